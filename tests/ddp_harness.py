"""Megatron-Core's own DistributedDataParallel, optimizer and schedules (no pipelining, 1F1B,
interleaved), run for real on CPU ranks (gloo), for tests that must see exactly what training does
to gradients and parameters.

    with cpu_megatron():
        ddp, opt = megatron_ddp(chunk(cfg, layer), overlap_grad_reduce=True, use_distributed_optimizer=True)
        losses = train_step(ddp, opt, microbatches, loss_fn)   # loss_fn(model, microbatch) -> scalar
        params = full_params(ddp)                              # {name: tensor} as the next forward sees them

Runs on the current process group with Megatron's parallel state already initialized (moe_harness.spawn).
Wiring follows Megatron-LM's training.py: config.no_sync_func / grad_sync_func / param_sync_func /
finalize_model_grads_func / grad_scale_func; zero_grad_buffer + zero_grad, forward_backward_func,
optimizer.step(); with overlap_param_gather the forward pre-hooks (and the interleaved schedule's
param_sync_func) are off for the first iteration.

Gradient scaling (megatron-core 0.16.1 and 0.19.2, calculate_per_token_loss and average_in_collective
False):
the schedule divides each microbatch loss by the number of microbatches, and DDP multiplies every
buffer by 1/|DP| before a SUM collective (dense params over DP, `allreduce=False` expert params over
expert-DP, still by 1/|DP|). So the step gradient is d/dw of mean over (ranks x microbatches) of the loss.

gloo in torch 2.13 has every collective DDP uses (all_reduce, reduce_scatter_tensor and
all_gather_into_tensor, sync and async, inside `_coalescing_manager`; even ReduceOp.AVG), so only
CUDA-isms are patched (cpu_megatron).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"  # an int is a CUDA index


class _CudaAsCpu(TorchFunctionMode):
    """CUDA literals inside Megatron function bodies, so no attribute to patch short of copying
    whole methods; a torch-function mode reaches them all:
    * device="cuda" bookkeeping tensors (raise without CUDA): FP32Optimizer's loss scale,
      MixedPrecisionOptimizer's overflow buffer and unit scale, get_grad_norm_fp32 and
      local_multi_tensor_l2_norm (ChainedOptimizer.step always computes the grad norm), the
      schedule's token counter: made on the CPU;
    * DistributedOptimizer files params by `param.type()` in 'torch.cuda.{Float,Half,BFloat16}Tensor'
      and raises TypeError for anything else: `.type()` reports the CUDA name of a CPU tensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:  # the distributed optimizer's fully reshardable checkpoint format
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and not out.startswith("torch.cuda."):
            out = "torch.cuda." + out.removeprefix("torch.")
        return out


class _HostStream:
    """The one CPU "stream": host work is already ordered, so waiting on anything is a no-op."""

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass


@contextlib.contextmanager
def cpu_megatron():
    """Megatron DDP + optimizer + schedule on CPU while inside; a no-op where CUDA is available, and
    everything restored on exit. (The model layers need megatron_rails.megatron.cpu_shims, which
    moe_harness.spawn applies.) Other stream/event/synchronize calls are not reached: only
    num_distributed_optimizer_instances > 1, nccl_ub and grad-buffer offload make them. Also for
    megatron.core.dist_checkpointing's default (torch_dist) save and load."""
    if torch.cuda.is_available():
        yield
        return
    old = (torch.cuda.current_device, torch.cuda.current_stream, torch.cuda.synchronize, torch.cuda.Stream,
           torch.cuda.stream)
    # DDP and the distributed optimizer allocate their buffers on torch.cuda.current_device()
    torch.cuda.current_device = lambda: torch.device("cpu")
    # 0.19: every grad reduction first makes the current stream wait for CUDA-graph wgrad events
    torch.cuda.current_stream = lambda device=None: _HostStream()
    # dist_checkpointing's torch_dist save syncs the device before writing its staged copies
    torch.cuda.synchronize = lambda device=None: None
    # --moe-shared-expert-overlap runs the shared experts on a stream of their own, made and entered
    # through torch.cuda: on the host every stream is the one stream
    torch.cuda.Stream = lambda *args, **kwargs: _HostStream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    try:
        with _CudaAsCpu():
            yield
    finally:
        (torch.cuda.current_device, torch.cuda.current_stream, torch.cuda.synchronize, torch.cuda.Stream,
         torch.cuda.stream) = old


def skewed_chunk(world: int, policy: str, u: torch.Tensor, experts: int, bias: bool = False):
    """A one-MoE-layer model chunk (seeded: equal weights under every policy) for DDP tests:
    `policy` "stock" (the stock allgather dispatcher), "stock-alltoall" (trained inside
    flips.stock_alltoall()) or a rails policy (alltoall config; slots 2, direct comm, tolerance 0);
    world: the config's EP size; the router pushed towards the rows of u [experts, H] float32 so
    that inputs along them skew the routing; bias: add_bias_linear."""
    import megatron_rails
    from flips import stock_alltoall
    from moe_harness import build_moe_layer, moe_config

    cfg = moe_config(world, "allgather" if policy == "stock" else "alltoall", experts=experts)
    cfg.add_bias_linear = bias
    torch.manual_seed(7)
    if policy in ("stock", "stock-alltoall"):
        with stock_alltoall():
            layer = build_moe_layer(cfg)
    else:
        megatron_rails.install({"policy": policy, "slots": 2, "comm": "direct", "tolerance": 0.0})
        try:
            layer = build_moe_layer(cfg)
        finally:
            megatron_rails.uninstall()
    with torch.no_grad():
        layer.router.weight.add_(4.0 * u)
    return chunk(cfg, layer)


def chunk(config, module, pipeline: bool = False):
    """`module` (e.g. a bare MoELayer) as a model chunk for the schedule, which asks the unwrapped
    model for `set_input_tensor` and `model_type`; forward returns the module's first output where
    it returns a tuple (MoELayer: (output, bias)). pipeline: a pipeline stage's chunk, which
    computes on the tensor the schedule received from the previous stage where there is one
    (set_input_tensor), the data in the first stage's first chunk: `stage_input(x)` says which,
    for the caller to pass to forward (so activation recompute sees it as the input); and adds its
    input to the module's output, as a transformer block's residual does (else every layer's
    output, and so any error in it, shrinks from layer to layer: a gated MLP's is quadratic in
    small inputs)."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer.module import MegatronModule

    class Chunk(MegatronModule):
        model_type = ModelType.encoder_or_decoder
        # finalize_model_grads looks for a pipeline stage's embedding: there is none
        share_embeddings_and_output_weights, pre_process = False, False

        def __init__(self):
            super().__init__(config)
            self.layer = module
            self.input_tensor = None

        def set_input_tensor(self, input_tensor):
            if pipeline:  # else first and last stage: inputs come from the data iterator
                self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

        def stage_input(self, x):
            """What this chunk computes on: the previous stage's output, else the data `x`."""
            return self.input_tensor if self.input_tensor is not None else x

        def forward(self, x, *args, **kwargs):
            out = self.layer(x, *args, **kwargs)
            out = out[0] if isinstance(out, tuple) else out
            return x + out if pipeline else out

    return Chunk()


def megatron_ddp(model, *, overlap_grad_reduce: bool, use_distributed_optimizer: bool,
                 overlap_param_gather: bool = False, lr: float = 0.1, optimizer: str = "sgd",
                 bucket_size: int | None = None, **optimizer_kw):
    """(DistributedDataParallel, MegatronOptimizer) for `model` (a MegatronModule with `.config`),
    or (a list of them, one optimizer) for a list of model chunks (virtual pipeline stages, as
    Megatron-LM's get_model wraps them: bucketing off from the second chunk on).
    The optimizer is plain: no weight decay, clipping or momentum unless given in optimizer_kw
    (OptimizerConfig fields). With use_distributed_optimizer, megatron-core 0.16.1 accepts only
    "adam" (torch AdamW here: no Transformer Engine or Apex); "sgd" raises there. bucket_size
    (elements) splits the buffers into several buckets when overlap_grad_reduce is on (DDP ignores
    it otherwise)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    assert use_distributed_optimizer or not overlap_param_gather, "overlap_param_gather needs distopt"
    chunks = model if isinstance(model, list) else [model]
    config = chunks[0].config
    # Megatron-LM aligns the parameter all-gathers across pipeline stages (the schedule dispatches
    # them) for the interleaved schedule only, and turns align_param_gather off otherwise
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=overlap_grad_reduce, use_distributed_optimizer=use_distributed_optimizer,
        overlap_param_gather=overlap_param_gather, bucket_size=bucket_size,
        align_param_gather=overlap_param_gather and len(chunks) > 1)
    ddps = [DistributedDataParallel(config, ddp_config, m, disable_bucketing=i > 0) for i, m in enumerate(chunks)]
    # OptimizerConfig's defaults are weight decay 0.01, clip 1.0, SGD momentum 0.9
    kw = {**dict(weight_decay=0.0, clip_grad=0.0, sgd_momentum=0.0), **optimizer_kw}
    opt_config = OptimizerConfig(optimizer=optimizer, lr=lr, use_distributed_optimizer=use_distributed_optimizer, **kw)
    opt = get_megatron_optimizer(opt_config, ddps)

    def per_chunk(fns):  # Megatron-LM's train(): a list for several chunks, the function for one
        return fns if len(fns) > 1 else fns[0]

    # as Megatron-LM's train() sets the model config up
    config.grad_scale_func = opt.scale_loss
    config.no_sync_func = config.grad_sync_func = config.param_sync_func = None
    if overlap_grad_reduce:
        config.no_sync_func = per_chunk([d.no_sync for d in ddps])
        config.grad_sync_func = per_chunk([d.start_grad_sync for d in ddps])  # align_grad_reduce (default on)
    config.finalize_model_grads_func = finalize_model_grads
    # train() starts with the param all-gather pre-hooks off, and the schedule's param_sync_func
    # unset, and turns both on after the first successful step (so that a bad init or checkpoint
    # load is not spread by the first gather); schedule_step does the turning on
    config.harness_param_sync_func = None
    if ddp_config.overlap_param_gather and ddp_config.align_param_gather:
        config.harness_param_sync_func = per_chunk([d.start_param_sync for d in ddps])
    for d in ddps:
        if d.use_forward_hook:
            d.disable_forward_pre_hook(param_sync=False)
    return (ddps if isinstance(model, list) else ddps[0]), opt


def train_step(ddp, optimizer, microbatches: list, loss_fn) -> list[float]:
    """One optimizer step over `microbatches` through Megatron's forward_backward_func and
    optimizer.step(). Grads accumulate in DDP's buffers; with overlap_grad_reduce all microbatches
    but the last run under ddp.no_sync and the bucket reductions start from the backward hooks of
    the last one; finalize_model_grads finishes (or, without overlap, does) them.
    loss_fn(model, microbatch) -> scalar loss tensor; returns the per-microbatch losses (unscaled)."""
    return schedule_step([ddp], optimizer, microbatches, loss_fn, lambda out, microbatch: out)


def schedule_step(ddps: list, optimizer, microbatches: list, forward_fn, loss_fn, *, seq_length: int = 0,
                  forward_only: bool = False) -> list[float]:
    """One step of Megatron's forward_backward_func for the parallel state's pipeline (no
    pipelining, 1F1B, or interleaved for several chunks) over `microbatches`, then, unless
    forward_only, optimizer.step(). forward_fn(model, microbatch) -> the chunk's output;
    loss_fn(output, microbatch) -> scalar loss (called on the last stage only). seq_length: the
    tokens per microbatch that stages send each other (whole sequences: the schedule divides them
    by the context- and, under sequence parallelism, tensor-parallel sizes; micro batch size 1).
    Returns the last stage's per-microbatch losses (unscaled), [] on other stages."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not forward_only:
        for d in ddps:
            d.zero_grad_buffer()
        optimizer.zero_grad()

    def forward_step(data_iterator, model):
        microbatch = next(data_iterator)

        def loss_func(out):
            loss = loss_fn(out, microbatch)
            # the schedule divides the returned loss in place: report a copy
            return loss, {"loss": loss.detach().clone()}

        return forward_fn(model, microbatch), loss_func

    data = [iter(microbatches) for _ in ddps]
    reduced = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data if len(ddps) > 1 else data[0], model=ddps,
        num_microbatches=len(microbatches), seq_length=seq_length, micro_batch_size=1, forward_only=forward_only)
    if not forward_only:
        ok, _grad_norm, _ = optimizer.step()
        assert ok, "optimizer step skipped (inf/nan gradients)"
        for d in ddps:
            if d.use_forward_hook and not d.remove_forward_pre_hook_handles:
                d.enable_forward_pre_hook()
        config = ddps[0].module.config
        config.param_sync_func = getattr(config, "harness_param_sync_func", None)
    return [float(r["loss"]) for r in reduced]


@torch.no_grad()
def full_params(ddp) -> dict[str, torch.Tensor]:
    """Every parameter of ddp.module by name, as the next forward will see it. With overlap_param_gather
    the distributed optimizer has updated only this rank's shard of each parameter buffer and the
    all-gather waits for the next forward's pre-hooks: gather the shards here into copies, leaving
    DDP's buffers and its gather state untouched."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    current = {p: p.detach().clone() for p in ddp.module.parameters()}
    if ddp.ddp_config.overlap_param_gather:
        for buffer in ddp.buffers + ddp.expert_parallel_buffers:
            group = buffer.data_parallel_group
            for bucket in buffer.buckets:
                full = torch.empty_like(bucket.param_data)
                shard = shard_buffer(bucket.param_data, group.size())[group.rank()]
                dist.all_gather_into_tensor(full, shard.contiguous(), group=group)
                for p in bucket.params_list:
                    # the buffer's map, not the bucket's param_to_index: megatron-core 0.16 counts
                    # that one without the padding the distributed optimizer puts before params
                    # (a bias of 24 elements shifts every later param of the bucket)
                    start, end, _ = buffer.param_index_map[p]
                    current[p] = full[start - bucket.offset:end - bucket.offset].view_as(p).clone()
    return {name: current[p] for name, p in ddp.module.named_parameters()}

