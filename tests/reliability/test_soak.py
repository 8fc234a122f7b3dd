"""A short soak in the suite (the full one is `megatron-rails soak`, results in docs/reliability.md):
drifting planner calls with every plan validated and its route recounted, and dispatcher steps on
4 gloo ranks compared with the stock allgather dispatcher every step, every policy and both comms."""
from megatron_rails.reliability.soak import CASES, dispatcher_soak, planner_soak


def test_planner_soak_short():
    res = planner_soak(calls=120, ranks=16, experts=32)
    assert res["failures"] == [], res["failures"][:3]
    assert res["worst_max_over_mean"]["ultraep"] <= res["worst_max_over_mean"]["none"]


def test_dispatcher_soak_short():
    res = dispatcher_soak(steps=len(CASES) + 2, world=4)
    assert res["failures"] == [], res["failures"][:3]
    # memory stays flat after warm-up on every rank (a per-step leak of a layer-sized buffer, say a
    # kept plan or metric record holding tensors, would add megabytes per step)
    growth = [end - warm for end, warm in zip(res["rss_mb_end"], res["rss_mb_after_warmup"])]
    assert len(growth) == 4 and max(growth) < 64, growth
