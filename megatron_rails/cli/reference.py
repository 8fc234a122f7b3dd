"""docs/cli.md: every `megatron-rails` command's --help, generated from the parser itself, so the
reference cannot drift from the flags (tests/test_cli.py compares the committed file).

    python -m megatron_rails.cli.reference --out docs/cli.md
"""
from __future__ import annotations

import argparse
import os
import sys

WIDTH = 80  # the help as an 80-column terminal shows it, whatever terminal generates the file

HEAD = """# Command line reference

Every `megatron-rails` command's `--help`, as an 80-column terminal shows it. Generated from the parser
(`python -m megatron_rails.cli.reference --out docs/cli.md`); `tests/test_cli.py` fails when it is stale.
Bad input exits 2 with a line per problem naming the flag (or file and key) and what is allowed;
`config validate` exits 1 for an invalid file.
"""


def _subcommands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parser's subcommands in the order they were added (their aliases skipped)."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen = set()
            for sub in action.choices.values():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    out.append(sub)
    return out


def _walk(parser: argparse.ArgumentParser):
    yield parser
    for sub in _subcommands(parser):
        yield from _walk(sub)


def generate() -> str:
    """The whole reference (markdown): one section per command, its --help in a code block."""
    from .main import build_parser

    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)  # argparse wraps at the terminal size it reads from here
    try:
        parts = [HEAD]
        for p in _walk(build_parser()):
            parts.append(f"\n## `{p.prog}`\n\n```text\n{p.format_help().rstrip()}\n```\n")
    finally:
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before
    return "".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_rails.cli.reference", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write here (default: print)")
    args = ap.parse_args(argv)
    text = generate()
    if args.out:
        from ..core.outfile import write_text

        write_text(args.out, text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
