"""kernels/indexer_topk_ws.py on the CPU: launch overrides lay over the defaults, a CPU tensor
never takes the Gluon scoring kernel (it needs sm_90; its scores are checked bit for bit against the
Triton kernel's in tests/kernels/test_kernels_gpu.py, its compile in test_kernels_compile.py), and
a launch it cannot run is refused."""

from __future__ import annotations

import pytest
import torch

from titan_glm52.kernels import indexer_topk_ws as W
from titan_glm52.kernels.tuning import launch_overrides


def test_overrides_merge_with_the_defaults():
    assert W.config() == W.DEFAULTS["score"] and W.rows_per_program() == W.DEFAULTS["score"]["bq"]
    with launch_overrides({"indexer_topk_ws": {"score": {"enable": False, "stages": 6}}}):
        assert W.config() == {**W.DEFAULTS["score"], "enable": False, "stages": 6}
    assert W.config() == W.DEFAULTS["score"]


def test_cpu_tensors_take_the_triton_kernel():
    q = torch.zeros(3, W.H, W.D, dtype=torch.bfloat16)
    k = torch.zeros(3, W.D, dtype=torch.bfloat16)
    assert not W.supported(q, k)


@pytest.mark.parametrize("bad", [{"bq": 16}, {"bq": 3}, {"bn": 128}, {"stages": 0}])
def test_unrunnable_launch_refused(bad):
    with launch_overrides({"indexer_topk_ws": {"score": bad}}):
        with pytest.raises(ValueError, match="needs bq in"):
            W.score(*[None] * 11)
