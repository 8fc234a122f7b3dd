"""fsep's expert biases are stock parameters: weight decay, the optimizer's parameter groups and its
checkpoint are stock EP's (runtime/sharded.py shards the weights only).

Stock Megatron-Core exempts biases and 1-D parameters from weight decay (`wd_mult` 0 in
megatron.core.optimizer.get_standard_config_overrides), which applies per parameter group. A SequentialMLP
layer with `add_bias_linear` (nonzero biases, so that decay moves them from the first step) trained
with weight decay 0.1 under Megatron's own DDP, optimizer (Adam) and parameter scheduler (which sets
each group's decay as Megatron-LM's does) on 2 gloo ranks (EP 2), against the stock allgather
dispatcher from the same weights: losses and every parameter (stock layout) after each of 3 steps
equal to 1e-5, with and without overlap_grad_reduce and the distributed optimizer. The parameter groups
are stock's: the same groups in the same order, each with stock's wd_mult, lr_mult, expert-parallel
flag and decay, over the same stock parameters by name (the shard parameter standing in for the
weights it holds). The regular optimizer's distributed checkpoint (megatron.core.dist_checkpointing)
holds stock's tensors key by key and stock's parameter groups.
"""
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moe_harness import spawn

E, LR, WD, STEPS = 8, 0.1, 0.1, 3
ADAM = dict(adam_eps=1.0)  # Adam's update then stays close to proportional to the gradient
COMBOS = [(False, False), (True, False), (False, True), (True, True)]  # overlap_grad_reduce, distopt
GROUP_FIELDS = ("wd_mult", "lr_mult", "is_expert_parallel", "weight_decay", "lr")


def _build(world, policy, u):
    from ddp_harness import skewed_chunk

    model = skewed_chunk(world, policy, u, E, bias=True)
    if policy == "stock":  # biases are built zero, which no decay moves; fsep loads stock's
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for name, p in model.layer.named_parameters():
                if name.endswith(".bias"):
                    p.copy_(torch.randn(p.shape, generator=g))
    return model


def _trained(model, ogr, dopt):
    """Megatron DDP, optimizer and the parameter scheduler that sets every group's weight decay."""
    from ddp_harness import megatron_ddp
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    ddp, opt = megatron_ddp(model, overlap_grad_reduce=ogr, use_distributed_optimizer=dopt, lr=LR, optimizer="adam",
                            bucket_size=1000 if ogr else None, weight_decay=WD, **ADAM)
    OptimizerParamScheduler(opt, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0, lr_decay_steps=STEPS,
                            lr_decay_style="constant", start_wd=WD, end_wd=WD, wd_incr_steps=STEPS,
                            wd_incr_style="constant")
    return ddp, opt


def _groups(model, opt, names: bool):
    """The optimizer's parameter groups, in order: (stock's fields, the stock parameter names they
    train, or None where the optimizer trains copies: the distributed optimizer's main params).
    fsep's shard parameter stands for the stock weights it holds."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    store = getattr(model.layer.token_dispatcher, "store", None)
    sharded = getattr(store, "PARAM", None)
    out = []
    for g in opt.param_groups:
        trains = None
        if names:
            trains = set()
            for p in g["params"]:
                n = name_of[id(p)]
                if sharded is not None and n.endswith(sharded):  # the weights it holds, by stock name
                    trains.update(n[:-len(sharded)] + k for k in store.params)
                else:
                    trains.add(n)
        out.append((tuple(g[f] for f in GROUP_FIELDS), trains))
    return out


def _saved(ddp, opt, path):
    """Model and optimizer saved as Megatron-LM saves them; (their tensors, the optimizer's common state)."""
    from megatron.core import dist_checkpointing
    from test_fsep_dist_checkpoint import _metadata

    if dist.get_rank() == 0:
        os.makedirs(path)
    dist.barrier()
    meta = _metadata(None)
    model_sd = ddp.module.sharded_state_dict(metadata=meta)
    dist_checkpointing.save({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, metadata=meta)}, path)
    tensors = {k: v for k, v in dist_checkpointing.load_plain_tensors(path).items() if torch.is_tensor(v)}
    return tensors, dist_checkpointing.load_common_state_dict(path)["optimizer"]


def _param_groups(common) -> list:
    """Every saved parameter group without its parameter indices (fsep's groups hold the shard
    parameter where stock's hold the weights), however the chained optimizer nests them."""
    if isinstance(common, dict) and "param_groups" in common:
        return [{k: v for k, v in g.items() if k != "params"} for g in common["param_groups"]]
    values = common.values() if isinstance(common, dict) else common if isinstance(common, list) else []
    return [g for v in values for g in _param_groups(v)]


def _worker(rank, world, root):
    from ddp_harness import cpu_megatron, full_params, train_step
    from test_fsep_dist_checkpoint import _stop_writer_manager

    import test_lifecycle_ddp as lc

    H, u = lc._setup(rank, world)
    loss_fn = lc._loss_fn(False)
    try:
        with cpu_megatron():
            for ogr, dopt in COMBOS:
                where = f"overlap_grad_reduce={ogr} distopt={dopt} rank {rank}"
                models = {p: _build(world, p, u) for p in ("stock", "fsep")}
                models["fsep"].layer.load_state_dict(models["stock"].layer.state_dict())
                runs = {p: _trained(m, ogr, dopt) for p, m in models.items()}
                want_groups, got_groups = (_groups(models[p], runs[p][1], not dopt) for p in ("stock", "fsep"))
                assert got_groups == want_groups, f"{where}: parameter groups\n{got_groups}\nstock's\n{want_groups}"
                decays = {fields[0]: fields[3] for fields, _ in want_groups}
                assert decays == {0.0: 0.0, 1.0: WD}, f"{where}: stock's decay is not on where it applies: {decays}"
                bias = [n for n, _ in models["stock"].named_parameters() if n.endswith(".bias")]
                assert bias, f"{where}: the layer has no biases"
                for step in range(STEPS):
                    mbs = lc._microbatches(rank, step, u, H)
                    before = full_params(runs["stock"][0])
                    want = train_step(*runs["stock"], mbs, loss_fn)
                    got = train_step(*runs["fsep"], mbs, loss_fn)
                    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5,
                                               msg=lambda m: f"{where} step {step}: losses\n{m}")
                    ref = full_params(runs["stock"][0])
                    assert all(not torch.equal(ref[n], before[n]) for n in bias), f"{where}: a bias did not move"
                    state = models["fsep"].layer.state_dict()  # stock layout
                    for k, v in ref.items():
                        k = k[len("layer."):]
                        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-5,
                                                   msg=lambda m: f"{where} step {step}: {k}\n{m}")
                if dopt:
                    continue
                (want_t, want_c), (got_t, got_c) = (
                    _saved(*runs[p], os.path.join(root, f"{p}-{ogr}")) for p in ("stock", "fsep"))
                assert set(got_t) == set(want_t), f"{where}: saved keys {sorted(set(got_t) ^ set(want_t))}"
                assert any(k.startswith("optimizer.state.exp_avg.") and k.endswith(".bias") for k in want_t), \
                    f"{where}: no bias optimizer state saved ({sorted(want_t)})"
                for k, v in want_t.items():
                    torch.testing.assert_close(got_t[k], v, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}: saved {k}\n{m}")
                assert _param_groups(got_c) == _param_groups(want_c) != [], \
                    f"{where}: saved parameter groups\n{_param_groups(got_c)}\nstock's\n{_param_groups(want_c)}"
    finally:
        _stop_writer_manager()


def test_fsep_biases_train_and_save_as_stock_under_weight_decay(tmp_path):
    spawn(_worker, 2, str(tmp_path))
