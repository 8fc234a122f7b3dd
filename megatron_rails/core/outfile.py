"""Writing result files (benchmark JSON, traces, figures, generated docs) so that a failed write never
leaves a truncated file where a good one was: the data goes to a temporary file in the same
directory, renamed over the target once complete (os.replace: atomic within a file system). A
target that exists and is not a regular file (/dev/stdout, a pipe, a device) is written directly:
there is nothing there to keep. A failed write raises WriteError naming the target.

    with replacing(out) as tmp:          # a path: np.save, savefig, anything that writes a file
        ...
    write_text(out, json.dumps(result))
    save_figure(fig, png)
"""
from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Iterator


class WriteError(OSError):
    """A result could not be written to `filename` (its strerror says why); what was there is kept."""


@contextlib.contextmanager
def _naming(path) -> Iterator[None]:
    """OSErrors of the block as WriteError naming `path` (a write's own error names no file)."""
    try:
        yield
    except WriteError:
        raise
    except OSError as err:
        raise WriteError(err.errno or errno.EIO, err.strerror or str(err), str(path)) from None


def writes_in_place(path) -> bool:
    """Whether `path` is written as it is rather than replaced: a pipe or device, or a name under
    /dev or /proc (/dev/stdout is the file or pipe the shell opened: replacing the file would leave
    the shell's descriptor on the old one), or a file in a directory where we may create none."""
    if os.path.abspath(path).startswith(("/dev/", "/proc/")):
        return True
    target = Path(os.path.realpath(path))
    return (target.exists() and not target.is_file()) or not os.access(target.parent, os.W_OK)


@contextlib.contextmanager
def replacing(path) -> Iterator[str]:
    """The path to write `path`'s new content to: a temporary sibling (same suffix: writers read the
    format from it), renamed over `path` when the block ends, removed if it raises; `path` itself
    where writes_in_place says so. A link is followed: the file it points to is replaced, the link kept."""
    with _naming(path):
        if writes_in_place(path):
            yield str(path)
            return
        target = Path(os.path.realpath(path))
        tmp = target.with_name(f".{target.stem}.{os.urandom(4).hex()}.tmp{target.suffix}")
        try:
            yield str(tmp)
            if target.exists():  # the new file gets the old one's permissions, not the default ones
                os.chmod(tmp, os.stat(target).st_mode & 0o7777)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)  # gone after the rename; left over after an error


@contextlib.contextmanager
def open_for_writing(path, mode: str = "w") -> Iterator:
    """open(path, mode) for writing, through `replacing`: the file appears whole or not at all."""
    with replacing(path) as tmp:
        with _naming(path), open(tmp, mode) as f:
            yield f


def write_text(path, text: str) -> None:
    with open_for_writing(path) as f:
        f.write(text)


def save_figure(fig, path, **savefig_kwargs) -> None:
    """fig.savefig to `path` through `replacing`. Whatever stops the figure (a full disk, a format
    whose backend needs a program that is not installed) is a WriteError naming the file."""
    with replacing(path) as tmp:
        try:
            fig.savefig(tmp, **savefig_kwargs)
        except OSError:
            raise
        except Exception as err:  # the backend's own errors: the results written before it stand
            why = " ".join(str(err).split())[:120] or type(err).__name__
            raise WriteError(errno.EIO, f"the figure could not be written ({why})", str(path)) from None


def is_stdout(path) -> bool:
    """Whether `path` is this process's standard output (/dev/stdout, /proc/self/fd/1, the file or
    pipe stdout goes to): a summary printed to stdout would then land inside the results."""
    try:
        return os.path.samestat(os.stat(path), os.fstat(1))
    except (OSError, ValueError):
        return False
