"""Host blocks an expert store needs every optimizer step, kept between steps (`HostBlocks`).

Every step a store with moved slots allocates the same few large host tensors per layer: the
fetch's receive buffer, the slots' weights, their gradient accumulator and the gradient return's
receive buffer. Allocated afresh, they landed in fresh pages step after step (glibc's heap kept
growing, freed blocks fragmenting it): measured in place on `bench step`'s model with fewer cases
in the process than the benchmark runs, fsep's gradient return took 1,500-4,600 minor page faults
per step, and 2-4x the time of the same exchange into memory already touched. CUDA's caching allocator already keeps freed blocks per stream, so on any
device but the host this hands out fresh tensors.

A kept block is handed out again only when nothing else references its storage (no tensor, view,
gradient, autograd saved tensor or collective in flight): what a caller got stays its own for as
long as it holds any view of it. Sizes follow the placement (replicas received, slots, parts of a
grown window), so `turn()`, called as each window opens, forgets the idle blocks no request took
in the last two windows (one a caller held through a whole window, the previous window's weights
say, stays for the next): at most KEEP blocks a size.
"""
from __future__ import annotations

import torch

MIN_BYTES = 1 << 20  # smaller tensors: glibc's free lists serve them well
KEEP = 4  # blocks kept per size: a layer's fetch buffer, weights, accumulator and returned gradient


_COUNTS = hasattr(torch._C, "_storage_Use_Count")  # without it no block is ever handed out again


def _use_count(storage: torch.UntypedStorage) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


class HostBlocks:
    """Host storages kept by byte size; `empty` reuses one nobody else holds."""

    def __init__(self):
        # byte size -> [storage, the turn it was last handed out in]
        self._kept: dict[int, list[list]] = {}
        self._turn = 0

    def turn(self) -> None:
        """A new window opens: forget the idle blocks not handed out in the last two windows."""
        self._turn += 1
        for nbytes in list(self._kept):
            left = [e for e in self._kept[nbytes] if e[1] >= self._turn - 2 or _use_count(e[0]) > 1]
            if left:
                self._kept[nbytes] = left
            else:
                del self._kept[nbytes]

    def empty(self, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialized tensor of `shape` and `dtype` on `device` (a kept block's memory when on
        the host and at least MIN_BYTES)."""
        shape = tuple(int(s) for s in shape)
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dtype.itemsize
        device = torch.device(device)
        if device.type != "cpu" or nbytes == 0 or nbytes < MIN_BYTES or not _COUNTS:
            return torch.empty(shape, dtype=dtype, device=device)
        kept = self._kept.setdefault(nbytes, [])
        # only this list holds a free block's storage (one reference)
        free = next((e for e in kept if _use_count(e[0]) == 1), None)
        if free is None:
            out = torch.empty(shape, dtype=dtype, device=device)
            if len(kept) < KEEP:
                kept.append([out.untyped_storage(), self._turn])
            return out
        free[1] = self._turn
        return torch.empty(0, dtype=dtype, device=device).set_(free[0], 0, shape)

    def storages(self) -> list[torch.UntypedStorage]:
        """Every kept block's storage, in use or not."""
        return [e[0] for entries in self._kept.values() for e in entries]

    def kept_bytes(self) -> int:
        """Bytes of every kept block, in use or not."""
        return sum(st.nbytes() for st in self.storages())

    def idle_bytes(self) -> int:
        """Bytes of the kept blocks nothing else holds now."""
        return sum(st.nbytes() for st in self.storages() if _use_count(st) == 1)
