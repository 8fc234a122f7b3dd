"""Run Megatron-LM's own training script on CPU ranks, for checks: its training loop (schedules, DDP,
the distributed optimizer, the optimizer step, logging) exactly as written, with every CUDA placement
answered by the CPU.

    torchrun --nproc-per-node N scripts/megatron_lm_cpu.py MEGATRON_LM_DIR/pretrain_gpt.py \
        [Megatron-LM args] --distributed-backend gloo [--moe-balancer POLICY]

The script runs through the megatron-rails launcher (`python -m megatron_rails.launch`), with or without
the project's flags, against the Megatron-LM checkout it lives in (its megatron.core first on the path).
It is a checking tool, not a way to train: Megatron-LM asserts CUDA and puts its tensors on "cuda"
throughout, so here, for the whole process,
* tensors and modules that Megatron puts on "cuda" (`device="cuda"`, a device index, `.cuda()`,
  `.to("cuda")`) stay on the CPU (a torch function mode); `pin_memory` is dropped;
* `torch.cuda` answers: available, one device, no-op set_device / synchronize / empty_cache, streams
  and events that do nothing (events time with the host clock), zero memory statistics, an empty RNG
  state;
* Megatron's RNG tracker keeps one CPU generator state per name, seeded as asked, swapped in by
  `fork()` and saved back, advanced, on exit: what it does with CUDA states. Every weight Megatron
  initializes inside a fork (the experts' among them: seeded per EP rank) is then drawn afresh; with a
  fork that restored one state each time, every expert of a layer would start identical and a token
  sent to the wrong expert could not change the loss;
* a CPU tensor's `.type()` reads `torch.cuda.*Tensor` (the gradient clipping asserts it);
* a pipeline `isend` sends a copy of its tensor taken at the call (what stream order gives on CUDA);
* `megatron.legacy.fused_kernels.load` (an nvcc version probe) does nothing, and torch.compile is off
  (TORCHDYNAMO_DISABLE: Megatron compiles a few fused functions, for CUDA).
megatron-core 0.16.1's alltoall dispatcher cannot run on more than one CPU rank: it keeps its split
sizes as tensors unless they are on CUDA, which `all_to_all_single` refuses. Stock runs with expert
parallelism use Megatron's allgather dispatcher here (scripts/cpu_pretrain_check.sh). With
PRETRAIN_UNCOALESCED=1 Megatron DDP's bucket collectives also run one by one, as
scripts/megatron_lm_gloo.py has them on a GPU.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # read when torch._dynamo is first imported

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402


def _on_cuda(device) -> bool:
    """Whether a device argument names a CUDA device (an int is a CUDA index in torch's factories)."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaOnCpu(TorchFunctionMode):
    """Every torch call with a CUDA device gets the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name == "cuda":  # Tensor.cuda(...)
            return args[0]
        if name == "type" and len(args) == 1 and not kwargs:  # the type string, as on CUDA
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if _on_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if name == "to":
            args = tuple("cpu" if _on_cuda(a) else a for a in args)
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


class _Event:
    def __init__(self, *args, **kwargs):
        self.t = 0.0

    def record(self, *args, **kwargs):
        self.t = time.perf_counter()

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3

    def synchronize(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self) -> bool:
        return True


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def record_event(self, *args, **kwargs):
        event = _Event()
        event.record()
        return event


def _nothing(*args, **kwargs):
    return None


def _zero(*args, **kwargs):
    return 0


def cuda_on_cpu() -> None:
    """Install the mapping for the rest of the process."""
    from megatron_rails.megatron import cpu_shims

    cpu_shims.apply()  # while torch still says no CUDA: it installs only then
    c = torch.cuda
    for name, value in {
        "is_available": lambda: True, "device_count": lambda: 1, "set_device": _nothing,
        "synchronize": _nothing, "empty_cache": _nothing, "memory_stats": lambda *a, **k: {},
        "memory_allocated": _zero, "max_memory_allocated": _zero, "memory_reserved": _zero,
        "max_memory_reserved": _zero, "device_memory_used": _zero, "reset_peak_memory_stats": _nothing,
        "Stream": _Stream, "Event": _Event, "current_stream": lambda *a, **k: _Stream(),
        "default_stream": lambda *a, **k: _Stream(), "stream": lambda *a, **k: contextlib.nullcontext(),
        "get_device_capability": lambda *a, **k: (9, 0),
        "get_rng_state": lambda *a, **k: torch.empty(0, dtype=torch.uint8), "set_rng_state": _nothing,
        "manual_seed": _nothing, "manual_seed_all": _nothing,
    }.items():
        setattr(c, name, value)
    from megatron.core.tensor_parallel import random as mp_random

    mp_random.CudaRNGStatesTracker.add = _tracker_add
    mp_random.CudaRNGStatesTracker.fork = _tracker_fork
    try:  # Megatron-LM's, not in the megatron-core package
        import megatron.legacy.fused_kernels as fused_kernels
    except ImportError:
        pass
    else:
        fused_kernels.load = _nothing
    # batch_isend_irecv reads isend from distributed_c10d: both names
    torch.distributed.isend = torch.distributed.distributed_c10d.isend = _isend_a_copy
    CudaOnCpu().__enter__()


def _tracker_add(self, name: str, seed: int) -> None:
    """CudaRNGStatesTracker.add on the CPU generator: the named state seeded with `seed`."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()


@contextlib.contextmanager
def _tracker_fork(self, name: str | None = None):
    """CudaRNGStatesTracker.fork on the CPU generator: the named state (default: Megatron's
    model-parallel one) in, then saved back (advanced) and the state before restored; forks nest."""
    if name is None:
        from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME as name
    if name not in self.states_:
        raise Exception(f"rng state {name} is not added")
    outer = torch.get_rng_state()
    torch.set_rng_state(self.states_[name])
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)


_isend = torch.distributed.isend


def _isend_a_copy(tensor, *args, **kwargs):
    """isend of a copy taken now. On CUDA a send reads its tensor in stream order, before any later
    kernel; the pipeline schedules free a sent activation's storage right after an isend they do not
    wait for (`deallocate_output_tensor`, interleaved schedules overlapping their p2p), which on gloo's
    thread could then send freed memory (NaN losses in a 2-stage interleaved run, not reproducible)."""
    return _isend(tensor.detach().clone(), *args, **kwargs)


def _prepare() -> None:
    cuda_on_cpu()
    if os.environ.get("PRETRAIN_UNCOALESCED") == "1":  # what scripts/megatron_lm_gloo.py does on GPUs
        from megatron_lm_gloo import uncoalesced

        uncoalesced()


if __name__ == "__main__":
    from megatron_lm_gloo import launch  # beside this file: sys.path[0]

    sys.exit(launch(sys.argv[1:], _prepare,
                    "usage: torchrun ... scripts/megatron_lm_cpu.py MEGATRON_LM_DIR/pretrain_gpt.py [ARGS...]"))
