"""StepBuffers (runtime/buffers.py): a kept buffer is handed out again only when nothing else refers
to its memory (no view, no tensor autograd saved for backward), else a fresh one; per dtype."""
import pytest
import torch

from megatron_rails.runtime import buffers
from megatron_rails.runtime.buffers import StepBuffers

pytestmark = pytest.mark.skipif(buffers._use_count is None, reason="this torch exposes no storage use count")


def test_idle_buffer_is_reused():
    pool = StepBuffers()
    a = pool.get("x", (4, 8), torch.float32, "cpu")
    ptr = a.data_ptr()
    del a
    b = pool.get("x", (2, 8), torch.float32, "cpu")  # smaller fits in the same memory
    assert b.data_ptr() == ptr and b.shape == (2, 8)
    del b
    c = pool.get("x", (8, 8), torch.float32, "cpu")  # larger: fresh, and kept from now on
    assert c.numel() == 64
    ptr = c.data_ptr()
    del c
    assert pool.get("x", (8, 8), torch.float32, "cpu").data_ptr() == ptr


def test_buffer_in_use_is_not_handed_out_again():
    pool = StepBuffers()
    a = pool.get("x", (4, 8), torch.float32, "cpu")
    view = a[1:]
    view.fill_(2.0)
    del a
    b = pool.get("x", (4, 8), torch.float32, "cpu")  # a view still reads the first one
    assert b.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
    b.fill_(1.0)
    assert torch.equal(view, torch.full((3, 8), 2.0))


def test_buffer_saved_for_backward_is_not_handed_out_again():
    pool = StepBuffers()
    w = pool.get("w", (3, 3), torch.float32, "cpu")
    w.copy_(torch.eye(3))
    x = torch.ones(2, 3, requires_grad=True)
    y = x @ w.view(3, 3)  # autograd saves w for x's gradient
    ptr = w.data_ptr()
    del w
    fresh = pool.get("w", (3, 3), torch.float32, "cpu")
    assert fresh.data_ptr() != ptr
    fresh.fill_(7.0)  # must not change what the backward reads
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(2, 3))


def test_dtypes_are_kept_apart():
    pool = StepBuffers()
    a = pool.get("x", (4,), torch.float32, "cpu")
    b = pool.get("x", (4,), torch.bfloat16, "cpu")
    assert a.dtype == torch.float32 and b.dtype == torch.bfloat16
    assert pool.nbytes() == 4 * 4 + 4 * 2
