"""scripts/gpu_check.py, the multi-rank check made for a GPU, run on CPU: 4 ranks over gloo, every
policy x comm against Megatron-Core's stock dispatcher through 3 optimizer steps; and its self-test
(one of our expert weights nudged) must fail, so the check can."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--device", "cpu", "--ranks", "4", "--hidden", "16", "--tokens", "64"]


def _run(*argv):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), *SMALL, *argv],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)


def _cases(stdout: str) -> dict:
    """{(policy, comm): (verdict, the case's lines joined)} from the report's blocks (a verdict line,
    then indented lines)."""
    cases, key = {}, None
    for line in stdout.splitlines():
        m = re.match(r"(\w+)\s+(direct|rails)\s+(ok|BAD) ", line)
        if m:
            key = (m.group(1), m.group(2))
            cases[key] = [m.group(3), line]
        elif key and line.startswith("    "):
            cases[key][1] += " " + line.strip()
        else:
            key = None
    return {k: tuple(v) for k, v in cases.items()}


def test_every_policy_and_comm_matches_stock_on_four_ranks():
    proc = _run()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cases = _cases(proc.stdout)
    assert len(cases) == 10 and all(v == "ok" for v, _ in cases.values()), proc.stdout
    for (policy, comm), (_, text) in cases.items():
        if policy != "none":
            assert "weights 0.0 MiB" not in text, text  # a balancing policy moved weights
            # ... and its slots' gradients went back once per optimizer step (3), not per microbatch
            assert "gradients back 3 times" in text, text
        if comm == "rails":
            assert "sprayed 0/" not in text, text
    assert "every case (10) matches stock" in proc.stdout
    assert max(len(line) for line in proc.stdout.splitlines()) <= 80, proc.stdout


def test_a_nudged_weight_fails_the_check():
    proc = _run("--perturb", "--policies", "fsep", "ultraep", "--comms", "rails")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert [v for v, _ in _cases(proc.stdout).values()] == ["BAD", "BAD"], proc.stdout


def test_shared_experts_match_stock():
    """--shared-experts (on CUDA overlapped with the dispatcher; on the host run by MoELayer)."""
    proc = _run("--shared-experts", "--policies", "fsep", "--comms", "direct")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [v for v, _ in _cases(proc.stdout).values()] == ["ok"], proc.stdout
