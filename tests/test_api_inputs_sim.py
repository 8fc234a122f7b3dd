"""The simulator's and the trace module's Python API on bad input: SimOptions, Setup.from_run_config's
slots, Workload's trace, simulate_run's arguments, save_trace / load_trace. Bad input raises SimError
(TraceError for traces) naming the argument; numpy scalars, numpy bools and tuples work as plain values."""
import types
from pathlib import Path

import numpy as np
import pytest

import megatron_rails.sim.run as run_mod
from megatron_rails.config.run import load_run_config
from megatron_rails.core.errors import InputError
from megatron_rails.core.trace import TraceError, load_trace, save_trace
from megatron_rails.sim.model import Setup, SimError, SimOptions
from megatron_rails.sim.run import Workload, simulate_run

ROOT = Path(__file__).resolve().parents[1]
MINI = str(ROOT / "configs" / "mini" / "mini-mixtral.yaml")


@pytest.fixture(scope="module")
def rc():
    return load_run_config(MINI)


@pytest.fixture(scope="module")
def setup(rc):
    return Setup.from_run_config(rc)


@pytest.fixture(scope="module")
def wl(setup):
    return Workload(setup)


@pytest.fixture
def frozen_clock(monkeypatch):
    """Planner wall times of 0: simulate_run's results depend on its input only, so runs compare exactly."""
    clock = types.SimpleNamespace(perf_counter=lambda: 0.0, perf_counter_ns=lambda: 0)
    monkeypatch.setattr(run_mod, "time", clock)


def test_errors_are_input_errors():
    assert issubclass(SimError, InputError) and issubclass(TraceError, InputError)


# -- 5. SimOptions ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, named", [
    (dict(grad_bytes=-4), "grad_bytes"), (dict(grad_bytes=0), "grad_bytes"), (dict(grad_bytes=4.0), "grad_bytes"),
    (dict(grad_bytes=True), "grad_bytes"), (dict(dtype_bytes=0), "dtype_bytes"), (dict(dtype_bytes="2"), "dtype_bytes"),
    (dict(dtype_bytes=2.5), "dtype_bytes"), (dict(dtype_bytes=10**6), "dtype_bytes"),
    (dict(mfu="0.5"), "mfu"), (dict(mfu=None), "mfu"), (dict(mfu=True), "mfu"), (dict(mfu=0.0), "mfu"),
    (dict(mfu=1.5), "mfu"), (dict(mfu=float("nan")), "mfu"), (dict(mfu=np.float64("inf")), "mfu"),
    (dict(overlap="always"), "overlap"), (dict(overlap=None), "overlap"), (dict(overlap=["none"]), "overlap"),
    (dict(weight_sync="step"), "weight-sync"), (dict(a2a_model=1), "a2a-model"),
    (dict(dedup=1), "dedup"), (dict(dedup="on"), "dedup"), (dict(dedup=None), "dedup"),
])
def test_simoptions_refused(kw, named):
    with pytest.raises(SimError, match=named):
        SimOptions(**kw)


def test_simoptions_numpy_scalars_are_plain():
    o = SimOptions(mfu=np.float32(0.25), dtype_bytes=np.int64(2), grad_bytes=np.uint8(4), dedup=np.True_,
                   overlap=np.str_("weights"))
    assert o == SimOptions(mfu=0.25, dtype_bytes=2, grad_bytes=4, dedup=True, overlap="weights")
    assert type(o.mfu) is float and type(o.dtype_bytes) is int and type(o.dedup) is bool
    assert SimOptions(dedup=np.False_).dedup is False
    assert SimOptions(mfu=1).mfu == 1  # an int in range is a number


# -- 6. simulate_run's arguments -------------------------------------------------------------------------------

@pytest.mark.parametrize("steps", ["1", None, 1.5, True, False, 0, -2, 10**9, np.float64(1.0)])
def test_simulate_run_steps_refused(setup, wl, steps):
    with pytest.raises(SimError, match="steps"):
        simulate_run(setup, SimOptions(), "none", "direct", steps, wl)


@pytest.mark.parametrize("policies, comms, named", [
    (None, "direct", "policies"), ([1], "direct", "policies"), (3, "direct", "policies"),
    ("none", None, "comm"), ("none", [None], "comm"), ("", "direct", "policies"), ("none", " , ", "comm"),
    ("bogus", "direct", "policy"),
])
def test_simulate_run_names_refused(setup, wl, policies, comms, named):
    with pytest.raises(SimError, match=named):
        simulate_run(setup, SimOptions(), policies, comms, 1, wl)


def test_simulate_run_objects_refused(setup, wl, rc):
    with pytest.raises(SimError, match="setup"):
        simulate_run(rc, SimOptions(), "none", "direct", 1, wl)
    with pytest.raises(SimError, match="opts"):
        simulate_run(setup, {"mfu": 0.5}, "none", "direct", 1, wl)
    with pytest.raises(SimError, match="workload"):
        simulate_run(setup, SimOptions(), "none", "direct", 1, "zipf:1.2")
    with pytest.raises(SimError, match="progress"):
        simulate_run(setup, SimOptions(), "none", "direct", 1, wl, progress=5)


def test_negative_grad_bytes_no_longer_reaches_the_model(setup, wl):
    with pytest.raises(SimError, match="grad_bytes"):
        simulate_run(setup, SimOptions(grad_bytes=-4, weight_sync="microbatch"), "none,ultraep", "direct", 1, wl)


def test_numpy_and_tuples_match_plain_values(setup, wl, frozen_clock):
    plain = simulate_run(setup, SimOptions(mfu=0.4, dedup=True, weight_sync="microbatch"), "none,ultraep",
                         "direct,rails", 2, wl)
    fancy = simulate_run(setup, SimOptions(mfu=np.float64(0.4), dedup=np.True_, weight_sync=np.str_("microbatch")),
                         ("none", "ultraep"), np.array(["direct", "rails"]), np.int64(2), wl)
    assert fancy == plain
    assert plain["rows"][1]["iteration_ms"] > 0 and type(fancy["options"]["steps"]) is int


# -- 7. Setup.from_run_config's slots ---------------------------------------------------------------------------

@pytest.mark.parametrize("slots", [2.7, 2.0, "2", "x", -1, 1025, 10**30, True, np.float64(2)])
def test_slots_refused(rc, slots):
    with pytest.raises(SimError, match="slots"):
        Setup.from_run_config(rc, slots)


def test_slots_numpy_and_none(rc, setup):
    assert Setup.from_run_config(rc, np.int64(3)) == Setup.from_run_config(rc, 3)
    assert type(Setup.from_run_config(rc, np.int32(3)).policy.slots) is int
    assert Setup.from_run_config(rc, None) == setup
    assert Setup.from_run_config(rc, 0).policy.slots == 0
    with pytest.raises(SimError, match="RunConfig"):
        Setup.from_run_config(MINI)


# -- 8. Workload's trace ----------------------------------------------------------------------------------------

def _trace(setup, steps=2, layers=1, seed=0):
    return np.random.default_rng(seed).integers(0, 20, (steps, layers, setup.ep, setup.experts))


@pytest.mark.parametrize("make", [
    lambda s: -np.ones((1, 1, s.ep, s.experts), int),
    lambda s: np.full((1, 1, s.ep, s.experts), 0.5),
    lambda s: np.full((1, 1, s.ep, s.experts), np.nan),
    lambda s: np.ones((s.ep, s.experts), int),
    lambda s: np.zeros((0, 1, s.ep, s.experts), int),
    lambda s: np.ones((1, 1, s.ep, s.experts), bool),
    lambda s: np.full((1, 1, s.ep, s.experts), "1"),
    lambda s: np.full((1, 1, s.ep, s.experts), 2**64 - 1, np.uint64),
    lambda s: [1, 2, 3],
    lambda s: [[1, 2], [3]],
    lambda s: "trace.npz",
])
def test_trace_refused(setup, make):
    with pytest.raises(SimError, match="trace"):
        Workload(setup, trace=make(setup))


def test_trace_array_likes_match(setup, frozen_clock):
    t = _trace(setup)
    want = simulate_run(setup, SimOptions(), "none,eplb", "direct", 2, Workload(setup, trace=t))
    for same in (t.tolist(), t.astype(np.float64), t.astype(np.uint16), t.astype(np.int32)):
        wl = Workload(setup, trace=same, raw=np.False_)
        assert wl.trace.dtype == np.int64 and np.array_equal(wl.trace, t)
        assert simulate_run(setup, SimOptions(), ["none", "eplb"], ("direct",), 2, wl) == want


def test_workload_fields_refused(setup):
    with pytest.raises(SimError, match="raw"):
        Workload(setup, trace=_trace(setup), raw="yes")
    with pytest.raises(SimError, match="setup"):
        Workload("mini-mixtral")


# -- 10. save_trace / load_trace --------------------------------------------------------------------------------

def test_save_trace_bad_counts(tmp_path):
    for c in (np.zeros((0, 1, 4, 8), int), np.full((1, 1, 4, 8), 2**64 - 1, np.uint64), -np.ones((1, 1, 4, 8), int),
              np.ones((4, 8), int), np.full((1, 1, 4, 8), 1.0), [[1], [2, 3]]):
        with pytest.raises(TraceError, match="counts"):
            save_trace(tmp_path / "t.npz", c)
    assert not (tmp_path / "t.npz").exists()


@pytest.mark.parametrize("meta, named", [
    ({"topk": "x"}, "topk"), ({"topk": -1}, "topk"), ({"topk": 0}, "topk"), ({"topk": 1.5}, "topk"),
    ({"topk": True}, "topk"), ({"hidden": -3}, "hidden"), ({"tokens_per_rank": -220}, "tokens_per_rank"),
    ([1], "meta"), ("topk=2", "meta"), ({1: 2}, "meta"), ({"x": object()}, "'x'"), ({"x": {1: 2}}, "'x'"),
    ({"steps": 99, "ranks": 1}, "steps"), ({"ranks": 1}, "ranks"), ({"experts": 9}, "experts"),
    ({"layers": True}, "layers"), ({"format": "other"}, "format"), ({"version": 2}, "version"),
    ({"policy": 3}, "policy"), ({"source": None}, "source"), ({"x": float("nan")}, "meta"),
])
def test_save_trace_bad_meta(tmp_path, meta, named):
    with pytest.raises(TraceError, match=named):
        save_trace(tmp_path / "t.npz", np.ones((1, 1, 4, 8), int), meta)
    assert not (tmp_path / "t.npz").exists()


def test_save_trace_numpy_meta_round_trip(tmp_path):
    c = np.random.default_rng(1).integers(0, 9, (3, 2, 4, 8))
    plain = {"topk": 2, "hidden": 64, "policy": "none", "source": "test", "steps": 3, "ranks": 4, "extra": [1, 2.5]}
    fancy = {"topk": np.int64(2), "hidden": np.int32(64), "policy": np.str_("none"), "source": "test",
             "steps": np.int64(3), "ranks": np.uint8(4), "extra": (np.int16(1), np.float32(2.5))}
    got_plain = load_trace(save_trace(tmp_path / "a.npz", c, plain))
    got_fancy = load_trace(save_trace(tmp_path / "b.npz", c.astype(np.uint32), fancy))
    assert np.array_equal(got_plain[0], c) and np.array_equal(got_fancy[0], c)
    assert got_fancy[1] == got_plain[1]
    meta = got_plain[1]
    assert (meta["steps"], meta["layers"], meta["ranks"], meta["experts"]) == (3, 2, 4, 8)
    assert meta["tokens_per_rank"] == int(c[0, 0].sum(axis=1).max()) // 2


def test_save_trace_uint64_within_int64(tmp_path):
    c = np.full((1, 1, 2, 2), 7, np.uint64)
    assert np.array_equal(load_trace(save_trace(tmp_path / "t.npz", c))[0], c.astype(np.int64))


def test_trace_paths_refused():
    c = np.ones((1, 1, 4, 8), int)
    for bad in (None, 3, ""):
        with pytest.raises(TraceError, match="path"):
            save_trace(bad, c)
        with pytest.raises(TraceError, match="path"):
            load_trace(bad)
