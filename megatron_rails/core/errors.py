"""The package's error types, in a module of its own so that every layer can raise them.

`InputError` marks input a user can fix (a command-line argument, a config or data file): the
`megatron-rails` command prints its message as `megatron-rails CMD: error: ...` and exits 2, without a
traceback. Any other exception reaching the command is a bug and keeps its traceback.
"""

import math
import reprlib
from pathlib import Path

import numpy as np

SHOWN_CHARS = 60  # the most of a value an error message shows: a file may hold values of any size
_REPR = reprlib.Repr()  # bounded work as well as bounded text: a shared list can expand to 10^9 items
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 3, 8, 8, 6
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = SHOWN_CHARS, SHOWN_CHARS, 40


def is_integer(v) -> bool:
    """A Python or numpy integer, not a bool (True would pass as 1 expert, slot or rank)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def shown(value, limit: int = SHOWN_CHARS) -> str:
    """`value` for an error message, in the words a YAML file writes it with (true, .nan; None,
    YAML's null, as "an empty value"), at most `limit` characters (cut with "...")."""
    if value is None:
        return "an empty value"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if math.isnan(value) else ".inf" if value > 0 else "-.inf"
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def cut(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` (a key, a name) as it is, at most `limit` characters (cut with "..."); characters that are
    not printable escaped as Python writes them (a key holding a terminal escape or a right-to-left
    override would otherwise recolor or reorder the message)."""
    if not text.isprintable():
        text = repr(text)[1:-1]
    return text if len(text) <= limit else text[:limit - 3] + "..."


def reason(err: BaseException, limit: int = 120) -> str:
    """A library's error as one line of at most `limit` characters (its type where it says nothing)."""
    return " ".join(str(err).split())[:limit] or type(err).__name__


class InputError(ValueError):
    """Bad input: an argument, a config or a data file. Its message names the argument (or file and
    key) and what is allowed."""


class WorkloadError(InputError):
    """A workload spec, skew text or counts file is invalid."""


class PlanError(ValueError):
    """A placement or plan violates the plan model's invariants."""


class ChildFailed(RuntimeError):
    """A launched run (torchrun training, trace recording) exited non-zero; the message carries the
    tail of its output, which is what a user needs to see (not our traceback)."""


def check_file(path, what: str, error=InputError, missing: Exception | None = None) -> None:
    """`path` names a regular file to read as a `what` file; else one line saying what it is instead:
    error("PATH: is a directory, ...") or error("PATH: not a regular file ..."; a pipe or device,
    which reading would block on or drain), and, where nothing is there, `missing` (callers word it
    and pick its type, FileNotFoundError for loaders) or error("PATH: WHAT file not found")."""
    if not str(path):  # Path("") is ".", which would read as "a directory"
        raise error(f"an empty path; give a {what} file")
    p = Path(path)
    if p.is_dir():
        raise error(f"{p}: is a directory, not a {what} file")
    if p.exists() and not p.is_file():
        raise error(f"{p}: not a regular file (a pipe or a device); give a {what} file")
    if not p.is_file():
        raise missing if missing is not None else error(f"{p}: {what} file not found")
