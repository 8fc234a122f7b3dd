"""The slot weights' fetch runs in the background from the plan until the slots are computed.

On 2 gloo ranks with skewed routing (so replicas / FSEP slots move), for the step's first microbatch:
when the token all-to-all starts and when the stock experts compute the owner slots, the fetch is
still outstanding (not waited for); the slots are computed after the stock experts; the output
equals the stock allgather dispatcher's. The fetch runs on a process group of its own, so it does
not queue behind the token exchanges, made when the layer is built.

The slots' gradients return (a collective) only after the stock experts' backward on every rank, a
rank without slot rows too: joining earlier, it would wait there for the other ranks' expert backward
and they for its own afterwards (ReturnGate, runtime/residency.py).
"""
import torch

from moe_harness import build_moe_layer, moe_config, spawn, stock_and_rails

E, H, T = 8, 16, 48


def _worker(rank, world, policy):
    from megatron_rails import new_step
    from megatron_rails.runtime.comm import base as comm_base
    from megatron_rails.runtime.comm.base import side_group

    stock, rails = stock_and_rails(world, {"policy": policy, "slots": 2, "comm": "direct", "tolerance": 0.0},
                                   seed=3, experts=E, hidden=H)
    runtime = rails.token_dispatcher.runtime
    # made with the layer, not at the first fetch: where the default group is bound to a device,
    # making a group is a collective of every rank, which pipeline stages would reach apart
    assert tuple(torch.distributed.get_process_group_ranks(runtime.group)) in comm_base._SIDE
    with torch.no_grad():  # every token prefers expert 0: its owner rank straggles
        for layer in (stock, rails):
            layer.router.weight[0].add_(3.0)
    events = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            window = runtime.store.window
            events.append((name, window is not None and bool(window.fetches)))
            return fn(*args, **kwargs)
        return wrapped

    runtime.exchange_tokens = spy("tokens", runtime.exchange_tokens)
    rails.experts.forward = spy("owners", rails.experts.forward)
    runtime.store.compute = spy("slot", runtime.store.compute)

    x = torch.randn(T, 1, H, generator=torch.Generator().manual_seed(rank)) + 0.5
    for micro in range(2):
        events.clear()
        out = rails(x.clone())[0]
        out.sum().backward()
        want = stock(x.clone())[0]
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        first = {name: pending for name, pending in reversed(events)}  # the first event of each kind
        assert [n for n, _ in events if n != "slot"] == ["tokens", "owners"], events
        if micro == 0:
            assert runtime.metrics[-1]["slots_fetched"], f"{policy}: expected a fetch in the first microbatch"
            assert first["tokens"] and first["owners"], f"rank {rank}, {policy}: the fetch was waited for early: {events}"
        else:  # resident: nothing to wait for
            assert not runtime.metrics[-1]["slots_fetched"] and not first["tokens"], events
        slots = [i for i, (n, _) in enumerate(events) if n == "slot"]
        assert all(i > events.index(("owners", first["owners"])) for i in slots), \
            f"{policy}: slots computed before the stock experts: {events}"
        assert not runtime.store.window.fetches
    new_step()
    assert side_group(runtime.group) is not runtime.group


def test_weight_fetch_runs_under_tokens_and_owner_compute():
    for policy in ("ultraep", "fsep"):
        spawn(_worker, 2, policy)


def _return_worker(rank, world, policy):
    import megatron_rails

    torch.manual_seed(3)
    megatron_rails.install({"policy": policy, "slots": 2, "comm": "direct", "tolerance": 0.0})
    try:
        rails = build_moe_layer(moe_config(world, "alltoall", experts=E, hidden=H))
    finally:
        megatron_rails.uninstall()
    with torch.no_grad():  # every token prefers expert 0: a replica of it computes on the other rank
        rails.router.weight[0].add_(3.0)
    store = rails.token_dispatcher.runtime.store
    events = []
    stock_forward = rails.experts.forward

    def experts_forward(x, *args, **kwargs):
        x = x.view_as(x)  # its gradient exists once the stock experts' backward has run
        x.register_hook(lambda g: events.append("owners_backward"))
        return stock_forward(x, *args, **kwargs)

    def flush(window, in_graph, _flush=store.flush):
        events.append("return")
        return _flush(window, in_graph)

    slot_rows = []

    def compute(w, x_n, *args, _compute=store.compute, **kwargs):
        slot_rows.append(x_n.shape[0])
        return _compute(w, x_n, *args, **kwargs)

    rails.experts.forward = experts_forward
    store.flush = flush
    store.compute = compute
    x = (torch.randn(T, 1, H, generator=torch.Generator().manual_seed(rank)) + 0.5).requires_grad_()
    rails(x)[0].sum().backward()
    moved = rails.token_dispatcher.runtime.metrics[-1]["resident_slots"]
    slots_here = store.window.n_rows
    assert moved > 0, f"{policy}: expected moved slots"
    # some rank computed token rows on its slots: there are slot gradients to return
    computed = torch.tensor([float(sum(slot_rows))])
    torch.distributed.all_reduce(computed)
    assert computed.item() > 0, f"{policy}: no rank computed a slot's rows ({slots_here} resident slots here)"
    # a rank with no slot rows of its own must not join the return before its stock experts' backward
    # (the rank computing the slots does so after its whole expert backward)
    assert events == ["owners_backward", "return"], f"rank {rank} ({slots_here} resident slots): {events}"


def test_slot_gradients_return_after_every_ranks_expert_backward():
    for policy in ("ultraep", "fsep"):
        spawn(_return_worker, 2, policy)
