"""The long-run rule (tests/flips.py) on 4 CPU ranks, a tiny Mixtral-shaped GPTModel (the demo
trainer's, 2 MoE layers, 8 experts top-2, skewed routing), 6 steps of 2 microbatches:

* the CPU stand-ins run Megatron-Core's stock alltoall dispatcher as stock: its per-step losses
  equal the allgather dispatcher's to 1e-5 until a routing flip, and its flips are few;
* the flip count agrees with a direct count on routing maps built by hand;
* a dispatcher that really diverges (one token's expert output dropped; every output 1% off)
  fails the rule against stock, while the shipped default configuration passes it."""
import numpy as np
import pytest

from moe_harness import spawn

STEPS, MICRO = 6, 2


def _model(world, kind: str):
    """The demo trainer's model under `kind`: stock allgather, stock alltoall or a policy preset."""
    import dataclasses

    import flips
    import megatron_rails
    from megatron_rails.core.policy import as_policy
    from megatron_rails.demo.train import DemoShape, build_model

    if kind == "allgather":
        return build_model(DemoShape(), world, "allgather")
    if kind == "alltoall":
        with flips.stock_alltoall():
            return build_model(DemoShape(), world, "alltoall")
    megatron_rails.install(dataclasses.replace(as_policy(kind), ranks_per_node=2))
    try:
        return build_model(DemoShape(), world, "alltoall")
    finally:
        megatron_rails.uninstall()


def _run(rank, world, kind: str, mutate=None):
    """(per-step losses, RoutingLog) of `kind` (see _model); mutate: a function applied to the
    rails dispatcher's combined output [S, B, H] (a broken dispatcher)."""
    import contextlib

    import flips
    from megatron_rails.demo.train import DemoShape, train_steps
    from megatron_rails.megatron.dispatcher import RailsTokenDispatcher

    model = _model(world, kind)
    log = flips.RoutingLog(model)
    old = RailsTokenDispatcher.combine_postprocess
    if mutate:
        RailsTokenDispatcher.combine_postprocess = lambda self, h: mutate(old(self, h))
    try:
        with flips.stock_alltoall() if kind == "alltoall" else contextlib.nullcontext():
            losses, _ = train_steps(model, DemoShape(), STEPS, rank, world, microbatches=MICRO)
    finally:
        RailsTokenDispatcher.combine_postprocess = old
    log.close()
    return losses, log


def _hand_count(rank, world):
    """flips_per_forward against a count by hand: rank r's maps differ from the reference in r + 1
    tokens at forward 1 of router 0 (and nowhere else), so forward 1 counts 1 + 2 + ... + world."""
    import torch

    import flips

    class Log:  # RoutingLog's data without a model
        def __init__(self, maps):
            self.maps = maps

    g = torch.Generator().manual_seed(rank)
    ref = [[torch.rand(16, 8, generator=g) < 0.25 for _ in range(3)] for _ in range(2)]
    got = [[m.clone() for m in router] for router in ref]
    got[0][1][: rank + 1] = ~got[0][1][: rank + 1]
    want = np.array([0, sum(range(1, world + 1)), 0])
    assert flips.flips_per_forward(Log(got), Log(ref)).tolist() == want.tolist()
    # the demo's count: the same, from every rank's maps gathered
    from megatron_rails.megatron.routing_log import RoutingLog, flips_per_forward

    assert flips_per_forward(RoutingLog(maps=got).gathered(), RoutingLog(maps=ref).gathered()).tolist() == want.tolist()


def _stock_pair(rank, world):
    import flips

    _hand_count(rank, world)
    ref, ref_log = _run(rank, world, "allgather")
    ctl, ctl_log = _run(rank, world, "alltoall")
    control = flips.per_step(flips.flips_per_forward(ctl_log, ref_log), STEPS)
    first = flips.check_run(ctl, ref, control, np.zeros_like(control), "stock alltoall vs allgather")
    assert control.sum() <= flips.SLACK, control
    assert ref[-1] < ref[0], ref  # it trains
    assert first == STEPS or first > 0  # (flips, if any, after step 0: the stand-ins keep the routing)


def test_stock_alltoall_runs_as_stock_on_cpu():
    spawn(_stock_pair, 4)


def _drop_token(out):
    out = out.clone()
    out.view(-1, out.shape[-1])[0] = 0.0  # the first token's expert output lost
    return out


def _off_by_1pct(out):
    return out * 1.01


def _mutant(rank, world, name):
    import flips

    mutate = {"drop_token": _drop_token, "off_by_1%": _off_by_1pct, "none": None}[name]
    ref, ref_log = _run(rank, world, "allgather")
    got, got_log = _run(rank, world, "default", mutate)
    found = flips.per_step(flips.flips_per_forward(got_log, ref_log), STEPS)

    def control():
        _, ctl_log = _run(rank, world, "alltoall")
        return flips.per_step(flips.flips_per_forward(ctl_log, ref_log), STEPS)

    if mutate is None:
        flips.check_against_stock(got, ref, found, control, "default")
    else:
        with pytest.raises(AssertionError, match="routing flips against stock|differs from stock"):
            flips.check_against_stock(got, ref, found, control, f"default, {name}")


@pytest.mark.parametrize("name", ["none", "drop_token", "off_by_1%"])
def test_divergence_is_caught_and_stock_rounding_is_not(name):
    spawn(_mutant, 4, name)
