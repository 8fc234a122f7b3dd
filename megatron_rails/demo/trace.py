"""`megatron-rails trace`: record the tiny CPU training demo's routing (core/trace.py's format).

    megatron-rails trace --out FILE.npz [--steps STEPS] [--policy POLICY] [--ranks RANKS]

trains the demo trainer's model on RANKS gloo ranks launched by torchrun with the policy's `trace`
key set (megatron/trace_log.py records every training forward's all-gathered counts) and saves the
trace; .npy / .json outputs get the bare counts.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from ..core.errors import ChildFailed
from ..core.trace import TraceError, load_trace, save_trace


# -- recording the CPU demo -----------------------------------------------------------------------------------

def _worker(argv=None) -> int:
    """One torchrun rank: the demo trainer's tiny model, recording through the policy's `trace` key."""
    import argparse

    import torch
    import torch.distributed as dist

    from ..megatron.install import install, uninstall
    from ..megatron.trace_log import close_all
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
    out = Path(args.out)
    npz = out if out.suffix.lower() == ".npz" else out.with_name(f".{out.name}.npz")  # recorded, then converted
    install({"policy": args.policy, "slots": args.slots, "ranks_per_node": min(2, world), "trace": str(npz)})
    try:
        model = td.build_model(shape, world, "alltoall")
    finally:
        uninstall()

    def progress(step, loss, step_s):
        if rank == 0:
            print(f"[trace] step {step + 1}/{args.steps} loss {loss:.5f} ({step_s * 1e3:.0f} ms)", flush=True)

    td.train_steps(model, shape, args.steps, rank, world, on_step=progress)
    close_all()  # rank 0 writes the file
    if rank == 0 and npz != out:
        save_trace(out, load_trace(npz)[0])
        npz.unlink()
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
