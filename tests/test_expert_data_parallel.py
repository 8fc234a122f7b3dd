"""Expert-data-parallel replicas: 4 gloo ranks, EP = 2, so every expert lives on 2 ranks that
train it on different data and reduce its gradients over the expert-data-parallel group (every
other test runs EP = world). Megatron-Core's own DDP, optimizer and schedule (tests/ddp_harness.py),
steps of 4, 4, 4 and 2 microbatches with skewed routing, against the stock allgather dispatcher
trained the same way: losses and every parameter in stock layout after each step to 1e-5. Then
fsep's distributed checkpoint (Adam, the regular optimizer) holds stock's tensors, saved once per
replica set (Megatron's replica ids) and equal key by key.
"""
import os

import pytest
import torch
import torch.distributed as dist

from moe_harness import spawn

WORLD, EP = 4, 2


def _worker(rank, world, policy, overlap_grad_reduce, dopt, root):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from ddp_harness import cpu_megatron, full_params, megatron_ddp, train_step
    import test_fsep_dist_checkpoint as ck
    import test_lifecycle_ddp as lc

    assert ps.get_expert_data_parallel_world_size() == world // EP
    H, u = lc._setup(rank, EP)
    loss_fn = lc._loss_fn(False)
    kind = "adam" if dopt or root is not None else "sgd"  # Adam: optimizer state to checkpoint
    where = f"{policy}: overlap_grad_reduce={overlap_grad_reduce} distopt={dopt} rank {rank}"
    try:
        with cpu_megatron():
            models = {p: lc._build(EP, p, u) for p in ("stock", policy)}
            models[policy].layer.load_state_dict(models["stock"].layer.state_dict())
            runs = {p: megatron_ddp(m, overlap_grad_reduce=overlap_grad_reduce, use_distributed_optimizer=dopt,
                                    lr=lc.LR, optimizer=kind, bucket_size=1000 if overlap_grad_reduce else None,
                                    **(lc.ADAM if kind == "adam" else {}))
                    for p, m in models.items()}
            initial = {n: p.detach().clone() for n, p in models["stock"].layer.named_parameters()}
            for step in range(len(lc.MICRO)):
                mbs = lc._microbatches(rank, step, u, H)
                want = train_step(*runs["stock"], mbs, loss_fn)
                got = train_step(*runs[policy], mbs, loss_fn)
                torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{where} step {step}: losses\n{m}")
                ref = full_params(runs["stock"][0])
                if step == 0:  # equal parameters show something only where training moved them
                    still = [n for n, v in initial.items() if torch.equal(ref[f"layer.{n}"], v)]
                    assert not still, f"{where} step 0: stock parameters did not change: {still}"
                state = models[policy].layer.state_dict()  # stock layout
                for k, v in ref.items():
                    k = k[len("layer."):]
                    torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-5,
                                               msg=lambda m: f"{where} step {step}: {k}\n{m}")
            if root is None:
                return
            for name, (ddp, opt) in runs.items():
                path = os.path.join(root, name)
                if rank == 0:
                    os.makedirs(path)
                dist.barrier()
                dist_checkpointing.save(ck._state(ddp, opt, None, False), path)
            saved = {name: {k: v for k, v in dist_checkpointing.load_plain_tensors(os.path.join(root, name)).items()
                            if torch.is_tensor(v)} for name in runs}
            assert set(saved[policy]) == set(saved["stock"]), sorted(set(saved[policy]) ^ set(saved["stock"]))
            assert any(k.startswith("optimizer.state.exp_avg.") and "experts" in k for k in saved["stock"])
            for k, v in saved["stock"].items():
                torch.testing.assert_close(saved[policy][k], v, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{where}: saved {k}\n{m}")
    finally:
        ck._stop_writer_manager()


@pytest.mark.parametrize("policy,overlap_grad_reduce,dopt,checkpoint", [
    ("fsep", False, False, True), ("fsep", True, True, False), ("ultraep", True, False, False)])
def test_expert_data_parallel_replicas_train_like_stock(policy, overlap_grad_reduce, dopt, checkpoint, tmp_path):
    spawn(_worker, WORLD, policy, overlap_grad_reduce, dopt, str(tmp_path) if checkpoint else None, ep=EP)


# The two expert-data-parallel replicas plan apart: with this routing one EP group's ultraep moves a
# replica in some steps while the other's keeps the stock layout, so their backward graphs differ
# (a ReturnGate holds one group's owner gradients back until the slot gradients return) and their
# expert gradients become ready in different orders. Found by a randomized sweep of configurations.
ORDER_E, ORDER_TOKENS, ORDER_MICRO, ORDER_SEED = 6, 13, (1, 2, 2), 445657487


def _order_worker(rank, world):
    import numpy as np
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import param_and_grad_buffer as pgb

    import megatron_rails
    from ddp_harness import chunk, cpu_megatron, full_params, megatron_ddp, train_step
    from moe_harness import build_moe_layer, moe_config

    # what every bucket group does, in order: ("ready", group) when its last gradient arrived in a
    # backward (stock launches then), ("launch", group) when its reduction starts. Patched before DDP
    # is built, so that the in-order launcher wraps the recording start_grad_sync
    events = []
    start, ready = pgb._ParamAndGradBucketGroup.start_grad_sync, pgb._ParamAndGradBucketGroup.register_grad_ready

    def recording_start(self, *args, **kwargs):
        events.append(("launch", self))
        return start(self, *args, **kwargs)

    def recording_ready(self, param, *args, **kwargs):
        out = ready(self, param, *args, **kwargs)
        if self.is_last_microbatch and not self.is_first_batch \
                and self.per_param_grad_ready_counts == self.golden_per_param_grad_ready_counts:
            events.append(("ready", self))
        return out

    pgb._ParamAndGradBucketGroup.start_grad_sync = recording_start
    pgb._ParamAndGradBucketGroup.register_grad_ready = recording_ready
    H = 16
    u = torch.tensor(np.random.default_rng(ORDER_SEED).standard_normal((ORDER_E, H)), dtype=torch.float32)
    u /= u.norm(dim=1, keepdim=True)

    def build(policy):
        cfg = moe_config(EP, "allgather" if policy is None else "alltoall", experts=ORDER_E, topk=4)
        torch.manual_seed(ORDER_SEED % 1000)
        if policy is None:
            layer = build_moe_layer(cfg)
        else:
            megatron_rails.install(policy)
            try:
                layer = build_moe_layer(cfg)
            finally:
                megatron_rails.uninstall()
        with torch.no_grad():
            layer.router.weight.add_(5.0 * u)
        return chunk(cfg, layer)

    def loss_fn(model, microbatch):
        x, y = microbatch
        return ((model(x) - y) ** 2).mean()

    try:
        with cpu_megatron():
            models = {"stock": build(None), "ultraep": build({"policy": "ultraep", "slots": 3, "comm": "direct",
                                                                "tolerance": 0.0})}
            models["ultraep"].layer.load_state_dict(models["stock"].layer.state_dict())
            runs = {p: megatron_ddp(m, overlap_grad_reduce=True, use_distributed_optimizer=False, lr=0.1,
                                    bucket_size=1000) for p, m in models.items()}
            ddp = runs["ultraep"][0]
            expert_groups = {id(g): i for i, g in enumerate(ddp.expert_parallel_bucket_groups)}
            assert len(expert_groups) > 1, "the expert buffer needs several bucket groups"
            orders = []
            for step in range(len(ORDER_MICRO)):
                g = torch.Generator().manual_seed(1000 * rank + step + ORDER_SEED % 997)
                mbs = []
                for m in range(ORDER_MICRO[step]):
                    hot = (step + m) % ORDER_E
                    x = torch.randn(ORDER_TOKENS, H, generator=g) * 0.5 + 1.5 * u[hot] + 0.8 * u[(hot + 3) % ORDER_E]
                    mbs.append((x.view(ORDER_TOKENS, 1, H), torch.randn(ORDER_TOKENS, 1, H, generator=g)))
                want = train_step(*runs["stock"], mbs, loss_fn)
                del events[:]
                got = train_step(*runs["ultraep"], mbs, loss_fn)
                torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)
                orders.append({kind: [expert_groups[id(grp)] for k, grp in events if k == kind and id(grp) in expert_groups]
                               for kind in ("ready", "launch")})
                ref = full_params(runs["stock"][0])
                state = models["ultraep"].layer.state_dict()
                for k, v in ref.items():
                    torch.testing.assert_close(state[k[len("layer."):]], v, rtol=1e-5, atol=1e-5,
                                               msg=lambda msg: f"rank {rank} step {step}: {k}\n{msg}")
            # every expert bucket group launched once per step (else the orders compared below are empty)
            assert all(sorted(o["launch"]) == sorted(expert_groups.values()) for o in orders), orders
            # every replica launches its expert reductions in the same order, although (the premise:
            # else this test would not test it) their gradients became ready in different orders
            peers = [None] * ps.get_expert_data_parallel_world_size()
            dist.all_gather_object(peers, orders, group=ps.get_expert_data_parallel_group())
            assert all(p_[s]["launch"] == orders[s]["launch"] for p_ in peers for s in range(1, len(orders))), peers
            assert any(peers[0][s]["ready"] != peers[1][s]["ready"] for s in range(1, len(orders))), peers
    finally:
        pgb._ParamAndGradBucketGroup.start_grad_sync = start
        pgb._ParamAndGradBucketGroup.register_grad_ready = ready


def test_replicas_whose_plans_differ_launch_expert_reductions_in_one_order():
    """Megatron DDP with overlap_grad_reduce and several expert buckets: a replica whose gradients
    become ready in another order than its peer's still launches the reductions in the same order
    (grad_sync.InOrderLaunch), so each bucket is summed with its own counterpart; parameters equal
    stock's after every step."""
    spawn(_order_worker, WORLD, ep=EP)
