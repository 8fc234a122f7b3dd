"""Training parity and checkpoints on 4 CPU ranks: a tiny Mixtral-shaped GPTModel (2 MoE layers,
hidden 64, 8 experts top-2) under skewed routing.

* per-step losses under fsep and ultraep match the stock allgather dispatcher within 1e-5 relative
  until a routing flip, and their flips are bounded by stock alltoall's own (tests/flips.py);
* a checkpoint written under fsep / ultraep has exactly the stock model's keys, loads strictly into a
  stock model, and training resumed from it is bit-identical to the uninterrupted run.
"""
from moe_harness import replicas_used, spawn

STEPS = 20
HALF = 10


def _build(policy, world):
    import megatron_rails
    from megatron_rails.demo.train import DemoShape, build_model

    shape = DemoShape()
    if policy == "stock":
        return build_model(shape, world, "allgather")
    megatron_rails.install({"policy": policy, "slots": 2, "ranks_per_node": 2})
    try:
        return build_model(shape, world, "alltoall")
    finally:
        megatron_rails.uninstall()


def _control(shape, rank, world):
    """Stock alltoall's routing over the run (tests/flips.py's control)."""
    from flips import RoutingLog, stock_alltoall
    from megatron_rails.demo.train import build_model, train_steps

    with stock_alltoall():
        model = build_model(shape, world, "alltoall")
        log = RoutingLog(model)
        train_steps(model, shape, STEPS, rank, world)
    return log


def _worker(rank, world, policies):
    import torch

    from flips import Control, RoutingLog, check_against_stock, step_flips
    from megatron_rails.demo.train import DemoShape, dispatcher_metrics, make_optimizer, train_steps

    torch.set_num_threads(1)
    shape = DemoShape()
    stock = _build("stock", world)
    ref_log = RoutingLog(stock)
    ref, _ = train_steps(stock, shape, STEPS, rank, world)
    control = Control(lambda: _control(shape, rank, world), ref_log, STEPS)
    stock_keys = set(_build("stock", world).state_dict())
    for policy in policies:
        model = _build(policy, world)
        log = RoutingLog(model)
        got, _ = train_steps(model, shape, STEPS, rank, world)
        # the skewed routing made the policy use replicas at least once (summed over layers and ranks)
        used = replicas_used(r for layer in dispatcher_metrics(model) for r in layer)
        assert used > 0, f"{policy}: no replica used in {STEPS} steps"
        check_against_stock(got, ref, step_flips(log, ref_log, STEPS), control, policy)
        assert got[-1] < got[0], f"{policy}: did not train: {got}"

        # checkpoint at HALF under `policy` (SGD: the weights are the whole training state)
        model = _build(policy, world)
        log = RoutingLog(model)
        first, opt = train_steps(model, shape, HALF, rank, world, opt=make_optimizer(model, "sgd"))
        ckpt = {k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}
        assert set(ckpt) == stock_keys, f"{policy}: checkpoint keys differ from stock: {set(ckpt) ^ stock_keys}"
        rest, _ = train_steps(model, shape, STEPS - HALF, rank, world, opt=opt, start=HALF)
        # resume under the same policy in a fresh model: bit-identical to the uninterrupted run
        again = _build(policy, world)
        again.load_state_dict(ckpt, strict=True)
        resumed, _ = train_steps(again, shape, STEPS - HALF, rank, world, opt=make_optimizer(again, "sgd"),
                                 start=HALF)
        assert resumed == rest, f"{policy}: resumed losses differ\n{rest}\n{resumed}"
        # resume in a stock model: the checkpoint is in stock layout
        stock = _build("stock", world)
        stock.load_state_dict(ckpt, strict=True)
        cont_log = RoutingLog(stock)
        cont, _ = train_steps(stock, shape, STEPS - HALF, rank, world, opt=make_optimizer(stock, "sgd"), start=HALF)
        check_against_stock(cont, rest, step_flips(cont_log, log.slice(HALF), STEPS - HALF), lambda: control(HALF),
                            f"{policy} -> stock resume")


def test_training_parity_and_checkpoints():
    spawn(_worker, 4, ["fsep", "ultraep"])
