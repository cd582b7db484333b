"""kernels/indexer_topk_ws.py on the CPU: its launch overrides merge with the defaults, a CPU tensor never takes the
Gluon scoring kernel (it needs sm_90; its scores are checked bit for bit against the Triton kernel's in
tests/kernels/test_kernels_gpu.py, its compile in test_kernels_compile.py), and a launch it cannot run is refused."""

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
    path.write_text(json.dumps({"indexer_topk_ws": {"score": {"enable": False, "stages": 6}}}))
    code = ("import json; from titan_glm52.kernels import indexer_topk_ws as W; "
            "print(json.dumps({'tune': W.TUNE, 'defaults': W.DEFAULTS}))")
    env = dict(os.environ, TITAN_DSA_TUNE_FILE=str(path))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["tune"]["score"] == {**got["defaults"]["score"], "enable": False, "stages": 6}


def test_cpu_tensors_take_the_triton_kernel():
    from titan_glm52.kernels import indexer_topk_ws as W
    q = torch.zeros(3, W.H, W.D, dtype=torch.bfloat16)
    k = torch.zeros(3, W.D, dtype=torch.bfloat16)
    assert not W.supported(q, k)


@pytest.mark.parametrize("bad", [{"bq": 16}, {"bq": 3}, {"bn": 128}, {"stages": 0}])
def test_unrunnable_launch_refused(monkeypatch, bad):
    from titan_glm52.kernels import indexer_topk_ws as W
    monkeypatch.setitem(W.TUNE, "score", {**W.DEFAULTS["score"], **bad})
    with pytest.raises(ValueError, match="needs bq in"):
        W.score(*[None] * 11)
