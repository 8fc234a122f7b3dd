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

`stock_alltoall()` (megatron_rails.megatron.cpu_shims) lets Megatron-Core's stock alltoall dispatcher
run on CPU gloo ranks; `RoutingLog` is megatron_rails.megatron.routing_log's.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from megatron_rails.megatron.cpu_shims import stock_alltoall  # noqa: F401  (the tests' stand-ins)
from megatron_rails.megatron.routing_log import RoutingLog

# flips a run under test may have beyond 2 x the control's: a near tie or two can flip in one pair
# of rounding-level runs and not in another (the control had none, the run one); a real divergence
# (tokens dropped or misrouted) makes many more, since from its first microbatch on every later
# router sees different weights
SLACK = 2


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


class Online:
    """The rule applied as a test goes, for tests that compare every microbatch or step at once:
    the run under test, the reference (stock allgather) and the control (stock alltoall) trained
    side by side, each with its RoutingLog. `update()` after each compared forward (or several)
    counts the new forwards' flips of the run and of the control (collectives: every rank calls
    it at the same points) and says whether tight checks still hold (no flip of the run yet);
    `check(what)` at the end bounds the run's flips by the control's."""

    def __init__(self, got: RoutingLog, ref: RoutingLog, control: RoutingLog):
        self.logs, self.seen, self.flips, self.control = (got, ref, control), 0, 0, 0

    def update(self) -> bool:
        got, ref, ctl = self.logs
        end = len(ref.maps[0])
        self.flips += int(flips_per_forward(got.slice(self.seen, end), ref.slice(self.seen, end)).sum())
        self.control += int(flips_per_forward(ctl.slice(self.seen, end), ref.slice(self.seen, end)).sum())
        self.seen = end
        return self.flips == 0

    def check(self, what: str) -> None:
        check_bound(np.array([self.flips]), np.array([self.control]), what)
        for log in self.logs:
            log.close()
