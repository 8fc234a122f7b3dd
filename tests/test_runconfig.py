"""Run configs and the one loader: every shipped YAML validates, each class of mistake gets a message
naming the file and the key, overrides work the same everywhere, the reference doc matches the code."""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_rails.core.policy import ConfigError, PolicyConfig
from megatron_rails.core.topology import Topology
from megatron_rails.config.run import RunConfig, load_any, load_run_config

ROOT = Path(__file__).resolve().parent.parent
MINI = ROOT / "configs" / "mini" / "mini-mixtral.yaml"
M8x7 = ROOT / "configs" / "mixtral" / "mixtral-8x7b.yaml"
M8x22 = ROOT / "configs" / "mixtral" / "mixtral-8x22b.yaml"
ALL = sorted((ROOT / "configs").glob("**/*.yaml"))
CLI = [sys.executable, "-m", "megatron_rails.cli"]


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_shipped_config_validates(path, tmp_path):
    obj = load_any(path)
    want = {"policies": PolicyConfig, "topology": Topology}.get(path.parent.name, RunConfig)
    assert isinstance(obj, want)
    if isinstance(obj, RunConfig):  # the resolved form (balancer and topology inline) loads to the same config
        f = tmp_path / "resolved.yaml"
        f.write_text(yaml.safe_dump(obj.to_dict(), sort_keys=False))
        assert dataclasses.replace(load_run_config(f), source=obj.source) == obj


RUNS = [p for p in ALL if p.parent.name not in ("policies", "topology")]
PRESETS = sorted(p.stem for p in (ROOT / "configs" / "policies").glob("*.yaml"))


@pytest.mark.parametrize("path", RUNS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_policy_preset_fits_every_run_config(path):
    """docs/slurm.md: `balancer=NAME` swaps the policy of a run config; no preset fixes a node size
    that contradicts the run's layout (they derive it: ranks_per_node 0)."""
    base = load_run_config(path)
    over = [] if base.balancer is not None else ["model.moe_token_dispatcher_type=alltoall"]
    for name in PRESETS:
        c = load_run_config(path, [f"balancer={name}", *over])
        assert c.balancer.policy == load_any(ROOT / "configs" / "policies" / f"{name}.yaml").policy
        assert 1 <= c.balancer.ranks_per_node <= c.parallelism.expert_model_parallel_size, (name, c.balancer)


def test_mixtral_configs_say_the_published_shapes():
    a, b = load_run_config(M8x7), load_run_config(M8x22)
    m, p, t = a.model, a.parallelism, a.training
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups,
            m.seq_length, m.rotary_base, m.num_experts, m.moe_router_topk) == (32, 4096, 14336, 32, 8, 4096, 10**6, 8, 2)
    assert (m.normalization, m.swiglu, m.moe_aux_loss_coeff, m.moe_grouped_gemm, m.moe_token_dispatcher_type) == \
        ("RMSNorm", True, 1e-2, True, "alltoall")
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size) == (1, 4, 8)
    assert a.world_size >= 32 and (t.micro_batch_size, t.global_batch_size, t.bf16) == (1, 256, True)
    assert a.topology.name == "dgx-h100" and a.balancer is not None
    m = b.model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups,
            m.num_experts, m.moe_router_topk) == (56, 6144, 16384, 48, 8, 8, 2)
    assert b.world_size == 64
    args = a.megatron_args()
    for flag in ("--num-experts", "--group-query-attention", "--moe-grouped-gemm", "--bf16", "--swiglu"):
        assert flag in args
    assert args[args.index("--pipeline-model-parallel-size") + 1] == "4"
    assert args[args.index("--distributed-backend") + 1] == "nccl"


def test_overrides():
    c = load_run_config(MINI, ["balancer.policy=ultraep", "training.train_iters=10", "training.lr=3e-4"])
    assert (c.balancer.policy, c.balancer.slots, c.training.train_iters, c.training.lr) == ("ultraep", 2, 10, 3e-4)
    # a balancer given as a file: the file is loaded, then the key set
    c = load_run_config(M8x7, ["balancer.slots=3", "parallelism.nodes=8", "topology=dgx-a100"])
    assert (c.balancer.policy, c.balancer.slots, c.world_size, c.topology.name) == ("ultraep", 3, 64, "dgx-a100")
    c = load_run_config(MINI, ["balancer=configs/policies/eplb.yaml", "balancer.ranks_per_node=0"])
    assert (c.balancer.policy, c.balancer.ranks_per_node) == ("eplb", 2)  # derived from topology cpu-2x2
    c = load_run_config(MINI, ["balancer=null", "model.moe_token_dispatcher_type=allgather"])
    assert c.balancer is None
    assert load_any(ROOT / "configs/policies/ultraep.yaml", ["slots=4"]).slots == 4


def test_derived_values():
    c = load_run_config(MINI)
    assert (c.world_size, c.topology.nodes, c.balancer.ranks_per_node, c.training.global_batch_size) == (4, 2, 2, 8)
    c = load_run_config(M8x22)  # ETP 1: an EP group of 8 consecutive ranks fills a node
    assert c.balancer.ranks_per_node == 8 and c.data_parallel_size == 8


def _write(tmp_path, text, name="run.yaml"):
    f = tmp_path / name
    f.write_text(text)
    return f


def _mini_with(tmp_path, edit, name="bad.yaml"):
    data = yaml.safe_load(MINI.read_text())
    edit(data)
    return _write(tmp_path, yaml.safe_dump(data), name)


def _errors(path, overrides=()):
    with pytest.raises(ConfigError) as err:
        load_any(path, overrides)
    return str(err.value)


def test_unknown_key_suggests(tmp_path):
    f = _mini_with(tmp_path, lambda d: d["model"].update(num_layer=3))
    msg = _errors(f)
    assert "bad.yaml: model.num_layer: unknown key; did you mean 'model.num_layers'?" in msg
    f = _mini_with(tmp_path, lambda d: d["model"].update(micro_batch_size=3))
    assert "'micro_batch_size' belongs in the training section" in _errors(f)
    f = _mini_with(tmp_path, lambda d: d.update(trainig=d.pop("training")))
    msg = _errors(f)
    assert "bad.yaml: trainig: unknown key; did you mean 'training'?" in msg
    assert "bad.yaml: training.train_iters: required key is missing" in msg
    f = _mini_with(tmp_path, lambda d: d["balancer"].update(slotz=1))
    assert "bad.yaml: balancer.slotz: unknown key; did you mean 'balancer.slots'?" in _errors(f)


def test_wrong_types_and_values(tmp_path):
    def edit(d):
        d["training"]["train_iters"] = "ten"
        d["model"]["swiglu"] = "yes"
        d["model"]["normalization"] = "rmsnorm"
        d["parallelism"]["expert_model_parallel_size"] = 0
        d["balancer"]["policy"] = "magic"

    msg = _errors(_mini_with(tmp_path, edit))
    for want in ("bad.yaml: training.train_iters: expected integer, got 'ten'",
                 "bad.yaml: model.swiglu: expected true or false, got 'yes'",
                 "bad.yaml: model.normalization: must be one of LayerNorm, RMSNorm, got 'rmsnorm'; did you mean 'RMSNorm'?",
                 "bad.yaml: parallelism.expert_model_parallel_size: must be >= 1, got 0",
                 "bad.yaml: balancer.policy: unknown policy 'magic'"):
        assert want in msg  # every problem at once, not just the first
    assert load_any(_write(tmp_path, MINI.read_text().replace("lr: 3.0e-3", "lr: 3e-3"))).training.lr == 3e-3


def test_topology_and_world_size_mismatch(tmp_path):
    f = _mini_with(tmp_path, lambda d: d["parallelism"].update(world_size=6))
    assert ("bad.yaml: parallelism.world_size: 6, but parallelism.nodes 2 x topology.gpus_per_node 2 "
            "(topology 'cpu-2x2') = 4") in _errors(f)
    msg = _errors(MINI, ["topology=dgx-h100"])
    assert "mini-mixtral.yaml: parallelism.world_size: 4, but parallelism.nodes 2 x topology.gpus_per_node 8" in msg
    f = _mini_with(tmp_path, lambda d: d.update(topology={"gpus_per_node": 2, "rails_per_node": 2, "nodes": 3}))
    assert "bad.yaml: topology.nodes: 3 nodes, but parallelism.nodes is 2" in _errors(f)
    msg = _errors(M8x7, ["parallelism.pipeline_model_parallel_size=3"])
    assert "mixtral-8x7b.yaml: parallelism: world size 32 is not divisible by" in msg
    assert "model.num_layers: 32 is not divisible by pipeline_model_parallel_size 3" in msg
    msg = _errors(M8x7, ["balancer.ranks_per_node=4"])
    assert "balancer.ranks_per_node: 4, but this layout puts 8 ranks of each expert-parallel group on a node" in msg


def test_tensor_parallel_rules():
    """TP > 1 without sequence parallelism (Megatron-Core's MoELayer refuses to train), and experts
    tensor-parallel under a balancer (the dispatcher refuses to build): both named at validation,
    with ETP's default spelled out; stock (balancer: null) may keep experts tensor-parallel."""
    msg = _errors(M8x7, ["parallelism.tensor_model_parallel_size=2", "parallelism.pipeline_model_parallel_size=2"])
    assert ("mixtral-8x7b.yaml: parallelism.sequence_parallel: false, but Megatron-Core trains MoE layers under "
            "tensor parallelism (tensor_model_parallel_size 2) only with sequence parallelism") in msg
    assert ("parallelism.expert_tensor_parallel_size: 2 (null: tensor_model_parallel_size, Megatron's default), but "
            "a balancer moves whole experts: set 1") in msg
    # the other rules are checked as they will hold with ETP 1: no advice that setting it would undo
    msg = _errors(M8x7, ["parallelism.tensor_model_parallel_size=2", "parallelism.sequence_parallel=true",
                         "balancer.ranks_per_node=8"])
    assert "expert_tensor_parallel_size: 2" in msg and "ranks_per_node" not in msg and "not divisible" not in msg, msg
    ok = ["parallelism.tensor_model_parallel_size=2", "parallelism.pipeline_model_parallel_size=2",
          "parallelism.sequence_parallel=true"]
    assert load_any(M8x7, ok + ["parallelism.expert_tensor_parallel_size=1"]).parallelism.sequence_parallel
    assert load_any(M8x7, ok + ["balancer=null", "parallelism.expert_model_parallel_size=4"]).balancer is None


def test_expert_divisibility(tmp_path):
    msg = _errors(MINI, ["model.num_experts=6", "balancer.policy=none"])
    assert "mini-mixtral.yaml: balancer.policy: 'none' cannot serve this layout" in msg
    assert "divisible by the expert-parallel size (4)" in msg
    msg = _errors(MINI, ["model.num_experts=6"])  # fsep copes, Megatron-Core's MoELayer does not
    assert "mini-mixtral.yaml: model.num_experts: 6 is not divisible by expert_model_parallel_size 4" in msg


def test_missing_files(tmp_path):
    assert "nope.yaml: file not found" in _errors(tmp_path / "nope.yaml")
    f = _mini_with(tmp_path, lambda d: d.update(balancer="configs/policies/nope.yaml"))
    assert "bad.yaml: balancer: policy file 'configs/policies/nope.yaml' not found" in _errors(f)
    f = _mini_with(tmp_path, lambda d: d.update(topology="dgx-z900"))
    assert "bad.yaml: topology: topology file 'dgx-z900' not found" in _errors(f)
    f = _mini_with(tmp_path, lambda d: d.pop("topology"))
    assert "bad.yaml: topology: required key is missing" in _errors(f)


def test_bad_overrides():
    assert "override 'training.train_iters': expected KEY=VALUE" in _errors(MINI, ["training.train_iters"])
    assert ("override 'training.steps=10': unknown key 'training.steps'; did you mean 'training.train_iters'?"
            in _errors(MINI, ["training.steps=10"]))
    assert "override 'modle.num_layers=2': unknown key 'modle'; did you mean 'model'?" in _errors(
        MINI, ["modle.num_layers=2"])
    assert "not valid YAML" in _errors(MINI, ["training.lr=[1"])
    assert ("mini-mixtral.yaml: training.train_iters: expected integer, got 'ten' "
            "(from override 'training.train_iters=ten')") in _errors(MINI, ["training.train_iters=ten"])
    assert "'model.num_layers' takes a value, not sub-keys" in _errors(MINI, ["model.num_layers.x=1"])
    assert "override 'slotz=1': unknown key 'slotz'; did you mean 'slots'?" in _errors(
        ROOT / "configs/policies/fsep.yaml", ["slotz=1"])


def test_kinds(tmp_path):
    assert isinstance(load_any(_write(tmp_path, "policy: ultraep\nslots: 1\n", "p.yaml")), PolicyConfig)
    topo = load_any(_write(tmp_path, "gpus_per_node: 4\nrails_per_node: 2\n", "t.yaml"))
    assert isinstance(topo, Topology) and topo.name == "t"
    assert "cannot tell the kind" in _errors(_write(tmp_path, "hello: 1\n", "x.yaml"))
    assert "x.yaml: gpus_per_nod: unknown key; did you mean 'gpus_per_node'?" in _errors(
        _write(tmp_path, "rails_per_node: 2\ngpus_per_nod: 4\n", "x.yaml"))
    # every topology key has a default (docs/rails.md): a file of some of them is a topology
    topo = load_any(_write(tmp_path, "nic_gbps: 100\n", "n.yaml"))
    assert isinstance(topo, Topology) and topo.nic_gbps == 100 and topo.gpus_per_node == Topology().gpus_per_node
    assert "'nic_gbps' is a topology key, but 'slots' is not" in _errors(
        _write(tmp_path, "nic_gbps: 100\nslots: 2\n", "m.yaml"))
    assert "cannot tell the kind" in _errors(_write(tmp_path, "description: a run?\n", "d.yaml"))


def test_train_demo_accepts_mini_and_explains_the_rest():
    from megatron_rails.demo.train import DemoShape, from_run_config

    for f in ("mini-mixtral.yaml", "mini-mixtral-stock.yaml"):
        assert from_run_config(str(ROOT / "configs/mini" / f))[1] == DemoShape()  # the demo's own shape
    with pytest.raises(ConfigError) as err:
        from_run_config(str(M8x7))
    assert "mixtral-8x7b.yaml: parallelism.backend: the demo trainer runs on CPU: gloo" in str(err.value)
    with pytest.raises(ConfigError, match="model.swiglu: the demo trainer's model has True"):
        from_run_config(str(MINI), ["model.swiglu=false"])


def test_configuration_doc_is_generated():
    from megatron_rails.config.docs import generate

    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == generate(), "docs/configuration.md is stale: megatron-rails config docs --out docs/configuration.md"
    for cls in (PolicyConfig, Topology):  # every key of every kind is documented
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in committed


def cli(*args, ok=True):
    p = subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert (p.returncode == 0) == ok, p.stdout + p.stderr
    return p


def test_cli_validate(tmp_path):
    out = cli("config", "validate", *map(str, ALL)).stdout
    assert out.count("OK ") == len(ALL)
    bad = _mini_with(tmp_path, lambda d: (d["model"].update(num_layer=3), d["training"].update(train_iters="ten")))
    p = cli("config", "validate", str(MINI), str(bad), ok=False)
    assert p.returncode == 1 and f"OK {MINI}" in p.stdout
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("megatron-rails config validate: error: ")]
    assert len(errors) == 2 and all(str(bad) in ln for ln in errors)
    assert "model.num_layer: unknown key" in errors[0] and "training.train_iters: expected integer" in errors[1]
    assert "1 of 2 file(s) invalid" in p.stderr


def test_cli_show(tmp_path):
    out = cli("config", "show", str(MINI), "balancer.policy=ultraep", "training.train_iters=7").stdout
    data = yaml.safe_load(out)
    assert data["balancer"]["policy"] == "ultraep" and data["training"]["train_iters"] == 7
    assert data["topology"]["name"] == "cpu-2x2" and data["parallelism"]["world_size"] == 4
    f = _write(tmp_path, out, "shown.yaml")  # what show prints is a valid run config
    assert load_run_config(f).training.train_iters == 7
    got = cli("config", "show", str(MINI), "--get", "parallelism.backend", "--get", "parallelism.world_size").stdout
    assert got.split() == ["gloo", "4"]
    flags = cli("config", "show", str(M8x7), "--megatron-args").stdout
    assert flags.startswith("--num-layers 32 ") and "--moe-token-dispatcher-type alltoall" in flags
    p = cli("config", "show", str(MINI), "training.steps=3", ok=False)
    assert "did you mean 'training.train_iters'?" in p.stderr


def test_pretrain_print_args(tmp_path):
    p = subprocess.run([sys.executable, "-m", "megatron_rails.pretrain", "--run-config", str(M8x22), "--megatron-lm",
                        "/opt/Megatron-LM", "--print-args", "training.train_iters=5", "balancer.slots=3", "--",
                        "--save", "/ckpt"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, RUN_DIR=str(tmp_path)))
    assert p.returncode == 0, p.stderr
    argv = p.stdout.split()
    assert argv[:6] == ["python", "-m", "megatron_rails.launch", "/opt/Megatron-LM/pretrain_gpt.py", "--num-layers", "56"]
    assert argv[argv.index("--train-iters") + 1] == "5" and argv[-2:] == ["--save", "/ckpt"]
    rails = Path(argv[argv.index("--rails-config") + 1])  # the resolved balancer, as a policy YAML
    assert rails.parent == tmp_path
    assert PolicyConfig.from_yaml(rails) == load_run_config(M8x22, ["balancer.slots=3"]).balancer
    stock = subprocess.run([sys.executable, "-m", "megatron_rails.pretrain", "--run-config", str(M8x7), "--print-args",
                            "balancer=null"], capture_output=True, text=True, timeout=120)
    assert stock.returncode == 0 and "--rails-config" not in stock.stdout
    cpu = subprocess.run([sys.executable, "-m", "megatron_rails.pretrain", "--run-config", str(MINI), "--print-args"],
                         capture_output=True, text=True, timeout=120)
    assert cpu.returncode == 2 and "CPU (gloo) run configs run with megatron_rails.demo.train" in cpu.stderr


def test_pretrain_policy_file_and_environment_errors(tmp_path):
    def pretrain(*argv, **env):
        return subprocess.run([sys.executable, "-m", "megatron_rails.pretrain", "--run-config", str(M8x7), *argv],
                              capture_output=True, text=True, timeout=120, env=dict(os.environ, **env))

    # the same config gives the same file, not one more each time (processes of a run, repeated --print-args)
    first, again = (pretrain("--print-args", RUN_DIR=str(tmp_path)) for _ in range(2))
    assert first.returncode == 0 and first.stdout == again.stdout
    assert [p.name for p in tmp_path.iterdir()] == [Path(first.stdout.split("--rails-config ")[1].split()[0]).name]
    other = pretrain("--print-args", "balancer.slots=2", RUN_DIR=str(tmp_path))
    assert other.stdout != first.stdout and len(list(tmp_path.glob("balancer-*"))) == 2
    # without RUN_DIR: a directory of this user's alone, not the shared temp directory itself
    (tmp_path / "tmp").mkdir()
    bare = pretrain("--print-args", TMPDIR=str(tmp_path / "tmp"))
    rails = Path(bare.stdout.split("--rails-config ")[1].split()[0])
    assert rails.parent == tmp_path / "tmp" / f"megatron-rails-{os.getuid()}" and rails.parent.stat().st_mode & 0o077 == 0
    # a link planted under the predictable name is replaced, never written through
    name = Path(first.stdout.split("--rails-config ")[1].split()[0]).name
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (tmp_path / name).unlink()
    (tmp_path / name).symlink_to(victim)
    assert pretrain("--print-args", RUN_DIR=str(tmp_path)).stdout == first.stdout
    assert victim.read_text() == "keep" and not (tmp_path / name).is_symlink()
    afile = tmp_path / "afile"
    afile.write_text("")
    for argv, env, words in ((["--print-args"], {"RUN_DIR": str(afile)}, "cannot write the balancer's policy file"),
                             ([], {"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not a rank count")):
        p = pretrain(*argv, **env)
        assert p.returncode == 2 and words in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_DIR"), reason="set MEGATRON_LM_DIR to a Megatron-LM checkout "
                    "to check the generated flags with Megatron-LM's own parse_args/validate_args")
@pytest.mark.parametrize("path", [M8x7, M8x22], ids=lambda p: p.name)
def test_megatron_lm_accepts_the_flags(path, monkeypatch):
    import types

    import torch

    monkeypatch.syspath_prepend(os.environ["MEGATRON_LM_DIR"])
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # as scripts/slurm/launch.sh sets it
    for name, value in (("get_device_capability", lambda *a, **k: (9, 0)), ("is_bf16_supported", lambda *a, **k: True),
                        ("get_device_properties", lambda *a, **k: types.SimpleNamespace(major=9, minor=0))):
        monkeypatch.setattr(torch.cuda, name, value)  # validate_args asks the (absent) GPU
    arguments = pytest.importorskip("megatron.training.arguments")
    rc = load_run_config(path)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *rc.megatron_args()])
    ns = arguments.parse_args()
    ns.world_size, ns.rank = rc.world_size, 0
    arguments.validate_args(ns)
    assert ns.data_parallel_size == rc.data_parallel_size and ns.num_experts == rc.model.num_experts


def test_a_directory_never_hides_a_preset(tmp_path, monkeypatch):
    # a run directory called `default` or `dgx-h100` in the working directory: the bare names still mean
    # the presets; a regular file of that name is read as the file (./NAME or not)
    from megatron_rails.core.policy import as_policy
    from megatron_rails.core.topology import load_topology

    monkeypatch.chdir(tmp_path)
    (tmp_path / "default").mkdir()
    (tmp_path / "dgx-h100").mkdir()
    assert as_policy("default") == PolicyConfig()
    assert load_topology("dgx-h100").name == "dgx-h100"
    (tmp_path / "cpu-2x2").mkdir()  # the mini config's topology: cpu-2x2
    run = load_any(MINI, ["balancer=default"])
    assert run.topology.name == "cpu-2x2" and run.topology.gpus_per_node == load_topology("cpu-2x2").gpus_per_node
    assert run.balancer.policy == PolicyConfig().policy and run.balancer.slots == PolicyConfig().slots
    (tmp_path / "eplb").write_text("policy: ultraep\n")
    assert as_policy("eplb").policy == "ultraep"


@pytest.mark.parametrize("override,words", [
    ("training.save=--load", "training.save: '--load': an empty value or one starting with '-' is no value for --save"),
    ("data.data_path=[a, '--lr', b]", "is no value for --data-path"),
    ("training.save=''", "training.save: '': an empty value"),
    ("training.adam_beta2=1.5", "training.adam_beta2: must be < 1, got 1.5"),
    ("model.attention_dropout=1", "model.attention_dropout: must be < 1, got 1.0")])
def test_values_megatron_lm_would_misread_or_refuse_late(override, words):
    # a value starting with '-' became a flag of its own on pretrain_gpt.py's command line ('--save --load');
    # torch refuses beta or dropout >= 1 only after minutes of start-up
    assert words in _errors(M8x7, [override])


def test_overrides_must_be_a_list_of_strings():
    for bad in ("training.train_iters=5", {"training.train_iters": 5}, [5], "", {}):
        assert "overrides must be a list of KEY=VALUE strings" in _errors(M8x7, bad)
    assert load_run_config(M8x7, (t for t in ["training.train_iters=7"])).training.train_iters == 7
    assert load_run_config(M8x7, (t for t in [])) == load_run_config(M8x7, None) == load_run_config(M8x7, [])
