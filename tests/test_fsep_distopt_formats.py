"""fsep checkpoints under every sharding type of Megatron-Core's DistributedOptimizer, against stock EP:
saved by a 4-rank run (EP 2, two expert-data-parallel replicas) with Adam, loaded into fresh models at
the same and at other parallel sizes (gloo ranks, Megatron DDP; tests/ddp_harness.py).

A stock run and an fsep run from the same weights train a step and save with the type. Each run
loads its own checkpoint, and in the model-space format (`fully_reshardable`: every optimizer state
in the model parameters' layout) each the other's too, into models moved off those weights and
trained a step on other data; then every loaded model trains one more step. The reference is
stock loading stock's checkpoint at the same parallel sizes: losses and parameters equal it (Adam's
step depends on the loaded moments; a lost or misplaced state shows in the step after the load). In
`fully_reshardable` fsep's checkpoint holds stock's tensors, key by key. That format reloads at other
expert-parallel sizes as long as the run has as many chained optimizers (dense, experts') as the
saving one: at world 2, EP 1 megatron-core 0.19.2 builds one, and the load fails for stock as for fsep.

The buffer formats (`dp_reshardable`, `dp_zero_gather_scatter`: the optimizer's flat buffers by
data-parallel rank) hold the buffers of the run's own layout: they reload under the same policy and
expert-parallel size only, at any data-parallel size, as for stock. `fully_sharded_model_space`
(flattened ranges of the model entries) is rejected by Megatron-Core 0.16.1 and 0.19.2 themselves
for every parameter (ShardedTensor refuses `flattened_range`): fsep fails there as stock does, when
the optimizer's sharded state dict is made.
"""
import os

import pytest
import torch
import torch.distributed as dist

from moe_harness import spawn
from test_fsep_dist_checkpoint import ADAM, _params, _state, _stop_writer_manager

SAVE = dict(world=4, ep=2)
# sharding type: the (world, ep) layouts loaded at, and whether the runs load each other's checkpoint
FORMATS = {
    "dp_reshardable": ([(4, 2), (2, 2)], False),
    "dp_zero_gather_scatter": ([(4, 2), (2, 2)], False),
    "fully_reshardable": ([(4, 2), (2, 2), (4, 4)], True),
}
POLICIES = ("stock", "fsep")


def _run(ep, policy, u, source=None):
    """(model, (ddp, optimizer)) under `policy` at expert-parallel size `ep`, Adam through the
    distributed optimizer; the weights of `source` (a model of the same layout) where given."""
    from ddp_harness import megatron_ddp

    import test_lifecycle_ddp as lc

    model = lc._build(ep, policy, u)  # its first argument is only the config's EP size
    if source is not None:
        model.layer.load_state_dict(source.layer.state_dict())
    return model, megatron_ddp(model, overlap_grad_reduce=False, use_distributed_optimizer=True, lr=0.05,
                               optimizer="adam", **ADAM)


def _save_worker(rank, world, root, sharding, ep):
    from megatron.core import dist_checkpointing
    from ddp_harness import cpu_megatron, train_step

    import test_lifecycle_ddp as lc

    H, u = lc._setup(rank, world)
    try:
        with cpu_megatron():
            stock, stock_run = _run(ep, "stock", u)
            runs = {"stock": stock_run, "fsep": _run(ep, "fsep", u, stock)[1]}
            for name, (ddp, opt) in runs.items():
                train_step(ddp, opt, lc._microbatches(rank, 0, u, H), lc._loss_fn(False))
                path = os.path.join(root, sharding, name)
                if rank == 0:
                    os.makedirs(path)
                dist.barrier()
                dist_checkpointing.save(_state(ddp, opt, sharding, False), path)
            saved = {name: {k: v for k, v in dist_checkpointing.load_plain_tensors(
                os.path.join(root, sharding, name)).items() if torch.is_tensor(v)} for name in POLICIES}
            want, got = saved["stock"], saved["fsep"]
            if not FORMATS[sharding][1]:  # the optimizer's buffers are in each policy's layout: the model's only
                want, got = ({k: v for k, v in d.items() if k.startswith("model.")} for d in (want, got))
            assert set(got) == set(want), f"{sharding}: keys {sorted(set(got) ^ set(want))}"
            if FORMATS[sharding][1]:
                assert any(k.startswith("optimizer.state.exp_avg.") and ".experts." in k for k in want), \
                    f"{sharding}: no expert optimizer state saved ({sorted(want)})"
            for k, v in want.items():
                torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{sharding}: saved {k}, rank {rank}\n{m}")
    finally:
        _stop_writer_manager()


def _load_worker(rank, world, root, sharding, ep):
    from megatron.core import dist_checkpointing
    from ddp_harness import cpu_megatron, train_step

    import test_lifecycle_ddp as lc

    H, u = lc._setup(rank, world)
    loss_fn = lc._loss_fn(False)
    cross = FORMATS[sharding][1]
    pairs = [(by, into) for by in POLICIES for into in POLICIES if cross or by == into]
    results = {}
    try:
        with cpu_megatron(), _torch_adam_steps():
            for by, into in pairs:
                where = f"{sharding} at world {world} EP {ep}: saved by {by}, loaded into {into}, rank {rank}"
                model, (ddp, opt) = _run(ep, into, u)
                with torch.no_grad():  # off the checkpoint's weights (the build seeds itself alike)
                    g = torch.Generator().manual_seed(100 + rank)
                    for p in model.parameters():
                        if 0 not in p.stride():  # not fsep's freed stock expert copies
                            p.add_(0.1 * torch.randn(p.shape, generator=g).to(p.dtype))
                # trained on other data first: the load must replace weights and optimizer state alike
                train_step(ddp, opt, lc._microbatches(rank, 2, u, H), loss_fn)
                loaded = dist_checkpointing.load(_state(ddp, opt, sharding, True), os.path.join(root, sharding, by))
                ddp.module.load_state_dict(loaded["model"])
                with torch.no_grad():  # Megatron-Core's dp_reshardable load copies into fp32 parameters that
                    opt.load_state_dict(loaded["optimizer"])  # are their own main params, outside no_grad
                losses = train_step(ddp, opt, lc._microbatches(rank, 1, u, H), loss_fn)
                results[by, into] = where, torch.tensor(losses), _params(model)
        _, want_losses, want = results["stock", "stock"]
        for where, losses, got in results.values():
            torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{where}: losses of the step after the load\n{m}")
            assert set(got) == set(want), where
            for k, v in want.items():
                torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{where}: {k} after the step after the load\n{m}")
    finally:
        _stop_writer_manager()


class _torch_adam_steps:
    """Megatron-Core's distributed optimizer is written for Apex's or Transformer Engine's Adam,
    which keep the step in the parameter groups; torch's AdamW (all there is on CPU) keeps a
    per-parameter `step` tensor, and two stock load paths then go wrong, stock or fsep alike:

    * DistributedOptimizer.load_state_dict gives every parameter's state one shared `step` tensor,
      which torch's AdamW then increments once per parameter and step (after a load an optimizer
      of n parameters counts n steps per step; its bias correction runs ahead);
    * the model-space formats do not save `step`, and their load fails on its absence.

    While inside, each parameter keeps a `step` of its own after a load, and a loaded state without
    one leaves the optimizer's (the runs here stepped once before saving and once before loading,
    so it is the saved one)."""

    def __enter__(self):
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        self.old = DistributedOptimizer.load_state_dict, DistributedOptimizer._set_main_param_and_optimizer_states
        load, set_states = self.old

        def load_state_dict(opt, state_dict):
            load(opt, state_dict)
            for state in opt.optimizer.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()

        def set_own_step(opt, model_param, tensors):
            if "step" not in tensors:
                group_index, group_order = opt.model_param_group_index_map[model_param]
                main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
                step = opt.optimizer.state[main_param].get("step")
                if step is not None:
                    tensors = {**tensors, "step": step.clone()}
            return set_states(opt, model_param, tensors)

        DistributedOptimizer.load_state_dict = load_state_dict
        DistributedOptimizer._set_main_param_and_optimizer_states = set_own_step
        return self

    def __exit__(self, *exc):
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        DistributedOptimizer.load_state_dict, DistributedOptimizer._set_main_param_and_optimizer_states = self.old


@pytest.mark.parametrize("sharding", list(FORMATS))
def test_fsep_distributed_optimizer_checkpoint_round_trips_as_stock(sharding, tmp_path):
    spawn(_save_worker, SAVE["world"], str(tmp_path), sharding, SAVE["ep"], ep=SAVE["ep"])
    for world, ep in FORMATS[sharding][0]:
        spawn(_load_worker, world, str(tmp_path), sharding, ep, ep=ep)


def _flattened_worker(rank, world):
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from ddp_harness import cpu_megatron, train_step

    import test_lifecycle_ddp as lc

    H, u = lc._setup(rank, world)
    with cpu_megatron():
        for policy in POLICIES:
            model, (ddp, opt) = _run(world, policy, u)
            # Megatron-Core 0.19.2's DistributedOptimizer.state_dict() needs the optimizer stepped
            train_step(ddp, opt, lc._microbatches(rank, 0, u, H), lc._loss_fn(False))
            for loading in (False, True):
                for part in opt.chained_optimizers:  # the dense one, then the experts' alone
                    with pytest.raises(CheckpointingException, match="flattened_range"):
                        model_sd = ddp.module.sharded_state_dict(metadata={"singleton_local_shards": False})
                        part.sharded_state_dict(model_sd, is_loading=loading,
                                                metadata={"distrib_optim_sharding_type": "fully_sharded_model_space"})


def test_fully_sharded_model_space_fails_under_fsep_as_under_stock():
    """Megatron-Core's ShardedTensor refuses flattened ranges: fsep's experts' optimizer state fails
    with stock's error, where stock's experts fail (when the state dict is made, saving or loading)."""
    spawn(_flattened_worker, 2)
