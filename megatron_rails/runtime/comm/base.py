"""Collective helpers shared by the exchanges: the count all-gather, where bookkeeping tensors
live, the group timeout, and `CommError` for a failed collective."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist


def all_gather_counts(counts_E: torch.Tensor, group) -> np.ndarray:
    """counts_E: int64 [E] on this rank -> int64 numpy [D, E], identical on every rank of `group`."""
    D = dist.get_world_size(group)
    out = torch.empty((D, counts_E.numel()), dtype=torch.int64, device=counts_E.device)
    try:  # gloo has no all_gather_into_tensor
        dist.all_gather(list(out.unbind(0)), counts_E.to(torch.int64).contiguous(), group=group)
    except RuntimeError as err:
        raise CommError(f"rank {dist.get_rank()}: all-gather of token counts failed: a peer rank probably died "
                        f"or timed out ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from err
    return out.cpu().numpy()


def collective_device(group) -> torch.device:
    """Where small bookkeeping tensors for a collective on `group` must live: the current CUDA
    device when NCCL is the group's only backend (NCCL takes no CPU tensors), else the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class CommError(RuntimeError):
    """A collective failed: a peer rank died, hung past the timeout, or the group is broken."""


def group_timeout(group):
    """The timeout `group` was created with (a timedelta), or None where torch does not expose it.
    Sub-groups we create inherit it, so they fail exactly when Megatron's own groups would."""
    try:
        dev = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
        return group._get_backend(dev).options._timeout
    except Exception:  # private API; a missing attribute only costs the inheritance
        return None


def _short(ranks) -> str:
    return str(ranks) if len(ranks) <= 8 else f"[{ranks[0]}..{ranks[-1]}] ({len(ranks)})"
