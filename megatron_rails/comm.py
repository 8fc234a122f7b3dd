"""Device-agnostic collectives for the dispatcher (gloo on CPU, NCCL on GPU), autograd-aware.

This is the one place the token and weight all-to-alls go through; a communication backend (the
direct all-to-all here, RailS's multi-phase schedule in rails/alltoall.py) implements `exchange`.
"""
from __future__ import annotations

from typing import Sequence

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


def _a2a(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group) -> torch.Tensor:
    out = x.new_empty((int(sum(out_splits)),) + tuple(x.shape[1:]))
    try:
        dist.all_to_all_single(out, x.contiguous(), list(map(int, out_splits)), list(map(int, in_splits)),
                               group=group)
    except RuntimeError as err:  # DistBackendError / gloo socket errors / timeouts
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        raise CommError(f"rank {dist.get_rank()}: all-to-all over ranks {_short(ranks)} failed: a peer rank "
                        f"probably died or timed out ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
                        ) from err
    return out


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


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _a2a(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        # the reverse exchange: what we received from rank j goes back to rank j
        return _a2a(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group) -> torch.Tensor:
    """Uneven all-to-all along dim 0: rows in_splits[j] of x go to rank j; out_splits[j] rows come
    from rank j. Differentiable: the backward is the reverse exchange."""
    if dist.get_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


class DirectAllToAll:
    """The plain all-to-all (`comm: direct`)."""

    name = "direct"

    def __init__(self, group):
        self.group = group

    def exchange(self, x: torch.Tensor, send_D: Sequence[int], recv_D: Sequence[int], traffic_DD=None) -> torch.Tensor:
        """x: send_D[j] rows for rank j, in rank order -> recv_D[j] rows from rank j, in rank order.
        traffic_DD (the full [D, D] send matrix) is accepted for a uniform interface and unused."""
        return all_to_all(x, recv_D, send_D, self.group)

    def sprays(self, traffic_DD) -> bool:
        return False


def make_comm(pcfg, group):
    """The communication backend a policy config asks for, on the EP process group."""
    if pcfg.comm == "direct":
        return DirectAllToAll(group)
    from .rails.alltoall import RailsAllToAll
    from .rails.topology import Topology

    D = dist.get_world_size(group)
    G = min(pcfg.ranks_per_node or D, D)
    if D % G:
        from .config import ConfigError

        raise ConfigError(f"comm: rails needs ranks_per_node ({G}) to divide the expert-parallel size ({D})")
    return RailsAllToAll(group, Topology(name="ep-group", gpus_per_node=G, rails_per_node=G),
                         tolerance=float(pcfg.rails_tolerance))
