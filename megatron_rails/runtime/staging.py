"""Per-plan host tables on their way to the device, and the permutations made from them.

A plan's tables are numpy on the host; what the device needs of them goes over in one
host-to-device copy per table, non-blocking from pinned memory on CUDA (no wait for the device).

Shape letters: docs/architecture.md (glossary); here N the rows of one permutation.
"""
from __future__ import annotations

import os

import numpy as np
import torch

STAGING_ENV = "MEGATRON_RAILS_H2D"  # pinned (default) or pageable: how per-plan tables reach a GPU


def _pinned(device) -> bool:
    """Whether host buffers bound for `device` are pinned ($MEGATRON_RAILS_H2D, CUDA only)."""
    how = os.environ.get(STAGING_ENV, "pinned")
    if how not in ("pinned", "pageable"):
        raise ValueError(f"{STAGING_ENV}={how!r}: expected pinned or pageable")
    return torch.device(device).type == "cuda" and how == "pinned"


def host_rows(n: int, device, rows: int = 2) -> torch.Tensor:
    """An int64 [rows, n] host buffer for per-plan rows bound for `device`: filled through .numpy(),
    then sent by one `.to(device, non_blocking=True)`. Pinned for CUDA, so that copy does not wait
    for the device (the caching host allocator keeps the block until the copy is done);
    $MEGATRON_RAILS_H2D=pageable stages them through pageable memory instead (the driver copies
    small pageable buffers to its own staging memory and returns; bench local compares the two)."""
    return torch.empty((rows, n), dtype=torch.int64, pin_memory=_pinned(device))


def values_on(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """A few host numbers as a 1-D `dtype` tensor on `device`, by one non-blocking copy from a
    host_rows-like buffer (`torch.tensor(values, device=cuda)` copies from pageable memory)."""
    return torch.tensor(values, dtype=dtype, pin_memory=_pinned(device)).to(device, non_blocking=True)


def permutation_and_inverse(order_N: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A permutation (numpy) and its inverse as int64 tensors on `device`, in one host-to-device copy
    (on CUDA from pinned memory, not waiting for the device)."""
    both = host_rows(order_N.size, device)
    both_np = both.numpy()
    both_np[0] = order_N
    both_np[1, order_N] = np.arange(order_N.size)
    order_t, inverse_t = both.to(device, non_blocking=True).unbind(0)
    return order_t, inverse_t


def segment_order(lengths: np.ndarray, seg_order: np.ndarray) -> np.ndarray:
    """Positions of a stream cut into consecutive segments of `lengths`, the segments taken in
    `seg_order` (each one's positions ascending): a permutation, built without sorting the stream."""
    starts = np.cumsum(lengths) - lengths
    L, S = lengths[seg_order], starts[seg_order]
    return np.repeat(S - (np.cumsum(L) - L), L) + np.arange(int(L.sum()), dtype=np.int64)


def stage(arrays: list, device) -> list[torch.Tensor]:
    """Host integer tables (numpy, any shape) as int64 tensors on `device`, in one host-to-device
    copy from a host_rows buffer (non-blocking: on CUDA from pinned memory, no wait for the device;
    a plain `torch.from_numpy(a).to(cuda)` copies from pageable memory and waits for every kernel
    queued before it). The tensors are views of one device buffer."""
    sizes = [int(np.size(a)) for a in arrays]
    buf = host_rows(sum(sizes), device, rows=1)[0]
    buf_np, at = buf.numpy(), 0
    for a, n in zip(arrays, sizes):
        buf_np[at:at + n] = np.ravel(a)
        at += n
    on_dev = buf.to(device, non_blocking=True)
    return [t.view(np.shape(a)) for t, a in zip(on_dev.split(sizes), arrays)]
