"""Routing traces: the exact all-gathered counts of a run, per microbatch and MoE layer, on disk.

Shape legend:  I rows (training forwards: microbatches)   Y MoE layers   D expert-parallel ranks   E experts

Files:
  .npz   `counts` int64 [I, Y, D, E], `meta` (a JSON string: format, version, steps, layers, ranks,
         experts, topk, hidden, tokens_per_rank, policy, source) and, when recorded by a run,
         `step_I` int64 [I] (the optimizer step each row belongs to, from 0).
  .npy / .json   the bare 4-D counts, as workloads.save_counts writes them (no metadata).
`load_trace` reads all three (and 2-D / 3-D counts files, broadcast to [I, Y, D, E]); `save_trace`
writes one whole; `TraceStream` writes one as a run goes: rows appended to a part file beside it,
the .npz rewritten from that file (memory-mapped, so memory stays one row) on every `flush()`.
The recorder of a training run is megatron/trace_log.py; `megatron-rails trace` records the CPU demo.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from .errors import InputError, reason, shown

FORMAT, VERSION = "megatron-rails-trace", 1


class TraceError(InputError):
    """A trace cannot be recorded, saved or read."""


SHAPE_KEYS = ("steps", "layers", "ranks", "experts")  # meta keys the counts' shape sets
META_INTS = {"topk": 1, "hidden": 1, "tokens_per_rank": 0}  # meta keys holding integers: their least value


def _check_path(path, what: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TraceError(f"path must be a file path ({what}), got {shown(path)}")
    if not str(path):
        raise TraceError(f"path: an empty path; give a {what}")
    return Path(path)


def _plain(value, key: str):
    """`value` with numpy scalars as the built-in values they stand for, tuples as lists (recursively);
    TraceError naming meta's `key` for anything JSON cannot hold."""
    if isinstance(value, (np.bool_, np.integer, np.floating, np.str_)):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, key) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v, key) for k, v in value.items()}
    raise TraceError(f"meta[{key!r}]: not a JSON value (a number, string, bool, list or dict with string keys), "
                     f"got {type(value).__name__} {shown(value)}")


def _check_meta(meta, shape: tuple) -> dict:
    """A plain-JSON copy of `meta`: the shape keys agree with the counts' shape, topk / hidden /
    tokens_per_rank are integers in range, policy / source strings; TraceError naming the key."""
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise TraceError(f"meta must be a dict (or None), got {type(meta).__name__} {shown(meta)}")
    out = {}
    for k, v in meta.items():
        if not isinstance(k, str):
            raise TraceError(f"meta: keys must be strings, got {shown(k)}")
        out[k] = _plain(v, k)
    fixed = dict(zip(SHAPE_KEYS, shape)) | {"format": FORMAT, "version": VERSION}
    for k, v in fixed.items():
        if k in out and (isinstance(out[k], bool) or out[k] != v):
            raise TraceError(f"meta[{k!r}] = {shown(out[k])} contradicts the trace: the counts' shape "
                             f"[steps, layers, ranks, experts] is {list(shape)}, format {FORMAT} {VERSION}; "
                             f"drop {k!r} from meta (it is written from the counts)")
    for k, lo in META_INTS.items():
        v = out.get(k)
        if k in out and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
            raise TraceError(f"meta[{k!r}] must be a {'positive' if lo else 'non-negative'} integer, got {shown(v)}")
    for k in ("policy", "source"):
        if k in out and not isinstance(out[k], str):
            raise TraceError(f"meta[{k!r}] must be a string, got {shown(out[k])}")
    return out


def save_trace(path, counts_IYDE, meta: dict | None = None) -> Path:
    """Write a trace: .npz (counts + meta) or .npy/.json (workloads.save_counts, counts only).

    counts_IYDE: a non-empty, non-negative integer array-like [steps, layers, ranks, experts] within
    int64; meta: None or a dict of JSON values (numpy scalars taken as Python numbers). steps, layers,
    ranks, experts, format and version are written from the counts (meta may repeat them, not change
    them); topk, hidden and tokens_per_rank must be integers (topk, hidden >= 1). TraceError naming the
    argument for anything else, before any file is written."""
    from .workloads import WorkloadError, validate_counts

    p = _check_path(path, "a .npz, .npy or .json trace file")
    try:
        c = np.asarray(counts_IYDE)
    except (ValueError, TypeError) as err:  # ragged nested lists
        raise TraceError(f"{p}: counts_IYDE is not an array ({reason(err)})") from None
    if c.ndim != 4 or c.dtype.kind not in "iu" or 0 in c.shape or (c.min() < 0):
        raise TraceError(f"{p}: counts_IYDE: a trace is non-empty, non-negative integer counts [steps, layers, ranks, "
                         f"experts], got shape {c.shape} dtype {c.dtype}")
    try:  # within int64 (uint64 past it would wrap to negatives) and totals a plan holds: what load_trace takes
        c = validate_counts(c, f"{p}: counts_IYDE")
    except WorkloadError as err:
        raise TraceError(str(err)) from None
    meta = _file_meta(meta, c.shape, c[0, 0])
    suffix = p.suffix.lower()
    if suffix in (".npy", ".json"):
        from .workloads import save_counts

        return save_counts(p, c)
    if suffix != ".npz":
        raise TraceError(f"{p}: unsupported extension {p.suffix!r}; use .npz (with metadata), .npy or .json")
    return _write_npz(p, c, meta)


def _file_meta(meta: dict | None, shape: tuple, first_DE) -> dict:
    """The metadata a .npz holds: `meta` checked (_check_meta) under the format, version and shape
    keys; with topk, tokens_per_rank (unless given) from the first row's busiest rank (`first_DE`,
    int [D, E]: T k tokens-expert pairs a rank)."""
    meta = _check_meta(meta, shape)
    meta = {"format": FORMAT, "version": VERSION, **dict(zip(SHAPE_KEYS, shape))} | meta
    if meta.get("topk"):
        meta.setdefault("tokens_per_rank", int(np.asarray(first_DE).sum(axis=1).max()) // int(meta["topk"]))
    return meta


def _write_npz(p: Path, counts_IYDE, meta: dict, step_I=None) -> Path:
    """counts, meta (checked) and step_I (if given) into the .npz `p`, whole or not at all. numpy
    writes an array into a zip member in chunks, so a memory-mapped `counts_IYDE` is never read whole."""
    try:
        text = json.dumps(meta, allow_nan=False)
    except ValueError as err:  # NaN / inf: not JSON
        raise TraceError(f"meta: {reason(err)}") from None
    from .outfile import open_for_writing

    arrays = {"counts": counts_IYDE, "meta": np.array(text)}
    if step_I is not None:
        arrays["step_I"] = step_I
    with open_for_writing(p, "wb") as f:  # np.savez(str) would append .npz to other names
        np.savez(f, **arrays)
    return p


def load_trace(path) -> tuple[np.ndarray, dict]:
    """(int64 counts [I, Y, D, E], metadata dict) from .npz, or .npy/.json counts (2-D, 3-D or 4-D)."""
    from .workloads import load_counts, load_trace_npz

    p = _check_path(path, "a .npz, .npy or .json trace file")
    if p.suffix.lower() == ".npz":
        return load_trace_npz(p)
    c = load_counts(p)  # it says what is wrong with the file, as a counts file
    while c.ndim < 4:  # [D, E] -> one step; [I, D, E] -> every layer alike (as workloads replays it)
        c = c[None] if c.ndim == 2 else c[:, None]
    return c, {"source": str(p)}


class TraceStream:
    """A trace written as a run goes: `append(counts_YDE, step)` adds a row to PATH's part file
    (`.PATH.part` beside it, int64: the step, then the counts), `flush()` writes PATH from the rows
    so far, `close()` flushes and removes the part file. PATH must be a .npz (the rows' steps and the
    metadata need it); a part file left by an earlier run is replaced. TraceError naming the path
    when it cannot be written."""

    def __init__(self, path, meta: dict | None = None):
        p = _check_path(path, "a .npz trace file")
        if p.suffix.lower() != ".npz":
            raise TraceError(f"{p}: a recorded trace is a .npz (it keeps each row's step and the run's metadata); "
                             f"got {p.suffix or 'no extension'!r}")
        if not p.parent.is_dir():
            raise TraceError(f"{p}: directory {str(p.parent)!r} does not exist")
        self.path, self.meta = p, dict(meta or {})
        self.part = p.with_name(f".{p.name}.part")
        try:
            self._file = open(self.part, "wb")
        except OSError as err:
            raise TraceError(f"{p}: cannot write beside it ({reason(err)})") from None
        self.shape: tuple | None = None  # (Y, D, E), from the first row
        self.rows = 0

    def append(self, counts_YDE, step: int) -> None:
        c = np.asarray(counts_YDE)
        if c.ndim != 3 or c.dtype.kind not in "iu" or 0 in c.shape or c.min() < 0:
            raise TraceError(f"{self.path}: a row is non-negative integer counts [layers, ranks, experts], got shape "
                             f"{c.shape} dtype {c.dtype}")
        if self.shape is None:
            self.shape = c.shape
        elif c.shape != self.shape:
            raise TraceError(f"{self.path}: row {self.rows} has shape {c.shape}, the trace's rows {self.shape}")
        self._file.write(np.int64(step).tobytes())
        self._file.write(np.ascontiguousarray(c, dtype=np.int64).tobytes())
        self.rows += 1

    def flush(self) -> Path | None:
        """Write PATH from every row so far (nothing before the first row); returns PATH or None."""
        if self._file is None or not self.rows:
            return None
        self._file.flush()
        width = 1 + int(np.prod(self.shape))
        table = np.memmap(self.part, dtype=np.int64, mode="r", shape=(self.rows, width))
        Y, D, E = self.shape
        meta = _file_meta(self.meta, (self.rows, Y, D, E), table[0, 1:1 + D * E].reshape(D, E))
        try:
            return _write_npz(self.path, table[:, 1:].reshape(self.rows, Y, D, E), meta, table[:, 0])
        finally:
            del table

    def close(self) -> Path | None:
        """flush(), then remove the part file; a second close does nothing."""
        if self._file is None:
            return None
        try:
            return self.flush()
        finally:
            self._file.close()
            self._file = None
            self.part.unlink(missing_ok=True)
