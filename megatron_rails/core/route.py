"""Token routes from per-replica quotas: which source rank sends how many tokens to which replica.

Given the tokens every replica must compute (quota_R), tokens of an expert are matched to its replicas
in two phases: first inside every node (as much as the node's own supply and quota allow), then the
remainder across nodes. The tokens crossing nodes are then sum over (expert, node) of
max(0, supply - quota), the minimum any route with these quotas can reach. Both phases are a
north-west-corner matching of two ordered streams with equal totals, so every expert's split has at
most (sources + replicas) entries and the whole computation is a handful of vectorized passes.

Legend: D ranks, E experts, R replicas, M route entries, G ranks per node; `multi`: the experts split over
two or more replicas (n_multi of them).
"""
from __future__ import annotations

import numpy as np

from .compiled import compiled as find_compiled
from .errors import PlanError


def nw_corner(a: np.ndarray, b: np.ndarray):
    """Match supply a[i] to demand b[j] (int64, equal totals) in order.

    Returns (i, j, amount) int64 arrays with amount > 0, ordered by position in the streams.
    """
    A, B = np.cumsum(a), np.cumsum(b)
    if A.size == 0 or A[-1] == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z
    cuts = np.union1d(A, B)
    cuts = cuts[cuts > 0]
    amount = np.diff(cuts, prepend=0)
    # segment (cuts[k-1], cuts[k]] lies in the first supply (demand) entry whose cumulative sum reaches cuts[k]
    return np.searchsorted(A, cuts, "left"), np.searchsorted(B, cuts, "left"), amount


def _local_part(x: np.ndarray, group: np.ndarray, cap_groups: np.ndarray) -> np.ndarray:
    """Per element, the share of x that fits under its group's cap when filled in order."""
    before = np.cumsum(x) - x
    group_start = np.cumsum(np.bincount(group, weights=x, minlength=cap_groups.size).astype(np.int64))
    group_start = np.r_[0, group_start[:-1]]
    return np.clip(cap_groups[group] - (before - group_start[group]), 0, x)


def split_by_quota(counts_DE: np.ndarray, placement, quota_R) -> tuple[np.ndarray, ...]:
    """Route counts_DE (int64 [D, E]) so that replica r receives quota_R[r] tokens.

    Returns (src_M, rep_M, tok_M) int64 triples (unsorted, positive). PlanError if a quota is
    negative or an expert's quotas do not sum to its tokens.
    """
    p = placement
    D, E = counts_DE.shape
    quota = np.asarray(quota_R, dtype=np.int64)
    if quota.shape != (p.num_replicas,):
        raise PlanError(f"quota_R has shape {quota.shape}, expected ({p.num_replicas},) (one per replica)")
    if quota.size and quota.min() < 0:
        raise PlanError(f"replica {int(np.argmin(quota))} has a negative quota {quota.min()}")
    load_E = counts_DE.sum(axis=0)
    quota_E = np.zeros(E, dtype=np.int64)
    np.add.at(quota_E, p.replica_expert_R, quota)
    if not np.array_equal(quota_E, load_E):
        e = int(np.flatnonzero(quota_E != load_E)[0])
        raise PlanError(f"expert {e}: replica quotas sum to {quota_E[e]} but it has {load_E[e]} tokens")

    pos = np.flatnonzero(quota > 0)
    n_pos_E = np.bincount(p.replica_expert_R[pos], minlength=E)
    # experts served by exactly one replica: every source sends its whole count there
    single_rep = pos[n_pos_E[p.replica_expert_R[pos]] == 1]
    rep_of_E = np.full(E, -1, dtype=np.int64)
    rep_of_E[p.replica_expert_R[single_rep]] = single_rep
    cols = p.replica_expert_R[single_rep]
    sub = counts_DE[:, cols]
    d1, j1 = np.nonzero(sub)
    parts = [(d1, single_rep[j1], sub[d1, j1])]

    multi = np.flatnonzero(n_pos_E >= 2)
    if multi.size:
        G = p.ranks_per_node
        n_nodes = D // G
        n_multi = multi.size
        # supply stream ordered by (expert, source rank); demand by (expert, replica rank)
        a = np.ascontiguousarray(counts_DE[:, multi].T).ravel()
        a_src = np.tile(np.arange(D, dtype=np.int64), n_multi)
        a_grp = np.repeat(np.arange(n_multi, dtype=np.int64), D) * n_nodes + a_src // G
        dem = pos[n_pos_E[p.replica_expert_R[pos]] >= 2]
        b = quota[dem]
        multi_idx_E = np.full(E, -1, dtype=np.int64)
        multi_idx_E[multi] = np.arange(n_multi)
        b_grp = multi_idx_E[p.replica_expert_R[dem]] * n_nodes + p.replica_rank_R[dem] // G
        cap = np.minimum(np.bincount(a_grp, weights=a, minlength=n_multi * n_nodes),
                         np.bincount(b_grp, weights=b, minlength=n_multi * n_nodes)).astype(np.int64)
        a_loc, b_loc = _local_part(a, a_grp, cap), _local_part(b, b_grp, cap)
        for sa, sb in ((a_loc, b_loc), (a - a_loc, b - b_loc)):
            i, j, amt = nw_corner(sa, sb)
            parts.append((a_src[i], dem[j], amt))
    src, rep, tok = (np.concatenate(x) for x in zip(*parts))
    return src, rep, tok


_KERNEL = find_compiled("megatron_rails.core._route_c", "route_csr")  # None: the Python definition below


def route_csr(counts_DE: np.ndarray, placement, quota_R, compiled: bool = True) -> tuple[np.ndarray, ...]:
    """The route of `split_by_quota` as `to_csr` gives it: (indptr int64 [D+1], rep int64 [M], tok
    int64 [M]), read-only; PlanError where the quotas do not fit the counts. Compiled where built
    (`_route_c.c`: the same entries; compiled=False forces Python). In Python, where every expert's
    tokens go to one replica (stock layouts, and every plan that splits no expert) the CSR is read
    off the counts directly: each source sends an expert's whole count to its one replica."""
    return route_and_sends(counts_DE, placement, quota_R, compiled)[0]


def route_and_sends(counts_DE: np.ndarray, placement, quota_R, compiled: bool = True) -> tuple:
    """(route_csr's route, send_DD int64 [D, D] read-only: tokens rank i sends to rank j, from the
    compiled route in the same pass; None where the route came from Python)."""
    p = placement
    # no conversion calls where none is needed: on the cold caches between a step's plans each
    # numpy call costs microseconds (scripts/profile_local.py --plan-only --cold)
    quota = quota_R if _int64_c(quota_R) else np.ascontiguousarray(quota_R, dtype=np.int64)
    D, E = counts_DE.shape
    R = p.num_replicas
    if compiled and _KERNEL is not None and quota.shape == (R,) and R and p.num_ranks == D:
        cap = 3 * D * E + 2 * R
        ptr, rep, tok, send_DD = (np.empty(D + 1, dtype=np.int64), np.empty(cap, dtype=np.int64),
                                  np.empty(cap, dtype=np.int64), np.empty((D, D), dtype=np.int64))
        counts = counts_DE if _int64_c(counts_DE) else np.ascontiguousarray(counts_DE, dtype=np.int64)
        M = _KERNEL(counts, p.replica_expert_R, p.replica_rank_R, quota, D, E, R, p.ranks_per_node, ptr, rep, tok,
                    send_DD)
        if M >= 0:  # else the quotas do not fit the counts: the Python path below says how
            for a in (ptr, rep, tok, send_DD):
                a.flags.writeable = False
            # the entries as views of the worst-case buffers where those are small, else copies
            # (at EP 1024 x E 256 each buffer is 6 MB, kept as long as the plan is)
            if cap <= _KEEP_CAPACITY:
                rep, tok = rep[:M], tok[:M]
            else:
                rep, tok = rep[:M].copy(), tok[:M].copy()
                rep.flags.writeable = tok.flags.writeable = False
            return (ptr, rep, tok), send_DD
    return _route_python(counts_DE, p, quota), None


_KEEP_CAPACITY = 4096  # route buffers up to 32 KiB each stay with the plan


def _int64_c(a) -> bool:
    """Whether `a` is an int64 C-contiguous ndarray already."""
    return type(a) is np.ndarray and a.dtype == np.int64 and a.flags.c_contiguous


def _route_python(counts_DE: np.ndarray, p, quota: np.ndarray) -> tuple[np.ndarray, ...]:
    R = p.num_replicas
    if quota.shape == (R,) and quota.min(initial=0) >= 0:
        pos = np.flatnonzero(quota)
        e_pos = p.replica_expert_R[pos]  # ascending: replicas are numbered in (expert, rank) order
        load_E = counts_DE.sum(axis=0)
        # one replica per loaded expert, with its whole load (else the general path, which also
        # says what is wrong with quotas that do not match the counts)
        if (not np.count_nonzero(e_pos[1:] == e_pos[:-1]) and np.array_equal(quota[pos], load_E[e_pos])
                and int(load_E.sum()) == int(quota.sum())):
            sub = counts_DE[:, e_pos]
            d, j = np.nonzero(sub)  # row-major: sorted by (source, replica), as to_csr orders them
            ptr = np.zeros(counts_DE.shape[0] + 1, dtype=np.int64)
            np.cumsum(np.bincount(d, minlength=counts_DE.shape[0]), out=ptr[1:])
            out = (ptr, pos[j], sub[d, j])
            for a in out:
                a.flags.writeable = False
            return out
    src, rep, tok = split_by_quota(counts_DE, p, quota)
    return to_csr(p.num_ranks, max(p.num_replicas, 1), src, rep, tok)


def to_csr(num_ranks: int, num_replicas: int, src_M, rep_M, tok_M):
    """Canonical CSR of (source, replica, tokens) triples: sorted by (source, replica), duplicates
    summed, zeros dropped. Returns (indptr int64 [D+1], rep int64 [M], tok int64 [M])."""
    keep = tok_M > 0
    key = src_M[keep] * num_replicas + rep_M[keep]
    tok = tok_M[keep]
    order = np.argsort(key, kind="stable")
    key, tok = key[order], tok[order]
    if key.size:
        start = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
        tok = np.add.reduceat(tok, start)
        key = key[start]
    ptr = np.zeros(num_ranks + 1, dtype=np.int64)
    np.cumsum(np.bincount(key // num_replicas, minlength=num_ranks), out=ptr[1:])
    out = (ptr, key % num_replicas, tok)
    for a in out:
        a.flags.writeable = False
    return out
