"""Checkpoints and determinism on 4 CPU ranks (tiny Mixtral-shaped GPTModel, skewed routing, SGD).

For every policy (and the RailS all-to-all under fsep and ultraep):
* determinism: two identical runs give bit-identical per-step losses;
* a checkpoint written to disk under the policy has exactly the stock model's keys and loads strictly
  into a stock Megatron-Core model; resumed under the same policy it continues bit-identically;
* the reverse: a stock checkpoint loads into the policy's model and training continues as stock does
  (1e-5 relative: the policies sum in a different order);
* switching policy between save and resume continues within 1e-5 relative of the uninterrupted run.
Runs that sum in different orders are compared by tests/flips.py's rule: 1e-5 until a routing flip,
flips bounded by stock alltoall's own against stock allgather.
"""
from __future__ import annotations

import os


from moe_harness import spawn

CASES = [("none", "direct"), ("eplb", "direct"), ("ultraep", "direct"), ("lp", "direct"), ("fsep", "direct"),
         ("fsep", "rails")]
if float(os.environ.get("MEGATRON_RAILS_TEST_SCALE", "1")) < 1:  # CI's second Megatron-Core version
    CASES = [("ultraep", "direct"), ("fsep", "rails"), ("lp", "direct")]
STEPS, HALF = 6, 3


def _shape():
    from megatron_rails.demo.train import DemoShape

    return DemoShape(layers=1)  # one MoE layer keeps 6 cases x 7 runs inside the CI budget


def _build(case, world):
    import megatron_rails
    from megatron_rails.demo.train import build_model

    if case == "stock":
        return build_model(_shape(), world, "allgather")
    policy, comm = case
    megatron_rails.install({"policy": policy, "slots": 2, "ranks_per_node": 2, "comm": comm, "interval": 2,
                            "window": 2})
    try:
        return build_model(_shape(), world, "alltoall")
    finally:
        megatron_rails.uninstall()


def _train(model, steps, rank, world, start=0):
    from megatron_rails.demo.train import make_optimizer, train_steps

    losses, _ = train_steps(model, _shape(), steps, rank, world, opt=make_optimizer(model, "sgd"), start=start)
    return losses


def _logged(model, steps, rank, world, start=0):
    """(losses, RoutingLog) of `steps` steps (one router forward per step: one microbatch)."""
    from flips import RoutingLog

    log = RoutingLog(model)
    losses = _train(model, steps, rank, world, start)
    log.close()
    return losses, log


def _control(rank, world):
    """Stock alltoall's routing over the whole run (tests/flips.py's control)."""
    from flips import stock_alltoall
    from megatron_rails.demo.train import build_model

    with stock_alltoall():
        return _logged(build_model(_shape(), world, "alltoall"), STEPS, rank, world)[1]


def _save_load(model, path):
    import torch

    torch.save(model.state_dict(), path)
    return torch.load(path, weights_only=True)


def _close(a, b, what, control, start=0):
    """a, b: (losses, RoutingLog) of the same steps from `start` on, compared by the long-run rule."""
    from flips import check_against_stock, step_flips

    (got, got_log), (ref, ref_log) = a, b
    check_against_stock(got, ref, step_flips(got_log, ref_log, len(ref)), lambda: control(start), what)


def _worker(rank, world, tmp):
    import torch

    from megatron_rails.demo.train import dispatcher_metrics

    torch.set_num_threads(1)
    from flips import Control

    stock = _build("stock", world)
    stock_keys = set(stock.state_dict())
    stock_full, stock_log = _logged(stock, STEPS, rank, world)
    control = Control(lambda: _control(rank, world), stock_log, STEPS)
    stock_half = _build("stock", world)
    _train(stock_half, HALF, rank, world)
    stock_ckpt = _save_load(stock_half, f"{tmp}/stock-{rank}.pt")
    for i, case in enumerate(CASES):
        name = "/".join(case)
        model = _build(case, world)
        full, full_log = _logged(model, STEPS, rank, world)
        if case[0] != "none":  # the skewed routing made the policy use replicas (summed over ranks)
            used = torch.tensor([float(sum(r["replicas_used"] for layer in dispatcher_metrics(model) for r in layer))])
            torch.distributed.all_reduce(used)
            assert used.item() > 0, f"{name}: no replica used in {STEPS} steps"
        again = _train(_build(case, world), STEPS, rank, world)
        assert again == full, f"{name}: two identical runs differ\n{full}\n{again}"
        _close((full, full_log), (stock_full, stock_log), f"{name} vs stock", control)
        rest = (full[HALF:], full_log.slice(HALF))  # the uninterrupted run's steps after the save

        model = _build(case, world)
        assert _train(model, HALF, rank, world) == full[:HALF]
        ckpt = _save_load(model, f"{tmp}/{case[0]}-{case[1]}-{rank}.pt")
        assert set(ckpt) == stock_keys, f"{name}: checkpoint keys differ from stock: {set(ckpt) ^ stock_keys}"
        resumed = _build(case, world)
        resumed.load_state_dict(ckpt, strict=True)
        assert _train(resumed, STEPS - HALF, rank, world, start=HALF) == full[HALF:], f"{name}: resume differs"

        into_stock = _build("stock", world)
        into_stock.load_state_dict(ckpt, strict=True)
        _close(_logged(into_stock, STEPS - HALF, rank, world, start=HALF), rest, f"{name} -> stock resume",
               control, HALF)

        from_stock = _build(case, world)
        from_stock.load_state_dict(stock_ckpt, strict=True)
        _close(_logged(from_stock, STEPS - HALF, rank, world, start=HALF),
               (stock_full[HALF:], stock_log.slice(HALF)), f"stock -> {name} resume", control, HALF)

        other = CASES[(i + 2) % len(CASES)]  # switch policy (and comm) between save and resume
        switched = _build(other, world)
        switched.load_state_dict(ckpt, strict=True)
        _close(_logged(switched, STEPS - HALF, rank, world, start=HALF), rest,
               f"{name} -> {'/'.join(other)} resume", control, HALF)


def test_checkpoints_and_determinism_every_policy(tmp_path):
    spawn(_worker, 4, str(tmp_path))


def _sharded_worker(rank, world):
    """fsep keeps the trained expert weights in its shards: Megatron's distributed-checkpoint path
    (sharded_state_dict) must see them, exactly as state_dict() does."""
    import torch

    from moe_harness import build_moe_layer, moe_config
    import megatron_rails

    torch.manual_seed(3)
    megatron_rails.install({"policy": "fsep", "slots": 1, "ranks_per_node": 2})
    try:
        layer = build_moe_layer(moe_config(world, "alltoall"))
    finally:
        megatron_rails.uninstall()
    store = layer.token_dispatcher.store
    with torch.no_grad():  # what training does to the shards; the stock copies go stale
        store.shards.add_(torch.randn(store.shards.shape, generator=torch.Generator().manual_seed(rank)))
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    sharded = layer.sharded_state_dict()  # first, and copied now: its tensors alias the parameters
    # the shards' one entry is for optimizers (megatron/fsep_checkpoint.py): the model saves nothing of it
    shards_entry = sharded.pop(next(k for k in sharded if k.endswith(store.PARAM)))
    assert isinstance(shards_entry.build(), LocalNonpersistentObject)
    sharded = {k: v.data.clone() for k, v in sharded.items() if torch.is_tensor(getattr(v, "data", None))}
    plain = layer.state_dict()
    expert_keys = [k for k in sharded if "experts." in k]
    # every stock expert parameter is in the view
    assert len(expert_keys) == len(store.params), list(sharded)
    # key by key: each entry holds its own expert's trained (shard) weights, not merely some expert's
    for k in expert_keys:
        assert k in plain, f"{k}: not a state_dict() key ({sorted(n for n in plain if 'experts.' in n)})"
        assert torch.equal(sharded[k], plain[k]), \
            f"{k}: the sharded checkpoint view does not hold this expert's trained (shard) weights"


def test_fsep_distributed_checkpoint_view_is_current():
    spawn(_sharded_worker, 2)
