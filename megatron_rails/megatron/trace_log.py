"""Recording a training run's routing: the policy key `trace: FILE.npz` (`--rails-trace FILE.npz`).

Every RailsTokenDispatcher built with a policy that names a trace hands its layer's all-gathered
counts_DE to that file's `Recorder`, once per training forward (the runtime's `count_sink`; not for
an activation recompute's replay, evaluation or inference). The counts are on the host already (the
planner reads them there), so recording adds no device sync: a copy per layer and microbatch, and
a file write per microbatch row.

Shape legend: I rows (training forwards)   Y MoE layers of this rank   D EP ranks   E experts

* Rows: row i holds every layer's counts of the i-th training forward, [Y, D, E], and the
  optimizer step it belongs to (`step_I`; a step ends at an optimizer step, `residency.epoch`).
  A row is written when every layer has its counts; memory holds at most the layers' forwards in
  flight, the file grows (core/trace.TraceStream).
* One writer per pipeline stage: the rank of tensor-parallel rank 0 and data-parallel rank 0 (its
  EP group's counts are every EP rank's). Stage 0 writes FILE, stage s > 0 FILE with `.stage{s}`
  before the suffix; with no Megatron parallel state, global rank 0 writes FILE. Other ranks record
  nothing.
* The file is rewritten whole at every `flush()`: the launcher flushes after every checkpoint save,
  and every recorder at interpreter exit (`close_all`).
"""
from __future__ import annotations

import atexit
import os
import time
from pathlib import Path

import numpy as np
import torch.distributed as dist

from ..core.trace import TraceError, TraceStream
from ..runtime import residency

_recorders: dict[str, "Recorder"] = {}  # requested path -> its recorder (one per file and process)


def writer_path(path) -> Path | None:
    """Where this rank writes the trace `path`, or None when another rank of its stage does."""
    p = Path(path)
    if not dist.is_initialized():
        return p
    try:
        from megatron.core import parallel_state as ps

        staged = ps.model_parallel_is_initialized()
    except ImportError:
        staged = False
    if not staged:
        return p if dist.get_rank() == 0 else None
    if ps.get_tensor_model_parallel_rank() != 0 or ps.get_data_parallel_rank(with_context_parallel=True) != 0:
        return None
    stage = ps.get_pipeline_model_parallel_rank()
    return p if stage == 0 else p.with_name(f"{p.stem}.stage{stage}{p.suffix}")


class Recorder:
    """The layers of one trace file on this rank; see the module docstring."""

    def __init__(self, path: Path, meta: dict):
        self.stream = TraceStream(path, meta)
        self.pending: list[list[np.ndarray]] = []  # per layer: counts of forwards not yet in a row
        self._epoch: int | None = None
        self.step = 0
        self.seconds = 0.0  # spent recording (copies, rows, file writes; not flushes): bench step --record

    def add(self, dispatcher) -> None:
        """Record `dispatcher`'s layer from its next training forward on (layer index: the order added)."""
        if self.stream.rows:
            raise TraceError(f"{self.stream.path}: a MoE layer was built after recording began; build every "
                             "layer before the first training forward")
        queue: list[np.ndarray] = []
        self.pending.append(queue)

        def sink(counts_DE: np.ndarray) -> None:
            t0 = time.perf_counter()
            queue.append(np.array(counts_DE, dtype=np.int64, copy=True))
            if all(self.pending):
                self._row()
            self.seconds += time.perf_counter() - t0

        dispatcher.runtime.count_sink = sink

    def _row(self) -> None:
        epoch = residency.epoch()
        if self._epoch is not None and epoch != self._epoch:
            self.step += 1  # one optimizer step (a chained optimizer's several hooks count once)
        self._epoch = epoch
        self.stream.append(np.stack([q.pop(0) for q in self.pending]), self.step)

    def flush(self):
        return self.stream.flush()

    def close(self):
        return self.stream.close()


def recorder_for(path, dispatcher) -> Recorder | None:
    """The recorder `dispatcher`'s layer reports to (made at the first layer), None on ranks that
    do not write. TraceError where the file cannot be written."""
    key = os.fspath(path)
    if key not in _recorders:
        where = writer_path(key)
        if where is None:
            return None
        meta = {"ranks": int(dispatcher.ep_size), "experts": int(dispatcher.num_experts),
                "policy": dispatcher.runtime.policy.policy, "topk": int(dispatcher.config.moe_router_topk),
                "hidden": int(dispatcher.config.hidden_size), "source": f"recorded by rank "
                f"{dist.get_rank() if dist.is_initialized() else 0} ({where.name})"}
        if not _recorders:
            atexit.register(close_all)
        _recorders[key] = Recorder(where, meta)
    rec = _recorders[key]
    rec.add(dispatcher)
    return rec


def recorders() -> dict[str, Recorder]:
    """The traces this process records: requested path -> recorder."""
    return dict(_recorders)


def flush_all() -> None:
    """Rewrite every trace file this process records from the rows so far (after a checkpoint)."""
    for rec in _recorders.values():
        rec.flush()


def close_all() -> None:
    """Flush and finish every trace this process records; layers built later start new files."""
    while _recorders:
        _, rec = _recorders.popitem()
        rec.close()
