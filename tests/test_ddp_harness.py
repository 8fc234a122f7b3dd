"""ddp_harness against a hand-written reference, on 2 gloo ranks (EP = 2, stock allgather dispatcher).

Megatron-Core's DDP + optimizer + no-pipelining schedule train a MoE layer 3 steps x 4 microbatches (+ 1 x 2)
for every combination of overlap_grad_reduce and the distributed optimizer (and overlap_param_gather
with it). The reference is the same layer in plain torch: backward over the microbatches with each
loss divided by their number, dense grads summed over ranks, every grad divided by the world size
(DDP's 1/|DP| scaling; expert grads are reduced over expert-DP, here the rank alone), then the same
torch optimizer. Losses and every parameter after every step agree to 1e-5.

Optimizers: SGD without the distributed optimizer; with it Adam, the only one megatron-core 0.16.1's
DistributedOptimizer accepts. Adam's update is nearly invariant to the gradients' scale, so it runs
with eps = 1 (grads here are well below 1): the update is then close to proportional to the gradient
and a wrong reduction scale (a missing or doubled 1/|DP|) fails the comparison.
"""
import pytest
import torch

from moe_harness import build_moe_layer, moe_config, spawn

# microbatches per optimizer step: 3 steps x 4, then one of 2. Megatron DDP learns in the first step
# how often each param's grad gets ready on the last microbatch, and with overlap_grad_reduce dispatches
# a bucket's reduction when those counts are reached again. Only with no_sync around the earlier
# microbatches is that count independent of the number of microbatches: the short step fails without.
MICRO = (4, 4, 4, 2)
TOKENS, LR = 16, 0.1
# (overlap_grad_reduce, use_distributed_optimizer, overlap_param_gather)
COMBOS = [(False, False, False), (True, False, False), (False, True, False), (True, True, False),
          (True, True, True)]
BUCKET = 1000  # elements: several buckets per buffer when overlapping (the expert buffer holds 4608)


def _build(world, bias=False):
    import dataclasses

    from ddp_harness import chunk

    # linear biases: params whose sizes make the distributed optimizer pad the buffers (full_params
    # must read each param where the buffer put it)
    cfg = dataclasses.replace(moe_config(world, "allgather"), add_bias_linear=bias)
    torch.manual_seed(7)  # same router on every rank
    return chunk(cfg, build_moe_layer(cfg))


def _loss(model, microbatch):
    x, y = microbatch
    return ((model(x) - y) ** 2).mean()


def _microbatches(rank, step, hidden):
    g = torch.Generator().manual_seed(1000 * rank + step)  # each rank its own data
    return [(torch.randn(TOKENS, 1, hidden, generator=g), torch.randn(TOKENS, 1, hidden, generator=g))
            for _ in range(MICRO[step])]


ADAM = dict(adam_eps=1.0)  # see the docstring


def _reference_optimizer(model, kind):
    params = list(model.parameters())
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR)
    # Megatron's adam: torch AdamW (decoupled weight decay, here none), betas (0.9, 0.999)
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=ADAM["adam_eps"], weight_decay=0.0)


def _reference_step(model, opt, microbatches, world):
    import torch.distributed as dist

    opt.zero_grad(set_to_none=True)
    losses = []
    for mb in microbatches:
        loss = _loss(model, mb)
        (loss / len(microbatches)).backward()
        losses.append(loss.item())
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if getattr(p, "allreduce", True):
                dist.all_reduce(p.grad)  # dense: replicated, summed over the data-parallel ranks
            # expert (allreduce=False): reduced over expert-DP, which is this rank alone (EP = world)
            p.grad /= world
    opt.step()
    return losses


def _worker(rank, world, bias):
    from ddp_harness import cpu_megatron, full_params, megatron_ddp, train_step

    with cpu_megatron():
        for ogr, dopt, opg in COMBOS:
            kind = "adam" if dopt else "sgd"
            where = f"{kind} overlap_grad_reduce={ogr} distopt={dopt} overlap_param_gather={opg} rank {rank}"
            ref = _build(world, bias)
            model = _build(world, bias)
            model.load_state_dict(ref.state_dict())
            init = {n: p.detach().clone() for n, p in ref.named_parameters()}
            assert any(not getattr(p, "allreduce", True) for p in model.parameters()), "no expert params"
            ref_opt = _reference_optimizer(ref, kind)
            ddp, opt = megatron_ddp(model, overlap_grad_reduce=ogr, use_distributed_optimizer=dopt,
                                    overlap_param_gather=opg, lr=LR, optimizer=kind,
                                    bucket_size=BUCKET if ogr else None, **(ADAM if kind == "adam" else {}))
            if ogr:
                assert len(ddp.expert_parallel_bucket_groups) > 1, "expected several buckets"
            for step in range(len(MICRO)):
                mbs = _microbatches(rank, step, model.config.hidden_size)
                want = _reference_step(ref, ref_opt, mbs, world)
                got = train_step(ddp, opt, mbs, _loss)
                torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{where} step {step}: losses\n{m}")
                params = full_params(ddp)
                for name, p in ref.named_parameters():
                    torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-5,
                                               msg=lambda m: f"{where} step {step}: {name}\n{m}")
            for name, p in ref.named_parameters():
                assert not torch.equal(p, init[name]), f"{where}: {name} did not train"


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_megatron_ddp_matches_reference(bias):
    spawn(_worker, 2, bias)
