"""The node-aware sums of runtime/units.py against plain Python loops, and on the meta device.

`ordered_sum` must add each group's rows one by one in level order (so a partial is the same bits
whichever rank adds it), for any host width that bounds the levels; `levels` must number a group's
rows in row order. Neither may read device data: on a GPU that is a sync in the layer's forward.
"""
import numpy as np
import pytest
import torch

from megatron_rails.runtime.units import levels, ordered_sum


def _groups(rng, N: int, groups: int) -> np.ndarray:
    return rng.integers(0, groups, N).astype(np.int64)


def _levels_ref(group_N: np.ndarray) -> np.ndarray:
    seen: dict = {}
    out = np.empty_like(group_N)
    for i, g in enumerate(group_N.tolist()):
        out[i] = seen.get(g, 0)
        seen[g] = out[i] + 1
    return out


@pytest.mark.parametrize("N,groups", [(0, 3), (1, 1), (17, 5), (200, 7), (64, 200)])
def test_levels_number_each_groups_rows_in_row_order(N, groups):
    group_N = _groups(np.random.default_rng(N + groups), N, groups)
    got = levels(torch.from_numpy(group_N), groups)
    assert got.dtype == torch.int64
    assert np.array_equal(got.numpy(), _levels_ref(group_N))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,groups,H", [(0, 4, 3), (30, 6, 5), (300, 40, 8)])
def test_ordered_sum_adds_in_level_order_for_any_bounding_width(N, groups, H, dtype):
    rng = np.random.default_rng(N * 7 + groups)
    group_N = _groups(rng, N, groups)
    # levels in a shuffled row order, so level order is not row order
    perm = rng.permutation(N)
    level_N = np.empty(N, dtype=np.int64)
    level_N[perm] = _levels_ref(group_N[perm])
    y = torch.from_numpy(rng.standard_normal((N, H)) * 10.0 ** rng.integers(-3, 4, (N, 1))).to(dtype)
    if N:
        y[torch.from_numpy(group_N == group_N[0])] = -0.0  # a group of -0.0 rows must stay -0.0
    ref = torch.zeros((groups, H), dtype=dtype)
    for g in range(groups):
        rows = sorted(np.flatnonzero(group_N == g), key=lambda i: level_N[i])
        acc = None
        for i in rows:  # one rounded add at a time, as the layer's order defines
            acc = y[i].clone() if acc is None else acc + y[i]
        ref[g] = acc if acc is not None else torch.zeros(H, dtype=dtype)
    exact = int(level_N.max()) + 1 if N else 1
    for width in (exact, exact + 1, exact + 3):
        got = ordered_sum(y, torch.from_numpy(group_N), torch.from_numpy(level_N), groups, width)
        # bit for bit, the sign of zero included (as integers of the same width)
        bits = torch.int16 if dtype != torch.float32 else torch.int32
        nonempty = torch.from_numpy(np.bincount(group_N, minlength=groups) > 0)
        assert torch.equal(got[nonempty].view(bits), ref[nonempty].view(bits)), f"width {width}"
        empty = got[~nonempty]
        assert torch.equal(empty, torch.zeros_like(empty)) and not empty.signbit().any(), "empty group not +0.0"


def test_ordered_sum_and_levels_read_no_device_data():
    """On the meta device (shapes, no values): any op that reads a value to the host, or sizes its
    output by one (bincount, max().item()), raises here."""
    group_N = torch.empty(50, dtype=torch.int64, device="meta")
    level_N = levels(group_N, 9)
    assert level_N.shape == (50,) and level_N.device.type == "meta"
    y = torch.empty((50, 4), device="meta", requires_grad=True)
    out = ordered_sum(y, group_N, level_N, 9, width=3)
    assert out.shape == (9, 4) and out.device.type == "meta"
    out.sum().backward()
    assert y.grad.shape == y.shape
