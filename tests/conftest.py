"""Suite-wide settings.

CI runs the suite twice (.ci/run): all of it on the default Megatron-Core pin (0.19.2, with Triton),
then its Megatron-dependent part on 0.16.1. The second pass sets MEGATRON_RAILS_CORE_ONLY=1 and
skips the modules whose code paths do not touch Megatron-Core at all (planners, plan model,
workloads, rail schedule and simulator, configs, Slurm, CLI output and refusals), since the first
pass already ran them with the same package code, and the benchmark and soak smoke runs, whose
Megatron-Core use (building MoE layers through the adapter) the parity tests of the second pass
cover.

MEGATRON_RAILS_REQUIRE names the optional parts (tests/optional.py) whose tests must run, not skip.
Every run ends with its skips counted by reason, so one that should not happen shows in the log.
"""
import collections
import os

import pytest

import optional

VERSION_INDEPENDENT = [
    "test_plan.py", "test_planners.py", "test_ultraep.py", "test_lp.py", "test_workloads.py", "test_config.py",
    "test_rails_alltoall.py", "test_rails_sim.py", "test_runconfig.py", "test_sim_run.py", "test_slurm.py",
    "test_cli.py", "reliability/test_faults.py", "test_layers.py",
    # the framework-free runtime's parts, the compiled planners, CLI output and refusals, the
    # benchmarks' and soak's smoke runs, packaging and the test harness
    "test_bench_step.py", "test_cli_output.py", "test_cli_errors.py", "test_comm_errors.py", "test_dispatch_local.py",
    "test_eplb.py", "test_fsep_build.py", "test_fsep_kernel.py", "test_leave.py", "test_outfile.py",
    "test_pretrain_loss_table.py", "test_route_kernel.py", "test_sampling.py", "test_sim_dedup.py",
    "test_sim_dedup_model.py", "test_step_plans.py", "test_ultraep_kernel.py", "test_units.py", "test_install.py",
    "reliability/test_soak.py", "test_spawn_harness.py", "test_api_inputs_core.py", "test_api_inputs_sim.py",
    "test_config_megatron_asserts.py", "test_flow_kernel.py", "test_ci.py",
]
# Deselected tests: the launcher tests run Megatron-LM's call shapes against fake `megatron.training`
# modules (the same with either Megatron-Core version); and, to keep CI's two passes within the
# suite's time budget, parts of broader checks whose Megatron-Core calls other tests of the second pass
# make: the GPU check's CPU runs (MoE layers built through the adapter and trained over optimizer
# steps against stock, as in test_lifecycle.py and test_training.py; shared experts:
# test_dispatcher_configs.py), dedup's forward-only and direct cases (its parity with stock over the
# RailS exchange stays)
VERSION_INDEPENDENT_TESTS = (
    "tests/test_args.py::test_launcher", "tests/test_readme.py::", "tests/test_gpu_check.py::",
    "tests/test_dedup.py::test_dedup_on_off_same_forward_and_fewer_internode_bytes",
    "tests/test_dedup.py::test_parity_with_stock_dedup_on[direct]",
    # the pretrain check's shell logic (its CPU mapping of CUDA placements, which Megatron-Core's RNG
    # tracker takes part in, runs in both passes)
    "tests/test_pretrain_check.py::test_cpu_runs", "tests/test_pretrain_check.py::test_gpu_runs",
    "tests/test_pretrain_check.py::test_bad_device",
    # the kept host blocks' own rules (plain torch); their training against stock runs in both passes
    "tests/test_host_blocks.py::test_a_", "tests/test_host_blocks.py::test_small_",  # test_a_turn_ too
    "tests/test_host_blocks.py::test_at_most_",
)
CORE_ONLY = bool(os.environ.get("MEGATRON_RAILS_CORE_ONLY"))
collect_ignore = VERSION_INDEPENDENT if CORE_ONLY else []


def pytest_configure(config):
    unknown = sorted(optional.REQUIRED - set(optional.PARTS))
    if unknown:
        raise pytest.UsageError(f"MEGATRON_RAILS_REQUIRE: unknown part(s) {', '.join(unknown)} "
                                f"(known: {', '.join(optional.PARTS)})")


def pytest_collection_modifyitems(config, items):
    if not CORE_ONLY:
        return
    keep = [it for it in items if not it.nodeid.startswith(VERSION_INDEPENDENT_TESTS)]
    config.hook.pytest_deselected(items=[it for it in items if it not in keep])
    items[:] = keep


def pytest_report_header(config):
    lines = [f"MEGATRON_RAILS_REQUIRE: {' '.join(sorted(optional.REQUIRED)) or '(none)'} "
             f"(tests needing these fail where they would skip)"]
    if CORE_ONLY:
        lines.append(f"MEGATRON_RAILS_CORE_ONLY: not collecting version-independent modules "
                     f"(run in the default pass): {', '.join(VERSION_INDEPENDENT)}; deselected: "
                     f"{', '.join(t + '*' for t in VERSION_INDEPENDENT_TESTS)}")
    return lines


def pytest_terminal_summary(terminalreporter):
    """The run's skips, counted by reason (most first), with the modules they are in."""
    by_reason = collections.defaultdict(list)
    for rep in terminalreporter.stats.get("skipped", []):
        if isinstance(rep.longrepr, tuple):  # (path, line, "Skipped: reason")
            path, reason = rep.longrepr[0], rep.longrepr[2]
        else:
            path, reason = rep.nodeid, str(rep.longrepr)
        by_reason[reason.removeprefix("Skipped: ")].append(rep.nodeid.split("::")[0] or path)
    total = sum(map(len, by_reason.values()))
    terminalreporter.section(f"{total} skipped, by reason", sep="-")
    for reason, where in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        terminalreporter.line(f"{len(where):5d}  {reason}  [{', '.join(sorted(set(where)))}]")
