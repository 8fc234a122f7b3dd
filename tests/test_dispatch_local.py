"""The dispatcher's local work (dispatcher.order_pairs / sum_pairs / receive_order / segment_order)
against direct single-process references: the routed pairs, per-token sums in float64, and the
received rows labelled with their (source, slot) from the plan's route."""
import json

import numpy as np
import pytest
import torch

from megatron_rails.bench.local import bench_local, markdown_table
from megatron_rails.core.policy import PolicyConfig
from megatron_rails.runtime import receive as receive_mod
from megatron_rails.runtime.local import order_pairs, order_pairs_on_device, pairs_per_token_range, sum_pairs, token_rows
from megatron_rails.runtime.receive import MAX_RUNS, Runs, receive_order, rows, rows_back
from megatron_rails.runtime.staging import segment_order
from megatron_rails.core.planners import make_planner

import optional

POLICIES = ["none", "eplb", "ultraep", "lp", "fsep"]
D, E = 4, 8


def _routing(rng, T, k):
    """k > 0: top-k (every token k experts); k = 0: a random number of experts per token, zero included."""
    if k:
        logits = rng.standard_normal((T, E)) + np.log(1.0 / np.arange(1, E + 1)) * rng.uniform(0, 2)
        top = np.argsort(-logits, axis=1)[:, :k]
        rmap = np.zeros((T, E), dtype=bool)
        np.put_along_axis(rmap, top, True, axis=1)
    else:
        rmap = rng.random((T, E)) < rng.uniform(0.05, 0.5)
    probs = np.where(rmap, rng.random((T, E)), 0.0)
    return torch.from_numpy(rmap), torch.from_numpy(probs)


def _plan(rng, policy, rmap, me):
    counts = rng.integers(0, 3 * max(1, rmap.shape[0]), size=(D, E)).astype(np.int64)
    counts[me] = rmap.sum(dim=0).numpy()
    cfg = PolicyConfig(policy=policy, slots=2, ranks_per_node=2).planner_config(D, E)
    planner = make_planner(policy, cfg)
    plan, _ = planner.plan(counts, planner.initial_state())
    return plan


def test_segment_order_against_concatenated_runs():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = rng.integers(0, 6, size=rng.integers(0, 12))
        seg = rng.permutation(n.size)
        stream = np.repeat(np.arange(n.size), n)
        ref = np.concatenate([np.flatnonzero(stream == i) for i in seg] + [np.zeros(0, dtype=np.int64)])
        assert np.array_equal(segment_order(n, seg), ref)


@pytest.mark.parametrize("policy", POLICIES)
def test_order_pairs_and_sum_pairs(policy):
    rng = np.random.default_rng(POLICIES.index(policy))
    for it in range(40):
        T = int(rng.integers(0, 40))
        k = [0, 1, 2, 3, E][it % 5]  # E: every expert (by_token then whole rows)
        rmap, probs = _routing(rng, T, k)
        me = int(rng.integers(D))
        plan = _plan(rng, policy, rmap, me)
        so = order_pairs(plan, me, rmap, probs)
        # exactly the routed (token, prob) pairs, split as the plan says
        want = sorted((int(t), float(probs[t, e])) for t, e in zip(*np.nonzero(rmap.numpy())))
        assert sorted(zip(so.token_P.tolist(), so.probs_P.tolist())) == want
        assert so.send_D == plan.send_DD[me].tolist() and so.recv_D == plan.send_DD[:, me].tolist()
        # the send order, pair by pair: the stock (expert-major, token-minor) pairs take the route's
        # runs in turn, then a stable sort by (destination rank, slot)
        ptr, rep_M, tok_M = plan.route
        rep_P = np.repeat(rep_M[ptr[me]:ptr[me + 1]], tok_M[ptr[me]:ptr[me + 1]])
        e_P, t_P = np.nonzero(rmap.numpy().T)
        ref_order = np.lexsort((plan.placement.replica_slot_R[rep_P], plan.placement.replica_rank_R[rep_P]))
        assert so.token_P.tolist() == t_P[ref_order].tolist()
        # per-token sums against float64 loops, on the reduction path and the scattered-add path
        y = torch.randn(so.token_P.numel(), 5, dtype=torch.float64)
        ref = np.zeros((T, 5))
        for i, t in enumerate(so.token_P.tolist()):
            ref[t] += y[i].numpy()
        uniform = T > 0 and bool((rmap.sum(dim=1) == rmap.sum(dim=1)[0]).all()) and rmap.any()
        assert (so.by_token is not None) == uniform
        # the order made on the device (no sync), told what pairs_per_token_range's gather says:
        # the same tensors, and the same host-side destinations
        lo, hi = pairs_per_token_range(rmap).tolist()
        dev = order_pairs_on_device(plan, me, rmap, probs, uniform=lo == hi)
        assert torch.equal(dev.token_P, so.token_P) and torch.equal(dev.probs_P, so.probs_P)
        assert (dev.by_token is None) == (so.by_token is None)
        assert dev.by_token is None or torch.equal(dev.by_token, so.by_token)
        assert (dev.send_D, dev.recv_D, dev.k) == (so.send_D, so.recv_D, so.k)
        assert np.array_equal(dev.dest_P, so.dest_P) and np.array_equal(dev.slot_P, so.slot_P)
        np.testing.assert_allclose(sum_pairs(y, so, T).numpy(), ref, rtol=1e-12, atol=1e-12)
        so.by_token = None
        np.testing.assert_allclose(sum_pairs(y, so, T).numpy(), ref, rtol=1e-12, atol=1e-12)


def same_order(a, b) -> bool:
    """Two receive orders (Runs, permutation tensors or None) are the same reordering."""
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, Runs) or isinstance(b, Runs):
        return a == b
    return torch.equal(a, b)


@pytest.mark.parametrize("max_runs", [MAX_RUNS, 0])
@pytest.mark.parametrize("policy", POLICIES)
def test_receive_order_groups_rows_by_slot(policy, max_runs, monkeypatch):
    """By runs (split + cat) or, beyond MAX_RUNS runs, by a permutation: the same grouping."""
    monkeypatch.setattr(receive_mod, "MAX_RUNS", max_runs)
    rng = np.random.default_rng(7 + POLICIES.index(policy))
    for _ in range(40):
        rmap, _ = _routing(rng, int(rng.integers(1, 40)), int(rng.integers(0, 3)))
        me = int(rng.integers(D))
        plan = _plan(rng, policy, rmap, me)
        p = plan.placement
        ptr, rep_M, tok_M = plan.route
        # label every received row with (source, slot): rows arrive source-major, slot-minor
        labels = []
        for src in range(D):
            runs = [(int(p.replica_slot_R[r]), int(n)) for r, n in zip(rep_M[ptr[src]:ptr[src + 1]],
                                                                       tok_M[ptr[src]:ptr[src + 1]])
                    if p.replica_rank_R[r] == me]
            for slot, n in sorted(runs, key=lambda sn: sn[0]):
                labels += [(src, slot)] * n
        x = torch.tensor([s * 1000 + d for d, s in labels], dtype=torch.int64)
        order, inverse, per_slot = receive_order(plan, me, torch.device("cpu"))
        assert order is None or isinstance(order, Runs) == bool(max_runs)
        grouped = rows(x, order)
        assert np.array_equal(per_slot, np.bincount([s for _, s in labels], minlength=p.slots_per_rank))
        # slot-major, source order kept within a slot
        assert grouped.tolist() == sorted(x.tolist(), key=lambda v: (v // 1000, v % 1000))
        assert torch.equal(rows(grouped, inverse), x)
        already = x.tolist() == sorted(x.tolist(), key=lambda v: (v // 1000, v % 1000))
        assert (order is None) == already  # a permutation only where the rows need one


@pytest.mark.parametrize("max_runs", [MAX_RUNS, 0])
def test_compiled_host_tables_match_numpy(max_runs, monkeypatch):
    """The Triton send order's host side compiled (core/_route_c.c rank_tables) against its numpy
    definition: the staged table, sizes, runs in send order, split sizes and the receive order, every
    policy (beyond MAX_RUNS runs the receive order is a permutation on both)."""
    from megatron_rails.runtime.local import _RANK_TABLES, _host_tables, _host_tables_numpy

    if _RANK_TABLES is None:
        pytest.skip("core/_route_c.c is not built here (or MEGATRON_RAILS_PURE_PYTHON is set)")
    monkeypatch.setattr(receive_mod, "MAX_RUNS", max_runs)
    rng = np.random.default_rng(21)
    for policy in POLICIES:
        for it in range(30):
            rmap, _ = _routing(rng, int(rng.integers(0, 40)), int(rng.integers(0, 3)))
            me = int(rng.integers(D))
            plan = _plan(rng, policy, rmap, me)
            for receive in (True, False):
                a = _host_tables(plan, me, E, torch.device("cpu"), receive)
                b = _host_tables_numpy(plan, me, E, torch.device("cpu"), receive)
                assert torch.equal(a.staged, b.staged), (policy, it)
                assert (a.M, a.runs_max, a.P, a.send_D) == (b.M, b.runs_max, b.P, b.send_D), (policy, it)
                for x, y in ((a.pairs.dest_M, b.pairs.dest_M), (a.pairs.slot_M, b.pairs.slot_M),
                             (a.pairs.n_M, b.pairs.n_M)):
                    assert np.array_equal(x, y), (policy, it)
                if receive:
                    ao, bo = a.receive[0], b.receive[0]
                    assert (np.array_equal(ao, bo) if isinstance(bo, np.ndarray) else ao == bo), (policy, it)
                    assert np.array_equal(a.receive[1], b.receive[1])
                else:
                    assert a.receive is None and b.receive is None


@pytest.mark.parametrize("path", ["host", "device"])
def test_send_order_brings_the_receive_order_along(path, monkeypatch):
    """send_order(receive=True) carries receive_order's result, whichever path makes the send order."""
    from megatron_rails.runtime.local import send_order

    monkeypatch.setenv("MEGATRON_RAILS_SEND_ORDER", path)
    rng = np.random.default_rng(13)
    for policy in POLICIES:
        for _ in range(8):
            rmap, probs = _routing(rng, int(rng.integers(0, 30)), int(rng.integers(0, 3)))
            me = int(rng.integers(D))
            plan = _plan(rng, policy, rmap, me)
            got = send_order(plan, me, rmap, probs, uniform=False, receive=True).receive
            want = receive_order(plan, me, torch.device("cpu"))
            for g, w in zip(got[:2], want[:2]):
                assert same_order(g, w)
            assert np.array_equal(got[2], want[2])


def test_a_triton_kernel_that_fails_on_first_use_leaves_the_send_order_to_torch(monkeypatch):
    """Triton importable but its kernel cannot be built here (no compiler for the GPU, say): one
    RuntimeWarning, the send order from torch ops (the same tensors), and no second try. Any other
    error is raised; asked for by name ($MEGATRON_RAILS_SEND_ORDER=triton), the build error too."""
    from megatron_rails.runtime import local, local_triton

    def broken(*args, **kwargs):
        raise local_triton.KernelUnavailable("PTX assembly failed") from RuntimeError("PTX assembly failed\n(details)")

    def bad_data(*args, **kwargs):
        raise IndexError("index out of range")

    monkeypatch.delenv("MEGATRON_RAILS_SEND_ORDER", raising=False)
    monkeypatch.setattr(local, "_TRITON_BROKEN", [])
    monkeypatch.setattr(local_triton, "available", lambda: True)
    rng = np.random.default_rng(21)
    rmap, probs = _routing(rng, 24, 2)
    plan = _plan(rng, "ultraep", rmap, 1)
    real_path = local.send_order_path
    monkeypatch.setattr(local, "send_order_path", lambda m: "triton" if not local._TRITON_BROKEN else real_path(m))
    monkeypatch.setattr(local_triton, "send_order_tensors", bad_data)
    with pytest.raises(IndexError):
        local.send_order(plan, 1, rmap, probs, uniform=True)
    assert not local._TRITON_BROKEN
    monkeypatch.setattr(local_triton, "send_order_tensors", broken)
    with pytest.warns(RuntimeWarning, match="Triton send-order kernel failed on first use .RuntimeError: PTX"):
        got = local.send_order(plan, 1, rmap, probs, uniform=True)
    want = order_pairs(plan, 1, rmap, probs, uniform=True)
    assert torch.equal(got.token_P, want.token_P) and torch.equal(got.by_token, want.by_token)
    assert len(local._TRITON_BROKEN) == 1 and local.send_order_path(rmap) == "host"  # CPU map
    monkeypatch.setattr(local, "_TRITON_BROKEN", [])
    monkeypatch.setenv("MEGATRON_RAILS_SEND_ORDER", "triton")
    with pytest.raises(RuntimeError, match="PTX assembly failed"):
        local.send_order(plan, 1, rmap, probs, uniform=True)


def test_only_the_kernels_first_launch_counts_as_unavailable(monkeypatch):
    """local_triton wraps a failing first launch as KernelUnavailable (its cause kept); once a
    launch went through, errors are the caller's, and out-of-memory is never the kernel's."""
    optional.import_triton()
    from megatron_rails.runtime import local_triton

    calls = []

    class Launcher:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append(grid)
                if len(calls) in (1, 3):
                    raise RuntimeError("compile failed")
                if len(calls) == 4:
                    raise torch.OutOfMemoryError("out of memory")
            return launch

    monkeypatch.setattr(local_triton, "_kernel", lambda: Launcher())
    monkeypatch.setattr(local_triton, "_LAUNCHED", [])
    rmap = torch.zeros(4, 3, dtype=torch.bool)
    table = torch.zeros(4 + 3, dtype=torch.int64)
    with pytest.raises(local_triton.KernelUnavailable, match="compile failed") as info:
        local_triton.send_order_tensors(rmap, table, 1, 1, 0, 0)
    assert isinstance(info.value.__cause__, RuntimeError)
    local_triton.send_order_tensors(rmap, table, 1, 1, 0, 0)  # goes through: launched from now on
    with pytest.raises(RuntimeError, match="compile failed") as info:
        local_triton.send_order_tensors(rmap, table, 1, 1, 0, 0)
    assert not isinstance(info.value, local_triton.KernelUnavailable)
    monkeypatch.setattr(local_triton, "_LAUNCHED", [])
    with pytest.raises(torch.OutOfMemoryError):
        local_triton.send_order_tensors(rmap, table, 1, 1, 0, 0)


def test_rows_with_inverse_backward_equals_advanced_indexing():
    """rows(x, order, inverse) differentiates by a gather; autograd's own x[order] is the reference."""
    rng = np.random.default_rng(3)
    for n in (0, 1, 7, 50):
        order = torch.from_numpy(rng.permutation(n))
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(n)
        x = torch.randn(n, 5, dtype=torch.float64, requires_grad=True)
        w = torch.randn(n, 5, dtype=torch.float64)
        (rows(x, order, inverse) * w).sum().backward()
        ours = x.grad.clone()
        x.grad = None
        (x[order] * w).sum().backward()
        assert torch.equal(rows(x, order, inverse), x[order]) and torch.equal(ours, x.grad)


@pytest.mark.parametrize("kind", ["permutation", "subset", "repeats"])
def test_shard_rows_scatter_sums_gradients_into_their_rows(kind):
    """The FSEP exchange's shard-row gradients back onto [E, ...]: a dense float64 loop is the reference."""
    from megatron_rails.runtime.sharded import _ShardRows

    rng = np.random.default_rng(11)
    for _ in range(20):
        n_E = 9
        taken = {"permutation": rng.permutation(n_E), "subset": rng.permutation(n_E)[:rng.integers(0, n_E)],
                 "repeats": rng.integers(0, n_E, size=rng.integers(1, 3 * n_E))}[kind]
        sr = _ShardRows(taken, n_E, torch.device("cpu"))
        assert (sr.inverse is not None) == (kind == "permutation")
        g = torch.randn(taken.size, 4, dtype=torch.float64)
        ref = torch.zeros(n_E, 4, dtype=torch.float64)
        for i, e in enumerate(taken):
            ref[e] += g[i]
        assert torch.equal(sr.rows, torch.from_numpy(taken.astype(np.int64)))
        assert torch.allclose(sr.scatter(g), ref, rtol=0, atol=1e-12)


def test_bench_local_runs_and_checks_the_send_order(tmp_path):
    out = tmp_path / "local.json"
    res = bench_local(str(out), shape_name="tiny", reps=2)
    assert out.exists()
    assert {(r["policy"], r["skew"]) for r in res["rows"]} == {(p, s) for p in POLICIES for s in ("uniform", "zipf:1.2")}
    for r in res["rows"]:
        assert r["pairs_sent"] == 256 * 2 and r["local_us_p50"] > 0 and r["megatron_local_us_p50"] > 0
        if r["skew"] != "uniform" and r["policy"] != "none":  # balancing shrinks the busiest rank's rows
            assert r["rows_received"] < r["rows_received_stock"]
        elif r["policy"] != "eplb":  # eplb splits an expert's tokens evenly over its replicas, not exactly
            assert r["rows_received"] <= r["rows_received_stock"]
    # the targets read off the rows (each limit against each row's own ratio), and one table line per row
    for skew, limit in (("uniform", 1.2), ("zipf:1.2", 1.6)):
        assert res["targets"][f"{skew}_ratio_le_{limit}"] == {r["policy"]: r["ratio_vs_megatron"] <= limit
                                                               for r in res["rows"] if r["skew"] == skew}
    assert json.loads(out.read_text())["targets"] == res["targets"]
    table = markdown_table(res["rows"]).splitlines()
    assert len(table) == 2 + len(res["rows"]) and all(line.count("|") == 11 for line in table)


def test_collective_device_follows_the_backend(monkeypatch):
    """Bookkeeping tensors of a collective go where the backend takes them: CUDA under NCCL alone."""
    import megatron_rails.runtime.comm.base as comm

    monkeypatch.setattr(comm.torch.cuda, "current_device", lambda: 3)
    for backend, want in (("nccl", torch.device("cuda", 3)), ("gloo", torch.device("cpu")),
                          ("cpu:gloo,cuda:nccl", torch.device("cpu"))):
        monkeypatch.setattr(comm.dist, "get_backend", lambda group, b=backend: b)
        assert comm.collective_device(None) == want


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rows_back_against_concatenate_then_gather(dtype):
    """rows_back puts the slot-ordered parts back in received order, as cat + a gather by the
    inverse permutation would, and its backward gives every part (a zero-row one too) the gradient
    the reference's autograd does; rows whose bytes make 8-byte words (float32, bf16 at even widths)
    are written as words, odd widths as themselves. Without an order, parts are concatenated, and a
    lone part with rows is the result itself."""
    rng = np.random.default_rng(5)
    for it in range(40):
        sizes = [int(n) for n in rng.integers(0, 6, size=rng.integers(1, 5))]
        if it % 4 == 0:  # one part holds every row, zero-row parts (anchors) beside it
            sizes = [0] * len(sizes)
            sizes[int(rng.integers(len(sizes)))] = int(rng.integers(1, 6))
        H = [3, 4, 8][it % 3]
        Q = sum(sizes)
        order = torch.from_numpy(rng.permutation(Q))
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(Q)
        # every third case: parts cut from a wider buffer (a one- or zero-row slice there keeps the
        # wide row stride, which a word view must not take)
        parts = [(torch.randn(n, H + 2, dtype=torch.float64).to(dtype)[:, :H] if it % 3 == 1 else
                  torch.randn(n, H, dtype=torch.float64).to(dtype)).requires_grad_() for n in sizes]
        w = torch.randn(Q, H, dtype=torch.float64).to(dtype)
        for got, ref in ((rows_back(parts, order), torch.cat(parts)[inverse]), (rows_back(parts, None), torch.cat(parts))):
            assert torch.equal(got, ref)
            want = torch.autograd.grad((ref * w).sum(), parts)
            have = torch.autograd.grad((got * w).sum(), parts)
            assert all(torch.equal(a, b) for a, b in zip(have, want))
        if sum(1 for n in sizes if n) == 1:
            lone = next(p for p in parts if p.shape[0])
            assert rows_back(parts, None).data_ptr() == lone.data_ptr()  # nothing copied


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_runs_reorder_and_put_back_against_a_gather(dtype):
    """rows(x, runs) equals a gather by the runs' permutation (segment_order), rows_back undoes it
    from parts cut at run boundaries (a zero-row part among them), and both backwards give the
    gradients autograd of the gathers gives."""
    rng = np.random.default_rng(9)
    for it in range(60):
        n_runs = int(rng.integers(1, 9))
        sizes = rng.integers(1, 5, n_runs)
        take = rng.permutation(n_runs)
        runs = Runs(tuple(sizes.tolist()), tuple(take.tolist()))
        perm = torch.from_numpy(segment_order(sizes, take))
        Q = int(sizes.sum())
        x = torch.randn(Q, 3, dtype=torch.float64).to(dtype).requires_grad_()
        w = torch.randn(Q, 3, dtype=torch.float64).to(dtype)
        got, ref = rows(x, runs), x[perm]
        assert torch.equal(got, ref)
        assert torch.equal(*(torch.autograd.grad((r * w).sum(), x)[0] for r in (got, ref)))
        assert torch.equal(rows(x.detach(), runs), ref)
        # parts of the slot-ordered rows at run boundaries, a zero-row part (an anchor) at the end
        cut = sorted(rng.choice(np.arange(1, n_runs), size=int(rng.integers(0, n_runs)), replace=False).tolist()) \
            if n_runs > 1 else []
        ends = np.cumsum([runs.sizes[i] for i in runs.take])
        bounds = [0] + [int(ends[c - 1]) for c in cut] + [Q]
        y = torch.randn(Q, 3, dtype=torch.float64).to(dtype)
        parts = [y[a:b].clone().requires_grad_() for a, b in zip(bounds[:-1], bounds[1:])]
        parts.append(torch.zeros(0, 3, dtype=dtype, requires_grad=True))
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(Q)
        got, ref = rows_back(parts, runs), torch.cat(parts)[inv]
        assert torch.equal(got, ref) and torch.equal(rows_back([p.detach() for p in parts], runs), ref)
        have, want = (torch.autograd.grad((r * w).sum(), parts) for r in (got, ref))
        assert all(torch.equal(a, b) for a, b in zip(have, want))


def _uniform_order(rng, policy, T, k):
    rmap, probs = _routing(rng, T, k)
    me = int(rng.integers(D))
    return order_pairs(_plan(rng, policy, rmap, me), me, rmap, probs, uniform=True), rmap


@pytest.mark.parametrize("k", [1, 2, 3, E])
def test_sum_pairs_and_token_rows_gradients_against_autograd_of_indexing(k):
    """Where every token has k pairs, the combine's sum and the dispatch's row gather differentiate
    by gathers and a [k, T, H] sum; autograd through scatter-add / advanced indexing in float64 is
    the reference, values and gradients."""
    rng = np.random.default_rng(k)
    for policy in ("none", "fsep"):
        so, _ = _uniform_order(rng, policy, int(rng.integers(1, 30)), k)
        T, P = so.by_token.numel() // k, so.token_P.numel()
        x = torch.randn(T, 6, dtype=torch.float64, requires_grad=True)
        y = torch.randn(P, 6, dtype=torch.float64, requires_grad=True)
        w_P, w_T = torch.randn(P, 6, dtype=torch.float64), torch.randn(T, 6, dtype=torch.float64)
        got_x, ref_x = token_rows(x, so), x[so.token_P]
        assert torch.equal(got_x, ref_x)
        torch.testing.assert_close(*(torch.autograd.grad((r * w_P).sum(), x)[0] for r in (got_x, ref_x)),
                                   rtol=1e-12, atol=1e-12)  # k > 2: summed in another order
        got_y = sum_pairs(y, so, T)
        ref_y = torch.zeros(T, 6, dtype=torch.float64).index_add(0, so.token_P, y)
        torch.testing.assert_close(got_y, ref_y, rtol=1e-12, atol=1e-12)
        assert torch.equal(*(torch.autograd.grad((r * w_T).sum(), y)[0] for r in (got_y, ref_y)))


_TRITON_CHECK = """
import os, sys
import numpy as np, torch
sys.path.insert(0, {tests!r})
from test_dispatch_local import _routing, _plan, POLICIES, D, E
from megatron_rails.runtime.local import order_pairs, order_pairs_triton, pairs_per_token_range
from megatron_rails.runtime.receive import receive_order
from test_dispatch_local import same_order as same
cases = 0
for policy in POLICIES:
    rng = np.random.default_rng(POLICIES.index(policy))
    for it in range(25):
        T = int(rng.integers(0, 40))
        rmap, probs = _routing(rng, T, [0, 1, 2, 3, E][it % 5])
        probs = probs.to([torch.float32, torch.float64][it % 2])
        me = int(rng.integers(D))
        plan = _plan(rng, policy, rmap, me)
        lo, hi = pairs_per_token_range(rmap).tolist()
        a = order_pairs(plan, me, rmap, probs, uniform=lo == hi)
        b = order_pairs_triton(plan, me, rmap, probs, uniform=lo == hi, receive=True)
        order, inverse, per_slot = receive_order(plan, me, torch.device("cpu"))
        assert same(b.receive[0], order) and same(b.receive[1], inverse), (policy, it)
        assert np.array_equal(b.receive[2], per_slot)
        assert torch.equal(a.token_P, b.token_P) and torch.equal(a.probs_P, b.probs_P), (policy, it)
        assert (a.by_token is None) == (b.by_token is None), (policy, it)
        assert a.by_token is None or torch.equal(a.by_token, b.by_token), (policy, it)
        assert (a.send_D, a.recv_D, a.k) == (b.send_D, b.recv_D, b.k)
        cases += 1
print("triton send order matches", cases)
"""


_GATHER_SUM_CHECK = """
import numpy as np, torch
from megatron_rails.runtime.local_triton import gather_sum, gather_sum_fits
rng = np.random.default_rng(3)
cases = 0
for dtype in (torch.float16, torch.float32):
    for k in (1, 2):
        for T, H in ((0, 8), (1, 1), (7, 5), (33, 64), (20, 1500)):
            P = k * T + int(rng.integers(0, 4))  # rows no token reads too (a dump row)
            y = (torch.randn(P, H, dtype=torch.float64) * 100).to(dtype)
            by = torch.from_numpy(np.concatenate([rng.permutation(P)[:k * T]]) if T else np.zeros(0, dtype=np.int64))
            assert gather_sum_fits(y, k)
            want = y.index_select(0, by)
            want = want if k == 1 else want.view(k, T, H).sum(0)
            got = gather_sum(y, by, k)
            assert got.dtype == dtype and torch.equal(got, want), (dtype, k, T, H)
            cases += 1
assert not gather_sum_fits(torch.zeros(4, 3, dtype=torch.float64), 2)
assert not gather_sum_fits(torch.zeros(4, 3), 3)
assert not gather_sum_fits(torch.zeros(3, 4).T, 2)
print("gather-sum matches", cases)
"""


def test_triton_gather_sum_matches_torch():
    """The combine's Triton gather-sum under Triton's interpreter on CPU: torch's gather and
    [k, T, H] sum bit for bit (k = 1, 2; fp16, fp32; widths across block boundaries). bf16 is
    checked on a GPU (scripts/gpu_check.py): the interpreter rounds float32 to bf16 its own way (ties
    away from even), where the GPU's conversion rounds to nearest even as torch does."""
    optional.import_triton()
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _GATHER_SUM_CHECK], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "gather-sum matches 20" in out.stdout


def test_triton_send_order_matches_the_host_order():
    """The Triton send-order kernel (CUDA's path) under Triton's interpreter on CPU: the host path's
    tensors exactly, every policy, routings with and without k pairs per token (k == E too)."""
    optional.import_triton()
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")  # read when the kernel is jitted: a fresh process
    tests = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", _TRITON_CHECK.format(tests=tests)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "triton send order matches 125" in out.stdout


@pytest.mark.parametrize("max_runs", [MAX_RUNS, 0])
@pytest.mark.parametrize("policy", POLICIES)
def test_device_local_work_reads_no_device_data(policy, max_runs, monkeypatch):
    """The local work of a layer step on the device path (MEGATRON_RAILS_SEND_ORDER=device, what
    CUDA runs where Triton is missing): the send order made by torch ops, the rows sent, the received
    rows grouped by slot, split, put back, and the combine's sum, forward and backward, run on the
    meta device, which holds no data. So none of those ops reads device values back to the host or
    sizes an output by them, what would make a GPU wait (the all-to-all's split sizes come from the
    plan, on the host). The host-made order, whose nonzero does read them, fails on meta."""
    from megatron_rails.runtime.local import send_order

    monkeypatch.setenv("MEGATRON_RAILS_SEND_ORDER", "device")
    monkeypatch.setattr(receive_mod, "MAX_RUNS", max_runs)  # 0: the regrouping by a permutation tensor
    meta, H = torch.device("meta"), 6
    rng = np.random.default_rng(31 + POLICIES.index(policy))
    for k in (2, 0, E):  # top-2; a varying number of pairs per token (no by-token table); every expert
        T = int(rng.integers(1, 40))
        rmap, probs = _routing(rng, T, k)
        me = int(rng.integers(D))
        plan = _plan(rng, policy, rmap, me)
        with pytest.raises(NotImplementedError):  # the check can fail: the host path reads the map
            order_pairs(plan, me, rmap.to(meta), probs.to(meta), uniform=k > 0)
        probs_m = probs.to(meta).float().requires_grad_()
        so = send_order(plan, me, rmap.to(meta), probs_m, uniform=k > 0, receive=True)
        P = int(rmap.sum())
        assert so.token_P.device == meta and so.token_P.shape == (P,) and (so.by_token is None) == (k == 0)
        x_TH = torch.empty(T, H, device=meta, requires_grad=True)
        x_PH = token_rows(x_TH, so) * so.probs_P.unsqueeze(-1)
        # the rows that arrive (their count from the plan), grouped by slot, computed, put back
        order, inverse, per_slot = so.receive
        x_QH = torch.empty(sum(so.recv_D), H, device=meta, requires_grad=True)
        parts = torch.split(rows(x_QH, order, inverse), per_slot.tolist())
        y_QH = rows_back([2 * p for p in parts], order)
        assert y_QH.shape == x_QH.shape
        # what comes back, one row per pair sent, summed per token
        y_TH = sum_pairs(x_PH, so, T)
        assert y_TH.shape == (T, H)
        (y_TH.sum() + y_QH.sum()).backward()
        assert x_TH.grad.shape == (T, H) and probs_m.grad.shape == (T, E) and x_QH.grad.shape == x_QH.shape


def test_stage_puts_host_tables_on_the_device_in_one_buffer():
    """staging.stage: every table's values, shape and int64 dtype, as views of one device buffer
    (one copy), on CPU; on the meta device it only allocates (nothing read back)."""
    from megatron_rails.runtime.staging import stage

    rng = np.random.default_rng(3)
    tables = [rng.integers(-5, 10**12, (7,)), np.arange(0), rng.integers(0, 9, (3, 4)).astype(np.int32),
              np.array([42])]
    got = stage(tables, torch.device("cpu"))
    assert [tuple(t.shape) for t in got] == [a.shape for a in tables]
    for t, a in zip(got, tables):
        assert t.dtype == torch.int64 and np.array_equal(t.numpy(), a)
    bases = {t.untyped_storage().data_ptr() for t in got}
    assert len(bases) == 1, "not views of one buffer"
    meta = stage(tables, torch.device("meta"))
    assert all(t.device.type == "meta" and tuple(t.shape) == a.shape for t, a in zip(meta, tables))


def test_values_on_copies_a_few_numbers_to_the_device(monkeypatch):
    """staging.values_on (the metric values Megatron's tracker gets every layer step): the numbers
    in the dtype asked for; the staging switch is checked as for the plan tables."""
    from megatron_rails.runtime.staging import STAGING_ENV, values_on

    got = values_on([1.5, 2.0, 1e6], torch.float32, torch.device("cpu"))
    assert got.dtype == torch.float32 and got.tolist() == [1.5, 2.0, 1e6]
    assert values_on([3.0], torch.float64, "meta").device.type == "meta"
    monkeypatch.setenv(STAGING_ENV, "paged")
    with pytest.raises(ValueError, match="expected pinned or pageable"):
        values_on([1.0], torch.float32, torch.device("cpu"))
