"""The direct exchange (`comm: direct`): one autograd-aware uneven `all_to_all_single`."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .base import Pending, describe_failure, side_group


def _received(x: torch.Tensor, recv_D: Sequence[int], out: Optional[torch.Tensor]) -> torch.Tensor:
    """The receive buffer: `out` (checked: [sum(recv_D), ...] like x, contiguous) or a new one."""
    shape = (int(sum(recv_D)),) + tuple(x.shape[1:])
    if out is None:
        return x.new_empty(shape)
    if tuple(out.shape) != shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"all-to-all: out must be a contiguous {x.dtype} tensor of shape {list(shape)} on "
                         f"{x.device}, got {out.dtype} {list(out.shape)} on {out.device}")
    return out


def _a2a(x: torch.Tensor, send_D: Sequence[int], recv_D: Sequence[int], group,
         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    out = _received(x, recv_D, out)
    try:
        dist.all_to_all_single(out, x.contiguous(), list(map(int, recv_D)), list(map(int, send_D)), group=group)
    except RuntimeError as err:  # DistBackendError / gloo socket errors / timeouts
        raise describe_failure(group, "all-to-all", err) from err
    return out


@torch.no_grad()
def start_all_to_all(x: torch.Tensor, send_D: Sequence[int], recv_D: Sequence[int], group,
                     out: Optional[torch.Tensor] = None) -> Pending:
    """all_to_all's exchange started in the background on `group` (not differentiable): the
    Pending's wait() gives [sum(recv_D), ...] rows in source-rank order (in `out` where given,
    except on one rank, where x itself comes back)."""
    if dist.get_world_size(group) == 1:
        return Pending.done(x)
    send = x.detach().contiguous()
    out = _received(x, recv_D, out)
    try:
        work = dist.all_to_all_single(out, send, list(map(int, recv_D)), list(map(int, send_D)), group=group,
                                      async_op=True)
    except RuntimeError as err:
        raise describe_failure(group, "a background all-to-all", err) from err
    return Pending(out, work, send=send, group=group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_D, recv_D, group):
        ctx.splits, ctx.group = (send_D, recv_D), group
        return _a2a(x, send_D, recv_D, group)

    @staticmethod
    def backward(ctx, grad):
        send_D, recv_D = ctx.splits
        # the reverse exchange: what we received from rank j goes back to rank j
        return _a2a(grad, recv_D, send_D, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send_D: Sequence[int], recv_D: Sequence[int], group) -> torch.Tensor:
    """Uneven all-to-all along dim 0: x [sum(send_D), ...], rows send_D[j] go to rank j ->
    [sum(recv_D), ...], recv_D[j] rows from rank j, in rank order. Differentiable: the backward is
    the reverse exchange."""
    if dist.get_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(send_D), list(recv_D), group)


@torch.no_grad()
def all_to_all_into(x: torch.Tensor, send_D: Sequence[int], recv_D: Sequence[int], group,
                    out: torch.Tensor) -> torch.Tensor:
    """all_to_all into the receive buffer `out` [sum(recv_D), ...], not differentiable (weights,
    gradients); on one rank x itself comes back."""
    if dist.get_world_size(group) == 1:
        return x
    return _a2a(x.detach(), send_D, recv_D, group, out)


class DirectAllToAll:
    """The plain all-to-all (`comm: direct`)."""

    name = "direct"

    def __init__(self, group):
        self.group = group

    def exchange(self, x: torch.Tensor, send_D: Sequence[int], recv_D: Sequence[int], traffic_DD=None,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: send_D[j] rows for rank j, in rank order -> recv_D[j] rows from rank j, in rank order.
        traffic_DD (the full [D, D] send matrix) is accepted for a uniform interface and unused.
        With `out` (the receive buffer, [sum(recv_D), ...]) not differentiable (weights, gradients);
        on one rank x itself comes back."""
        if out is None:
            return all_to_all(x, send_D, recv_D, self.group)
        return all_to_all_into(x, send_D, recv_D, self.group, out)

    def exchange_async(self, x: torch.Tensor, send_D: Sequence[int], recv_D: Sequence[int],
                       traffic_DD=None, out: Optional[torch.Tensor] = None) -> Pending:
        """exchange() started in the background on a side group (not differentiable; for weights),
        into `out` where given."""
        return start_all_to_all(x, send_D, recv_D, side_group(self.group), out)

    def sprays(self, traffic_DD) -> bool:
        return False
