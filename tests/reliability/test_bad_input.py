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


# every torch.distributed entry point that communicates (or makes a group, which is a collective
# where the default group is bound to a device)
COMM_FUNCTIONS = (
    "all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list",
    "gather", "gather_object", "scatter", "scatter_object_list", "barrier", "monitored_barrier",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "new_group", "new_subgroups",
)


def _no_comm_worker(rank, world, pcfg, expect):
    import sys

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    import megatron_rails

    called = []

    def sentinel_for(name):
        def sentinel(*args, **kwargs):
            called.append(name)
            raise AssertionError(f"communication ({name}) started before the configuration error was raised")
        return sentinel

    # `from torch.distributed import all_reduce` (in torch itself, Megatron-Core or this package)
    # binds the function where it was imported: patching torch.distributed alone misses those. So
    # every loaded module's name bound to one of these functions is replaced (torch.distributed,
    # distributed_c10d, whose own collectives call each other through its globals, included);
    # modules imported later get the sentinel from torch.distributed itself
    real = {id(getattr(dist, n)): n for n in COMM_FUNCTIONS if hasattr(dist, n)}
    assert len(real) >= 20, sorted(real.values())
    patched = []
    for mod in list(sys.modules.values()):
        for attr, val in list(getattr(mod, "__dict__", {}).items()):
            if id(val) in real:
                patched.append((mod, attr, val))
                setattr(mod, attr, sentinel_for(real[id(val)]))
    assert {(m, a) for m, a, _ in patched} >= {(dist, n) for n in real.values()} | \
        {(distributed_c10d, n) for n in real.values() if hasattr(distributed_c10d, n)}
    megatron_rails.install(pcfg)
    try:
        with pytest.raises(Exception) as err:
            build_moe_layer(moe_config(world, "alltoall", experts=8))
        assert not called, f"communication started before the configuration error was raised: {called}"
        assert re.search(expect, str(err.value)), str(err.value)
    finally:
        megatron_rails.uninstall()
        for mod, attr, val in patched:
            setattr(mod, attr, val)


@pytest.mark.parametrize("pcfg,expect", [
    ({"policy": "ultraep", "ranks_per_node": 3}, "ranks_per_node=3 does not divide"),
    ({"policy": "fsep", "comm": "rails", "ranks_per_node": 3}, "ranks_per_node"),
], ids=["node size vs EP size", "rails node size vs EP size"])
def test_build_time_errors_come_before_any_collective(pcfg, expect):
    spawn(_no_comm_worker, 4, pcfg, expect)
