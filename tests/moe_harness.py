"""Spawned-rank harness for dispatcher tests: stock Megatron-Core MoELayers on gloo (CPU).

`spawn(fn, world, *args)` runs fn(rank, world, *args) in `world` processes with torch.distributed
(gloo) and Megatron's parallel state initialized (EP = world unless `ep` or a pipeline says
otherwise); a failure on any rank fails the call.
"""
from __future__ import annotations

import os
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_rails.runtime.comm.base import leave


# a collective no peer joins (a rank skipping one: the bug class these tests look for) fails the
# test after this long instead of torch's 30 minutes; a step here takes seconds
TIMEOUT = timedelta(minutes=5)


def _entry(rank, world, store, fn, args, errq, megatron=True, ep=None, parallel=None):
    torch.set_num_threads(1)
    try:
        # rendezvous through a file: no port picked in advance that another process could take
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=TIMEOUT)
        if megatron:
            from megatron_rails.megatron import cpu_shims

            cpu_shims.apply()
            from megatron.core import parallel_state as ps

            parallel = parallel or {}
            stage = world // parallel.get("pipeline_model_parallel_size", 1)
            ps.initialize_model_parallel(expert_model_parallel_size=ep or stage,
                                         distributed_timeout_minutes=int(TIMEOUT.total_seconds() // 60),
                                         **parallel)
        fn(rank, world, *args)
    except BaseException:
        errq.put(f"rank {rank}:\n{traceback.format_exc()}")
        os._exit(1)  # do not wait in collectives that will never complete
    # no interpreter finalization: a gloo thread finishing a collective then aborts the process
    leave(0)


def spawn(fn, world: int, *args, megatron: bool = True, ep: int | None = None, parallel: dict | None = None) -> None:
    """megatron=False: plain gloo ranks (no Megatron import, no parallel state) for comm-only tests.
    ep: the expert-parallel size (default: the ranks of a pipeline stage); world / (pp x ep) expert-
    data-parallel replicas per stage. parallel: more keywords of `initialize_model_parallel`
    (tensor, context, pipeline, virtual pipeline sizes, expert_tensor_parallel_size; not
    expert_model_parallel_size, which is `ep`)."""
    ctx = mp.get_context("spawn")
    errq = ctx.SimpleQueue()
    try:
        with tempfile.TemporaryDirectory(prefix="rails-spawn-") as tmp:
            mp.start_processes(_entry, args=(world, os.path.join(tmp, "store"), fn, args, errq, megatron, ep, parallel),
                               nprocs=world, join=True, start_method="spawn")
    except mp.ProcessExitedException as err:
        msgs = []
        while not errq.empty():
            msgs.append(errq.get())
        raise AssertionError("\n".join(msgs) or str(err)) from None


def moe_config(world: int, dispatcher: str, experts: int = 8, topk: int = 2, hidden: int = 16, ffn: int = 24):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=2, num_moe_experts=experts, moe_router_topk=topk,
        moe_token_dispatcher_type=dispatcher, ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn, add_bias_linear=False,
        expert_model_parallel_size=world, use_cpu_initialization=True, moe_aux_loss_coeff=0.0,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, bias_activation_fusion=False,
        moe_router_load_balancing_type="none", init_method_std=0.2,
        moe_router_pre_softmax=topk == 1)  # Megatron requires it at top-1 (the prob would be 1)


def build_moe_layer(cfg):
    from megatron_rails.megatron.compat import build_moe_layer as build

    return build(cfg)


def replicas_used(records) -> float:
    """How many replicas / slots the dispatcher's metric `records` (dicts) used, summed over every
    rank of the default group (one rank's experts may get no tokens): a collective."""
    used = torch.tensor([float(sum(r["replicas_used"] for r in records))])
    dist.all_reduce(used)
    return used.item()
