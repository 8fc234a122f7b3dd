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
            for step in range(len(lc.MICRO)):
                mbs = lc._microbatches(rank, step, u, H)
                want = train_step(*runs["stock"], mbs, loss_fn)
                got = train_step(*runs[policy], mbs, loss_fn)
                torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{where} step {step}: losses\n{m}")
                ref = full_params(runs["stock"][0])
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
