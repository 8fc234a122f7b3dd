"""FSEP holds its shards and the step's slots, not a stock copy beside them (runtime/sharded.py).

Storage bytes of the experts module's parameters per rank, measured (distinct storages), against a
stock Megatron-Core layer of the same shape: equal up to the shards' padding and the one element the
stock parameters share. It stays so after training steps, after `state_dict()` / `load_state_dict()` and
after a cast that gives the stock parameters memory again (as `.cuda()` / `.bfloat16()` do: released
at the next step); the outputs and the stock-layout state equal stock's throughout.
"""
import torch

from moe_harness import build_moe_layer, moe_config, spawn

E, H, F, T = 8, 32, 48, 64


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _expert_bytes(layer) -> int:
    return _storage_bytes(p for p in layer.experts.parameters())


def _assert_state_equal(got, want, where, tol=0.0):
    assert set(got) == set(want), f"{where}: keys differ: {set(got) ^ set(want)}"
    for k, v in want.items():
        if torch.is_tensor(v):
            diff = (got[k] - v).abs().max().item()
            assert diff <= tol * max(1.0, v.abs().max().item()), f"{where}: {k} differs by {diff}"


def _worker(rank, world):
    import megatron_rails
    from megatron_rails import new_step

    torch.manual_seed(5)
    stock = build_moe_layer(moe_config(world, "allgather", experts=E, hidden=H, ffn=F))
    megatron_rails.install({"policy": "fsep", "comm": "direct"})
    try:
        rails = build_moe_layer(moe_config(world, "alltoall", experts=E, hidden=H, ffn=F))
    finally:
        megatron_rails.uninstall()
    rails.load_state_dict(stock.state_dict())
    store = rails.token_dispatcher.store
    stock_params = [p for n, p in rails.experts.named_parameters() if not n.endswith(store.PARAM)]
    esize = stock_params[0].element_size()
    # the shards pad every expert to a multiple of D elements; the stock parameters share one element
    slack = (E * (world - 1) + 1) * esize
    stock_bytes = _expert_bytes(stock)

    def check(where, slot_bytes=0):
        got = _expert_bytes(rails)
        assert store.stock_released(), f"rank {rank}, {where}: the stock parameters hold memory"
        assert got <= stock_bytes + slack, f"rank {rank}, {where}: {got} expert bytes vs stock's {stock_bytes}"
        assert got + slot_bytes >= stock_bytes, f"rank {rank}, {where}: {got} bytes cannot hold the experts"

    check("after build and load")
    _assert_state_equal(rails.state_dict(), stock.state_dict(), f"rank {rank}, state_dict after load")
    check("after state_dict")

    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (stock, rails)]
    gen = torch.Generator().manual_seed(rank)
    w = torch.linspace(-1, 1, T * H).view(T, 1, H)
    for step in range(3):
        x = torch.randn(T, 1, H, generator=gen)
        outs = []
        for m, opt in zip((stock, rails), opts):
            opt.zero_grad()
            out = m(x.clone())[0]
            (out * w).sum().backward()
            opt.step()
            outs.append(out.detach())
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
        window = store.window
        check(f"step {step}", slot_bytes=_storage_bytes([window.weights_NW]))
        new_step()
    _assert_state_equal(rails.state_dict(), stock.state_dict(), f"rank {rank}, state_dict after training",
                        tol=1e-5)  # the experts' sums run in another order

    # a cast gives every stock parameter full memory back (clone of a stride-0 tensor is dense)
    rails.experts._apply(lambda t: t.clone())
    assert not store.stock_released(), "the cast was expected to expand the placeholders"
    x = torch.randn(T, 1, H, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(rails(x.clone())[0], stock(x.clone())[0], rtol=1e-5, atol=1e-5)
    check("after a cast and a forward")

    # a partial load keeps the rest of the experts' current values
    first = next(k for k in stock.state_dict() if k.startswith("experts."))
    before = rails.state_dict()
    rails.load_state_dict({first: torch.zeros_like(before[first])}, strict=False)
    check("after a partial load")
    after = rails.state_dict()
    assert after[first].abs().max().item() == 0.0
    for k, v in before.items():
        if k != first and torch.is_tensor(v):
            torch.testing.assert_close(after[k], v, rtol=0, atol=0, msg=f"rank {rank}, partial load: {k}")


def test_fsep_holds_shards_not_a_stock_copy():
    spawn(_worker, 2)


def _dist_ckpt_worker(rank, world):
    """Megatron-LM's load of a distributed checkpoint: the template from sharded_state_dict(), the
    checkpoint written in place into its tensors (as dist_checkpointing.load does), then
    load_state_dict with them."""
    import dataclasses

    import megatron_rails
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    def cfg(dispatcher, gated):
        return dataclasses.replace(moe_config(world, dispatcher, experts=E, hidden=H, ffn=F), gated_linear_unit=gated)

    for gated in (False, True):
        torch.manual_seed(5)
        stock = build_moe_layer(cfg("allgather", gated))
        torch.manual_seed(7)  # other weights than the checkpoint's
        megatron_rails.install({"policy": "fsep", "comm": "direct"})
        try:
            rails = build_moe_layer(cfg("alltoall", gated))
        finally:
            megatron_rails.uninstall()
        ckpt = stock.state_dict()
        loaded, in_place = {}, 0
        for k, v in rails.sharded_state_dict().items():
            if isinstance(v, ShardedTensor):
                v.data.detach().copy_(ckpt[k])
                loaded[k], in_place = v.data, in_place + 1
            elif torch.is_tensor(ckpt.get(k)):  # factories (a gated fc1) merge into a new tensor
                loaded[k] = ckpt[k].clone()
        assert in_place, "no tensor of the template was loaded in place: the case is not exercised"
        rails.load_state_dict(loaded, strict=False)
        _assert_state_equal(rails.state_dict(), ckpt, f"rank {rank}, gated {gated}: state after the load")
        x = torch.randn(T, 1, H, generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            torch.testing.assert_close(rails(x.clone())[0], stock(x.clone())[0], rtol=1e-5, atol=1e-5)


def test_a_distributed_checkpoint_loads_into_fsep():
    """The tensors a distributed checkpoint load fills are the stock parameters sharded_state_dict()
    made live: load_state_dict must shard those values, not write the old shards back over them."""
    spawn(_dist_ckpt_worker, 2)
