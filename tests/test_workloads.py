"""Tests for megatron_rails.core.workloads: invariants, determinism, skew statistics, exactness, files.

Statistical bounds are several standard deviations wide and the seeds are fixed, so they cannot flake.
"""
from __future__ import annotations

import itertools
import json
import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_rails.core import workloads as wl
from megatron_rails.core.workloads import (SKEW_FORMS, Skew, WorkloadError, WorkloadSpec, counts, load_counts, parse_skew,
                                           save_counts, trace)


def mixtral_like(num_ranks, tokens_per_rank=4096, skew="uniform", *, seed=0, num_layers=1):
    """Mixtral 8x7B / 8x22B routing: 8 experts, top-2."""
    return WorkloadSpec(num_ranks, 8, 2, tokens_per_rank, skew, seed, num_layers)


def deepseek_like(num_ranks, tokens_per_rank=4096, skew="uniform", *, seed=0, num_layers=1):
    """DeepSeek-V3 routing: 256 routed experts, top-8."""
    return WorkloadSpec(num_ranks, 256, 8, tokens_per_rank, skew, seed, num_layers)


def imbalance(counts_DE: np.ndarray) -> float:
    load_E = counts_DE.sum(axis=0)
    return float(load_E.max() / load_E.mean())


# -- parsing and specs ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, want", [
    ("uniform", Skew("uniform")),
    (" ONE ", Skew("one")),
    ("zipf:1", Skew("zipf", s=1.0)),
    ("drift:1.5", Skew("drift", s=1.5, period=wl.DRIFT_PERIOD)),
    ("drift:0.8:16", Skew("drift", s=0.8, period=16)),
    ("bursty:0", Skew("bursty", s=0.0, frac=wl.BURST_FRAC, rate=wl.BURST_RATE)),
    ("bursty:1.2:0.7:0.1", Skew("bursty", s=1.2, frac=0.7, rate=0.1)),
    ("file:/tmp/a:b.npy", Skew("file", path="/tmp/a:b.npy")),
])
def test_parse_skew_accepts(text, want):
    got = parse_skew(text)
    assert got == want
    assert parse_skew(str(got)) == got  # the canonical text round-trips


@pytest.mark.parametrize("text", [
    "", "zipf", "zipf:", "zipf:0", "zipf:-1", "zipf:abc", "zipf:nan", "zipf:inf", "zipf:11", "zipf:1:2",
    "drift:1:0", "drift:1:2.5", "drift:1:x", "bursty", "bursty:-1", "bursty:1:0", "bursty:1:1.5",
    "bursty:1:0.5:0", "bursty:1:0.5:0.5:1", "one:3", "uniform:1", "gauss:1", "file:",
])
def test_parse_skew_rejects_with_clear_message(text):
    with pytest.raises(ValueError) as info:
        parse_skew(text)
    assert repr(text) in str(info.value) and SKEW_FORMS in str(info.value)


def test_parse_skew_rejects_non_string():
    with pytest.raises(WorkloadError, match="must be a string"):
        parse_skew(1.5)


def test_spec_validation_and_canonical_skew():
    assert WorkloadSpec(4, 8, 2, 16, "zipf:1") == WorkloadSpec(4, 8, 2, 16, "zipf:1.0")
    assert WorkloadSpec(np.int64(4), 8, 2, 16).num_ranks == 4
    assert WorkloadSpec(4, 8, 2, 16).routed_per_rank == 32
    for args, match in [((0, 8, 2, 16), "num_ranks"), ((4, 8, 9, 16), "topk=9 exceeds"),
                        ((4, 8, 0, 16), "topk"), ((4, 8, 2, -1), "tokens_per_rank"),
                        ((4, 8, 2, 2.5), "tokens_per_rank"), ((4, True, 2, 16), "num_experts"),
                        ((4, 8, 2, 16, "zipf:0"), "bad skew"), ((4, 8, 2, 16, "uniform", -1), "seed"),
                        ((4, 8, 2, 16, "uniform", 0, 0), "num_layers")]:
        with pytest.raises(WorkloadError, match=match):
            WorkloadSpec(*args)


def test_presets():
    m = mixtral_like(8, skew="zipf:1.2", num_layers=4)
    assert (m.num_experts, m.topk, m.tokens_per_rank, m.num_layers, m.skew) == (8, 2, 4096, 4, "zipf:1.2")
    d = deepseek_like(16, tokens_per_rank=1024, seed=3)
    assert (d.num_experts, d.topk, d.tokens_per_rank, d.seed, d.skew) == (256, 8, 1024, 3, "uniform")


# -- invariants and determinism ---------------------------------------------------------------------------------

SKEWS = st.one_of(
    st.sampled_from(["uniform", "one"]),
    st.floats(0.05, 3.0).map(lambda s: f"zipf:{s:.3f}"),
    st.tuples(st.floats(0.05, 3.0), st.integers(1, 40)).map(lambda t: f"drift:{t[0]:.3f}:{t[1]}"),
    st.tuples(st.floats(0.0, 3.0), st.floats(0.05, 1.0), st.floats(0.05, 1.0)).map(
        lambda t: f"bursty:{t[0]:.3f}:{t[1]:.3f}:{t[2]:.3f}"),
)


@st.composite
def specs(draw):
    E = draw(st.integers(1, 40))
    return WorkloadSpec(num_ranks=draw(st.integers(1, 9)), num_experts=E, topk=draw(st.integers(1, min(E, 8))),
                        tokens_per_rank=draw(st.integers(0, 300)), skew=draw(SKEWS),
                        seed=draw(st.integers(0, 2**40)), num_layers=draw(st.integers(1, 3)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(), step=st.integers(0, 10**6), data=st.data())
def test_counts_invariants(spec, step, data):
    layer = data.draw(st.integers(0, spec.num_layers - 1))
    c = counts(spec, step, layer)
    assert c.shape == (spec.num_ranks, spec.num_experts) and c.dtype == np.int64
    assert np.all(c.sum(axis=1) == spec.tokens_per_rank * spec.topk)
    assert c.min() >= 0 and c.max() <= spec.tokens_per_rank
    assert np.array_equal(c, counts(spec, step, layer))


@pytest.mark.parametrize("skew", ["uniform", "zipf:1.2", "zipf:3", "zipf:10", "drift:1:7", "bursty:0.5:0.8:1", "one"])
def test_large_invariants(skew):
    spec = deepseek_like(64, 2048, skew)
    c = counts(spec, step=5)
    assert np.all(c.sum(axis=1) == 2048 * 8) and c.max() <= 2048 and c.min() >= 0


def test_topk_equal_to_experts_picks_every_expert():
    c = counts(WorkloadSpec(3, 6, 6, 50, "zipf:2"))
    assert np.all(c == 50)


def test_zero_tokens():
    assert not counts(WorkloadSpec(3, 6, 2, 0, "zipf:2")).any()


def test_determinism_and_variation():
    spec = deepseek_like(16, 1024, "zipf:1.0", num_layers=2)
    base = counts(spec, 3, 1)
    assert np.array_equal(base, counts(deepseek_like(16, 1024, "zipf:1", num_layers=2), 3, 1))
    for other in (counts(spec, 4, 1), counts(spec, 3, 0),
                  counts(deepseek_like(16, 1024, "zipf:1.0", seed=1, num_layers=2), 3, 1),
                  counts(deepseek_like(16, 1024, "drift:1.0", num_layers=2), 3, 1)):
        assert not np.array_equal(base, other)
    assert len({row.tobytes() for row in base}) == 16  # every rank draws its own tokens


def test_trace_matches_counts():
    spec = mixtral_like(4, 256, "bursty:1:0.5:0.5", num_layers=3)
    tr = trace(spec, 5)
    assert tr.shape == (5, 3, 4, 8) and tr.dtype == np.int64
    for s, l in itertools.product(range(5), range(3)):
        assert np.array_equal(tr[s, l], counts(spec, s, l))
    assert trace(spec, 0).shape == (0, 3, 4, 8)
    with pytest.raises(WorkloadError, match="layer 3 out of range"):
        counts(spec, 0, 3)


# -- skew statistics ----------------------------------------------------------------------------------------------

def test_uniform_is_balanced():
    # per-expert load ~ 32768 +- 181; max over 256 experts is ~1.02x the mean, 1.05 is > 8 sigma
    assert imbalance(counts(deepseek_like(64, 16384))) < 1.05
    assert imbalance(counts(mixtral_like(64, 16384))) < 1.01


def test_zipf_skew_grows_with_s():
    loads = [counts(deepseek_like(32, 4096, f"zipf:{s}")).sum(axis=0) for s in (0.2, 0.5, 1.0, 1.5, 2.0, 3.0)]
    max_over_mean = [x.max() / x.mean() for x in loads]
    cv = [x.std() / x.mean() for x in loads]  # keeps growing after the hottest expert saturates
    assert max_over_mean[0] > 2 and all(b > a * 1.2 for a, b in zip(max_over_mean[:3], max_over_mean[1:4]))
    assert all(b >= a for a, b in zip(max_over_mean, max_over_mean[1:])) and max_over_mean[-1] <= 256 / 8
    assert all(b > a * 1.05 for a, b in zip(cv, cv[1:])), cv


def test_zipf_hot_expert_is_permuted():
    hot = {int(counts(mixtral_like(8, 512, "zipf:2", seed=s)).sum(axis=0).argmax()) for s in range(12)}
    assert len(hot) >= 4
    spec = deepseek_like(8, 512, "zipf:2", num_layers=6)
    assert len({int(counts(spec, 0, l).sum(axis=0).argmax()) for l in range(6)}) >= 4


def test_one_puts_every_token_on_one_expert():
    spec = deepseek_like(16, 1024, "one", num_layers=2)
    for layer in (0, 1):
        c = counts(spec, 0, layer)
        hot = int(c.sum(axis=0).argmax())
        assert np.all(c[:, hot] == 1024) and np.all(c.max(axis=1) >= 1024)
        others = np.delete(c, hot, axis=1)  # the other 7 choices uniform over 255 experts: 28.1 per cell
        assert abs(others.mean() - 1024 * 7 / 255) < 1e-9 and others.max() < 80


def test_drift_moves_the_hot_expert():
    spec = mixtral_like(8, 2048, "drift:2:8")
    hot = [int(counts(spec, s).sum(axis=0).argmax()) for s in range(9)]
    assert len(set(hot[:8])) == 8 and hot[8] == hot[0]  # one expert a step, back after P = 8 steps
    slow = deepseek_like(8, 1024, "drift:1.5:512")  # 0.5 expert a step: the hot set overlaps step to step
    top = [set(np.argsort(-counts(slow, s).sum(axis=0))[:8]) for s in (0, 2, 40)]
    assert len(top[0] & top[1]) >= 5 and not top[0] & top[2]


def test_bursty_bursts_on_some_steps():
    spec = deepseek_like(16, 1024, "bursty:0:0.9:0.5")
    peak = np.array([counts(spec, s).sum(axis=0).max() / (16 * 1024) for s in range(24)])
    burst = peak > 0.85  # burst expert: ~0.9 + 0.1 * 8/256 of the tokens; otherwise ~1/32 + noise
    assert 4 <= burst.sum() <= 20 and np.all(peak[~burst] < 0.1)
    always = deepseek_like(16, 1024, "bursty:1:0.5:1")
    assert all(counts(always, s).sum(axis=0).max() >= 0.5 * 16 * 1024 for s in range(4))


# -- files ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".npy", ".json"])
@pytest.mark.parametrize("shape", [(3, 5), (2, 3, 5), (2, 4, 3, 5)])
def test_file_round_trip(tmp_path, suffix, shape):
    arr = np.random.default_rng(0).integers(0, 1000, size=shape)
    path = save_counts(tmp_path / f"c{suffix}", arr)
    assert path == tmp_path / f"c{suffix}" and path.exists()
    got = load_counts(str(path))
    assert got.dtype == np.int64 and np.array_equal(got, arr)


def test_json_forms(tmp_path):
    (tmp_path / "list.json").write_text("[[1, 2], [3, 4.0]]")
    (tmp_path / "obj.json").write_text(json.dumps({"counts": [[[1, 2]], [[3, 4]]], "note": "x"}))
    assert load_counts(tmp_path / "list.json").tolist() == [[1, 2], [3, 4]]
    assert load_counts(tmp_path / "obj.json").shape == (2, 1, 2)


@pytest.mark.parametrize("name, content, match", [
    ("neg.json", "[[1, -2], [3, 4]]", r"neg\.json: counts\[0, 1\] = -2 is negative"),
    ("neg3.json", "[[[1, 2]], [[3, -4]]]", r"neg3\.json: step 1, counts\[0, 1\] = -4 is negative"),
    ("frac.json", "[[1, 2.5]]", r"frac\.json: counts\[0, 1\] = .*2\.5.* is not an integer"),
    ("str.json", '[["a", "b"]]', r"str\.json: counts must hold integers"),
    ("bool.json", "[[true, false]]", r"bool\.json: counts must be integers, not true / false"),
    ("boolmix.json", "[[true, 0], [1, 2]]", r"boolmix\.json: counts must be integers, not true / false"),
    ("ragged.json", "[[1, 2], [3]]", r"ragged\.json: counts must be a rectangular array"),
    ("flat.json", "[1, 2, 3]", r"flat\.json: expected .*got shape \(3,\)"),
    ("deep.json", "[[[[[1]]]]]", r"deep\.json: expected .*got shape \(1, 1, 1, 1, 1\)"),
    ("empty.json", "[[]]", r"empty\.json: expected a non-empty"),
    ("nokey.json", '{"data": [[1]]}', r"nokey\.json: JSON object has no 'counts' key"),
    ("scalar.json", "7", r"scalar\.json: expected a JSON list"),
    ("broken.json", "[[1, 2]", r"broken\.json: invalid JSON"),
    ("c.csv", "1,2", r"c\.csv: unsupported extension"),
])
def test_load_errors_name_the_file(tmp_path, name, content, match):
    (tmp_path / name).write_text(content)
    with pytest.raises(WorkloadError, match=match):
        load_counts(tmp_path / name)


def test_load_npy_errors(tmp_path):
    np.save(tmp_path / "f.npy", np.array([[1.0, np.nan]]))
    with pytest.raises(WorkloadError, match=r"f\.npy: counts\[0, 1\] = .*nan.* is not an integer"):
        load_counts(tmp_path / "f.npy")
    np.save(tmp_path / "n.npy", np.array([[[[1, 2]]], [[[0, -1]]]]))
    with pytest.raises(WorkloadError, match=r"n\.npy: step 1, layer 0, counts\[0, 1\] = -1 is negative"):
        load_counts(tmp_path / "n.npy")
    (tmp_path / "junk.npy").write_bytes(b"not numpy")  # numpy alone would call it a pickle to load unsafely
    with pytest.raises(WorkloadError, match=r"junk\.npy: not a \.npy file \(no NumPy header\)"):
        load_counts(tmp_path / "junk.npy")
    np.save(tmp_path / "obj.npy", np.array([[1, None]], dtype=object), allow_pickle=True)
    with pytest.raises(WorkloadError, match=r"obj\.npy: not a readable \.npy array \(it holds Python objects"):
        load_counts(tmp_path / "obj.npy")
    os.mkfifo(tmp_path / "pipe.npy")
    with pytest.raises(WorkloadError, match=r"pipe\.npy: not a regular file"):
        load_counts(tmp_path / "pipe.npy")
    (tmp_path / "big.json").write_text("[[1, 2], [3, 99999999999999999999999]]")
    with pytest.raises(WorkloadError, match=r"big\.json: counts exceed int64"):
        load_counts(tmp_path / "big.json")
    (tmp_path / "half.json").write_text("[[1.5, 2]]")
    with pytest.raises(WorkloadError, match=r"half\.json: counts\[0, 0\] = 1\.5 is not an integer"):
        load_counts(tmp_path / "half.json")
    with pytest.raises(FileNotFoundError, match=r"missing\.npy"):
        load_counts(tmp_path / "missing.npy")


def test_save_errors(tmp_path):
    with pytest.raises(WorkloadError, match="is negative"):
        save_counts(tmp_path / "a.npy", [[1, -1]])
    with pytest.raises(WorkloadError, match="unsupported extension"):
        save_counts(tmp_path / "a.txt", [[1, 1]])
    with pytest.raises(WorkloadError, match="got shape"):
        save_counts(tmp_path / "a.json", [1, 1])
    assert not list(tmp_path.iterdir())


def test_file_skew_replays(tmp_path):
    arr = np.arange(3 * 2 * 4 * 5).reshape(3, 2, 4, 5)
    save_counts(tmp_path / "t4.npy", arr)
    save_counts(tmp_path / "t3.json", arr[:, 0])
    save_counts(tmp_path / "t2.json", arr[0, 0])
    spec4 = WorkloadSpec(4, 5, 2, 10, f"file:{tmp_path / 't4.npy'}", num_layers=2)
    assert np.array_equal(counts(spec4, 4, 1), arr[1, 1])  # steps cycle: 4 % 3
    assert np.array_equal(trace(spec4, 3), arr)
    spec3 = WorkloadSpec(4, 5, 2, 10, f"file:{tmp_path / 't3.json'}", num_layers=2)
    assert np.array_equal(counts(spec3, 2, 1), arr[2, 0])
    spec2 = WorkloadSpec(4, 5, 2, 10, f"file:{tmp_path / 't2.json'}")
    assert np.array_equal(counts(spec2, 9), arr[0, 0])
    out = counts(spec2)
    out[0, 0] = -5  # callers get their own copy
    assert counts(spec2)[0, 0] == 0
    with pytest.raises(WorkloadError, match=r"t4\.npy: file has 2 layers"):
        counts(WorkloadSpec(4, 5, 2, 10, f"file:{tmp_path / 't4.npy'}", num_layers=3))
    with pytest.raises(WorkloadError, match=r"t2\.json: counts are \[D=4, E=5\], but the workload has 8 ranks"):
        counts(WorkloadSpec(8, 5, 2, 10, f"file:{tmp_path / 't2.json'}"))
    with pytest.raises(FileNotFoundError, match="nope.npy"):
        counts(WorkloadSpec(4, 5, 2, 10, f"file:{tmp_path / 'nope.npy'}"))


@pytest.mark.parametrize("args,digest", [
    ((8, 8, 2, 4096, "zipf:1.2", 0, 2), "83d26de16ae9fe50"),
    ((16, 64, 6, 1024, "bursty:0.8:0.5:0.5", 3, 2), "1c0e44e432f57550"),
    ((4, 256, 8, 2048, "drift:1.0:7", 1, 2), "da08bff69b5cc442"),
    ((8, 16, 4, 999, "one", 5, 2), "aa2e2361db86a754"),
    ((4, 512, 40, 700, "zipf:0.9", 2, 2), "554c84cb4cdd754b"),  # top-40: the picks' bitmap
])
def test_seeded_workloads_stay_as_they_were(args, digest):
    # a seed names a workload: figures in the docs and benchmarks were made from these draws. The digests
    # were computed with the sampler of c435b27 (before the bitmap, the computed tables and the running
    # sum), and this one gives the same; a change to the draws must be deliberate
    import hashlib

    spec = WorkloadSpec(*args)
    c = np.stack([counts(spec, step, layer) for step in range(2) for layer in range(2)])
    assert hashlib.sha256(c.tobytes()).hexdigest()[:16] == digest
