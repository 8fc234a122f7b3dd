"""Routing flips: how far two training runs that agree to rounding may part, and by what rule a
long run is compared against stock.

Per microbatch, from equal weights, the rails dispatcher gives stock's result to 1e-5 in fp32, and
so do stock's own alltoall and allgather dispatchers against each other: their sums run in
different orders. Over a run those rounding-level differences reach the weights, and a token whose
k-th and (k+1)-th router scores nearly tie can pick another expert set in one run than in the
other: a *routing flip*. From there on the runs part by more than rounding (the flipped token's
output, its gradients, then the weights), and a comparison to 1e-5 fails on any BLAS or summation
order change without anything being wrong.

So a long run compares three runs from the same weights and data: the reference (stock
allgather), a control (stock alltoall: the rounding-level pair Megatron-Core itself ships) and
the run under test. `RoutingLog` records every router's top-k choice per forward, `flips_per_forward`
counts the tokens whose expert set differs from the reference's at the same layer, microbatch and
step, and `check_run` applies the rule: steps before the first flip match the reference tightly,
and the test run's flips are bounded by the control's.

`stock_alltoall()` lets Megatron-Core's stock alltoall dispatcher run on CPU gloo ranks: it needs
stand-ins only around its device-to-host copy of the split sizes (../shared/DESIGN.md, 7).
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.distributed as dist

# flips a run under test may have beyond 2 x the control's: a near tie or two can flip in one pair
# of rounding-level runs and not in another (the control had none, the run one); a real divergence
# (tokens dropped or misrouted) makes many more, since from its first microbatch on every later
# router sees different weights
SLACK = 2


class RoutingLog:
    """Every MoE router's top-k expert choice of `model`, per training or evaluation forward:
    `maps[y][c]` is router y's routing map (bool [T, E], this rank's tokens) at its c-th forward.
    Recomputed forwards (activation recompute runs inside a backward pass) are not recorded: they
    repeat a recorded one. `close()` removes the hooks."""

    def __init__(self, models=None, maps=None):
        if maps is not None:  # a slice of another log
            self.maps, self._hooks, self._paused = maps, [], False
            return
        models = models if isinstance(models, (list, tuple)) else [models]
        routers = [m for model in models for m in model.modules() if type(m).__name__ == "TopKRouter"]
        assert routers, "no TopKRouter in the model"
        self.maps: list[list[torch.Tensor]] = [[] for _ in routers]
        self._hooks = [r.register_forward_hook(self._hook(y)) for y, r in enumerate(routers)]
        self._paused = False

    def _hook(self, y: int):
        def record(module, args, out):
            if self._paused or torch._C._current_graph_task_id() != -1:  # a recompute inside the backward pass
                return
            routing_map_TE = out[1]
            self.maps[y].append(routing_map_TE.detach().bool().clone())

        return record

    @contextlib.contextmanager
    def paused(self):
        """Forwards inside are not recorded (an evaluation forward one run makes and another not)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def slice(self, first: int, end: int | None = None) -> "RoutingLog":
        """The forwards [first, end) of every router (a resumed run's part of a whole run)."""
        return RoutingLog(maps=[m[first:end] for m in self.maps])

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def flips_per_forward(got: RoutingLog, ref: RoutingLog) -> np.ndarray:
    """[C] int: for each forward c, the tokens whose expert set differs between `got` and `ref`,
    summed over routers and over the ranks of the default group (a collective; every rank gets
    the same counts). Both logs must hold the same forwards (the same schedule)."""
    assert len(got.maps) == len(ref.maps), (len(got.maps), len(ref.maps))
    calls = {len(m) for m in got.maps + ref.maps}
    assert len(calls) == 1, f"the runs made different numbers of router forwards: {calls}"
    C = calls.pop()
    flips_C = torch.zeros(C, dtype=torch.int64)
    for maps_g, maps_r in zip(got.maps, ref.maps):
        for c, (g_TE, r_TE) in enumerate(zip(maps_g, maps_r)):
            assert g_TE.shape == r_TE.shape, (c, g_TE.shape, r_TE.shape)
            flips_C[c] += int((g_TE != r_TE).any(dim=1).sum())
    dist.all_reduce(flips_C)
    return flips_C.numpy()


def check_run(got: list, ref: list, flips: np.ndarray, control: np.ndarray, what: str,
              rtol: float = 1e-5, atol: float = 0.0) -> int:
    """The long-run rule over I steps; returns the first step with a flip (I if none).

    got, ref: per-step values ([I] floats, or per step a list: a step's microbatch losses);
    flips, control: [I] flips per step of the run under test and of the control (stock alltoall)
    against the reference. Every step before the run's first flip matches the reference to
    rtol / atol (all of them where nothing flipped); the run's total flips are at most
    2 x the control's + SLACK."""
    got_I, ref_I = list(got), list(ref)
    assert len(got_I) == len(ref_I) == len(flips) == len(control), (len(got_I), len(ref_I), len(flips), len(control))
    flipped = np.flatnonzero(flips)
    first = int(flipped[0]) if flipped.size else len(got_I)
    for i in range(first):
        g, r = np.atleast_1d(np.asarray(got_I[i], float)), np.atleast_1d(np.asarray(ref_I[i], float))
        assert g.shape == r.shape and np.all(np.abs(g - r) <= atol + rtol * np.abs(r)), \
            f"{what}: step {i} (before any routing flip) differs from stock:\n{ref_I[:first]}\n{got_I[:first]}"
    check_bound(flips, control, what)
    return first


def check_bound(flips: np.ndarray, control: np.ndarray, what: str) -> None:
    """The run's flips (per step, [I]) at most 2 x the control's + SLACK."""
    bound = 2 * int(control.sum()) + SLACK
    assert flips.sum() <= bound, \
        f"{what}: {int(flips.sum())} routing flips against stock (per step {flips.tolist()}), more than " \
        f"2 x stock alltoall's own {int(control.sum())} (per step {control.tolist()}) + {SLACK}"


def check_against_stock(got: list, ref: list, flips: np.ndarray, control, what: str, rtol: float = 1e-5,
                        atol: float = 0.0) -> int:
    """check_run, with the control run only where it can matter: `control()` gives its [I] flips per
    step and is called only when the run under test flipped more than SLACK tokens (every rank takes
    the same branch: the counts are all-reduced, so a control with collectives inside is safe)."""
    ctl = control() if flips.sum() > SLACK else np.zeros_like(flips)
    return check_run(got, ref, flips, ctl, what, rtol, atol)


def per_step(flips_C: np.ndarray, steps: int) -> np.ndarray:
    """[I]: per-forward counts [C] summed over each step's forwards (C a multiple of I)."""
    assert len(flips_C) % steps == 0, (len(flips_C), steps)
    return flips_C.reshape(steps, -1).sum(axis=1)


def step_flips(got: RoutingLog, ref: RoutingLog, steps: int) -> np.ndarray:
    """[I] int: the tokens routed differently from `ref`, per step, summed over routers and ranks."""
    return per_step(flips_per_forward(got, ref), steps)


class Control:
    """The control of a long-run test: `run()` trains stock alltoall from the reference's weights on
    its data and returns its RoutingLog; `ref` is the reference's log over the same `steps`. Run at
    most once, and only when asked: `control(start)` gives its [I - start] flips per step from
    `start` on (a resumed run's part). A collective: every rank asks at once."""

    def __init__(self, run, ref: RoutingLog, steps: int):
        self._run, self._ref, self._steps, self._flips = run, ref, steps, None

    def __call__(self, start: int = 0) -> np.ndarray:
        if self._flips is None:
            log = self._run()
            self._flips = step_flips(log, self._ref, self._steps)
            log.close()
        return self._flips[start:]


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
    and run inside; megatron_rails.megatron.cpu_shims already applied). Restores everything."""
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
