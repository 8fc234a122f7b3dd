"""fsep's shards in Megatron's distributed checkpoints: saved and loaded in the stock layout.

Under fsep the experts train one parameter, the shards [E, ceil(W/D)] (runtime/sharded.py's
ShardedExpertStore), while a checkpoint holds the stock expert parameters: what stock EP saves,
loadable at any EP size and by a run with any policy. `sharded_state_dict()` of the experts module
is wrapped so that

* the stock parameters' entries are stock Megatron-Core's own, over real tensors holding the
  shards' values (ShardedExpertStore.stock_for_checkpoint);
* the shards get one entry, a ShardedTensorFactory. Megatron's optimizers find their parameters'
  state through the model's entries (the regular optimizer by the entry's `data`, the distributed
  one's fully reshardable format likewise) and build the state's entries by replacing `data` and
  prefixing `key`; with no entry, saving raised "Param id ... does not match any model sharded
  param". The factory's model instance saves nothing, not even a key (the stock entries beside it
  hold the weights); an optimizer's instance saves its state of the shards as stock-layout tensors under
  the stock entries' keys, prefixed as Megatron prefixes every parameter's state, and loads it
  back into the shard layout. So the optimizer state is in the stock layout too.

Building and merging the factory exchange whole experts over the EP group (a collective): every
EP rank of a pipeline stage saves and loads the same entries in the same order, as Megatron's
checkpointing does. Optimizer state in the distributed optimizer's default `dp_reshardable`
format and in `dp_zero_gather_scatter` (its buffers, by data-parallel rank) needs no entry and
loads under the same policy and expert-parallel size, at any data-parallel size, as stock EP's
does (not checked here: another policy's buffers can have the same sizes, and Megatron-Core
checks only those). `fully_sharded_model_space` is refused when the optimizer makes its entries,
as Megatron-Core 0.16.1 and 0.19.2 refuse it for every parameter. Saving builds each optimizer state's stock-layout copy where that state lives, all
before writing: transient memory of one stock copy of the local experts per state tensor.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor, ShardedTensorFactory

from ..runtime.sharded import ShardedExpertStore


def wrap_sharded_state_dict(store: ShardedExpertStore) -> None:
    """Wrap `store.experts.sharded_state_dict` (see the module docstring); nothing where the module
    has none."""
    experts = store.experts
    stock_sharded = getattr(experts, "sharded_state_dict", None)
    if stock_sharded is None:
        return

    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        store.stock_for_checkpoint()
        out = stock_sharded(prefix, sharded_offsets, metadata)
        out = {k: v for k, v in out.items() if not k.endswith(store.PARAM)}
        # the stock parameters' entries: what an optimizer state is saved as. An entry is under the
        # parameter's name, its data the parameter, a view of it, or (modules that read their own
        # state_dict(), such as GroupedMLP: this store's hook assembles it) a copy
        name_of = {p.untyped_storage().data_ptr(): n for n, p in store.params.items()}
        stock = []
        for k, v in out.items():
            if not isinstance(v, (ShardedTensor, ShardedTensorFactory)) or not torch.is_tensor(v.data):
                continue
            name = k[len(prefix):] if k.startswith(prefix) and k[len(prefix):] in store.params else \
                name_of.get(v.data.untyped_storage().data_ptr())
            if name is not None:
                stock.append((name, v))
        missing = set(store.params) - {name for name, _ in stock}
        if missing:
            raise NotImplementedError(f"fsep: {type(experts).__name__}.sharded_state_dict() has no entry for "
                                      f"{sorted(missing)}: its optimizer state cannot be saved in the stock layout")
        key = prefix + store.PARAM
        # replica_id as the stock entries it stands for: the model-space optimizer formats read it
        factory = _ShardsFactory(key, store.shards, None, _merge_fn(store, stock), replica_id=stock[0][1].replica_id)
        # the key as it is when the factory is built: Megatron renames entries in place after this
        # call (TransformerBlock: 'decoder.layers.<local index>.' -> 'decoder.layers.' or the global
        # index), and an optimizer's copy prefixes the renamed key
        factory.build_fn = _build_fn(store, lambda: factory.key, stock)
        out[key] = factory
        return out

    experts.sharded_state_dict = sharded_state_dict


class _ShardsFactory(ShardedTensorFactory):
    """The shards' entry. An optimizer's flattened range of it (the distributed optimizer's
    fully_sharded_model_space format) would index the shard layout, not the stock one: refused when
    the optimizer makes its entries, where and as Megatron-Core refuses every ShardedTensor's."""

    def validate_metadata_integrity(self):
        if self.flattened_range is not None:
            raise CheckpointingException("ShardedTensor.flattened_range is not supported (fsep's shards, "
                                         "like every stock parameter's entry)")


def _as_entry(t: torch.Tensor, entry, param: torch.Tensor) -> torch.Tensor:
    """`t` (contiguous, shaped like `param`) as entry.data is of `param`: the same view of it where
    entry.data is a view of the parameter, else (a copy) t itself."""
    view = entry.data
    if view.untyped_storage().data_ptr() == param.untyped_storage().data_ptr():
        return t.as_strided(view.shape, view.stride(),
                            t.storage_offset() + view.storage_offset() - param.storage_offset())
    if view.shape != param.shape:
        raise NotImplementedError(f"fsep: a checkpoint entry {entry.key!r} of shape {tuple(view.shape)} holds "
                                  f"neither the parameter {tuple(param.shape)} nor a view of it")
    return t


def _build_fn(store: ShardedExpertStore, model_key, stock: list):
    """The factory's build: the model's instance (data is the shards) -> nothing; an optimizer's
    (data [E, ceil(W/D)] its state of the shards, key: model_key() prefixed) -> {i: stock entry i
    over that state in the stock layout, its key prefixed alike}."""

    @torch.no_grad()
    def build(key: str, data: torch.Tensor, replica_id, flattened_range):
        assert flattened_range is None, "refused by _ShardsFactory.validate_metadata_integrity"
        if data is store.shards:  # not even a key: a stock model loading the checkpoint would not expect one
            return LocalNonpersistentObject(None)
        own_key = model_key()
        if not key.endswith(own_key):
            raise ValueError(f"fsep: an entry of the shards under {key!r}, which does not end in the model's "
                             f"{own_key!r}")
        prefix = key[:len(key) - len(own_key)]
        tensors = store.stock_layout(data)
        built = {}
        for i, (name, entry) in enumerate(stock):
            t = _as_entry(tensors[name], entry, store.params[name])
            if isinstance(entry, ShardedTensorFactory):  # e.g. a gated fc1's two halves
                built[str(i)] = replace(entry, key=prefix + entry.key, data=t).build()
            else:
                built[str(i)] = replace(entry, key=prefix + entry.key, data=t, dtype=t.dtype)
                built[str(i)].validate_metadata_integrity()
        return built

    return build


def _merge_fn(store: ShardedExpertStore, stock: list):
    """The inverse of _build_fn after a load: None (the model's instance: the stock entries loaded
    the weights, load_state_dict re-shards them) -> the shards as they are; {i: loaded} -> the
    shards' layout of it [E, ceil(W/D)]."""

    @torch.no_grad()
    def merge(loaded: dict | None):
        if loaded is None:
            return store.shards.detach()
        tensors = {}
        for i, (name, entry) in enumerate(stock):
            got = loaded[str(i)]
            if isinstance(entry, ShardedTensorFactory):
                got = entry.merge_fn(got)
            param = store.params[name]
            if name not in tensors:
                tensors[name] = torch.zeros(param.shape, dtype=got.dtype, device=got.device)
            full = tensors[name]
            _as_entry(full, entry, param).copy_(got)
        return store.shard_layout(tensors)

    return merge
