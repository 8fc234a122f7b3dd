"""Recording a run's routing (the policy key `trace`, `--rails-trace`): a 2-rank CPU training run with
SGD, routed by a named workload, recorded through the Python API and through the launcher's code
path (install_from_args, then Megatron-LM's save_checkpoint wrapped as the launcher wraps it) gives
a trace whose every row equals the counts the routers handed the dispatcher (computed here from the
workload's routing maps, independently of the dispatcher), with each row's optimizer step;
evaluation forwards and activation recompute add no row; a checkpoint save rewrites the file with
the rows so far; under pipeline parallelism each stage's first rank writes its own file. The trace
replays: `bench step`'s replayed workload and `simulate run`'s loader give back the same counts.
Bad paths and flags are one-line errors."""
import argparse

import numpy as np
import pytest
import torch

from moe_harness import spawn

SMALL = dict(layers=2, hidden=16, ffn=32, experts=8, topk=2, tokens=24)
MICRO, STEPS = 3, 3


def _want(workload, ranks, steps=STEPS, micro=MICRO, shape=SMALL):
    """int64 [steps x micro, layers, ranks, experts]: every router's routing map, counted here."""
    from megatron_rails.bench.step import SEED
    from megatron_rails.core.step_workloads import routing_for

    T, E, k, Y = shape["tokens"], shape["experts"], shape["topk"], shape["layers"]
    return np.array([[[np.bincount(routing_for(workload, SEED, s, m, y, d, T, E, k).ravel(), minlength=E)
                        for d in range(ranks)]
                      for y in range(Y)] for s in range(steps) for m in range(micro)], dtype=np.int64)


def _train(layers, xs, steps, first=0, evaluate=False, recompute=False):
    from megatron_rails.bench import step as bench

    opt = torch.optim.SGD(layers.parameters(), lr=0.05)
    for s in range(first, first + steps):
        bench.Clock.step = s
        for i, x in enumerate(xs):
            bench.Clock.micro = i
            with bench.no_sync() if i < len(xs) - 1 else torch.enable_grad():
                if recompute:  # reentrant recompute: the forward again inside the backward, a replay
                    out = torch.utils.checkpoint.checkpoint(bench._forward, layers, x.requires_grad_(True),
                                                            use_reentrant=True)
                else:
                    out = bench._forward(layers, x)
                out.pow(2).mean().backward()
        if evaluate:  # an evaluation forward between steps (eval mode, as Megatron's evaluate): never recorded
            layers.eval()
            with torch.no_grad():
                bench._forward(layers, xs[0])
            layers.train()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _python_api(rank, world, path, recompute):
    import torch.distributed as dist

    import megatron_rails
    from megatron_rails.bench import step as bench

    megatron_rails.install({"policy": "ultraep", "trace": path})
    try:
        layers = bench.build(world, SMALL, None, "rotating", rank)
    finally:
        megatron_rails.uninstall()
    _train(layers, bench._microbatches(rank, SMALL, MICRO), STEPS, evaluate=True, recompute=recompute)
    megatron_rails.close_traces()
    dist.barrier()


@pytest.mark.parametrize("recompute", [False, True])
def test_python_api_records_the_routers_counts(tmp_path, recompute):
    from megatron_rails.core.trace import load_trace

    path = tmp_path / "run.npz"
    spawn(_python_api, 2, str(path), recompute)
    counts, meta = load_trace(path)
    np.testing.assert_array_equal(counts, _want("rotating", 2))
    with np.load(path) as z:
        np.testing.assert_array_equal(z["step_I"], np.repeat(np.arange(STEPS), MICRO))
    assert (meta["steps"], meta["layers"], meta["ranks"], meta["experts"]) == (STEPS * MICRO, 2, 2, 8)
    assert meta["policy"] == "ultraep" and meta["topk"] == 2 and meta["tokens_per_rank"] == SMALL["tokens"]
    assert not list(tmp_path.glob(".*part")), "the part file outlives close_traces()"


def _launcher_path(rank, world, path):
    import torch.distributed as dist

    import megatron_rails
    from megatron_rails.bench import step as bench
    from megatron_rails.megatron import launch_hooks
    from megatron_rails.megatron.args import install_from_args

    args = argparse.Namespace(moe_balancer="fsep", moe_balancer_slots=None, moe_rails_comm=None, rails_config=None,
                              rails_trace=path, moe_token_dispatcher_type="alltoall", num_experts=8)
    assert install_from_args(args, quiet=True).trace == path
    try:
        layers = bench.build(world, SMALL, None, "burst", rank)
    finally:
        megatron_rails.uninstall()
    xs = bench._microbatches(rank, SMALL, MICRO)
    _train(layers, xs, 2)
    saved = []
    launch_hooks._flush_traces_after(lambda *a: saved.append(a))(2, "model")  # Megatron-LM's save_checkpoint
    assert saved == [(2, "model")]
    dist.barrier()
    if rank == 0:  # the checkpoint's trace: the rows so far, readable while the run goes on
        from megatron_rails.core.trace import load_trace

        np.testing.assert_array_equal(load_trace(path)[0], _want("burst", 2, steps=2))
    dist.barrier()
    _train(layers, xs, 1, first=2)
    megatron_rails.close_traces()
    dist.barrier()


def test_launcher_path_records_and_flushes_at_checkpoints(tmp_path):
    from megatron_rails.core.trace import load_trace

    path = tmp_path / "launch.npz"
    spawn(_launcher_path, 2, str(path))
    counts, meta = load_trace(path)
    np.testing.assert_array_equal(counts, _want("burst", 2))
    assert meta["policy"] == "fsep"


def _staged(rank, world, path):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import megatron_rails
    from megatron_rails.bench import step as bench

    ep_rank = dist.get_rank(ps.get_expert_model_parallel_group())
    megatron_rails.install({"policy": "none", "trace": path})
    try:
        layers = bench.build(2, SMALL, None, "hot-rank", ep_rank)
    finally:
        megatron_rails.uninstall()
    _train(layers, bench._microbatches(ep_rank, SMALL, MICRO), 1)
    megatron_rails.close_traces()
    dist.barrier()


def test_each_pipeline_stage_writes_its_own_file(tmp_path):
    from megatron_rails.core.trace import load_trace

    path = tmp_path / "pp.npz"
    spawn(_staged, 4, str(path), ep=2, parallel={"pipeline_model_parallel_size": 2})
    want = _want("hot-rank", 2, steps=1)
    for p in (path, tmp_path / "pp.stage1.npz"):
        np.testing.assert_array_equal(load_trace(p)[0], want)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["pp.npz", "pp.stage1.npz"]  # one writer per stage


def test_replay_gives_back_the_recorded_counts(tmp_path):
    """bench step --trace routes each (step, microbatch, layer, rank) by the trace's row: at the trace's
    own tokens per rank the replayed routing maps count exactly the recorded counts (simulate run
    --trace reads the file with load_trace, as here)."""
    from megatron_rails.bench.step import load_step_trace
    from megatron_rails.core.step_workloads import TRACE, routing_for, use_trace
    from megatron_rails.core.trace import TraceStream, load_trace

    rng = np.random.default_rng(3)
    T, E, k, D, Y = 64, 8, 2, 2, 2
    rows = []
    for _ in range(2 * MICRO):
        row = np.zeros((Y, D, E), np.int64)
        for y in range(Y):
            for d in range(D):
                picks = np.argsort(rng.random((T, E)) + np.arange(E) * 0.05 * y, axis=1)[:, :k]
                row[y, d] = np.bincount(picks.ravel(), minlength=E)
        rows.append(row)
    stream = TraceStream(tmp_path / "r.npz", {"topk": k})
    for i, row in enumerate(rows):
        stream.append(row, i // MICRO)
    stream.close()
    counts = load_trace(tmp_path / "r.npz")[0]
    np.testing.assert_array_equal(counts, np.stack(rows))
    use_trace(counts, E, MICRO)
    for s in range(2):
        for m in range(MICRO):
            for y in range(Y):
                for d in range(D):
                    got = np.bincount(routing_for(TRACE, 0, s, m, y, d, T, E, k).ravel(), minlength=E)
                    np.testing.assert_array_equal(got, counts[s * MICRO + m, y, d])
    np.testing.assert_array_equal(load_step_trace(str(tmp_path / "r.npz")), counts)  # bench step --trace's reader


def test_stream_writes_rows_as_they_come_and_refuses_bad_ones(tmp_path):
    from megatron_rails.core.trace import TraceError, TraceStream, load_trace

    s = TraceStream(tmp_path / "s.npz")
    assert s.flush() is None and not (tmp_path / "s.npz").exists()  # nothing before the first row
    part = tmp_path / ".s.npz.part"
    s.append(np.ones((1, 2, 4), np.int64), 0)
    s.flush()
    size = part.stat().st_size
    assert size == 8 * (1 + 8)  # the step, then the row: a row on disk per row recorded
    np.testing.assert_array_equal(load_trace(tmp_path / "s.npz")[0], np.ones((1, 1, 2, 4)))
    with pytest.raises(TraceError, match=r"row 1 has shape \(1, 2, 5\)"):
        s.append(np.ones((1, 2, 5), np.int64), 0)
    with pytest.raises(TraceError, match="non-negative integer"):
        s.append(-np.ones((1, 2, 4), np.int64), 0)
    s.close()
    assert not part.exists() and s.close() is None
    for bad, says in ((tmp_path / "x.npy", "a recorded trace is a .npz"),
                      (tmp_path / "no" / "x.npz", "does not exist")):
        with pytest.raises(TraceError, match=says):
            TraceStream(bad)


@pytest.mark.parametrize("argv,says", [
    (["--moe-balancer", "ultraep", "--rails-trace", "t.txt"], "expected a .npz file"),
    (["--moe-balancer", "ultraep", "--rails-trace", "/no/such/dir/t.npz"], "does not exist"),
    (["--rails-trace", "t.npz"], "--rails-trace given without --moe-balancer or --rails-config"),
])
def test_bad_trace_flags_are_one_line(argv, says):
    from megatron_rails.core.policy import ConfigError
    from megatron_rails.megatron.args import check_flags

    with pytest.raises(ConfigError, match=says) as err:
        check_flags(argv)
    assert "\n" not in str(err.value)


def test_rails_trace_flag_sets_the_policy_key(tmp_path):
    from megatron_rails.megatron.args import check_flags

    path = str(tmp_path / "t.npz")
    assert check_flags(["--moe-balancer", "none", "--rails-trace", path]).trace == path
    assert check_flags(["--moe-balancer", "none"]).trace == ""


@pytest.mark.parametrize("value", ["t.npy", "t", 5, None])
def test_policy_trace_key_refuses_what_is_no_npz_path(value):
    from megatron_rails.core.policy import ConfigError, PolicyConfig

    with pytest.raises(ConfigError, match="trace: expected the path of a .npz file"):
        PolicyConfig(trace=value)
    assert PolicyConfig(trace="a/b.NPZ").trace == "a/b.NPZ"
