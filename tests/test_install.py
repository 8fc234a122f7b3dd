"""The package works installed (non-editable), away from the checkout.

The presets (policy and topology YAMLs) ship as package data (megatron_rails/presets/, declared in
pyproject.toml); `balancer: default` and `topology: dgx-h100` must resolve from a plain install run
from any working directory. One build + install per session into a temp dir (no network, no deps,
the project venv untouched); the checks run in a subprocess whose PYTHONPATH puts that install
first and whose working directory is outside the checkout, and which first asserts that it imported
the installed copy, not the checkout (the venv has an editable install of it).

Also: the product default is defined once: PolicyConfig() is the `default` preset, and a
RailsTokenDispatcher built without a policy (nothing installed) takes exactly that.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]  # the checkout (pyproject.toml, setup.py, megatron_rails/)
PRESETS = ROOT / "megatron_rails" / "presets"
RUN_CONFIG = ROOT / "configs" / "mixtral" / "mixtral-8x7b.yaml"


PROBE = """
import setuptools  # before pip (see _distutils_hack's spec_for_pip)
try:
    import setuptools.command.bdist_wheel
except ImportError:
    import wheel.bdist_wheel
import pip
"""


def _yamls(presets_dir: Path) -> list[str]:
    return sorted(p.relative_to(presets_dir).as_posix() for p in presets_dir.rglob("*.yaml"))


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A non-editable install of the checkout (`pip install --target`), built from a copy of its
    sources so that the build writes nothing (build/, *.egg-info) into the checkout."""
    # checked in a subprocess: looking pip up here would switch off setuptools' distutils shim in
    # this process (_distutils_hack), and a later `import setuptools` (torch.utils.cpp_extension) fails
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"building the package offline (pip --no-build-isolation) needs pip and setuptools with "
                    f"bdist_wheel (setuptools >= 70.1, or the wheel package) in {sys.executable}: "
                    f"{probe.stderr.strip().splitlines()[-1:]}")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "megatron_rails", src / "megatron_rails",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info"))
    target = tmp_path_factory.mktemp("site")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--no-cache-dir", "--disable-pip-version-check", "--no-input", "--target", str(target), str(src)],
        cwd=tmp_path_factory.mktemp("pipcwd"), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert (target / "megatron_rails" / "__init__.py").is_file(), proc.stdout[-4000:]
    return target


CHECK = textwrap.dedent("""
    import dataclasses, json, sys
    from pathlib import Path

    target, checkout, run_yaml = (Path(a).resolve() for a in sys.argv[1:4])
    import megatron_rails
    pkg = Path(megatron_rails.__file__).resolve()
    assert pkg.is_relative_to(target), f"imported {pkg}, not the install under {target}"
    assert not pkg.is_relative_to(checkout), f"imported the checkout's copy {pkg}"

    from megatron_rails.core import presets
    from megatron_rails.core.policy import PolicyConfig, as_policy
    from megatron_rails.core.topology import load_topology, presets as topology_presets
    from megatron_rails.config.run import load_run_config

    topo = load_topology("dgx-h100")
    rc = load_run_config(run_yaml)
    out = {
        "presets_dir": str(presets.PRESETS_DIR.resolve()),
        "policies": presets.names(presets.POLICY_DIR),
        "topologies": topology_presets(),
        "dgx_h100": dataclasses.asdict(topo),
        "default_is_product_default": as_policy("default") == PolicyConfig(),
        "default": dataclasses.asdict(as_policy("default")),
        "product_default": dataclasses.asdict(PolicyConfig()),
        "run": rc.to_dict(),
        "yamls": sorted(p.relative_to(presets.PRESETS_DIR).as_posix()
                        for p in presets.PRESETS_DIR.rglob("*.yaml")),
        # every megatron_rails module that got imported, wherever it came from
        "modules": sorted({str(Path(m.__file__).resolve()) for n, m in list(sys.modules.items())
                           if n.split(".")[0] == "megatron_rails" and getattr(m, "__file__", None)}),
    }
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def installed_result(installed, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("elsewhere")  # the working directory: not the checkout
    run_yaml = work / RUN_CONFIG.name
    shutil.copy2(RUN_CONFIG, run_yaml)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(installed)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    proc = subprocess.run([sys.executable, "-c", CHECK, str(installed), str(ROOT), str(run_yaml)],
                          cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"the installed package failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_installed_package_finds_presets(installed, installed_result):
    from megatron_rails.config.run import load_run_config
    from megatron_rails.core.topology import load_topology

    r = installed_result
    site = installed.resolve()
    assert Path(r["presets_dir"]).is_relative_to(site) and not Path(r["presets_dir"]).is_relative_to(ROOT)
    outside = [m for m in r["modules"] if not Path(m).is_relative_to(site)]
    assert not outside, f"megatron_rails modules imported from outside the install: {outside}"

    assert "default" in r["policies"] and "dgx-h100" in r["topologies"]
    assert r["dgx_h100"]["gpus_per_node"] == 8
    assert r["dgx_h100"] == dataclasses.asdict(load_topology("dgx-h100"))  # same as the checkout's
    assert r["default_is_product_default"], (r["default"], r["product_default"])

    # the run config (balancer: default, topology: dgx-h100) resolves there as it does here
    run = r["run"]
    assert run["topology"]["name"] == "dgx-h100" and run["topology"]["gpus_per_node"] == 8
    assert run["balancer"] is not None and run["balancer"]["policy"] == r["product_default"]["policy"]
    assert run == load_run_config(RUN_CONFIG).to_dict()

    # every preset YAML of the checkout ships, and nothing else
    checkout_yamls = _yamls(PRESETS)
    assert checkout_yamls and r["yamls"] == checkout_yamls
    for rel in checkout_yamls:
        assert (site / "megatron_rails" / "presets" / rel).read_bytes() == (PRESETS / rel).read_bytes(), rel


def test_product_default_is_the_default_preset(monkeypatch):
    from megatron_rails.core.policy import PolicyConfig, as_policy

    assert PolicyConfig() == PolicyConfig.from_yaml(PRESETS / "policies" / "default.yaml")
    assert as_policy("default") == PolicyConfig()
    try:
        from megatron_rails.megatron import dispatcher
    except ImportError as err:  # Megatron-Core (or torch) not importable here
        pytest.skip(f"megatron_rails.megatron not importable: {err}")
    monkeypatch.setattr(dispatcher, "_installed", None)  # nothing installed (restored afterwards)
    got = dispatcher.installed_policy()
    assert type(got) is PolicyConfig and got == PolicyConfig()


def test_te_general_gemm_is_defined_where_megatron_left_it_undefined(monkeypatch):
    """Megatron-Core 0.16 without Transformer Engine never defines moe_utils.te_general_gemm, which
    its router GEMM tests (NameError at the first MoE forward on a GPU): the launcher and install()
    define it as None, the value meaning 'no Transformer Engine'; a defined one is left alone."""
    from megatron.core.transformer.moe import moe_utils

    from megatron_rails.megatron.compat import define_te_general_gemm

    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    assert define_te_general_gemm() is True and moe_utils.te_general_gemm is None
    sentinel = object()
    monkeypatch.setattr(moe_utils, "te_general_gemm", sentinel)
    assert define_te_general_gemm() is False and moe_utils.te_general_gemm is sentinel
