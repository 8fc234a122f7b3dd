"""runtime/comm/base.leave: a rank's process ends with the given status, its output flushed and its
process groups destroyed, right after a background collective (what our spawned ranks do)."""
from __future__ import annotations

import subprocess
import sys
import textwrap


def test_leave_exits_with_status_and_flushed_output(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        import torch
        import torch.distributed as dist
        from megatron_rails.runtime.comm.base import leave

        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        x = torch.arange(6.0)
        out = torch.empty_like(x)
        work = dist.all_to_all_single(out, x, async_op=True)
        work.wait()
        print("sum", int(out.sum()), end="")  # no newline: only an explicit flush writes it to a pipe
        sys.stderr.write("to stderr")
        leave(3)
        print("unreachable")
    """)
    got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert got.returncode == 3, got.stderr
    assert got.stdout == "sum 15"
    assert got.stderr.endswith("to stderr")
