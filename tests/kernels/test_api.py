"""The kernels package API: lazy (no triton import for the torch backend), names the model can
call."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_package_import_does_not_import_triton():
    code = (
        "import sys; import titan_glm52.kernels; from titan_glm52.kernels import reference; "
        "print('triton' in sys.modules)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_triton_entry_points():
    import titan_glm52.kernels as k
    from titan_glm52.kernels import reference

    ops = k.triton_kernels()
    assert set(ops) == {"indexer_topk", "sparse_mla", "indexer_kl_sparse", "sparse_mla_indexer_kl"}
    assert k.triton_sparse_mla is ops["sparse_mla"] and k.triton_indexer_topk is ops["indexer_topk"]
    assert k.triton_indexer_kl_sparse is ops["indexer_kl_sparse"]
    # they are the modules' functions; a module stays a plain module (``k.indexer_topk`` once it
    # is imported)
    from titan_glm52.kernels import indexer_loss, indexer_topk, sparse_mla

    assert ops["indexer_topk"] is indexer_topk.indexer_topk
    assert ops["sparse_mla"] is sparse_mla.sparse_mla
    assert ops["indexer_kl_sparse"] is indexer_loss.indexer_kl_sparse
    assert ops["sparse_mla_indexer_kl"] is indexer_loss.sparse_mla_indexer_kl
    assert k.indexer_topk is indexer_topk
    assert not any(callable(m) for m in (indexer_topk, sparse_mla, indexer_loss))
    from titan_glm52.kernels._triton_env import interpreting

    dev = "cpu" if interpreting() else "cuda"
    q, kk, w = (
        torch.randn(6, 2, 16, device=dev),
        torch.randn(6, 16, device=dev),
        torch.randn(6, 2, device=dev),
    )
    cu = torch.tensor([0, 2, 6], dtype=torch.int32, device=dev)
    # the same set per row (the Triton kernel lists it in row order)
    rows = [
        fn(q, kk, w, cu, 3, 1.0).sort(dim=1).values
        for fn in (ops["indexer_topk"], reference.indexer_topk)
    ]
    assert torch.equal(*rows)


def test_scale_kernel_equals_the_torch_product():
    """kernels/scale.py (the fused loss's backward scaling on CUDA): one rounding of the fp32
    product, the same bits as model/head.py's torch path, with a ragged last block (also under the
    interpreter: _triton_env makes its fp32 -> bf16 casts round to nearest even, as the compiled
    kernel does)."""
    from titan_glm52.kernels._triton_env import interpreting
    from titan_glm52.kernels.scale import scaled
    from titan_glm52.model.head import _scaled

    g = torch.tensor(1 / 3, dtype=torch.float32)
    dev = "cpu" if interpreting() else "cuda"
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(37, 129, generator=torch.Generator().manual_seed(0)).to(dtype)
        ref = _scaled(x, g, rows=5)
        assert torch.equal(ref, (x.float() * g).to(dtype))
        out = scaled(x.to(dev), g.to(dev)).cpu()
        assert out.dtype == dtype and out.shape == x.shape
        assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="one element"):
        scaled(x.to(dev), torch.ones(2, device=dev))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_kernel_equals_the_torch_path(dtype):
    """kernels/cross_entropy.py (the fused loss's per-chunk work on CUDA): per-row loss and
    ``softmax - onehot`` written over the logits equal model/head.py's torch path, over several
    column blocks with a ragged last one, targets in the first and the last block, and ignored rows
    (loss 0, gradient 0)."""
    from titan_glm52.kernels._triton_env import interpreting
    from titan_glm52.kernels.cross_entropy import cross_entropy_rows
    from titan_glm52.model.head import IGNORE_INDEX, _chunk_loss_and_grad

    dev = "cpu" if interpreting() else "cuda"
    g = torch.Generator().manual_seed(3)
    h = torch.randn(6, 32, generator=g).to(dtype)
    w = (torch.randn(1000, 32, generator=g) * 0.5).to(dtype)
    labels = torch.tensor([0, 999, IGNORE_INDEX, 517, 3, IGNORE_INDEX])
    z = torch.nn.functional.linear(h, w)
    ref_loss, ref_grad = _chunk_loss_and_grad(z.clone(), labels, True)  # CPU: the torch path
    z = z.to(dev)
    z_before = z.clone()
    loss = cross_entropy_rows(
        z.clone(), labels.to(dev), IGNORE_INDEX, grad_in_place=False, block=256
    )
    assert loss.dtype == torch.float32 and loss.shape == (6,)
    assert loss[2] == 0 and loss[5] == 0
    torch.testing.assert_close(loss.sum().cpu(), ref_loss, rtol=1e-5, atol=1e-5)
    loss2 = cross_entropy_rows(z, labels.to(dev), IGNORE_INDEX, grad_in_place=True, block=256)
    assert torch.equal(loss2, loss)
    grad = z.cpu()
    assert grad.dtype == dtype and not torch.equal(grad, z_before.cpu())
    assert (grad[2] == 0).all() and (grad[5] == 0).all()
    if dtype == torch.float32:
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
    else:  # one bf16 step (exp's last fp32 bits, and the interpreter's truncating cast)
        ulp = torch.finfo(torch.bfloat16).eps * ref_grad.float().abs() + 1e-30
        assert ((grad.float() - ref_grad.float()).abs() <= ulp).all()
    with pytest.raises(ValueError, match="labels"):
        cross_entropy_rows(z, labels[:3].to(dev), IGNORE_INDEX, grad_in_place=False)
    with pytest.raises(ValueError, match="contiguous rows"):
        cross_entropy_rows(z.t(), labels.to(dev), IGNORE_INDEX, grad_in_place=False)
