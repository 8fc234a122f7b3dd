"""Flow-level model of all-to-all completion on a rail-optimized topology, for three routing schemes.

Shape legend:  D ranks (GPUs)   G ranks per node   V nodes   J rails per node   K chunks

Schemes, each built as a RailSchedule (chunks with src, dst, rail, fwd, land, units):
  direct  rail-matched with sender-side NVLink forwarding, as NCCL's PXN does: an inter-node message
          s -> d goes s --NVLink--> the GPU of s's node on rail(d) --rail(d)--> d. No receiver-side
          forwarding; a whole message rides one rail, the destination's.
  ecmp    hash-based multipath: each whole message on the rail picked by a deterministic hash of
          (s, d); NVLink forwarding on the sender side and on the receiver side where needed.
  rails   the RailS LPT spraying schedule (schedule.rails_schedule).
The forwarding GPU keeps the sender's position within its rail (`Topology.rail_gpu(node, rail, s)`),
the same convention in all three schemes; with one GPU per rail (every preset) it is simply the node's
GPU on that rail.

Resources, per direction: every node's NIC on every rail (egress, ingress) at `nic_gbps`; every GPU's
NVLink port (egress, ingress) at `nvlink_gbps`. A chunk uses: NVLink out of s and into fwd if fwd != s;
the NIC egress of (node(s), rail) and the NIC ingress of (node(d), rail); NVLink out of land and into d
if land != d. An intra-node message uses NVLink out of s and into d; a rank's message to itself moves
nothing. The GPU-NIC PCIe hop and the rail switches are not modeled (assumed non-blocking).

Model (fluid, pipelined): every resource drains its total load at line rate, all at once, and a
multi-hop path is pipelined (cut-through), so

    completion = max over resources (bytes / bandwidth) + latency_us x (hops of the longest path).

The max term is exactly the makespan of the fluid relaxation: giving every chunk the constant rate
bytes / t* (t* = the max term) never oversubscribes a resource, and no schedule can beat the busiest
resource. It is therefore what the routing allows, not what a congestion-controlled network
delivers: no incast, no head-of-line blocking, no max-min fair sharing, no store-and-forward delay.
`phased_us` is the store-and-forward alternative matching a three-phase implementation
(megatron_rails/runtime/comm/rails.py): phase 1 = intra-node messages and the s -> fwd hops, phase 2 =
the rails, phase 3 = the land -> d hops, each phase its own bottleneck plus one latency, in sequence.

Lower bound (scheme-independent, same model): max of
  - each node's inter-node bytes out (and in) spread perfectly over its J NICs;
  - each GPU's intra-node bytes out (in) over its NVLink port;
  - each GPU's total bytes out (in) over NVLink plus its own NIC, the only two ways off (onto) a GPU,
plus one latency. Every scheme's completion is >= this bound.

Bus bandwidth follows NCCL's all-to-all definition (nccl-tests PERFORMANCE.md): algbw = size / t with
size the per-rank data size, busbw = algbw x (D - 1) / D. For uneven traffic size is the MEAN per-rank
send size (total bytes / D, a rank's message to itself included, as nccl-tests counts it). `busbw_gbps` is
in Gb/s (the unit of the topology's bandwidths); `busbw_GBps` in GB/s (the unit nccl-tests prints).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..core.errors import InputError, is_integer
from ..core.rails_schedule import RailSchedule, rails_schedule
from ..core.topology import Topology, load_topology

SCHEMES = ("direct", "ecmp", "rails")


# -- schemes --------------------------------------------------------------------------------------------------

def _messages(traffic_DD, topo: Topology):
    traffic = np.asarray(traffic_DD)
    if traffic.ndim != 2 or traffic.shape[0] != traffic.shape[1]:
        raise ValueError(f"traffic_DD must be square [D, D], got shape {traffic.shape}")
    if traffic.size and (traffic.dtype.kind not in "iu" or traffic.min() < 0):
        raise ValueError("traffic_DD must hold non-negative integers")
    topo = topo.for_world(traffic.shape[0])
    s, d = np.nonzero(traffic)
    return topo, traffic.astype(np.int64), s, d, traffic[s, d].astype(np.int64)


def _one_rail(topo: Topology, traffic, s, d, u, rail_K, receiver_forwarding: bool) -> RailSchedule:
    """Every message whole on one rail (rail_K for inter-node ones: one chunk per message)."""
    inter = topo.node_of(s) != topo.node_of(d)
    rail = np.where(inter, rail_K, -1)
    fwd = np.where(inter & (topo.rail_of(s) != rail), topo.rail_gpu(topo.node_of(s), rail, s), s)
    fwd = np.where(inter, fwd, d)
    land = np.where(inter & (topo.rail_of(d) != rail), topo.rail_gpu(topo.node_of(d), rail, d), d)
    if not receiver_forwarding:
        assert np.array_equal(land, d)
    return RailSchedule.from_chunks(topo, traffic, s, d, rail, fwd, land, u)


def direct_schedule(traffic_DD, topo: Topology) -> RailSchedule:
    """Rail-matched (PXN-style): every inter-node message whole on the destination's rail."""
    topo, traffic, s, d, u = _messages(traffic_DD, topo)
    return _one_rail(topo, traffic, s, d, u, topo.rail_of(d), receiver_forwarding=False)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on uint64 (a fixed, platform-independent hash)."""
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def ecmp_rail(s, d, num_ranks: int, rails: int, seed: int = 0) -> np.ndarray:
    """The rail a hash of (s, d) picks: splitmix64(seed * D^2 + s * D + d) mod J."""
    key = (np.int64(seed) * num_ranks + np.asarray(s, np.int64)) * num_ranks + np.asarray(d, np.int64)
    with np.errstate(over="ignore"):
        h = _mix64(key.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15))
    return (h % np.uint64(rails)).astype(np.int64)


def ecmp_schedule(traffic_DD, topo: Topology, seed: int = 0) -> RailSchedule:
    """Hash-based multipath: every inter-node message whole on the rail hash(s, d) picks."""
    topo, traffic, s, d, u = _messages(traffic_DD, topo)
    return _one_rail(topo, traffic, s, d, u, ecmp_rail(s, d, traffic.shape[0], topo.rails_per_node, seed), True)


def build_schedule(scheme: str, traffic_DD, topo: Topology) -> RailSchedule:
    if scheme == "direct":
        return direct_schedule(traffic_DD, topo)
    if scheme == "ecmp":
        return ecmp_schedule(traffic_DD, topo)
    if scheme == "rails":
        return rails_schedule(traffic_DD, topo)
    raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")


# -- model ----------------------------------------------------------------------------------------------------

def _us(bytes_, gbps: float):
    """Microseconds to move `bytes_` at `gbps` Gb/s."""
    return np.asarray(bytes_, dtype=np.float64) * 8.0 / (gbps * 1e3)


@dataclass(frozen=True)
class Loads:
    """Bytes each resource carries under one schedule. nic_*_VJ: [V, J]; nvl_*_D: [D];
    phase*_: the same NVLink loads split into phase 1 (intra-node messages, s -> fwd) and phase 3."""

    nic_out_VJ: np.ndarray
    nic_in_VJ: np.ndarray
    nvl_out_D: np.ndarray
    nvl_in_D: np.ndarray
    ph1_out_D: np.ndarray
    ph1_in_D: np.ndarray
    ph3_out_D: np.ndarray
    ph3_in_D: np.ndarray
    hops: int             # hops of the longest chunk path (0: nothing moves)
    forwarded_bytes: int  # NVLink bytes of forwarding hops (s -> fwd, land -> d)


def resource_loads(sch: RailSchedule, bytes_per_unit: int = 1) -> Loads:
    """Per-resource byte loads of `sch` (units x bytes_per_unit)."""
    t, D = sch.topo, sch.num_ranks
    V, J = D // t.gpus_per_node, t.rails_per_node
    b = sch.units_K.astype(np.float64) * bytes_per_unit  # float64: exact below 2^53 bytes
    inter = sch.rail_K >= 0
    local = ~inter & (sch.src_K != sch.dst_K)
    hop1 = inter & (sch.fwd_K != sch.src_K)
    hop3 = inter & (sch.land_K != sch.dst_K)

    def bc(idx, m, n=D):
        return np.bincount(idx[m], weights=b[m], minlength=n)

    nic_out = bc(t.node_of(sch.src_K) * J + sch.rail_K, inter, V * J).reshape(V, J)
    nic_in = bc(t.node_of(sch.dst_K) * J + sch.rail_K, inter, V * J).reshape(V, J)
    ph1_out = bc(sch.src_K, local) + bc(sch.src_K, hop1)
    ph1_in = bc(sch.dst_K, local) + bc(sch.fwd_K, hop1)
    ph3_out, ph3_in = bc(sch.land_K, hop3), bc(sch.dst_K, hop3)
    hops = np.where(inter, 1 + hop1 + hop3, np.where(local, 1, 0))
    return Loads(nic_out, nic_in, ph1_out + ph3_out, ph1_in + ph3_in, ph1_out, ph1_in, ph3_out, ph3_in,
                 int(hops.max(initial=0)), int(b[hop1].sum() + b[hop3].sum()))


def _argmax_label(terms: dict) -> tuple[float, str]:
    name, arr = max(terms.items(), key=lambda kv: float(np.max(kv[1], initial=0.0)))
    arr = np.asarray(arr)
    if not arr.size:
        return 0.0, name
    at = np.unravel_index(int(np.argmax(arr)), arr.shape)
    return float(arr[at]), f"{name}[{','.join(map(str, at))}]"


def lower_bound_us(bytes_DD, topo: Topology) -> tuple[float, str]:
    """(the scheme-independent lower bound in us, which term binds); see the module docstring."""
    B = np.asarray(bytes_DD, dtype=np.float64)
    D = B.shape[0]
    t = topo.for_world(D)
    G, J, V = t.gpus_per_node, t.rails_per_node, t.nodes
    B = B.copy()
    np.fill_diagonal(B, 0.0)  # a rank's message to itself moves nothing
    same = (np.arange(D)[:, None] // G) == (np.arange(D)[None, :] // G)
    intra_out, intra_in = (B * same).sum(1), (B * same).sum(0)
    x_out, x_in = B.sum(1) - intra_out, B.sum(0) - intra_in
    node_out, node_in = x_out.reshape(V, G).sum(1), x_in.reshape(V, G).sum(1)
    both = t.nvlink_gbps + t.nic_gbps
    terms = {"nic_out_spread": _us(node_out / J, t.nic_gbps), "nic_in_spread": _us(node_in / J, t.nic_gbps),
             "nvlink_out_intra": _us(intra_out, t.nvlink_gbps), "nvlink_in_intra": _us(intra_in, t.nvlink_gbps),
             "gpu_out": _us(intra_out + x_out, both), "gpu_in": _us(intra_in + x_in, both)}
    val, which = _argmax_label(terms)
    return (val + t.latency_us if B.any() else 0.0), which


@dataclass(frozen=True)
class SimResult:
    scheme: str
    completion_us: float      # fluid, pipelined (the module docstring)
    phased_us: float          # store-and-forward in three phases
    lower_bound_us: float
    ratio_to_lb: float
    busbw_gbps: float         # Gb/s
    busbw_GBps: float         # GB/s, as nccl-tests prints it
    algbw_GBps: float
    bottleneck: str           # the resource that sets completion_us
    lb_term: str
    hops: int
    rail_max_over_mean: float       # busiest NIC port / mean NIC port (egress and ingress, all nodes)
    rail_node_max_over_mean: float  # worst node-direction: busiest rail / that node's mean rail
    nvlink_max_over_nic_max: float  # busiest NVLink port time / busiest NIC port time
    forwarded_frac: float           # NVLink forwarding bytes (both sides counted) / all bytes, 0..2
    total_bytes: int
    chunks: int

    def to_dict(self) -> dict:
        return asdict(self)


def simulate_schedule(sch: RailSchedule, scheme: str, bytes_per_unit: int = 1,
                      lower_bound: tuple[float, str] | None = None) -> SimResult:
    t, D = sch.topo, sch.num_ranks
    loads = resource_loads(sch, bytes_per_unit)
    nic_terms = {"nic_out": _us(loads.nic_out_VJ, t.nic_gbps), "nic_in": _us(loads.nic_in_VJ, t.nic_gbps)}
    nvl_terms = {"nvlink_out": _us(loads.nvl_out_D, t.nvlink_gbps),
                 "nvlink_in": _us(loads.nvl_in_D, t.nvlink_gbps)}
    busy, where = _argmax_label(nic_terms | nvl_terms)
    lat = t.latency_us
    completion = busy + lat * loads.hops

    def phase(*arrs_gbps):
        m = max((float(_us(a, g).max(initial=0.0)) for a, g in arrs_gbps), default=0.0)
        return m + lat if m > 0 else 0.0

    phased = (phase((loads.ph1_out_D, t.nvlink_gbps), (loads.ph1_in_D, t.nvlink_gbps))
              + phase((loads.nic_out_VJ, t.nic_gbps), (loads.nic_in_VJ, t.nic_gbps))
              + phase((loads.ph3_out_D, t.nvlink_gbps), (loads.ph3_in_D, t.nvlink_gbps)))
    total = int(sch.units_K.sum()) * bytes_per_unit
    lb, lb_term = lower_bound if lower_bound is not None else lower_bound_us(sch.traffic_DD * bytes_per_unit, t)
    size = total / D if D else 0.0
    algbw = size / (completion * 1e-6) / 1e9 if completion > 0 else 0.0  # GB/s
    busbw = algbw * (D - 1) / D if D else 0.0
    nic = np.concatenate([loads.nic_out_VJ.ravel(), loads.nic_in_VJ.ravel()])
    per_node = np.concatenate([loads.nic_out_VJ, loads.nic_in_VJ])
    node_mean = per_node.mean(axis=1)
    ok = node_mean > 0
    nic_max = float(np.max(_us(nic, t.nic_gbps), initial=0.0))
    nvl_max = float(max(np.max(_us(loads.nvl_out_D, t.nvlink_gbps), initial=0.0),
                        np.max(_us(loads.nvl_in_D, t.nvlink_gbps), initial=0.0)))
    return SimResult(
        scheme=scheme, completion_us=completion, phased_us=phased, lower_bound_us=lb,
        ratio_to_lb=completion / lb if lb > 0 else 1.0, busbw_gbps=busbw * 8, busbw_GBps=busbw,
        algbw_GBps=algbw, bottleneck=where, lb_term=lb_term, hops=loads.hops,
        rail_max_over_mean=float(nic.max() / nic.mean()) if nic.size and nic.mean() > 0 else 1.0,
        rail_node_max_over_mean=float((per_node[ok].max(axis=1) / node_mean[ok]).max()) if ok.any() else 1.0,
        nvlink_max_over_nic_max=nvl_max / nic_max if nic_max > 0 else 0.0,
        forwarded_frac=loads.forwarded_bytes / total if total else 0.0, total_bytes=total,
        chunks=int(sch.units_K.size))


def simulate(traffic_DD, topo: Topology, bytes_per_unit: int = 1, schemes=SCHEMES) -> list[SimResult]:
    """Simulate `traffic_DD` (int [D, D], units of `bytes_per_unit` bytes) under each scheme.

    The schedules are built on the units (token rows), as the real all-to-all schedules rows."""
    traffic = np.asarray(traffic_DD)
    if isinstance(schemes, str):  # one scheme by name
        schemes = (schemes,)
    unknown = [str(x) for x in schemes if x not in SCHEMES]
    if unknown or not schemes:
        raise InputError(f"schemes: unknown {', '.join(unknown) or 'none given'}; choose from {', '.join(SCHEMES)}")
    if not is_integer(bytes_per_unit) or bytes_per_unit < 1:
        raise InputError(f"bytes_per_unit must be a positive integer, got {bytes_per_unit!r}")
    topo = load_topology(topo).for_world(traffic.shape[0] if traffic.ndim else 0)
    lb = lower_bound_us(traffic.astype(np.float64) * bytes_per_unit, topo)
    return [simulate_schedule(build_schedule(s, traffic, topo), s, bytes_per_unit, lb) for s in schemes]
