"""Every `megatron-rails` command in README.md and docs/*.md parses with the real CLI parser (docs
cannot drift from the flags); the README's quick ones run here (each doc's own test runs its commands; (the rest run in their own tests: bench planners --quick and demo in test_cli.py, the soak in
reliability/test_soak.py, make demo / make test in CI)."""
import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rails.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
RUN_HERE = ("plan", "simulate a2a", "simulate run", "config validate", "config show")


def commands(path):
    """`megatron-rails ...` lines (continuations joined, comments dropped) of shell code blocks."""
    cmds, lang, buf = [], None, []
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, buf = line[3:].strip(), []
                continue
            if lang in ("", "bash", "sh", "console"):
                for cmd in "\n".join(buf).replace("\\\n", " ").splitlines():
                    cmd = cmd.split("  #")[0].strip()
                    if cmd.startswith("megatron-rails "):
                        cmds.append(shlex.split(cmd)[1:])
            lang = None
        elif lang is not None:
            buf.append(line)
    return cmds


CMDS = commands(ROOT / "README.md")
DOC_CMDS = [(p.name, c) for p in sorted((ROOT / "docs").glob("*.md")) for c in commands(p)]


@pytest.mark.parametrize("doc,argv", DOC_CMDS, ids=[f"{d}: {' '.join(c[:2])}" for d, c in DOC_CMDS])
def test_doc_command_parses(doc, argv):
    build_parser().parse_args(argv)


def parser_commands(parser, prefix=()):
    """Every command path of the real parser: subcommands (nested) and, below a command, the choices of
    its first positional (`bench planners`, `bench dispatcher`, ...)."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.append(prefix + (name,))
                out += parser_commands(sub, prefix + (name,))
        elif prefix and not action.option_strings and action.choices:
            out += [prefix + (str(c),) for c in action.choices]
            break
    return out


def test_readme_documents_every_command():
    # the parser's commands against the README's (its command block, and `...` spans in its prose such as
    # "Also: `bench dispatcher`, ..."): a command added to the CLI must be documented there
    text = (ROOT / "README.md").read_text()
    spans = CMDS + [s.split() for s in re.findall(r"`([a-z][^`]*)`", text)]
    documented = set()
    for words in spans:
        lead = []
        for w in words[:2]:  # the command words: up to two, before the first flag
            if w.startswith("-"):
                break
            lead.append(w)
        documented |= {tuple(lead[:1]), tuple(lead)}
    got = parser_commands(build_parser())
    assert {c[0] for c in got} >= {"plan", "bench", "simulate", "config", "demo"}  # the walk found the tree
    missing = [" ".join(c) for c in got if c not in documented]
    assert not missing, f"commands of the CLI that README.md does not document: {missing}"


@pytest.mark.parametrize("argv", CMDS, ids=[" ".join(c[:2]) for c in CMDS])
def test_readme_command(argv):
    build_parser().parse_args(argv)  # SystemExit (a test failure) on any unknown flag or value
    if any(" ".join(argv).startswith(p) for p in RUN_HERE):
        args = [a for a in argv if a != "--json"]
        proc = subprocess.run([sys.executable, "-m", "megatron_rails.cli", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, f"{' '.join(argv)}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
