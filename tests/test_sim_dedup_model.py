"""Issue #17 in `simulate run`: node dedup (a token crosses to a remote node once, then fans out over
NVLink). The analytic distinct-token model (sim/model.py `distinct_ratio_DV`) against an exact
enumeration of its own distribution and against brute-force counts of sampled top-k routings; the
properties the issue states (top-1 and one node change nothing, dedup never adds a byte); the run's
report; the DeepSeek-V3-like config."""
import itertools
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from megatron_rails import cli
from megatron_rails.config.run import load_run_config
from megatron_rails.core.planners import PlannerConfig, make_planner
from megatron_rails.sim import model as sim_model
from megatron_rails.sim.model import (CommModel, Setup, SimOptions, distinct_ratio_DV, entry_DV, route_rows_DEV,
                                      token_traffic)
from megatron_rails.sim.run import Workload, simulate_run

ROOT = Path(__file__).resolve().parents[1]
X7 = str(ROOT / "configs" / "mixtral" / "mixtral-8x7b.yaml")
DS = str(ROOT / "configs" / "deepseek" / "deepseek-v3.yaml")
CROSS = ["topology.gpus_per_node=4", "topology.rails_per_node=4", "parallelism.nodes=8", "balancer.ranks_per_node=0"]


def run(overrides, dedup, policies="none,ultraep", comms="direct,rails", config=X7, skew="zipf:1.2"):
    setup = Setup.from_run_config(load_run_config(config, overrides))
    return simulate_run(setup, SimOptions(dedup=dedup), policies, comms, 1, Workload(setup, skew=skew))


# -- the model against independent counts ------------------------------------------------------------------------

def enumerate_ratio(p_E, f_EV, k):
    """E[tokens with a pair on b] / E[pairs on b] by enumerating every k-set of experts (weight prod p x
    prod (1 - p), conditioned on k picks) and every node each pick's pair can go to."""
    E, V = f_EV.shape
    hit, pairs, total = np.zeros(V), np.zeros(V), 0.0
    for S in itertools.combinations(range(E), k):
        w = np.prod([p_E[e] if e in S else 1 - p_E[e] for e in range(E)])
        total += w
        for nodes in itertools.product(range(V), repeat=k):
            q = w * np.prod([f_EV[e, b] for e, b in zip(S, nodes)])
            for b in range(V):
                hit[b] += q * (b in nodes)
                pairs[b] += q * nodes.count(b)
    return hit / pairs


def test_generating_functions_match_enumeration():
    rng = np.random.default_rng(3)
    E, V, k = 6, 3, 3
    for _ in range(5):
        counts = rng.integers(20, 41, (1, E)).astype(float)  # every p_e = count / 100 below 1
        counts *= 100 * k / counts.sum()             # a row of 100 tokens x k picks
        f = rng.random((E, V)) * (rng.random((E, V)) < 0.6)
        f[np.arange(E), rng.integers(0, V, E)] += 0.5  # every expert served somewhere; some on several nodes
        f /= f.sum(axis=1, keepdims=True)
        got = distinct_ratio_DV(counts, counts[0][None, :, None] * f[None], k)[0]
        p = counts[0] / 100
        assert got == pytest.approx(enumerate_ratio(p, f, k), rel=1e-10)
        assert np.all(got <= 1.0)


PURE = os.environ.get("MEGATRON_RAILS_PURE_PYTHON", "") not in ("", "0")


def test_compiled_model_is_built_where_a_compiler_exists():
    if PURE or shutil.which("cc") is None:
        pytest.skip("pure Python here (MEGATRON_RAILS_PURE_PYTHON or no C compiler)")
    assert sim_model._DISTINCT_PAIRS is not None, \
        "megatron_rails/sim/_dedup_c.c was not built: reinstall (pip install -e .)"


def test_compiled_model_is_bit_identical_to_the_numpy_loop():
    """The compiled loop (sim/_dedup_c.c) against the numpy loop it replaces, bit for bit: random
    shapes, zero counts, experts no source routes to, rows on one node or spread, top-k up to E."""
    rng = np.random.default_rng(11)
    shapes = [(64, 256, 8, 8)] + [(int(rng.integers(1, 20)), int(rng.integers(1, 40)), int(rng.integers(1, 6)), 0)
                                  for _ in range(200)]
    for D, E, V, k in shapes:
        k = k or int(rng.integers(1, min(E, 9) + 1))
        counts = rng.integers(0, 60, (D, E)) * (rng.random((D, E)) < 0.7)
        share = rng.random((D, E, V)) * (rng.random((D, E, V)) < 0.5)
        share[..., rng.integers(0, V)] += rng.random() < 0.2  # sometimes every row reaches one node
        total = share.sum(axis=2, keepdims=True)
        rows = counts[:, :, None] * np.where(total > 0, share / np.where(total > 0, total, 1), 0)
        fast = distinct_ratio_DV(counts, rows, k)
        slow = distinct_ratio_DV(counts, rows, k, compiled=False)
        assert fast.dtype == slow.dtype == np.float64 and np.array_equal(fast, slow), (D, E, V, k)


def gumbel_topk(rng, p_E, T, k):
    """[T, k]: each token's k distinct experts, sequential sampling without replacement from p_E
    (Gumbel-top-k), the way core/workloads.py routes synthetic tokens."""
    g = np.log(p_E)[None, :] - np.log(-np.log(rng.random((T, p_E.size))))
    return np.argpartition(-g, k - 1, axis=1)[:, :k]


@pytest.mark.parametrize("E,D,G,k,s,tol", [(64, 16, 4, 6, 1.2, 0.02), (256, 32, 8, 8, 1.2, 0.02),
                                           (8, 8, 4, 2, 0.8, 0.04)])
def test_model_against_sampled_routings(E, D, G, k, s, tol):
    """Sample every token's top-k routing, place experts stock (expert e on rank e*D//E), count the
    distinct (token, remote node) pairs and the fan-out rows token by token, and compare with what the
    simulator derives from the counts alone."""
    rng = np.random.default_rng(7)
    p = np.arange(1, E + 1, dtype=float) ** -s
    p = p[rng.permutation(E)] / p.sum()
    T = 2048
    picks = np.stack([gumbel_topk(rng, p, T, k) for _ in range(D)])        # [D, T, k]
    dest = picks * D // E                                                   # stock owner rank
    node, src = dest // G, np.arange(D)[:, None, None]
    remote = node != src // G
    distinct = sum(int(((node == b) & remote).any(axis=2).sum()) for b in range(D // G))
    entry = entry_DV(D, G)[np.broadcast_to(src, dest.shape), node]
    hop = remote & (dest != entry)
    fan = np.zeros((D, D), dtype=np.int64)
    np.add.at(fan, (entry[hop], dest[hop]), 1)
    counts = np.stack([np.bincount(picks[d].ravel(), minlength=E) for d in range(D)])
    plan, _ = make_planner("none", PlannerConfig(D, E, G, 1)).plan(counts)
    tr = token_traffic(plan.send_DD, distinct_ratio_DV(counts, route_rows_DEV(plan, G), k), G, True)
    assert tr.inter_rows == int(remote.sum())
    assert tr.inter_rows_dedup == pytest.approx(distinct, rel=tol)
    assert np.array_equal(tr.fan_DD, fan)  # the fan-out follows from the pair rows exactly
    # stage 1: same-node pairs as before, the distinct tokens only to the entry ranks
    same = (np.arange(D)[:, None] // G) == (np.arange(D)[None, :] // G)
    assert np.array_equal(np.where(same, tr.net_DD, 0), np.where(same, plan.send_DD, 0))
    cross = np.where(same, 0, tr.net_DD)
    assert cross.sum() == tr.inter_rows_dedup
    assert set(zip(*np.nonzero(cross))) <= {(s_, int(e)) for s_ in range(D) for e in entry_DV(D, G)[s_]}


# -- the properties of issue #17 ----------------------------------------------------------------------------------

def test_top1_changes_no_byte():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 500, (8, 16)).astype(float)
    rows = rng.random((8, 16, 4))
    rows = rows / rows.sum(axis=2, keepdims=True) * counts[:, :, None]
    assert distinct_ratio_DV(counts, rows, 1) == pytest.approx(np.ones((8, 4)), abs=1e-12)
    res = run([*CROSS, "model.moe_router_topk=1"], True, policies="none,eplb,fsep,ultraep,lp")
    for r in res["rows"] + res["force_balanced"]:
        assert r["internode_bytes_per_layer"] > 0
        assert r["internode_bytes_dedup_per_layer"] == r["internode_bytes_per_layer"], r["policy"]


@pytest.mark.parametrize("policy", ["none", "eplb", "fsep", "ultraep", "lp"])
def test_dedup_never_adds_bytes(policy):
    rng = np.random.default_rng(1)
    D, E, G = 16, 32, 4
    for k in (1, 2, 4, 8):
        for _ in range(4):
            w = rng.random(E) ** 3
            counts = np.stack([np.bincount(gumbel_topk(rng, w / w.sum(), 256, k).ravel(), minlength=E)
                               for _ in range(D)])
            plan, _ = make_planner(policy, PlannerConfig(D, E, G, 2)).plan(counts)
            ratio = distinct_ratio_DV(counts, route_rows_DEV(plan, G), k)
            assert np.all((ratio >= 0) & (ratio <= 1))
            tr = token_traffic(plan.send_DD, ratio, G, True)
            assert tr.inter_rows_dedup <= tr.inter_rows
            pairs_DV = plan.send_DD.reshape(D, D // G, G).sum(axis=2)
            net_DV = tr.net_DD.reshape(D, D // G, G).sum(axis=2)
            assert np.all(net_DV <= pairs_DV)  # per (source, node) too


def test_one_node_changes_nothing():
    on, off = run([], True), run([], False)  # the shipped 8x7B: EP8 inside one DGX node
    assert on["setup"]["ep_nodes"] == 1
    for a, b in zip(on["rows"] + on["force_balanced"], off["rows"] + off["force_balanced"]):
        assert a["internode_bytes_per_layer"] == a["internode_bytes_dedup_per_layer"] == 0
        assert a["fanout_bytes_per_layer"] == 0
        for part in ("dense_ms", "expert_compute_ms", "token_a2a_ms", "weights_ms"):
            assert a["breakdown"][part] == b["breakdown"][part]


def test_cross_node_run_reports_and_prices_dedup():
    on, off = run(CROSS, True), run(CROSS, False)
    assert on["options"]["dedup"] is True and off["options"]["dedup"] is False
    assert "once" in on["assumptions"]["dedup"] and "per pair" in off["assumptions"]["dedup"]
    for a, b in zip(on["rows"] + on["force_balanced"], off["rows"] + off["force_balanced"]):
        # the same plans: the bytes are reported alike, only what is priced differs
        assert a["internode_bytes_per_layer"] == b["internode_bytes_per_layer"] > 0
        assert a["internode_bytes_dedup_per_layer"] == b["internode_bytes_dedup_per_layer"]
        assert a["internode_bytes_dedup_per_layer"] < 0.95 * a["internode_bytes_per_layer"]  # top-2 on 2 nodes
        assert a["fanout_bytes_per_layer"] > 0
        assert a["breakdown"]["token_a2a_ms"] < b["breakdown"]["token_a2a_ms"], (a["policy"], a["comm"])
        assert sum(a["breakdown"].values()) == pytest.approx(a["iteration_ms"], rel=1e-12)


def test_cli_dedup_flag_and_policy_default(capsys):
    def sim(*argv):
        assert cli.main(["simulate", "run", X7, *CROSS, "--steps", "1", "--policies", "none", "--comm", "direct",
                         "--json", "--quiet", *argv]) == 0
        return json.loads(capsys.readouterr().out)

    default, off, on = sim(), sim("--dedup", "off"), sim("--dedup", "on")
    assert default["options"]["dedup"] is True and off["options"]["dedup"] is False and on["options"]["dedup"]
    from_policy = sim("--set", "balancer.dedup=false")
    assert from_policy["options"]["dedup"] is False
    assert sim("--set", "balancer.dedup=false", "--dedup", "on")["options"]["dedup"] is True
    a2a = {name: r["rows"][0]["breakdown"]["token_a2a_ms"] for name, r in
           (("on", on), ("off", off), ("policy", from_policy))}
    assert a2a["on"] < a2a["off"] == a2a["policy"]


def test_table_note_gives_bytes_before_and_after(capsys):
    assert cli.main(["simulate", "run", X7, *CROSS, "--steps", "1", "--policies", "none,ultraep", "--comm",
                     "direct", "--quiet"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "dedup on (priced)" in out and "inter-node token MB per layer dispatch, without -> with dedup" in out
    assert all(f"{name} " in out.split("without -> with dedup:")[1] for name in ("none", "ultraep", "ideal"))


def test_deepseek_like_config_simulates():
    """The shipped DeepSeek-V3-like config: E256 top-8 over an EP group of 8 nodes (16 of its 64 layers
    here, one per pipeline stage, to stay fast)."""
    res = run(["model.num_layers=16"], True, policies="none,ultraep", comms="rails", config=DS)
    s = res["setup"]
    assert (s["experts"], s["topk"], s["ep"], s["ep_nodes"], s["hidden"], s["ffn"]) == (256, 8, 64, 8, 7168, 2048)
    for r in res["rows"]:
        saved = 1 - r["internode_bytes_dedup_per_layer"] / r["internode_bytes_per_layer"]
        assert 0.2 < saved < 0.5, (r["policy"], saved)  # top-8 over 8 nodes: ~5 distinct remote nodes of 7 pairs


def test_rails_tolerance_sends_balanced_exchanges_direct():
    """The dispatcher's rule (policy rails_tolerance): RailS sprays only an exchange whose rail-matched
    direct all-to-all is unbalanced; node dedup's stage 1 (every source on its own rail) is balanced."""
    setup = Setup.from_run_config(load_run_config(X7, CROSS))
    topo = setup.ep_topo
    D = topo.nodes * topo.gpus_per_node
    mild = np.full((D, D), 1000, dtype=np.int64)
    mild[:, 3] = 1030  # its busiest rail 2% above the even spread: within the 5% tolerance
    hot = mild.copy()
    hot[:, 3] *= 8
    always, rule = CommModel(topo), CommModel(topo, rails_tolerance=0.05)
    assert rule.ms(mild, 8192, "rails") == always.ms(mild, 8192, "direct") > always.ms(mild, 8192, "rails")
    assert rule.ms(hot, 8192, "rails") == always.ms(hot, 8192, "rails") < always.ms(hot, 8192, "direct")
