"""core/outfile.py: a result file appears whole or not at all; a failed write names the file."""
from __future__ import annotations

import os

import pytest

from megatron_rails.core.outfile import WriteError, is_stdout, open_for_writing, replacing, write_text, writes_in_place


def test_a_failed_write_keeps_the_old_file(tmp_path):
    f = tmp_path / "r.json"
    f.write_text("good")
    with pytest.raises(RuntimeError):
        with open_for_writing(f) as out:
            out.write("half of the new")
            raise RuntimeError("the writer failed")
    assert f.read_text() == "good" and os.listdir(tmp_path) == ["r.json"]  # no temporary file left


def test_data_the_disk_did_not_take_fails_the_write(tmp_path, monkeypatch):
    """The new content reaches the disk before the rename (fsync): where the disk reports an error
    the write fails naming the file and the old file stays (a rename first could have left it empty
    after a crash)."""
    import errno

    f = tmp_path / "r.json"
    f.write_text("good")

    def failing_fsync(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(WriteError) as err:
        write_text(f, "new")
    assert err.value.filename == str(f) and err.value.errno == errno.EIO
    assert f.read_text() == "good" and os.listdir(tmp_path) == ["r.json"]


def test_a_finished_write_replaces_the_file_keeping_its_mode_and_links(tmp_path):
    f = tmp_path / "r.json"
    f.write_text("old")
    os.chmod(f, 0o640)
    link = tmp_path / "link.json"
    link.symlink_to(f)
    write_text(link, "new")
    assert f.read_text() == "new" and link.is_symlink() and (f.stat().st_mode & 0o777) == 0o640
    with replacing(tmp_path / "fig.svg") as tmp:
        assert tmp.endswith(".svg") and os.path.dirname(tmp) == str(tmp_path)  # writers read the suffix
        open(tmp, "w").write("<svg/>")
    assert (tmp_path / "fig.svg").read_text() == "<svg/>"
    assert sorted(os.listdir(tmp_path)) == ["fig.svg", "link.json", "r.json"]


def test_a_device_is_written_directly_and_its_error_names_it(tmp_path):
    assert writes_in_place("/dev/stdout") and writes_in_place("/dev/null") and not writes_in_place(tmp_path / "x")
    with pytest.raises(WriteError) as err:
        write_text("/dev/full", "x" * 100_000)
    assert err.value.filename == "/dev/full" and err.value.strerror == "No space left on device"
    write_text("/dev/null", "gone")


def test_is_stdout(tmp_path):
    import subprocess
    import sys

    code = ("from megatron_rails.core.outfile import is_stdout; import sys; "
            "print(is_stdout('/dev/stdout'), is_stdout(sys.argv[1]), file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "other")], capture_output=True, text=True,
                       timeout=60)
    assert p.stderr.split() == ["True", "False"], p.stderr
    assert not is_stdout(tmp_path / "missing")


def test_what_a_rename_would_change_is_written_in_place(tmp_path):
    """A file with another hard link keeps it (both names see the new content); /dev/shm holds
    files, not descriptors, so a result there is replaced like anywhere else."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text("old")
    os.link(a, b)
    assert writes_in_place(a)
    write_text(a, "new")
    assert b.read_text() == "new"
    assert not writes_in_place("/dev/shm/megatron-rails-test.json")
    assert writes_in_place("/dev/stdout") and writes_in_place("/dev/fd/1")


def test_a_long_name_and_the_blocks_own_errors(tmp_path):
    """A 255-byte name (the most a file system takes) still gets its temporary sibling; an OSError
    of the caller's own block (reading an input) is not reported as the output's write error."""
    long = tmp_path / ("r" * 250 + ".json")
    write_text(long, "x")
    assert long.read_text() == "x"
    with pytest.raises(FileNotFoundError):
        with replacing(tmp_path / "out.json"):
            open(tmp_path / "missing-input.json")
    assert not list(tmp_path.glob(".out*"))  # no temporary file left behind
