"""Issue #16, output: the tables of `simulate run`, `simulate a2a` and `demo` fit 80 columns
(COLUMNS=80), their headers are distinct and non-empty, footnotes wrap; `--wide` shows every column."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_rails.core.policy import PolicyConfig

ROOT = Path(__file__).resolve().parents[1]
X7 = str(ROOT / "configs" / "mixtral" / "mixtral-8x7b.yaml")
CLI = [sys.executable, "-m", "megatron_rails.cli"]


def run80(*args, columns=80):
    env = dict(os.environ, COLUMNS=str(columns))
    p = subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


# piped (these tests' subprocesses, a StringIO) a table is drawn in sim/term.py's ASCII_BOX: the
# header rule of "=" and "+", cells split by "|"; on a terminal by ━ and │
RULE, BAR = "=", "|"


def headers(text: str) -> list[str]:
    """The column headers of the one table in `text`: header rows above the rule, cells split by the
    bar; a header's lines joined by a space."""
    lines = text.splitlines()
    rule = next(i for i, ln in enumerate(lines) if ln.startswith(RULE))
    rows = []
    for ln in lines[:rule][::-1]:  # header rows, bottom up, until the title
        if BAR not in ln:
            break
        rows.insert(0, [c.strip() for c in ln.split(BAR)])
    assert rows and len({len(r) for r in rows}) == 1, rows
    return [" ".join(r[i] for r in rows if r[i]) for i in range(len(rows[0]))]


def check_fits(text: str, width: int = 80) -> list[str]:
    long = [ln for ln in text.splitlines() if len(ln.encode()) > width]  # in bytes: as a log counts
    assert not long, long
    h = headers(text)
    assert all(h) and len(set(h)) == len(h), h
    return h


def test_simulate_run_fits_80_columns():
    p = run80("simulate", "run", X7, "--policies", "none,fsep,ultraep", "--comm", "direct,rails", "--steps", "1",
              "--quiet")
    h = check_fits(p.stdout)
    assert h[:4] == ["policy", "comm", "iter ms", "speedup"] and "max/mean" in h
    assert "ultraep" in p.stdout and "force-balanced ideal" in p.stdout
    # EP8 fits in one DGX node: the identical direct/rails rows are explained
    assert "direct and rails rows are the same" in " ".join(p.stdout.split())


@pytest.mark.parametrize("sizes", [["training.global_batch_size=65536"],
                                   ["training.global_batch_size=10000000", "model.num_layers=200", "--mfu", "0.001"],
                                   ["topology.nic_gbps=1e-300"]])  # the ideal's line too: 4.10e299 ms
def test_simulate_run_fits_80_columns_at_huge_times(sizes):
    """Iteration times of hours to years print compactly: no cell folds (a policy or comm cut over two
    rows), and the numbers read back as the JSON's within their shown digits."""

    argv = ["simulate", "run", X7, "--policies", "none,ultraep", "--comm", "direct,rails", "--steps", "1", "--quiet",
            *sizes]
    p = run80(*argv)
    check_fits(p.stdout)
    iteration = p.stdout.split("memory of the busiest GPU")[0]  # the memory table below has policy rows too
    body = [ln.split(BAR) for ln in iteration.splitlines() if BAR in ln and ln.split(BAR)[0].strip() in ("none",
                                                                                                         "ultraep")]
    assert len(body) == 4 and all(c[1].strip() in ("direct", "rails") for c in body), p.stdout
    res = json.loads(run80(*argv, "--json").stdout)
    want = {(r["policy"], r["comm"]): r["iteration_ms"] for r in res["rows"]}
    for c in body:
        shown = float(c[2])
        assert abs(shown - want[(c[0].strip(), c[1].strip())]) <= 0.006 * shown, (c, want)
    # the ideal's note below the table: the same compact numbers (a long one would only fold there)
    note = " ".join(p.stdout.split("force-balanced ideal")[1].split("iter ms =")[0].split())
    ideal = {r["comm"]: r["iteration_ms"] for r in res["force_balanced"]}
    shown = dict(re.findall(r"(direct|rails) (\S+) ms", note))
    assert set(shown) == set(ideal), note
    for comm, text in shown.items():
        assert len(text) <= 8 and abs(float(text) - ideal[comm]) <= 0.006 * float(text), (note, ideal)


def test_simulate_run_wide_and_topology_override():
    p = run80("simulate", "run", X7, "topology=dgx-a100", "--policies", "none,fsep", "--comm", "direct",
              "--steps", "1", "--quiet", "--wide")
    h = headers(p.stdout)
    assert {"iteration ms", "dense ms", "bubble ms", "of ideal", "plan us"} <= set(h) and len(set(h)) == len(h)
    title = " ".join(p.stdout.split(BAR)[0].split())
    assert "dgx-a100" in title and "dgx-h100" not in title
    assert "direct and rails rows" not in p.stdout  # only direct was asked for


def test_simulate_a2a_fits_80_columns():
    p = run80("simulate", "a2a", "--nodes", "8", "--tokens-per-rank", "512")
    h = check_fits(p.stdout)
    assert h[0] == "scheme" and "rail max/mean" in h and "bottleneck" in h
    assert all(s in p.stdout for s in ("direct", "ecmp", "rails"))
    wide = headers(run80("simulate", "a2a", "--nodes", "8", "--tokens-per-rank", "512", "--wide").stdout)
    assert {"phased us", "in-node", "hops"} <= set(wide)


def test_simulate_run_plot_wrote_line(tmp_path):
    png = tmp_path / "s.png"
    p = run80("simulate", "run", X7, "--policies", "none,ultraep", "--comm", "direct", "--steps", "2", "--quiet",
              "--json", "--plot", str(png))
    assert json.loads(p.stdout)["plot"] == str(png)  # stdout holds the JSON only
    assert f"wrote {png}" in p.stderr and png.stat().st_size > 10_000


def test_demo_report_fits_80_columns(capsys, monkeypatch):
    """The demo's table and notes (the training runs take a minute: the report is fed a summary here)."""
    from megatron_rails.demo.run import print_report

    monkeypatch.setenv("COLUMNS", "80")
    layer = {"max_over_mean_before": 1.807, "max_over_mean_after": 1.019, "token_bytes_per_step": 1.3e6,
             "weight_bytes_per_step": 15.7e6, "plan_us_p50": 596.0}
    summary = {"layers": [dict(layer, layer=i) for i in range(4)], "loss_max_abs_diff": 0.0,
               "loss_max_rel_diff": 3e-4, "loss_max_rel_diff_before_flip": 4e-8, "first_flip_step": 12,
               "routing_flips_per_step": [0] * 12 + [3] * 8, "routings_per_step": 16384, "loss_first": 5.9,
               "loss_last": 3.4, "step_ms_stock": 3408.0, "step_ms_policy": 3934.0}
    print_report(summary, "ultraep", "rails", 4, 2, 20, 4, True)
    out = capsys.readouterr().out
    h = check_fits(out)
    assert h == ["layer", "max/mean stock", "max/mean ultraep", "token MB/step", "weight MB/step", "plan us p50"]
    text = " ".join(out.split())
    assert "loss parity against stock" in text and "more weight bytes than token bytes" in text
    assert "the 12 steps before the first routing flip within 4.0e-08" in text and "24 of 327680" in text


def test_simulate_run_cross_node_fits_80_columns_with_the_dedup_note():
    """EP8 over two 4-GPU nodes: the footnote gives the inter-node token bytes without and with node
    dedup, wrapped at 80 columns like the rest."""
    p = run80("simulate", "run", X7, "topology.gpus_per_node=4", "topology.rails_per_node=4", "parallelism.nodes=8",
              "balancer.ranks_per_node=0", "--policies", "none,ultraep", "--comm", "direct,rails", "--steps", "1",
              "--quiet")
    check_fits(p.stdout)
    text = " ".join(p.stdout.split())
    assert "dedup on (priced)" in text and "without -> with dedup: none" in text and "ideal" in text
    assert "direct and rails rows are the same" not in text


def test_simulate_run_plot_legend(tmp_path):
    """Issue #16: the plot's legend names only what some bar shows (stock EP moves no weights), the
    parts from the top of the stack down, the comms' bar styles, and the force-balanced ideal as a
    labelled line with its value (one line for comms whose ideal is the same)."""
    from megatron_rails.config.run import load_run_config
    from megatron_rails.sim.model import Setup, SimOptions
    from megatron_rails.sim.report import plot
    from megatron_rails.sim.run import Workload, simulate_run

    setup = Setup.from_run_config(load_run_config(X7))
    res = simulate_run(setup, SimOptions(), "none", "direct,rails", 1, Workload(setup))
    labels = plot(res, str(tmp_path / "none.png"))
    assert labels[:5] == ["bubble", "planner", "token a2a", "experts", "dense"]  # no "weights": none moves none
    assert "comm direct" in labels and "comm rails" in labels
    ideal = [t for t in labels if t.startswith("force-balanced ideal")]
    assert len(ideal) == 1 and "(direct, rails)" in ideal[0] and ideal[0].endswith(" ms")
    res = simulate_run(setup, SimOptions(), "none,fsep", "direct", 1, Workload(setup))
    labels = plot(res, str(tmp_path / "fsep.png"))
    assert "weights" in labels and not any(t.startswith("comm ") for t in labels)
    assert (tmp_path / "fsep.png").stat().st_size > 10_000


def test_simulate_run_progress_lines_fit_80_columns():
    """stderr too: the opening line (config, layout, workload, dedup) wraps at the terminal's width."""
    p = run80("simulate", "run", X7, "topology.gpus_per_node=4", "topology.rails_per_node=4", "parallelism.nodes=8",
              "balancer.ranks_per_node=0", "--policies", "none", "--comm", "direct", "--steps", "1")
    lines = p.stderr.splitlines()
    assert lines and all(len(ln) <= 80 for ln in lines), lines
    head = " ".join(" ".join(lines[:-1]).split())  # the opening line, unwrapped; then the step line
    assert head.startswith("simulate run: ") and "EP8 on 2 node(s)" in head and head.endswith("dedup on"), head
    assert lines[-1].startswith("simulate run: step 1/1")


def test_soak_lines_fit_80_columns():
    """soak's progress and summary lines (stderr) wrap at 80 columns."""
    p = subprocess.run(CLI + ["soak", "--planner-calls", "20", "--steps", "0"], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "planner soak: 20 calls" in p.stderr
    assert max(map(len, p.stderr.splitlines())) <= 80, p.stderr
    assert p.stderr.splitlines()[0] == "soak: 20 planner calls per policy", p.stderr  # no "then 0 steps"


def test_config_lines_fit_80_columns(tmp_path):
    """config validate's OK line and config show's header and description wrap at 80 columns, for
    the checkout's absolute path (whose length depends on where it lies) and for a path longer than
    80 columns, which stays whole on a line of its own; the longest shipped descriptions wrap too."""
    deep = tmp_path / ("d" * 50) / ("e" * 50)
    deep.mkdir(parents=True)
    # relative (run80 runs in ROOT: the path shares its line with the text), absolute, and too long
    cases = ["configs/mixtral/mixtral-8x7b.yaml", str(ROOT / "configs/deepseek/deepseek-v3.yaml")]
    cases.append(str(deep / "mixtral-8x7b.yaml"))
    (deep / "mixtral-8x7b.yaml").write_text((ROOT / "configs/mixtral/mixtral-8x7b.yaml").read_text())
    assert len(cases[-1]) > 80

    def fits(text, lead):  # only the unbreakable path, on a line of its own, may pass 80 columns
        return all(len(ln) <= 80 or ln == lead for ln in text.splitlines())

    for path in cases:
        out = run80("config", "validate", path).stdout
        flat = " ".join(out.split())  # wrapped, nothing cut
        # the config names `balancer: default`: the line shows the default policy, whichever it is
        assert flat.startswith(f"OK {path} (run: ") and flat.endswith(f"balancer {PolicyConfig().policy})"), out
        first = f"OK {path}\n" if len(f"OK {path} (run:") > 80 else f"OK {path} (run:"
        assert out.startswith(first), out  # the path never broken: grep finds its line
        assert fits(out, f"OK {path}"), out
        shown = run80("config", "show", path, "balancer.policy=ultraep").stdout
        head = " ".join(w for ln in shown.splitlines() if ln.startswith("#") for w in ln[1:].split())
        assert head == f"{path} (run config, validated, with balancer.policy=ultraep)", shown
        assert shown.startswith(f"# {path}") and fits(shown, f"# {path}"), shown


def test_demo_planners_headers_are_whole():
    """demo --planners: every header whole (on two or three lines), the tables within 80 columns."""
    out = run80("demo", "--planners").stdout
    assert max(map(len, out.splitlines())) <= 80 and "…" not in out, out
    rule = next(i for i, ln in enumerate(out.splitlines()) if ln.startswith(RULE))
    head = out.splitlines()[1:rule]  # the first table's header rows, below its title
    words = " ".join(" ".join(c.split()) for ln in head for c in ln.split(BAR))
    assert all(w in words for w in ("max/mean", "before", "after", "bound", "cross-", "node", "tokens", "p99 us")), head


def test_numbers_are_never_cut_across_rows(monkeypatch):
    """A table narrower than its columns (simulate a2a's at 256 nodes, 80 columns): the text columns
    fold, every number stays on one row whole (sim/term.py's table, which every command's table is;
    before, `1218286.6` came out as `1218286` over `.6`)."""
    import io

    from rich.console import Console

    from megatron_rails.sim.term import table

    t = table("title", ["scheme", "a us", "b us", "c us", "d us", "e", "bottleneck"], left=("scheme", "bottleneck"))
    rows = [("direct", "1218286.6", "154488.5", "7.886", "1218286.6", "+698.2%", "nic_in[126,7]"),
            ("ecmp", "161120.4", "154488.5", "1.043", "161120.4", "+0.0%", "nic_in[126,6]")]
    for r in rows:
        t.add_row(*r)
    buf = io.StringIO()
    Console(file=buf, width=64, highlight=False).print(t)
    text = buf.getvalue()
    assert max(map(len, text.splitlines())) <= 64, text
    cells = {c.strip() for ln in text.splitlines() for c in ln.split("│")}
    assert all(n in cells for r in rows for n in r[1:6]), text
    # a terminal narrower than the numbers alone: the commands' console is widened, not cropped
    from megatron_rails.sim.term import console

    monkeypatch.setenv("COLUMNS", "30")
    buf = io.StringIO()
    console(t, file=buf).print(t)
    cells = {c.strip() for ln in buf.getvalue().splitlines() for c in ln.split(BAR)}
    assert all(n in cells for r in rows for n in r[1:6]), buf.getvalue()


# Issue #52: every command's human output (not --json, which has everything on one line) in lines of at
# most 80 characters. Piped, as here, a line is also at most 80 bytes: a log or `awk length` counts
# bytes, and the tables' box-drawing characters took 3 each (simulate run's rule: 76 columns, 228
# bytes). Not checked here: `config show --megatron-args` piped (one line for $(...)), `config docs`
# (the text of docs/configuration.md) and piped errors (one line each, for grep; on a terminal they
# wrap: test_terminal_output_fits_80_columns); the commands that train or time Megatron layers (seconds
# each) in the tests that run them anyway: demo and soak above, bench step in test_bench_step.py, bench
# dispatcher in test_cli.py. trace and bench local were checked by hand (2026-12-07: 76 and 79 columns).
EVERY_COMMAND = {
    "plan": ["plan", "--policy", "ultraep", "--budget", "0.05"],
    "plan lp DeepSeek-sized": ["plan", "--policy", "lp", "--ranks", "64", "--experts", "256", "--topk", "8",
                               "--slots", "2", "--budget", "0.05"],
    "simulate a2a": ["simulate", "a2a", "--nodes", "8", "--tokens-per-rank", "512"],
    "simulate a2a at 256 nodes": ["simulate", "a2a", "--nodes", "256", "--tokens-per-rank", "64"],
    "simulate a2a dedup both": ["simulate", "a2a", "--nodes", "4", "--tokens-per-rank", "256", "--dedup", "both"],
    "simulate run, the issue's": ["simulate", "run", "configs/mixtral/mixtral-8x7b.yaml"],
    "simulate run cross-node": ["simulate", "run", X7, "topology.gpus_per_node=4", "topology.rails_per_node=4",
                                "parallelism.nodes=8", "balancer.ranks_per_node=0", "--steps", "1"],
    "config validate": ["config", "validate", "configs/mixtral/mixtral-8x7b.yaml", "configs/policies/default.yaml",
                        "configs/topology/dgx-h100.yaml"],
    "config show": ["config", "show", "configs/deepseek/deepseek-v3.yaml"],
    "config show preset": ["config", "show", "dgx-h100"],
    "config show --get": ["config", "show", "configs/mixtral/mixtral-8x7b.yaml", "--get", "parallelism"],
    "demo --planners": ["demo", "--planners"],
    "simulate run --trace": ["simulate", "run", "configs/mini/mini-mixtral.yaml", "--trace", "trace.npy"],
    "config show policy": ["config", "show", "configs/policies/default.yaml"],
    "config show topology": ["config", "show", "nvl72"],
    "bench rails --quick": ["bench", "rails", "--quick", "--out", "rails.json"],
    "bench planners --quick": ["bench", "planners", "--quick", "--out", "planners.json"],
}


def too_long(text: str, width: int = 80) -> list[str]:
    return [ln for ln in text.splitlines() if len(ln) > width or len(ln.encode()) > width]


@pytest.mark.parametrize("name,columns", [(name, "80") for name in EVERY_COMMAND] +
                         [(name, None) for name in ("plan", "simulate run, the issue's", "demo --planners")])
def test_every_command_fits_80_columns_piped(name, columns, tmp_path):
    """stdout and stderr of every command piped, at COLUMNS=80 and, for a table of each kind, without
    COLUMNS (80 then); files it writes are named relative to its directory, as a user's usually are."""
    argv = EVERY_COMMAND[name]
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    if "--trace" in argv:  # counts [steps, layers, D, E] of mini-mixtral's shape (EP4, 8 experts, 2 layers)
        np.save(tmp_path / "trace.npy", np.random.default_rng(0).integers(0, 50, (2, 2, 4, 8)))
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | ({"COLUMNS": columns} if columns else {})
    p = subprocess.run(CLI + argv, capture_output=True, text=True, timeout=300, env=env,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip() or p.stderr.strip()
    assert not too_long(p.stdout) and not too_long(p.stderr), too_long(p.stdout) + too_long(p.stderr)
    assert "━" not in p.stdout and "│" not in p.stdout  # piped: ASCII rules


def on_terminal(argv: list[str], columns: int = 80) -> tuple[int, str]:
    """Run the command on a pseudo-terminal `columns` wide (and COLUMNS set to it): its exit status and
    what it printed, stdout and stderr together."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    main_fd, term_fd = pty.openpty()
    fcntl.ioctl(term_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = dict(os.environ, COLUMNS=str(columns), TERM="xterm")
    p = subprocess.Popen(CLI + argv, stdin=term_fd, stdout=term_fd, stderr=term_fd, env=env, cwd=ROOT)
    os.close(term_fd)
    out = b""
    while select.select([main_fd], [], [], 300)[0]:
        try:
            chunk = os.read(main_fd, 1 << 16)
        except OSError:  # EIO: the command exited and closed its end
            break
        if not chunk:
            break
        out += chunk
    os.close(main_fd)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode()).replace("\r\n", "\n")  # no colours, no CR
    return p.wait(timeout=60), text


def test_terminal_output_fits_80_columns():
    """On an 80-column terminal: the tables in box-drawing characters, one column each; an error wraps."""
    rc, text = on_terminal(["simulate", "run", "configs/mixtral/mixtral-8x7b.yaml", "--steps", "1"])
    assert rc == 0 and "━" in text and "│" in text, text
    assert max(map(len, text.splitlines())) <= 80, text
    rc, text = on_terminal(["simulate", "run", "configs/mixtral/mixtral-8x7b.yaml", "--policies", "none,bogus"])
    assert rc == 2 and text.startswith("megatron-rails simulate run: error: "), text
    assert len(text.splitlines()) > 1 and max(map(len, text.splitlines())) <= 80, text


def test_every_help_fits_80_columns():
    """Every command's --help (docs/cli.md's sections, as an 80-column terminal shows them)."""
    from megatron_rails.cli.main import build_parser
    from megatron_rails.cli.reference import _walk, generate

    blocks = re.findall(r"```text\n(.*?)\n```", generate(), re.S)
    assert len(blocks) == len(list(_walk(build_parser())))
    assert not [ln for b in blocks for ln in b.splitlines() if len(ln) > 80]
