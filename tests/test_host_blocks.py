"""The expert stores' step buffers kept between optimizer steps (runtime/hostbuf.py).

A kept block is handed out again only when nothing else holds its storage: a view, a parameter's
gradient, an autograd graph's saved tensor. In training (2 ranks, every block kept: MIN_BYTES 0)
fsep's and ultraep's slot weights, accumulator and returned gradients come from the same blocks step
after step, and the parameters stay equal to the stock dispatcher's after every step, with the
optimizer setting gradients to None or zeroing them in place (the returned gradient then stays the
shards' `.grad`, and its block is not handed out again), and over RailS with two nodes, whose
sprayed exchanges receive into buffers of their own.
"""
import contextlib

import numpy as np
import torch

from moe_harness import spawn, stock_and_rails
from megatron_rails.runtime import hostbuf
from megatron_rails.runtime.hostbuf import HostBlocks

MB = 1 << 20


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_block_comes_back_only_when_nothing_holds_it():
    blocks = HostBlocks()
    a = blocks.empty((MB // 4,), torch.float32, torch.device("cpu"))
    view = a[10:]
    del a
    b = blocks.empty((MB // 4,), torch.float32, torch.device("cpu"))
    assert _ptr(b) != _ptr(view), "a block was handed out while a view of it was alive"
    kept = {_ptr(view), _ptr(b)}
    del view
    c = blocks.empty((MB // 8, 2), torch.float32, torch.device("cpu"))
    assert _ptr(c) in kept and _ptr(c) != _ptr(b), "the freed block was not handed out again"
    assert c.shape == (MB // 8, 2) and c.is_contiguous()
    del c
    d = blocks.empty((MB // 2,), torch.bfloat16, torch.device("cpu"))  # the same bytes in another dtype
    assert _ptr(d) in kept and d.dtype == torch.bfloat16
    assert blocks.kept_bytes() == 2 * MB
    assert blocks.idle_bytes() == 0  # b and d are held
    del b, d
    assert blocks.idle_bytes() == 2 * MB


def test_a_gradient_or_a_saved_tensor_keeps_its_block():
    blocks = HostBlocks()
    p = torch.nn.Parameter(torch.zeros(MB // 4))
    g = blocks.empty((MB // 4,), torch.float32, torch.device("cpu"))
    g.fill_(1.0)
    p.grad = g
    del g
    assert _ptr(blocks.empty((MB // 4,), torch.float32, torch.device("cpu"))) != _ptr(p.grad)
    # a weight saved for backward by a matmul, the graph kept
    w = blocks.empty((512, 512), torch.float32, torch.device("cpu")).copy_(torch.eye(512))
    x = torch.ones(3, 512, requires_grad=True)
    y = (x @ w).sum()
    w_ptr = _ptr(w)
    del w
    for _ in range(hostbuf.KEEP + 1):
        other = blocks.empty((512, 512), torch.float32, torch.device("cpu"))
        assert _ptr(other) != w_ptr, "a block a graph saved was handed out"
        other.fill_(7.0)  # would corrupt the saved weight if it were the same memory
    y.backward()
    torch.testing.assert_close(x.grad, torch.ones(3, 512))


def test_a_turn_forgets_the_idle_sizes_the_last_two_windows_did_not_take():
    blocks, cpu = HostBlocks(), torch.device("cpu")
    a = blocks.empty((MB // 4,), torch.float32, cpu)  # a size window 0 needs
    del a
    blocks.turn()
    b = blocks.empty((MB // 2,), torch.float32, cpu)  # window 1 needs another
    held = blocks.empty((3 * MB // 8,), torch.float32, cpu)  # and holds this one on
    del b
    blocks.turn()  # window 2 opens: windows 0 and 1 are the last two
    assert blocks.kept_bytes() == MB + 2 * MB + 3 * MB // 2, "a size one of the last two windows took is gone"
    blocks.turn()  # window 3
    assert blocks.kept_bytes() == 2 * MB + 3 * MB // 2, "window 0's idle size is still kept"
    blocks.turn()  # window 4: window 1's idle size goes, its held one stays
    assert blocks.kept_bytes() == 3 * MB // 2
    again = blocks.empty((3 * MB // 8,), torch.float32, cpu)
    assert _ptr(again) != _ptr(held), "a held block was handed out"
    del held, again
    blocks.turn()  # window 5: the one window 4 took stays; the one taken in window 1 goes
    assert blocks.kept_bytes() == 3 * MB // 2
    blocks.turn()
    blocks.turn()
    assert blocks.kept_bytes() == 0


def test_small_or_device_tensors_are_fresh():
    blocks = HostBlocks()
    for _ in range(2):
        small = blocks.empty((16,), torch.float32, torch.device("cpu"))
        del small
    assert blocks.kept_bytes() == 0
    meta = blocks.empty((MB,), torch.float32, torch.device("meta"))
    assert meta.device.type == "meta" and blocks.kept_bytes() == 0


def test_at_most_keep_blocks_per_size():
    blocks = HostBlocks()
    held = [blocks.empty((MB // 4,), torch.float32, torch.device("cpu")) for _ in range(hostbuf.KEEP + 2)]
    assert len({_ptr(t) for t in held}) == hostbuf.KEEP + 2
    assert blocks.kept_bytes() == hostbuf.KEEP * MB


E, H, T, STEPS, MICRO = 8, 32, 48, 4, 3


def _worker(rank, world, policy, set_to_none, comm=None):
    from megatron_rails import no_sync
    from megatron_rails.runtime import hostbuf as hb

    hb.MIN_BYTES = 0  # every block of the step kept, at this small size too
    cfg = {"policy": policy, "slots": 2, "comm": "direct", "tolerance": 0.0, **(comm or {})}
    stock, rails = stock_and_rails(world, cfg, seed=3, experts=E, hidden=H)
    u = torch.tensor(np.random.default_rng(1).standard_normal(H), dtype=torch.float32)
    with torch.no_grad():
        for layer in (stock, rails):
            layer.router.weight[0].add_(3.0 * u / u.norm())  # expert 0 hot: slots move
    store = rails.token_dispatcher.store
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (stock, rails)]
    w = torch.linspace(-1, 1, T * H).view(T, 1, H)
    kept = []
    for step in range(STEPS):
        for micro in range(MICRO):
            gen = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
            x = (torch.randn(T, H, generator=gen) + 2.0 * u / u.norm()).view(T, 1, H)
            for i, layer in enumerate((stock, rails)):
                gate = no_sync() if i == 1 and micro < MICRO - 1 else contextlib.nullcontext()
                with gate:
                    ((layer(x.clone())[0] * w).sum() / T).backward()
        window = store.window
        assert window is not None and window.moved, f"{policy}: no slot moved"
        weights_ptr = _ptr(window.weights_NW)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        got, ref = rails.state_dict(), stock.state_dict()
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{policy}, rank {rank}, after step {step}, {k}: {m}")
        ptrs = {st.data_ptr() for st in store.blocks.storages()}
        if window.weights_NW.numel():  # (an ultraep rank may receive no replica)
            assert weights_ptr in ptrs, f"{policy}, rank {rank}, step {step}: the slot weights are not a kept block"
        kept.append(ptrs)
        del window  # as a training loop holds none
    # from the second step on the same blocks come back: none allocated, none forgotten
    assert all(p == kept[1] for p in kept[1:]), f"{policy}, rank {rank}: kept blocks changed after step 1"
    anywhere = torch.tensor([float(store.blocks.kept_bytes())])
    torch.distributed.all_reduce(anywhere)
    assert anywhere.item() > 0, f"{policy}: no rank kept a block"
    return rails


def _cases_worker(rank, world):
    for policy, set_to_none in (("fsep", True), ("fsep", False), ("ultraep", True)):
        _worker(rank, world, policy, set_to_none)



def test_training_on_kept_blocks_matches_stock():
    spawn(_cases_worker, 2)


def _sprayed_worker(rank, world):
    # RailS over two nodes of two ranks: skewed exchanges spray (their phases make their own buffers)
    sprayed = {"comm": "rails", "ranks_per_node": 2, "rails_tolerance": 0.0}
    comm = _worker(rank, world, "fsep", True, sprayed).token_dispatcher.runtime.comm
    assert comm.sprayed > 0, f"RailS sprayed {comm.sprayed}, sent direct {comm.direct}"


def test_sprayed_exchanges_on_kept_blocks_match_stock():
    spawn(_sprayed_worker, 4)
