"""Routing traces: record the exact all-gathered counts of a real run, replay them in `simulate run`.

Shape legend:  I steps (planner calls per layer)   Y MoE layers   D expert-parallel ranks   E experts

    rec = TraceRecorder.attach(model)        # after building the model with megatron_rails installed
    ... train ...
    if rank == 0: rec.save("trace.npz")      # counts are all-gathered: identical on every EP rank
    rec.detach()

The recorder wraps each RailsTokenDispatcher's `planner.plan` (per instance) and keeps a copy of the
counts_DE it is called with, once per layer and microbatch, in module order. Files:
  .npz   `counts` int64 [I, Y, D, E] and `meta`, a JSON string: format, version, steps, layers, ranks,
         experts, topk, hidden, tokens_per_rank, policy, source.
  .npy / .json   the bare 4-D counts, as workloads.save_counts writes them (no metadata).
`load_trace` reads all three (and 2-D / 3-D counts files, broadcast to [I, Y, D, E]).

`megatron-rails trace --out FILE.npz [--steps STEPS] [--policy POLICY] [--ranks RANKS]` records the tiny
CPU training demo (the demo trainer's model on RANKS gloo ranks launched by torchrun) and saves its trace.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from ..core.errors import ChildFailed, InputError, reason, shown

FORMAT, VERSION = "megatron-rails-trace", 1


class TraceError(InputError):
    """A trace cannot be recorded, saved or read."""


class TraceRecorder:
    """Records counts_DE per MoE layer and planner call; see the module docstring."""

    def __init__(self):
        self.layers: list[list[np.ndarray]] = []
        self.meta: dict = {}
        self._wrapped: list = []

    @classmethod
    def attach(cls, model) -> "TraceRecorder":
        """Hook every RailsTokenDispatcher of `model` (a module or a list of model chunks)."""
        from ..megatron.dispatcher import RailsTokenDispatcher

        rec = cls()
        chunks = model if isinstance(model, (list, tuple)) else [model]
        found, seen = [], set()
        for chunk in chunks:
            for mod in chunk.modules():
                for obj in (mod, getattr(mod, "token_dispatcher", None)):
                    if isinstance(obj, RailsTokenDispatcher) and id(obj) not in seen:
                        seen.add(id(obj))
                        found.append(obj)
        if not found:
            raise TraceError("no RailsTokenDispatcher in this model: build it after megatron_rails.install(...)")
        for i, disp in enumerate(found):
            rec.layers.append([])
            rec._wrap(i, disp.planner)
        d0 = found[0]
        # the policy that ran (the runtime's: with one EP rank, none whatever was asked)
        rec.meta = {"ranks": int(d0.ep_size), "experts": int(d0.num_experts), "policy": d0.runtime.policy.policy,
                    "topk": int(d0.config.moe_router_topk), "hidden": int(d0.config.hidden_size)}
        return rec

    def _wrap(self, layer: int, planner) -> None:
        if "plan" in vars(planner):
            raise TraceError(f"layer {layer}: its planner is already wrapped (attach once, or detach first)")
        orig = planner.plan
        store = self.layers[layer]

        def plan(counts_DE, state=None):
            store.append(np.array(counts_DE, dtype=np.int64, copy=True))
            return orig(counts_DE, state)

        planner.plan = plan  # an instance attribute: shadows the class's method for this planner only
        self._wrapped.append(planner)

    def detach(self) -> None:
        for planner in self._wrapped:
            vars(planner).pop("plan", None)
        self._wrapped = []

    def counts(self) -> np.ndarray:
        """int64 [I, Y, D, E]; I = the fewest calls any layer saw (a layer's extra calls are dropped)."""
        if not self.layers or not min(map(len, self.layers)):
            raise TraceError("nothing recorded yet: run at least one forward pass after attach()")
        I = min(map(len, self.layers))
        return np.stack([np.stack(calls[:I]) for calls in self.layers], axis=1)

    def save(self, path, source: str = "") -> Path:
        c = self.counts()
        meta = self.meta | {"source": source}
        return save_trace(path, c, meta)


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
    from ..core.workloads import WorkloadError, validate_counts

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
    meta = _check_meta(meta, c.shape)
    suffix = p.suffix.lower()
    if suffix in (".npy", ".json"):
        from ..core.workloads import save_counts

        return save_counts(p, c)
    if suffix != ".npz":
        raise TraceError(f"{p}: unsupported extension {p.suffix!r}; use .npz (with metadata), .npy or .json")
    I, Y, D, E = c.shape
    row = c[0, 0].sum(axis=1)
    meta = {"format": FORMAT, "version": VERSION, "steps": I, "layers": Y, "ranks": D, "experts": E} | meta
    if meta.get("topk"):
        meta.setdefault("tokens_per_rank", int(row.max()) // int(meta["topk"]))
    try:
        text = json.dumps(meta, allow_nan=False)
    except ValueError as err:  # NaN / inf: not JSON
        raise TraceError(f"meta: {reason(err)}") from None
    from ..core.outfile import open_for_writing

    with open_for_writing(p, "wb") as f:  # np.savez(str) would append .npz to other names
        np.savez(f, counts=c, meta=np.array(text))
    return p


def load_trace(path) -> tuple[np.ndarray, dict]:
    """(int64 counts [I, Y, D, E], metadata dict) from .npz, or .npy/.json counts (2-D, 3-D or 4-D)."""
    from ..core.workloads import load_counts, load_trace_npz

    p = _check_path(path, "a .npz, .npy or .json trace file")
    if p.suffix.lower() == ".npz":
        return load_trace_npz(p)
    c = load_counts(p)  # it says what is wrong with the file, as a counts file
    while c.ndim < 4:  # [D, E] -> one step; [I, D, E] -> every layer alike (as workloads replays it)
        c = c[None] if c.ndim == 2 else c[:, None]
    return c, {"source": str(p)}


# -- recording the CPU demo -----------------------------------------------------------------------------------

def _worker(argv=None) -> int:
    """One torchrun rank: the demo trainer's tiny model with the recorder attached."""
    import argparse

    import torch
    import torch.distributed as dist

    from ..megatron.install import install, uninstall
    from . import train as td

    ap = argparse.ArgumentParser(prog="python -m megatron_rails.demo.trace")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--policy", default="none")
    ap.add_argument("--slots", type=int, default=2)
    args = ap.parse_args(argv)
    rank, world = td.init_distributed()
    torch.set_num_threads(1)
    shape = td.DemoShape()
    install({"policy": args.policy, "slots": args.slots, "ranks_per_node": min(2, world)})
    try:
        model = td.build_model(shape, world, "alltoall")
    finally:
        uninstall()
    rec = TraceRecorder.attach(model)

    def progress(step, loss, step_s):
        if rank == 0:
            print(f"[trace] step {step + 1}/{args.steps} loss {loss:.5f} ({step_s * 1e3:.0f} ms)", flush=True)

    td.train_steps(model, shape, args.steps, rank, world, on_step=progress)
    rec.detach()
    if rank == 0:
        rec.save(args.out, source=f"demo trainer, {world} gloo ranks, policy {args.policy}, {args.steps} steps")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def record_demo(out: str, steps: int = 10, policy: str = "none", ranks: int = 4, slots: int = 2,
                quiet: bool = False) -> Path:
    """Launch the CPU demo on `ranks` gloo ranks with recording on; returns the trace path."""
    import subprocess

    from ..core.planners import POLICIES

    if policy not in POLICIES:
        raise TraceError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    if Path(out).suffix.lower() not in (".npz", ".npy", ".json"):
        raise TraceError(f"--out {out}: unsupported extension; use .npz (with metadata), .npy or .json")
    if ranks < 1 or 8 % ranks:
        raise TraceError(f"--ranks must divide the demo's 8 experts, got {ranks}")
    if steps < 1:
        raise TraceError(f"--steps must be >= 1, got {steps}")
    from ..core.policy import ConfigError, PolicyConfig

    try:  # the workers install this policy: refuse it here rather than in a torchrun failure
        PolicyConfig(policy=policy, slots=slots)
    except ConfigError as err:
        raise TraceError(f"--{err}") from None
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           "--standalone", "-m", "megatron_rails.demo.trace", "--out", str(out),
           "--steps", str(steps), "--policy", policy, "--slots", str(slots)]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    tail = []
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        if line.startswith("[trace] ") and not quiet:
            print(f"  {line.rstrip()}", file=sys.stderr, flush=True)
    if proc.wait() != 0:
        raise ChildFailed(f"trace run failed (exit {proc.returncode}):\n{''.join(tail)}")
    return Path(out)


def cmd_trace(args) -> int:
    path = record_demo(args.out, args.steps, args.policy, args.ranks, args.slots, args.quiet)
    I, Y, D, E = load_trace(path)[0].shape
    from ..sim.term import wrapped

    print(wrapped(f"trace: {path}: {I} steps x {Y} layers, {D} ranks x {E} experts (policy {args.policy}; "
                  f"replay: megatron-rails simulate run CONFIG --trace {path})"))
    return 0


if __name__ == "__main__":
    from ..runtime.comm.base import leave

    leave(_worker())  # no interpreter finalization after gloo collectives (see leave)
