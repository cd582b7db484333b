"""FP8 training's quantisation kernels in the Triton interpreter and its products on CPU, against
quantise-then-matmul references (``_cases.check_fp8``; at real size on a GPU:
``test_kernels_gpu.py``)."""

from __future__ import annotations

import pytest

try:
    from ._cases import check_fp8, check_fp8_head
except ImportError:
    from _cases import check_fp8, check_fp8_head


@pytest.mark.parametrize(
    "splits",
    [
        [300],  # one segment (a linear), a short last tile
        [100, 0, 250, 1, 129],  # experts: uneven, one without rows, tiles cut at experts
    ],
)
def test_fp8_quantisation_and_products(splits):
    check_fp8("cpu", splits, dim=256, hidden=192, tol=1e-5)


@pytest.mark.parametrize("splits", [[300], [100, 0, 250, 1, 129]])
def test_fp8_products_on_the_kernel_path(monkeypatch, splits):
    """The products as CUDA runs them (the Triton quantisation, segments padded to ROW_ALIGN rows,
    per-segment scale views, each product's padded rows written over the next expert's rows or,
    past the end, into a scratch product), with the products of the dequantised operands in place
    of cuBLAS's: the same results as the CPU path's."""
    from titan_glm52.model import fp8_mm as M

    monkeypatch.setattr(M, "_on_kernel", lambda *ts: True)
    check_fp8("cpu", splits, dim=256, hidden=192, tol=1e-5)


@pytest.mark.parametrize("kernel_path", [False, True])
@pytest.mark.parametrize(
    "rows, chunk, piece",
    [
        (200, 4096, 16384),  # one chunk (its weight gradient written in place), padded rows
        (300, 128, 128),  # three chunks, the later ones' weight gradient in two pieces of 128 rows
    ],
)
def test_fp8_head_loss_and_gradients(monkeypatch, kernel_path, rows, chunk, piece):
    """The LM head's fused loss in FP8 (``_cases.check_fp8_head``), on the CPU path and on the
    kernel path (the Triton quantisation, as ``test_fp8_products_on_the_kernel_path``)."""
    if kernel_path:
        from titan_glm52.model import fp8_mm as M

        monkeypatch.setattr(M, "_on_kernel", lambda *ts: True)
    check_fp8_head("cpu", rows, dim=256, vocab=256, chunk=chunk, piece=piece, tol=1e-5)


def test_registered_ops_pass_torch_checks():
    """The FP8 product and its two gradient products as torch.library registers them
    (``model/ops.py``): schema, fake (meta) kernels, autograd registration and tracing, as
    ``torch.library.opcheck`` checks them, on the CPU path."""
    import torch

    from titan_glm52.model import fp8_mm as M

    g = torch.Generator().manual_seed(0)
    splits = [100, 0, 156]
    x = torch.randn(256, 256, generator=g).requires_grad_()
    w = (torch.randn(3, 128, 256, generator=g) * 0.05).requires_grad_()
    dy = torch.randn(256, 128, generator=g)
    torch.library.opcheck(M.fp8_expert_mm, (x, w, splits))
    torch.library.opcheck(M._input_grad, (dy, w.detach(), splits))
    torch.library.opcheck(M._weight_grad, (dy, x.detach(), splits, torch.float32))
    with torch.device("meta"):
        out = M.fp8_expert_mm(torch.empty(256, 256), torch.empty(3, 128, 256), splits)
    assert out.shape == (256, 128)
