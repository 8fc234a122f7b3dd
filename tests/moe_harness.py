"""Spawned-rank harness for dispatcher tests: stock Megatron-Core MoELayers on gloo (CPU).

`spawn(fn, world, *args)` runs fn(rank, world, *args) in `world` processes with torch.distributed
(gloo) and Megatron's parallel state initialized (EP = world unless `ep` or a pipeline says
otherwise); a failure on any rank fails the call.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import rank_boot
from megatron_rails.runtime.comm.base import leave


# what the forkserver imports before it forks ranks: torch and the Megatron-Core modules the tests
# build from (not megatron_rails: some of its modules read the environment when imported)
PRELOAD = ["torch", "torch.distributed", "megatron.core.parallel_state", "megatron.core.models.gpt.gpt_model",
           "megatron.core.transformer.moe.moe_layer", "megatron.core.distributed", "megatron.core.optimizer",
           "megatron.core.dist_checkpointing"]

# a collective no peer joins (a rank skipping one: the bug class these tests look for) fails the
# test after this long instead of torch's 30 minutes; a step here takes seconds
TIMEOUT = timedelta(minutes=5)


def _entry(rank, errq, world, store, fn, args, megatron=True, ep=None, parallel=None):
    torch.set_num_threads(1)
    try:
        # rendezvous through a file: no port picked in advance that another process could take
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=TIMEOUT)
        # every rank has its connections before any may leave: a rank whose function makes no
        # collective would otherwise close them under a peer still connecting (gloo: "Connection
        # closed by peer" in that peer's init)
        dist.barrier()
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
        errq.put((rank, traceback.format_exc()))
        os._exit(1)  # do not wait in collectives that will never complete
    # no interpreter finalization: a gloo thread finishing a collective then aborts the process
    leave(0)


def spawn(fn, world: int, *args, megatron: bool = True, ep: int | None = None, parallel: dict | None = None,
          fresh: bool = False) -> None:
    """megatron=False: plain gloo ranks (no Megatron import, no parallel state) for comm-only tests.
    ep: the expert-parallel size (default: the ranks of a pipeline stage); world / (pp x ep) expert-
    data-parallel replicas per stage. parallel: more keywords of `initialize_model_parallel`
    (tensor, context, pipeline, virtual pipeline sizes, expert_tensor_parallel_size; not
    expert_model_parallel_size, which is `ep`). fresh: start each rank in a new interpreter instead
    of forking it from the server, for an environment that decides how the preloaded modules
    import (TRITON_INTERPRET: Megatron-Core imports Triton where it is installed)."""
    ctx = mp.get_context("spawn" if fresh else "forkserver")
    if not fresh:
        # the server imports these once; every rank forks from it (a failed import is skipped there
        # and happens in the rank instead, as under spawn)
        ctx.set_forkserver_preload(PRELOAD)
    errq = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="rails-spawn-") as tmp:
        payload = pickle.dumps((_entry, (world, os.path.join(tmp, "store"), fn, args, megatron, ep, parallel)))
        procs = [ctx.Process(target=rank_boot.run, args=(rank, dict(os.environ), list(sys.path), payload, errq))
                 for rank in range(world)]
        for p in procs:
            p.start()
        codes = _join(procs)
    if any(codes):
        told = {}  # rank -> its traceback
        while not errq.empty():
            rank, text = errq.get()
            told[rank] = text
        msgs = [f"rank {r}:\n{told[r]}" if r in told else f"rank {r}: exit code {c} and no traceback"
                for r, c in enumerate(codes) if c or r in told]
        raise AssertionError("\n".join(msgs))


def _join(procs, grace_s: float = 20.0) -> list:
    """Exit codes of `procs`. Once one fails, the others get `grace_s` to fail too and say why (a
    peer's failure breaks their collectives at once); those still running then are terminated."""
    deadline = None
    while any(p.exitcode is None for p in procs):
        for p in procs:
            p.join(0.05)
        if deadline is None and any(p.exitcode for p in procs):
            deadline = time.monotonic() + grace_s
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.exitcode is None:
                    p.terminate()
            for p in procs:
                p.join()
    return [p.exitcode for p in procs]


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


def stock_and_rails(world: int, policy: dict, seed: int, experts: int = 8, hidden: int = 16):
    """(stock allgather layer, rails layer under `policy` with the stock one's weights), built
    after torch.manual_seed(seed)."""
    import megatron_rails

    torch.manual_seed(seed)
    stock = build_moe_layer(moe_config(world, "allgather", experts=experts, hidden=hidden))
    megatron_rails.install(policy)
    try:
        rails = build_moe_layer(moe_config(world, "alltoall", experts=experts, hidden=hidden))
    finally:
        megatron_rails.uninstall()
    rails.load_state_dict(stock.state_dict())
    return stock, rails


def replicas_used(records) -> float:
    """How many replicas / slots the dispatcher's metric `records` (dicts) used, summed over every
    rank of the default group (one rank's experts may get no tokens): a collective."""
    used = torch.tensor([float(sum(r["replicas_used"] for r in records))])
    dist.all_reduce(used)
    return used.item()
