"""Run Megatron-LM's own training script with several ranks sharing one GPU over gloo, for checks.

    torchrun --nproc-per-node N scripts/megatron_lm_gloo.py MEGATRON_LM_DIR/pretrain_gpt.py \
        [Megatron-LM args] --distributed-backend gloo --local-rank 0 [--moe-balancer POLICY]

NCCL refuses two ranks on one GPU, and gloo has no CUDA path for the coalesced all-reduce that
Megatron-Core's DDP issues over a bucket group (`ProcessGroupGloo::allreduce_coalesced: unsupported
device type cuda`, at the first gradient synchronization). Here Megatron-Core's
param_and_grad_buffer gets a `_coalescing_manager` under which each bucket's collective runs on its
own (the same reduction, one call per bucket) and the handle it returns waits for all of them. The
script then runs through the megatron-rails launcher against the Megatron-LM checkout it lives in,
as scripts/megatron_lm_cpu.py does on CPU (which applies the same with PRETRAIN_UNCOALESCED=1, to
check that it changes nothing).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import sys

_WORKS: contextvars.ContextVar = contextvars.ContextVar("megatron_lm_gloo_works", default=None)


class _Handle:
    """What `_coalescing_manager` yields: wait() waits for every collective issued under it."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []


@contextlib.contextmanager
def _one_by_one(group=None, device=None, async_ops=False):
    works: list = []
    token = _WORKS.set(works)
    try:
        yield _Handle(works)
    finally:
        _WORKS.reset(token)


def _collected(collective):
    """The collective, its async handle kept for the enclosing `_one_by_one`."""

    @functools.wraps(collective)
    def call(*args, **kwargs):
        work = collective(*args, **kwargs)
        works = _WORKS.get()
        if works is not None and work is not None:
            works.append(work)
        return work

    return call


def uncoalesced() -> None:
    """Megatron-Core DDP's bucket-group collectives one by one instead of coalesced (once: a second
    call changes nothing)."""
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as buffers

    if buffers._coalescing_manager is _one_by_one:
        return
    buffers._coalescing_manager = _one_by_one
    dist.all_reduce = _collected(dist.all_reduce)  # buffers calls it as torch.distributed.all_reduce
    for name in ("dist_all_gather_func", "dist_reduce_scatter_func"):  # its module-level aliases
        setattr(buffers, name, _collected(getattr(buffers, name)))


def launch(argv: list[str], prepare, usage: str) -> int:
    """Run argv (SCRIPT ARGS...) through the megatron-rails launcher after prepare(), with the script's
    Megatron-LM checkout first on the path (its megatron.core, as under `python SCRIPT`)."""
    if not argv or argv[0].startswith("-"):
        print(usage, file=sys.stderr)
        return 2
    checkout = os.path.dirname(os.path.abspath(argv[0]))
    os.environ.setdefault("MEGATRON_LM_DIR", checkout)
    sys.path.insert(0, checkout)
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # megatron_rails
    from megatron_rails.launch import not_a_script

    why = not_a_script(argv[0])  # before prepare() imports megatron.core from the script's directory
    if why:
        print(f"{os.path.basename(sys.argv[0])}: {why}", file=sys.stderr)
        return 2
    prepare()
    from megatron_rails.launch import main as run

    return run(argv)


if __name__ == "__main__":
    sys.exit(launch(sys.argv[1:], uncoalesced,
                    "usage: torchrun ... scripts/megatron_lm_gloo.py MEGATRON_LM_DIR/pretrain_gpt.py [ARGS...]"))
