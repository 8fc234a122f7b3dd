"""The exchanges every token and weight all-to-all goes through (gloo on CPU, NCCL on GPU),
autograd-aware. One interface, two backends:

    backend.exchange(x, send_D, recv_D, traffic_DD=None) -> rows received, in source-rank order
    backend.sprays(traffic_DD) -> whether that exchange takes RailS's multi-phase path

`direct.DirectAllToAll` (`comm: direct`) is one `all_to_all_single`; `rails.RailsAllToAll` (`comm:
rails`) runs the RailS schedule as three all-to-alls over node and rail sub-groups. Everywhere in
this package the send side comes before the receive side in argument lists.
"""
from __future__ import annotations

import torch.distributed as dist

from ...core.policy import ConfigError
from ...core.topology import Topology
from .base import CommError, all_gather_counts, collective_device, group_timeout
from .direct import DirectAllToAll, all_to_all
from .rails import RailsAllToAll

__all__ = ["CommError", "DirectAllToAll", "RailsAllToAll", "all_gather_counts", "all_to_all", "collective_device",
           "group_timeout", "make_comm"]


def make_comm(pcfg, group, node_size: int | None = None):
    """The communication backend a policy config asks for, on the EP process group; node_size: G
    (default: the policy's ranks_per_node, 0 = all ranks of the group on one node)."""
    if pcfg.comm == "direct":
        return DirectAllToAll(group)
    D = dist.get_world_size(group)
    G = node_size if node_size else pcfg.node_size(D)
    if D % G:
        raise ConfigError(f"comm: rails needs ranks_per_node ({G}) to divide the expert-parallel size ({D})")
    if G >= D:  # one node: no traffic crosses a rail, so RailS would send the direct exchange anyway
        return DirectAllToAll(group)
    return RailsAllToAll(group, Topology(name="ep-group", gpus_per_node=G, rails_per_node=G),
                         tolerance=float(pcfg.rails_tolerance))
