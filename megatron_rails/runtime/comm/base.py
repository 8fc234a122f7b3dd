"""Collective helpers shared by the exchanges: the count all-gather, where bookkeeping tensors
live, the group timeout, `CommError` for a failed collective, and what an exchange started in the
background (`Pending`, on a `side_group`) needs."""
from __future__ import annotations

import os
import sys

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
        raise describe_failure(group, "all-gather of token counts", err) from err
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


# words of the errors a dead, hung or unreachable peer leaves (gloo, NCCL, the store)
_PEER_WORDS = ("timed out", "timeout", "connection", "socket", "peer", "closed", "abort")


def describe_failure(group, what: str, err: Exception) -> CommError:
    """A CommError naming the collective, the group's ranks, the likely cause and the underlying
    error's first line: a peer's failure only where the error is one (torch's distributed errors,
    or words a lost peer leaves); anything else (a tensor on a device the backend does not take,
    say) is reported as the backend rejecting the call, not blamed on a peer."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    first = str(err).splitlines()[0] if str(err) else ""
    peer = isinstance(err, dist.DistError) or any(w in first.lower() for w in _PEER_WORDS)
    cause = "a peer rank probably died or timed out" if peer else "the backend rejected the call"
    return CommError(f"rank {dist.get_rank()}: {what} over ranks {_short(ranks)} failed: {cause} "
                     f"({type(err).__name__}: {first})")


def leave(code: int = 0):
    """End this rank's process now, with exit status `code`: destroy every process group, flush
    stdout and stderr, and exit without interpreter finalization. For processes this project starts
    (its spawned ranks and its torchrun entry points), after their last collective.

    Why not a normal exit: a gloo worker thread drops its reference to a finished collective (and
    the tensors it holds, which takes the GIL) after the caller already saw it complete. Under CPU
    contention that can come after interpreter finalization began; the thread then exits inside a
    noexcept frame and the process aborts ("terminate called without an active exception", SIGABRT;
    a core dump of one of our 4-rank tests shows it, and pytorch/pytorch PR 179291 describes it).
    gloo has no shutdown that joins those threads, so the only safe exit skips finalization."""
    if dist.is_initialized():
        dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or redirected to a closed pipe: nothing to keep
            pass
    os._exit(code)


class Pending:
    """An exchange running in the background: `wait()` blocks until it is done and returns its
    result, `then(out)` applied once (a reordering of the received rows). Holds the send buffer
    until then (NCCL reads it asynchronously)."""

    def __init__(self, out: torch.Tensor, work=None, then=None, send=None, group=None):
        self._out, self._work, self._then, self._send, self._group = out, work, then, send, group

    @classmethod
    def done(cls, out: torch.Tensor) -> "Pending":
        return cls(out)

    @property
    def ready(self) -> bool:
        return self._work is None

    def map(self, then) -> "Pending":
        """This exchange's result passed through then(result) when waited for."""
        prev = self._then
        self._then = then if prev is None else (lambda out: then(prev(out)))
        return self

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            try:
                self._work.wait()
            except RuntimeError as err:
                raise describe_failure(self._group, "a background all-to-all", err) from err
            self._work = self._send = None
        if self._then is not None:
            self._out, self._then = self._then(self._out), None
        return self._out


_SIDE: dict = {}  # EP group ranks -> a second process group over the same ranks
_NODE: dict = {}  # (EP group ranks, G) -> this rank's node group


def node_group(group, G: int):
    """The process group of this rank's node within `group`: the G consecutive EP ranks it shares a
    node with (`group` itself when it is one node). Created once per process, only its members
    taking part, with `group`'s timeout."""
    ranks = tuple(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()))
    if G >= len(ranks):
        return group
    key = (ranks, G)
    if key not in _NODE:
        lo = (ranks.index(dist.get_rank()) // G) * G
        members = list(ranks[lo:lo + G])
        _NODE[key] = dist.new_group(members, timeout=group_timeout(group), use_local_synchronization=True)
    return _NODE[key]


def side_group(group):
    """A second process group over `group`'s ranks, created once per process (only its members
    take part; the runtime makes it when it builds a layer that moves weights), for exchanges that
    run in the background: its own gloo threads / NCCL communicator and stream, so they proceed
    beside the token all-to-alls on `group` instead of queueing with them. Inherits the group's
    timeout."""
    ranks = tuple(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()))
    if ranks not in _SIDE:
        _SIDE[ranks] = dist.new_group(list(ranks), timeout=group_timeout(group), use_local_synchronization=True)
    return _SIDE[ranks]
