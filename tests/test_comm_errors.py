"""runtime/comm: a failed collective is reported as a CommError naming the collective and the
group's ranks, and blames a peer only where the error is a peer's (a rank that died or hung), not
where the backend rejected the call itself (a wrong input: on a GPU, a host tensor given to NCCL)."""
from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_rejected_call_is_not_blamed_on_a_peer(tmp_path):
    script = textwrap.dedent(f"""
        import torch
        import torch.distributed as dist
        from megatron_rails.runtime.comm.base import CommError, describe_failure, leave
        from megatron_rails.runtime.comm.direct import _a2a

        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        try:
            _a2a(torch.zeros(6, 2), [5], [5], None)  # split sizes that do not add up to the rows
        except CommError as err:
            print("REJECTED", err)
        lost = describe_failure(None, "all-to-all", dist.DistBackendError("Connection closed by peer"))
        print("LOST", lost)
        leave(0)
    """)
    got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    lines = dict(line.split(" ", 1) for line in got.stdout.splitlines())
    assert lines["REJECTED"].startswith("rank 0: all-to-all over ranks [0] failed: the backend rejected the call ("), got.stdout
    assert "peer" not in lines["REJECTED"].split("(")[0]
    assert "a peer rank probably died or timed out (DistBackendError: Connection closed by peer)" in lines["LOST"]
