"""Issue #17: token dedup across nodes in the RailS simulator (sim/dedup.py, `simulate a2a --dedup`)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_rails import cli
from megatron_rails.core.planners import PlannerConfig, make_planner
from megatron_rails.core.rails_schedule import rails_schedule
from megatron_rails.core.topology import Topology, load_topology
from megatron_rails.core.sampling import gumbel_topk
from megatron_rails.core.workloads import WorkloadSpec, counts
from megatron_rails.sim.dedup import (MAX_PAIRS, counts_of, dedup_traffic, entry_rank, pair_destinations,
                                      routing_weights, sample_routing, simulate_dedup, token_traffic)
from megatron_rails.sim.rails import SCHEMES, simulate

ROOT = Path(__file__).resolve().parents[1]
G, V, E, TOPK, T = 8, 8, 256, 8, 48          # top-8 of 256 experts over 8 nodes of 8 GPUs; a modest T
D = G * V
HIDDEN, DTYPE_BYTES = 7168, 2


@pytest.fixture(scope="module")
def stock():
    """(picks [D, T, topk], dest [D, T, topk]) of DeepSeek-like zipf 1.2 routing under stock EP."""
    p_E, hot, frac = routing_weights("zipf:1.2", E, TOPK, seed=5)
    picks = sample_routing(p_E, D, T, TOPK, seed=5, hot=hot, hot_frac=frac)
    return picks, stock_destinations(picks, D, E)


def stock_destinations(picks_DT, num_ranks: int, num_experts: int) -> np.ndarray:
    """dest_DT int32 [D, T, topk]: the owner of each pair's expert (stock EP, policy `none`)."""
    from megatron_rails.core.plan import owner_of_experts

    return owner_of_experts(int(num_experts), int(num_ranks)).astype(np.int32)[np.asarray(picks_DT, dtype=np.intp)]


def dedup_markdown_table(result: dict) -> str:
    """The token-dedup table of docs/rails.md, from a bench result's "dedup" rows (written from it, kept in sync here)."""
    rows = result.get("dedup") or []
    gib = 2**30
    lines = ["| traffic | nodes | inter-node GiB, without → with dedup | RailS / LB, without / with | "
             "RailS µs, without → with (fan-out included) | RailS gain (without / with - 1), fluid / phased |", "|---" * 6 + "|"]
    order = {f: i for i, f in enumerate(dict.fromkeys(r["traffic"] for r in rows))}
    for r in sorted(rows, key=lambda r: (order[r["traffic"]], r["nodes"])):
        m = {k: r["modes"][k]["rails"] for k in ("pairs", "dedup")}
        lines.append(f"| {r['traffic']} | {r['nodes']} | {r['inter_node_bytes_pairs'] / gib:.1f} → "
                     f"{r['inter_node_bytes_dedup'] / gib:.1f} (-{100 * r['dedup_saving']:.0f}%) | "
                     f"{r['rails_over_lb_pairs']:.4f} / {r['rails_over_lb_dedup']:.4f} | "
                     f"{m['pairs']['end_to_end_us']:.0f} → {m['dedup']['end_to_end_us']:.0f} | "
                     f"{100 * r['rails_speedup_from_dedup']:+.0f}% / "
                     f"{100 * r['rails_phased_speedup_from_dedup']:+.0f}% |")
    return "\n".join(lines) + "\n"


def brute_force(dest, G):
    """Independent count with Python sets and dicts: (pair rows, stage-1 rows, fan-out rows, inter-node pairs,
    distinct (token, remote node)); entry rank of node b for source s: b * G + s % G."""
    D, T, k = dest.shape
    pairs, units, fan = {}, {}, {}
    inter_pairs, crossings = 0, set()
    for s in range(D):
        for t in range(T):
            for d in dest[s, t].tolist():
                pairs[s, d] = pairs.get((s, d), 0) + 1
                if d // G == s // G:
                    units[s, d] = units.get((s, d), 0) + 1
                    continue
                inter_pairs += 1
                entry = (d // G) * G + s % G
                if (s, t, d // G) not in crossings:
                    crossings.add((s, t, d // G))
                    units[s, entry] = units.get((s, entry), 0) + 1
                if d != entry:
                    fan[entry, d] = fan.get((entry, d), 0) + 1

    def dense(m):
        out = np.zeros((D, D), dtype=np.int64)
        for (i, j), v in m.items():
            out[i, j] = v
        return out

    return dense(pairs), dense(units), dense(fan), inter_pairs, len(crossings)


def test_dedup_bytes_match_an_independent_brute_force_count(stock):
    picks, dest = stock
    assert picks.shape == (D, T, TOPK)
    assert all(len(set(row)) == TOPK for row in picks.reshape(-1, TOPK).tolist())  # distinct experts per token
    dd = dedup_traffic(dest, G)
    pairs, units, fan, inter_pairs, crossings = brute_force(dest, G)
    bpr = HIDDEN * DTYPE_BYTES
    fig = dd.figures(bpr)
    assert fig["inter_node_bytes_dedup"] == crossings * HIDDEN * DTYPE_BYTES
    assert fig["inter_node_bytes_pairs"] == inter_pairs * HIDDEN * DTYPE_BYTES
    assert crossings < inter_pairs and fig["dedup_saving"] > 0
    assert np.array_equal(dd.tokens_DD, pairs) and np.array_equal(dd.units_DD, units)
    assert np.array_equal(dd.fanout_DD, fan)


def test_units_rows_and_fanout_are_consistent(stock):
    _, dest = stock
    dd = dedup_traffic(dest, G)
    node = np.arange(D) // G
    same = node[:, None] == node[None, :]
    # intra-node pairs unchanged; a row's remote units all go to entry ranks (same local index)
    assert np.array_equal(np.where(same, dd.units_DD, 0), np.where(same, dd.tokens_DD, 0))
    remote_units = np.where(same, 0, dd.units_DD)
    s_idx, d_idx = np.nonzero(remote_units)
    assert np.all(s_idx % G == d_idx % G)
    assert remote_units.sum() == dd.inter_units and np.where(same, 0, dd.tokens_DD).sum() == dd.inter_pairs
    # each row: its intra pairs + its distinct (token, remote node); between T*1 and T*topk in all
    distinct = [len({(t, b) for t in range(T) for b in (dest[s, t] // G).tolist() if b != s // G}) for s in range(D)]
    assert dd.units_DD.sum(axis=1).tolist() == (np.where(same, dd.tokens_DD, 0).sum(axis=1) + distinct).tolist()
    assert np.all(dd.units_DD.sum(axis=1) <= dd.tokens_DD.sum(axis=1))
    # fan-out stays inside a node, and every remote pair is delivered: by the fan-out or at the entry rank
    f_s, f_d = np.nonzero(dd.fanout_DD)
    assert np.all(f_s // G == f_d // G) and np.all(f_s != f_d)
    remote_in = np.where(same, 0, dd.tokens_DD).sum(axis=0)
    at_entry = np.array([sum(int((dest[s] == d).sum()) for s in range(D) if s // G != d // G and s % G == d % G)
                         for d in range(D)])
    assert np.array_equal(remote_in, dd.fanout_DD.sum(axis=0) + at_entry)


def test_topk_one_changes_nothing():
    p_E, _, _ = routing_weights("zipf:1.2", E, 1, seed=1)
    picks = sample_routing(p_E, D, T, 1, seed=1)
    dd = dedup_traffic(stock_destinations(picks, D, E), G)
    assert dd.inter_units == dd.inter_pairs > 0
    assert dd.figures(HIDDEN * 2)["inter_node_bytes_dedup"] == dd.figures(HIDDEN * 2)["inter_node_bytes_pairs"]
    node = np.arange(D) // G
    same = node[:, None] == node[None, :]
    assert np.array_equal(np.where(same, dd.units_DD, 0), np.where(same, dd.tokens_DD, 0))
    assert dd.units_DD.sum() == dd.tokens_DD.sum()


def test_rails_schedule_on_dedup_units_is_valid(stock):
    _, dest = stock
    dd = dedup_traffic(dest, G)
    topo = load_topology("dgx-h100").with_nodes(V)
    sch = rails_schedule(dd.units_DD, topo)
    sch.check()
    assert np.array_equal(sch.traffic_DD, dd.units_DD)


def test_entry_rank_is_the_same_index_on_the_sender_rail():
    for J in (8, 4, 2, 1):
        topo = Topology(gpus_per_node=8, rails_per_node=J, nodes=4)
        s = np.arange(32)[:, None]
        b = np.arange(4)[None, :]
        e = entry_rank(s, b, 8)
        assert np.array_equal(e, topo.rail_gpu(b, topo.rail_of(s), s))
        assert np.array_equal(topo.rail_of(e), np.broadcast_to(topo.rail_of(s), e.shape))


def test_sampler_is_deterministic_and_follows_the_skew():
    p_E, hot, frac = routing_weights("zipf:1.2", 64, 4, seed=2)
    a = sample_routing(p_E, 2, 20_000, 4, seed=2)
    assert np.array_equal(a, sample_routing(p_E, 2, 20_000, 4, seed=2))
    assert not np.array_equal(a, sample_routing(p_E, 2, 20_000, 4, seed=3))
    mine = counts_of(a, 64).sum(axis=0)
    # the count-level sampler (core/workloads.py) draws from the same model: per-expert totals agree
    ref = counts(WorkloadSpec(2, 64, 4, 20_000, "zipf:1.2", 2)).sum(axis=0)
    assert np.argmax(mine) == np.argmax(ref) == np.argmax(p_E)
    assert np.abs(mine - ref).max() < 6 * np.sqrt(ref.max()) + 10
    # a burst: the hot expert is every token's first pick with probability frac
    p_E, hot, frac = routing_weights("one", 64, 4, seed=0)
    one = sample_routing(p_E, 1, 1000, 4, seed=0, hot=hot, hot_frac=frac)
    assert hot >= 0 and np.all(one[0, :, 0] == hot) and np.all((one[0, :, 1:] != hot))


def test_sampler_large_topk_takes_the_gumbel_path(monkeypatch):
    # top-64 of 128 experts would redraw ~k^2 times one by one; the Gumbel-top-k path draws the same model
    import megatron_rails.sim.dedup as dedup_mod

    calls = []
    monkeypatch.setattr(dedup_mod, "gumbel_topk", lambda *a, **k: calls.append(1) or gumbel_topk(*a, **k))
    p_E, _, _ = routing_weights("zipf:1.2", 128, 64, seed=4)
    picks = sample_routing(p_E, 2, 4000, 64, seed=4)
    assert len(calls) == 2  # one per rank
    assert np.all(np.diff(np.sort(picks.astype(np.int64), axis=2), axis=2) > 0)
    mine = counts_of(picks, 128).sum(axis=0)
    ref = counts(WorkloadSpec(2, 128, 64, 4000, "zipf:1.2", 4)).sum(axis=0)
    assert np.abs(mine - ref).max() < 6 * np.sqrt(ref.max()) + 10
    first = np.bincount(picks[:, :, 0].reshape(-1), minlength=128) / 8000  # the first pick ~ p_E
    want = p_E / p_E.sum()
    assert np.all(np.abs(first - want) <= 6 * np.sqrt(want * (1 - want) / 8000) + 1e-9)


def test_planned_route_follows_the_plan():
    """pair_destinations sends each (rank, expert) run where the plan's route says: the pair traffic is the
    plan's send_DD, for a replica policy and for stock EP (where every pair goes to its owner)."""
    p_E, _, _ = routing_weights("zipf:1.2", 64, 4, seed=0)
    picks = sample_routing(p_E, 16, 64, 4, seed=0)
    c = counts_of(picks, 64)
    for policy in ("none", "ultraep", "fsep"):
        plan, _ = make_planner(policy, PlannerConfig(16, 64, 8, 1)).plan(c)
        dest = pair_destinations(picks, plan)
        assert np.array_equal(dedup_traffic(dest, 8).tokens_DD, plan.send_DD), policy
        if policy == "none":
            assert np.array_equal(dest, stock_destinations(picks, 16, 64))


def test_token_traffic_and_simulation():
    tt = token_traffic("deepseek:none", D, G, tokens_per_rank=T, seed=5)
    assert (tt.experts, tt.topk, tt.hidden, tt.policy) == (256, 8, 7168, "none")
    p_E, hot, frac = routing_weights("zipf:1.2", E, TOPK, seed=5)
    direct = dedup_traffic(stock_destinations(sample_routing(p_E, D, T, TOPK, 5, hot, frac), D, E), G)
    assert np.array_equal(tt.dedup.units_DD, direct.units_DD)
    desc = tt.describe()
    assert desc["inter_node_bytes_dedup"] < desc["inter_node_bytes_pairs"]
    topo = load_topology("dgx-h100").with_nodes(V)
    rows = simulate_dedup(tt, topo)
    assert [(r["mode"], r["scheme"]) for r in rows] == [(m, s) for m in ("pairs", "dedup") for s in SCHEMES]
    ref = {r.scheme: r for r in simulate(tt.dedup.tokens_DD, topo, tt.bytes_per_token)}
    for r in rows:
        assert r["lower_bound_us"] <= r["completion_us"] <= r["end_to_end_us"]
        assert r["lower_bound_end_to_end_us"] <= r["end_to_end_us"] + 1e-9
        if r["mode"] == "pairs":  # the pair rows are the plain simulator's on the same traffic
            assert r["completion_us"] == ref[r["scheme"]].completion_us
            assert r["end_to_end_us"] == r["completion_us"] and r["fanout_bytes"] == 0
        else:
            assert r["fanout_bytes"] > 0 and r["fanout_us"] > 0
            assert r["inter_node_bytes"] == desc["inter_node_bytes_dedup"]


# -- CLI ------------------------------------------------------------------------------------------------------

A2A = ["simulate", "a2a", "--nodes", "8", "--traffic", "deepseek:none", "--tokens-per-rank", "64"]


def test_cli_dedup_both_json(capsys):
    assert cli.main(A2A + ["--dedup", "both", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["mode"], r["scheme"]) for r in rows] == [(m, s) for m in ("pairs", "dedup") for s in SCHEMES]
    r = {(x["mode"], x["scheme"]): x for x in rows}
    assert r["dedup", "rails"]["inter_node_bytes"] < r["pairs", "rails"]["inter_node_bytes"]
    assert r["dedup", "rails"]["inter_node_bytes"] == rows[0]["inter_node_bytes_dedup"]
    assert all(x["ratio_to_lb"] >= 1 for x in rows)  # small messages: the 3-hop latency shows (docs/rails.md)
    assert cli.main(A2A + ["--dedup", "on", "--json"]) == 0
    on = json.loads(capsys.readouterr().out)
    assert [x["mode"] for x in on] == ["dedup"] * 3 and on == rows[3:]


def test_cli_dedup_table_fits_80_columns():
    env = dict(os.environ, COLUMNS="80")
    for mode in ("on", "both"):
        p = subprocess.run([sys.executable, "-m", "megatron_rails.cli", *A2A, "--dedup", mode], capture_output=True,
                           text=True, timeout=120, env=env, cwd=ROOT)
        assert p.returncode == 0, p.stderr
        assert max(len(ln.encode()) for ln in p.stdout.splitlines()) <= 80
        assert "with dedup" in p.stdout and "speedup" in p.stdout and "rails" in p.stdout
        assert (" 1.00x " in p.stdout) == (mode == "both")  # the pair rows against themselves
        assert p.stdout.count("| pairs ") == (3 if mode == "both" else 0)  # both: a traffic column


@pytest.mark.parametrize("argv, words", [
    (["--dedup", "maybe"], "invalid choice: 'maybe'"),
    (["--dedup", "on", "--tokens-per-rank", str(MAX_PAIRS // 64 // 8 + 1)], "token dedup samples every token"),
])
def test_cli_dedup_bad_input_is_one_line(argv, words, capsys):
    try:
        rc = cli.main(A2A + argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and words in err and len(err.strip().splitlines()) == 1, err


# -- docs: the dedup table is bench/rails.json's, the quoted figures are the command's ------------------------

def test_docs_hold_the_committed_dedup_results():

    res = json.loads((ROOT / "bench" / "rails.json").read_text())
    r8 = next(r for r in res["dedup"] if r["nodes"] == 8 and r["family"] == "deepseek:none")
    assert (r8["experts"], r8["topk"], r8["ranks"]) == (256, 8, 64) and r8["dedup_saving"] > 0
    assert all(r["inter_node_bytes_dedup"] <= r["inter_node_bytes_pairs"] for r in res["dedup"])
    table = dedup_markdown_table(res)
    for doc in ("rails.md", "benchmarks.md"):
        assert table in (ROOT / "docs" / doc).read_text(), doc


def test_doc_quoted_dedup_figures():
    from megatron_rails.cli.sim import run_a2a

    args = cli.build_parser().parse_args(["simulate", "a2a", "--topology", "dgx-h100", "--nodes", "8", "--traffic",
                                          "deepseek:none", "--dedup", "both"])
    head, rows = run_a2a(args)
    r = {(x["mode"], x["scheme"]): x for x in rows}
    text = (ROOT / "docs" / "rails.md").read_text()
    for want in (f"inter-node {head['inter_node_bytes_pairs'] / 2**30:.1f} GiB, "
                 f"{head['inter_node_bytes_dedup'] / 2**30:.1f} GiB with dedup (-{100 * head['dedup_saving']:.1f}%)",
                 f"rails  │ pairs   │ {r['pairs', 'rails']['completion_us']:.1f} │",
                 f"rails  │ dedup   │  {r['dedup', 'rails']['completion_us']:.1f} │  "
                 f"{r['dedup', 'rails']['lower_bound_us']:.1f} │",
                 f"{r['dedup', 'rails']['fanout_us']:.0f} µs of",
                 f"{r['dedup', 'rails']['phased_end_to_end_us']:.0f} µs"):
        assert want in text, want
