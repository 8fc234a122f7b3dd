"""Plan model: where expert replicas live and how many tokens each source rank sends to each replica.

Shape legend (suffixes on array names):
    D  ranks of the expert-parallel group        E  experts
    S  slots per rank (owner slots + redundant slots, or FSEP slots)
    R  replicas: every filled (rank, slot), numbered in (expert, rank) order
    M  route entries (one per source rank and replica that exchange tokens)

A `Placement` is frozen and validated on construction; a `Plan` adds the token route and checks it
against the exact counts it was planned for. Both hash to a stable hex digest that is identical on every
rank and in every process for the same content, which the dispatcher can all-reduce to detect
inconsistent plans. All arrays are int64 and read-only.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import numpy as np

OWNER = "owner"      # stock EP owners in the first `owner_slots` slots, redundant replicas after them
SHARDED = "sharded"  # FSEP: every expert sharded over all ranks, every slot materialized per step
LAYOUTS = (OWNER, SHARDED)


class PlanError(ValueError):
    """A placement or plan violates the plan model's invariants."""


def _frozen_i64(a, name: str, ndim: int) -> np.ndarray:
    arr = np.asarray(a)
    if arr.ndim != ndim:
        raise PlanError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
            raise PlanError(f"{name} must hold integers, got dtype {arr.dtype}")
    arr = np.array(arr, dtype=np.int64, copy=True)
    arr.flags.writeable = False
    return arr


def check_counts(counts_DE, num_ranks: int | None = None, num_experts: int | None = None) -> np.ndarray:
    """Validate a token-count matrix: int64 [D, E], non-negative. Returns a read-only int64 copy."""
    counts = _frozen_i64(counts_DE, "counts_DE", 2)
    if num_ranks is not None and counts.shape[0] != num_ranks:
        raise PlanError(f"counts_DE has {counts.shape[0]} rows, expected one per rank ({num_ranks})")
    if num_experts is not None and counts.shape[1] != num_experts:
        raise PlanError(f"counts_DE has {counts.shape[1]} columns, expected one per expert ({num_experts})")
    if counts.size and counts.min() < 0:
        d, e = np.argwhere(counts < 0)[0]
        raise PlanError(f"counts_DE[{d}, {e}] = {counts[d, e]} is negative")
    return counts


def owner_of_experts(num_experts: int, num_ranks: int) -> np.ndarray:
    """Owner rank of every expert, int64 [E]: contiguous balanced blocks, rank d owns e with
    floor(e*D/E) == d. For E divisible by D this is stock Megatron EP (expert index
    ep_rank * E/D + i); for E < D the owners are spread and some ranks own nothing."""
    return (np.arange(num_experts, dtype=np.int64) * num_ranks) // num_experts


def owner_slots_needed(num_experts: int, num_ranks: int) -> int:
    """Most experts any rank owns under `owner_of_experts`: ceil(E / D)."""
    return -(-num_experts // num_ranks)


@dataclass(frozen=True, eq=False)
class Placement:
    """Which expert sits in every slot of every rank.

    slot_expert_DS: int64 [D, S]; expert id, or -1 for an empty slot.
    layout: OWNER (first `owner_slots` slots hold the owned experts, fixed) or SHARDED (FSEP).
    ranks_per_node: ranks sharing a node (locality for routes and weight moves).
    """

    slot_expert_DS: np.ndarray
    num_experts: int
    ranks_per_node: int
    layout: str = OWNER
    owner_slots: int = 0

    def __post_init__(self):
        se = _frozen_i64(self.slot_expert_DS, "slot_expert_DS", 2)
        object.__setattr__(self, "slot_expert_DS", se)
        D, S = se.shape
        E, G = int(self.num_experts), int(self.ranks_per_node)
        if D < 1 or E < 1:
            raise PlanError(f"need at least one rank and one expert, got D={D}, E={E}")
        if G < 1 or D % G:
            raise PlanError(f"ranks_per_node={G} must be >= 1 and divide the number of ranks {D}")
        if self.layout not in LAYOUTS:
            raise PlanError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if se.size and (se.min() < -1 or se.max() >= E):
            d, s = np.argwhere((se < -1) | (se >= E))[0]
            raise PlanError(f"slot ({d}, {s}) holds expert {se[d, s]}, outside [0, {E}) (or -1 for empty)")
        filled = np.sort(se, axis=1)
        dup = (filled[:, 1:] == filled[:, :-1]) & (filled[:, 1:] >= 0)
        if dup.any():
            d = int(np.argwhere(dup)[0][0])
            raise PlanError(f"rank {d} hosts an expert twice: slots {se[d].tolist()}")
        if self.layout == OWNER:
            L = owner_slots_needed(E, D)
            if self.owner_slots != L or S < L:
                raise PlanError(f"owner layout needs owner_slots = ceil(E/D) = {L} <= S={S}, got {self.owner_slots}")
            want = _owner_block(E, D, L)
            if not np.array_equal(se[:, :L], want):
                d = int(np.argwhere((se[:, :L] != want).any(axis=1))[0][0])
                raise PlanError(f"rank {d} owner slots {se[d, :L].tolist()} differ from stock EP {want[d].tolist()}")
        elif self.owner_slots != 0:
            raise PlanError("sharded layout has no owner slots")

    # -- constructors ---------------------------------------------------------------------------
    @classmethod
    def owner(cls, num_experts: int, num_ranks: int, ranks_per_node: int,
              redundant_DR: Sequence[Sequence[int]] | np.ndarray | None = None, slots: int = 0) -> "Placement":
        """Owner layout with `slots` redundant slots per rank; redundant_DR[d] lists rank d's replicas."""
        L = owner_slots_needed(num_experts, num_ranks)
        se = np.full((num_ranks, L + slots), -1, dtype=np.int64)
        se[:, :L] = _owner_block(num_experts, num_ranks, L)
        if redundant_DR is not None:
            if len(redundant_DR) != num_ranks:
                raise PlanError(f"redundant slots given for {len(redundant_DR)} ranks, expected {num_ranks}")
            for d, row in enumerate(redundant_DR):
                row = [int(x) for x in row if int(x) >= 0]
                if len(row) > slots:
                    raise PlanError(f"rank {d}: {len(row)} replicas overflow its {slots} redundant slots")
                se[d, L:L + len(row)] = row
        return cls(se, num_experts, ranks_per_node, OWNER, L)

    @classmethod
    def sharded(cls, num_experts: int, ranks_per_node: int, slots_DS: Sequence[Sequence[int]], slots: int) -> "Placement":
        """FSEP layout: rank d materializes the experts listed in slots_DS[d] (at most `slots`)."""
        se = np.full((len(slots_DS), slots), -1, dtype=np.int64)
        for d, row in enumerate(slots_DS):
            if len(row) > slots:
                raise PlanError(f"rank {d}: {len(row)} experts overflow its {slots} FSEP slots")
            se[d, :len(row)] = row
        return cls(se, num_experts, ranks_per_node, SHARDED, 0)

    # -- derived ----------------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return self.slot_expert_DS.shape[0]

    @property
    def slots_per_rank(self) -> int:
        return self.slot_expert_DS.shape[1]

    @cached_property
    def node_D(self) -> np.ndarray:
        return np.arange(self.num_ranks, dtype=np.int64) // self.ranks_per_node

    @cached_property
    def _replicas(self):
        se = self.slot_expert_DS
        d, s = np.nonzero(se >= 0)
        e = se[d, s]
        order = np.lexsort((d, e))  # by expert, then rank
        e, d, s = e[order], d[order], s[order]
        ptr = np.zeros(self.num_experts + 1, dtype=np.int64)
        np.cumsum(np.bincount(e, minlength=self.num_experts), out=ptr[1:])
        for a in (e, d, s, ptr):
            a.flags.writeable = False
        return e, d, s, ptr

    @property
    def replica_expert_R(self) -> np.ndarray:
        return self._replicas[0]

    @property
    def replica_rank_R(self) -> np.ndarray:
        return self._replicas[1]

    @property
    def replica_slot_R(self) -> np.ndarray:
        return self._replicas[2]

    @property
    def expert_ptr(self) -> np.ndarray:
        """int64 [E+1]: replicas of expert e are replica ids expert_ptr[e]:expert_ptr[e+1]."""
        return self._replicas[3]

    @property
    def num_replicas(self) -> int:
        return int(self.replica_expert_R.size)

    @cached_property
    def replicas_per_expert_E(self) -> np.ndarray:
        return np.diff(self.expert_ptr)

    @cached_property
    def is_moved_R(self) -> np.ndarray:
        """bool [R]: replica whose weights must be brought to its rank (not a stock owner copy)."""
        if self.layout == SHARDED:
            return np.ones(self.num_replicas, dtype=bool)
        return self.replica_slot_R >= self.owner_slots

    def replica_id(self, rank: int, expert: int) -> int:
        """Replica id of `expert` on `rank`; PlanError if the rank does not host it."""
        lo, hi = self.expert_ptr[expert], self.expert_ptr[expert + 1]
        hit = np.flatnonzero(self.replica_rank_R[lo:hi] == rank)
        if not hit.size:
            raise PlanError(f"rank {rank} does not host expert {expert}")
        return int(lo + hit[0])

    def digest(self) -> str:
        h = hashlib.sha256()
        h.update(f"placement|{self.layout}|{self.num_experts}|{self.ranks_per_node}|{self.owner_slots}|".encode())
        h.update(np.ascontiguousarray(self.slot_expert_DS).tobytes())
        h.update(str(self.slot_expert_DS.shape).encode())
        return h.hexdigest()


def _owner_block(num_experts: int, num_ranks: int, L: int) -> np.ndarray:
    """int64 [D, L]: owned experts of every rank, padded with -1."""
    owner = owner_of_experts(num_experts, num_ranks)
    first = np.searchsorted(owner, np.arange(num_ranks), side="left")
    idx = first[:, None] + np.arange(L)[None, :]
    ok = idx < num_experts
    ok[ok] = owner[idx[ok]] == np.nonzero(ok)[0]
    return np.where(ok, idx, -1).astype(np.int64)


@dataclass(frozen=True, eq=False)
class Plan:
    """A placement plus the token route for one layer and microbatch.

    route_indptr: int64 [D+1]; source rank d's entries are route_indptr[d]:route_indptr[d+1]
    route_rep_M:  int64 [M]; replica id of each entry, strictly increasing within a source row
    route_tok_M:  int64 [M]; tokens > 0 that the source sends to that replica
    For every source rank d and expert e the tokens over e's replicas sum exactly to counts_DE[d, e].
    `info` carries planner diagnostics (lower bound, threshold...); it is not part of the hash.
    """

    placement: Placement
    counts_DE: np.ndarray
    route_indptr: np.ndarray
    route_rep_M: np.ndarray
    route_tok_M: np.ndarray
    policy: str = ""
    info: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        p = self.placement
        counts = check_counts(self.counts_DE, p.num_ranks, p.num_experts)
        object.__setattr__(self, "counts_DE", counts)
        ptr = _frozen_i64(self.route_indptr, "route_indptr", 1)
        rep = _frozen_i64(self.route_rep_M, "route_rep_M", 1)
        tok = _frozen_i64(self.route_tok_M, "route_tok_M", 1)
        for name, a in (("route_indptr", ptr), ("route_rep_M", rep), ("route_tok_M", tok)):
            object.__setattr__(self, name, a)
        D, M = p.num_ranks, rep.size
        if ptr.size != D + 1 or ptr[0] != 0 or ptr[-1] != M or np.any(np.diff(ptr) < 0):
            raise PlanError(f"route_indptr must be non-decreasing from 0 to {M} with {D + 1} entries")
        if tok.size != M:
            raise PlanError(f"route has {M} replica ids but {tok.size} token counts")
        if M and (rep.min() < 0 or rep.max() >= p.num_replicas):
            bad = int(np.flatnonzero((rep < 0) | (rep >= p.num_replicas))[0])
            raise PlanError(f"route entry {bad} names replica {rep[bad]}; the placement has {p.num_replicas}")
        if M and tok.min() <= 0:
            bad = int(np.flatnonzero(tok <= 0)[0])
            kind = "negative" if tok[bad] < 0 else "zero (canonical routes hold positive counts only)"
            raise PlanError(f"route entry {bad} (source {self.src_M[bad]}) sends {tok[bad]} tokens: {kind}")
        src = self.src_M
        if M > 1:
            same_row = src[1:] == src[:-1]
            if np.any(same_row & (rep[1:] <= rep[:-1])):
                raise PlanError("route replica ids must be strictly increasing within each source row")
        got = np.zeros_like(counts)
        np.add.at(got, (src, p.replica_expert_R[rep]), tok)
        if not np.array_equal(got, counts):
            d, e = np.argwhere(got != counts)[0]
            hosts = p.replica_rank_R[p.expert_ptr[e]:p.expert_ptr[e + 1]].tolist()
            raise PlanError(f"route from rank {d} for expert {e} carries {got[d, e]} tokens but "
                            f"counts_DE[{d}, {e}] = {counts[d, e]} (expert {e} is hosted on ranks {hosts})")

    # -- constructors ---------------------------------------------------------------------------
    @classmethod
    def from_entries(cls, placement: Placement, counts_DE, src_M, rep_M, tok_M, policy: str = "",
                     info: dict | None = None) -> "Plan":
        """Canonicalize raw (source, replica, tokens) triples (any order, duplicates summed,
        zeros dropped) and validate. Negative token counts are rejected, not netted out."""
        src = np.asarray(src_M, dtype=np.int64).ravel()
        rep = np.asarray(rep_M, dtype=np.int64).ravel()
        tok = np.asarray(tok_M, dtype=np.int64).ravel()
        if not (src.size == rep.size == tok.size):
            raise PlanError("route triples must have equal lengths")
        if tok.size and tok.min() < 0:
            bad = int(np.flatnonzero(tok < 0)[0])
            raise PlanError(f"route entry {bad} (source {src[bad]}, replica {rep[bad]}) has negative tokens {tok[bad]}")
        D, R = placement.num_ranks, max(placement.num_replicas, 1)
        if src.size and (src.min() < 0 or src.max() >= D):
            raise PlanError(f"route source rank out of range [0, {D})")
        if rep.size and (rep.min() < 0 or rep.max() >= placement.num_replicas):
            raise PlanError(f"route replica id out of range [0, {placement.num_replicas})")
        keep = tok > 0
        key = src[keep] * R + rep[keep]
        tok = tok[keep]
        order = np.argsort(key, kind="stable")
        key, tok = key[order], tok[order]
        if key.size:
            start = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
            tok = np.add.reduceat(tok, start)
            key = key[start]
        src, rep = key // R, key % R
        ptr = np.zeros(D + 1, dtype=np.int64)
        np.cumsum(np.bincount(src, minlength=D), out=ptr[1:])
        return cls(placement, counts_DE, ptr, rep, tok, policy, dict(info or {}))

    @classmethod
    def from_quotas(cls, placement: Placement, counts_DE, quota_R, policy: str = "",
                    info: dict | None = None) -> "Plan":
        """Route tokens so that replica r receives exactly quota_R[r] tokens, sending as few tokens
        across nodes as these quotas allow (see `route.split_by_quota`)."""
        from .route import split_by_quota

        counts = check_counts(counts_DE, placement.num_ranks, placement.num_experts)
        src, rep, tok = split_by_quota(counts, placement, quota_R)
        return cls.from_entries(placement, counts, src, rep, tok, policy, info)

    # -- derived figures --------------------------------------------------------------------------
    @cached_property
    def src_M(self) -> np.ndarray:
        D = self.placement.num_ranks
        return np.repeat(np.arange(D, dtype=np.int64), np.diff(self.route_indptr))

    @cached_property
    def tokens_R(self) -> np.ndarray:
        """int64 [R]: tokens each replica computes."""
        return np.bincount(self.route_rep_M, weights=self.route_tok_M,
                           minlength=self.placement.num_replicas).astype(np.int64)

    @cached_property
    def load_D(self) -> np.ndarray:
        """int64 [D]: tokens each rank's experts compute (the compute load)."""
        p = self.placement
        return np.bincount(p.replica_rank_R, weights=self.tokens_R, minlength=p.num_ranks).astype(np.int64)

    @property
    def max_over_mean(self) -> float:
        return imbalance(self.load_D)

    @cached_property
    def cross_node_tokens(self) -> int:
        p = self.placement
        dst_node = p.node_D[p.replica_rank_R[self.route_rep_M]]
        return int(self.route_tok_M[p.node_D[self.src_M] != dst_node].sum())

    @cached_property
    def send_DD(self) -> np.ndarray:
        """int64 [D, D]: tokens rank i sends to rank j (the all-to-all's split sizes, in tokens)."""
        p, D = self.placement, self.placement.num_ranks
        flat = self.src_M * D + p.replica_rank_R[self.route_rep_M]
        return np.bincount(flat, weights=self.route_tok_M, minlength=D * D).astype(np.int64).reshape(D, D)

    @cached_property
    def active_moved_R(self) -> np.ndarray:
        """bool [R]: replicas that receive tokens and whose weights are not already on their rank."""
        return self.placement.is_moved_R & (self.tokens_R > 0)

    @property
    def weight_moves(self) -> int:
        """Expert weight copies this plan materializes (replicas with tokens that are not owners)."""
        return int(self.active_moved_R.sum())

    def weight_bytes(self, expert_param_bytes: int) -> int:
        """Expert-weight bytes moved over the network for this plan. An owner-layout replica is one
        full copy; an FSEP slot gathers the (D-1)/D of the expert held as shards elsewhere."""
        p = self.placement
        if p.layout == SHARDED:
            D = p.num_ranks
            return int(self.weight_moves * expert_param_bytes * (D - 1) // D)
        return int(self.weight_moves * expert_param_bytes)

    def route_DR(self) -> np.ndarray:
        """Dense int64 [D, R] route (for tests and small cases)."""
        out = np.zeros((self.placement.num_ranks, self.placement.num_replicas), dtype=np.int64)
        out[self.src_M, self.route_rep_M] = self.route_tok_M
        return out

    def digest(self) -> str:
        """Stable hex digest of placement, counts and route (identical across ranks and processes)."""
        h = hashlib.sha256()
        h.update(self.placement.digest().encode())
        h.update(f"|{self.policy}|".encode())
        for a in (self.counts_DE, self.route_indptr, self.route_rep_M, self.route_tok_M):
            h.update(str(a.shape).encode())
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()

    def __hash__(self) -> int:
        return int(self.digest()[:15], 16)

    def __eq__(self, other) -> bool:
        return isinstance(other, Plan) and self.digest() == other.digest()

    def summary(self, expert_param_bytes: int = 0) -> dict:
        return {
            "policy": self.policy,
            "max_over_mean": self.max_over_mean,
            "max_load": int(self.load_D.max()) if self.load_D.size else 0,
            "cross_node_tokens": self.cross_node_tokens,
            "weight_moves": self.weight_moves,
            "weight_bytes": self.weight_bytes(expert_param_bytes),
            "replicas": self.placement.num_replicas,
        }


def imbalance(load_D: np.ndarray) -> float:
    """max / mean of a per-rank load; 1.0 when there is no load at all."""
    load = np.asarray(load_D, dtype=np.float64)
    total = load.sum()
    return float(load.max() * load.size / total) if total > 0 else 1.0


def stock_load_D(counts_DE: np.ndarray, num_ranks: int) -> np.ndarray:
    """int64 [D]: per-rank compute load with experts on their owners only (no replicas)."""
    counts = np.asarray(counts_DE, dtype=np.int64)
    owner = owner_of_experts(counts.shape[1], num_ranks)
    return np.bincount(owner, weights=counts.sum(axis=0), minlength=num_ranks).astype(np.int64)
