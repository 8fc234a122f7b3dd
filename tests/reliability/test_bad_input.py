"""Bad input gets a clear error before any communication starts, naming the file, key or flag.

Config-level cases go through the one loader (`load_any` / `load_run_config`) and the CLI, with no
process group at all. Build-time cases (a MoE layer under an impossible policy) run on spawned gloo
ranks whose collectives are replaced by a sentinel that fails the test if anything communicates.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from moe_harness import build_moe_layer, moe_config, spawn

ROOT = Path(__file__).resolve().parents[2]
MINI = ROOT / "configs" / "mini" / "mini-mixtral.yaml"

POLICY_CASES = [  # (id, policy YAML text, what the message must contain)
    ("unknown key", "policy: fsep\nturbo: true\n", ["turbo", "unknown"]),
    ("mistyped key", "policy: fsep\nslot: 2\n", ["slot", "did you mean 'slots'"]),
    ("wrong type", "policy: fsep\nslots: two\n", ["slots"]),
    ("negative slots", "policy: fsep\nslots: -1\n", ["slots"]),
    ("unknown policy", "policy: fsepp\n", ["policy", "fsepp"]),
    ("unknown comm", "policy: fsep\ncomm: infiniband\n", ["comm", "infiniband"]),
    ("slots below policy need", "policy: ultraep\nslots: 0\n", ["slots", "ultraep"]),
    ("bad lp placement", "policy: lp\nplacement: magic\n", ["placement", "magic"]),
    ("not a mapping", "- fsep\n- ultraep\n", ["mapping"]),
]


@pytest.mark.parametrize("text,needles", [c[1:] for c in POLICY_CASES], ids=[c[0] for c in POLICY_CASES])
def test_policy_yaml_errors_name_file_and_key(tmp_path, text, needles):
    from megatron_rails.core.policy import ConfigError
    from megatron_rails.config.run import load_any

    path = tmp_path / "policies" / "bad.yaml"
    path.parent.mkdir()
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_any(path)
    msg = str(err.value)
    assert str(path) in msg, msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in: {msg}"


RUN_CASES = [  # (id, overrides on the mini run config, what the message must contain)
    ("topology vs world size", ["topology.gpus_per_node=3"], ["gpus_per_node"]),
    ("experts not divisible for stock EP", ["model.num_experts=6", "balancer.policy=none"], ["num_experts"]),
    ("unknown section key", ["model.hiden_size=64"], ["hiden_size", "did you mean"]),
    ("unknown topology", ["topology=dgx-z9000"], ["dgx-z9000"]),
]


@pytest.mark.parametrize("overrides,needles", [c[1:] for c in RUN_CASES], ids=[c[0] for c in RUN_CASES])
def test_run_config_errors_name_the_key(overrides, needles):
    from megatron_rails.core.policy import ConfigError
    from megatron_rails.config.run import load_run_config

    with pytest.raises(ConfigError) as err:
        load_run_config(MINI, overrides)
    msg = str(err.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in: {msg}"


def test_missing_files_are_named(tmp_path):
    from megatron_rails.core.policy import ConfigError, PolicyConfig
    from megatron_rails.config.run import load_run_config

    for load in (PolicyConfig.from_yaml, load_run_config):
        with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "nope.yaml"))):
            load(tmp_path / "nope.yaml")
    proc = subprocess.run([sys.executable, "-m", "megatron_rails.cli", "config", "validate", str(tmp_path / "nope.yaml")],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "nope.yaml" in proc.stdout + proc.stderr


@pytest.mark.parametrize("argv,flag", [(["--moe-balancer", "bogus"], "--moe-balancer"),
                                       (["--moe-balancer", "fsep", "--moe-rails-comm", "ib"], "--moe-rails-comm"),
                                       (["--moe-balancer", "fsep", "--moe-balancer-slots", "-2"], "--moe-balancer-slots"),
                                       (["--rails-config", "/nonexistent/p.yaml"], "/nonexistent/p.yaml")])
def test_megatron_flags_errors_name_the_flag(argv, flag, capsys):
    import argparse

    from megatron_rails.megatron import add_arguments, install_from_args

    parser = add_arguments(argparse.ArgumentParser(prog="pretrain_gpt.py"))
    with pytest.raises(SystemExit) as ex:
        args = parser.parse_args(argv)
        install_from_args(args)  # file-level problems surface here (argparse already validated the rest)
    assert ex.value.code == 2
    assert flag in capsys.readouterr().err


def _no_comm_worker(rank, world, pcfg, expect):
    import torch.distributed as dist

    import megatron_rails

    def sentinel(*args, **kwargs):
        raise AssertionError("communication started before the configuration error was raised")

    for name in ("all_to_all_single", "all_gather", "all_reduce", "new_group", "broadcast"):
        setattr(dist, name, sentinel)
    megatron_rails.install(pcfg)
    try:
        with pytest.raises(Exception, match=expect):
            build_moe_layer(moe_config(world, "alltoall", experts=8))
    finally:
        megatron_rails.uninstall()


@pytest.mark.parametrize("pcfg,expect", [
    ({"policy": "ultraep", "ranks_per_node": 3}, "ranks_per_node=3 does not divide"),
    ({"policy": "fsep", "comm": "rails", "ranks_per_node": 3}, "ranks_per_node"),
], ids=["node size vs EP size", "rails node size vs EP size"])
def test_build_time_errors_come_before_any_collective(pcfg, expect):
    spawn(_no_comm_worker, 4, pcfg, expect)
