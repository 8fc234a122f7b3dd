"""Every MoE router's top-k choice per forward: what two runs from the same weights and data are
compared by (routing flips: tests/flips.py, `megatron-rails demo`)."""
from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.distributed as dist


class RoutingLog:
    """Every MoE router's top-k expert choice of `model`, per training or evaluation forward:
    `maps[y][c]` is router y's routing map (bool [T, E], this rank's tokens) at its c-th forward.
    Recomputed forwards (activation recompute runs inside a backward pass) are not recorded: they
    repeat a recorded one. `close()` removes the hooks."""

    def __init__(self, models=None, maps=None):
        if maps is not None:  # a slice of another log
            self.maps, self._hooks, self._paused = maps, [], False
            return
        models = models if isinstance(models, (list, tuple)) else [models]
        routers = [m for model in models for m in model.modules() if type(m).__name__ == "TopKRouter"]
        if not routers:
            raise ValueError("RoutingLog: no TopKRouter in the model")
        self.maps: list[list[torch.Tensor]] = [[] for _ in routers]
        self._hooks = [r.register_forward_hook(self._hook(y)) for y, r in enumerate(routers)]
        self._paused = False

    def _hook(self, y: int):
        def record(module, args, out):
            if self._paused or torch._C._current_graph_task_id() != -1:  # a recompute inside the backward pass
                return
            routing_map_TE = out[1]
            self.maps[y].append(routing_map_TE.detach().bool().clone())

        return record

    @contextlib.contextmanager
    def paused(self):
        """Forwards inside are not recorded (an evaluation forward one run makes and another not)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def slice(self, first: int, end: int | None = None) -> "RoutingLog":
        """The forwards [first, end) of every router (a resumed run's part of a whole run)."""
        return RoutingLog(maps=[m[first:end] for m in self.maps])

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    def gathered(self) -> np.ndarray:
        """bool [Y, C, D, T, E]: every router's maps of every forward, from every rank of the default
        group (a collective; every rank gets it). Every rank must hold the same T at a forward."""
        mine_YCTE = torch.stack([torch.stack(maps) for maps in self.maps])
        got = [torch.empty_like(mine_YCTE) for _ in range(dist.get_world_size())]
        dist.all_gather(got, mine_YCTE)
        return torch.stack(got, dim=2).numpy()


def flips_per_forward(got_YCDTE: np.ndarray, ref_YCDTE: np.ndarray) -> np.ndarray:
    """int64 [C]: per forward, the tokens (over routers and ranks) whose expert set differs between
    two `gathered()` logs of the same schedule."""
    if got_YCDTE.shape != ref_YCDTE.shape:
        raise ValueError(f"the runs' routing logs differ in shape: {got_YCDTE.shape} and {ref_YCDTE.shape}")
    return (got_YCDTE != ref_YCDTE).any(axis=-1).sum(axis=(0, 2, 3)).astype(np.int64)
