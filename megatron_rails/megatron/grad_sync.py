"""Megatron DDP's gradient synchronization, told to the resident slots (runtime/residency.py).

Megatron's schedules run every microbatch of an optimizer step but the last inside DDP's
`no_sync()`, and start the gradient reduction either from the last backward pass (DDP's
gradient-ready hooks) or explicitly (`start_grad_sync` as `grad_sync_func`, `finish_grad_sync` in
`finalize_model_grads`). Hooked here once per process:

* `no_sync()` also enters the runtime's `no_sync()`: slot gradients accumulate locally;
* a DDP built without overlap_grad_reduce reduces only in `finish_grad_sync()` and Megatron-LM then
  never enters no_sync: the rails layers inside it defer every return to that call (`defer_flush`);
* `start_grad_sync()` / `finish_grad_sync()` first return the slot gradients still owed by that
  DDP's own layers, so that the reduction reads complete gradients (the interleaved schedule with
  `grad_sync_func` runs a chunk's last backward inside no_sync and reduces that chunk afterwards,
  one chunk at a time: the other chunks' layers still accumulate and return at their own sync);
* a Megatron optimizer's `prepare_grads()`, the first thing its step reads gradients in, first
  returns whatever is still owed anywhere (the torch optimizer step hook of runtime/residency.py
  comes after the gradients were read there);
* with overlap_grad_reduce, a DDP holding rails layers launches its bucket groups' reductions in
  the order of its bucket-group lists, whatever order their gradients become ready in
  (`InOrderLaunch`). Stock Megatron launches a bucket group from the gradient-ready hooks as soon as
  its last gradient arrives and relies on every data-parallel rank running the same backward graph,
  so that all launch in the same order. Ours differ between expert-data-parallel replicas: each EP
  group plans from its own counts, and a group whose slots moved holds its owners' gradients back
  until the return (ReturnGate) while another's arrive expert by expert. Two replicas launching two
  equal-sized buckets in opposite orders would each sum the other's wrong bucket, silently.

The hooks stay after `uninstall()`: layers built meanwhile keep their dispatcher. Without rails
layers they do nothing (no store owes anything).
"""
from __future__ import annotations

import contextlib
import functools

from ..runtime import residency

_hooked: dict = {}


def hook_ddp() -> None:
    """Wrap Megatron-Core DDP's no_sync / start_grad_sync / finish_grad_sync (idempotent)."""
    if _hooked:
        return
    from megatron.core.distributed import DistributedDataParallel as DDP

    init, no_sync, start, finish = DDP.__init__, DDP.no_sync, DDP.start_grad_sync, DDP.finish_grad_sync
    zero = DDP.zero_grad_buffer

    def rails_init(self, config, ddp_config, module, *args, **kwargs):
        init(self, config, ddp_config, module, *args, **kwargs)
        self.rails_stores = []  # this model chunk's rails layers' stores
        for m in module.modules():
            store = getattr(getattr(getattr(m, "token_dispatcher", None), "runtime", None), "store", None)
            if store is not None:
                store.defer_flush = not ddp_config.overlap_grad_reduce
                self.rails_stores.append(store)
        self.rails_launches = []
        if self.rails_stores and ddp_config.overlap_grad_reduce:
            for name in ("bucket_groups", "expert_parallel_bucket_groups"):  # one process group each
                groups = getattr(self, name, None)
                if groups:
                    self.rails_launches.append(InOrderLaunch(groups))

    @contextlib.contextmanager
    def rails_no_sync(self):
        with residency.no_sync(), no_sync(self):
            yield

    def rails_start_grad_sync(self, *args, **kwargs):
        residency.flush_pending(_own_stores(self))
        return start(self, *args, **kwargs)

    def rails_finish_grad_sync(self, *args, **kwargs):
        residency.flush_pending(_own_stores(self))
        return finish(self, *args, **kwargs)

    def rails_zero_grad_buffer(self, *args, **kwargs):
        for launches in getattr(self, "rails_launches", ()):
            launches.reset()  # a step that failed half-way leaves no group waiting into the next
        return zero(self, *args, **kwargs)

    _hooked.update(init=init, no_sync=no_sync, start_grad_sync=start, finish_grad_sync=finish,
                   zero_grad_buffer=zero)
    DDP.__init__, DDP.no_sync, DDP.zero_grad_buffer = rails_init, rails_no_sync, rails_zero_grad_buffer
    DDP.start_grad_sync, DDP.finish_grad_sync = rails_start_grad_sync, rails_finish_grad_sync
    _hook_optimizers()


class InOrderLaunch:
    """The reductions of a list of bucket groups (one process group's) launched in list order:
    a group whose gradients are ready waits until every group before it was launched, and then
    goes. Megatron orders the list as gradients usually become ready (the buckets nearest the
    output first), so in the usual backward nothing waits. Calls for a group already launched in
    this round (DDP's explicit start_grad_sync after the hooks) go through as they would in stock.
    The round restarts once the last group was launched, and at every zero_grad_buffer()."""

    def __init__(self, groups: list):
        self.groups = list(groups)
        self.index = {id(g): i for i, g in enumerate(self.groups)}
        self.reset()
        for g in self.groups:
            g.start_grad_sync = functools.partial(self.start, g, g.start_grad_sync)

    def reset(self) -> None:
        self.next, self.ready = 0, {}

    def start(self, group, launch, *args, **kwargs):
        i = self.index[id(group)]
        if i < self.next:
            return launch(*args, **kwargs)
        self.ready[i] = (launch, args, kwargs)
        while self.next in self.ready:
            go, a, kw = self.ready.pop(self.next)
            self.next += 1
            go(*a, **kw)
        if self.next == len(self.groups):
            self.reset()
        return None


def _own_stores(ddp):
    """The stores of `ddp`'s own rails layers; None (every store) where it has none to name, so
    that nothing owed is ever left out of a reduction."""
    return getattr(ddp, "rails_stores", None) or None


def _hook_optimizers() -> None:
    """Every Megatron optimizer class that defines prepare_grads(): return what is owed first."""
    from megatron.core import optimizer as megatron_optimizer

    for cls in vars(megatron_optimizer.optimizer).values():
        if not (isinstance(cls, type) and "prepare_grads" in vars(cls)
                and issubclass(cls, megatron_optimizer.MegatronOptimizer)):
            continue
        prepare = cls.prepare_grads
        if getattr(prepare, "__isabstractmethod__", False):
            continue

        @functools.wraps(prepare)
        def rails_prepare_grads(self, *args, _prepare=prepare, **kwargs):
            residency.flush_pending()
            return _prepare(self, *args, **kwargs)

        _hooked[f"{cls.__name__}.prepare_grads"] = (cls, prepare)
        cls.prepare_grads = rails_prepare_grads
