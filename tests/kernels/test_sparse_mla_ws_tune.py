"""kernels/sparse_mla_ws.py on the CPU: launch overrides lay over the defaults, a CPU tensor never
takes the Gluon kernels (they need sm_90; their numerics are checked in
tests/kernels/test_kernels_gpu.py, their compile in test_kernels_compile.py), and a launch they
cannot run is refused."""

from __future__ import annotations

import pytest
import torch

from titan_glm52.kernels import sparse_mla_ws as W
from titan_glm52.kernels.tuning import launch_overrides


def test_overrides_merge_with_the_defaults():
    assert {part: W.config(part) for part in W.DEFAULTS} == W.DEFAULTS
    with launch_overrides({"sparse_mla_ws": {"bwd_grad": {"stages": 2}, "fwd": {"enable": False}}}):
        assert W.config("bwd_grad") == {**W.DEFAULTS["bwd_grad"], "stages": 2}
        assert W.config("fwd") == {**W.DEFAULTS["fwd"], "enable": False}
        assert W.config("bwd_ps") == W.DEFAULTS["bwd_ps"]
    assert W.config("bwd_grad") == W.DEFAULTS["bwd_grad"] and W.config("fwd") == W.DEFAULTS["fwd"]


def test_unknown_part_or_key_refused():
    for bad, what in (
        ({"bwd": {"stages": 4}}, "unknown part 'bwd'"),
        ({"bwd_ps": {"stage": 4}}, "unknown key.*'stage'"),
    ):
        with pytest.raises(ValueError, match=what):
            with launch_overrides({"sparse_mla_ws": bad}):
                pass


def test_cpu_tensors_take_the_triton_kernels():
    q = torch.zeros(3, W.H, W.DA + W.DB, dtype=torch.bfloat16)
    kv = torch.zeros(3, W.DA + W.DB, dtype=torch.bfloat16)
    assert not W.supported(q, kv, W.DA)


def test_part1_ring_checked_before_launch():
    """Part 1's ring needs two slots per consumer (one held while the next is awaited): a smaller or
    odd ring is refused before any launch (it would hang on the GPU)."""
    for bad in ({"stages": 2}, {"stages": 7}):
        with launch_overrides({"sparse_mla_ws": {"bwd_ps": bad}}):
            with pytest.raises(ValueError, match="must be even and >= 4"):
                W.bwd_ps(*[None] * 12)
