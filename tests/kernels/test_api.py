"""The kernels package API: lazy (no triton import for the torch backend), names the model can call."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_package_import_does_not_import_triton():
    code = ("import sys; import titan_glm52.kernels; from titan_glm52.kernels import reference; "
            "print('triton' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_triton_entry_points():
    import titan_glm52.kernels as k
    ops = k.triton_kernels()
    assert set(ops) == {"indexer_topk", "sparse_mla", "indexer_kl_sparse"}
    assert k.triton_sparse_mla is ops["sparse_mla"] and k.triton_indexer_topk is ops["indexer_topk"]
    assert k.triton_indexer_kl_sparse is ops["indexer_kl_sparse"]
    # after the submodules are imported, ``k.indexer_topk`` is the module; it is callable with the same contract
    from titan_glm52.kernels import indexer_topk as mod
    q, kk, w = torch.randn(6, 2, 16), torch.randn(6, 16), torch.randn(6, 2)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    assert torch.equal(mod(q, kk, w, cu, 3, 1.0), ops["indexer_topk"](q, kk, w, cu, 3, 1.0))
