"""CI's own configuration, and how the suite treats the optional parts CI provides.

* .ci/run with `make` and scripts/slurm/local-cluster.sh replaced by stubs that record their calls: a
  Slurm cluster that fails to start, or that start leaves absent, fails CI before any test runs;
  otherwise two passes: the whole suite on the Makefile's defaults with Triton and Slurm required,
  then the Megatron-dependent part on megatron-core 0.16.1 without Triton, on fewer steps.
* the Makefile through `make -n` (what it would run) and `make -q` (whether the venv is up to date):
  the default venv has megatron-core 0.19.2 and Triton and its `make test` requires Triton; every C
  source of the package, and the Triton choice, rebuild the venv.
* tests/optional.py through pytest itself, Triton hidden and Slurm unreachable: their tests skip,
  counted by reason at the end of the run, and fail where MEGATRON_RAILS_REQUIRE names the part.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("MEGATRON_RAILS_CORE_ONLY", "MEGATRON_RAILS_TEST_SCALE", "MEGATRON_RAILS_REQUIRE")
TRITON_TESTS = [f"tests/test_dispatch_local.py::{name}" for name in (
    "test_triton_gather_sum_matches_torch", "test_triton_send_order_matches_the_host_order",
    "test_only_the_kernels_first_launch_counts_as_unavailable")]
SLURM_TESTS = [f"tests/test_slurm.py::{name}" for name in (
    "test_sbatch_cpu_mode_matches_direct_torchrun", "test_sbatch_fails_clearly", "test_sbatch_reports_a_killed_rank")]
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="no `make` here (CI runs the suite through it)")


def _stub(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(0o755)


def run_ci(tmp_path, start_rc=0, status_rc=0):
    """(exit status, output, [(slurm command) or {"argv", "env"} of each make call]) of .ci/run in a
    copy of the tree whose cluster script and `make` only record their calls."""
    tree, calls = tmp_path / "tree", tmp_path / "calls.jsonl"
    (tree / ".ci").mkdir(parents=True)
    shutil.copy2(ROOT / ".ci" / "run", tree / ".ci" / "run")
    _stub(tree / "scripts" / "slurm" / "local-cluster.sh", f"""\
        import json, os, sys
        with open(os.environ["CALLS"], "a") as f:
            f.write(json.dumps(sys.argv[1]) + "\\n")
        sys.exit({{"start": {start_rc}, "status": {status_rc}}}.get(sys.argv[1], 0))
        """)
    _stub(tmp_path / "bin" / "make", f"""\
        import json, os, sys
        with open(os.environ["CALLS"], "a") as f:
            f.write(json.dumps({{"argv": sys.argv[1:], "env": {{k: os.environ.get(k) for k in {KEYS!r}}}}}) + "\\n")
        """)
    env = {k: v for k, v in os.environ.items() if k not in KEYS}
    env.update(CALLS=str(calls), PATH=f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}")
    p = subprocess.run(["bash", str(tree / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    lines = calls.read_text().splitlines() if calls.exists() else []
    return p.returncode, p.stdout + p.stderr, [json.loads(ln) for ln in lines]


@pytest.mark.parametrize("start_rc,status_rc", [(1, 1), (0, 1)], ids=["start fails", "start leaves no cluster"])
def test_ci_fails_without_a_slurm_cluster(tmp_path, start_rc, status_rc):
    rc, out, calls = run_ci(tmp_path, start_rc, status_rc)
    assert rc != 0, out
    assert not [c for c in calls if isinstance(c, dict)], f"tests ran without a Slurm cluster: {calls}"
    assert calls[-1] == "stop", calls  # whatever start left running is stopped


def _make_vars(argv):
    return dict(a.split("=", 1) for a in argv if "=" in a)


def test_ci_passes(tmp_path):
    """Pass 1 takes the Makefile's defaults (test_make_defaults: megatron-core 0.19.2 with Triton)
    and requires Triton and Slurm; pass 2 is 0.16.1, CORE_ONLY at a quarter of the steps, no Triton."""
    rc, out, calls = run_ci(tmp_path)
    assert rc == 0, out
    assert calls[0] == "start" and calls[-1] == "stop", calls
    first, second = [c for c in calls if isinstance(c, dict)]
    assert first["argv"][0] == second["argv"][0] == "test"
    one, two = _make_vars(first["argv"]), _make_vars(second["argv"])
    assert not {"MCORE_VERSION", "VENV", "TRITON"} & set(one), one
    assert set(re.split(r"[ ,]+", one.get("REQUIRE", first["env"]["MEGATRON_RAILS_REQUIRE"] or ""))) >= {"triton",
                                                                                                        "slurm"}
    assert not first["env"]["MEGATRON_RAILS_CORE_ONLY"] and not first["env"]["MEGATRON_RAILS_TEST_SCALE"]
    assert two["MCORE_VERSION"] == "0.16.1" and two["VENV"] not in ("", ".venv") and two["TRITON"] == ""
    assert second["env"]["MEGATRON_RAILS_CORE_ONLY"] == "1" and second["env"]["MEGATRON_RAILS_TEST_SCALE"] == "0.25"


def _clean_make_env() -> dict[str, str]:
    """The environment without what an enclosing `make` passes down: under `make test REQUIRE=...`
    (CI's first pass) MAKEFLAGS carries REQUIRE into every nested make, which would then read the
    caller's settings rather than the Makefile's defaults; so would the Makefile's own variables set in
    the environment (make reads the environment as variables)."""
    drop = {"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", *KEYS,
            "PYTHON", "VENV", "MCORE_VERSION", "TRITON", "REQUIRE", "PYTEST_ARGS"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def make_n(*args, cwd=ROOT) -> list[str]:
    """The commands `make -n -B ARGS` would run (nothing runs; -B: as if the venv were out of date)."""
    p = subprocess.run(["make", "-n", "-B", *args], cwd=cwd, env=_clean_make_env(), capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()


@needs_make
def test_make_defaults(tmp_path):
    venv = f"VENV={tmp_path / 'venv'}"
    lines = make_n("test", venv)
    installs = [ln for ln in lines if " -m pip install " in ln]
    assert any("megatron-core==0.19.2" in ln for ln in installs), lines
    assert not any("megatron-core==0.16.1" in ln for ln in lines), lines
    assert any(re.search(r"\striton(\s|$)", ln) for ln in installs), lines
    pytest_line = [ln for ln in lines if " -m pytest " in ln]
    assert len(pytest_line) == 1 and re.search(r"MEGATRON_RAILS_REQUIRE=\S*triton", pytest_line[0]), lines
    # CI's second pass: 0.16.1, Triton left out of (and taken out of) its venv, nothing required
    lines = make_n("test", venv, "MCORE_VERSION=0.16.1", "TRITON=")
    assert any(" -m pip install " in ln and "megatron-core==0.16.1" in ln for ln in lines), lines
    assert not any(" -m pip install " in ln and re.search(r"\striton(\s|$)", ln) for ln in lines), lines
    assert any(" -m pip uninstall " in ln and "triton" in ln for ln in lines), lines
    assert "triton" not in [ln for ln in lines if " -m pytest " in ln][0]


@needs_make
def test_make_rebuilds_the_venv_on_a_changed_source(tmp_path):
    """`make -q venv` in a copy of the Makefile and its inputs: up to date after the stamp, out of date
    once any C source or header of the package is newer, or with the other Triton choice."""
    sources = [p.relative_to(ROOT) for ext in ("*.c", "*.h") for p in (ROOT / "megatron_rails").rglob(ext)]
    assert len(sources) >= 6, sources  # the planners', the route's, the simulator's and the shared header
    for rel in [Path("Makefile"), Path("pyproject.toml"), Path("setup.py"), *sources]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, tmp_path / rel)
    stamp = [ln.split()[-1] for ln in make_n("venv", cwd=tmp_path) if ln.startswith("rm -f") and "touch" in ln]
    assert len(stamp) == 1, stamp
    (tmp_path / stamp[0]).parent.mkdir(parents=True)
    (tmp_path / stamp[0]).touch()
    past = (tmp_path / stamp[0]).stat().st_mtime - 100
    for rel in [Path("Makefile"), Path("pyproject.toml"), Path("setup.py"), *sources]:
        os.utime(tmp_path / rel, (past, past))

    def up_to_date(*args):
        return subprocess.run(["make", "-q", "venv", *args], cwd=tmp_path, env=_clean_make_env(),
                              capture_output=True).returncode == 0

    assert up_to_date()
    assert not up_to_date("TRITON=")
    for rel in sources:
        os.utime(tmp_path / rel)  # now: newer than the stamp
        assert not up_to_date(), f"{rel} changed, yet `make venv` would keep the venv"
        os.utime(tmp_path / rel, (past, past))


def pytest_run(nodeids, **env):
    """(exit status, output) of pytest on those tests in a fresh process, env over this one's (a None
    value drops the variable); not as CI's second pass, whatever this one is."""
    full = {k: v for k, v in os.environ.items() if k not in KEYS}
    full.update(env)
    full = {k: v for k, v in full.items() if v is not None}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *nodeids],
                       cwd=ROOT, env=full, capture_output=True, text=True, timeout=600)
    return p.returncode, p.stdout + p.stderr


@pytest.fixture
def no_triton(tmp_path):
    """A PYTHONPATH on which `import triton` raises ImportError."""
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text('raise ImportError("hidden by tests/test_ci.py")\n')
    return str(tmp_path)


def test_triton_tests_skip_counted_or_fail_where_required(no_triton):
    rc, out = pytest_run(TRITON_TESTS, PYTHONPATH=no_triton)
    assert rc == 0 and re.search(r"\b3 skipped\b", out), out[-3000:]
    # the end-of-run summary: the skips counted by reason
    assert re.search(r"^-+ 3 skipped, by reason -+$", out, re.M), out[-3000:]
    assert re.search(r"^ +3  triton is not importable \(hidden by tests/test_ci\.py\).*\[tests/test_dispatch_local\.py\]$",
                     out, re.M), out[-3000:]
    rc, out = pytest_run(TRITON_TESTS, PYTHONPATH=no_triton, MEGATRON_RAILS_REQUIRE="triton")
    assert rc == 1 and re.search(r"\b3 failed\b", out) and "skipped" not in out.split("short test summary")[-1], out[-3000:]
    assert "MEGATRON_RAILS_REQUIRE names triton" in out, out[-3000:]


def test_slurm_tests_skip_or_fail_where_required():
    unreachable = dict(SLURM_CONF="/nonexistent/slurm.conf")  # sinfo fails wherever Slurm is installed
    rc, out = pytest_run(SLURM_TESTS, **unreachable)
    assert rc == 0 and re.search(r"\b3 skipped\b", out), out[-3000:]
    rc, out = pytest_run(SLURM_TESTS, MEGATRON_RAILS_REQUIRE="slurm,triton", **unreachable)
    assert rc == 1 and re.search(r"\b3 errors?\b", out) and "MEGATRON_RAILS_REQUIRE names slurm" in out, out[-3000:]


def test_an_unknown_required_part_is_refused():
    rc, out = pytest_run(["tests/test_units.py", "--collect-only"], MEGATRON_RAILS_REQUIRE="triton slrum")
    assert rc == 4 and "MEGATRON_RAILS_REQUIRE: unknown part(s) slrum (known: triton, slurm)" in out, out[-2000:]
