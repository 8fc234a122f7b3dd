"""Resident slot weights under Megatron-Core's own DDP, optimizer and schedule (tests/ddp_harness.py),
against the stock allgather dispatcher trained the same way, on 2 gloo ranks (EP = 2).

Steps of 4, 4, 4 and 2 microbatches with skewed routing that differs per microbatch; every
combination of overlap_grad_reduce and the distributed optimizer, overlap_param_gather, and
Megatron's activation recompute. The slot gradients must reach the owners (shards) before DDP
reduces them: with overlap_grad_reduce from inside the last backward, before the owners' gradient
ready hooks; without it before finish_grad_sync. Losses of every microbatch and, where the
parameters are current after the step, every parameter in stock layout equal stock's to 1e-5,
until the first near-tie routing flip (tests/flips.py's rule, a stock alltoall control beside).
Slots are fetched once per step (DDP's no_sync marks the microbatches that accumulate). The
stores' step buffers come from kept blocks here (runtime/hostbuf.py, at every size).
"""
import numpy as np
import pytest
import torch

from moe_harness import moe_config, spawn

MICRO = (4, 4, 4, 2)
TOKENS, LR, E = 16, 0.1, 8
# (overlap_grad_reduce, use_distributed_optimizer, overlap_param_gather, recompute)
COMBOS = [(False, False, False, False), (True, False, False, False), (False, True, False, False),
          (True, True, False, False), (True, True, True, False), (True, False, False, True)]
ADAM = dict(adam_eps=1.0)  # Adam's update is then close to proportional to the gradient (test_ddp_harness.py)


def _build(world, policy, u):
    from ddp_harness import skewed_chunk

    return skewed_chunk(world, policy, u, E)


def _microbatches(rank, step, u, hidden):
    g = torch.Generator().manual_seed(1000 * rank + step)
    out = []
    for m in range(MICRO[step]):
        hot = (step + m) % E
        x = torch.randn(TOKENS, hidden, generator=g) * 0.5 + 1.5 * u[hot] + 0.8 * u[(hot + 3) % E]
        out.append((x.view(TOKENS, 1, hidden), torch.randn(TOKENS, 1, hidden, generator=g)))
    return out


def _loss_fn(recompute):
    from megatron.core import tensor_parallel

    def loss(model, microbatch):
        x, y = microbatch
        # hidden states require grad (as a model's do): else Megatron's checkpoint output has no
        # grad_fn and no gradient reaches the layer under recompute
        x = x.detach().requires_grad_(True)
        out = tensor_parallel.checkpoint(lambda t: model(t), False, x) if recompute else model(x)
        return ((out - y) ** 2).mean()

    return loss


def _worker(rank, world, policies):
    from ddp_harness import cpu_megatron, full_params, megatron_ddp, train_step
    from flips import Online, RoutingLog, stock_alltoall

    from megatron_rails.runtime import hostbuf

    hostbuf.MIN_BYTES = 0  # the stores' step buffers come from kept blocks at this small size too

    H = moe_config(world, "allgather").hidden_size
    u = torch.tensor(np.random.default_rng(3).standard_normal((E, H)), dtype=torch.float32)
    u /= u.norm(dim=1, keepdim=True)
    with cpu_megatron():
        for policy in policies:
            for ogr, dopt, opg, recompute in COMBOS:
                kind = "adam" if dopt else "sgd"
                where = f"{policy}: overlap_grad_reduce={ogr} distopt={dopt} overlap_param_gather={opg} " \
                        f"recompute={recompute} rank {rank}"
                models = {p: _build(world, p, u) for p in ("stock", policy, "stock-alltoall")}
                for p in (policy, "stock-alltoall"):
                    models[p].layer.load_state_dict(models["stock"].layer.state_dict())
                rule = Online(*(RoutingLog(models[p]) for p in (policy, "stock", "stock-alltoall")))
                grad_bytes = []  # fsep: storage of the shards' .grad when DDP's gradient-ready hook sees it
                if policy == "fsep":  # registered before DDP's hook on the same node, so it runs first
                    shards = models[policy].layer.experts.rails_fsep_shards
                    acc = shards.expand_as(shards).grad_fn.next_functions[0][0]
                    acc.register_hook(lambda *_, s=shards: grad_bytes.append(
                        None if s.grad is None else s.grad.untyped_storage().nbytes()))
                trained = {}
                for name, model in models.items():
                    trained[name] = megatron_ddp(model, overlap_grad_reduce=ogr, use_distributed_optimizer=dopt,
                                                 overlap_param_gather=opg, lr=LR, optimizer=kind,
                                                 bucket_size=1000 if ogr else None,
                                                 **(ADAM if kind == "adam" else {}))
                disp = models[policy].layer.token_dispatcher
                loss_fn = _loss_fn(recompute)
                initial = {n: p.detach().clone() for n, p in models["stock"].layer.named_parameters()}
                for step in range(len(MICRO)):
                    mbs = _microbatches(rank, step, u, H)
                    n_records = len(disp.metrics)
                    want = train_step(*trained["stock"], mbs, loss_fn)
                    got = train_step(*trained[policy], mbs, loss_fn)
                    with stock_alltoall():
                        train_step(*trained["stock-alltoall"], mbs, loss_fn)
                    strict = rule.update()  # no routing flip yet
                    if strict:
                        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5,
                                                   msg=lambda m: f"{where} step {step}: losses\n{m}")
                    records = list(disp.metrics)[n_records:]
                    fetched = [r["slots_fetched"] for r in records]
                    assert len(records) == len(mbs) and fetched[0] and not any(fetched[1:]), \
                        f"{where} step {step}: slots fetched {fetched}"
                    # main_grad holds the shards' gradient: the .grad DDP's hook sees costs no memory
                    if policy == "fsep":
                        took = max([b or 0 for b in grad_bytes], default=None)
                        assert took is not None and took <= shards.element_size(), \
                            f"{where} step {step}: the shards' .grad took {took} bytes (None: DDP's hook never ran)"
                    if strict and not opg:  # parameters are current after the step (no all-gather pending)
                        ref = full_params(trained["stock"][0])
                        # equal parameters show something only where training moved them
                        assert all(not torch.equal(ref[f"layer.{n}"], v) for n, v in initial.items()), \
                            f"{where} step {step}: a stock parameter did not change"
                        state = models[policy].layer.state_dict()  # stock layout (fsep writes shards back)
                        for k, v in ref.items():
                            k = k[len("layer."):]
                            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-5,
                                                       msg=lambda m: f"{where} step {step}: {k}\n{m}")
                rule.check(where)


@pytest.mark.parametrize("policy", ["ultraep", "fsep"])
def test_megatron_ddp_training_matches_stock(policy):
    spawn(_worker, 2, [policy])


def _setup(rank, world):
    H = moe_config(world, "allgather").hidden_size
    u = torch.tensor(np.random.default_rng(3).standard_normal((E, H)), dtype=torch.float32)
    u /= u.norm(dim=1, keepdim=True)
    return H, u


def _chunks_worker(rank, world):
    from ddp_harness import cpu_megatron, megatron_ddp

    H, u = _setup(rank, world)
    with cpu_megatron():
        chunks = [_build(world, "fsep", u) for _ in range(2)]  # two model chunks (virtual pipeline stages)
        ddps = [megatron_ddp(c, overlap_grad_reduce=True, use_distributed_optimizer=False, lr=LR)[0] for c in chunks]
        stores = [c.layer.token_dispatcher.store for c in chunks]
        x, _ = _microbatches(rank, 0, u, H)[0]
        for ddp in ddps:
            ddp.zero_grad_buffer()
        with ddps[0].no_sync(), ddps[1].no_sync():  # both chunks' backward done, nothing returned yet
            ddps[1](ddps[0](x)).sum().backward()
        assert [s.returns for s in stores] == [0, 0] and all(s.window.pending for s in stores)
        # the interleaved schedule syncs one chunk as its backward completes; the other's layers may
        # still accumulate (more microbatches) and return at their own sync
        ddps[1].start_grad_sync()
        assert [s.returns for s in stores] == [0, 1], [s.returns for s in stores]
        ddps[0].start_grad_sync()
        assert [s.returns for s in stores] == [1, 1], [s.returns for s in stores]


def test_a_chunks_grad_sync_returns_its_own_layers_only():
    """Interleaved pipelines sync model chunks one by one (grad_sync_func): each DDP's sync returns
    the slot gradients of its own layers, so every layer returns once per step, not once per later
    chunk's sync as well."""
    spawn(_chunks_worker, 2)


def _owed_at_step_worker(rank, world):
    from ddp_harness import cpu_megatron, megatron_ddp

    H, u = _setup(rank, world)
    with cpu_megatron():
        trained = {}
        for policy in ("stock", "fsep"):
            model = _build(world, policy, u)
            if policy != "stock":
                model.layer.load_state_dict(trained["stock"][0].module.layer.state_dict())
            # clipping reads every gradient before the update: a small bound makes it act
            trained[policy] = megatron_ddp(model, overlap_grad_reduce=True, use_distributed_optimizer=False, lr=LR,
                                           clip_grad=1e-3)
        for policy, (ddp, opt) in trained.items():
            ddp.zero_grad_buffer()
            opt.zero_grad()
            for x, y in _microbatches(rank, 0, u, H):
                with ddp.no_sync():  # every microbatch, and no finalize_model_grads: all still owed
                    ((ddp(x) - y) ** 2).mean().backward()
            ok, _, _ = opt.step()
            assert ok
        want = trained["stock"][0].module.layer.state_dict()
        got = trained["fsep"][0].module.layer.state_dict()  # stock layout
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}: {k}\n{m}")


def test_a_megatron_optimizer_step_returns_what_is_owed_before_reading_gradients():
    """The last resort: slot gradients still owed when a Megatron optimizer steps go back before it
    reads any gradient (its grad-norm clipping here), not after (the torch step hook, too late)."""
    spawn(_owed_at_step_worker, 2)
