"""Every `megatron-rails` command in README.md parses with the real CLI parser; the quick ones run
here (the rest run in their own tests: bench planners --quick and demo in test_cli.py, the soak in
reliability/test_soak.py, make demo / make test in CI)."""
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rails.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
RUN_HERE = ("plan", "simulate a2a", "simulate run", "config validate", "config show")


def readme_commands():
    text = ROOT.joinpath("README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    cmds = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("megatron-rails "):
                cmds.append(shlex.split(line)[1:])
    return cmds


CMDS = readme_commands()


def test_readme_lists_commands():
    assert len(CMDS) >= 6, CMDS


@pytest.mark.parametrize("argv", CMDS, ids=[" ".join(c[:2]) for c in CMDS])
def test_readme_command(argv):
    build_parser().parse_args(argv)  # SystemExit (a test failure) on any unknown flag or value
    if any(" ".join(argv).startswith(p) for p in RUN_HERE):
        args = [a for a in argv if a != "--json"]
        proc = subprocess.run([sys.executable, "-m", "megatron_rails.cli", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, f"{' '.join(argv)}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
