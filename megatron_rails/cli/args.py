"""argparse pieces shared by the subcommands: the parser class (one-line errors, defaults and ranges
shown in --help, a description for every subcommand) and value checkers whose errors name the flag and
the allowed range. Bad input never reaches the code behind a command as a value it cannot use."""
from __future__ import annotations

import argparse
import contextlib
import errno
import math
import os
import re
import sys
from pathlib import Path

from ..core.errors import InputError


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X; RANGE)" to an option's help: the default unless there is no value to show
    (None, a flag's False) or the help already says what it is, and the range its type checks (the
    checkers below carry it as `range_text`), so no help text spells a range out by hand."""

    def _get_help_string(self, action):
        text = action.help or ""
        nothing = action.default in ([], None, argparse.SUPPRESS) or action.default is False
        if not (nothing or "default" in text):  # `is`: a default of 0 is a value to show
            text = super()._get_help_string(action)
        rng = getattr(action.type, "range_text", "")
        if not rng:
            return text
        if text.endswith(")") and text[text.rfind("("):].startswith("(default"):  # into the default's parentheses
            return f"{text[:-1]}; {rng})"
        return f"{text} ({rng})"


class Default:
    """An option's default as the parser stores it, so that a command can tell a value typed from the
    same value left alone (an option that would have no effect is refused only where it was typed);
    --help shows the value. `fill_defaults` puts the values in place after parsing."""

    def __init__(self, value):
        self.value = value

    def __str__(self) -> str:
        return str(self.value)


def fill_defaults(args) -> frozenset:
    """Replace every Default left in `args` by its value; the names of those options (not typed)."""
    left = frozenset(k for k, v in vars(args).items() if isinstance(v, Default))
    for k in left:
        setattr(args, k, getattr(args, k).value)
    return left


class _Subcommands(argparse._SubParsersAction):
    """Subcommands whose --help opens with their one-line help, and which remember their full name
    (`megatron-rails simulate run`) for error messages."""

    def add_parser(self, name, **kwargs):
        kwargs.setdefault("description", kwargs.get("help"))
        parser = super().add_parser(name, **kwargs)
        parser.set_defaults(command_prog=parser.prog)
        return parser


def error_text(prog: str, message: str) -> str:
    """`PROG: error: MESSAGE` as a line for stderr. Piped or written to a file it stays one line (a
    log keeps each error on a line of its own, for grep, and a program reading it gets one line
    whatever COLUMNS it exports); on a terminal it wraps at the terminal's width with the rest
    indented two columns, a longer word (a path) whole on a line of its own. A message of several
    lines keeps its line breaks, each line wrapped."""
    text = f"{prog}: error: {message}"
    width = _terminal_width()
    if width is None or max(map(len, text.splitlines() or [""])) <= width:
        return text
    import textwrap

    return "\n".join(textwrap.fill(line, width, subsequent_indent="  ", break_on_hyphens=False,
                                    break_long_words=False) for line in text.splitlines())


def _terminal_width() -> int | None:
    """The width of the terminal stderr writes to (COLUMNS where set, as the tables read it; 80
    where the terminal reports none), or None where stderr is not a terminal."""
    try:
        if not sys.stderr.isatty():
            return None
        columns = os.environ.get("COLUMNS", "").strip()
        width = int(columns) if columns.isdigit() else os.get_terminal_size(sys.stderr.fileno()).columns
    except (AttributeError, ValueError, OSError):  # stderr replaced, closed, or not a real descriptor
        return None
    return max(width or 80, 40)


def discard(stream) -> None:
    """Point `stream`'s descriptor at /dev/null after a failed write: what is still buffered goes
    nowhere, so that the interpreter's flush at exit does not fail again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser (its subcommands inherit the class) that reports a usage error in one line."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _Subcommands)

    def _print_message(self, message, file=None):
        # argparse drops a failed write (--help > /dev/full would exit 0 having written nothing): say so
        # and exit 1 as every command does; a reader that left (--help | head) ends it quietly
        if not message:
            return
        file = file or sys.stderr
        if file is sys.stderr:  # an error message: its exit status stands whether or not it got out
            with contextlib.suppress(OSError):
                file.write(message)
            return
        try:
            file.write(message)
            file.flush()
        except OSError as err:
            discard(file)
            if not isinstance(err, BrokenPipeError):
                with contextlib.suppress(OSError):
                    sys.stderr.write(error_text(self.prog, str(err.strerror or err)) + "\n")
            raise SystemExit(1) from None

    def error(self, message):
        # the usage block of a long command pushes the message off screen; --help has the usage.
        # Checkers name their flag themselves: drop argparse's "argument --x: " before "--x ..."
        message = re.sub(r"^argument (\S+): (?=\1\b)", "", message)
        self.exit(2, error_text(self.prog, f"{message} (see {self.prog} --help)") + "\n")


def _parse_int(name: str, text: str) -> int:
    """An integer, also written as an integral float (1e6) as people type token counts; in ASCII
    digits without Python's `_` separators (int() takes `8_0` for 80 and other scripts' digits)."""
    if not text.isascii() or "_" in text:
        raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}")
    try:
        return int(text)
    except ValueError:
        pass
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v.is_integer()):
        raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}")
    return int(v)


def _range_text(lo, hi) -> str:
    return f">= {lo}" + (f" and <= {hi}" if hi is not None else "")


def int_range(name: str, lo: int, hi: int | None = None):
    """argparse type: an integer in [lo, hi] (hi None: no upper bound)."""
    def conv(text: str) -> int:
        v = _parse_int(name, text)
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{name} must be {_range_text(lo, hi)}, got {text}")
        return v
    conv.range_text = f"{lo} to {hi}" if hi is not None else f"at least {lo}"
    return conv


def float_range(name: str, lo: float, hi: float):
    """argparse type: a finite number in [lo, hi] (NaN and inf are refused: they pass every < test)."""
    def conv(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not (math.isfinite(v) and lo <= v <= hi):
            raise argparse.ArgumentTypeError(f"{name} must be a finite number >= {lo:g} and <= {hi:g}, got {text}")
        return v
    conv.range_text = f"{lo:g} to {hi:g}"
    return conv


def divisor_of(name: str, n: int, what: str):
    """argparse type: a positive integer dividing n (`what` says what n counts)."""
    allowed = [d for d in range(1, n + 1) if n % d == 0]

    def conv(text: str) -> int:
        v = _parse_int(name, text)
        if v not in allowed:
            raise argparse.ArgumentTypeError(f"{name} must divide {what} ({n}): one of "
                                             f"{', '.join(map(str, allowed))}, got {text}")
        return v
    conv.range_text = f"divides {n}: {', '.join(map(str, allowed))}"
    return conv


def workload_list(text: str) -> tuple[str, ...]:
    """`--workloads A,B,...`: names of core/step_workloads.py's workloads."""
    from ..core.errors import WorkloadError
    from ..core.step_workloads import parse_workloads

    try:
        return parse_workloads(text)
    except WorkloadError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--workloads: ")) from None


def in_file(name: str, what: str):
    """argparse type: a path to read `what` from; refused when empty (Path("") is the working directory,
    which the loaders would report as a directory nobody named). The loaders check the file itself."""
    def conv(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{name}: an empty path; give {what}")
        return text
    return conv


def _os_checked(name: str, conv):
    """conv, with an OSError from looking at the path (a name too long for the file system, a loop
    of links) as the option's own error instead of a traceback from inside argparse."""
    def checked(text: str) -> str:
        try:
            return conv(text)
        except OSError as err:
            raise argparse.ArgumentTypeError(f"{name} {text!r}: cannot write there ({err.strerror})") from None
    return checked


def out_file(name: str):
    """argparse type: a path a result can be written to (its directory exists, it is not a directory,
    and a file can be opened there for writing), checked before the work rather than after it; "-"
    is standard output (/dev/stdout), as for most tools."""
    check = _os_checked(name, _out_file(name))
    return lambda text: check("/dev/stdout" if text == "-" else text)


def _out_file(name: str):
    def conv(text: str) -> str:
        p = Path(text)
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{name}: empty; give a file name")
        if p.is_dir():
            raise argparse.ArgumentTypeError(f"{name} {text!r} is a directory; give a file name")
        if not p.parent.is_dir():
            what = "is not a directory" if p.parent.exists() else "does not exist"
            raise argparse.ArgumentTypeError(f"{name} {text!r}: {str(p.parent)!r} {what}")
        _probe_writable(name, p)
        return text
    return conv


def _probe_writable(name: str, p: Path) -> None:
    """Open p for writing without changing it (append; a file made here is removed again): what the
    directory's permission bits cannot tell (a read-only mount, /proc, root's view of them). A pipe
    or device (/dev/stdout) is opened without blocking, so that a pipe nobody reads is an error now
    rather than a hang; a link to a file not there yet is left alone (the probe would make the file
    and then remove the link): its target's directory is checked instead."""
    if p.is_symlink() and not p.exists():
        target = Path(os.path.realpath(p))
        if not target.parent.is_dir():
            raise argparse.ArgumentTypeError(f"{name} {str(p)!r} links to {str(target)!r}, whose directory "
                                             "does not exist")
        if not os.access(target.parent, os.W_OK):
            raise argparse.ArgumentTypeError(f"{name} {str(p)!r} links to {str(target)!r}: cannot write there")
        return
    if p.exists() and not p.is_file():
        try:
            os.close(os.open(p, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
        except OSError as err:
            why = "a pipe nobody reads" if err.errno == errno.ENXIO else err.strerror
            raise argparse.ArgumentTypeError(f"{name} {str(p)!r}: cannot write there ({why})") from None
        return
    existed = p.exists()
    try:
        with open(p, "a"):
            pass
    except OSError as err:
        raise argparse.ArgumentTypeError(f"{name} {str(p)!r}: cannot write there ({err.strerror})") from None
    if not existed:
        p.unlink(missing_ok=True)


# what matplotlib's savefig writes with its own backends (Agg with Pillow, PDF, PS, SVG); not .pgf, which
# needs a LaTeX installation and would fail only after the work
STREAM_NAMES = re.compile(r"^/dev/(stdin|stdout|stderr|tty)$|^/dev/fd/|^/proc/[^/]+/fd/")
PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".svgz", ".eps", ".ps", ".jpg", ".jpeg", ".tif", ".tiff", ".webp")


def plot_file(name: str):
    """argparse type: out_file for a figure, whose suffix says its format (one of PLOT_SUFFIXES);
    without one, .png is added (the name printed is then the file written). A figure is a file: a
    device or pipe (/dev/full, /dev/stdout) is refused as it is, with no suffix added."""
    check = out_file(name)

    def conv(text: str) -> str:
        suffix = Path(text).suffix.lower()
        if Path(text).is_dir() or not text.strip():
            return check(text)  # its own error: a directory, no name
        # /dev/stdout is a regular file when the stream is redirected to one: the names of a
        # process's streams are refused by name too (/dev/shm and the like stay usable)
        if text == "-":
            raise argparse.ArgumentTypeError(f"{name} -: that is standard output; a figure is written to a file")
        special = STREAM_NAMES.match(os.path.abspath(text))
        if special or (Path(text).exists() and not Path(text).is_file()):
            raise argparse.ArgumentTypeError(f"{name} {text!r}: not a regular file (a device or a pipe); a "
                                             "figure is written to a file")
        if not suffix:
            text += ".png"
        elif suffix not in PLOT_SUFFIXES:
            raise argparse.ArgumentTypeError(f"{name} {text!r}: a figure's format comes from its suffix; "
                                             f"use one of {', '.join(PLOT_SUFFIXES)}")
        return check(text)
    return _os_checked(name, conv)


def escaped(text: str, values) -> str:
    """`text` with each of `values` (arguments as typed) that holds a newline or another control
    character written as Python writes it in quotes ('a\\nb'), so that a path cannot split an error
    line; longest first, so that no shorter argument inside a longer one is escaped on its own."""
    for value in sorted((v for v in values if isinstance(v, str) and not v.isprintable()), key=len, reverse=True):
        text = text.replace(value, repr(value)[1:-1])
    return text


def no_table_with_json(args) -> None:
    """--wide chooses the table's columns; with --json there is no table (checked before any work)."""
    if args.json and args.wide:
        raise InputError("--wide widens the table, and --json prints no table: drop one of them")


def flag_error(err) -> str:
    """A config error "ranks_per_node: ..." from validating flags, as "--ranks-per-node: ..."."""
    key, sep, rest = str(err).partition(": ")
    return f"--{key.replace('_', '-')}: {rest}" if sep and key.isidentifier() else str(err)
