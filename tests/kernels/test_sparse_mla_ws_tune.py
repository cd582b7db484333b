"""kernels/sparse_mla_ws.py on the CPU: its launch overrides merge with the defaults, and a CPU tensor never takes
the Gluon kernels (they need sm_90; their numerics are checked in tests/kernels/test_kernels_gpu.py, their compile in
test_kernels_compile.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_tune_file_overrides_merge_with_the_defaults(tmp_path):
    path = tmp_path / "tune.json"
    path.write_text(json.dumps({"sparse_mla_ws": {"bwd_grad": {"stages": 2}, "fwd": {"enable": False}}}))
    code = ("import json; from titan_glm52.kernels import sparse_mla_ws as W; "
            "print(json.dumps({'tune': W.TUNE, 'defaults': W.DEFAULTS}))")
    env = dict(os.environ, TITAN_DSA_TUNE_FILE=str(path))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    tune, defaults = got["tune"], got["defaults"]
    assert tune["bwd_grad"] == {**defaults["bwd_grad"], "stages": 2}
    assert tune["fwd"] == {**defaults["fwd"], "enable": False}
    assert tune["bwd_ps"] == defaults["bwd_ps"]


def test_cpu_tensors_take_the_triton_kernels():
    from titan_glm52.kernels import sparse_mla_ws as W
    q = torch.zeros(3, W.H, W.DA + W.DB, dtype=torch.bfloat16)
    kv = torch.zeros(3, W.DA + W.DB, dtype=torch.bfloat16)
    assert not W.supported(q, kv, W.DA)


def test_part1_ring_checked_before_launch(monkeypatch):
    """Part 1's ring needs two slots per consumer (one held while the next is awaited): a smaller or odd ring is
    refused before any launch (it would hang on the GPU)."""
    from titan_glm52.kernels import sparse_mla_ws as W
    for bad in ({"stages": 2}, {"stages": 7}):
        monkeypatch.setitem(W.TUNE, "bwd_ps", {**W.DEFAULTS["bwd_ps"], **bad})
        with pytest.raises(ValueError, match="must be even and >= 4"):
            W.bwd_ps(*[None] * 12)
