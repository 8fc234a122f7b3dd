"""Routing workloads: token-count matrices counts_DE, synthetic (uniform, zipf, drift, bursty, one) or recorded.

Shape legend (suffixes on array names): D source ranks, E experts, T tokens per rank, I steps, Y layers.

counts_DE[d, e] (int64) is how many of rank d's T tokens picked expert e, top-k already expanded: every
token picks topk distinct experts, so a row sums to T*topk and no entry exceeds T.

Sampling (core/sampling.py): a skew gives routing weights p_E for one (step, layer), shared by all
ranks; every token picks topk distinct experts by sequential sampling without replacement from them.
Random streams are seeded by (seed, step, layer, sha256 of the canonical skew), never the salted hash().
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np

from .errors import WorkloadError, check_file, cut, reason, shown
from .outfile import open_for_writing, write_text
from .plan import MAX_COUNT_TOTAL, PlanError, check_counts
from .sampling import MAX_EXPERTS, sample_topk_counts

SKEW_FORMS = "uniform | zipf:S | drift:S[:P] | bursty:S[:F[:R]] | one | file:PATH"
MAX_S = 10.0                        # zipf exponent cap; steeper tails vanish below float64 resolution
DRIFT_PERIOD = 100                  # default P
BURST_FRAC, BURST_RATE = 0.5, 0.25  # default F, R
_TAG_PERM, _TAG_SAMPLE, _TAG_BURST = 0x5045524D, 0x53414D50, 0x42555253


@dataclass(frozen=True)
class Skew:
    """Parsed skew: kind (uniform, zipf, drift, bursty, one, file), zipf exponent s, drift period (steps),
    burst frac (F) and rate (R), counts file path. str() gives the canonical text."""

    kind: str
    s: float = 0.0
    period: int = 0
    frac: float = 0.0
    rate: float = 0.0
    path: str = ""

    def __str__(self) -> str:
        return {"zipf": f"zipf:{self.s!r}", "drift": f"drift:{self.s!r}:{self.period}",
                "bursty": f"bursty:{self.s!r}:{self.frac!r}:{self.rate!r}",
                "file": f"file:{self.path}"}.get(self.kind, self.kind)


def parse_skew(text: str) -> Skew:
    """Parse a skew text; WorkloadError (a ValueError) names the text and lists the accepted forms.

    uniform          every expert equally likely.
    zipf:S           the r-th hottest expert has weight ~ (r+1)^-S, 0 < S <= 10; which expert is r-th is a
                     random permutation drawn from (seed, layer).
    drift:S[:P]      zipf:S whose ranking rotates along that permutation by E/P experts a step, back to the
                     start after P steps (default 100).
    bursty:S[:F[:R]] zipf:S background (S = 0: uniform); a (step, layer) is a burst with probability R
                     (default 0.25): one random expert is then each token's first choice with probability F
                     (default 0.5).
    one              every token's first choice is one expert (random per layer); its other topk-1 choices are
                     uniform over the remaining experts.
    file:PATH        replay a counts file (see load_counts and counts).
    """
    if not isinstance(text, str):
        raise WorkloadError(f"skew must be a string, got {shown(text)}; accepted forms: {SKEW_FORMS}")

    def bad(why: str) -> WorkloadError:
        return WorkloadError(f"bad skew {shown(text)}: {why}; accepted forms: {SKEW_FORMS}")

    def num(x: str, name: str, lo: float, hi: float, lo_open: bool = True) -> float:
        try:
            v = float(x)
        except ValueError:
            raise bad(f"{name} must be a number, got {x!r}") from None
        if not (math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi):
            raise bad(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {x!r}")
        return v

    kind, _, rest = text.strip().partition(":")
    kind, args = kind.lower(), (rest.split(":") if rest else [])
    if kind == "file" and rest:
        return Skew("file", path=rest)
    if kind in ("uniform", "one") and not args:
        return Skew(kind)
    nmax = {"zipf": 1, "drift": 2, "bursty": 3}.get(kind, 0)
    if not 1 <= len(args) <= nmax:
        raise bad("file needs a path" if kind == "file" else f"{kind} takes no parameters"
                  if kind in ("uniform", "one") else f"unknown kind {kind!r}" if not nmax
                  else f"{kind} takes {1 if nmax == 1 else f'1 to {nmax}'} parameter(s), got {len(args)}")
    s = num(args[0], "S", 0.0, MAX_S, lo_open=kind != "bursty")
    if kind == "zipf":
        return Skew("zipf", s=s)
    if kind == "drift":
        if len(args) > 1 and (not args[1].strip().isdigit() or int(args[1]) < 1):
            raise bad(f"P must be a positive integer number of steps, got {args[1]!r}")
        return Skew("drift", s=s, period=int(args[1]) if len(args) > 1 else DRIFT_PERIOD)
    frac = num(args[1], "F", 0.0, 1.0) if len(args) > 1 else BURST_FRAC
    rate = num(args[2], "R", 0.0, 1.0) if len(args) > 2 else BURST_RATE
    return Skew("bursty", s=s, frac=frac, rate=rate)


def _int(name: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise WorkloadError(f"{name} must be an integer >= {lo}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class WorkloadSpec:
    """One MoE routing workload: each of num_ranks ranks routes tokens_per_rank tokens to topk distinct of
    num_experts experts, in each of num_layers layers. skew is kept in canonical form (str(parse_skew))."""

    num_ranks: int
    num_experts: int
    topk: int
    tokens_per_rank: int
    skew: str = "uniform"
    seed: int = 0
    num_layers: int = 1

    def __post_init__(self):
        for name, lo in (("num_ranks", 1), ("num_experts", 1), ("topk", 1), ("tokens_per_rank", 0),
                         ("seed", 0), ("num_layers", 1)):
            object.__setattr__(self, name, _int(name, getattr(self, name), lo))
        if self.topk > self.num_experts:
            raise WorkloadError(f"topk={self.topk} exceeds num_experts={self.num_experts}: "
                                "a token picks topk distinct experts")
        if self.num_experts >= MAX_EXPERTS:
            raise WorkloadError(f"num_experts={self.num_experts} must be below {MAX_EXPERTS}")
        object.__setattr__(self, "skew", str(parse_skew(self.skew)))

    @cached_property
    def parsed_skew(self) -> Skew:
        return parse_skew(self.skew)

    @property
    def routed_per_rank(self) -> int:
        """Row sum of every synthetic counts_DE: tokens_per_rank * topk."""
        return self.tokens_per_rank * self.topk


# -- generators -----------------------------------------------------------------------------------------------

def _skew_key(skew: str) -> int:
    return int.from_bytes(hashlib.sha256(skew.encode()).digest()[:8], "little")


def _zipf_E(s: float, order_E: np.ndarray) -> np.ndarray:
    """float64 [E]: weight (r+1)^-s on expert order_E[r], normalized."""
    p = np.empty(order_E.size, dtype=np.float64)
    p[order_E] = np.arange(1, order_E.size + 1, dtype=np.float64) ** -s
    return p / p.sum()


def _routing(spec: WorkloadSpec, step: int, layer: int):
    """(p_E float64 [E], hot expert or -1, hot_frac) of a synthetic skew at one step and layer."""
    sk, E = spec.parsed_skew, spec.num_experts
    perm_E = np.random.default_rng([spec.seed, layer, _TAG_PERM]).permutation(E)
    uniform = np.full(E, 1.0 / E)
    if sk.kind in ("uniform", "one"):
        return (uniform, -1, 0.0) if sk.kind == "uniform" else (uniform, int(perm_E[0]), 1.0)
    if sk.kind == "zipf":
        return _zipf_E(sk.s, perm_E), -1, 0.0
    if sk.kind == "drift":
        return _zipf_E(sk.s, np.roll(perm_E, -((step % sk.period) * E // sk.period))), -1, 0.0
    p = _zipf_E(sk.s, perm_E) if sk.s > 0 else uniform
    brng = np.random.default_rng([spec.seed, step, layer, _skew_key(spec.skew), _TAG_BURST])
    if brng.random() < sk.rate:
        return p, int(brng.integers(E)), sk.frac
    return p, -1, 0.0


def counts(spec: WorkloadSpec, step: int = 0, layer: int = 0) -> np.ndarray:
    """counts_DE: int64 [D, E] at one step and layer, a deterministic function of (spec, step, layer).

    Synthetic skews: rows sum to spec.routed_per_rank and entries are <= spec.tokens_per_rank. A file skew
    replays the file (whose D, E must match the spec): a 2-D file at every step and layer, 3-D [I, D, E]
    at step % I for every layer, 4-D [I, Y, D, E] at step % I and layer (needs Y >= spec.num_layers).
    """
    step, layer = _int("step", step, 0), _int("layer", layer, 0)
    if layer >= spec.num_layers:
        raise WorkloadError(f"layer {layer} out of range for num_layers={spec.num_layers}")
    if spec.parsed_skew.kind == "file":
        return _file_counts(spec, step, layer)
    p_E, hot, frac = _routing(spec, step, layer)
    rng = np.random.default_rng([spec.seed, step, layer, _skew_key(spec.skew), _TAG_SAMPLE])
    return sample_topk_counts(rng, p_E, spec.topk, spec.num_ranks, spec.tokens_per_rank, hot, frac)


def trace(spec: WorkloadSpec, steps: int) -> np.ndarray:
    """counts_IYDE: int64 [I, Y, D, E] (I = steps) with counts_IYDE[s, l] == counts(spec, s, l)."""
    steps = _int("steps", steps, 0)
    out = np.empty((steps, spec.num_layers, spec.num_ranks, spec.num_experts), dtype=np.int64)
    for s in range(steps):
        for l in range(spec.num_layers):
            out[s, l] = counts(spec, s, l)
    return out


# -- files ----------------------------------------------------------------------------------------------------

def _validate(arr, where: str) -> np.ndarray:
    """int64 copy of a 2-D [D, E], 3-D [I, D, E] or 4-D [I, Y, D, E] count array; errors name `where`."""
    a = np.asarray(arr)
    if a.ndim not in (2, 3, 4) or 0 in a.shape:
        raise WorkloadError(f"{where}: expected a non-empty 2-D [D,E], 3-D [steps,D,E] or 4-D "
                            f"[steps,layers,D,E] array, got shape {a.shape}")
    if a.dtype.kind == "f":
        ok = np.isfinite(a) & (a == np.round(a))
        if not ok.all():
            at = tuple(int(i) for i in np.argwhere(~ok)[0])
            raise WorkloadError(f"{where}: counts{list(at)} = {a[at].item()!r} is not an integer")
    elif a.dtype.kind not in "iu":
        raise WorkloadError(f"{where}: counts must hold integers, got dtype {a.dtype}")
    # compared as Python numbers: numpy would cast int64's bound to the array's dtype (float16: inf,
    # with an overflow warning)
    if (a.dtype.kind == "u" and int(a.max()) > np.iinfo(np.int64).max) or \
            (a.dtype.kind == "f" and float(a.max()) >= 2.0**63):
        raise WorkloadError(f"{where}: counts exceed int64")
    out = a.astype(np.int64)
    if out.min() < 0:  # named as the file holds it (counts[...]), not as a planner's argument (counts_DE)
        at = tuple(int(i) for i in np.argwhere(out < 0)[0])
        raise WorkloadError(f"{where}: {_at(at[:-2])}counts[{at[-2]}, {at[-1]}] = {out[at]} is negative")
    for at in np.ndindex(*out.shape[:-2]):
        try:
            check_counts(out[at])
        except PlanError as err:
            raise WorkloadError(f"{where}: {_at(at)}{err}") from None
    _check_totals(out, where)
    return out


def _at(index) -> str:
    return "".join(f"{k} {v}, " for k, v in zip(("step", "layer"), index))


def _check_totals(counts_arr: np.ndarray, where: str) -> None:
    """Each [D, E] matrix's total must stay exact in int64 sums and float64 means (planners use both);
    counts near 2^62 would overflow the token totals silently."""
    D, E = counts_arr.shape[-2:]
    totals = counts_arr.reshape(-1, D * E).sum(axis=1, dtype=np.float64)  # float: cannot wrap around
    big = np.flatnonzero(totals > MAX_COUNT_TOTAL)
    if big.size:
        at = np.unravel_index(big[0], counts_arr.shape[:-2]) if counts_arr.ndim > 2 else ()
        raise WorkloadError(f"{where}: {_at(tuple(int(i) for i in at))}counts sum to {totals[big[0]]:.3g} tokens; "
                            f"at most 2^53 ({MAX_COUNT_TOTAL:.3g}) per [D, E] matrix are supported")


def validate_counts(arr, where: str) -> np.ndarray:
    """int64 copy of a 2-D, 3-D or 4-D count array (see load_counts); WorkloadError naming `where`."""
    return _validate(arr, where)


NPY_MAGIC, NPZ_MAGIC = b"\x93NUMPY", b"PK\x03\x04"  # how .npy files and .npz (zip) archives begin


def has_magic(p: Path, magic: bytes) -> bool:
    """Whether file p begins with `magic`."""
    with open(p, "rb") as f:
        return f.read(len(magic)) == magic


COUNTS_FILES = ".npy or .json counts, or a `megatron-rails trace` .npz"  # what load_counts reads, for help texts


def _suffix(p: Path, readable: tuple[str, ...] = (".npy", ".json")) -> str:
    if p.suffix.lower() not in readable:
        raise WorkloadError(f"{p}: unsupported extension {p.suffix!r}; use {', '.join(readable[:-1])} or "
                            f"{readable[-1]}")
    return p.suffix.lower()


def _check_npy_size(p: Path) -> None:
    """WorkloadError unless the file holds the bytes its .npy header promises: a corrupt header
    (shape (10^8, 10^5)) would otherwise make numpy allocate terabytes before it finds the file short."""
    fmt = np.lib.format
    with open(p, "rb") as f:
        try:
            read = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}.get(fmt.read_magic(f))
            if read is None:  # a newer header version: numpy's own checks stand
                return
            shape, _, dtype = read(f)
        except (ValueError, OSError, EOFError) as err:
            raise WorkloadError(f"{p}: not a readable .npy array (its header: {err})") from None
        need = math.prod(shape) * dtype.itemsize
        have = os.fstat(f.fileno()).st_size - f.tell()
    if need > have:
        raise WorkloadError(f"{p}: its header promises shape {shape} ({need} bytes) but the file holds {have}: "
                            "cut off or corrupt")


def _load_npy(p: Path):
    if not has_magic(p, NPY_MAGIC):  # else numpy takes it for a pickle and suggests loading it unsafely
        raise WorkloadError(f"{p}: not a .npy file (no NumPy header); save counts with numpy.save or as .json")
    _check_npy_size(p)
    try:
        return np.load(p, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:  # EOFError: an empty or cut-off file
        why = "it holds Python objects, not numbers" if "pickle" in str(err) else str(err)
        raise WorkloadError(f"{p}: not a readable .npy array ({why})") from None


def _unique_keys(pairs: list) -> dict:
    """json object_pairs_hook: an object with a key given twice is an error (json keeps the last one
    silently, as PyYAML would; the YAML loader refuses them too)."""
    seen = set()
    for k, _ in pairs:
        if k in seen:
            raise WorkloadError(f"key {shown(k)} given twice in one object; give each key once")
        seen.add(k)
    return dict(pairs)


def _load_json(p: Path):
    try:
        data = json.loads(p.read_text(), object_pairs_hook=_unique_keys)
    except WorkloadError as err:  # a key given twice
        raise WorkloadError(f"{p}: {err}") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise WorkloadError(f"{p}: invalid JSON ({err})") from None
    except RecursionError:
        raise WorkloadError(f"{p}: nested too deeply to be counts (at most [steps, layers, ranks, experts])") from None
    if isinstance(data, dict) and "counts" not in data:
        raise WorkloadError(f"{p}: JSON object has no 'counts' key (keys: {shown(sorted(data))})")
    data = data["counts"] if isinstance(data, dict) else data
    if not isinstance(data, list):
        raise WorkloadError(f"{p}: expected a JSON list of lists or {{\"counts\": [...]}}")
    if _has_bool(data):  # numpy would read true / false beside integers as 1 / 0
        raise WorkloadError(f"{p}: counts must be integers, not true / false")
    try:
        data = np.array(data)
    except OverflowError:  # integers beyond int64 (numpy refuses them in an int array)
        raise WorkloadError(f"{p}: counts exceed int64") from None
    except ValueError:  # ragged
        data = None
    if data is not None and data.dtype == object and all(type(v) is int for v in data.ravel()):
        raise WorkloadError(f"{p}: counts exceed int64")  # numpy keeps such integers as Python objects
    if data is None or data.dtype in (bool, object):
        raise WorkloadError(f"{p}: counts must be a rectangular array of integers")
    return data


def _has_bool(x) -> bool:
    """Whether nested lists hold a true / false anywhere (a walk with a stack of its own: JSON nests
    deeper than Python's recursion goes)."""
    todo = [x]
    while todo:
        v = todo.pop()
        if isinstance(v, bool):
            return True
        if isinstance(v, list):
            todo.extend(v)
    return False


def load_trace_npz(path) -> tuple[np.ndarray, dict]:
    """(int64 counts [I, Y, D, E], metadata dict) of a `megatron-rails trace` .npz; WorkloadError naming
    the file for anything else (FileNotFoundError where there is none)."""
    import zipfile

    p = Path(path)
    check_file(p, "trace", WorkloadError, FileNotFoundError(f"trace file {str(p)!r} does not exist"))
    if not has_magic(p, NPZ_MAGIC):  # else numpy takes it for a pickle and suggests loading it unsafely
        raise WorkloadError(f"{p}: not a .npz archive; record one with `megatron-rails trace`")
    try:
        with np.load(p, allow_pickle=False) as z:
            if "counts" not in z.files:
                raise WorkloadError(f"{p}: no 'counts' array in the .npz (arrays: {cut(', '.join(z.files))})")
            c = z["counts"]
            meta = json.loads(str(z["meta"])) if "meta" in z.files else {}
    except WorkloadError:
        raise
    except MemoryError:  # a member whose header claims more than the machine has
        raise WorkloadError(f"{p}: not a readable trace .npz (its counts claim more memory than there is: "
                            "cut off or corrupt)") from None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:  # EOFError: empty; BadZipFile: cut off
        raise WorkloadError(f"{p}: not a readable trace .npz ({reason(err)})") from None
    if c.ndim != 4 or c.dtype.kind not in "iu" or 0 in c.shape or c.min() < 0:
        raise WorkloadError(f"{p}: counts must be non-negative integers [steps, layers, ranks, experts], "
                            f"got shape {c.shape} dtype {c.dtype}")
    if not isinstance(meta, dict):
        meta = {}
    return _validate(c, str(p)), meta  # the same checks as a counts file (totals within int64)


def load_counts(path: str | os.PathLike) -> np.ndarray:
    """int64 counts [D, E], [I, D, E] or [I, Y, D, E] from a .npy or .json file, or the counts of a
    `megatron-rails trace` .npz ([I, Y, D, E]).

    JSON holds nested lists or an object {"counts": [...]} (each key once). Integral floats are
    accepted; negative, fractional, non-numeric or ragged data raise WorkloadError naming the file, a
    missing file FileNotFoundError.
    """
    p = Path(path)
    if not str(path).strip():  # Path("") is ".", the working directory
        raise WorkloadError(f"an empty path; give a counts file ({COUNTS_FILES})")
    check_file(p, "counts", WorkloadError, FileNotFoundError(f"counts file {str(p)!r} does not exist"))
    suffix = _suffix(p, (".npy", ".json", ".npz"))
    if suffix == ".npz":
        return load_trace_npz(p)[0]
    data = _load_npy(p) if suffix == ".npy" else _load_json(p)
    return _validate(data, str(p))


def save_counts(path: str | os.PathLike, counts_arr) -> Path:
    """Write int counts (2-D [D, E], 3-D [I, D, E] or 4-D [I, Y, D, E]) to .npy or .json {"counts": ...}."""
    p = Path(path)
    suffix = _suffix(p)
    arr = _validate(counts_arr, f"save_counts({str(p)!r})")
    if suffix == ".npy":
        with open_for_writing(p, "wb") as f:  # np.save(str) would append .npy to other names
            np.save(f, arr, allow_pickle=False)
    else:
        write_text(p, json.dumps({"counts": arr.tolist()}))
    return p


@lru_cache(maxsize=8)
def _load_cached(path: str, mtime_ns: int, size: int) -> np.ndarray:
    arr = load_counts(path)
    arr.flags.writeable = False
    return arr


@lru_cache(maxsize=8)
def _all_zero(path: str, mtime_ns: int, size: int) -> bool:
    return not _load_cached(path, mtime_ns, size).any()


def _file_counts(spec: WorkloadSpec, step: int, layer: int) -> np.ndarray:
    path = spec.parsed_skew.path
    try:
        check_file(path, "counts", WorkloadError,
                   FileNotFoundError(f"counts file {path!r} (skew {spec.skew!r}) does not exist"))
    except WorkloadError as err:
        raise WorkloadError(f"{err} (skew {spec.skew!r})") from None
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_mtime_ns, st.st_size)
    arr = _load_cached(*key)  # reloads when the file changes
    if _all_zero(*key):  # every policy would compare idle ranks (--counts and --trace refuse it alike)
        raise WorkloadError(f"{path}: every count is 0; there are no tokens to route (skew {spec.skew!r})")
    if arr.shape[-2:] != (spec.num_ranks, spec.num_experts):
        raise WorkloadError(f"{path}: counts are [D={arr.shape[-2]}, E={arr.shape[-1]}], but the workload has "
                            f"{spec.num_ranks} ranks and {spec.num_experts} experts")
    if arr.ndim == 4 and arr.shape[1] < spec.num_layers:
        raise WorkloadError(f"{path}: file has {arr.shape[1]} layers, the spec has num_layers={spec.num_layers}")
    sl = arr if arr.ndim == 2 else arr[step % arr.shape[0]] if arr.ndim == 3 else arr[step % arr.shape[0], layer]
    return sl.copy()
