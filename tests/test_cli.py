"""CLI smoke tests: real subprocesses of the `megatron-rails` entry point."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_rails.core.plan import imbalance

CLI = [sys.executable, "-m", "megatron_rails.cli"]
KEYS = {"policy", "ranks", "experts", "max_over_mean_before", "max_over_mean_after", "lower_bound_max_over_mean",
        "cross_node_tokens", "weight_moves", "plan_us_p50", "plan_us_p99"}


def run(*args, ok=True):
    p = subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=600)
    assert (p.returncode == 0) == ok, p.stdout + p.stderr
    return p


@pytest.mark.parametrize("policy", ["none", "eplb", "fsep", "ultraep", "lp"])
def test_plan_json(policy):
    slots = [] if policy == "none" else ["--slots", "1"]  # none places no slots (typed, it is refused)
    out = run("plan", "--policy", policy, "--ranks", "8", "--experts", "16", "--topk", "2", "--tokens-per-rank",
              "512", *slots, "--ranks-per-node", "4", "--skew", "zipf:1.2", "--seed", "3", "--json",
              "--repeats", "3", "--budget", "0.01").stdout
    row = json.loads(out)
    assert KEYS <= set(row) and row["policy"] == policy and row["ranks"] == 8 and row["experts"] == 16
    assert row["lower_bound_max_over_mean"] <= row["max_over_mean_after"] + 1e-9
    assert row["tokens"] == 8 * 512 * 2


def test_plan_from_counts_file(tmp_path):
    counts = np.zeros((4, 8), dtype=np.int64)
    counts[:, 2] = 100
    counts[:, 5] = 20
    f = tmp_path / "c.npy"
    np.save(f, counts)
    row = json.loads(run("plan", "--policy", "ultraep", "--counts", str(f), "--slots", "1", "--ranks-per-node", "2",
                         "--json", "--repeats", "2", "--budget", "0.01").stdout)
    # independent: stock owners of 8 experts on 4 ranks are pairs; expert 2 (rank 1) holds 400 of 480
    assert row["max_over_mean_before"] == pytest.approx(imbalance(np.array([0, 400, 80, 0])))
    assert row["max_over_mean_after"] < row["max_over_mean_before"]
    table = run("plan", "--policy", "fsep", "--counts", str(f), "--repeats", "2", "--budget", "0.01").stdout
    assert "max_over_mean_after" in table


def test_plan_errors_are_clear(tmp_path):
    assert "invalid choice" in run("plan", "--policy", "magic", ok=False).stderr
    assert "zipf" in run("plan", "--policy", "none", "--skew", "zipf:oops", ok=False).stderr
    assert "divisible" in run("plan", "--policy", "none", "--ranks", "8", "--experts", "12", ok=False).stderr
    missing = tmp_path / "nope.npy"
    assert "nope.npy" in run("plan", "--policy", "lp", "--counts", str(missing), ok=False).stderr


def test_bench_planners_quick(tmp_path):
    out = tmp_path / "b.json"
    p = run("bench", "planners", "--quick", "--out", str(out))
    res = json.loads(out.read_text())
    # stdout holds the JSON summary only (progress bar and HiGHS' banner on stderr), no nulls
    summary = json.loads(p.stdout)
    assert summary == res["targets"] and "null" not in p.stdout and "HiGHS" not in p.stdout
    assert summary["ultraep_p50_us_worst_measured"]["us"] > 0 and len(summary["not_measured"]) == 2
    assert f"wrote {out}" in p.stderr
    rows = [r for r in res["rows"] if "error" not in r]
    assert {r["policy"] for r in rows} == {"none", "eplb", "fsep", "ultraep", "lp"}
    assert res["lp_vs_highs"]["gap_count"] == 0
    # the figures recomputed from the grid's inputs (4096 tokens per rank, stock owner e * D // E)
    from megatron_rails.bench.planners import TOPK, _counts

    by = {(r["ranks"], r["experts"], r["slots"], r["skew"], r["policy"]): r for r in rows}
    for (D, E, R, skew, policy), r in by.items():
        load_E = np.asarray(_counts(D, E, skew)).reshape(D, E).sum(axis=0)
        total = int(load_E.sum())
        assert total == r["tokens"] == D * 4096 * TOPK[E]
        stock = np.bincount(np.arange(E) * D // E, weights=load_E, minlength=D)
        assert r["max_over_mean_before"] == pytest.approx(stock.max() * D / total, rel=1e-12)
        assert r["lower_bound_max_over_mean"] <= r["max_over_mean_after"] + 1e-9
        if policy == "ultraep" and E <= D:  # one expert per rank at most: the cascade reaches ceil(mean)
            assert r["max_over_mean_after"] == pytest.approx(-(-total // D) * D / total, rel=1e-12), (D, E, skew)
        if policy == "lp":  # exact min-max on ultraep's placement: never above ultraep's own quotas
            assert r["max_over_mean_after"] <= by[D, E, R, skew, "ultraep"]["max_over_mean_after"] + 1e-12
    assert (tmp_path / "b.png").stat().st_size > 10_000


def _demo_control(tmp_path, steps: int, microbatches: int, ranks: int) -> np.ndarray:
    """[I]: stock alltoall's routing flips against stock allgather per step, both trained by the demo's
    trainer from the same weights and data (the control of tests/flips.py's rule)."""
    maps = {}
    for kind in ("stock", "stock-allgather"):
        out = tmp_path / f"{kind}.json"
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--standalone",
                        "-m", "megatron_rails.demo.train", "--shape", "compute", "--policy", kind, "--steps",
                        str(steps), "--microbatches", str(microbatches), "--out", str(out), "--routing",
                        f"{out}.npz"], check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        maps[kind] = np.load(f"{out}.npz")["maps"]  # bool [Y, C, D, T, E]
    differs_C = (maps["stock"] != maps["stock-allgather"]).any(axis=-1).sum(axis=(0, 2, 3))
    return differs_C.reshape(steps, -1).sum(axis=1)


def test_demo_json(tmp_path):
    """The demo against stock by the long-run rule (tests/flips.py): losses within 1e-5 until the first
    routing flip, the flips at most 2 x stock alltoall's own against allgather + SLACK (that control
    trained only when the demo flipped more than SLACK tokens)."""
    from flips import SLACK, check_bound

    png = tmp_path / "d.png"
    res = json.loads(run("demo", "--steps", "3", "--json", "--plot", str(png)).stdout)
    assert {"loss_max_abs_diff", "imbalance_before", "imbalance_after", "plan_us_p50", "step_ms_stock"} <= set(res)
    flips_I = np.array(res["routing_flips_per_step"])
    assert len(flips_I) == 3 and res["imbalance_after"] < res["imbalance_before"]
    assert res["first_flip_step"] == (int(np.flatnonzero(flips_I)[0]) if flips_I.any() else 3)
    assert res["loss_max_rel_diff_before_flip"] < 1e-5
    if not flips_I.any():
        assert res["loss_max_rel_diff"] == res["loss_max_rel_diff_before_flip"]
    control = _demo_control(tmp_path, 3, res["microbatches"], res["ranks"]) if flips_I.sum() > SLACK else 0 * flips_I
    check_bound(flips_I, control, "demo")
    assert png.stat().st_size > 10_000


def test_bench_dispatcher_quick(tmp_path):
    """Structure, the quantities that follow from the shape alone, and the figures derived from the timings
    (recomputed here; the timings themselves are not checked)."""
    out = tmp_path / "d.json"
    p = run("bench", "dispatcher", "--quick", "--out", str(out))
    res = json.loads(out.read_text())
    assert json.loads(p.stdout) == res["targets"] and f"wrote {out}" in p.stderr  # stdout: results only
    # piped (80 columns): every line of the summary and the progress fits, as every command's (test_cli_output.py)
    # (the output path is the caller's: pytest's tmp_path alone can pass 80 characters)
    printed = (p.stdout + p.stderr).replace(str(out), "OUT")
    assert not [ln for ln in printed.splitlines() if len(ln) > 80], printed
    H, F, E, T, k, D = 256, 512, 8, 1024, 2, res["meta"]["world"]
    assert res["meta"]["shape"] == {"hidden": H, "ffn": F, "experts": E, "topk": k, "tokens": T}
    rows = {(r["policy"], r["skew"]): r for r in res["rows"]}
    policies = ["none", "eplb", "ultraep", "lp", "fsep", "fsep+rails"]
    assert set(rows) == {(p, s) for p in ["stock", *policies] for s in ("uniform", "zipf:1.2")}
    stocks = {}
    for skew in ("uniform", "zipf:1.2"):  # stock: its own reference, its routing none's (the same router)
        stocks[skew] = stock = rows.pop(("stock", skew))
        assert stock["ratio_vs_stock"] == 1.0 and stock["ms_p50"] > 0 and "weight_bytes_per_layer" not in stock
        assert stock["max_over_mean_after"] == rows[("none", skew)]["max_over_mean_before"]
    expert_bytes = 3 * H * F * 4  # SwiGLU expert in fp32: fc1 [2F, H] and fc2 [H, F]
    for (policy, skew), r in rows.items():
        assert r["ms_p50"] > 0 and r["plan_us_p50"] > 0
        assert r["max_over_mean_after"] <= r["max_over_mean_before"] + 1e-9, (policy, skew)
        if policy == "none":
            assert r["overhead_vs_none"] == 0 and r["weight_bytes_per_layer"] == 0
            assert r["max_over_mean_after"] == r["max_over_mean_before"]
        if policy.startswith("fsep") and skew == "uniform":
            # one slot per expert, each gathering the (D-1)/D of it held elsewhere
            assert r["weight_bytes_per_layer"] == E * expert_bytes * (D - 1) // D
        if policy != "none" and skew != "uniform":
            assert r["max_over_mean_after"] <= 1.05, (policy, skew)
    assert rows[("none", "zipf:1.2")]["max_over_mean_before"] > 1.5  # the skew is real
    # overhead_vs_none is the median over rounds of (policy / none in the same round) - 1. --quick times 2
    # rounds, so the median is the mean of the two ratios, and each row's p50 and min give its two times:
    # recompute it from those (the round pairing is not recorded: one of the two pairings must match)
    assert res["meta"]["reps"] == 2
    overhead = {}
    for skew in ("uniform", "zipf:1.2"):
        n_lo = rows[("none", skew)]["ms_min"]
        n_hi = 2 * rows[("none", skew)]["ms_p50"] - n_lo
        for policy in policies:
            r = rows[(policy, skew)]
            lo, hi = r["ms_min"], 2 * r["ms_p50"] - r["ms_min"]
            pairings = [(lo / n_lo + hi / n_hi) / 2 - 1, (lo / n_hi + hi / n_lo) / 2 - 1]
            match = [x for x in pairings if r["overhead_vs_none"] == pytest.approx(x, rel=1e-9, abs=1e-12)]
            assert match, (policy, skew, r["overhead_vs_none"], pairings)
            overhead[policy, skew] = match[0]
            s_lo, s_hi = stocks[skew]["ms_min"], 2 * stocks[skew]["ms_p50"] - stocks[skew]["ms_min"]
            vs_stock = [(lo / s_lo + hi / s_hi) / 2, (lo / s_hi + hi / s_lo) / 2]
            assert any(r["ratio_vs_stock"] == pytest.approx(x, rel=1e-9) for x in vs_stock), (policy, skew)
    # the targets, from the recomputed overheads; on the skewed step every policy but none balances
    # (--quick: the overheads as numbers, no noise-driven yes/no against 5%)
    assert res["targets"]["uniform_overhead_vs_none"] == pytest.approx({p: overhead[p, "uniform"] for p in policies})
    assert res["targets"]["uniform_ratio_vs_stock"] == {p: rows[(p, "uniform")]["ratio_vs_stock"] for p in policies}
    assert "uniform_overhead_le_5pct" not in res["targets"] and res["targets"]["not_evaluated"]
    assert res["targets"]["zipf_max_over_mean_le_1_05"] == {p: p != "none" for p in policies}
    floor = res["meta"]["fsep_weight_exchange"]
    assert floor["bytes_per_rank"] == E * -(-3 * H * F // D) * 4 and floor["ms_p50"] > 0


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="argparse lays out --help differently in other Pythons; "
                    "docs/cli.md is generated under 3.11, CI's")
def test_cli_reference_is_generated():
    """docs/cli.md is every command's --help as the parser gives it now; every command is in it."""
    from pathlib import Path

    from megatron_rails.cli.reference import generate

    committed = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    assert committed == generate(), "docs/cli.md is stale: python -m megatron_rails.cli.reference --out docs/cli.md"
    for cmd in ("plan", "bench", "simulate a2a", "simulate run", "trace", "soak", "demo", "config validate",
                "config show", "config docs"):
        assert f"## `megatron-rails {cmd}`" in committed
    assert "--rounds ROUNDS" in committed and "--get KEY" in committed  # flags no other doc lists
    assert max(len(ln) for ln in committed.split("```text")[1].splitlines()) <= 80


@pytest.mark.parametrize("argv,shape", [(["--quick"], "tiny"), ([], "mixtral-8x7b"),
                                        (["--quick", "--shape", "mixtral-8x22b"], "mixtral-8x22b")])
def test_bench_local_quick_keeps_a_given_shape(tmp_path, argv, shape):
    """--quick picks the tiny layer only where no --shape is given."""
    from megatron_rails.cli.main import _bench_args, build_parser

    args = build_parser().parse_args(["bench", "local", "--out", str(tmp_path / "l.json"), *argv])
    _bench_args(args)
    assert args.shape == shape
