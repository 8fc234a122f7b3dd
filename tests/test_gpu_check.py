"""scripts/gpu_check.py, the multi-rank check made for a GPU, run on CPU: 4 ranks over gloo, every
policy x comm against Megatron-Core's stock dispatcher through 3 optimizer steps; and its self-test
(one of our expert weights nudged) must fail, so the check can."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--device", "cpu", "--ranks", "4", "--hidden", "16", "--tokens", "64"]


def _run(*argv):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), *SMALL, *argv],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)


def test_every_policy_and_comm_matches_stock_on_four_ranks():
    proc = _run()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if " ok " in ln]
    assert len(lines) == 10, proc.stdout
    for ln in lines:
        if not ln.startswith("none"):
            assert "weights 0.0 MiB" not in ln, ln  # a balancing policy moved weights
        if " rails " in ln:
            assert "sprayed 0/" not in ln, ln
    assert "all of 10 cases match stock" in proc.stdout


def test_a_nudged_weight_fails_the_check():
    proc = _run("--perturb", "--policies", "fsep", "ultraep", "--comms", "rails")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.count(" BAD ") == 2, proc.stdout
