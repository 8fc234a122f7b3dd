"""Runtime: what a rank does with a plan in one MoE layer step, on torch and torch.distributed alone
(no Megatron import): the local token work (send order, receive order, combine), the expert stores
(replica and FSEP slots, their weights and gradients), the collectives (`comm`: direct and RailS) and
the per-layer driver (`layer.LayerRuntime`) that the Megatron adapter wraps."""
