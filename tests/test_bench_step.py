"""`megatron-rails bench step`: refuses more ranks than cores and unknown workloads in one line; a
quick run writes every (workload, policy) row with the issue's fields, and its figures hang
together: stock is its own reference and moves no weights, the balanced workload is balanced and
its stock row is the ideal, stock's max/mean is the workload's (recomputed here from the counts);
its progress on stderr is clean (no warnings) and 80 columns wide. The bench's stock is stock:
its outputs and gradients equal Megatron-Core's allgather dispatcher's under the same routing; and
under the moving workloads every policy trains like it (3 optimizer steps, SGD): the routing is
the workload's, so nothing may part, not even by a routing flip."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from moe_harness import spawn

CLI = [sys.executable, "-m", "megatron_rails.cli", "bench", "step"]
FIELDS = {"policy", "workload", "step_ms_p50", "ratio_vs_stock", "ratio_vs_stock_q25", "ratio_vs_stock_q75",
          "of_ideal", "stock_max_over_mean", "max_over_mean_after", "weight_bytes_per_step", "relayouts_per_step",
          "expert_bytes_per_rank"}
SMALL = dict(layers=2, hidden=16, ffn=32, experts=8, topk=2, tokens=24)


def test_more_ranks_than_cores_is_refused(tmp_path):
    # pinned to one core, so that 2 ranks (which divide the bench's 8 experts) are one too many on any machine
    one_core = sorted(os.sched_getaffinity(0))[0]
    p = subprocess.run(CLI + ["--out", str(tmp_path / "s.json"), "--ranks", "2"], capture_output=True,
                       text=True, timeout=120, preexec_fn=lambda: os.sched_setaffinity(0, {one_core}))
    assert p.returncode != 0 and "Traceback" not in p.stderr
    msg = p.stderr.strip().splitlines()[-1]
    assert "--ranks 2" in msg and "gives us 1 core and" in msg, p.stderr
    assert not (tmp_path / "s.json").exists()


@pytest.mark.parametrize("args,says", [(["--rounds", "0"], "--rounds must be >= 1"),
                                       (["--workloads", "zipf:1.3"], "unknown workload 'zipf:1.3'"),
                                       (["--workloads", "burst,burst"], "'burst' twice"),
                                       (["--workloads", "burst,"], "unknown workload ''")])
def test_bad_options_are_refused(tmp_path, args, says):
    p = subprocess.run(CLI + ["--out", str(tmp_path / "s.json"), *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert says in p.stderr.strip().splitlines()[-1], p.stderr


def test_quick_run_rows(tmp_path):
    from megatron_rails.core.step_workloads import counts_E

    out = tmp_path / "s.json"
    ranks = min(2, len(os.sched_getaffinity(0)))
    workloads = ["balanced", "rotating", "zero"]
    p = subprocess.run(CLI + ["--out", str(out), "--ranks", str(ranks), "--microbatches", "2", "--quick",
                              "--workloads", ",".join(workloads)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    # what the ranks and Megatron-Core's imports print stays out of the user's terminal; the progress
    # lines fit 80 columns
    assert "Warning" not in p.stderr and max(map(len, p.stderr.splitlines())) <= 80, p.stderr
    # the summary table too (stdout is a pipe here: 80 columns), one row per case
    assert max(map(len, p.stdout.splitlines())) <= 80, p.stdout
    assert sum(ln.startswith(tuple(f"{w} " for w in workloads)) for ln in p.stdout.splitlines()) == 21, p.stdout
    res = json.loads(out.read_text())
    assert res["meta"]["reps"] == 1 and set(res["meta"]["workloads"]) == set(workloads)
    rows = {(r["workload"], r["policy"]): r for r in res["rows"]}
    policies = {"stock", "none", "eplb", "ultraep", "lp", "fsep", "default"}
    assert set(rows) == {(w, p) for w in workloads for p in policies}
    shape = res["meta"]["shape"]
    for (w, policy), r in rows.items():
        assert FIELDS <= set(r) and r["step_ms_p50"] > 0 and r["expert_bytes_per_rank"] > 0
        for name in ("ratio_vs_stock", "of_ideal"):  # one round: its quartiles are the median
            assert r[f"{name}_q25"] == r[name] == r[f"{name}_q75"]
        # stock's max/mean from the workload's counts, every step, microbatch, layer (1 round, no warm-up)
        E, T, k = shape["experts"], shape["tokens"], shape["topk"]
        mm = []
        for m in range(2):
            for y in range(shape["layers"]):
                load_E = sum(counts_E(w, 0, 0, m, y, d, T, E, k) for d in range(ranks))
                load_D = [load_E[d * E // ranks:(d + 1) * E // ranks].sum() for d in range(ranks)]
                mm.append(max(load_D) / np.mean(load_D))
        assert r["stock_max_over_mean"] == pytest.approx(np.mean(mm), rel=1e-12), (w, policy)
    # stock's experts on a rank, counted by hand: E / D experts of fc1 [2 F, H] (gated) and fc2 [H, F],
    # fp32 weights and their gradients (the probe ran after the last backward), in every layer
    H, F, E, Y = shape["hidden"], shape["ffn"], shape["experts"], shape["layers"]
    by_hand = Y * (E // ranks) * 3 * H * F * 4 * 2
    for w in workloads:
        stock = rows[(w, "stock")]
        assert stock["expert_bytes_per_rank"] == by_hand and stock["slot_bytes"] == 0
        assert stock["ratio_vs_stock"] == 1.0 and stock["weight_bytes_per_step"] == 0
        assert stock["relayouts_per_step"] == 0 and stock["max_over_mean_after"] == stock["stock_max_over_mean"]
    assert rows[("balanced", "stock")]["of_ideal"] == 1.0
    assert rows[("balanced", "stock")]["stock_max_over_mean"] == 1.0
    if ranks == 2:
        assert rows[("zero", "stock")]["stock_max_over_mean"] == 2.0  # the upper half of the experts: rank 1
        assert rows[("zero", "ultraep")]["max_over_mean_after"] < 2.0
    if ranks == 2:  # sim/memory.py's prediction for the bench's shape (fp32, SGD) against the storage measured
        _memory_predicted(rows, shape)
    fsep = rows[("rotating", "fsep")]
    assert 0 < fsep["weight_bytes_per_step"] <= fsep["weight_bytes_per_step_if_per_microbatch"]
    assert os.path.exists(tmp_path / "s.png")


def _memory_predicted(rows, shape):
    """Expert bytes per rank, bench against sim/memory.py for the same shape on 2 ranks: at the zero
    workload's skew the peak (fsep's ceil(E/D) + R slots, an owner layout's R), at balanced routing
    none beyond stock's for the owner layouts and fsep's ceil(E/D) slots (its rule within tolerance)."""
    from pathlib import Path

    from megatron_rails.bench.step import PLACEHOLDER_BYTES
    from megatron_rails.config.run import load_run_config
    from megatron_rails.core.policy import PolicyConfig, as_policy
    from megatron_rails.sim.memory import gpu_memory

    mini = Path(__file__).resolve().parents[1] / "configs" / "mini" / "mini-mixtral.yaml"
    rc = load_run_config(mini, [f"model.num_layers={shape['layers']}", f"model.hidden_size={shape['hidden']}",
                                f"model.ffn_hidden_size={shape['ffn']}", f"model.num_experts={shape['experts']}",
                                "parallelism.expert_model_parallel_size=2", "parallelism.nodes=1",
                                "parallelism.world_size=2", "training.optimizer=sgd"])
    W = 3 * shape["hidden"] * shape["ffn"]
    for p in ("stock", "none", "eplb", "ultraep", "lp", "fsep", "default"):
        cfg = None if p == "stock" else as_policy("default") if p == "default" else PolicyConfig(policy=p)
        want = gpu_memory(rc, cfg)
        got = rows[("zero", p)]
        slack = PLACEHOLDER_BYTES * shape["layers"] if p == "fsep" else 0  # fsep's placeholders
        assert abs(got["expert_bytes_per_rank"] - want["expert_bytes"]) <= slack, (p, got, want)
        assert got["slot_bytes"] == want["slots"], p
        at_balance = rows[("balanced", p)]["slot_bytes"]
        assert at_balance == (shape["layers"] * shape["experts"] // 2 * W * 8 if p == "fsep" else 0), p


def test_trace_replay(tmp_path):
    """`--trace FILE` replays a counts file as the workload 'trace' (alone): stock's max/mean is the
    trace's, rescaled, at every call, layer and rank; a file of other experts is one line."""
    from megatron_rails.core.step_workloads import rescaled
    from megatron_rails.core.workloads import save_counts

    ranks = min(2, len(os.sched_getaffinity(0)))
    c = np.random.default_rng(4).integers(0, 40, (3, 1, 2, 8))
    c[:, :, :, :4] *= 5  # the first half hot: stock's rank 0
    save_counts(tmp_path / "t.npy", c)
    out = tmp_path / "s.json"
    p = subprocess.run(CLI + ["--out", str(out), "--ranks", str(ranks), "--microbatches", "2", "--quick", "--trace",
                              str(tmp_path / "t.npy")], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert {r["workload"] for r in res["rows"]} == {"trace"} and res["meta"]["trace"]["shape"] == [3, 1, 2, 8]
    T, k, E, Y = 128, 2, 8, 2
    mm = []
    for m in range(2):  # step 0 (one round, no warm-up), microbatch m: the trace's call m, layer y mod 1
        for y in range(Y):
            load_E = sum(rescaled(c[m % 3, 0, d % 2], T, k) for d in range(ranks))
            load_D = load_E.reshape(ranks, -1).sum(axis=1)
            mm.append(load_D.max() / load_D.mean())
    stock = next(r for r in res["rows"] if r["policy"] == "stock")
    assert stock["stock_max_over_mean"] == pytest.approx(np.mean(mm), rel=1e-12)
    save_counts(tmp_path / "six.npy", c[..., :6])
    p = subprocess.run(CLI + ["--out", str(out), "--trace", str(tmp_path / "six.npy")], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "the bench's layers have 8 experts" in p.stderr.strip().splitlines()[-1], p.stderr


def _train(layers, xs, steps, policy):
    """Per microbatch: (loss, input gradient); per step the parameters after SGD."""
    from megatron_rails.bench import step as bench

    opt = torch.optim.SGD(layers.parameters(), lr=0.05)
    losses, params = [], []
    for s in range(steps):
        bench.Clock.step = s
        with bench._stock(policy):
            for i, x in enumerate(xs):
                bench.Clock.micro = i
                x = x.clone().requires_grad_(True)
                with bench.no_sync() if i < len(xs) - 1 else _null():
                    loss = bench._forward(layers, x).pow(2).mean()
                    loss.backward()
                losses.append((loss.item(), x.grad))
            opt.step()
            opt.zero_grad(set_to_none=True)
        params.append({n: p.detach().clone() for n, p in layers.state_dict().items() if torch.is_tensor(p)})
    return losses, params


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _stock_is_stock(rank, world):
    from megatron_rails.bench import step as bench

    xs = bench._microbatches(rank, SMALL, 3)
    for workload in ("hot-rank", "rotating"):
        got = bench.build(world, SMALL, "stock", workload, rank)
        ref = bench.build(world, SMALL, "stock", workload, rank, stock_dispatcher="allgather")
        ref.load_state_dict(got.state_dict())
        (lg, pg), (lr, pr) = _train(got, xs, 2, "stock"), _train(ref, xs, 2, "allgather")
        for (a, ga), (b, gb) in zip(lg, lr):
            assert abs(a - b) <= 1e-5 * abs(b), (workload, a, b)
            torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-6)
        for sg, sr in zip(pg, pr):
            for n in sr:
                torch.testing.assert_close(sg[n], sr[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{workload} {n}: {m}")


def test_the_bench_stock_is_megatron_core_stock():
    spawn(_stock_is_stock, 2)


def _moving_parity(rank, world, policies):
    from megatron_rails.bench import step as bench

    xs = bench._microbatches(rank, SMALL, 4)
    for workload in ("rotating", "burst"):
        stock = bench.build(world, SMALL, "stock", workload, rank)
        want_l, want_p = _train(stock, xs, 3, "stock")
        for policy in policies:
            layers = bench.build(world, SMALL, policy, workload, rank)
            layers.load_state_dict(bench.build(world, SMALL, "stock", workload, rank).state_dict())
            got_l, got_p = _train(layers, xs, 3, policy)
            recs = [r for layer in layers for r in layer.token_dispatcher.metrics]
            where = f"{workload}, {policy}, rank {rank}"
            for i, ((a, ga), (b, gb)) in enumerate(zip(got_l, want_l)):
                assert abs(a - b) <= 1e-5 * abs(b), f"{where}, microbatch {i}: {a} vs {b}"
                torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}, {i}: {m}")
            for s, (sg, sr) in enumerate(zip(got_p, want_p)):
                for n in sr:
                    torch.testing.assert_close(sg[n], sr[n], rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"{where}, after step {s}, {n}: {m}")
            if policy != "none":  # the premise: slots moved under the moving hot spot
                assert any(r["weight_bytes_sent"] for r in recs), f"{where}: no weights moved"


@pytest.mark.parametrize("policies", [("none", "eplb", "ultraep"), ("lp", "fsep", "default")])
def test_moving_workloads_train_like_stock(policies):
    """Three optimizer steps of 4 microbatches under the rotating hot spot and the burst, from stock's
    weights: every microbatch's loss and input gradient and every step's parameters equal stock
    alltoall's (a slot resident from an earlier microbatch that now serves another expert, or a
    placement kept from the step before, would leak a stale weight or gradient)."""
    spawn(_moving_parity, 2, policies)


def test_step_report_counts_two_of_three():
    """The docs' target table: a case is met where two of the three runs meet it."""
    from megatron_rails.bench.step_report import rows_table, targets_over_runs, targets_table

    def run(a, b, t):
        rows = [{"workload": "w", "policy": "p", "ratio_vs_stock": a, "of_ideal": b, "stock_max_over_mean": 1.5,
                 "max_over_mean_after": 1.0, "weight_bytes_per_step": 2e6, "relayouts_per_step": 1.0}]
        return {"rows": rows, "meta": {"wall_s": 60.0}, "targets": {"x": {"w p": t[0], "w q": t[1]}, "time": t[2]}}

    runs = [run(0.9, 0.95, (True, False, True)), run(0.91, 0.96, (True, True, False)),
            run(0.92, 0.97, (False, False, False))]
    got = targets_over_runs(runs)
    assert got["x"]["cases"] == {"w p": (2, 3), "w q": (1, 3)} and not got["x"]["all_met"]
    assert got["time"]["cases"] == {None: (1, 3)} and not got["time"]["all_met"]
    assert targets_over_runs(runs[:2])["x"]["cases"]["w p"] == (2, 2)
    assert "w q (1/3)" in targets_table(runs) and "| 1 of 2 |" in targets_table(runs)
    assert "| w | p | 0.900 / 0.910 / 0.920 | 0.950 / 0.960 / 0.970 | 1.50 → 1.00 | 2.0 | 1.0 |" in rows_table(runs)


def test_step_report_pools_medians_over_runs():
    """The pooled table: per workload the median over the runs having it (an even count: the mean
    of the middle two) of each policy's median, a policy a run lacks left out of its median."""
    from megatron_rails.bench.step_report import POOLED, pooled_table

    def run(ratios, workloads=("w",)):
        rows = []
        for w in workloads:
            rows.append({"workload": w, "policy": "stock", "ratio_vs_stock": 1.0, "of_ideal": 0.8,
                         "stock_max_over_mean": 1.5})
            rows += [{"workload": w, "policy": p, "ratio_vs_stock": r, "of_ideal": 1.0 / r}
                     for p, r in zip(POOLED, ratios)]
        return {"rows": rows}

    runs = [run([0.9] * 6), run([1.1] * 6, ("w", "v")), run([1.0] * 5), run([0.8] * 6, ("w", "v"))]
    lines = pooled_table(runs).splitlines()
    w = next(ln for ln in lines if ln.startswith("| w |"))
    # none..fsep: 0.8, 0.9, 1.0, 1.1 -> 0.95; default: 0.8, 0.9, 1.1 (the third run lacks it) -> 0.9
    assert w == "| w | 1.50 | 0.950 | 0.950 | 0.950 | 0.950 | 0.950 | 0.900 | " + f"{1 / 0.9:.3f}" + " | 4 |"
    v = next(ln for ln in lines if ln.startswith("| v |"))
    assert v.endswith(f"| 0.950 | {(1 / 0.8 + 1 / 1.1) / 2:.3f} | 2 |")


def test_docs_hold_the_committed_step_runs():
    """docs/benchmarks.md's step tables are step_report's on the committed runs (bench/step-runs/):
    the three of the current default, their targets, and the pooled medians with the runs before."""
    from pathlib import Path

    from megatron_rails.bench.step_report import load, pooled_table, rows_table, targets_table

    root = Path(__file__).resolve().parents[1]
    runs = load([str(root / "bench" / "step-runs" / f"run{i}.json") for i in (1, 2, 3)])
    before = load([str(root / "bench" / "step-runs" / "2026-12-07" / f"run{i}.json") for i in (1, 2, 3)])
    doc = (root / "docs" / "benchmarks.md").read_text()
    for table in (rows_table(runs), targets_table(runs), pooled_table(before + runs)):
        assert table in doc
