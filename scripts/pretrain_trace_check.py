"""The routing traces scripts/pretrain_check.sh's `default` runs recorded with `--rails-trace`, checked:

    python scripts/pretrain_trace_check.py OUT/traces --iters ITERS --accum ACCUM --pairs-per-rank N

Each GROUP-default.npz (and its pipeline stages' GROUP-default.stage{s}.npz) must hold a row per
microbatch the run trained: ITERS x the group's microbatches per iteration (ACCUM, rounded up to a
multiple of the pipeline stages), half the iterations for a checkpoint group (its file is the
resumed run's); each row's optimizer steps 0, 1, ... in order, ACCUM rows each; every rank's counts
summing to N token-expert pairs (micro-batch x sequence x top-k), every layer. One line per file;
exit status 1 when any is missing or wrong.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

from megatron_rails.core.trace import load_trace

GROUP = re.compile(r"^ep(\d+)(?:pp(\d+))?(dist)?(rails)?(ckpt)?-default(?:\.stage(\d+))?\.npz$")


def check(path: Path, iters: int, accum: int, pairs: int) -> str | None:
    """What is wrong with one trace, or None."""
    m = GROUP.match(path.name)
    if m is None:
        return "not a GROUP-default[.stageS].npz name"
    pp = int(m.group(2) or 1)
    per_iter = -(-accum // pp) * pp
    want_iters = iters // 2 if m.group(5) else iters
    counts, meta = load_trace(path)
    with np.load(path) as z:
        step_I = z["step_I"] if "step_I" in z.files else None
    if counts.shape[0] != want_iters * per_iter:
        return f"{counts.shape[0]} rows, expected {want_iters} iterations x {per_iter} microbatches"
    if step_I is None or not np.array_equal(step_I, np.repeat(np.arange(want_iters), per_iter)):
        return "its rows' optimizer steps are not 0, 1, ... with a row per microbatch each"
    sums = counts.sum(axis=3)
    if not (sums == pairs).all():
        return f"a rank's counts sum to {int(sums[sums != pairs][0])}, expected {pairs} pairs"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", type=Path)
    ap.add_argument("--iters", type=int, required=True)
    ap.add_argument("--accum", type=int, required=True)
    ap.add_argument("--pairs-per-rank", type=int, required=True)
    a = ap.parse_args(argv)
    files = sorted(a.traces.glob("*.npz"))
    bad = 0
    for f in files:
        why = check(f, a.iters, a.accum, a.pairs_per_rank)
        c = load_trace(f)[0] if why is None else None
        print(f"{f.name}: " + (f"ok, {c.shape[0]} rows x {c.shape[1]} layers x {c.shape[2]} ranks x {c.shape[3]} "
                               "experts" if why is None else f"FAILED: {why}"))
        bad += why is not None
    if not files:
        print(f"{a.traces}: no trace recorded")
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
