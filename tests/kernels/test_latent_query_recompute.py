"""[dsa] recompute_latent_query: the sparse attention's backward forms the latent query [q_nope
W_uk, q_rope] again instead of keeping it, with the same bits (the same eager ops on the same
inputs), so every gradient is the same; after forward nothing holds the latent queries; activation
checkpointing (its own recompute) turns it off. On the Triton backend (the interpreter without a
GPU), whose sparse attention keeps exactly that tensor, and on torch's."""

import gc
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from titan_glm52 import GLM52Model, get_flavor
from titan_glm52.kernels._triton_env import interpreting
from titan_glm52.model import attention as attention_mod
from titan_glm52.model import recompute as recompute_mod
from titan_glm52.model.attention import Attention
from tests.losses import cross_entropy_sum
from titan_glm52.model.options import ModelOptions
from titan_glm52.parallelize import apply_compile

TOKENS = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
CU = torch.tensor([0, 20, 32, 64], dtype=torch.int32)  # 3 documents, one shorter than index_topk


def _model(backend: str, rebuild: bool) -> GLM52Model:
    if backend == "triton" and not interpreting():
        pytest.skip(
            "the Triton backend on CPU tensors needs the interpreter (TRITON_INTERPRET=1, which "
            "tests/conftest.py sets without a GPU); on a GPU "
            "tests/unit/test_forward_determinism.py covers it"
        )
    # sparse at 32 tokens; 2 layers (IndexShare FF) + MTP keep the interpreter's runs short
    options = ModelOptions(dsa_backend=backend, recompute_latent_query=rebuild)
    model = GLM52Model(get_flavor("debug").replace(index_topk=8, num_hidden_layers=2), options)
    model.init_weights(seed=3)
    return model


def _step(model: GLM52Model, wrap=None):
    if wrap is not None:
        for block in list(model.layers.values()) + [model.mtp.block]:
            block.forward = (lambda f: lambda *a: wrap(f, *a))(block.forward)
    logits, mtp = model(TOKENS, CU, with_mtp=True)
    loss = cross_entropy_sum(logits[:, :-1], TOKENS[:, 1:]) + cross_entropy_sum(
        mtp[:, :-2], TOKENS[:, 2:]
    )
    loss.backward()
    return [loss.detach()] + [
        p.grad for _, p in sorted(model.named_parameters()) if p.grad is not None
    ]


@pytest.mark.parametrize("backend,compile", [("triton", False), ("triton", True), ("torch", False)])
def test_rebuilt_latent_query_gives_the_same_bits(backend, compile):
    runs = []
    for rebuild in (False, True):
        model = _model(backend, rebuild)
        if compile:
            apply_compile(model, backend="aot_eager")
        runs.append(_step(model))
    assert len(runs[0]) == len(runs[1]) > 10
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rebuild", [True, False])
def test_the_latent_queries_are_not_kept(rebuild, monkeypatch):
    refs = []
    real = attention_mod._absorb

    def spy(*args):
        out = real(*args)
        if torch.is_grad_enabled():  # the forward's (the rebuild runs without grad)
            refs.append(weakref.ref(out[0]))
        return out

    monkeypatch.setattr(attention_mod, "_absorb", spy)
    model = _model("triton", rebuild)
    logits = model(TOKENS, CU)
    gc.collect()
    n_attn = sum(isinstance(m, Attention) for m in model.layers.modules())
    assert len(refs) == n_attn
    alive = [r() is not None for r in refs]
    assert alive == [not rebuild] * n_attn
    logits.float().pow(2).mean().backward()  # the rebuilt queries serve the backward
    assert all(p.grad is not None for n, p in model.layers.named_parameters() if "wkv_b" in n)


def test_checkpointed_blocks_install_no_rebuild(monkeypatch):
    calls = []
    real_init = recompute_mod.RecomputeSaved.__init__

    def counting_init(self, *args):
        calls.append(args[0])
        real_init(self, *args)

    monkeypatch.setattr(recompute_mod.RecomputeSaved, "__init__", counting_init)
    plain = _step(_model("triton", False))
    ckpt = _step(_model("triton", True), wrap=lambda f, *a: checkpoint(f, *a, use_reentrant=False))
    assert "sparse attention" not in calls
    for a, b in zip(plain, ckpt):
        assert torch.equal(a, b)


def test_latent_query_is_the_concatenated_product():
    """``_absorb`` (eager: the product written into its columns of the output) equals
    ``cat(einsum(q_nope, W_uk), q_rope)`` with the same gradients, on strided views like the model's
    (q_nope a split of q, W_uk a slice of wkv_b's weight); gradcheck in float64."""
    g = torch.Generator().manual_seed(1)
    t, h, nope, rope, rank = 7, 4, 6, 3, 8
    q = torch.randn(t, h, nope + rope, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(h, nope + 5, rank, dtype=torch.float64, generator=g, requires_grad=True)

    def run(absorb):
        q_nope, q_rope = q.split((nope, rope), dim=-1)
        return absorb(q_nope, q_rope * 2, w[:, :nope])

    out, none = run(attention_mod._absorb)
    assert none is None
    ref = run(lambda a, b, c: torch.cat((torch.einsum("thn,hnr->thr", a, c), b), dim=-1))
    assert out.shape == (t, h, rank + rope) and out.is_contiguous()
    assert torch.equal(out, ref)
    grad = torch.randn(out.shape, dtype=torch.float64, generator=g)
    for a, b in zip(torch.autograd.grad(out, (q, w), grad), torch.autograd.grad(ref, (q, w), grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    args = (
        q[..., :nope].detach().requires_grad_(),
        q[..., nope:].detach().requires_grad_(),
        w[:, :nope].detach().requires_grad_(),
    )
    assert torch.autograd.gradcheck(attention_mod._LatentQuery.apply, args)


def test_latent_query_with_prefix_rows():
    """Given row blocks (the dense prefix's: ``length`` rows from each start) ``_absorb`` also
    returns their plain queries ``cat(q_nope[rows], q_rope[rows])``, and the gradients of both
    outputs reach q_nope / q_rope / W_uk as autograd's for the two expressions (the plain rows'
    gradient added into the latent query's, also where that one is not zero); gradcheck in
    float64."""
    g = torch.Generator().manual_seed(2)
    t, h, nope, rope, rank = 9, 3, 5, 4, 6
    q = torch.randn(t, h, nope + rope, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(h, nope, rank, dtype=torch.float64, generator=g, requires_grad=True)
    starts, length = (0, 6), 2
    rows = torch.tensor([0, 1, 6, 7])

    def run(absorb):
        q_nope, q_rope = q.split((nope, rope), dim=-1)
        return absorb(q_nope, q_rope * 2, w, starts, length)

    def reference(a, b, c, _starts, _length):
        return torch.cat((torch.einsum("thn,hnr->thr", a, c), b), dim=-1), torch.cat(
            (a[rows], b[rows]), dim=-1
        )

    (out, pre), (ref, ref_pre) = run(attention_mod._absorb), run(reference)
    assert torch.equal(out, ref) and torch.equal(pre, ref_pre) and pre.shape == (4, h, nope + rope)
    grads = [torch.randn(x.shape, dtype=torch.float64, generator=g) for x in (out, pre)]
    got = torch.autograd.grad((out, pre), (q, w), grads)
    want = torch.autograd.grad((ref, ref_pre), (q, w), grads)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    args = (
        q[..., :nope].detach().requires_grad_(),
        q[..., nope:].detach().requires_grad_(),
        w.detach().requires_grad_(),
        starts,
        length,
    )
    assert torch.autograd.gradcheck(attention_mod._LatentQuery.apply, args)
