"""`megatron-rails bench step`: refuses more ranks than cores in one line; a quick run writes every
(routing, policy) row with the issue's fields, and its figures hang together: `none` is its own
reference, the forced-balanced routing really is balanced, fsep fetches its slots once per step
(less than per-microbatch movement would send) and weights move only for balancing policies; its
progress on stderr is clean (no warnings) and 80 columns wide."""
import json
import os
import subprocess
import sys

CLI = [sys.executable, "-m", "megatron_rails.cli", "bench", "step"]
FIELDS = {"policy", "skew", "step_ms_p50", "ratio_vs_none", "of_ideal", "max_over_mean_after",
          "weight_bytes_per_step", "expert_bytes_per_rank"}


def test_more_ranks_than_cores_is_refused(tmp_path):
    # pinned to one core, so that 2 ranks (which divide the bench's 8 experts) are one too many on any machine
    one_core = sorted(os.sched_getaffinity(0))[0]
    p = subprocess.run(CLI + ["--out", str(tmp_path / "s.json"), "--ranks", "2"], capture_output=True,
                       text=True, timeout=120, preexec_fn=lambda: os.sched_setaffinity(0, {one_core}))
    assert p.returncode != 0 and "Traceback" not in p.stderr
    msg = p.stderr.strip().splitlines()[-1]
    assert "--ranks 2" in msg and "gives us 1 core and" in msg, p.stderr
    assert not (tmp_path / "s.json").exists()


def test_rounds_out_of_range_is_refused(tmp_path):
    p = subprocess.run(CLI + ["--out", str(tmp_path / "s.json"), "--rounds", "0"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "--rounds must be >= 1" in p.stderr.strip().splitlines()[-1], p.stderr


def test_quick_run_rows(tmp_path):
    out = tmp_path / "s.json"
    ranks = min(2, len(os.sched_getaffinity(0)))
    p = subprocess.run(CLI + ["--out", str(out), "--ranks", str(ranks), "--microbatches", "2", "--quick"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    # what the ranks and Megatron-Core's imports print stays out of the user's terminal; the progress
    # lines fit 80 columns
    assert "Warning" not in p.stderr and max(map(len, p.stderr.splitlines())) <= 80, p.stderr
    # the summary table too (stdout is a pipe here: 80 columns), one row per case
    assert max(map(len, p.stdout.splitlines())) <= 80, p.stdout
    assert sum(ln.startswith(("uniform ", "zipf:", "balanced ")) for ln in p.stdout.splitlines()) == 24, p.stdout
    res = json.loads(out.read_text())
    assert res["meta"]["reps"] == 1  # --quick: one timed round
    rows = {(r["skew"], r["policy"]): r for r in res["rows"]}
    skews = {"uniform", "zipf:1.2", "zipf:2.0", "balanced"}
    policies = {"none", "eplb", "ultraep", "lp", "fsep", "default"}
    assert set(rows) == {(s, p) for s in skews for p in policies}
    for r in rows.values():
        assert FIELDS <= set(r) and r["step_ms_p50"] > 0 and r["expert_bytes_per_rank"] > 0
        for name in ("ratio_vs_none", "of_ideal"):  # one round: its quartiles are the median
            assert r[f"{name}_q25"] == r[name] == r[f"{name}_q75"]
    for s in skews:
        assert rows[(s, "none")]["ratio_vs_none"] == 1.0 and rows[(s, "none")]["weight_bytes_per_step"] == 0
    assert rows[("balanced", "none")]["of_ideal"] == 1.0
    assert abs(rows[("balanced", "none")]["max_over_mean_after"] - 1.0) < 1e-9
    fsep = rows[("uniform", "fsep")]
    assert 0 < fsep["weight_bytes_per_step"] <= fsep["weight_bytes_per_step_if_per_microbatch"]
    assert os.path.exists(tmp_path / "s.png")
