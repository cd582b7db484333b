"""model/model.py's chunked cross-entropy: the same bits as the per-chunk slicing it replaced, and no full-size
gradient tensors per chunk in backward."""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from titan_glm52.model.model import _head_ce_sum, chunked_cross_entropy_sum


def sliced_chunked_ce(head, h, labels, chunk):
    """The previous formulation: one slice of ``h`` per chunk."""
    total = h.new_zeros((), dtype=torch.float32)
    for a in range(0, h.shape[0], chunk):
        total = total + checkpoint(_head_ce_sum, head, h[a:a + chunk], labels[a:a + chunk], use_reentrant=False)
    return total


def _setup(dtype, t=45, d=24, vocab=50):
    g = torch.Generator().manual_seed(7)
    head = nn.Linear(d, vocab, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, d, generator=g) * 0.3)
    h = torch.randn(t, d, generator=g).to(dtype)
    labels = torch.randint(0, vocab, (t,), generator=g)
    labels[::5] = -100
    return head, h, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [8, 16, 45, 64])
def test_split_chunks_equal_sliced_chunks_bitwise(dtype, chunk):
    results = []
    for fn in (sliced_chunked_ce, chunked_cross_entropy_sum):
        head, h, labels = _setup(dtype)
        h.requires_grad_()
        loss = fn(head, h, labels, chunk)
        (loss * 0.37).backward()
        results.append((loss, h.grad, head.weight.grad))
    for a, b in zip(*results):
        assert a.dtype == b.dtype and torch.equal(a, b)


class _FullSizeAdds(TorchDispatchMode):
    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = torch.Size(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.add.Tensor and all(isinstance(a, torch.Tensor) and a.shape == self.shape
                                                    for a in args[:2]):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_backward_adds_no_full_size_gradients_per_chunk():
    head, h, labels = _setup(torch.float32)
    h.requires_grad_()
    loss = chunked_cross_entropy_sum(head, h, labels, 8)
    with _FullSizeAdds(h.shape) as mode:
        loss.backward()
    assert mode.count == 0
    head.weight.grad = None
    h.grad = None
    loss = sliced_chunked_ce(head, h, labels, 8)
    with _FullSizeAdds(h.shape) as mode:
        loss.backward()
    assert mode.count == 5  # what the slices cost: one full [T, D] add per chunk after the first
