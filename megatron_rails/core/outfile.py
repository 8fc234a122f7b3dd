"""Writing result files (benchmark JSON, traces, figures, generated docs) so that a failed write never
leaves a truncated file where a good one was: the data goes to a temporary file in the same
directory, renamed over the target once complete (os.replace: atomic within a file system). What a
rename cannot replace faithfully is written directly (`writes_in_place`: /dev/stdout, a pipe or
device, a file with other hard links or another owner, a directory we may not create files in). A
failed write raises WriteError naming the target.

    with open_for_writing(out) as f:     # a file object
        ...
    write_text(out, json.dumps(result))
    save_figure(fig, png)
"""
from __future__ import annotations

import contextlib
import errno
import os
import sys
from pathlib import Path
from typing import Iterator

from .errors import reason


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


# names for a descriptor the shell opened (/dev/stdout is the file or pipe stdout goes to: replacing
# that file would leave the shell's descriptor on the old one); /dev/shm and the like are file systems
_DESCRIPTOR_NAMES = ("/dev/stdin", "/dev/stdout", "/dev/stderr", "/dev/fd/", "/proc/")


def writes_in_place(path) -> bool:
    """Whether `path` is written as it is rather than replaced: a pipe or device, a descriptor's name
    (_DESCRIPTOR_NAMES) or the file stdout goes to, a file in a directory where we may create none,
    or a file a rename would change beyond its content: one with other hard links (they would keep
    the old content) or another owner (the new file would be ours)."""
    if os.path.abspath(path).startswith(_DESCRIPTOR_NAMES):
        return True
    target = Path(os.path.realpath(path))
    if not target.exists():
        return not os.access(target.parent, os.W_OK)
    st = target.stat()
    return (not target.is_file() or st.st_nlink > 1 or st.st_uid != os.geteuid()
            or not os.access(target.parent, os.W_OK) or is_stdout(target))  # `--out f > f`: as /dev/stdout


@contextlib.contextmanager
def replacing(path) -> Iterator[str]:
    """The path to write `path`'s new content to: a temporary sibling (same suffix: writers read the
    format from it), renamed over `path` when the block ends, removed if it raises; `path` itself
    where writes_in_place says so. A link is followed: the file it points to is replaced, the link kept."""
    if writes_in_place(path):
        yield str(path)
        return
    target = Path(os.path.realpath(path))
    # the name cut so that the temporary one fits where the target's does (255 bytes)
    tmp = target.with_name(f".{target.stem[:200]}.{os.urandom(4).hex()}.tmp{target.suffix}")
    try:
        yield str(tmp)  # the block's own errors are its own: only the rename below is the write's
        with _naming(path):
            _flush_to_disk(tmp)  # else a crash soon after the rename can leave an empty file there
            if target.exists():  # the new file gets the old one's permissions, not the default ones
                with contextlib.suppress(OSError):  # some mounts refuse chmod: the content still counts
                    os.chmod(tmp, os.stat(target).st_mode & 0o777)
            os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)  # gone after the rename; left over after an error


def _flush_to_disk(path) -> None:
    """fsync `path`'s data: a disk that fails to take it (EIO) fails the write, the old file kept."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    with replacing(path) as tmp, _naming(path):
        try:
            fig.savefig(tmp, **savefig_kwargs)
        except OSError:
            raise
        except Exception as err:  # the backend's own errors: the results written before it stand
            why = reason(err)
            raise WriteError(errno.EIO, f"the figure could not be written ({why})", str(path)) from None


def is_stdout(path) -> bool:
    """Whether `path` is this process's standard output (/dev/stdout, /proc/self/fd/1, the file or
    pipe stdout goes to): a summary printed to stdout would then land inside the results."""
    try:
        return os.path.samestat(os.stat(path), os.fstat(1))
    except (OSError, ValueError):
        return False


def summary_stream(path):
    """Where a command's short summary goes when its results go to `path`: stdout, unless that is
    where the results go (its one JSON document stays alone there), then stderr."""
    return sys.stderr if is_stdout(path) else sys.stdout
