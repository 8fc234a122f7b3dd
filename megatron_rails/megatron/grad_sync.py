"""Megatron DDP's gradient synchronization, told to the resident slots (runtime/residency.py).

Megatron's schedules run every microbatch of an optimizer step but the last inside DDP's
`no_sync()`, and start the gradient reduction either from the last backward pass (DDP's
gradient-ready hooks) or explicitly (`start_grad_sync` as `grad_sync_func`, `finish_grad_sync` in
`finalize_model_grads`). Hooked here once per process:

* `no_sync()` also enters the runtime's `no_sync()`: slot gradients accumulate locally;
* a DDP built without overlap_grad_reduce reduces only in `finish_grad_sync()` and Megatron-LM then
  never enters no_sync: the rails layers inside it defer every return to that call (`defer_flush`);
* `start_grad_sync()` / `finish_grad_sync()` first return any slot gradients still owed, so that
  the reduction reads complete gradients (the interleaved schedule with `grad_sync_func` runs the
  chunk's last backward inside no_sync and reduces afterwards).

The hooks stay after `uninstall()`: layers built meanwhile keep their dispatcher. Without rails
layers they do nothing (no store owes anything).
"""
from __future__ import annotations

import contextlib

from ..runtime import residency

_hooked: dict = {}


def hook_ddp() -> None:
    """Wrap Megatron-Core DDP's no_sync / start_grad_sync / finish_grad_sync (idempotent)."""
    if _hooked:
        return
    from megatron.core.distributed import DistributedDataParallel as DDP

    init, no_sync, start, finish = DDP.__init__, DDP.no_sync, DDP.start_grad_sync, DDP.finish_grad_sync

    def rails_init(self, config, ddp_config, module, *args, **kwargs):
        init(self, config, ddp_config, module, *args, **kwargs)
        for m in module.modules():
            store = getattr(getattr(getattr(m, "token_dispatcher", None), "runtime", None), "store", None)
            if store is not None:
                store.defer_flush = not ddp_config.overlap_grad_reduce

    @contextlib.contextmanager
    def rails_no_sync(self):
        with residency.no_sync(), no_sync(self):
            yield

    def rails_start_grad_sync(self, *args, **kwargs):
        residency.flush_pending()
        return start(self, *args, **kwargs)

    def rails_finish_grad_sync(self, *args, **kwargs):
        residency.flush_pending()
        return finish(self, *args, **kwargs)

    _hooked.update(init=init, no_sync=no_sync, start_grad_sync=start, finish_grad_sync=finish)
    DDP.__init__, DDP.no_sync = rails_init, rails_no_sync
    DDP.start_grad_sync, DDP.finish_grad_sync = rails_start_grad_sync, rails_finish_grad_sync
