"""scripts/pretrain_check.sh (gpu_ and cpu_pretrain_check.sh) and scripts/megatron_lm_cpu.py.

Without Megatron-LM: the runs each script would make (PRINT_ONLY=1) and the CPU mapping of CUDA
placements. With MEGATRON_LM_DIR: Megatron-LM's own pretrain_gpt.py on two CPU ranks, stock (its
allgather dispatcher) against two policies, lm loss and grad norm per iteration equal."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from moe_harness import spawn

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


def print_only(script: str, tmp_path: Path, **env) -> dict[str, list[str]]:
    """{run name: its command line} as the script prints them with PRINT_ONLY=1 (a fake checkout)."""
    mlm = tmp_path / "mlm"
    mlm.mkdir(exist_ok=True)
    (mlm / "pretrain_gpt.py").write_text("")
    proc = subprocess.run(["bash", str(SCRIPTS / script), str(mlm), str(tmp_path / "out")], capture_output=True,
                          text=True, env={**os.environ, "PRINT_ONLY": "1", **env}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    runs = {}
    for line in proc.stdout.splitlines():
        name, *cmd = shlex.split(line)
        runs[name] = cmd
    return runs


def value(cmd: list[str], flag: str) -> str:
    """The last value given to flag (argparse keeps the last)."""
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == flag][-1]


def test_cpu_runs(tmp_path):
    runs = print_only("cpu_pretrain_check.sh", tmp_path)
    policies = ["none", "eplb", "fsep", "ultraep", "lp"]
    expected = ([f"{g}-{p}" for g in ("ep2", "ep2dist") for p in ["stock", *policies, "default"]]
                + [f"ep4rails-{p}" for p in ["stock", *policies]]
                + [f"ep2pp2-{p}" for p in ["stock", *policies, "default"]]
                + ["phases/ep2ckpt-stock.1", "phases/ep2ckpt-stock.2"]
                + [run for p in [*policies, "default"] for run in
                   (f"phases/ep2ckpt-{p}_saves.1", f"phases/ep2ckpt-{p}_saves.2", f"ep2ckpt-{p}_loads")])
    assert list(runs) == expected
    ckpt = tmp_path / "out" / "ckpt"
    for name, cmd in runs.items():
        group, policy = name.removeprefix("phases/").split(".")[0].split("-")
        if group == "ep2ckpt":  # which policy runs each phase, and which checkpoint it saves or loads
            policy, _, role = policy.partition("_")
            phase = "2" if role == "loads" else name[-1]
            saver = "stock" if role == "loads" else policy
            if phase == "1":
                assert value(cmd, "--save") == str(ckpt / saver) and "--load" not in cmd
                assert value(cmd, "--exit-interval") == value(cmd, "--save-interval") == "10"
            else:  # a resume that finds no checkpoint must not train afresh
                assert value(cmd, "--load") == str(ckpt / saver) and "--save" not in cmd
                assert "--exit-on-missing-checkpoint" in cmd
            if phase == "2" and role != "loads":
                policy = "stock"  # stock resumes from the policy's checkpoint
        ep, pp = {"ep4rails": (4, 1), "ep2pp2": (2, 2)}.get(group, (2, 1))
        assert cmd[cmd.index("--nproc-per-node") + 1] == str(ep * pp)
        assert str(SCRIPTS / "megatron_lm_cpu.py") in cmd and "megatron_rails.launch" not in cmd
        assert value(cmd, "--distributed-backend") == "gloo" and "--local-rank" not in cmd
        assert value(cmd, "--expert-model-parallel-size") == str(ep)
        # 4 microbatches per iteration: micro batch 4 x data-parallel ranks (ep x pp / pp) x 4
        assert int(value(cmd, "--global-batch-size")) == 4 * ep * 4
        if pp > 1:  # two virtual stages of one layer per pipeline stage
            assert value(cmd, "--pipeline-model-parallel-size") == str(pp)
            assert value(cmd, "--num-layers") == str(2 * pp)
            assert value(cmd, "--num-layers-per-virtual-pipeline-stage") == "1"
        else:
            assert "--pipeline-model-parallel-size" not in cmd
        assert value(cmd, "--train-iters") == "20"
        dist = {"--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"}
        assert dist <= set(cmd) if group == "ep2dist" else not dist & set(cmd)
        # stock with expert parallelism on CPU: Megatron's allgather dispatcher; ours replace alltoall
        assert value(cmd, "--moe-token-dispatcher-type") == ("allgather" if policy == "stock" else "alltoall")
        ours = {"--moe-balancer", "--rails-config"} & set(cmd)
        assert not ours if policy == "stock" else len(ours) == 1
        if group == "ep4rails" and policy != "stock":
            cfg = yaml.safe_load(Path(value(cmd, "--rails-config")).read_text())
            assert cfg == {"policy": policy, "comm": "rails", "ranks_per_node": 2, "rails_tolerance": 0,
                           "dedup": True}
        elif policy == "default":  # which also records its routing, a file per group
            assert Path(value(cmd, "--rails-config")) == ROOT / "megatron_rails/presets/policies/default.yaml"
            assert value(cmd, "--rails-trace") == str(tmp_path / "out" / "traces" / f"{group}-default.npz")
        elif policy != "stock":
            assert value(cmd, "--moe-balancer") == policy


def test_gpu_runs(tmp_path):
    runs = print_only("gpu_pretrain_check.sh", tmp_path)
    policies = ["stock", "none", "eplb", "fsep", "ultraep", "lp"]
    assert list(runs) == [f"ep{w}-{p}" for w in (1, 2) for p in policies]
    for name, cmd in runs.items():
        world = int(name[2])
        entry = cmd.index("--master-port") + 2
        if world == 1:  # the launcher itself
            assert cmd[entry:entry + 2] == ["-m", "megatron_rails.launch"]
        else:  # two ranks on one GPU over gloo: DDP's bucket collectives uncoalesced
            assert cmd[entry] == str(SCRIPTS / "megatron_lm_gloo.py") and "megatron_rails.launch" not in cmd
        assert value(cmd, "--distributed-backend") == ("nccl" if world == 1 else "gloo")
        assert ("--local-rank" in cmd) == (world == 2)  # both ranks on cuda:0
        assert int(value(cmd, "--global-batch-size")) == 4 * world
        assert value(cmd, "--moe-token-dispatcher-type") == "alltoall"
    # the knobs gpu_checks.sh sets
    assert list(print_only("gpu_pretrain_check.sh", tmp_path, WORLDS="2", POLICIES="lp")) == ["ep2-stock", "ep2-lp"]


def test_bad_device(tmp_path):
    (tmp_path / "pretrain_gpt.py").write_text("")
    proc = subprocess.run(["bash", str(SCRIPTS / "pretrain_check.sh"), str(tmp_path)], capture_output=True, text=True,
                          env={**os.environ, "DEVICE": "tpu"}, timeout=60)
    assert proc.returncode == 2 and proc.stderr == "pretrain_check: DEVICE=tpu: cuda or cpu\n"


CUDA_ON_CPU = """
import sys, time
sys.path.insert(0, {scripts!r})
import torch, megatron_lm_cpu
megatron_lm_cpu.cuda_on_cpu()
x = torch.ones(3)
checks = {{
    "available": torch.cuda.is_available() and torch.cuda.device_count() == 1,
    "factory": torch.zeros(2, device="cuda").device.type == "cpu",
    "index": torch.tensor([1], device=0).device.type == "cpu",
    "device object": torch.empty(1, device=torch.device("cuda", 0)).device.type == "cpu",
    "cuda()": x.cuda() is x,
    "to": x.to("cuda").device.type == "cpu" and x.to(torch.device("cuda"), non_blocking=True).device.type == "cpu",
    "type": x.type() == "torch.cuda.FloatTensor" and x.type(torch.float64).dtype == torch.float64,
    "pin": not torch.empty(2, pin_memory=True).is_pinned(),
    "module": torch.nn.Linear(2, 2).cuda().weight.device.type == "cpu",
    "values": torch.arange(4, device="cuda").tolist() == [0, 1, 2, 3],
}}
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record(); time.sleep(0.01); end.record(); end.synchronize()
checks["event"] = start.elapsed_time(end) >= 10.0
with torch.cuda.stream(torch.cuda.Stream()):
    checks["stream"] = torch.cuda.current_stream() is not None
# Megatron's RNG tracker: a CPU state per name that forks advance (weights drawn in forks differ)
from megatron.core.tensor_parallel import random as mp_random
tracker = mp_random.CudaRNGStatesTracker()
tracker.add("a", 1); tracker.add("b", 2)
outer = torch.get_rng_state()
with tracker.fork("a"):
    a1 = torch.randn(4)
with tracker.fork("a"):
    a2 = torch.randn(4)
with tracker.fork("b"):
    b1 = torch.randn(4)
    with tracker.fork("a"):
        a3 = torch.randn(4)
    b2 = torch.randn(4)
checks["fork restores"] = torch.equal(torch.get_rng_state(), outer)
checks["named streams"] = (torch.equal(torch.cat([a1, a2, a3]), torch.randn(12, generator=torch.Generator().manual_seed(1)))
                           and torch.equal(torch.cat([b1, b2]), torch.randn(8, generator=torch.Generator().manual_seed(2))))
checks["isend"] = torch.distributed.distributed_c10d.isend is torch.distributed.isend is megatron_lm_cpu._isend_a_copy
print(sorted(k for k, ok in checks.items() if not ok))
"""


def test_cuda_on_cpu():
    proc = subprocess.run([sys.executable, "-c", CUDA_ON_CPU.format(scripts=str(SCRIPTS))], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_DIR"), reason="MEGATRON_LM_DIR not set: no Megatron-LM checkout")
def test_real_pretrain_gpt_on_cpu_ranks(tmp_path):
    mlm = Path(os.environ["MEGATRON_LM_DIR"]).resolve()
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPTS / "cpu_pretrain_check.sh"), str(mlm), str(out)], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PYTHON": sys.executable, "ITERS": "3",
                                                       "RUN_GROUPS": "ep2", "POLICIES": "ultraep fsep"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    sys.path.insert(0, str(SCRIPTS))
    import pretrain_loss_table as table

    runs = {r.name: r for r in table.load_runs(out)}
    assert set(runs) == {"ep2-stock", "ep2-ultraep", "ep2-fsep"}
    stock = runs["ep2-stock"]
    assert sorted(stock.losses) == [1, 2, 3]
    for name in ("ep2-ultraep", "ep2-fsep"):
        assert runs[name].losses == stock.losses and runs[name].grad_norms == stock.grad_norms, name
        assert runs[name].balance[1] is not None  # the dispatcher's figures reached Megatron's log


def test_group_names_paths_and_pipeline_microbatches(tmp_path):
    out = tmp_path / "out dir"  # a space in OUTDIR: one argument per path all the same
    mlm = tmp_path / "mlm"
    mlm.mkdir()
    (mlm / "pretrain_gpt.py").write_text("")
    proc = subprocess.run(["bash", str(SCRIPTS / "cpu_pretrain_check.sh"), str(mlm), str(out)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PRINT_ONLY": "1", "POLICIES": "lp",
                                                      "RUN_GROUPS": "ep4rail ep2x ep4rails ep2pp2"})
    assert proc.returncode == 0, proc.stderr
    runs = {line.split()[0]: shlex.split(line)[1:] for line in proc.stdout.splitlines()}
    assert list(runs) == ["ep4rails-stock", "ep4rails-lp", "ep2pp2-stock", "ep2pp2-lp"]  # stdout: commands only
    for typo in ("ep4rail", "ep2x"):  # a misspelt group is named and skipped, not run as plain EP
        assert f"group {typo}: not ep<N>" in proc.stderr
    assert value(runs["ep4rails-lp"], "--rails-config") == str(out / "policy-ep4rails-lp.yaml")
    # on CUDA (1 microbatch per iteration by default) a 2-stage interleaved pipeline gets 2
    cuda = print_only("gpu_pretrain_check.sh", tmp_path, RUN_GROUPS="ep2pp2", POLICIES="lp")
    assert int(value(cuda["ep2pp2-lp"], "--global-batch-size")) == 4 * 2 * 2


def test_failed_stock_run_skips_its_group(tmp_path):
    mlm = tmp_path / "mlm"
    (mlm / "megatron/core/datasets").mkdir(parents=True)
    (mlm / "pretrain_gpt.py").write_text("")
    out = tmp_path / "out"
    # every run fails at once (PYTHON=false): the stock runs fail, each group's other runs get markers
    proc = subprocess.run(["bash", str(SCRIPTS / "cpu_pretrain_check.sh"), str(mlm), str(out)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHON": "false", "POLICIES": "fsep default",
                                                      "RUN_GROUPS": "ep4rails ep2ckpt"})
    assert proc.returncode != 0
    rcs = {p.stem: p.read_text().strip() for p in out.glob("*.rc")}
    assert rcs == {"ep4rails-stock": "1", "ep4rails-fsep": "skipped", "ep2ckpt-stock": "1",
                   "ep2ckpt-fsep_saves": "skipped", "ep2ckpt-fsep_loads": "skipped",
                   "ep2ckpt-default_saves": "skipped", "ep2ckpt-default_loads": "skipped"}
    # the stock run's second phase is not attempted without a saved checkpoint
    assert (out / "phases/ep2ckpt-stock.2.log").read_text().startswith("skipped: phases/ep2ckpt-stock.1 failed")


def _uncoalesced_rank(rank, world):
    sys.path.insert(0, str(SCRIPTS))
    import megatron_lm_gloo
    from megatron.core.distributed import param_and_grad_buffer as buffers

    megatron_lm_gloo.uncoalesced()
    assert buffers._coalescing_manager is megatron_lm_gloo._one_by_one
    xs = [torch.full((3,), float(rank + i)) for i in range(3)]
    gathered = torch.empty(2 * world)
    # what DDP's start_grad_sync / start_param_sync issue: async collectives under the manager, whose
    # handle is waited for later; here one at a time, every handle kept
    shard = torch.empty(2)
    megatron_lm_gloo.uncoalesced()  # a second call wraps nothing twice
    with buffers._coalescing_manager(dist.group.WORLD, async_ops=True) as handle:
        for x in xs:
            dist.all_reduce(x, async_op=True)
        buffers.dist_all_gather_func(gathered, torch.full((2,), float(rank)), async_op=True)
        # the distributed optimizer's gradient reduce: rank r keeps elements 2r, 2r+1 of the sum
        buffers.dist_reduce_scatter_func(shard, torch.arange(2.0 * world) * (rank + 1), async_op=True)
    assert len(handle.works) == 5
    handle.wait()
    for i, x in enumerate(xs):
        assert torch.equal(x, torch.full((3,), float(sum(r + i for r in range(world)))))
    assert gathered.tolist() == [float(r) for r in range(world) for _ in range(2)]
    scale = sum(r + 1 for r in range(world))
    assert shard.tolist() == [float(2 * rank * scale), float((2 * rank + 1) * scale)]
    # synchronous calls: nothing to wait for
    with buffers._coalescing_manager(dist.group.WORLD, async_ops=False) as handle:
        dist.all_reduce(xs[0])
    assert handle.works == []


def test_uncoalesced_bucket_collectives():
    spawn(_uncoalesced_rank, 2, megatron=False)
