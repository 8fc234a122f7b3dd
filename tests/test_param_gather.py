"""Lazy parameter all-gather (Megatron DDP with the distributed optimizer and overlap_param_gather):
updated expert weights arrive only when DDP's forward pre-hook on their module runs. The stores read
them earlier, in the dispatcher, so they must run those hooks first.

DDP itself needs CUDA, so the hooks here are Megatron's real ones (`_make_forward_pre_hook`) bound
to a stand-in that holds the parameter -> bucket map; a bucket's "all-gather" writes the fresh
weights into its parameters. The reference is the stock allgather dispatcher with fresh weights."""
from types import SimpleNamespace

import numpy as np
import torch

from moe_harness import build_moe_layer, moe_config, spawn


class _Bucket:
    """One bucket group: finish_param_sync completes its 'all-gather' once."""

    def __init__(self, params, fresh):
        self.params, self.fresh, self.gathered = params, fresh, False

    @torch.no_grad()
    def finish_param_sync(self, skip_next_bucket_dispatch=False):
        if not self.gathered:
            for p, f in zip(self.params, self.fresh):
                p.copy_(f)
            self.gathered = True


def _hook_stale(module):
    """Make every trainable parameter under `module` stale (zeros) until DDP's pre-hook of its
    module runs; returns the bucket."""
    from megatron.core.distributed import DistributedDataParallel

    params = [p for p in module.parameters() if p.requires_grad]
    bucket = _Bucket(params, [p.detach().clone() for p in params])
    ddp = SimpleNamespace(use_forward_hook=True, param_to_bucket_group={p: bucket for p in params},
                          ddp_config=SimpleNamespace(align_param_gather=False),
                          overlap_param_gather_with_optimizer_step=False)
    hook = DistributedDataParallel._make_forward_pre_hook(ddp)
    for m in module.modules():
        m.register_forward_pre_hook(hook)
    with torch.no_grad():
        for p in params:
            p.zero_()
    return bucket


def _worker(rank, world):
    import megatron_rails

    E, H, T = 8, 16, 24
    torch.manual_seed(7)
    stock = build_moe_layer(moe_config(world, "allgather", experts=E, hidden=H))
    u = np.random.default_rng(3).standard_normal(H)
    u /= np.linalg.norm(u)
    alpha = np.zeros(E)
    alpha[5] = 50.0  # every token's first choice is expert 5: its owner must export
    with torch.no_grad():
        stock.router.weight.add_(torch.tensor(np.outer(alpha, u), dtype=torch.float32))
    x_np = np.random.default_rng(10 + rank).standard_normal((T, H)) * 0.5 + 2.0 * u
    x0 = torch.tensor(x_np, dtype=torch.float32).view(-1, 1, H)
    for policy in ("ultraep", "fsep"):
        megatron_rails.install({"policy": policy, "slots": 2, "tolerance": 0.0})
        rails = build_moe_layer(moe_config(world, "alltoall", experts=E, hidden=H))
        megatron_rails.uninstall()
        rails.load_state_dict(stock.state_dict())
        bucket = _hook_stale(rails.experts)
        outs = []
        for layer in (stock, rails):
            x = x0.clone().requires_grad_(True)
            out, _ = layer(x)
            out.sum().backward()
            outs.append((out.detach(), x.grad))
        assert bucket.gathered
        assert rails.token_dispatcher.plan.weight_moves > 0, "the routing must make replicas"
        where = f"{policy}, rank {rank}"
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}: output\n{m}")
        torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}: grad\n{m}")


def test_stores_wait_for_lazy_param_gather():
    spawn(_worker, 2)


def test_only_ddp_hooks_run():
    from megatron_rails.megatron.compat import wait_param_gather

    lin = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    calls = []
    lin[1].register_forward_pre_hook(lambda m, a: calls.append("other"))
    bucket = _hook_stale(lin)
    assert all((p == 0).all() for p in lin.parameters())
    wait_param_gather(lin)
    assert bucket.gathered and calls == []
    assert all(torch.equal(p, f) for p, f in zip(bucket.params, bucket.fresh))
    wait_param_gather(lin)  # idempotent
    assert calls == []
