"""`simulate run` (iteration-time simulator), `trace` (routing capture) and the commands of
docs/simulator.md and docs/reproduction.md."""
import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from megatron_rails import cli
from megatron_rails.core.planners import PlannerConfig, make_planner
from megatron_rails.config.run import load_run_config
from megatron_rails.sim.model import CommModel, Setup, SimOptions, layer_cost
from megatron_rails.sim.run import COMPONENTS, Workload, rescale_rows, simulate_run
from megatron_rails.core.trace import load_trace, save_trace

ROOT = Path(__file__).resolve().parents[1]
X7 = str(ROOT / "configs" / "mixtral" / "mixtral-8x7b.yaml")
# the same model on 4-GPU nodes: EP8 spans two nodes, so the token all-to-all crosses rails
CROSS = ["topology.gpus_per_node=4", "topology.rails_per_node=4", "parallelism.nodes=8", "balancer.ranks_per_node=0"]


def sim_json(capsys, *argv):
    assert cli.main(["simulate", "run", *argv, "--json", "--quiet"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def skewed():
    """zipf:1.2 on Mixtral 8x7B whose EP group spans two nodes, every policy x comm, 2 steps; the plain
    exchange (a row per token-expert pair, dedup off): with node dedup the rows crossing nodes go to the
    sender's rail, balanced, and leave RailS nothing to fix (tests/test_sim_dedup_model.py)."""
    setup = Setup.from_run_config(load_run_config(X7, CROSS))
    wl = Workload(setup, skew="zipf:1.2")
    return simulate_run(setup, SimOptions(dedup=False), "none,eplb,fsep,ultraep,lp", "direct,rails", 2, wl)


def test_breakdown_adds_up_and_baseline(skewed):
    rows = skewed["rows"]
    assert len(rows) == 10
    for r in rows + skewed["force_balanced"]:
        assert set(r["breakdown"]) == set(COMPONENTS)
        assert sum(r["breakdown"].values()) == pytest.approx(r["iteration_ms"], rel=1e-12)
        assert np.mean(r["iteration_ms_steps"]) == pytest.approx(r["iteration_ms"], rel=1e-12)
        assert all(v >= 0 for v in r["breakdown"].values())
    # 1F1B with m microbatches on pp stages: the iteration is (m + pp - 1) x the slowest stage's microbatch
    # time, so the bubble is (pp - 1) / m x the rest of the breakdown
    m, pp = skewed["setup"]["microbatches"], skewed["setup"]["pp"]
    assert pp > 1
    for r in rows + skewed["force_balanced"]:
        busy = sum(v for k, v in r["breakdown"].items() if k != "pipeline_bubble_ms")
        assert r["breakdown"]["pipeline_bubble_ms"] == pytest.approx((pp - 1) / m * busy, rel=1e-12)
        assert r["iteration_ms"] == pytest.approx((m + pp - 1) / m * busy, rel=1e-12)
    base = next(r for r in rows if (r["policy"], r["comm"]) == ("none", "direct"))
    ideal = {r["comm"]: r["iteration_ms"] for r in skewed["force_balanced"]}
    for r in rows:  # speedup over stock EP (none, direct) and share of the ideal, from the iteration times
        assert r["speedup"] == pytest.approx(base["iteration_ms"] / r["iteration_ms"], rel=1e-12)
        assert r["of_force_balanced"] == pytest.approx(ideal[r["comm"]] / r["iteration_ms"], rel=1e-12)
    assert base["breakdown"]["weights_ms"] == 0.0  # stock EP moves no weights


def test_balanced_policies_compute_less_and_rails_not_slower(skewed):
    by = {(r["policy"], r["comm"]): r for r in skewed["rows"]}
    for comm in ("direct", "rails"):
        none = by["none", comm]["breakdown"]["expert_compute_ms"]
        for pol in ("eplb", "fsep", "ultraep", "lp"):
            assert by[pol, comm]["breakdown"]["expert_compute_ms"] <= none
            assert by[pol, comm]["max_over_mean"] < by["none", comm]["max_over_mean"]
        # ultraep reaches the exact optimum ceil(mean): the force-balanced compute
        ideal = next(r for r in skewed["force_balanced"] if r["comm"] == comm)
        assert by["ultraep", comm]["breakdown"]["expert_compute_ms"] == pytest.approx(
            ideal["breakdown"]["expert_compute_ms"], rel=1e-3)
    for pol in ("none", "eplb", "fsep", "ultraep", "lp"):
        assert by[pol, "rails"]["breakdown"]["token_a2a_ms"] <= by[pol, "direct"]["breakdown"]["token_a2a_ms"]
    assert by["none", "rails"]["breakdown"]["token_a2a_ms"] < 0.8 * by["none", "direct"]["breakdown"]["token_a2a_ms"]
    assert by["none", "rails"]["speedup"] > 1.0


def test_compute_is_hand_computed_flops_on_the_busiest_rank():
    setup = Setup.from_run_config(load_run_config(X7))
    opts = SimOptions(mfu=0.4)
    comm = CommModel(setup.ep_topo)
    D, E = 8, 8
    counts = np.full((D, E), 512, dtype=np.int64)
    counts[:, 3] += 1000  # expert 3 (rank 3 under stock EP) gets 8 x 1512 tokens
    plan, _ = make_planner("none", PlannerConfig(D, E, 8, 1)).plan(counts)
    assert plan.load_D.max() == 8 * 1512
    cost = layer_cost(setup, opts, plan, comm, "direct")
    # SwiGLU: 3 GEMMs of 4096 x 14336 -> 6 * 4096 * 14336 FLOPs forward per token, x3 with backward,
    # at 989 TFLOP/s x 0.4
    want_ms = 8 * 1512 * 6 * 4096 * 14336 * 3 / (989e12 * 0.4) * 1e3
    assert cost["expert_compute_ms"] == pytest.approx(want_ms, rel=1e-12)
    assert cost["max_load"] == 12096
    doubled = layer_cost(setup, opts, make_planner("none", PlannerConfig(D, E, 8, 1)).plan(2 * counts)[0], comm,
                         "direct")
    assert doubled["expert_compute_ms"] == pytest.approx(2 * want_ms, rel=1e-12)
    # dense part: a policy-independent function of the shape (4096 tokens x per-token FLOPs)
    H, s, kv = 4096, 4096, 4096 * 8 / 32
    fwd = 2 * H * (H + 2 * kv) + 2 * H * H + 2 * s * H + 2 * H * E
    assert cost["dense_ms"] == pytest.approx(4096 * 3 * fwd / (989e12 * 0.4) * 1e3, rel=1e-12)


def test_weights_and_overlap_options(capsys):
    base = ["--steps", "1", "--policies", "none,fsep,ultraep", "--comm", "direct"]
    every = {r["policy"]: r for r in sim_json(capsys, X7, *base, "--weight-sync", "microbatch")["rows"]}
    hidden = {r["policy"]: r for r in sim_json(capsys, X7, *base, "--weight-sync", "microbatch",
                                               "--overlap", "weights")["rows"]}
    once = {r["policy"]: r for r in sim_json(capsys, X7, *base, "--weight-sync", "iteration")["rows"]}
    m = 32  # microbatches per iteration of the shipped 8x7B config
    for pol in ("fsep", "ultraep"):
        assert every[pol]["breakdown"]["weights_ms"] > 0
        assert hidden[pol]["breakdown"]["weights_ms"] <= every[pol]["breakdown"]["weights_ms"]
        # one fetch + one gradient return per iteration instead of one per microbatch: 1/m of the time
        assert once[pol]["weights_total_ms_per_layer"] == pytest.approx(
            every[pol]["weights_total_ms_per_layer"] / m, rel=1e-9)
        assert 0 < once[pol]["breakdown"]["weights_ms"] < every[pol]["breakdown"]["weights_ms"] / 10
        assert every[pol]["breakdown"]["expert_compute_ms"] == hidden[pol]["breakdown"]["expert_compute_ms"]
        assert once[pol]["breakdown"]["expert_compute_ms"] == every[pol]["breakdown"]["expert_compute_ms"]
        # the bytes of one fetch do not depend on how often it happens
        assert once[pol]["weight_bytes_per_layer"] == every[pol]["weight_bytes_per_layer"]
    # fsep: every slot with tokens gathers 7/8 of a 3 x 4096 x 14336 bf16 expert
    assert every["fsep"]["weight_bytes_per_layer"] > 0
    assert every["none"]["weight_bytes_per_layer"] == 0


def test_weight_sync_defaults_to_iteration(capsys):
    """The dispatcher keeps replica / FSEP slot weights resident for an optimizer step, so the default
    run prices exactly `--weight-sync iteration`; on a skewed workload fsep moves weights, and
    `--weight-sync microbatch` costs it more."""
    base = ["--steps", "1", "--policies", "none,fsep", "--comm", "direct", "--skew", "zipf:1.2"]
    default = sim_json(capsys, X7, *base)
    once = sim_json(capsys, X7, *base, "--weight-sync", "iteration")
    every = sim_json(capsys, X7, *base, "--weight-sync", "microbatch")
    assert default["options"]["weight_sync"] == "iteration"
    assert "once per iteration" in default["assumptions"]["weight_sync"]
    fsep = {name: next(r for r in res["rows"] if r["policy"] == "fsep")
            for name, res in (("default", default), ("once", once), ("every", every))}
    assert fsep["default"]["breakdown"]["weights_ms"] > 0
    assert fsep["default"]["breakdown"]["weights_ms"] == fsep["once"]["breakdown"]["weights_ms"]
    assert fsep["default"]["weights_total_ms_per_layer"] == fsep["once"]["weights_total_ms_per_layer"]
    assert fsep["every"]["breakdown"]["weights_ms"] > fsep["default"]["breakdown"]["weights_ms"]
    assert fsep["every"]["iteration_ms"] > fsep["default"]["iteration_ms"]
    assert SimOptions().weight_sync == "iteration"


def test_json_keys_and_plot(capsys, tmp_path):
    png = tmp_path / "sim.png"
    out = sim_json(capsys, X7, "--steps", "1", "--policies", "none,ultraep", "--comm", "direct,rails",
                   "--plot", str(png), "--skew", "zipf:0.8")
    assert png.stat().st_size > 1000
    assert {"setup", "options", "workload", "assumptions", "rows", "force_balanced"} <= set(out)
    assert [(r["policy"], r["comm"]) for r in out["rows"]] == [("none", "direct"), ("none", "rails"),
                                                                ("ultraep", "direct"), ("ultraep", "rails")]
    for r in out["rows"]:
        assert {"policy", "comm", "iteration_ms", "breakdown", "speedup", "of_force_balanced"} <= set(r)
    assert out["setup"]["ep"] == 8 and out["setup"]["microbatches"] == 32 and out["workload"].startswith("zipf:0.8")


def test_table_and_progress(capsys):
    assert cli.main(["simulate", "run", X7, "--steps", "2", "--policies", "none,eplb", "--comm", "direct"]) == 0
    out, err = capsys.readouterr()
    assert "iter ms" in out and "eplb" in out and "force-balanced ideal" in out
    assert "step 1/2" in err and "step 2/2" in err


@pytest.mark.parametrize("argv,msg", [
    ([X7, "--policies", "none,bogus"], "unknown policy 'bogus'"),
    ([X7, "--comm", "direct,ib"], "unknown comm 'ib'"),
    (["/nonexistent/run.yaml"], "file not found"),
    ([X7, "--policies", ""], "--policies '': no policy named"),
    ([X7, "--skew", "zipf:x"], "bad skew"),
    ([X7, "--trace", "/nonexistent/trace.npz"], "does not exist"),
    ([X7, "model.num_layerz=3"], "unknown key"),
])
def test_bad_arguments_exit_nonzero_with_a_clear_message(capsys, argv, msg):
    assert cli.main(["simulate", "run", *argv, "--steps", "1", "--quiet"]) == 2
    assert msg in capsys.readouterr().err


def test_argparse_errors(capsys):
    for argv in (["--steps", "0"], ["--overlap", "always"], ["--mfu", "1.5"]):
        with pytest.raises(SystemExit) as e:
            cli.main(["simulate", "run", X7, *argv])
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--steps must be >= 1" in err and "--mfu must be a finite number >= 0.001 and <= 1, got 1.5" in err
    with pytest.raises(SystemExit) as e:
        cli.main(["trace", "--out", "x.npz", "--policy", "bogus"])
    assert e.value.code == 2


def test_trace_files_and_mismatch(capsys, tmp_path):
    rng = np.random.default_rng(0)
    c = rng.integers(0, 50, (3, 2, 4, 8))
    p = save_trace(tmp_path / "t.npz", c, {"topk": 2, "policy": "none"})
    got, meta = load_trace(p)
    assert np.array_equal(got, c) and meta["ranks"] == 4 and meta["format"] == "megatron-rails-trace"
    save_trace(tmp_path / "t.npy", c)  # workloads.save_counts format
    assert np.array_equal(load_trace(tmp_path / "t.npy")[0], c)
    assert rescale_rows(np.array([[3, 1, 0]]), 8).tolist() == [[6, 2, 0]]
    assert rescale_rows(np.array([[1, 1, 1], [0, 0, 0]]), 4).tolist() == [[2, 1, 1], [0, 0, 0]]
    assert cli.main(["simulate", "run", X7, "--trace", str(p), "--steps", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "D=4" in err and "expert-parallel size 8" in err and "expert_model_parallel_size=4" in err
    # the overrides it names make the config take the trace, nodes included where the world must grow
    # (the mini config: EP 4 on 4 ranks; a trace of 8 ranks needs 8)
    mini = str(ROOT / "configs" / "mini" / "mini-mixtral.yaml")
    p8 = save_trace(tmp_path / "t8.npz", rng.integers(0, 50, (2, 2, 8, 8)), {"topk": 2, "policy": "none"})
    for config, trace in ((X7, p), (mini, p8)):
        assert cli.main(["simulate", "run", config, "--trace", str(trace), "--steps", "1", "--quiet"]) == 2
        hint = capsys.readouterr().err.split("simulate a config with ")[1].split(" (KEY=VALUE")[0]
        overrides = hint.replace(" and ", ", ").split(", ")
        assert ("parallelism.nodes=4" in overrides) == (config == mini), overrides
        assert cli.main(["simulate", "run", config, "--trace", str(trace), "--steps", "1", "--quiet", "--json",
                         *overrides]) == 0, overrides
        capsys.readouterr()


# -- the commands of the docs ---------------------------------------------------------------------------------

def doc_commands(name: str) -> list[str]:
    text = (ROOT / "docs" / name).read_text()
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith("megatron-rails "):
                cmds.append(line)
    return cmds


def run_doc_command(line: str, tmp_path: Path, capsys) -> str:
    argv = shlex.split(line)[1:]
    for i, a in enumerate(argv):
        if argv[i - 1] in ("--out", "--plot", "--trace") and i:
            argv[i] = str(tmp_path / Path(a).name)
        if argv[i - 1] == "--steps" and i and argv[0] == "simulate":
            argv[i] = "1"
        if a.startswith("configs/"):
            argv[i] = str(ROOT / a)
    assert cli.main(argv + (["--quiet"] if argv[0] in ("simulate", "trace") else [])) == 0, line
    return capsys.readouterr().out


def test_simulator_doc_commands_and_trace_round_trip(capsys, tmp_path):
    """Every command of docs/simulator.md; its trace commands record 2 real gloo ranks and replay them."""
    cmds = doc_commands("simulator.md")
    assert any(c.startswith("megatron-rails trace ") for c in cmds)
    assert any("--trace" in c and "simulate run" in c for c in cmds)
    for line in cmds:
        out = run_doc_command(line, tmp_path, capsys)
        if line.startswith("megatron-rails trace "):
            counts, meta = load_trace(tmp_path / "trace.npz")
            I, Y, D, E = counts.shape
            assert (Y, D, E) == (2, 2, 8) and I >= 2 and meta["ranks"] == 2 and meta["topk"] == 2
            assert (counts.sum(axis=3) == 2 * 32 * 2).all()  # micro-batch 2 x seq 32 x top-2 per rank
            assert (counts.max(axis=(0, 1, 2)) > 0).sum() >= 2
        if "--trace" in line and "--json" in line:
            res = json.loads(out)
            assert res["workload"].startswith("trace ") and res["setup"]["ep"] == 2
            none = next(r for r in res["rows"] if r["policy"] == "none")
            stock = [counts[s % I, layer % Y] for s in range(1) for layer in range(32)]
            from megatron_rails.core.plan import imbalance, stock_load_D
            want = np.mean([imbalance(stock_load_D(rescale_rows(c, 4096 * 2), 2)) for c in stock])
            assert none["max_over_mean"] == pytest.approx(want, rel=1e-9)


def test_reproduction_doc_commands(capsys, tmp_path):
    cmds = doc_commands("reproduction.md")
    text = (ROOT / "docs" / "reproduction.md").read_text()
    assert len(cmds) == int(re.search(r"All (\d+) runs", text).group(1))  # the count its prose quotes
    # every setup the page describes is run: both shipped Mixtral configs, the 32-A100 and the cross-node layout
    for words in ("mixtral-8x7b.yaml --skew", "mixtral-8x22b.yaml --skew", "topology=dgx-a100", " ".join(CROSS)):
        assert any(words in c for c in cmds), words
    for line in cmds:
        run_doc_command(line, tmp_path, capsys)


@pytest.mark.parametrize("model", ["fluid", "phased"])
def test_single_node_closed_form_matches_the_flow_model(model):
    from megatron_rails.sim.rails import simulate
    from megatron_rails.core.topology import load_topology

    rng = np.random.default_rng(1)
    topo = load_topology("dgx-h100").with_nodes(1)
    fast = CommModel(topo, model)
    for _ in range(20):
        traffic = rng.integers(0, 5000, (8, 8)) * (rng.random((8, 8)) < 0.7)
        for r in simulate(traffic, topo, 8192, schemes=("direct", "rails")):
            want = (r.completion_us if model == "fluid" else r.phased_us) / 1e3
            assert fast.ms(traffic, 8192, r.scheme) == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_progress_within_a_long_step(monkeypatch):
    """A step of many layers reports the layers done as it goes (at most every PROGRESS_S), then the step."""
    from megatron_rails.sim import run as run_mod

    monkeypatch.setattr(run_mod, "PROGRESS_S", 0.0)  # every layer
    setup = Setup.from_run_config(load_run_config(X7, ["model.num_layers=4"]))
    calls = []
    simulate_run(setup, SimOptions(dedup=False), "none", "direct", 2, Workload(setup),
                 lambda *a: calls.append((a[0], a[1], a[3])))
    assert calls == [(0, 2, 1), (0, 2, 2), (0, 2, 3), (1, 2, None), (1, 2, 1), (1, 2, 2), (1, 2, 3), (2, 2, None)]
