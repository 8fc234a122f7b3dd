"""Host blocks an expert store needs every optimizer step, kept between steps (`HostBlocks`).

Every step a store with moved slots allocates the same few large host tensors per layer: the
fetch's receive buffer, the slots' weights, their gradient accumulator and the gradient return's
receive buffer. glibc does not hand them the blocks the step before freed (an aligned request needs
a little more than the freed block), so its heap kept growing into fresh pages: measured in place
on `bench step`'s model with fewer cases in the process than the benchmark runs, fsep's gradient
return took 1,500-4,600 minor page faults per step, and 2-4x the time of the same exchange into
memory already touched. CUDA's caching allocator already keeps freed blocks per stream, so on any
device but the host this hands out fresh tensors.

A kept block is handed out again only when nothing else references its storage (no tensor, view,
gradient, autograd saved tensor or collective in flight): what a caller got stays its own for as
long as it holds any view of it.
"""
from __future__ import annotations

import torch

MIN_BYTES = 1 << 20  # smaller tensors: glibc's free lists serve them well
KEEP = 4  # blocks kept per size: a layer's fetch buffer, weights, accumulator and returned gradient


def _use_count(storage: torch.UntypedStorage) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


class HostBlocks:
    """Host storages kept by byte size; `empty` reuses one nobody else holds."""

    def __init__(self):
        self._kept: dict[int, list[torch.UntypedStorage]] = {}

    def empty(self, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialized tensor of `shape` and `dtype` on `device` (a kept block's memory when on
        the host and at least MIN_BYTES)."""
        shape = tuple(int(s) for s in shape)
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        device = torch.device(device)
        if device.type != "cpu" or nbytes == 0 or nbytes < MIN_BYTES or not hasattr(torch._C, "_storage_Use_Count"):
            return torch.empty(shape, dtype=dtype, device=device)
        kept = self._kept.setdefault(nbytes, [])
        # only this list holds a free block's storage (one reference)
        free = next((st for st in kept if _use_count(st) == 1), None)
        if free is None:
            out = torch.empty(shape, dtype=dtype, device=device)
            if len(kept) < KEEP:
                kept.append(out.untyped_storage())
            return out
        return torch.empty(0, dtype=dtype, device=device).set_(free, 0, shape)

    def kept_bytes(self) -> int:
        """Bytes of every kept block, in use or not."""
        return sum(st.nbytes() for blocks in self._kept.values() for st in blocks)

    def idle_bytes(self) -> int:
        """Bytes of the kept blocks nothing else holds now."""
        return sum(st.nbytes() for blocks in self._kept.values() for st in blocks if _use_count(st) == 1)
