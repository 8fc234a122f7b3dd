"""sim/memory.py: the busiest GPU's memory per policy, against arithmetic written out here from the
configs' numbers (Megatron-LM's bytes per parameter and activation estimate, the experts divided by
EP); `simulate run` prints it in 80 columns and puts it in its JSON; a bad gpu_memory_gib is one
error. tests/test_bench_step.py checks the expert bytes against what `bench step` measured by
storage, and the slots against the size of the windows it held."""
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rails.config.run import load_run_config
from megatron_rails.core.policy import ConfigError, PolicyConfig
from megatron_rails.core.topology import Topology
from megatron_rails.sim.memory import gpu_memory, memory_rows

ROOT = Path(__file__).resolve().parents[1]
X7 = ROOT / "configs" / "mixtral" / "mixtral-8x7b.yaml"
X22 = ROOT / "configs" / "mixtral" / "mixtral-8x22b.yaml"


def test_mixtral_8x7b_by_hand():
    rc = load_run_config(X7)
    # PP4: 8 of the 32 layers on a stage; EP8: one expert a GPU, 3 x 4096 x 14336 parameters (SwiGLU)
    expert = 3 * 4096 * 14336
    layers = 32 // 4
    stock = gpu_memory(rc, None)
    assert stock["expert_weights_grads"] == layers * expert * (2 + 4)  # bf16 weight, fp32 main_grad
    # the distributed optimizer over the expert data-parallel group: 32 GPUs / (EP8 x PP4) = 1
    assert stock["expert_optimizer"] == layers * expert * 12 / 1
    assert stock["slots"] == 0 and stock["expert_bytes"] == stock["expert_weights_grads"]
    # activations, Megatron-LM's estimate without sequence parallelism: s b H (10 + 24 / TP) per layer
    # over all 32 layers (PP microbatches in flight on the first stage), the embedding's, x min(1, m / PP),
    # x 1.05
    s, b, H, pp = 4096, rc.training.micro_batch_size, 4096, 4
    m = rc.training.global_batch_size // (b * rc.data_parallel_size)
    act = (s * b * H * (10 + 24) * 32 + 8 * s * b * pp + s * b * H * pp) * min(1, m / pp) * 1.05
    assert stock["activations"] == pytest.approx(act, rel=1e-12)
    pol = rc.balancer
    ultraep = gpu_memory(rc, dataclasses.replace(pol, policy="ultraep"))
    assert ultraep["slots"] == layers * pol.slots * expert * (2 + 4)  # replica weights and fp32 accumulators
    fsep = gpu_memory(rc, dataclasses.replace(pol, policy="fsep"))
    assert fsep["slots"] == layers * (1 + pol.slots) * expert * (2 + 4)  # ceil(E / EP) + R slots
    assert fsep["expert_optimizer"] == stock["expert_optimizer"]  # the shards' state is the experts'
    assert gpu_memory(rc, dataclasses.replace(pol, policy="lp", placement="fsep"))["slots"] == fsep["slots"]
    assert gpu_memory(rc, dataclasses.replace(pol, policy="lp", placement="static"))["slots"] == 0
    assert gpu_memory(rc, dataclasses.replace(pol, policy="none"))["slots"] == 0
    for g in (stock, ultraep, fsep):
        parts = ("expert_weights_grads", "expert_optimizer", "slots", "dense", "activations")
        assert g["total"] == pytest.approx(sum(g[k] for k in parts), rel=1e-12)


def test_rows_fit_against_the_topology():
    rc = load_run_config(X22)
    rows = memory_rows(rc, {p: dataclasses.replace(rc.balancer, policy=p) for p in ("none", "ultraep", "fsep")})
    assert [r["policy"] for r in rows] == ["stock", "none", "ultraep", "fsep"]
    for r in rows:
        assert r["gpu_memory_gib"] == 80 and r["fits"] == (r["total"] <= 80 * 2**30)
        assert r["expert_over_stock"] == pytest.approx(r["expert_bytes"] / rows[0]["expert_bytes"])
    assert rows[1]["expert_over_stock"] == 1.0
    # 2 slots beside one expert a GPU (EP8, ETP1): three experts' weights and accumulators per layer
    assert rows[2]["expert_over_stock"] == pytest.approx(3.0)
    small = dataclasses.replace(rc, topology=dataclasses.replace(rc.topology, gpu_memory_gib=1.0))
    assert not any(r["fits"] for r in memory_rows(small, {}))


def test_fp32_and_sgd_and_no_distributed_optimizer():
    rc = load_run_config(X7, ["training.bf16=false", "training.use_distributed_optimizer=false",
                              "training.optimizer=sgd"])
    g = gpu_memory(rc, PolicyConfig(policy="ultraep", slots=1))
    expert = 3 * 4096 * 14336
    assert g["expert_weights_grads"] == 8 * expert * (4 + 4)  # fp32 weight and gradient
    assert g["expert_optimizer"] == 8 * expert * 4  # SGD's momentum, no master copy, not sharded
    assert g["slots"] == 8 * expert * (4 + 4)


@pytest.mark.parametrize("value", [0, -1, "80", float("inf")])
def test_bad_gpu_memory_is_one_error(value):
    with pytest.raises(ConfigError, match="gpu_memory_gib: expected a finite positive number"):
        Topology(gpu_memory_gib=value)


def test_gpu_memory_takes_a_run_config():
    with pytest.raises(TypeError, match="takes a RunConfig"):
        gpu_memory({"model": {}}, None)


def test_simulate_run_prints_and_returns_memory():
    cmd = [sys.executable, "-m", "megatron_rails.cli", "simulate", "run", str(X7), "--steps", "1", "--quiet"]
    env = dict(os.environ, COLUMNS="80")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert max(map(len, lines)) <= 80, out.stdout
    at = next(i for i, ln in enumerate(lines) if ln.strip().startswith("memory of the busiest GPU"))
    cells = [[c for c in ln.split() if c != "|"] for ln in lines[at:]]
    assert ["stock", "1.00x", "yes"] in [c[:1] + c[-2:] for c in cells], out.stdout
    res = json.loads(subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=300, env=env,
                                    cwd=ROOT).stdout)
    policies = [r["policy"] for r in res["memory"]]
    assert policies[0] == "stock" and set(policies[1:]) == {r["policy"] for r in res["rows"]}
    assert all(math.isfinite(r["total"]) and r["total"] > 0 for r in res["memory"])
