"""The send order in one GPU kernel (Triton), for CUDA maps where Triton is importable; and the
combine's gather-and-sum of every token's expert outputs in one kernel.

runtime/local.order_pairs_on_device makes the same tensors from about ten torch ops; at Mixtral
shapes each op costs more host time than its kernel takes on the GPU, so this path launches three:
the map transposed and scanned per expert (torch), then one program per block of tokens that
looks up each routed pair's run in the per-plan table and writes its token, flat index and send
position. Integer values only, so it is bit-identical to the torch paths (tests run it under
Triton's interpreter on CPU against the host path, tensor for tensor). The gather-sum reads each
token's k rows and writes their sum, accumulated in float32 and rounded once, as torch's gather and
[k, T, H] sum do (two kernels and a [k*T, H] intermediate); bit-identical to that for k <= 2, where
the order of the additions cannot matter (GATHER_SUM_MAX_K).

Shape letters: docs/architecture.md (glossary). T local tokens, E experts, k pairs per token when
uniform, P pairs this rank sends, M this rank's route entries (runs).
"""
from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU install: the torch paths serve
    triton = None


_LAUNCHED: list = []  # names of the kernels whose launch has gone through once


class KernelUnavailable(RuntimeError):
    """The kernel's first launch failed (it could not be compiled or loaded here); __cause__ is why."""


def available() -> bool:
    return triton is not None


@functools.cache
def _kernel():
    """The jitted kernel, made on first use (Triton reads TRITON_INTERPRET when it jits)."""

    # sizes vary with every plan (M, runs_max) or batch (T): one compiled variant serves them all
    @triton.jit(do_not_specialize=["T", "E", "M", "runs_max"])
    def send_order_kernel(map_ptr, rank_ptr, table_ptr, token_ptr, flat_ptr, by_ptr,
                          T, E, M, runs_max, UNIFORM: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr):
        t = tl.program_id(0) * BT + tl.arange(0, BT)[:, None]  # [BT, 1] tokens of this program
        e = tl.arange(0, BE)[None, :]  # [1, BE]
        inside = (t < T) & (e < E)
        flat = t.to(tl.int64) * E + e
        routed = (tl.load(map_ptr + flat, mask=inside, other=0) != 0) & inside
        # place of the pair among its expert's pairs (the stock stream is expert-major, token-minor)
        c = tl.load(rank_ptr + e.to(tl.int64) * T + t, mask=routed, other=1).to(tl.int64) - 1
        # its run: this rank's route entries of expert e are runs first_E[e] .. first_E[e+1]-1, each
        # covering places lo..hi-1 of the expert's pairs, sent from position base + place
        first = tl.load(table_ptr + e, mask=e < E, other=0)
        last = tl.load(table_ptr + e + 1, mask=e < E, other=0)
        pos = tl.zeros([BT, BE], dtype=tl.int64)
        for i in range(0, runs_max):
            m = first + i
            has = m < last
            lo = tl.load(table_ptr + E + 1 + m, mask=has, other=0)
            hi = tl.load(table_ptr + E + 1 + M + m, mask=has, other=0)
            base = tl.load(table_ptr + E + 1 + 2 * M + m, mask=has, other=0)
            pos = tl.where(has & (c >= lo) & (c < hi), c + base, pos)
        tl.store(token_ptr + pos, (t + 0 * e).to(tl.int64), mask=routed)
        tl.store(flat_ptr + pos, flat, mask=routed)
        if UNIFORM:  # by_token, k-major: the j-th pair of token t (expert order) at j * T + t
            j = tl.cumsum(routed.to(tl.int32), axis=1) - 1
            tl.store(by_ptr + j.to(tl.int64) * T + t, pos, mask=routed)

    return send_order_kernel


def send_order_tensors(routing_map: torch.Tensor, table: torch.Tensor, M: int, runs_max: int, P: int, k: int):
    """(token_P int64 [P], flat_P int64 [P]: token * E + expert, by_token int64 [k*T] or None) on the
    map's device. routing_map bool [T, E]; table int64 [E+1+3M] on the device: first run of every
    expert (E+1), then the runs' first and past-last places among their expert's pairs and their
    send position minus that first place (M each); runs_max: most runs of one expert; k > 0: every
    token has k pairs (by_token wanted), else 0. The caller gathers the probs by flat_P (autograd
    then carries their gradient back to the router)."""
    T, E = routing_map.shape
    dev = routing_map.device
    # a routed pair's place + 1 among its expert's pairs: a scan along each expert's row of the
    # transposed map (along the map's columns, torch would scan E columns with one thread each)
    rank_ET = routing_map.T.contiguous().cumsum(1, dtype=torch.int32)
    out = torch.empty(2 * P + k * T, dtype=torch.int64, device=dev)
    token_P, flat_P, by_token = out[:P], out[P:2 * P], out[2 * P:]
    BE = triton.next_power_of_2(E)
    BT = max(1, min(triton.next_power_of_2(T), 2048 // BE))  # about 2048 pairs per program
    _launch("send_order", _kernel(), (triton.cdiv(T, BT),), routing_map.contiguous().view(torch.uint8), rank_ET, table, token_P,
            flat_P, by_token, T, E, M, runs_max, UNIFORM=bool(k), BT=BT, BE=BE)
    return token_P, flat_P, (by_token if k else None)


def _launch(name: str, kernel, grid: tuple, *args, **constexprs) -> None:
    """kernel[grid](*args, **constexprs); KernelUnavailable where the first launch of the kernel
    `name` fails (that one compiles: a failure there is the kernel's, not the caller's). Out of
    memory is re-raised."""
    try:
        kernel[grid](*args, **constexprs)
    except torch.OutOfMemoryError:
        raise
    except Exception as err:  # noqa: BLE001
        if name in _LAUNCHED:
            raise
        raise KernelUnavailable(str(err)) from err
    if name not in _LAUNCHED:
        _LAUNCHED.append(name)


GATHER_SUM_MAX_K = 2  # beyond, the sum's order of additions could differ from torch's reduction
GATHER_SUM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def _gather_sum_kernel():
    @triton.jit(do_not_specialize=["T", "H"])
    def gather_sum_kernel(y_ptr, by_ptr, out_ptr, T, H, K: tl.constexpr, BH: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1) * BH + tl.arange(0, BH)
        inside = h < H
        acc = tl.zeros([BH], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(by_ptr + j * T + t)
            acc += tl.load(y_ptr + row * H + h, mask=inside, other=0).to(tl.float32)
        tl.store(out_ptr + t.to(tl.int64) * H + h, acc.to(out_ptr.dtype.element_ty), mask=inside)

    return gather_sum_kernel


def gather_sum_fits(y_P: torch.Tensor, k: int) -> bool:
    """Whether gather_sum serves these rows: k <= GATHER_SUM_MAX_K, a 2-D contiguous float32 / bf16 /
    fp16 tensor."""
    return 1 <= k <= GATHER_SUM_MAX_K and y_P.dim() == 2 and y_P.dtype in GATHER_SUM_DTYPES and y_P.is_contiguous()


def gather_sum(y_P: torch.Tensor, by_token: torch.Tensor, k: int) -> torch.Tensor:
    """[T, H]: sum over j < k of y_P[by_token[j * T + t]] (by_token int64 [k*T], k-major), in one
    kernel; gather_sum_fits(y_P, k) must hold."""
    T, H = by_token.numel() // k, y_P.shape[1]
    out = torch.empty((T, H), dtype=y_P.dtype, device=y_P.device)
    if T == 0 or H == 0:
        return out
    BH = min(1024, triton.next_power_of_2(H))
    _launch("gather_sum", _gather_sum_kernel(), (T, triton.cdiv(H, BH)), y_P, by_token, out, T, H, K=k, BH=BH)
    return out
