"""Slot weights live for one optimizer step (runtime/residency.py), checked against the stock
allgather dispatcher with a real optimizer, so a stale weight fails.

Three optimizer steps of four microbatches each, every microbatch with different skewed counts;
gradient accumulation with `no_sync()` on all but the last microbatch (as Megatron's schedules do)
or without it; with or without Megatron's activation recompute. After every microbatch the loss,
after every step every parameter (in stock layout) equals stock's, until the first near-tie routing
flip (tests/flips.py's rule: a stock alltoall control trains beside them and bounds the flips).
Within a step the slots are fetched once and reused by the later microbatches (counted). An
evaluation forward after training (no optimizer) matches stock too. The stores' step buffers come from kept blocks here
(runtime/hostbuf.py, at every size).
"""
import numpy as np
import pytest
import torch

from moe_harness import build_moe_layer, moe_config, spawn

E, H, T = 8, 16, 24
STEPS, MICRO = 3, 4
POLICIES = ("none", "eplb", "ultraep", "lp", "fsep")


def _layers(world, policy, grow=False, ranks_per_node=0):
    import megatron_rails

    torch.manual_seed(11)
    stock = build_moe_layer(moe_config(world, "allgather", experts=E, hidden=H))
    # grow: every replica that lowers the busiest rank is worth its bytes (the default cost, tens of
    # thousands of tokens, never pays at this size)
    megatron_rails.install({"policy": policy, "slots": 2, "comm": "direct", "tolerance": 0.0, "window": 2,
                            "interval": 2, "ranks_per_node": ranks_per_node,
                            **({"replica_cost_tokens": 1} if grow else {})})
    try:
        rails = build_moe_layer(moe_config(world, "alltoall", experts=E, hidden=H))
    finally:
        megatron_rails.uninstall()
    rails.load_state_dict(stock.state_dict())
    # a router direction per hot expert: microbatch m leans on expert HOT[m], so counts differ
    u = torch.tensor(np.random.default_rng(3).standard_normal((E, H)), dtype=torch.float32)
    u /= u.norm(dim=1, keepdim=True)
    with torch.no_grad():
        for layer in (stock, rails):
            layer.router.weight.add_(4.0 * u)
    return stock, rails, u


def _control(world, stock):
    """Stock alltoall from stock allgather's weights (the control of tests/flips.py's rule); it must
    run inside flips.stock_alltoall()."""
    from flips import stock_alltoall

    with stock_alltoall():
        control = build_moe_layer(moe_config(world, "alltoall", experts=E, hidden=H))
    control.load_state_dict(stock.state_dict())
    return control


def _batch(rank, step, micro, u):
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    hot = (step + micro) % E  # a different hot expert in every microbatch of a step
    x = torch.randn(T, H, generator=gen) * 0.5 + 1.5 * u[hot] + 0.8 * u[(hot + 3) % E]
    return x.view(T, 1, H)


def _worker(rank, world, policies, accumulate, recompute, grow=False, ranks_per_node=0):
    from megatron.core import tensor_parallel

    from megatron_rails import no_sync
    from megatron_rails.runtime import hostbuf

    hostbuf.MIN_BYTES = 0  # the stores' step buffers come from kept blocks at this small size too

    from flips import Online, RoutingLog, stock_alltoall

    w = torch.linspace(-1, 1, T * H).view(T, 1, H)
    for policy in policies:
        stock, rails, u = _layers(world, policy, grow, ranks_per_node)
        layers = {"stock": stock, "rails": rails, "control": _control(world, stock)}
        rule = Online(*(RoutingLog(layers[n]) for n in ("rails", "stock", "control")))
        disp = rails.token_dispatcher
        opts = {n: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for n, m in layers.items()}
        reused = grown = 0
        for step in range(STEPS):
            n_records = len(disp.metrics)
            for micro in range(MICRO):
                x = _batch(rank, step, micro, u)
                losses = {}
                for name, layer in layers.items():
                    def fwd(t, m=layer):
                        return m(t)[0]

                    gate = no_sync() if (name == "rails" and accumulate and micro < MICRO - 1) else _null()
                    with gate, stock_alltoall() if name == "control" else _null():
                        xi = x.clone().requires_grad_(True)
                        out = tensor_parallel.checkpoint(fwd, False, xi) if recompute else fwd(xi)
                        loss = (out * w).sum()
                        loss.backward()
                    losses[name] = loss.item()
                where = f"{policy}, step {step}, microbatch {micro}, rank {rank}"
                strict = rule.update()  # no routing flip yet: the losses must agree to rounding
                assert not strict or abs(losses["rails"] - losses["stock"]) <= 1e-5 * max(1.0, abs(losses["stock"])), \
                    f"{where}: loss {losses['rails']} vs stock {losses['stock']}"
            records = list(disp.metrics)[n_records:]
            assert len(records) == MICRO, f"{policy}: {len(records)} records for {MICRO} microbatches"
            counts = [r["tokens_per_rank_before"] for r in records]
            assert len({tuple(c) for c in counts}) > 1, "the microbatches of a step must differ in counts"
            if accumulate and policy != "none":
                fetched = [r["slots_fetched"] for r in records]
                added = [r["slots_added"] for r in records]
                assert fetched[0], f"{policy}, step {step}: the first microbatch fetched nothing"
                # once a training forward used moved slots, later microbatches fetch only replicas the
                # resident placement grows by (before that, e.g. eplb falling back to stock, a new
                # placement may replace it)
                used = np.cumsum([r["resident_slots"] > 0 for r in records]) > 0
                for i in range(1, MICRO):
                    if used[i - 1]:
                        assert fetched[i] == (added[i] > 0), f"{policy}, step {step}, microbatch {i}: {records[i]}"
                        assert (records[i]["weight_bytes_sent"] == 0) == (added[i] == 0), records[i]
                assert grow or not any(added), f"{policy}: grew at the default cost: {added}"
                reused += sum(r["replicas_used"] > 0 for r in records[1:])
                grown += sum(added)
            for opt in opts.values():
                opt.step()
                opt.zero_grad(set_to_none=True)
            got, ref = rails.state_dict(), stock.state_dict()
            assert set(got) == set(ref)
            for k in ref if strict else ():
                torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{policy}, after step {step}, {k}: {m}")
        if accumulate and policy != "none":
            assert reused > 0, f"{policy}: no later microbatch computed on a resident slot"
        if grow and policy in ("ultraep", "lp"):  # a different hot expert every microbatch: room to grow
            assert grown > 0, f"{policy}: the resident placement never grew"
        # evaluation after training: no optimizer step follows, weights as trained
        with torch.no_grad():
            x = _batch(rank, STEPS, 0, u)
            got, want = rails(x)[0], stock(x)[0]
            with stock_alltoall():
                layers["control"](x)
        if rule.update():
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        rule.check(f"{policy}, rank {rank}")


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("accumulate,recompute,policies", [
    (True, False, POLICIES),
    (True, True, ("ultraep", "fsep")),
    (False, False, ("ultraep", "fsep")),
])
def test_training_steps_match_stock(accumulate, recompute, policies):
    spawn(_worker, 2, policies, accumulate, recompute)


@pytest.mark.parametrize("recompute", [False, True])
def test_grown_placement_matches_stock(recompute):
    """Replicas added to the resident placement mid-step (at a cost every gain pays) are fetched as
    a second part of the window, computed, and their gradients returned with the rest: exact."""
    spawn(_worker, 2, ("ultraep", "lp", "fsep"), True, recompute, True)


def _dropped_worker(rank, world):
    import gc

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rails import no_sync
    from megatron_rails.runtime import residency

    _, rails, u = _layers(world, "fsep")
    with no_sync():  # the slots' gradients stay owed
        rails(_batch(rank, 0, 0, u))[0].sum().backward()
    shards = rails.token_dispatcher.store.shards
    assert shards.grad is None
    if rank == 0:  # this rank drops its model while it owes; the garbage collector runs here only
        del rails, shards
        gc.collect()
    residency.flush_pending()  # a collective every rank must join
    if rank == 1:  # the owed gradients arrived (rank 0's share of its shards included)
        assert shards.grad is not None and shards.grad.abs().sum() > 0
    # the EP group's collectives still pair up: this all-reduce meets the same on every rank
    got = torch.tensor([float(rank + 1)])
    dist.all_reduce(got, group=ps.get_expert_model_parallel_group())
    assert got.item() == world * (world + 1) / 2


def test_a_model_dropped_while_owing_gradients_still_joins_the_flush():
    """Owed slot gradients go back by a collective; a rank whose garbage collector already took
    the model must still take part, or the ranks' collectives stop pairing up."""
    spawn(_dropped_worker, 2)


def test_slot_gradient_rows_no_backward_reached_come_back_zero():
    """The accumulator is allocated empty (a row's first gradients are copied in, not added into
    zeros): rows no backward wrote, and the padding past the real columns, must still read as
    zeros, whatever the allocation held (NaN here)."""
    from megatron_rails.core.plan import Placement  # noqa: F401  (Window's field type)
    from megatron_rails.runtime.residency import Window

    w = Window(placement=None, key=(0,), moved=True, weights_NW=torch.ones(4, 6))
    w.slots_N = np.arange(4)
    w.open_acc(W=5, dtype=torch.float32)
    assert torch.equal(w.acc_NW[:, 5:], torch.zeros(4, 1))
    w.acc_NW[:, :5] = float("nan")
    w.acc_NW[1, :5] = 2.0  # what a backward wrote into row 1
    w.acc_fresh[1] = False
    got = w.accumulated()
    want = torch.zeros(4, 6)
    want[1, :5] = 2.0
    assert torch.equal(got, want)


@pytest.mark.parametrize("ranks", [0, 2])
def test_held_first_gradients_survive_growth_and_sum_exactly(ranks):
    """A row's first gradients are held, not copied, until its next backward sums both into the
    accumulator in one pass. Growing the window in between (a new part, nothing allocated yet)
    keeps them, as growing it after the accumulator exists keeps that; the result equals a dense
    sum: rows reached once, twice, three times, never.
    ranks = 2: the rank-major layout FSEP's return sends ([D, N, W'/D]; the second piece spans
    both shards, the padding column stays zero)."""
    from megatron_rails.runtime import residency
    from megatron_rails.runtime.comm.base import Pending
    from megatron_rails.runtime.residency import Window, resident_anchor, resident_row

    class Store:  # what resident_row reads of an expert store
        numels = [2, 3]
        acc_dtype = torch.float32

    store = Store()
    w = Window(placement=None, key=(0,), moved=True, weights_NW=torch.ones(2, 6), acc_ranks=ranks)
    w.slots_N = np.arange(2)
    gen = torch.Generator().manual_seed(0)
    want = torch.zeros(4, 6)

    def backward(row):
        link = torch.zeros(0, requires_grad=True)
        resident_anchor(w, store, link)
        pieces = resident_row(w, store, row, link)
        g = torch.randn(5, generator=gen)
        want[row, :5] += g
        torch.autograd.backward(pieces, [g[:2], g[2:]])

    try:
        backward(0)
        assert w.acc_NW is None and list(w.acc_held) == [0], "the first gradients were not held"
        w.add_part(Pending.done(torch.ones(1, 6)), np.array([2]), {})  # grown: a third row
        w.weights()
        backward(0)  # held + these, in one pass
        w.add_part(Pending.done(torch.ones(1, 6)), np.array([3]), {})  # grown again, the accumulator too
        w.weights()
        backward(2)
        backward(3)
        backward(0)
        backward(3)
        acc = w.accumulated()
        assert not w.acc_held
        if ranks:
            assert acc.shape == (ranks, 4, 3)
            acc = acc.permute(1, 0, 2).reshape(4, 6)  # row-major, for the comparison
        torch.testing.assert_close(acc, want, rtol=0, atol=1e-6)
        assert torch.equal(acc[1], torch.zeros(6)), "a row no backward reached is not zero"
    finally:
        residency.settled(store)


def test_bf16_slot_gradients_accumulate_in_the_frameworks_fp32():
    """bf16 weights whose framework accumulates gradients in fp32 (Megatron DDP's main_grad): the
    slots' gradients accumulate in fp32 over the step's microbatches, as the stock experts' do
    (main_grad += grad per microbatch), not in bf16 (which would round every partial sum)."""
    from megatron_rails.runtime import residency
    from megatron_rails.runtime.residency import Window, resident_anchor, resident_row

    class Store:  # what resident_row reads of an expert store
        numels = [6]
        acc_dtype = torch.float32

    store = Store()
    w = Window(placement=None, key=(0,), moved=True, weights_NW=torch.ones(1, 6, dtype=torch.bfloat16))
    w.slots_N = np.arange(1)
    grads = [torch.full((6,), v, dtype=torch.bfloat16) for v in (256.0, 1.0, 1.0, 1.0)]
    for g in grads:  # four microbatches
        link = torch.zeros(0, requires_grad=True)
        resident_anchor(w, store, link)
        (piece,) = resident_row(w, store, 0, link)
        piece.backward(g)
    try:
        acc = w.accumulated()
        assert acc.dtype == torch.float32
        # fp32: 259 exactly; a bf16 accumulator rounds 257 back to 256 at every step
        assert torch.equal(acc[0], torch.full((6,), 259.0))
    finally:
        residency.settled(store)


def test_lent_accumulator_keeps_late_adds_through_growth_and_returns():
    """Under gradient accumulation fusion the accumulator's rows are lent out as main_grad, which the
    experts' linears add into during a backward that may come after the window grew (a later
    microbatch's forward, interleaved schedules) or after a return: those adds must reach the next
    return, exactly once."""
    from megatron_rails.runtime.residency import Window

    w = Window(placement=None, key=(0,), moved=True, weights_NW=torch.ones(1, 4))
    w.slots_N = np.arange(1)
    w.open_acc(4, torch.float32, lent=True)
    lent = w.acc_NW[0]  # a borrowed weight's main_grad
    assert torch.equal(w.acc_NW, torch.zeros(1, 4)), "a lent accumulator starts at zero"
    lent.add_(1.0)  # microbatch 1's backward
    w.in_flight = 1  # microbatch 2's forward ran on `lent` too; its backward is still to come
    w.add_part(None, np.array([5, 6]), {})  # microbatch 3's forward grows the window by two replicas
    lent.add_(2.0)  # microbatch 2's backward, after the growth
    w.acc_NW[2].add_(5.0)  # microbatch 3's backward, on a new row
    acc = w.accumulated()
    assert acc.shape == (3, 4)
    assert torch.equal(acc, torch.tensor([[3.0] * 4, [0.0] * 4, [5.0] * 4])), acc
    assert torch.equal(w.accumulated(), acc), "accumulated() twice added the late adds twice"
    w.pending = True
    w.returned()  # microbatch 2 still in flight: zeroed in place, its main_grad still counts
    assert not w.pending and torch.equal(w.acc_NW, torch.zeros(3, 4))
    lent.add_(4.0)  # a late backward after the return: owed at the next one
    assert torch.equal(w.accumulated()[0], torch.full((4,), 4.0))
    w.in_flight = 0
    w.returned()  # nothing in flight: the accumulator is dropped
    assert w.acc_NW is None and not w.acc_lent and not w.acc_stale


def test_each_slot_adds_its_weight_gradients_right_after_its_own_backward():
    """A slot's weight gradients are taken (held, or added into the accumulator) as soon as that
    slot's backward has made them, before the backward of the slots computed earlier: so one slot's gradients are alive at
    a time, not every slot's until the layer's backward ends. Observed from inside the backward:
    when a slot's input gradient is made, every slot computed after it has already added its
    weight gradients. The accumulated rows equal the dense gradients."""
    from megatron_rails.runtime import residency
    from megatron_rails.runtime.expert_kind import ExpertKind
    from megatron_rails.runtime.experts import ExpertStore
    from megatron_rails.runtime.residency import Window

    F, N = 3, 5

    class Kind(ExpertKind):  # E experts of one [F, H] weight each: y = probs * x w^T
        def __init__(self, num_local):
            self.module = torch.nn.Module()
            self.module.w = torch.nn.Parameter(torch.randn(num_local * F, H))
            self.num_local, self.slot_names = num_local, ("w",)

        def slices(self, i):
            return [("w", lambda t, i=i: t[i * F:(i + 1) * F])]

        def compute(self, params, x_NH, probs_N):
            return (x_NH @ params["w"].t()) * probs_N[:, None]

    torch.manual_seed(0)
    store = ExpertStore(Kind(E), E, rank=0, num_ranks=1)
    slots = [5, 6, 7]
    placement = object()  # the window's own placement: it serves it
    store.window = w = Window(placement=placement, key=store.key(), moved=True,
                              weights_NW=torch.randn(len(slots), F * H))
    w.slots_N = np.array(slots)
    link = torch.zeros(0, requires_grad=True)
    try:
        params, anchor = store.slot_params(placement, link)
        assert 6 in params and 9 not in params and len(params) == 3 and not params._made
        seen, outs, want = {}, [], {}

        def added_by_then(s):  # which slots' weight gradients the window has taken now
            def hook(_grad):
                seen[s] = set() if w.acc_fresh is None else {slots[r] for r in np.flatnonzero(~w.acc_fresh)}
            return hook

        for s in slots:
            x = torch.randn(N, H, requires_grad=True)
            probs = torch.rand(N)
            x.register_hook(added_by_then(s))
            outs.append(store.compute(params[s], x, probs))
            assert params[s]["w"] is params[s]["w"], "asked again, a slot's parameters were made anew"
            g = torch.randn(N, F)
            want[s] = (g * probs[:, None]).t() @ x.detach()
            outs[-1] = (outs[-1] * g).sum()
        (torch.stack(outs).sum() + anchor.sum()).backward()
        assert seen == {7: set(), 6: {7}, 5: {6, 7}}, seen
        # the step's first gradients are held as autograd made them, not copied (Window.acc_held)
        assert w.acc_NW is None and sorted(w.acc_held) == [0, 1, 2], (w.acc_NW, w.acc_held)
        acc = w.accumulated()
        for r, s in enumerate(slots):
            torch.testing.assert_close(acc[r].view(F, H), want[s], rtol=1e-6, atol=1e-6)
    finally:
        residency.settled(store)


def test_no_sync_holds_for_a_backward_run_on_another_thread():
    """On CUDA, autograd runs backward nodes on a worker thread of its own per device, not on the
    thread that entered no_sync() and called backward(): the gate that decides whether the slots'
    gradients return must see no_sync() there too (here the backward is run on another thread)."""
    import threading

    from megatron_rails.runtime import residency
    from megatron_rails.runtime.residency import ReturnGate, Window, no_sync, resident_anchor

    class Store:  # what ReturnGate and ResidentSlots use of an expert store
        defer_flush = False

        def __init__(self):
            self.flushes = 0

        def flush(self, window, in_graph):
            self.flushes += 1
            window.returned()
            residency.settled(self)
            return [None]

        def idle_grads(self):
            return [None]

    def microbatch(store, w):
        x = torch.randn(3, 2, requires_grad=True)
        x_out, _probs, link = ReturnGate.apply(w, store, x, torch.rand(3), torch.zeros(1, requires_grad=True))
        return x_out.sum() + resident_anchor(w, store, link).sum()

    def backward_on_another_thread(loss):
        t = threading.Thread(target=loss.backward)
        t.start()
        t.join()

    store = Store()
    w = Window(placement=None, key=(0,), moved=True, weights_NW=torch.ones(1, 4))
    w.slots_N = np.arange(1)
    try:
        with no_sync():
            backward_on_another_thread(microbatch(store, w))
        assert store.flushes == 0 and w.pending, "a backward inside no_sync() returned the gradients"
        backward_on_another_thread(microbatch(store, w))
        assert store.flushes == 1 and not w.pending
    finally:
        residency.settled(store)


def _inference_then_training_worker(rank, world):
    w = torch.linspace(-1, 1, T * H).view(T, 1, H)
    for policy in ("ultraep", "fsep"):
        stock, rails, u = _layers(world, policy)
        x = _batch(rank, 0, 0, u)
        with torch.inference_mode():  # generation (an RL rollout) on the training model itself
            got = rails(x.clone())[0]
            assert rails.token_dispatcher.store.window.moved, f"{policy}: no slot moved under skew"
        torch.testing.assert_close(got, stock(x.clone())[0], rtol=1e-5, atol=1e-5)
        outs = []
        for layer in (stock, rails):  # then a training step on the same counts
            xi = x.clone().requires_grad_(True)
            out = layer(xi)[0]
            (out * w).sum().backward()
            outs.append((out.detach(), xi.grad))
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-5)


def test_a_window_fetched_in_inference_mode_does_not_serve_training():
    """Slots fetched under torch.inference_mode() hold inference tensors, which autograd cannot
    save: the next training forward fetches afresh instead of computing on them (it raised), and
    matches stock."""
    spawn(_inference_then_training_worker, 2)


def _step_matches_stock(opts, stock, rails, where: str, strict: bool = True) -> None:
    """Every optimizer steps; then rails' parameters must equal stock's (where `strict`: no routing
    flip yet)."""
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)
    got, ref = rails.state_dict(), stock.state_dict()
    for k in ref if strict else ():
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}, {k}: {m}")


def _midstep_eval_worker(rank, world):
    import copy

    from megatron_rails import no_sync
    from megatron_rails.runtime.layer import GROWN

    w = torch.linspace(-1, 1, T * H).view(T, 1, H)
    evals = (("inference, eval mode", torch.inference_mode, False),
             ("inference, train mode", torch.inference_mode, True),
             ("no_grad, eval mode", torch.no_grad, False))
    from flips import Online, RoutingLog, stock_alltoall

    for policy in ("ultraep", "lp", "fsep"):
        stock, rails, u = _layers(world, policy, grow=True)
        control = _control(world, stock)
        rule = Online(RoutingLog(rails), RoutingLog(stock), RoutingLog(control))
        store = rails.token_dispatcher.store
        runtime = rails.token_dispatcher.runtime
        seen = []  # every forward's (all ranks') counts

        def plan_spy(counts_DE, *args, _plan=runtime._plan):
            seen.append(counts_DE.copy())
            return _plan(counts_DE, *args)

        runtime._plan = plan_spy
        # the premise, per evaluation: a training forward on its counts would grow the window (the
        # same decision, made without side effects), or the planner would place them otherwise
        would_grow = not_resident = 0
        opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (stock, rails, control)]
        for step in range(2):
            for micro in range(MICRO):
                x = _batch(rank, step, micro, u)
                losses = []
                for layer in (stock, rails, control):
                    with no_sync() if (layer is rails and micro < MICRO - 1) else _null(), \
                            stock_alltoall() if layer is control else _null():
                        loss = (layer(x.clone().requires_grad_(True))[0] * w).sum()
                        loss.backward()
                    losses.append(loss.item())
                where = f"{policy}, step {step}, microbatch {micro}, rank {rank}"
                strict = rule.update()  # until the first routing flip (tests/flips.py)
                assert not strict or abs(losses[1] - losses[0]) <= 1e-5 * max(1.0, abs(losses[0])), \
                    f"{where}: {losses}"
                if micro == MICRO - 1:
                    continue
                # evaluation between training microbatches, on counts that would grow the window
                window, digest = store.window, store.window.placement.digest()
                for k, (name, mode, train_mode) in enumerate(evals):
                    xe = _batch(rank, 50 + step, 3 + micro + k, u)
                    for layer in (stock, rails, control):
                        layer.train(train_mode)
                    with mode():
                        got, want = rails(xe)[0].clone(), stock(xe)[0].clone()
                        with stock_alltoall():
                            control(xe)
                    for layer in (stock, rails, control):
                        layer.train()
                    if rule.update():
                        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                                   msg=lambda m: f"{where}, {name}: {m}")
                    assert store.window is window and window.placement.digest() == digest, \
                        f"{where}: evaluation ({name}) changed the window its gradients are owed to"
                    fresh, _ = runtime.planner.plan(seen[-1], copy.deepcopy(runtime.state))
                    not_resident += fresh.placement.digest() != digest
                    would_grow += runtime._grow(runtime.plan, seen[-1], fresh)[1] == GROWN
            _step_matches_stock(opts, stock, rails, f"{policy}, after step {step}, rank {rank}", rule.update())
        # ultraep and lp: some evaluation counts would have grown the window. fsep never grows one
        # (its sharded layout fills every slot), so for it the premise is the other half of the
        # claim: the evaluation counts are planned on another placement, which evaluation must not
        # put in place of the window either
        assert would_grow > 0 or policy == "fsep", f"{policy}: no evaluation would have grown the window"
        assert not_resident > 0, f"{policy}: every evaluation's counts fit the resident placement"


def test_evaluation_mid_step_leaves_the_training_window_alone():
    """Evaluation forwards between a step's microbatches (inference mode with the layer in eval or
    train mode, or no_grad) compute like stock and neither grow nor replace the window the step's
    gradients are owed to, even where a training forward would grow it (ultraep, lp: checked to
    happen) and where the planner would place the evaluation's counts otherwise (every policy; fsep,
    which never grows a window, is here for that). Growing it under inference mode made its weights
    inference tensors: the next training forward raised."""
    spawn(_midstep_eval_worker, 2)


def _eval_mode_training_worker(rank, world):
    from megatron_rails import no_sync

    w = torch.linspace(-1, 1, T * H).view(T, 1, H)
    for policy in ("ultraep", "lp", "fsep"):
        stock, rails, u = _layers(world, policy)
        for layer in (stock, rails):
            layer.eval()  # training without dropout: autograd records, the modules are in eval mode
        opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (stock, rails)]
        for step in range(2):
            for layer in (stock, rails):
                with no_sync() if layer is rails else _null():
                    # two microbatches in flight (a pipeline schedule's warm-up), then their backwards
                    losses = [(layer(_batch(rank, step, m, u).requires_grad_(True))[0] * w).sum() for m in range(2)]
                    for loss in losses:
                        loss.backward()
                (layer(_batch(rank, step, 2, u).requires_grad_(True))[0] * w).sum().backward()
            _step_matches_stock(opts, stock, rails, f"{policy}, after step {step}, rank {rank}")


def test_training_in_eval_mode_matches_stock():
    """A forward autograd records owes its slot gradients whatever the module's mode: with two
    microbatches in flight in eval mode the second one, not counted as training, replaced the
    window the first one's gradients were owed to, and they were lost (ultraep's weights differed
    from stock's after the second step)."""
    spawn(_eval_mode_training_worker, 2)


def _eval_worker(rank, world):
    states = []
    for with_eval in (False, True):
        _stock, rails, u = _layers(world, "eplb")
        runtime = rails.token_dispatcher.runtime
        got = []
        for micro in range(4):
            if with_eval:  # evaluation in between: other data, routed to other hot experts
                rails.eval()
                with torch.no_grad():
                    for k in range(3):
                        rails(_batch(rank, 7, k + micro, u))
                rails.train()
            out = rails(_batch(rank, 0, micro, u))[0]
            out.sum().backward()
            state = runtime.state
            got.append((state.history_IE.copy(), state.step, state.placement.slot_expert_DS.copy()))
        states.append(got)
    for micro, (want, seen) in enumerate(zip(*states)):
        where = f"rank {rank} microbatch {micro}"
        assert np.array_equal(seen[0], want[0]), f"{where}: evaluation counts entered eplb's history"
        assert seen[1] == want[1], f"{where}: evaluation forwards advanced eplb's step ({seen[1]} vs {want[1]})"
        assert np.array_equal(seen[2], want[2]), f"{where}: eplb planned another placement"


def test_evaluation_forwards_do_not_feed_the_planners_history():
    """eplb plans from the history of training counts: evaluation forwards between training
    microbatches must not enter it nor advance its re-plan interval, so its plans are those of
    training alone (which placement a step then uses may still follow the resident window's
    weights: reusing them is free)."""
    spawn(_eval_worker, 2)
