"""Per-rail loads of a RailS schedule, recomputed from its chunks for the tests' checks
(the schedule itself carries only the chunks: source, destination, rail, forwarder, landing GPU,
units).

Shape letters as in docs/architecture.md: V nodes, J rails per node, K chunks."""
from __future__ import annotations

import numpy as np


def _per_rail(sch, node_K) -> np.ndarray:
    V, J = sch.num_ranks // sch.topo.gpus_per_node, sch.topo.rails_per_node
    m = sch.inter
    out = np.zeros((V, J), dtype=np.int64)
    np.add.at(out, (node_K[m], sch.rail_K[m]), sch.units_K[m])
    return out


def rail_egress(sch) -> np.ndarray:
    """int64 [V, J]: units each node sends on each of its rails."""
    return _per_rail(sch, sch.topo.node_of(sch.src_K))


def rail_ingress(sch) -> np.ndarray:
    """int64 [V, J]: units each node receives on each of its rails."""
    return _per_rail(sch, sch.topo.node_of(sch.dst_K))
