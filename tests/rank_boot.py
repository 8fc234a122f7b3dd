"""The first code a rank started by `moe_harness.spawn` runs: stdlib only, so that nothing the
test's environment decides is imported before that environment is in place.

The ranks fork from a server process that imported torch and Megatron-Core once (about 10 s of
CPU per rank otherwise, most of the suite's time). That server keeps the environment it started
with, so each rank first takes the environment and import path of the test that spawned it (tests
set MEGATRON_RAILS_SEND_ORDER and the like for their ranks), then unpickles its function and
arguments, which may import modules that read them.
"""
import os
import pickle
import sys


def run(rank: int, env: dict, path: list, payload: bytes, errq) -> None:
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path
    try:
        entry, args = pickle.loads(payload)
    except BaseException:
        import traceback

        errq.put((rank, traceback.format_exc()))
        raise
    entry(rank, errq, *args)
