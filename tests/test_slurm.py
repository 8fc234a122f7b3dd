"""scripts/slurm/ and docs/slurm.md.

On a real Slurm cluster (CI: the one-node cluster of scripts/slurm/local-cluster.sh), train.sbatch
runs the mini config's 4 gloo ranks on 1 node in CPU mode: the job must finish COMPLETED with exactly
the losses of the same run started by torchrun directly, and a missing or invalid YAML must fail the job
with a message naming it. Without Slurm those tests skip and say why (in CI they fail instead:
tests/optional.py). Every command of docs/slurm.md is listed in DOC_COMMANDS with where it runs, and
the ones that need no cluster or GPU run here.
"""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import optional

ROOT = Path(__file__).resolve().parent.parent
MINI = "configs/mini/mini-mixtral.yaml"
STEPS = 3
BIN = str(Path(sys.executable).parent)
ENV = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", MEGATRON_RAILS_PYTHON=sys.executable,
           PATH=BIN + os.pathsep + os.environ.get("PATH", ""))

SBATCH_CPU = ("sbatch --nodes 1 --ntasks-per-node 4 --overcommit scripts/slurm/train.sbatch "
              f"{MINI} training.train_iters={STEPS}")
TORCHRUN_CPU = (f"torchrun --nproc-per-node 4 -m megatron_rails.demo.train --run-config {MINI} --out run.json "
                f"training.train_iters={STEPS}")
DRY_GPU = ("MR_DRY_RUN=1 SLURM_NNODES=4 SLURM_NODEID=0 SLURM_JOB_ID=7 MEGATRON_LM_DIR=/opt/Megatron-LM "
           "scripts/slurm/launch.sh configs/mixtral/mixtral-8x7b.yaml")
# every command of docs/slurm.md -> where it is exercised ("here": test_doc_commands_run runs it as written)
DOC_COMMANDS = {
    "megatron-rails config validate configs/mixtral/mixtral-8x7b.yaml configs/mixtral/mixtral-8x22b.yaml": "here",
    "megatron-rails config show configs/mixtral/mixtral-8x7b.yaml parallelism.nodes=8 topology=dgx-a100": "here",
    "python -m megatron_rails.pretrain --run-config configs/mixtral/mixtral-8x7b.yaml --megatron-lm /opt/Megatron-LM "
    "--print-args": "here (and test_runconfig.py::test_pretrain_print_args)",
    DRY_GPU: "here (and test_launch_dry_run)",
    SBATCH_CPU: "test_sbatch_cpu_mode_matches_direct_torchrun",
    TORCHRUN_CPU: "test_sbatch_cpu_mode_matches_direct_torchrun (the reference run)",
    "scripts/slurm/local-cluster.sh start": ".ci/run",
    "scripts/slurm/local-cluster.sh stop": ".ci/run",
    "MEGATRON_LM_DIR=$HOME/Megatron-LM sbatch --nodes 4 --gpus-per-node 8 --exclusive scripts/slurm/train.sbatch "
    "configs/mixtral/mixtral-8x7b.yaml": "GPU cluster only: dry-run form above, flags in test_runconfig.py",
    "MEGATRON_LM_DIR=$HOME/Megatron-LM sbatch --nodes 8 --gpus-per-node 8 --exclusive scripts/slurm/train.sbatch "
    "configs/mixtral/mixtral-8x22b.yaml training.train_iters=1000": "GPU cluster only: as above",
}


def _cluster_reason() -> str | None:
    if shutil.which("sbatch") is None:
        return ("Slurm is not installed (as root on Debian, `scripts/slurm/local-cluster.sh start` installs "
                "and starts a one-node cluster; .ci/run does)")
    try:
        p = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"sinfo failed: {e}"
    if p.returncode != 0 or not ({"idle", "mixed", "allocated"} & set(p.stdout.split())):
        return f"no Slurm cluster answers (sinfo: {(p.stdout + p.stderr).strip() or 'no nodes'})"
    return None


NO_CLUSTER = _cluster_reason()


@pytest.fixture
def slurm_cluster():
    """A cluster that answers, else the test skips (fails where MEGATRON_RAILS_REQUIRE names slurm)."""
    if NO_CLUSTER is not None:
        optional.missing("slurm", NO_CLUSTER)


needs_slurm = pytest.mark.usefixtures("slurm_cluster")


def doc_commands() -> list[str]:
    text = (ROOT / "docs" / "slurm.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)
    return [ln.strip() for b in blocks for ln in b.replace("\\\n", " ").splitlines()
            if ln.strip() and not ln.strip().startswith("#")]


def test_every_doc_command_is_exercised():
    assert sorted(doc_commands()) == sorted(DOC_COMMANDS)


@pytest.mark.parametrize("cmd", [c for c, where in DOC_COMMANDS.items() if where.startswith("here")])
def test_doc_commands_run(cmd, tmp_path):
    p = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=dict(ENV, RUN_DIR=str(tmp_path)), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip()


def test_launch_dry_run(tmp_path):
    env = dict(ENV, RUN_DIR=str(tmp_path))
    out = subprocess.run(["bash", "-c", DRY_GPU], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for want in ("CUDA_DEVICE_MAX_CONNECTIONS=1", "NCCL_CROSS_NIC=0", "--nnodes 4 --node-rank 0 --nproc-per-node 8",
                 "--master-port 20007", "-m megatron_rails.pretrain --run-config configs/mixtral/mixtral-8x7b.yaml"):
        assert want in out.stdout
    assert "NCCL_IB_HCA is unset" in out.stderr
    cpu = subprocess.run(["scripts/slurm/launch.sh", MINI, "training.train_iters=2"], cwd=ROOT,
                         env=dict(env, MR_DRY_RUN="1", SLURM_NNODES="2", SLURM_NODEID="1", SLURM_JOB_ID="40001"),
                         capture_output=True, text=True, timeout=120)
    assert cpu.returncode == 0, cpu.stderr  # CPU mode: world 4 over 2 Slurm nodes = 2 ranks each
    assert "--nnodes 2 --node-rank 1 --nproc-per-node 2" in cpu.stdout and "--master-port 20001" in cpu.stdout
    assert f"--out {tmp_path}/result.json training.train_iters=2" in cpu.stdout and "OMP_NUM_THREADS=1" in cpu.stdout
    # wrong node count, missing YAML, invalid override: clear errors, non-zero exits, nothing started
    for args, extra, msg in (
            (["configs/mixtral/mixtral-8x7b.yaml"], {"SLURM_NNODES": "2"}, "wants 4 nodes x 8 GPUs, this job has 2"),
            (["configs/mini/nope.yaml"], {}, "run config 'configs/mini/nope.yaml' not found"),
            ([MINI, "training.stepz=1"], {}, "unknown key 'training.stepz'"),
            ([MINI], {"SLURM_NNODES": "0"}, "SLURM_NNODES=0 is not a node count"),
            ([MINI], {"SLURM_NNODES": "4", "SLURM_NODEID": "9"}, "SLURM_NODEID=9 is not a node of this job (0 .. 3)"),
            # what bash itself would have reported (or not at all), and a file of the wrong kind
            ([MINI], {"SLURM_NNODES": "08", "SLURM_NODEID": "07"}, "world size 4 does not split over 8 Slurm nodes"),
            ([MINI], {"SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID=abc is not a job id"),
            ([MINI], {"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
            ([MINI], {"MR_DRY_RUN": "yes"}, "MR_DRY_RUN=yes: expected 1"),
            ([MINI], {"MEGATRON_RAILS_PYTHON": "/nonexistent/python"}, "MEGATRON_RAILS_PYTHON=/nonexistent/python: no "
                                                                       "such Python"),
            (["configs"], {}, "configs: is a directory, not a run config file"),
            (["configs/policies/fsep.yaml"], {}, "--megatron-args needs a run config, this is a policy config")):
        p = subprocess.run(["scripts/slurm/launch.sh", *args], cwd=ROOT, env={**env, "MR_DRY_RUN": "1", **extra},
                           capture_output=True, text=True, timeout=120)
        assert p.returncode != 0 and msg in p.stderr, p.stderr


def submit(tmp_path, cmd: str, timeout=600):
    """Run a documented `sbatch ...` line with --wait; returns (job id, return code, job state, job log)."""
    out = tmp_path / "slurm-%j.out"
    argv = shlex.split(cmd)
    assert argv[0] == "sbatch"
    argv[1:1] = ["--wait", "--parsable", "--job-name", "mrails-test", "--output", str(out),
                 "--export", f"ALL,RUN_DIR={tmp_path / 'run'}"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        job = stdout.strip().split(";")[0]
        if job:
            subprocess.run(["scancel", job])
        pytest.fail(f"sbatch --wait timed out after {timeout} s (job {job or '?'} cancelled)")
    job = stdout.strip().split(";")[0]
    assert job.isdigit(), stdout + stderr
    # --wait returns when the job's script ends; Slurm may still be COMPLETING it (cleaning up its
    # processes) for a moment before the final state: wait for that
    deadline = time.monotonic() + 120
    while True:
        info = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
        state = next((w.split("=", 1)[1] for w in info.split() if w.startswith("JobState=")), "?")
        if state not in ("COMPLETING", "RUNNING", "CONFIGURING", "PENDING") or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    log = Path(str(out).replace("%j", job))
    return job, proc.returncode, state, log.read_text() if log.exists() else ""


def direct_run(tmp_path) -> list:
    """The documented torchrun line on this machine, no Slurm (the reference)."""
    argv = shlex.split(TORCHRUN_CPU.replace("run.json", str(tmp_path / "direct.json")))
    argv[:1] = [sys.executable, "-m", "torch.distributed.run", "--standalone"]  # its own free port
    p = subprocess.run(argv, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads((tmp_path / "direct.json").read_text())["losses"]


@pytest.mark.slow
@needs_slurm
def test_sbatch_cpu_mode_matches_direct_torchrun(tmp_path):
    job, rc, state, log = submit(tmp_path, SBATCH_CPU)
    assert rc == 0 and state == "COMPLETED", f"job {job}: exit {rc}, state {state}\n{log[-4000:]}"
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["world"] == 4 and result["run_config"].endswith(MINI) and len(result["losses"]) == STEPS
    assert f"[fsep] step {STEPS}/{STEPS} loss" in log  # rank 0 on the job's console
    ranks = sorted((tmp_path / "run" / "logs" / "node0").glob(f"{job}_*/attempt_0/*/stdout.log"))
    assert len(ranks) == 4  # a log per rank
    assert result["losses"] == direct_run(tmp_path)  # bit-identical: same config, same ranks, same data


@needs_slurm
def test_sbatch_fails_clearly(tmp_path):
    _, rc, state, log = submit(tmp_path, SBATCH_CPU.replace(MINI, "configs/mini/no-such.yaml"), timeout=120)
    assert rc != 0 and state == "FAILED", log
    assert "run config 'configs/mini/no-such.yaml' not found" in log
    _, rc, state, log = submit(tmp_path, SBATCH_CPU.replace("train_iters", "steps"), timeout=120)
    assert rc != 0 and state == "FAILED", log
    assert "unknown key 'training.steps'; did you mean 'training.train_iters'?" in log


@pytest.mark.slow
@needs_slurm
def test_sbatch_reports_a_killed_rank(tmp_path):
    """A rank SIGKILLed mid all-to-all: the job ends FAILED (not hung, not COMPLETED) with torchrun's
    report of the failed rank in the job log, and no process of the job survives it."""
    global ENV
    saved = ENV
    ENV = dict(saved, MEGATRON_RAILS_FAULT="rank=1,site=token_dispatch,call=2,action=kill")
    try:
        job, rc, state, log = submit(tmp_path, SBATCH_CPU, timeout=300)
    finally:
        ENV = saved
    assert rc != 0 and state == "FAILED", f"job {job}: exit {rc}, state {state}\n{log[-3000:]}"
    assert "exitcode  : -9" in log or "Signals.SIGKILL" in log, log[-3000:]
    assert not (tmp_path / "run" / "result.json").exists()
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "run")], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of job {job} survived: {left}"
