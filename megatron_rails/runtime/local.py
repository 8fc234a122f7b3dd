"""A rank's local token work in one MoE layer step, given the plan: which token-expert pairs go
where (send order) and how each token's expert outputs come back together (combine); the received
rows' grouping by slot is runtime/receive.py's. Plain torch ops are the reference and CI's path;
on CUDA two Triton kernels (runtime/local_triton.py) make the send order and the combine's sum.
The plan's tables are numpy on the host, the Triton path's compiled where built (core/_route_c.c).

Shape letters: docs/architecture.md (glossary). Here T local tokens, E experts, D EP ranks, S slots
per rank, P token-expert pairs this rank sends, H hidden size, M route entries.
"""
from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..core.compiled import compiled
from .receive import Runs, grouping, receive_order, receive_order_host
from .staging import host_rows, permutation_and_inverse, segment_order


@dataclass
class SendOrder:
    """This rank's token-expert pairs in send order (by destination rank, then slot there; token
    order kept within a slot), as order_pairs computes them."""
    token_P: torch.Tensor  # the token of every pair (on the routing map's device)
    probs_P: torch.Tensor  # its routing prob
    send_D: list  # all-to-all split sizes out
    recv_D: list  # and in
    # int64 [k*T], when every token has k pairs: the send position of token t's j-th pair (experts
    # ascending) at j * T + t
    by_token: Optional[torch.Tensor]
    k: int
    runs: "_RunsOfPairs"  # the pairs' destinations, by run (host)
    receive: Optional[tuple] = None  # receive_order's result, when asked for with the send order

    @functools.cached_property
    def dest_P(self) -> np.ndarray:
        """int64 [P] (host): the destination EP rank of every pair (made when first asked for)."""
        return self.runs.expand("dest")

    @functools.cached_property
    def slot_P(self) -> np.ndarray:
        """int64 [P] (host): its slot there."""
        return self.runs.expand("slot")


@dataclass
class _RunsOfPairs:
    """The send order's runs (int64 [M] each, in send order): destination rank, slot, pairs; their
    per-pair expansion is made only for the paths that need it (dedup)."""
    dest_M: np.ndarray
    slot_M: np.ndarray
    n_M: np.ndarray

    def expand(self, what: str) -> np.ndarray:
        return np.repeat(self.dest_M if what == "dest" else self.slot_M, self.n_M)


def pairs_per_token_range(routing_map: torch.Tensor) -> torch.Tensor:
    """int64 [2] on the map's device: (min, max) pairs per token, [0, 0] without tokens. Queued
    with the token counts' all-gather so that the send order needs no sync of its own."""
    if routing_map.shape[0] == 0:
        return torch.zeros(2, dtype=torch.int64, device=routing_map.device)
    return torch.stack(torch.aminmax(routing_map.sum(dim=1))).to(torch.int64)


def _runs(plan, me: int) -> tuple:
    """This rank's route row, host side: (runs in send order (int64 [M] positions into the row),
    tokens per run in row order (int64 [M]), destination rank, slot and expert of every run (int64
    [M] each)).
    The row lists this rank's replicas in (expert, rank) order, one run of pairs each, and those
    runs cut the stock (expert-major, token-minor) pair stream in turn; sending by (destination,
    slot), token order kept, is a stable reorder of the runs."""
    p = plan.placement
    ptr, rep_M, tok_M = plan.route
    row = slice(ptr[me], ptr[me + 1])
    rep = rep_M[row]
    dest, slot = p.replica_rank_R[rep], p.replica_slot_R[rep]
    runs = np.argsort(dest * p.slots_per_rank + slot, kind="stable")
    return runs, np.asarray(tok_M[row], dtype=np.int64), dest, slot, p.replica_expert_R[rep]


def _by_token(routing_map: torch.Tensor, pos_TE: torch.Tensor, k: int, sync_free: bool) -> torch.Tensor:
    """int64 [k*T], k-major: the send position of token t's j-th pair (its experts in ascending
    order) at j * T + t, from pos_TE (int64 [T, E]: send positions where routed); every token has
    k pairs. sync_free: by a top-k over expert ids and a gather (no device sync), else by
    masked_select (fewer ops; syncs a GPU for its size); at k == E every row whole."""
    T, E = routing_map.shape
    if k == E:
        return pos_TE.T.reshape(-1)
    if not sync_free:
        return pos_TE.masked_select(routing_map).view(T, k).T.reshape(-1)
    # the k smallest of (expert where routed, else E) are a token's experts, ascending
    key_TE = torch.where(routing_map, _expert_ids(E, routing_map.device), E)
    e_Tk = key_TE.topk(k, dim=1, largest=False, sorted=True).indices
    return pos_TE.gather(1, e_Tk).T.reshape(-1)


_EXPERT_IDS: dict = {}  # (E, device) -> int32 [E]: 0 .. E-1 (a constant per shape)


def _expert_ids(E: int, dev) -> torch.Tensor:
    key = (E, str(dev))
    if key not in _EXPERT_IDS:
        _EXPERT_IDS[key] = torch.arange(E, dtype=torch.int32, device=dev)
    return _EXPERT_IDS[key]


def _assemble(plan, me: int, runs_of_me: tuple, token_P, probs_P, by_token, T: int) -> SendOrder:
    """The SendOrder of pairs in send order (token_P, probs_P on the device; by_token: _by_token's
    table or None); runs_of_me: _runs(plan, me)."""
    runs, n_M, dest, slot = runs_of_me[:4]
    k = int(n_M.sum()) // T if T else 0
    send_D = np.bincount(dest, weights=n_M, minlength=plan.send_DD.shape[0]).astype(np.int64).tolist()
    return SendOrder(token_P, probs_P, send_D, plan.send_DD[:, me].tolist(), by_token, k,
                     _RunsOfPairs(dest[runs], slot[runs], n_M[runs]))


def _send_order(plan, me: int, runs_of_me: tuple, flat_P, routing_map, probs, uniform: bool,
                pos_ET=None) -> SendOrder:
    """The SendOrder of pairs already in send order, given as flat_P (int64 [P] on the device:
    token * E + expert, an index into the [T, E] map); runs_of_me: _runs(plan, me).
    uniform: every token has the same number k of pairs (top-k routing without drops): the combine
    then sums each token's k outputs as a [k, T, H] reduction instead of scattered adds, and the
    dispatch's backward likewise (by_token, _by_token's table; pos_ET: the send positions, [E, T],
    where the caller has them)."""
    T, E = routing_map.shape
    P = flat_P.numel()
    k = P // T if T else 0
    by_token = None
    if k and uniform:
        if pos_ET is None:
            pos_TE = torch.full((T * E,), P, dtype=torch.int64, device=flat_P.device)
            pos_TE[flat_P] = torch.arange(P, device=flat_P.device)
            pos_TE = pos_TE.view(T, E)
        else:
            pos_TE = pos_ET.T
        by_token = _by_token(routing_map, pos_TE, k, sync_free=pos_ET is not None)
    return _assemble(plan, me, runs_of_me, torch.div(flat_P, E, rounding_mode="floor"), _pair_probs(probs, flat_P),
                     by_token, T)


def _pair_probs(probs: torch.Tensor, flat_P: torch.Tensor) -> torch.Tensor:
    """[P]: the routing prob of every pair (flat_P: token * E + expert). Differentiable: the router's
    gradient comes back through it (advanced indexing: a sorted, deterministic accumulation)."""
    if probs.requires_grad and torch.is_grad_enabled():
        return probs.reshape(-1)[flat_P]
    return probs.reshape(-1).index_select(0, flat_P)


def order_pairs(plan, me: int, routing_map: torch.Tensor, probs: torch.Tensor,
                uniform: Optional[bool] = None) -> SendOrder:
    """Rank `me`'s token-expert pairs (routing_map bool [T, E], probs [T, E]) in the plan's send
    order, the order made on the host: the stock pair stream (nonzero: a device sync), reordered by
    a host-made permutation copied over. uniform: whether every token has the same number of pairs
    (pairs_per_token_range; None: found here, another sync)."""
    T, E = routing_map.shape
    lo_hi = pairs_per_token_range(routing_map) if uniform is None else None  # queued before nonzero's sync
    e_P, t_P = routing_map.T.nonzero(as_tuple=True)
    runs_of_me = _runs(plan, me)
    runs, n_M = runs_of_me[:2]
    order = torch.from_numpy(segment_order(n_M, runs)).to(routing_map.device)
    if uniform is None:
        lo, hi = lo_hi.tolist()
        uniform = lo == hi
    return _send_order(plan, me, runs_of_me, (t_P * E + e_P)[order], routing_map, probs, uniform)


_FLAT_TE: dict = {}  # (T, E, device) -> int64 [E*T]: t*E + e in (e, t) order (a constant per shape)


def _flat_te_in_et_order(T: int, E: int, dev) -> torch.Tensor:
    key = (T, E, str(dev))
    if key not in _FLAT_TE:
        if len(_FLAT_TE) >= 4:  # token counts vary (last batch, inference): keep a few ([T*E] int64 each)
            _FLAT_TE.clear()
        _FLAT_TE[key] = torch.arange(T * E, device=dev).view(T, E).T.reshape(-1)
    return _FLAT_TE[key]


def order_pairs_on_device(plan, me: int, routing_map: torch.Tensor, probs: torch.Tensor,
                          uniform: bool) -> SendOrder:
    """order_pairs with the order made on the map's device and no device sync, in few kernels: a
    running count over the map taken expert-major is each routed pair's place (+1) in the stock
    stream; a search in the runs' ends gives its run, the run's shift its send position, and one
    scatter of every (token, expert)'s flat index puts the pairs in send order. The per-plan table
    (two int64 [M]: run ends in the stream, send start minus stream start minus 1) is the only
    copy, non-blocking from pinned memory on CUDA. Same result as order_pairs, tensor for tensor."""
    dev = routing_map.device
    T, E = routing_map.shape
    runs_of_me = _runs(plan, me)
    runs, n_M = runs_of_me[:2]
    P = int(n_M.sum())
    if P == 0:
        none = torch.zeros(0, dtype=torch.int64, device=dev)
        return _send_order(plan, me, runs_of_me, none, routing_map, probs, uniform)
    table = host_rows(n_M.size, dev)
    end_M, shift_M = table.numpy()
    np.cumsum(n_M, out=end_M)  # run ends in the stream (exclusive)
    shift_M[runs] = np.cumsum(n_M[runs]) - n_M[runs]  # send start of every run ...
    shift_M -= end_M - n_M + 1  # ... minus its stream start, minus 1 (count is place + 1)
    end_M, shift_M = table.to(dev, non_blocking=True).unbind(0)
    routed_F = routing_map.T.contiguous().view(-1)  # F = E*T flat, expert-major: the stock stream's order
    count_F = routed_F.cumsum(0)  # int64: a routed pair's place in the stock stream, plus one
    # its run: the first whose end (exclusive) reaches count (count <= P = the last end: in range)
    pos_F = torch.where(routed_F, count_F + shift_M[torch.searchsorted(end_M, count_F)], P)  # P: a dump row
    flat_P = torch.empty(P + 1, dtype=torch.int64, device=dev).scatter_(0, pos_F, _flat_te_in_et_order(T, E, dev))
    return _send_order(plan, me, runs_of_me, flat_P[:P], routing_map, probs, uniform, pos_F.view(E, T))


def order_pairs_triton(plan, me: int, routing_map: torch.Tensor, probs: torch.Tensor, uniform: bool,
                       receive: bool = False) -> SendOrder:
    """order_pairs_on_device in two kernels (runtime/local_triton.py): the same tensors. The per-plan
    table (int64 [E+1+3M]) is the only copy, non-blocking from pinned memory on CUDA; its host side
    compiled where built (core/_route_c.c rank_tables), else numpy. receive: the receive order
    (receive_order's result, as .receive) too."""
    from . import local_triton

    dev = routing_map.device
    T, E = routing_map.shape
    t = _host_tables(plan, me, E, dev, receive)
    if t.P == 0:
        none = torch.zeros(0, dtype=torch.int64, device=dev)
        so = _send_order(plan, me, _runs(plan, me), none, routing_map, probs, uniform)
    else:
        on_dev = t.staged.to(dev, non_blocking=True)
        k = t.P // T if uniform else 0
        token_P, flat_P, by_token = local_triton.send_order_tensors(routing_map, on_dev, t.M, t.runs_max, t.P, k)
        so = SendOrder(token_P, _pair_probs(probs, flat_P), t.send_D, plan.send_DD[:, me].tolist(), by_token,
                       t.P // T if T else 0, t.pairs)
    if receive:
        order, per_slot = t.receive
        if order is None or isinstance(order, Runs):
            so.receive = (order, None if order is None else order.inverse(), per_slot)
        else:  # many runs: a permutation, copied on its own
            so.receive = (*permutation_and_inverse(order, dev), per_slot)
    return so


@dataclass
class _HostTables:
    """The host side of the Triton send order: the per-plan table staged for the device (int64
    [E+1+3M]: first run of every expert, then per run its first and past-last place among its
    expert's pairs and its send position minus that first place), M runs, the most runs of one
    expert, P pairs, the split sizes out, the runs in send order, and receive_order_host's result
    (or None)."""
    staged: torch.Tensor
    M: int
    runs_max: int
    P: int
    send_D: list
    pairs: _RunsOfPairs
    receive: Optional[tuple]


_RANK_TABLES = compiled("megatron_rails.core._route_c", "rank_tables")  # the compiled host side, where built


def _host_tables(plan, me: int, E: int, dev, receive: bool) -> _HostTables:
    if _RANK_TABLES is None:
        return _host_tables_numpy(plan, me, E, dev, receive)
    p = plan.placement
    ptr, rep_M, tok_M = plan.route
    D, S, M, Mt = p.num_ranks, p.slots_per_rank, int(ptr[me + 1] - ptr[me]), rep_M.size
    staged = host_rows(E + 1 + 3 * M, dev, rows=1)[0]
    out = np.empty(3 * M + D + S + 2 * Mt, dtype=np.int64)
    a, b, c = 3 * M, 3 * M + D, 3 * M + D + S
    runs_max, n_recv, grouped = _RANK_TABLES(ptr, rep_M, tok_M, p.replica_rank_R, p.replica_slot_R,
                                             p.replica_expert_R, D, E, S, me, staged.numpy(), out[:a], out[a:b],
                                             out[b:c], out[c:c + Mt], out[c + Mt:])
    order = None
    if receive and not grouped:
        order = grouping(out[c:c + n_recv], out[c + Mt:c + Mt + n_recv])
    send_D = out[a:b].tolist()
    return _HostTables(staged, M, runs_max, sum(send_D), send_D, _RunsOfPairs(out[:M], out[M:2 * M], out[2 * M:a]),
                       (order, out[b:c]) if receive else None)


def _host_tables_numpy(plan, me: int, E: int, dev, receive: bool) -> _HostTables:
    """_host_tables in numpy (where the compiled tables are not built): the definition."""
    runs, n_M, dest, slot, expert_M = _runs(plan, me)
    M = n_M.size
    staged = host_rows(E + 1 + 3 * M, dev, rows=1)[0]
    first_E, lo_M, hi_M, base_M = np.split(staged.numpy(), [E + 1, E + 1 + M, E + 1 + 2 * M])
    first_E[:] = np.searchsorted(expert_M, np.arange(E + 1))  # the row is in (expert, rank) order
    end_M = np.cumsum(n_M)
    start_M = end_M - n_M  # in the stock stream; minus the expert's start: the place among its pairs
    lo_M[:] = start_M - start_M[first_E[expert_M]]
    hi_M[:] = lo_M + n_M
    base_M[runs] = np.cumsum(n_M[runs]) - n_M[runs]  # send start of every run ...
    base_M -= lo_M  # ... minus its first place
    send_D = np.bincount(dest, weights=n_M, minlength=plan.send_DD.shape[0]).astype(np.int64).tolist()
    return _HostTables(staged, M, int(np.diff(first_E).max()) if M else 0, int(n_M.sum()), send_D,
                       _RunsOfPairs(dest[runs], slot[runs], n_M[runs]),
                       receive_order_host(plan, me) if receive else None)


def sum_pairs(y_P: torch.Tensor, so: SendOrder, T: int) -> torch.Tensor:
    """[T, H]: every token's returned expert outputs summed (rows of y_P in send order)."""
    if so.by_token is not None:
        return _SumPairs.apply(y_P, so.by_token, so.token_P, so.k)
    return y_P.new_zeros((T, y_P.shape[-1])).index_add(0, so.token_P, y_P)


def token_rows(x_TH: torch.Tensor, so: SendOrder) -> torch.Tensor:
    """[P, H]: every pair's token row, in send order. Its backward sums every token's k pair
    gradients as sum_pairs does (a [k, T, H] reduction) where every token has k pairs."""
    if not (x_TH.requires_grad and torch.is_grad_enabled()):
        return x_TH.index_select(0, so.token_P)
    if so.by_token is not None:
        return _TokenRows.apply(x_TH, so.token_P, so.by_token, so.k)
    return x_TH[so.token_P]  # its backward: a sorted, deterministic accumulation


def _gather_sum(y_P: torch.Tensor, by_token: torch.Tensor, k: int) -> torch.Tensor:
    """[T, H]: sum over j of y_P[by_token[j * T + t]] (k-major table). On the Triton path (CUDA,
    k <= 2) one kernel, bit-identical; else one gather, then a sum over the outermost dim, which
    reads rows whole."""
    if k > 1 and _fused_sum(y_P, k):
        from .local_triton import gather_sum

        out = _on_triton(lambda: gather_sum(y_P, by_token, k), "gather-sum")
        if out is not None:
            return out
    g = y_P.index_select(0, by_token)
    return g if k == 1 else g.view(k, by_token.numel() // k, *y_P.shape[1:]).sum(0)


def _fused_sum(y_P: torch.Tensor, k: int) -> bool:
    """Whether the combine's gather-sum takes the Triton kernel: the send order's path is Triton
    for this device (send_order_path) and the kernel serves this dtype, layout and k."""
    if send_order_path(y_P) != "triton":
        return False
    from .local_triton import gather_sum_fits

    return gather_sum_fits(y_P, k)


class _SumPairs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_P, by_token, token_P, k):
        ctx.token_P = token_P
        return _gather_sum(y_P, by_token, k)

    @staticmethod
    def backward(ctx, grad_TH):  # each pair's row gets its token's gradient: a gather, no scatter-add
        return grad_TH.index_select(0, ctx.token_P), None, None, None


class _TokenRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, token_P, by_token, k):
        ctx.by_token, ctx.k = by_token, k
        return x_TH.index_select(0, token_P)

    @staticmethod
    def backward(ctx, grad_P):
        return _gather_sum(grad_P, ctx.by_token, ctx.k), None, None, None


SEND_ORDER_ENV = "MEGATRON_RAILS_SEND_ORDER"  # auto, triton, device, host


_TRITON_BROKEN: list = []  # the error, once the Triton kernel failed to build or launch here


def _on_triton(run, what: str):
    """run() on the Triton path, or None where its kernel could not be built or launched here: in
    auto mode that is said once and torch ops take over; asked for by name, the error itself."""
    from .local_triton import KernelUnavailable

    try:
        return run()
    except KernelUnavailable as err:
        if os.environ.get(SEND_ORDER_ENV, "auto") != "auto":
            raise err.__cause__ from None
        _triton_failed(err.__cause__, what)
        return None


def _triton_failed(err: Exception, what: str) -> None:
    """A Triton kernel's first launch failed (no compiler for this GPU, a driver mismatch): warn
    once and leave the send order and the combine's sum to torch ops from then on."""
    _TRITON_BROKEN.append(err)
    first = str(err).splitlines()[0] if str(err) else ""
    warnings.warn(f"megatron-rails: the Triton {what} kernel failed on first use ({type(err).__name__}: "
                  f"{first}); the send order and the combine's sum are made by torch ops instead (slower; "
                  f"{SEND_ORDER_ENV}=device says so explicitly)", RuntimeWarning, stacklevel=3)


def send_order_path(routing_map: torch.Tensor) -> str:
    """Which path send_order takes for this map (a tensor on the device in question): triton,
    device or host. The combine's gather-sum follows it (Triton's kernel on the triton path)."""
    how = os.environ.get(SEND_ORDER_ENV, "auto")
    if how not in ("auto", "triton", "device", "host"):
        raise ValueError(f"{SEND_ORDER_ENV}={how!r}: expected auto, triton, device or host")
    if how == "auto":
        if not routing_map.is_cuda:
            return "host"
        from . import local_triton

        return "triton" if local_triton.available() and not _TRITON_BROKEN else "device"
    return how


def send_order(plan, me: int, routing_map: torch.Tensor, probs: torch.Tensor, uniform: bool,
               receive: bool = False) -> SendOrder:
    """The dispatcher's send order: for CUDA maps made on the device with no sync (one Triton kernel
    where Triton is importable, else torch ops), for CPU ones on the host (cheaper there; no device
    to wait for). $MEGATRON_RAILS_SEND_ORDER=triton / device / host forces one path (tests run the
    device paths on CPU this way, Triton's under its interpreter). receive: receive_order's result
    too, as .receive (on the Triton path in the same host-to-device copy)."""
    how = send_order_path(routing_map)
    if how == "triton":
        so = _on_triton(lambda: order_pairs_triton(plan, me, routing_map, probs, uniform, receive), "send-order")
        if so is not None:
            return so
        how = "device"
    if how == "device":
        so = order_pairs_on_device(plan, me, routing_map, probs, uniform)
    else:
        so = order_pairs(plan, me, routing_map, probs, uniform)
    if receive:
        so.receive = receive_order(plan, me, routing_map.device)
    return so
