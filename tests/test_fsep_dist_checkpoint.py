"""fsep under Megatron's distributed checkpoints with a stateful optimizer (Adam), on 2 gloo ranks (an
MoE layer, and a 2-layer GPTModel whose TransformerBlock names the entries as in real runs):
model and optimizer saved by megatron.core.dist_checkpointing as Megatron-LM saves them, loaded
into a fresh model, trained on; against the stock dispatcher trained straight through.

The model and the optimizer state are in the stock layout: an fsep checkpoint loads into a stock
model and a stock checkpoint into an fsep one (the regular optimizer and the distributed one's
`fully_reshardable` format); the distributed optimizer's default `dp_reshardable` format (its
buffers) reloads into the same layout. References: stock's checkpoint of the same training (every
tensor saved, model and optimizer state, key by key) and stock training without a checkpoint. Adam's
second step depends on the first one's moments, so a lost or misplaced optimizer state fails the
comparison of the parameters after it. The model loaded into has trained a step on other data.
"""
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moe_harness import spawn

CASES = {  # name: (use_distributed_optimizer, distrib_optim_sharding_type, (saved by, loaded into) pairs,
    #        whether fsep's checkpoint must hold stock's tensors)
    "regular": (False, None, [("fsep", "stock"), ("stock", "fsep"), ("fsep", "fsep")], True),
    # Megatron-Core loads this format only with Apex's or Transformer Engine's Adam (torch's keeps a
    # per-parameter step the format does not save): compared as saved
    "distopt-fully-reshardable": (True, "fully_reshardable", [], True),
    # buffers by data-parallel rank: reloads into the same model only, as for stock EP
    "distopt-dp-reshardable": (True, "dp_reshardable", [("fsep", "fsep")], False),
}
ADAM = dict(adam_eps=1e-3)


def _metadata(sharding):
    out = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if sharding is not None:
        out["distrib_optim_sharding_type"] = sharding
    return out


def _state(ddp, opt, sharding, loading):
    """{model, optimizer} as Megatron-LM's generate_state_dict makes them. The model's keys are
    renamed in place after the modules made them, as TransformerBlock renames its layers'
    ('decoder.layers.<local index>.' -> 'decoder.layers.'), before the optimizer reads them."""
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

    meta = _metadata(sharding)
    model = ddp.module.sharded_state_dict(metadata=meta)
    replace_prefix_for_sharding(model, "layer.", "decoder.layers.")
    return {"model": model, "optimizer": opt.sharded_state_dict(model, is_loading=loading, metadata=meta)}


def _params(model):
    return {k: v.detach().clone() for k, v in model.layer.state_dict().items() if torch.is_tensor(v)}


def _stop_writer_manager():
    """megatron.core.dist_checkpointing's file writer starts a Manager process per process for its
    results queue and never stops it; these ranks end by os._exit, which would leave it running."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = filesystem_async._results_queue
    if queue is not None:
        queue._manager.shutdown()
        filesystem_async._results_queue = None


def _worker(rank, world, root, case):
    try:
        _train_save_load(rank, world, root, case)
    finally:
        _stop_writer_manager()


def _train_save_load(rank, world, root, case):
    from megatron.core import dist_checkpointing
    from ddp_harness import cpu_megatron, megatron_ddp, train_step

    import test_lifecycle_ddp as lc

    dopt, sharding, pairs, same_tensors = CASES[case]
    H, u = lc._setup(rank, world)
    loss_fn = lc._loss_fn(False)

    def trained(policy, source=None):
        model = lc._build(world, policy, u)
        if source is not None:
            model.layer.load_state_dict(source.layer.state_dict())
        return model, megatron_ddp(model, overlap_grad_reduce=False, use_distributed_optimizer=dopt, lr=0.05,
                                   optimizer="adam", **ADAM)

    with cpu_megatron():
        stock, stock_run = trained("stock")
        fsep, fsep_run = trained("fsep", stock)
        first = lc._microbatches(rank, 0, u, H)
        for run in (stock_run, fsep_run):
            train_step(*run, first, loss_fn)
        saved = {"stock": stock_run, "fsep": fsep_run}
        for name, (ddp, opt) in saved.items():
            path = os.path.join(root, case, name)
            if rank == 0:
                os.makedirs(path)
            dist.barrier()
            dist_checkpointing.save(_state(ddp, opt, sharding, False), path)
        at_save = {"stock": _params(stock), "fsep": _params(fsep)}  # the weights each checkpoint holds
        if same_tensors:  # every tensor fsep saved, model and optimizer state, is stock's
            want_saved, got_saved = ({k: v for k, v in dist_checkpointing.load_plain_tensors(
                os.path.join(root, case, name)).items() if torch.is_tensor(v)} for name in ("stock", "fsep"))
            assert set(got_saved) == set(want_saved), f"{case}: keys {sorted(set(got_saved) ^ set(want_saved))}"
            assert any(k.startswith("optimizer.state.exp_avg.") and "experts" in k for k in want_saved), \
                f"{case}: no expert optimizer state saved: the case is not exercised ({sorted(want_saved)})"
            for k, v in want_saved.items():
                torch.testing.assert_close(got_saved[k], v, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{case}: saved {k}, rank {rank}\n{m}")
        # the reference goes on without a checkpoint
        second = lc._microbatches(rank, 1, u, H)
        want_losses = train_step(*stock_run, second, loss_fn)
        want = _params(stock)
        for by, into in pairs:
            where = f"{case}: saved by {by}, loaded into {into}, rank {rank}"
            model, (ddp, opt) = trained(into)
            # other weights than the checkpoint's: the build seeds itself (the checkpoint's initial
            # weights), so every parameter is moved off them here
            with torch.no_grad():
                g = torch.Generator().manual_seed(100 + rank)
                for p in model.parameters():
                    if 0 not in p.stride():  # not fsep's freed stock expert copies (its experts are the shards)
                        p.add_(0.1 * torch.randn(p.shape, generator=g).to(p.dtype))
            # trained on other data first: the load must replace weights and optimizer state alike
            # (and the distributed optimizer without Apex or Transformer Engine has no state to
            # load into before its first step)
            train_step(ddp, opt, lc._microbatches(rank, 2, u, H), loss_fn)
            before = _params(model)
            same = [k for k, v in at_save[by].items() if torch.equal(before[k], v)]
            assert not same, f"{where}: equal to the checkpoint before the load: {same}"
            state = _state(ddp, opt, sharding, True)
            loaded = dist_checkpointing.load(state, os.path.join(root, case, by))
            ddp.module.load_state_dict(loaded["model"])
            with torch.no_grad():  # Megatron-Core's dp_reshardable load copies into fp32 parameters that
                opt.load_state_dict(loaded["optimizer"])  # are their own main params, outside no_grad
            got_losses = train_step(ddp, opt, second, loss_fn)
            torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{where}: losses of the step after the load\n{m}")
            got = _params(model)
            assert set(got) == set(want), where
            for k, v in want.items():
                torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{where}: {k} after the step after the load\n{m}")


@pytest.mark.parametrize("case", list(CASES))
def test_fsep_checkpoint_with_optimizer_state_matches_stock(case, tmp_path):
    spawn(_worker, 2, str(tmp_path), case)


def _gpt_worker(rank, world, root):
    """A 2-layer MoE GPTModel (the demo's), where Megatron's own TransformerBlock names the layers'
    entries: fsep's checkpoint with Adam equals stock's, tensor for tensor."""
    import megatron_rails
    from megatron.core import dist_checkpointing
    from megatron_rails.demo import train as demo

    from ddp_harness import cpu_megatron, megatron_ddp, train_step

    shape = demo.DemoShape(layers=2, hidden=32, heads=4, ffn=48, experts=4, topk=2, vocab=64, seq=16)

    def loss_fn(model, microbatch):
        tokens, pos, mask, labels = microbatch
        return model(tokens, pos, mask, labels=labels).float().mean()

    try:
        with cpu_megatron():
            stock = demo.build_model(shape, world, "allgather", seed=11)
            megatron_rails.install({"policy": "fsep", "comm": "direct"})
            try:
                fsep = demo.build_model(shape, world, "alltoall", seed=11)
            finally:
                megatron_rails.uninstall()
            fsep.load_state_dict(stock.state_dict())
            batches = [demo.batch(shape, rank, i) for i in range(2)]
            for name, model in (("stock", stock), ("fsep", fsep)):
                ddp, opt = megatron_ddp(model, overlap_grad_reduce=False, use_distributed_optimizer=False, lr=0.01,
                                        optimizer="adam", **ADAM)
                train_step(ddp, opt, batches, loss_fn)
                path = os.path.join(root, name)
                if rank == 0:
                    os.makedirs(path)
                dist.barrier()
                meta = _metadata(None)
                model_sd = ddp.module.sharded_state_dict(metadata=meta)
                dist_checkpointing.save({"model": model_sd,
                                         "optimizer": opt.sharded_state_dict(model_sd, metadata=meta)}, path)
            want, got = ({k: v for k, v in dist_checkpointing.load_plain_tensors(os.path.join(root, name)).items()
                          if torch.is_tensor(v)} for name in ("stock", "fsep"))
            assert set(got) == set(want), sorted(set(got) ^ set(want))
            experts = [k for k in want if k.startswith("optimizer.state.exp_avg.") and ".experts." in k]
            assert experts, f"no expert optimizer state saved: the case is not exercised ({sorted(want)})"
            for k, v in want.items():
                torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5, msg=lambda m: f"saved {k}, rank {rank}\n{m}")
    finally:
        _stop_writer_manager()


def test_gpt_model_checkpoint_with_optimizer_state_equals_stock(tmp_path):
    spawn(_gpt_worker, 2, str(tmp_path))
