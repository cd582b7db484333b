"""FP8 training's quantisation kernels in the Triton interpreter and its products on CPU, against
quantise-then-matmul references (``_cases.check_fp8``; at real size on a GPU:
``test_kernels_gpu.py``)."""

from __future__ import annotations

import pytest

try:
    from ._cases import check_fp8
except ImportError:
    from _cases import check_fp8


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
