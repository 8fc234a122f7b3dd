"""CPU-only shims for running stock Megatron-Core MoE layers on gloo. Applied by `apply()` only
when CUDA is unavailable; every patch is recorded so `revert()` restores the original objects.

megatron-core 0.16.1 on CPU needs:
* a device for `torch.cuda.current_device()` callers (the router moves its weight there, global
  memory buffers and sequence-parallel gathers allocate there): the CPU device;
* `moe_utils.te_general_gemm`, referenced without Transformer Engine: None (the torch path);
* the model-parallel RNG tracker's `fork()` (attention enters it even without dropout): a fork of
  the CPU generator, which leaves the global CPU RNG stream untouched as the CUDA fork would;
* activation recompute (`tensor_parallel.checkpoint`) saves and restores the CUDA RNG state: on CPU
  there is none, so getting it gives an empty tensor and setting it does nothing (the CPU RNG state,
  which the CPU ops draw from, is still saved and restored).

`stock_alltoall()` is apart: stand-ins around the stock alltoall dispatcher's device-to-host copy of
its split sizes, so that dispatcher, too, runs on gloo (the baseline the benchmarks and the demo
time; equal to stock allgather there: tests/test_flips.py).
"""
from __future__ import annotations

import contextlib

import torch

_patched: list[tuple[object, str, object]] = []


def _patch(obj, name: str, value) -> None:
    _patched.append((obj, name, getattr(obj, name, _MISSING)))
    setattr(obj, name, value)


class _Missing:
    pass


_MISSING = _Missing()


def apply() -> bool:
    """Install the shims if running without CUDA; returns whether they are active."""
    if torch.cuda.is_available():
        return False
    if _patched:
        return True
    _patch(torch.cuda, "current_device", lambda: torch.device("cpu"))
    from megatron.core.transformer.moe import moe_utils

    if getattr(moe_utils, "te_general_gemm", None) is None:
        _patch(moe_utils, "te_general_gemm", None)
    from megatron.core.tensor_parallel import random as mp_random

    @contextlib.contextmanager
    def fork(self, name=None):
        with torch.random.fork_rng(devices=[]):
            yield

    _patch(mp_random.CudaRNGStatesTracker, "fork", fork)
    if hasattr(mp_random, "_get_cuda_rng_state"):
        _patch(mp_random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8))
    if hasattr(mp_random, "_set_cuda_rng_state"):
        _patch(mp_random, "_set_cuda_rng_state", lambda *args, **kwargs: None)
    return True


def revert() -> None:
    while _patched:
        obj, name, old = _patched.pop()
        if old is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, old)


class _HostStream:
    """The one host 'stream' the stock alltoall dispatcher copies its split sizes on: host work
    is ordered already, so waits are no-ops and its event is always complete."""

    def wait_stream(self, stream):
        pass

    def record_event(self):
        return self

    def synchronize(self):
        pass


def _to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    # stock moves only CUDA tensors (and only then makes numpy arrays): on the CPU the split sizes
    # stayed tensors, which gloo's all_to_all_single refuses as split sizes
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor


@contextlib.contextmanager
def stock_alltoall():
    """Megatron-Core's stock MoEAlltoAllTokenDispatcher runnable on CPU while inside (layers built
    and run inside; `apply()` done). Restores everything; with CUDA, changes nothing."""
    if torch.cuda.is_available():
        yield
        return
    from megatron.core.transformer.moe import token_dispatcher as td

    cls = td.MoEAlltoAllTokenDispatcher
    stream = _HostStream()
    old = (cls.cuda_dtoh_stream, td.maybe_move_tensor_to_cpu, torch.cuda.current_stream, torch.cuda.stream)
    cls.cuda_dtoh_stream = stream  # else __init__ makes a torch.cuda.Stream()
    td.maybe_move_tensor_to_cpu = _to_host
    torch.cuda.current_stream = lambda device=None: stream  # the copy then runs "on the current stream"
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    try:
        yield
    finally:
        cls.cuda_dtoh_stream, td.maybe_move_tensor_to_cpu, torch.cuda.current_stream, torch.cuda.stream = old
