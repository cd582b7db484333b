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
