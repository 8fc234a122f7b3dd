"""Plan model: where expert replicas live and how many tokens each source rank sends to each replica.

Shape legend (suffixes on array names):
    D  ranks of the expert-parallel group        E  experts
    S  slots per rank (owner slots + redundant slots, or FSEP slots)
    R  replicas: every filled (rank, slot), numbered in (expert, rank) order
    M  route entries (one per source rank and replica that exchange tokens)

A `Placement` is frozen and validated on construction; a `Plan` adds how many tokens every replica
computes and checks them against the exact counts it was planned for; the token route follows from
those by one deterministic rule. Both hash to a stable hex digest that is identical on every
rank and in every process for the same content, which the dispatcher can all-reduce to detect
inconsistent plans. All arrays are int64 and read-only.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Sequence

import numpy as np

from .compiled import compiled
from .errors import PlanError, is_integer, shown
from .route import route_and_sends

OWNER = "owner"      # stock EP owners in the first `owner_slots` slots, redundant replicas after them
SHARDED = "sharded"  # FSEP: every expert sharded over all ranks, every slot materialized per step
LAYOUTS = (OWNER, SHARDED)


def _int_arg(v, name: str, lowest: int) -> int:
    """`v` as a Python int if it is an integer (Python or numpy, not a bool) >= lowest; else a
    PlanError naming the argument. Cheap: no numpy call (the helper constructors are on hot paths)."""
    if type(v) is int and v >= lowest:
        return v
    if not is_integer(v) or v < lowest:
        raise PlanError(f"{name} must be an integer >= {lowest}, got {shown(v)}")
    return int(v)


def _int_item(x, name: str) -> int:
    """One entry of an id list (an integer, or a float holding one, as arrays take them), else a
    PlanError naming where it sits: no silent truncation of 1.7 to 1."""
    if type(x) is int:
        return x
    if is_integer(x):
        return int(x)
    if isinstance(x, (float, np.floating)) and math.isfinite(x) and x == int(x):
        return int(x)
    raise PlanError(f"{name} must hold integers, got {shown(x)}")


def _rows(table, name: str) -> int:
    """len(table) for a table given as one sequence per rank, else a PlanError naming it."""
    if isinstance(table, (str, bytes)) or not hasattr(table, "__len__") or not hasattr(table, "__iter__"):
        raise PlanError(f"{name} must be a list with one list of expert ids per rank, got {shown(table)}")
    return len(table)


def _row(row, name: str) -> list[int]:
    """One rank's row of expert ids as Python ints (PlanError naming `name` for anything else)."""
    if isinstance(row, (str, bytes)) or not hasattr(row, "__iter__"):
        raise PlanError(f"{name} must be a list of expert ids, got {shown(row)}")
    if isinstance(row, np.ndarray) and row.ndim != 1:
        raise PlanError(f"{name} must be a 1-D list of expert ids, got shape {row.shape}")
    return [_int_item(x, name) for x in row]


def _frozen_i64(a, name: str, ndim: int) -> np.ndarray:
    if type(a) is np.ndarray and a.dtype == np.int64 and a.ndim == ndim:
        if not a.flags.writeable and a.base is None and a.flags.c_contiguous:
            return a  # already a frozen int64 copy (built by this module or a planner)
        arr = a.copy()  # C order: the counts as the runtime gathers them take this path alone
        arr.flags.writeable = False
        return arr
    try:
        arr = np.asarray(a)
    except (ValueError, TypeError):  # ragged rows, an object numpy cannot take
        raise PlanError(f"{name} must be a {ndim}-D integer array (rows of equal length), got {shown(a)}") from None
    if arr.ndim != ndim:
        raise PlanError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iuf" and (arr.size or arr.dtype.kind != "b"):  # bool, complex, object, text
        raise PlanError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "f" and arr.size:
        if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
            raise PlanError(f"{name} must hold integers, got dtype {arr.dtype}")
    big = arr.size and (arr.max() > np.iinfo(np.int64).max if arr.dtype.kind == "u" else
                        arr.dtype.kind == "f" and np.abs(arr).max() >= 2.0**63)  # would wrap in int64
    if big:
        raise PlanError(f"{name} holds {shown(arr.flat[np.argmax(np.abs(arr))])}, beyond int64")
    arr = np.array(arr, dtype=np.int64, copy=True, order="C")
    arr.flags.writeable = False
    return arr


def check_counts(counts_DE, num_ranks: int | None = None, num_experts: int | None = None,
                 nonnegative: bool = True) -> np.ndarray:
    """Validate a token-count matrix: int64 [D, E], non-negative (unless the caller checks the sign
    itself: nonnegative=False). Returns a read-only int64 copy."""
    counts = _frozen_i64(counts_DE, "counts_DE", 2)  # no copy if already frozen (planners pass theirs on)
    if num_ranks is not None and counts.shape[0] != num_ranks:
        raise PlanError(f"counts_DE has {counts.shape[0]} rows, expected one per rank ({num_ranks})")
    if num_experts is not None and counts.shape[1] != num_experts:
        raise PlanError(f"counts_DE has {counts.shape[1]} columns, expected one per expert ({num_experts})")
    if nonnegative and counts.size:
        if counts.min() < 0:
            d, e = np.argwhere(counts < 0)[0]
            raise PlanError(f"counts_DE[{d}, {e}] = {counts[d, e]} is negative")
        if counts.max() > MAX_COUNT_TOTAL // counts.size:  # else the total cannot pass it: no exact sum needed
            _check_total(int(np.sum(counts, dtype=object)))
    return counts


MAX_COUNT_TOTAL = 2**53  # tokens in one counts matrix: exact in int64 sums and the float64 checks of a plan


def _check_total(total: int) -> None:
    if total > MAX_COUNT_TOTAL:
        raise PlanError(f"counts_DE totals {total:.4g} tokens, more than the 2^53 a plan holds exactly")


_COUNT_SUMS = compiled("megatron_rails.core._route_c", "count_sums")  # None: numpy below
_REPLICA_TABLE = compiled("megatron_rails.core._route_c", "replica_table")  # None: _replica_table
_RANK_SUMS = compiled("megatron_rails.core._route_c", "rank_sums")  # None: numpy in rank_totals


def counts_and_load(counts_DE, num_ranks: int, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """check_counts(counts_DE, num_ranks, num_experts) and the tokens of every expert (int64 [E],
    its column sums): in one compiled pass where built, which costs a planner a few microseconds
    where numpy's two reductions cost tens when the host's caches are cold (between the plans of a
    training step they are: scripts/profile_local.py --plan-only --cold)."""
    if _COUNT_SUMS is None:
        counts = check_counts(counts_DE, num_ranks, num_experts)
        return counts, counts.sum(axis=0)
    counts = check_counts(counts_DE, num_ranks, num_experts, nonnegative=False)
    load_E = np.empty(num_experts, dtype=np.int64)
    if _COUNT_SUMS(counts, num_ranks, num_experts, load_E) < 0:  # D, E >= 1: never empty
        check_counts(counts)  # raises, naming the negative entry or the total
    return counts, load_E


def rank_totals(rank_R: np.ndarray, amount_R: np.ndarray, num_ranks: int) -> tuple[np.ndarray, int, int]:
    """(int64 [D] amount_R summed by rank_R, its max, its sum): rank_R, amount_R int64 [R], every
    rank in [0, D); exact. Compiled where built: numpy's add.at (or bincount) and two reductions
    cost tens of microseconds on the cold caches between a step's plans, the compiled pass a few."""
    out = np.zeros(num_ranks, dtype=np.int64)
    if _RANK_SUMS is None or rank_R.dtype != np.int64 or amount_R.dtype != np.int64:
        np.add.at(out, rank_R, amount_R)
        return out, int(out.max(initial=0)), int(out.sum())
    most, total = _RANK_SUMS(c_order(rank_R), c_order(amount_R), rank_R.size, num_ranks, out)
    return out, most, total


def c_order(a: np.ndarray) -> np.ndarray:
    """`a` where C-contiguous already (no numpy call: on cold caches each costs microseconds), else
    a C-contiguous copy: what the compiled helpers take."""
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def owner_of_experts(num_experts: int, num_ranks: int) -> np.ndarray:
    """Owner rank of every expert, int64 [E]: contiguous balanced blocks, rank d owns e with
    floor(e*D/E) == d. For E divisible by D this is stock Megatron EP (expert index
    ep_rank * E/D + i); for E < D the owners are spread and some ranks own nothing."""
    return (np.arange(num_experts, dtype=np.int64) * num_ranks) // num_experts


def owner_slots_needed(num_experts: int, num_ranks: int) -> int:
    """Most experts any rank owns under `owner_of_experts`: ceil(E / D)."""
    return -(-num_experts // num_ranks)


_SCALARS = {"num_experts": 1, "ranks_per_node": 1, "owner_slots": 0}  # Placement's integer fields, lowest values


def _int_vector(a, name: str) -> np.ndarray:
    """int64 [N] from an int64 array as it is (no copy: the planners' path), else from any integer
    array, list or tuple (integral floats too, as _frozen_i64 takes them); PlanError naming `name`
    for fractions, NaN, text, None or ragged input."""
    if type(a) is np.ndarray and a.dtype == np.int64 and a.ndim == 1:
        return a
    return _frozen_i64(a, name, 1)


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
        for name in _SCALARS:  # numpy integers become Python ints (same digest); others refused
            v = getattr(self, name)
            if type(v) is not int:
                object.__setattr__(self, name, _int_arg(v, name, _SCALARS[name]))
        self._check()

    def validate(self) -> "Placement":
        """Raise PlanError unless the placement satisfies the plan model (run on construction;
        `trusted` placements skip it until called)."""
        se = self.slot_expert_DS
        if not (isinstance(se, np.ndarray) and se.dtype == np.int64 and se.ndim == 2):
            raise PlanError("slot_expert_DS must be a 2-D int64 array")
        for name in _SCALARS:  # the constructor made them ints; a trusted placement's are checked here
            v = getattr(self, name)
            if type(v) is not int and not is_integer(v):
                raise PlanError(f"{name} must be an integer >= {_SCALARS[name]}, got {shown(v)}")
        return self._check()

    def _check(self) -> "Placement":
        """validate() past the types (which the constructor has already made int64 and ints)."""
        se = self.slot_expert_DS
        D, S = se.shape
        E, G = int(self.num_experts), int(self.ranks_per_node)
        if D < 1 or E < 1:
            raise PlanError(f"need at least one rank and one expert, got D={D} ranks, num_experts={E}")
        if G < 1 or D % G:
            raise PlanError(f"ranks_per_node={G} must be >= 1 and divide the number of ranks {D}")
        if not isinstance(self.layout, str) or self.layout not in LAYOUTS:
            raise PlanError(f"layout must be one of {LAYOUTS}, got {shown(self.layout)}")
        # the replica table (filled slots sorted by (expert, rank)) also checks the expert ids and
        # finds an expert hosted twice
        self.__dict__["_replicas"] = _replica_table(se, E)
        if self.layout == OWNER:
            L = owner_slots_needed(E, D)
            if self.owner_slots != L or S < L:
                raise PlanError(f"owner layout needs owner_slots = ceil(E/D) = {L} <= S={S}, got {self.owner_slots}")
            idx, want_I = _owner_slots(E, D, L, S)
            if np.count_nonzero(se.ravel()[idx] != want_I):
                want = _owner_block(E, D, L)
                d = int(np.argwhere((se[:, :L] != want).any(axis=1))[0][0])
                raise PlanError(f"rank {d} owner slots {se[d, :L].tolist()} differ from stock EP {want[d].tolist()}")
        elif self.owner_slots != 0:
            raise PlanError("sharded layout has no owner slots")
        return self

    @classmethod
    def trusted(cls, slot_expert_DS: np.ndarray, num_experts: int, ranks_per_node: int, layout: str = OWNER,
                owner_slots: int = 0) -> "Placement":
        """A placement a planner built to satisfy the model by construction (read-only int64
        slot table): no checks on the hot path. Tests call `validate()` on every planner's output."""
        obj = object.__new__(cls)
        obj.__dict__.update(slot_expert_DS=slot_expert_DS, num_experts=num_experts, ranks_per_node=ranks_per_node,
                            layout=layout, owner_slots=owner_slots)  # frozen: no __setattr__ (hot path)
        return obj

    @classmethod
    def sharded_table(cls, slot_expert_DS: np.ndarray, num_experts: int, ranks_per_node: int) -> "Placement":
        """Placement(slot_expert_DS, num_experts, ranks_per_node, SHARDED) for a slot table a planner
        just built (int64 [D, S], C-contiguous, writable: frozen here), with the same checks: where
        compiled, its replica table and expert_ptr come from one pass that also finds an expert id
        out of range or hosted twice on a rank (the constructor then names it), instead of the
        numpy sort and reductions, which cost a plan tens of microseconds on cold caches."""
        se = slot_expert_DS
        E, G = _int_arg(num_experts, "num_experts", 1), _int_arg(ranks_per_node, "ranks_per_node", 1)
        if not (type(se) is np.ndarray and se.dtype == np.int64 and se.ndim == 2 and se.flags.c_contiguous
                and se.flags.writeable):  # a list, another dtype, a view: the constructor converts or refuses it
            return cls(se, E, G, SHARDED, 0)
        D, S = se.shape
        if _REPLICA_TABLE is None or D % G:
            return cls(se, E, G, SHARDED, 0)
        tables = np.empty((3, D * S), dtype=np.int64)
        ptr = np.empty(E + 1, dtype=np.int64)
        R = _REPLICA_TABLE(se, D, S, E, tables[0], tables[1], tables[2], ptr)
        if R < 0:
            return cls(se, E, G, SHARDED, 0)  # raises, naming the slot
        se.flags.writeable = False
        tables = tables[:, :R]
        tables.flags.writeable = False
        ptr.flags.writeable = False
        p = cls.trusted(se, E, G, SHARDED, 0)
        p.__dict__.update(_replicas=(tables[0], tables[1], tables[2]), expert_ptr=ptr)
        return p

    # -- constructors ---------------------------------------------------------------------------
    @classmethod
    def owner(cls, num_experts: int, num_ranks: int, ranks_per_node: int,
              redundant_DR: Sequence[Sequence[int]] | None = None, slots: int = 0) -> "Placement":
        """Owner layout with `slots` redundant slots per rank; redundant_DR[d] lists rank d's replicas
        (expert ids; -1 entries are skipped)."""
        num_experts, num_ranks = _int_arg(num_experts, "num_experts", 1), _int_arg(num_ranks, "num_ranks", 1)
        ranks_per_node, slots = _int_arg(ranks_per_node, "ranks_per_node", 1), _int_arg(slots, "slots", 0)
        ranks, experts = [], []
        if redundant_DR is not None:
            n = _rows(redundant_DR, "redundant_DR")
            if n != num_ranks:
                raise PlanError(f"redundant_DR gives slots for {n} ranks, expected {num_ranks}")
            for d, row in enumerate(redundant_DR):
                row = _row(row, f"redundant_DR[{d}]")
                if row and min(row) < -1:
                    raise PlanError(f"redundant_DR[{d}] holds expert {min(row)}, outside [0, {num_experts}) "
                                    f"(or -1 for none)")
                row = [x for x in row if x >= 0]
                if len(row) > slots:
                    raise PlanError(f"rank {d}: {len(row)} replicas overflow its {slots} redundant slots")
                ranks += [d] * len(row)
                experts += row
        return cls.owner_from_pairs(num_experts, num_ranks, ranks_per_node, slots, ranks, experts)

    @classmethod
    def owner_from_pairs(cls, num_experts: int, num_ranks: int, ranks_per_node: int, slots: int,
                         rank_I, expert_I) -> "Placement":
        """Owner layout plus replicas given as (rank_I[i], expert_I[i]) pairs (int [I]); a rank's
        redundant slots fill in the order its pairs appear."""
        num_experts, num_ranks = _int_arg(num_experts, "num_experts", 1), _int_arg(num_ranks, "num_ranks", 1)
        ranks_per_node, slots = _int_arg(ranks_per_node, "ranks_per_node", 1), _int_arg(slots, "slots", 0)
        L = owner_slots_needed(num_experts, num_ranks)
        se = _owner_template(num_experts, num_ranks, slots).copy()
        r = _int_vector(rank_I, "rank_I")  # planners pass int64 arrays: no copy, no numpy pass
        e = _int_vector(expert_I, "expert_I")
        if r.size != e.size:
            raise PlanError(f"rank_I has {r.size} entries, expert_I {e.size}: one rank per expert")
        if r.size:
            if r.min() < 0:
                raise PlanError(f"replica rank out of range [0, {num_ranks})")
            n_D = np.bincount(r, minlength=num_ranks)
            if n_D.size > num_ranks:
                raise PlanError(f"replica rank out of range [0, {num_ranks})")
            most = int(n_D.max())
            if most > slots:
                d = int(np.argmax(n_D))
                raise PlanError(f"rank {d}: {n_D[d]} replicas overflow its {slots} redundant slots")
            if most == 1:  # one replica per rank: its first redundant slot
                se[r, L] = e
            else:
                order = np.argsort(r, kind="stable")
                start = np.cumsum(n_D) - n_D
                slot = np.empty_like(r)
                slot[order] = np.arange(r.size) - start[r[order]]
                se[r, L + slot] = e
        se.flags.writeable = False
        return cls(se, num_experts, ranks_per_node, OWNER, L)

    @classmethod
    def sharded(cls, num_experts: int, ranks_per_node: int, slots_DS: Sequence[Sequence[int]], slots: int) -> "Placement":
        """FSEP layout: rank d materializes the experts listed in slots_DS[d] (at most `slots`)."""
        num_experts, slots = _int_arg(num_experts, "num_experts", 1), _int_arg(slots, "slots", 0)
        ranks_per_node = _int_arg(ranks_per_node, "ranks_per_node", 1)
        se = np.full((_rows(slots_DS, "slots_DS"), slots), -1, dtype=np.int64)
        for d, row in enumerate(slots_DS):
            row = _row(row, f"slots_DS[{d}]")
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
    def _replicas(self):  # set by validate(); trusted placements build it on first use
        return _replica_table(self.slot_expert_DS, self.num_experts, check=False)

    @property
    def replica_expert_R(self) -> np.ndarray:
        return self._replicas[0]

    @property
    def replica_rank_R(self) -> np.ndarray:
        return self._replicas[1]

    @property
    def replica_slot_R(self) -> np.ndarray:
        return self._replicas[2]

    @cached_property
    def expert_ptr(self) -> np.ndarray:
        """int64 [E+1]: replicas of expert e are replica ids expert_ptr[e]:expert_ptr[e+1]."""
        ptr = np.searchsorted(self.replica_expert_R, np.arange(self.num_experts + 1)).astype(np.int64)
        ptr.flags.writeable = False
        return ptr

    @cached_property
    def has_free_slot(self) -> bool:
        """Whether any rank has an empty slot a replica could be added to (in an owner layout, past the
        owner slots: where E is not a multiple of D their padding is no room)."""
        return bool((self.slot_expert_DS[:, self.owner_slots:] < 0).any())

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

    def move_bytes(self, expert_param_bytes: int, moves: int | None = None) -> int:
        """Expert-weight bytes sent over the network to materialize `moves` replicas (default: every
        moved replica). An owner-layout replica is one full copy; an FSEP slot gathers the (D-1)/D of
        the expert held as shards elsewhere."""
        expert_param_bytes = _int_arg(expert_param_bytes, "expert_param_bytes", 0)
        n = int(self.is_moved_R.sum()) if moves is None else _int_arg(moves, "moves", 0)
        if self.layout == SHARDED:
            D = self.num_ranks
            return int(n * expert_param_bytes * (D - 1) // D)
        return int(n * expert_param_bytes)

    def digest(self) -> str:
        h = hashlib.sha256()
        h.update(f"placement|{self.layout}|{self.num_experts}|{self.ranks_per_node}|{self.owner_slots}|".encode())
        h.update(np.ascontiguousarray(self.slot_expert_DS).tobytes())
        h.update(str(self.slot_expert_DS.shape).encode())
        return h.hexdigest()


def _replica_table(se: np.ndarray, num_experts: int, check: bool = True):
    """Filled slots of se (int64 [D, S]) as replicas sorted by (expert, rank): (expert_R, rank_R,
    slot_R), read-only. PlanError for an entry outside [0, E) other than -1 (empty), then naming
    the lowest rank that hosts an expert twice."""
    D, S = se.shape
    E = num_experts
    if check and se.size and (se.min() < -1 or se.max() >= E):
        d, s = np.argwhere((se < -1) | (se >= E))[0]
        raise PlanError(f"slot ({d}, {s}) holds expert {se[d, s]}, outside [0, {E}) (or -1 for empty)")
    # a stable sort by expert keeps equal experts in slot-table order, i.e. by rank: the replica
    # order. Empty slots (-1) sort first; the owner slots are already in order (timsort's runs).
    flat = se.ravel()
    order = np.argsort(flat, kind="stable")
    e = flat[order]
    n_empty = int(np.searchsorted(e, 0))
    e, order = e[n_empty:], order[n_empty:]
    d = order // S
    key = e * D + d
    dup = key[1:] == key[:-1] if check else None
    if check and np.count_nonzero(dup):
        r = int((key[1:][dup] % D).min())
        raise PlanError(f"rank {r} hosts an expert twice: slots {se[r].tolist()}")
    s = order - d * S
    for a in (e, d, s):
        a.flags.writeable = False
    return e, d, s


@lru_cache(maxsize=64)
def _owner_slots(num_experts: int, num_ranks: int, L: int, S: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices into a [D, S] slot table of the D*L owner slots, and the stock EP expert (or -1)
    each must hold (int64 [D*L] each, cached, read-only): a contiguous compare instead of a strided one."""
    idx = (np.arange(num_ranks, dtype=np.int64)[:, None] * S + np.arange(L)).ravel()
    want = _owner_block(num_experts, num_ranks, L).ravel()
    idx.flags.writeable = False
    return idx, want


@lru_cache(maxsize=64)
def _owner_template(num_experts: int, num_ranks: int, slots: int) -> np.ndarray:
    """int64 [D, L + slots] (read-only, cached): the owner block, redundant slots empty."""
    L = owner_slots_needed(num_experts, num_ranks)
    se = np.full((num_ranks, L + slots), -1, dtype=np.int64)
    se[:, :L] = _owner_block(num_experts, num_ranks, L)
    se.flags.writeable = False
    return se


@lru_cache(maxsize=64)
def _owner_block(num_experts: int, num_ranks: int, L: int) -> np.ndarray:
    """int64 [D, L] (read-only, cached): owned experts of every rank, padded with -1."""
    owner = owner_of_experts(num_experts, num_ranks)
    first = np.searchsorted(owner, np.arange(num_ranks), side="left")
    idx = first[:, None] + np.arange(L)[None, :]
    ok = idx < num_experts
    ok[ok] = owner[idx[ok]] == np.nonzero(ok)[0]
    out = np.where(ok, idx, -1).astype(np.int64)
    out.flags.writeable = False
    return out


@dataclass(frozen=True, eq=False)
class Plan:
    """A placement plus how many tokens every replica computes, for one layer and microbatch.

    quota_R: int64 [R]; tokens replica r computes. For every expert the quotas of its replicas sum
             exactly to its tokens, counts_DE[:, e].sum().
    The token route, how many tokens each source rank sends to each replica, is derived from the
    quotas by one fixed rule (`route.split_by_quota`: same-node first, then in rank order), so every
    rank derives the same route and the plan itself stays O(E + R) to build and to hash.
    `info` carries planner diagnostics (threshold, lower bound...); it is not part of the hash.
    """

    placement: Placement
    counts_DE: np.ndarray
    quota_R: np.ndarray
    policy: str = ""
    info: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        p = self.placement
        if not isinstance(p, Placement):
            raise PlanError(f"placement must be a Placement, got {type(p).__name__}")
        if not isinstance(self.policy, str):
            raise PlanError(f"policy must be a string, got {shown(self.policy)}")
        counts = check_counts(self.counts_DE, p.num_ranks, p.num_experts)
        object.__setattr__(self, "counts_DE", counts)
        quota = _frozen_i64(self.quota_R, "quota_R", 1)
        object.__setattr__(self, "quota_R", quota)
        self._check_quotas()

    def _check_quotas(self) -> None:
        p, quota = self.placement, self.quota_R
        if quota.size != p.num_replicas:
            raise PlanError(f"quota_R has {quota.size} entries, the placement has {p.num_replicas} replicas")
        if quota.size and quota.min() < 0:
            r = int(np.argmin(quota))
            raise PlanError(f"replica {r} (expert {p.replica_expert_R[r]} on rank {p.replica_rank_R[r]}) "
                            f"has a negative token count {quota[r]}")
        got_E = np.bincount(p.replica_expert_R, weights=quota, minlength=p.num_experts)  # exact below 2**53
        if np.count_nonzero(got_E != self.load_E):
            e = int(np.flatnonzero(got_E != self.load_E)[0])
            hosts = p.replica_rank_R[p.expert_ptr[e]:p.expert_ptr[e + 1]].tolist()
            if not hosts:
                raise PlanError(f"expert {e} has {self.load_E[e]} tokens but no rank hosts it")
            raise PlanError(f"expert {e}: its replicas on ranks {hosts} compute {int(got_E[e])} tokens, "
                            f"but {self.load_E[e]} are routed to it")

    def validate(self) -> "Plan":
        """Re-check everything: the placement, the counts and the quotas (PlanError otherwise)."""
        self.placement.validate()
        check_counts(self.counts_DE, self.placement.num_ranks, self.placement.num_experts)
        if not (isinstance(self.quota_R, np.ndarray) and self.quota_R.dtype == np.int64 and self.quota_R.ndim == 1):
            raise PlanError("quota_R must be a 1-D int64 array")
        self._check_quotas()
        return self

    @classmethod
    def trusted(cls, placement: Placement, counts_DE: np.ndarray, quota_R: np.ndarray, policy: str = "",
                info: dict | None = None) -> "Plan":
        """A plan a planner built to satisfy the model by construction (counts already checked by
        the planner, read-only int64 arrays): no checks on the hot path. The route derivation still
        checks quotas against counts when the route is first used; `validate()` checks the rest."""
        obj = object.__new__(cls)
        obj.__dict__.update(placement=placement, counts_DE=counts_DE, quota_R=quota_R, policy=policy,
                            info=dict(info) if info else {})  # frozen: no __setattr__ (hot path)
        return obj

    # -- constructors ---------------------------------------------------------------------------
    @classmethod
    def from_quotas(cls, placement: Placement, counts_DE, quota_R, policy: str = "",
                    info: dict | None = None) -> "Plan":
        return cls(placement, counts_DE, quota_R, policy, dict(info or {}))

    @classmethod
    def from_expert_ranks(cls, placement: Placement, counts_DE, expert_M, rank_M, tok_M, policy: str = "",
                          info: dict | None = None) -> "Plan":
        """Build from (expert, rank, tokens) triples, e.g. a solver's per-rank assignment.
        Raises PlanError for tokens on a rank that does not host the expert or negative counts;
        triples for the same (expert, rank) add up."""
        p = placement
        if not isinstance(p, Placement):
            raise PlanError(f"placement must be a Placement, got {type(p).__name__}")
        e, d, t = (_int_flat(a, name) for a, name in ((expert_M, "expert_M"), (rank_M, "rank_M"), (tok_M, "tok_M")))
        if not (e.size == d.size == t.size):
            raise PlanError("expert, rank and token arrays must have equal lengths")
        if t.size and t.min() < 0:
            i = int(np.argmin(t))
            raise PlanError(f"{t[i]} tokens of expert {e[i]} on rank {d[i]}: token counts must be >= 0")
        if e.size and (e.min() < 0 or e.max() >= p.num_experts or d.min() < 0 or d.max() >= p.num_ranks):
            raise PlanError(f"(expert, rank) out of range [0, {p.num_experts}) x [0, {p.num_ranks})")
        keys = p.replica_expert_R * p.num_ranks + p.replica_rank_R  # ascending: replicas sorted by (e, d)
        want = e * p.num_ranks + d
        idx = np.searchsorted(keys, want)
        miss = (idx >= keys.size) | (keys[np.minimum(idx, max(keys.size - 1, 0))] != want) if keys.size else want >= 0
        miss &= t > 0
        if np.any(miss):
            i = int(np.flatnonzero(miss)[0])
            raise PlanError(f"{t[i]} tokens of expert {e[i]} sent to rank {d[i]}, which does not host it")
        ok = t > 0
        quota = np.bincount(idx[ok], weights=t[ok], minlength=p.num_replicas).astype(np.int64)
        return cls(placement, counts_DE, quota, policy, dict(info or {}))

    # -- derived figures --------------------------------------------------------------------------
    @cached_property
    def load_E(self) -> np.ndarray:
        """int64 [E]: tokens routed to each expert."""
        return self.counts_DE.sum(axis=0)

    @property
    def load_D(self) -> np.ndarray:
        """int64 [D]: tokens each rank's experts compute (the compute load)."""
        p = self.placement
        return rank_totals(p.replica_rank_R, self.quota_R, p.num_ranks)[0]

    def peak_load(self) -> tuple[int, int]:
        """(max, sum) of load_D (rank_totals: compiled where built)."""
        p = self.placement
        return rank_totals(p.replica_rank_R, self.quota_R, p.num_ranks)[1:]

    @property
    def max_over_mean(self) -> float:
        return imbalance(self.load_D)

    @cached_property
    def route(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """CSR token route (route_indptr int64 [D+1], rep_M int64 [M], tok_M int64 [M]): source rank
        d sends tok_M[i] > 0 tokens to replica rep_M[i] for i in route_indptr[d]:route_indptr[d+1],
        replica ids strictly increasing within a row."""
        route, send_DD = route_and_sends(self.counts_DE, self.placement, self.quota_R)
        if send_DD is not None:  # made in the same pass: send_DD (a cached property) is this
            self.__dict__["send_DD"] = send_DD
        return route

    @cached_property
    def cross_node_tokens(self) -> int:
        """Tokens whose source and computing replica sit on different nodes. The route keeps every
        expert's tokens inside a node up to that node's quota, so this is
        sum over (expert, node) of max(0, tokens from the node - quota on the node)."""
        p = self.placement
        n_nodes = p.num_ranks // p.ranks_per_node
        supply_NE = self.counts_DE.reshape(n_nodes, p.ranks_per_node, -1).sum(axis=1)
        quota_NE = np.zeros_like(supply_NE)
        np.add.at(quota_NE, (p.node_D[p.replica_rank_R], p.replica_expert_R), self.quota_R)
        return int(np.maximum(supply_NE - quota_NE, 0).sum())

    @cached_property
    def send_DD(self) -> np.ndarray:
        """int64 [D, D], read-only: tokens rank i sends to rank j (the all-to-all's split sizes, in
        tokens); the compiled route makes it in the same pass."""
        p, D = self.placement, self.placement.num_ranks
        ptr, rep, tok = self.route
        src = np.repeat(np.arange(D), np.diff(ptr))
        flat = src * D + p.replica_rank_R[rep]
        send_DD = np.bincount(flat, weights=tok, minlength=D * D).astype(np.int64).reshape(D, D)
        send_DD.flags.writeable = False
        return send_DD

    @property
    def weight_moves(self) -> int:
        """Expert weight copies this plan materializes: replicas with tokens that are not owners."""
        return int((self.placement.is_moved_R & (self.quota_R > 0)).sum())

    def weight_bytes(self, expert_param_bytes: int) -> int:
        """Expert-weight bytes moved over the network for this plan's replicas with tokens (see
        Placement.move_bytes)."""
        return self.placement.move_bytes(expert_param_bytes, self.weight_moves)

    def digest(self) -> str:
        """Stable hex digest of placement, counts and quotas (identical across ranks and processes);
        the route is a deterministic function of these."""
        h = hashlib.sha256()
        h.update(self.placement.digest().encode())
        h.update(f"|{self.policy}|".encode())
        for a in (self.counts_DE, self.quota_R):
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


def _int_flat(a, name: str) -> np.ndarray:
    """Any integer array-like (or a float one holding integers) flattened to int64 [N]; PlanError
    naming `name` otherwise (no silent truncation of 0.5 to 0)."""
    try:
        arr = np.asarray(a)
    except (ValueError, TypeError):
        raise PlanError(f"{name} must be an integer array (rows of equal length), got {shown(a)}") from None
    return _frozen_i64(arr.reshape(-1), name, 1)


def imbalance(load_D: np.ndarray) -> float:
    """max / mean of a per-rank load; 1.0 when there is no load at all."""
    load = np.asarray(load_D, dtype=np.float64)
    total = load.sum()
    return float(load.max() * load.size / total) if total > 0 else 1.0


def peak_over_mean(most: int, total: int, num_ranks: int) -> float:
    """imbalance of a per-rank load from its max and sum (rank_totals' figures), without the array;
    the same float for loads below 2^53."""
    return most * num_ranks / total if total > 0 else 1.0


def stock_load_D(counts_DE: np.ndarray, num_ranks: int) -> np.ndarray:
    """int64 [D]: per-rank compute load with experts on their owners only (no replicas)."""
    counts = np.asarray(counts_DE, dtype=np.int64)
    owner = owner_of_experts(counts.shape[1], num_ranks)
    return np.bincount(owner, weights=counts.sum(axis=0), minlength=num_ranks).astype(np.int64)
