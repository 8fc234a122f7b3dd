"""The spawned-rank harness itself: its ranks fork from a server that started with some earlier
test's environment, so each must still see the environment and import path of the test that
spawned it (tests steer their ranks through both); and a failure names its rank and says why."""
import os
import sys

import pytest

from moe_harness import spawn

GONE = "MEGATRON_RAILS_HARNESS_GONE"
PROBE = "MEGATRON_RAILS_HARNESS_PROBE"


def _sees(rank, world, env, path):
    got = {k: os.environ.get(k) for k in env}
    assert got == env, (got, env)
    assert sys.path[0] == path, sys.path[:3]


def test_ranks_see_the_spawning_tests_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(GONE, "1")
    spawn(_sees, 2, {GONE: "1", PROBE: None}, sys.path[0], megatron=False)  # the server may start here
    monkeypatch.delenv(GONE)
    for value in ("first", "second"):  # set after the server started
        monkeypatch.setenv(PROBE, value)
        monkeypatch.syspath_prepend(str(tmp_path / value))
        spawn(_sees, 2, {GONE: None, PROBE: value}, str(tmp_path / value), megatron=False)


def _fails(rank, world):
    if rank == 1:
        raise ValueError("rank one's own error")
    if rank == 2:
        os._exit(3)  # dies without a traceback


def test_a_failing_rank_is_reported_with_its_traceback_and_a_silent_one_with_its_exit_code():
    with pytest.raises(AssertionError) as info:
        spawn(_fails, 3, megatron=False)
    text = str(info.value)
    assert "rank 1:\nTraceback" in text and "ValueError: rank one's own error" in text, text
    assert "rank 2: exit code 3 and no traceback" in text, text
    assert "rank 0" not in text, text  # rank 0 finished cleanly
