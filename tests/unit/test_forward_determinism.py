"""On a GPU the forward is bitwise reproducible: the proxy's widths (4 layers, IndexShare FFFS,
really sparse: top-2048 of 4096 keys; a 4096-row vocabulary), bf16, the Triton DSA kernels and
grouped GEMMs, the same weights and batch run twice give the same summed loss and the same hidden
states after every block. The backward is not bitwise reproducible (the sparse attention's backward
sums its key gradients with fp32 atomics in arrival order), but the latent query it rebuilds
(``[dsa] recompute_latent_query``) has the forward's bits."""

import pytest
import torch

from titan_glm52 import get_flavor
from titan_glm52.model import attention as attention_mod
from titan_glm52.model.init import init_weights_
from titan_glm52.model.model import GLM52Model
from titan_glm52.model.options import ModelOptions

hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a Hopper-class GPU (the Triton DSA kernels, torch._grouped_mm)",
)


def _proxy_model() -> tuple[GLM52Model, torch.Tensor, torch.Tensor]:
    args = get_flavor("glm52_proxy").replace(vocab_size=4096)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GLM52Model(args, ModelOptions(dsa_backend="triton", sparse_attention=True))
    model = model.to_empty(device="cuda")
    init_weights_(model, 0.02)
    model = model.to(torch.bfloat16)
    tokens = torch.randint(0, args.vocab_size, (1, 4096), device="cuda")
    return model, tokens, torch.roll(tokens, -1, dims=1)


@hopper
def test_the_forward_gives_the_same_bits_twice():
    model, tokens, labels = _proxy_model()
    blocks = []
    hooks = [
        b.register_forward_hook(lambda m, i, o: blocks.append(o[0].clone()))
        for b in model.layers.values()
    ]
    runs = []
    with torch.no_grad():
        for _ in range(2):
            blocks.clear()
            loss = model(tokens, labels=labels)
            runs.append((loss.clone(), list(blocks)))
    for h in hooks:
        h.remove()
    (loss0, h0), (loss1, h1) = runs
    assert torch.isfinite(loss0) and torch.equal(loss0, loss1)
    assert len(h0) == len(h1) == len(model.layers)
    for a, b in zip(h0, h1):
        assert torch.equal(a, b)


@hopper
def test_the_rebuilt_latent_query_has_the_forwards_bits(monkeypatch):
    model, tokens, labels = _proxy_model()
    made = []
    real = attention_mod._absorb

    def spy(*args):
        out = real(*args)
        made.append((torch.is_grad_enabled(), out[0].detach().clone()))
        return out

    monkeypatch.setattr(attention_mod, "_absorb", spy)
    model(tokens, labels=labels).backward()
    forward = [t for grad, t in made if grad]
    rebuilt = [t for grad, t in made if not grad]
    assert len(forward) == len(rebuilt) == len(model.layers)
    for a, b in zip(forward, reversed(rebuilt)):  # backward runs the layers last to first
        assert torch.equal(a, b)
