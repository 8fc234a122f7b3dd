"""scripts/pretrain_loss_table.py on synthetic logs shaped like Megatron-LM core_v0.16.1's training_log
(megatron/training/training.py): the same format strings, fp32 (loss scale 1.0), an MoE aux loss."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "pretrain_loss_table.py"
spec = importlib.util.spec_from_file_location("pretrain_loss_table", SCRIPT)
plt = importlib.util.module_from_spec(spec)
sys.modules["pretrain_loss_table"] = plt
spec.loader.exec_module(plt)


def training_log_line(iteration, train_iters, lm_loss, ms, batch=4, grad_norm=1.5, aux=1.0123):
    """One line as training_log prints it (core_v0.16.1, no throughput/energy/params-norm logging)."""
    log_string = f" [{datetime(2026, 1, 2, 3, 4, 5, 678901).strftime('%Y-%m-%d %H:%M:%S.%f')}]"
    log_string += ' iteration {:8d}/{:8d} |'.format(iteration, train_iters)
    log_string += ' consumed samples: {:12d} |'.format(iteration * batch)
    log_string += ' elapsed time per iteration (ms): {:.1f} |'.format(ms)
    log_string += f' learning rate: {1e-4:.6E} |'
    log_string += f' global batch size: {batch:5d} |'
    for key, avg in (("lm loss", lm_loss), ("load_balancing_loss", aux)):
        log_string += ' {}: {:.6E} |'.format(key, avg)
    log_string += f' loss scale: {1.0:.1f} |'
    log_string += f' grad norm: {grad_norm:.3f} |'
    log_string += ' number of skipped iterations: {:3d} |'.format(0)
    log_string += ' number of nan iterations: {:3d} |'.format(0)
    return log_string


PREAMBLE = """\
using world size: 1, data-parallel size: 1, context-parallel size: 1, tensor-model-parallel size: 1
> compiling dataset index builder ...
megatron-rails: installed policy=ultraep slots=1 comm=rails
[after training is done] datetime: 2026-01-02 03:04:05
 validation loss at iteration 50 | lm loss value: 6.000000E+00 | lm loss PPL: 4.034288E+02 |
"""


def loss_at(i, shift=0.0):
    return 7.0 - 0.01 * i + shift


def make_log(iters=50, shift=0.0, ms=40.0, stop=None, grad_shift=0.0):
    lines = [PREAMBLE.splitlines()[0], PREAMBLE.splitlines()[1], PREAMBLE.splitlines()[2]]
    for i in range(1, (stop or iters) + 1):
        lines.append(training_log_line(i, iters, loss_at(i, shift if i > 10 else 0.0),
                                       900.0 if i == 1 else ms + (i % 3), grad_norm=1.5 + grad_shift))
    lines += PREAMBLE.splitlines()[3:]
    return "\n".join(lines) + "\n"


TRACEBACK = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/x/pretrain_gpt.py", line 342, in <module>
[rank0]:     pretrain(
[rank0]:   File "/x/megatron/core/transformer/moe/token_dispatcher.py", line 445, in __init__
[rank0]:     raise RuntimeError("boom")
[rank0]: RuntimeError: ProcessGroupGloo::alltoall_base: unsupported device type cuda
E1102 03:04:05 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 1) local_rank: 0
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""


def write(outdir, name, text, rc="0"):
    (outdir / f"{name}.log").write_text(text)
    if rc is not None:
        (outdir / f"{name}.rc").write_text(rc + "\n")


def run_table(outdir, *extra):
    return subprocess.run([sys.executable, str(SCRIPT), str(outdir), *extra], capture_output=True, text=True)


def test_parse_log_reads_every_iteration():
    losses, times, norms, total = plt.parse_log(make_log())
    assert total == 50 and sorted(losses) == list(range(1, 51))
    assert losses[3] == float(f"{loss_at(3):.6E}") and times[1] == 900.0 and times[4] == 41.0
    assert norms[7] == 1.5
    # the validation line ("lm loss value") is not a training iteration
    assert len(losses) == 50


def test_parse_log_line_with_rank_prefix_and_extra_fields():
    line = "[rank1]:" + training_log_line(12, 50, 6.5, 33.3).replace(
        " learning rate:", " throughput per GPU (TFLOP/s/GPU): 12.3 | learning rate:")
    losses, times, _, total = plt.parse_log(line)
    assert losses == {12: 6.5} and times == {12: 33.3} and total == 50


def test_all_equal_passes(tmp_path):
    for name in ("ep1-stock", "ep1-none", "ep1-ultraep"):
        write(tmp_path, name, make_log())
    proc = run_table(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = (tmp_path / "table.md").read_text()
    assert table == proc.stdout
    row = next(line for line in table.splitlines() if line.startswith("| ep1-ultraep "))
    assert "| 50/50 | 0.000e+00 | 50/50 |" in row and "| 1.00 | ok |" in row
    assert "| ep1-stock | 50/50 | – | (reference) |" in table
    # median over iterations > 5 skips the slow first iteration: 40 + (i % 3) -> 41.0
    assert "| 41.0 |" in row
    assert "No problems" in table


def test_mismatch_fails(tmp_path):
    write(tmp_path, "ep1-stock", make_log())
    write(tmp_path, "ep1-eplb", make_log(shift=3e-4, ms=60.0))
    proc = run_table(tmp_path)
    assert proc.returncode == 1
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| ep1-eplb "))
    assert "MISMATCH > 0.0001" in row and "| 10/50 |" in row  # iterations 1..10 equal, 11..50 shifted
    assert "3.000e-04" in row and "| 1.49 |" in row           # 61.0 / 41.0
    assert "ep1-eplb: lm loss differs from ep1-stock by 3.000e-04 > 0.0001" in proc.stdout
    # a looser tolerance accepts it, and the exact-equality count still shows the difference
    proc = run_table(tmp_path, "--tol", "1e-3")
    assert proc.returncode == 0 and "| 10/50 |" in proc.stdout


def test_small_difference_within_tolerance_is_reported_not_failed(tmp_path):
    write(tmp_path, "ep1-stock", make_log())
    write(tmp_path, "ep1-fsep", make_log(shift=2e-5, grad_shift=0.001))
    proc = run_table(tmp_path)
    assert proc.returncode == 0, proc.stdout
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| ep1-fsep "))
    assert "| 10/50 |" in row and "| ok |" in row and "1.000e-03" in row   # grad norm Δ shown


def test_failed_one_rank_run_fails_with_its_error(tmp_path):
    write(tmp_path, "ep1-stock", make_log())
    write(tmp_path, "ep1-lp", make_log(stop=7) + TRACEBACK, rc="1")
    proc = run_table(tmp_path)
    assert proc.returncode == 1
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| ep1-lp "))
    assert "| 7/50 |" in row
    assert "FAILED: RuntimeError: ProcessGroupGloo::alltoall_base: unsupported device type cuda" in row
    assert "* ep1-lp failed: RuntimeError" in proc.stdout


def test_truncated_log_without_rc_is_a_failure(tmp_path):
    write(tmp_path, "ep1-stock", make_log())
    write(tmp_path, "ep1-none", make_log(stop=20), rc=None)
    proc = run_table(tmp_path)
    assert proc.returncode == 1 and "| ep1-none | 20/50 |" in proc.stdout


def test_timeout_is_named(tmp_path):
    write(tmp_path, "ep1-stock", make_log())
    write(tmp_path, "ep1-fsep", make_log(stop=3), rc="124")
    proc = run_table(tmp_path)
    assert proc.returncode == 1 and "FAILED: timed out (exit 124)" in proc.stdout


def test_two_rank_failures_are_reported_but_do_not_fail(tmp_path):
    for name in ("ep1-stock", "ep1-none"):
        write(tmp_path, name, make_log())
    write(tmp_path, "ep2-stock", "> initializing torch distributed ...\n" + TRACEBACK, rc="1")
    write(tmp_path, "ep2-none", "skipped: ep2-stock failed (see ep2-stock.log)\n", rc="skipped")
    proc = run_table(tmp_path)
    assert proc.returncode == 0, proc.stdout
    assert "| ep2-stock | 0 |" in proc.stdout and "FAILED: RuntimeError: ProcessGroupGloo" in proc.stdout
    assert "FAILED: skipped: ep2-stock failed" in proc.stdout


def test_two_rank_mismatch_fails(tmp_path):
    write(tmp_path, "ep1-stock", make_log())
    write(tmp_path, "ep2-stock", make_log(iters=50))
    write(tmp_path, "ep2-ultraep", make_log(shift=0.5))
    proc = run_table(tmp_path)
    assert proc.returncode == 1 and "ep2-ultraep: lm loss differs from ep2-stock" in proc.stdout


def test_failed_stock_means_no_comparison(tmp_path):
    write(tmp_path, "ep1-stock", TRACEBACK, rc="1")
    write(tmp_path, "ep1-none", make_log())
    proc = run_table(tmp_path)
    assert proc.returncode == 1
    assert "* ep1-stock failed" in proc.stdout and "no stock to compare: ep1-stock failed" in proc.stdout


def test_empty_dir(tmp_path):
    proc = run_table(tmp_path)
    assert proc.returncode == 1 and "no <group>-<run>.log files" in proc.stderr


@pytest.mark.parametrize("text, rc, expected", [
    ("ok\nAssertionError: pipeline_model parallel group is not initialized\n", "1",
     "AssertionError: pipeline_model parallel group is not initialized"),
    ("usage: pretrain_gpt.py [-h]\nmegatron_rails.launch: error: --moe-balancer fsep replaces ...\n", "2",
     "megatron_rails.launch: error: --moe-balancer fsep replaces ..."),
    ("iteration 1\n", "137", "timed out (exit 137)"),
    ("", "1", "empty log (exit 1)"),
])
def test_last_error(text, rc, expected):
    assert plt.last_error(text, rc) == expected


def test_rerun_without_deterministic_mode_is_noted(tmp_path):
    write(tmp_path, "ep1-stock", make_log())
    write(tmp_path, "ep1-lp", make_log())
    (tmp_path / "ep1-lp.deterministic-error.txt").write_text("RuntimeError: x does not have a deterministic "
                                                            "implementation\n")
    proc = run_table(tmp_path)
    assert proc.returncode == 0
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| ep1-lp "))
    assert row.endswith("| ok (rerun without --deterministic-mode: an op had no deterministic kernel) |")


def test_strict_makes_every_failure_a_problem(tmp_path):
    # what the CPU check passes: there a multi-rank failure is no machine limit but a defect
    write(tmp_path, "ep2-stock", make_log())
    write(tmp_path, "ep2-fsep", make_log(stop=7) + TRACEBACK, rc="1")
    write(tmp_path, "ep2dist-ultraep", make_log())  # a group without its stock run
    assert run_table(tmp_path).returncode == 0
    proc = run_table(tmp_path, "--strict")
    assert proc.returncode == 1
    assert "* ep2-fsep failed: RuntimeError: ProcessGroupGloo::alltoall_base" in proc.stdout
    assert "* ep2dist: no stock run" in proc.stdout


def test_balance_column(tmp_path):
    def with_balance(before, after):
        values = iter(zip(before, after))
        lines = []
        for line in make_log(iters=len(before)).splitlines():
            if plt.ITER_RE.search(line):
                b, a = next(values)
                line = line.replace(" loss scale:", f" rails_max_over_mean_before: {b:.6E} | "
                                                    f"rails_max_over_mean_after: {a:.6E} | loss scale:")
            lines.append(line)
        return "\n".join(lines) + "\n"

    write(tmp_path, "ep2-stock", make_log(iters=5))
    # medians over iterations: before (1.1, 1.3, 1.2, 1.5, 1.4) -> 1.3, after (1.0, 1.02, 1.01, 1.0, 1.0) -> 1.0
    write(tmp_path, "ep2-ultraep", with_balance([1.1, 1.3, 1.2, 1.5, 1.4], [1.0, 1.02, 1.01, 1.0, 1.0]))
    proc = run_table(tmp_path)
    assert proc.returncode == 0, proc.stdout
    rows = {line.split(" | ")[0][2:]: line for line in proc.stdout.splitlines() if line.startswith("| ep2")}
    assert "| 1.300 → 1.000 |" in rows["ep2-ultraep"]
    assert rows["ep2-stock"].split(" | ")[5] == "–"  # no dispatcher figures in a stock log


def test_a_resume_that_trained_afresh_fails(tmp_path):
    write(tmp_path, "ep2ckpt-stock", make_log(iters=20))
    resumed = "\n".join(line for line in make_log(iters=20).splitlines()
                        if not (plt.ITER_RE.search(line) and int(plt.ITER_RE.search(line).group(1)) <= 10))
    write(tmp_path, "ep2ckpt-fsep_loads", resumed + "\n")
    assert run_table(tmp_path, "--strict").returncode == 0
    # iterations 1..20, equal to stock's: trained from scratch instead of loading the checkpoint
    write(tmp_path, "ep2ckpt-lp_loads", make_log(iters=20))
    proc = run_table(tmp_path, "--strict")
    assert proc.returncode == 1 and "ep2ckpt-lp_loads logged iteration 1: it did not resume" in proc.stdout
