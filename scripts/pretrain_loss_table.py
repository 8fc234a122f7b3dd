"""Loss table of the runs of scripts/pretrain_check.sh (gpu_pretrain_check.sh, cpu_pretrain_check.sh): every
run's per-iteration lm loss against the stock run of its group.

    python scripts/pretrain_loss_table.py OUTDIR [--tol 1e-4] [--skip 5]

OUTDIR holds one Megatron-LM training log per run, `<group>-<name>.log` (`ep1-stock.log`, `ep1-ultraep.log`,
`ep2-lp.log`, ...), and optionally `<run>.rc` (the exit status, or `skipped`). Runs are compared with
`<group>-stock` of their group. Megatron-LM's training_log (core_v0.16) prints, on the last rank, one line per
logged iteration:

    [2026-01-01 10:00:00.000000] iteration        3/      50 | consumed samples:           12 | elapsed time
    per iteration (ms): 41.7 | learning rate: 1.000000E-04 | global batch size:     4 | lm loss: 6.912345E+00 |
    load_balancing_loss: 1.000123E+00 | loss scale: 1.0 | grad norm: 2.345 | number of skipped iterations:   0 |
    number of nan iterations:   0 |

Prints the table and writes OUTDIR/table.md. Exit status 1 when a run's lm loss differs from its stock run's
by more than --tol at some iteration, or when a run of a one-rank group (`ep1-*`) failed (with --strict: any
run), or when a run named `*_loads` (a resume from a checkpoint) logged iteration 1; 0 otherwise. Where the log has them, the table also gives the dispatcher's max/mean tokens per EP rank
under the stock placement and under the plan (medians over iterations).
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

ITER_RE = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|(.*)")
FIELD_RE = re.compile(r"\s*([^|:]+?):\s*([-+0-9.eEinfa]+)\s*$")
ERROR_RE = re.compile(r"(\b\w*(Error|Exception|Interrupt)\b|error:|Killed|Segmentation fault|CUDA out of memory|"
                      r"timed out|Timeout|AssertionError|Traceback)")
NOISE_RE = re.compile(r"Warning|warnings\.warn|FutureWarning|UserWarning|^\s*\^+\s*$|^\s*~+\s*$")
TORCHRUN_RE = re.compile(r"ChildFailedError|torch[./]distributed[./]elastic|SignalException|Sending process \d+ closing")
ONE_RANK_GROUPS = ("ep1",)


@dataclass
class Run:
    name: str
    group: str
    policy: str
    rc: str | None = None
    losses: dict[int, float] = field(default_factory=dict)
    times: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    balance: tuple[float | None, float | None] = (None, None)  # median max/mean tokens per rank: stock, plan
    train_iters: int | None = None
    error: str = ""
    note: str = ""

    @property
    def failed(self) -> bool:
        if self.rc not in (None, "0"):
            return True
        return not self.losses or (self.train_iters is not None and max(self.losses) < self.train_iters)


def iterations(text: str):
    """(iteration, train_iters, {field: value}) for every training_log line of a log."""
    for line in text.splitlines():
        m = ITER_RE.search(line)
        if not m:
            continue
        fields = {}
        for part in m.group(3).split("|"):
            f = FIELD_RE.match(part)
            if f:
                try:
                    fields[f.group(1).strip()] = float(f.group(2))
                except ValueError:
                    pass
        yield int(m.group(1)), int(m.group(2)), fields


def parse_log(text: str) -> tuple[dict[int, float], dict[int, float], dict[int, float], int | None]:
    """{iteration: lm loss}, {iteration: elapsed ms}, {iteration: grad norm}, train_iters, from training_log lines."""
    losses, times, norms, total = {}, {}, {}, None
    for it, total, fields in iterations(text):
        if "lm loss" in fields:
            losses[it] = fields["lm loss"]
        if "elapsed time per iteration (ms)" in fields:
            times[it] = fields["elapsed time per iteration (ms)"]
        if "grad norm" in fields:
            norms[it] = fields["grad norm"]
    return losses, times, norms, total


BALANCE_FIELDS = ("rails_max_over_mean_before", "rails_max_over_mean_after")


def parse_balance(text: str) -> tuple[float | None, float | None]:
    """Medians over the logged iterations of the dispatcher's max/mean tokens per EP rank under the stock
    placement and under the plan (megatron_rails' tracker names in the training log; None without them)."""
    values: dict[str, list[float]] = {name: [] for name in BALANCE_FIELDS}
    for _, _, fields in iterations(text):
        for name in BALANCE_FIELDS:
            if name in fields:
                values[name].append(fields[name])
    before, after = (statistics.median(values[n]) if values[n] else None for n in BALANCE_FIELDS)
    return before, after


def last_error(text: str, rc: str | None = None) -> str:
    """The last meaningful error line of a log (a traceback's exception, torchrun's failure, a timeout)."""
    if rc == "skipped" or text.startswith("skipped"):
        return text.strip().splitlines()[0] if text.strip() else "skipped"
    lines = [re.sub(r"^\[rank\d+\]:\s*|^\[default\d+\]:\s*", "", line).strip() for line in text.splitlines()]
    hits = [line for line in lines if line and ERROR_RE.search(line) and not NOISE_RE.search(line)
            and not line.startswith(("Traceback", "File ", "raise "))]
    if rc in ("124", "137"):
        return f"timed out (exit {rc})" + (f"; last error: {hits[-1][:200]}" if hits else "")
    if hits:
        # prefer a rank's exception line (Foo: message) over torchrun's own summary lines
        own = [h for h in hits if not TORCHRUN_RE.search(h)] or hits
        exc = [h for h in own if re.match(r"^[\w.]*(Error|Exception)\b", h)]
        return (exc or own)[-1][:300]
    tail = [line for line in lines if line]
    return (tail[-1][:300] if tail else "empty log") + (f" (exit {rc})" if rc else "")


def load_runs(outdir: Path) -> list[Run]:
    runs = []
    for log in sorted(outdir.glob("*.log")):
        m = re.match(r"^(.+)-([^-]+)$", log.stem)
        if not m:
            continue
        run = Run(name=log.stem, group=m.group(1), policy=m.group(2))
        rc_file = log.with_suffix(".rc")
        if rc_file.exists():
            run.rc = rc_file.read_text().strip()
        text = log.read_text(errors="replace")
        run.losses, run.times, run.grad_norms, run.train_iters = parse_log(text)
        run.balance = parse_balance(text)
        if run.failed:
            run.error = last_error(text, run.rc)
        if (outdir / f"{log.stem}.deterministic-error.txt").exists():
            run.note = " (rerun without --deterministic-mode: an op had no deterministic kernel)"
        runs.append(run)
    order = {"stock": 0, "none": 1, "eplb": 2, "fsep": 3, "ultraep": 4, "lp": 5, "default": 6}
    return sorted(runs, key=lambda r: (r.group, order.get(r.policy, 9), r.policy))


def median_time(run: Run, skip: int) -> float | None:
    vals = [t for it, t in sorted(run.times.items()) if it > skip]
    return statistics.median(vals) if vals else None


def fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def compare(runs: list[Run], tol: float, skip: int, strict: bool = False) -> tuple[list[str], list[str]]:
    """Markdown table lines and the problems (reasons for exit status 1). strict: every failed run and every
    group without a stock run is one (else only those of one-rank groups, ONE_RANK_GROUPS)."""
    stock = {r.group: r for r in runs if r.policy == "stock"}
    lines = [f"lm loss vs the stock run of the same group; tolerance {tol:g}; median iteration time over "
             f"iterations > {skip}.", "",
             "| run | iterations | max abs Δ lm loss | iterations exactly equal | max abs Δ grad norm "
             "| max/mean tokens per rank, stock → plan | median ms/iter | time / stock | status |",
             "|---|---|---|---|---|---|---|---|---|"]
    problems = []
    for run in runs:
        base = stock.get(run.group)
        n = len(run.losses)
        total = f"{n}/{run.train_iters}" if run.train_iters else str(n)
        med = median_time(run, skip)
        base_med = median_time(base, skip) if base and not base.failed else None
        ratio = med / base_med if med is not None and base_med else None
        delta = equal = dnorm = None
        status = "ok"
        if run.failed:
            status = f"FAILED: {run.error}"
            if strict or run.group in ONE_RANK_GROUPS:
                problems.append(f"{run.name} failed: {run.error}")
        if run.policy.endswith("_loads") and run.losses and min(run.losses) == 1:
            # resumed from a checkpoint, it must start after the saved iteration, not train afresh
            problems.append(f"{run.name} logged iteration 1: it did not resume from a checkpoint")
            status = "NOT RESUMED"
        if run is not base and base is not None and not base.failed and run.losses:
            common = sorted(set(run.losses) & set(base.losses))
            if common:
                delta = max(abs(run.losses[i] - base.losses[i]) for i in common)
                equal = sum(run.losses[i] == base.losses[i] for i in common)
                norms = [i for i in common if i in run.grad_norms and i in base.grad_norms]
                dnorm = max((abs(run.grad_norms[i] - base.grad_norms[i]) for i in norms), default=None)
                if delta > tol:
                    worst = max(common, key=lambda i: abs(run.losses[i] - base.losses[i]))
                    problems.append(f"{run.name}: lm loss differs from {base.name} by {delta:.3e} > {tol:g} "
                                    f"(iteration {worst}: {run.losses[worst]:.6e} vs {base.losses[worst]:.6e})")
                    if status == "ok":
                        status = f"MISMATCH > {tol:g}"
                eq = f"{equal}/{len(common)}"
            else:
                eq = "0/0"
        elif run is base:
            eq = "(reference)"
        else:
            eq = "–"
            if status == "ok" and base is not None and base.failed:
                status = f"ok (no stock to compare: {base.name} failed)"
            elif status == "ok" and base is None:
                status = "ok (no stock run in this group)"
        before, after = run.balance
        balance = "–" if before is None or after is None else f"{before:.3f} → {after:.3f}"
        lines.append(f"| {run.name} | {total} | {fmt(delta, '.3e')} | {eq} | {fmt(dnorm, '.3e')} | {balance} "
                     f"| {fmt(med, '.1f')} "
                     f"| {fmt(ratio, '.2f')} | {(status + run.note).replace('|', '/')} |")
    for group in sorted({r.group for r in runs} - set(stock)):
        if strict or group in ONE_RANK_GROUPS:
            problems.append(f"{group}: no stock run")
    return lines, problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--tol", type=float, default=1e-4, help="largest |lm loss - stock lm loss| accepted (1e-4)")
    ap.add_argument("--skip", type=int, default=5, help="iterations left out of the median time (5)")
    ap.add_argument("--strict", action="store_true",
                    help="every failed run is a problem, not only one-rank ones (CPU checks: nothing may fail)")
    args = ap.parse_args(argv)
    if not args.outdir.is_dir():
        ap.error(f"{args.outdir}: not a directory")
    runs = load_runs(args.outdir)
    if not runs:
        print(f"{args.outdir}: no <group>-<run>.log files", file=sys.stderr)
        return 1
    lines, problems = compare(runs, args.tol, args.skip, args.strict)
    lines += ["", "Problems:" if problems else "No problems: every run matches its stock run within the tolerance."]
    lines += [f"* {p}" for p in problems]
    text = "\n".join(lines) + "\n"
    (args.outdir / "table.md").write_text(text)
    print(text, end="")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
