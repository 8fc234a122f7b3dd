"""What the expert stores need to know about an expert module: the interface an adapter implements.

The stores (runtime/experts.py, runtime/sharded.py) move single experts around as flat vectors and
compute replica / FSEP slots with borrowed weights; they never look inside a module. An adapter
(the Megatron ones live in megatron/expert_kinds.py) says which views of the module's parameters
make up local expert i, and computes one expert on its tokens.

Shape letters (docs/architecture.md): N tokens of one slot, H hidden size.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

Slice = tuple[str, Callable[[torch.Tensor], torch.Tensor]]


class UnsupportedExperts(TypeError):
    """An expert module (or setting) the replica / FSEP stores cannot handle."""


class ExpertKind:
    """The adapter interface.

    module      the experts module (its `named_parameters()` are what `slices` names)
    num_local   experts held by the module
    slot_names  the keys of one slot's parameter dict, in `slices` order
    slices(i)   (parameter name, view function) pairs: applied to the named parameter the views are
                local expert i's tensors (differentiable), applied to a same-shaped buffer (a
                gradient, a checkpoint tensor) they give expert i's part of it
    compute(params, x_NH, probs_N) -> y_NH   one expert's math on its N tokens, router probs applied
    fused_wgrad  whether compute() adds a borrowed tensor's weight gradient into that tensor's
                `main_grad` attribute where it has one and hands autograd none (Megatron's
                gradient accumulation fusion): the stores then give every borrowed tensor one
    """

    name = "?"
    fused_wgrad = False
    module: torch.nn.Module
    num_local: int
    slot_names: tuple[str, ...]

    def slices(self, i: int) -> list[Slice]:
        raise NotImplementedError

    def compute(self, params: dict[str, torch.Tensor], x_NH: torch.Tensor, probs_N: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def unsupported(self, why: str) -> UnsupportedExperts:
        return UnsupportedExperts(f"megatron-rails cannot move experts of {type(self.module).__name__}: {why}")

    def check_coverage(self) -> None:
        """Every parameter of the module must belong to exactly one expert's slices: otherwise the
        stores would silently leave a parameter out of replicas, shards or checkpoints."""
        params = dict(self.module.named_parameters())
        covered: dict[str, int] = {}
        for i in range(self.num_local):
            for name, view in self.slices(i):
                covered[name] = covered.get(name, 0) + view(params[name]).numel()
        wrong = [n for n, p in params.items() if covered.get(n, 0) != p.numel()]
        if wrong:
            raise self.unsupported(f"parameters {wrong} are not split into {self.num_local} experts")
