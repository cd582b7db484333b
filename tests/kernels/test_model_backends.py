"""The model's DSA attention with ``backend = "triton"`` equals ``backend = "torch"`` (loss and
every gradient, the indexer KL included), eagerly and under torch.compile. Without a GPU the kernels
run in the interpreter."""

import pytest
import torch

from titan_glm52 import GLM52Model, get_flavor
from titan_glm52.model.aux_loss import AuxTerms
from tests.losses import cross_entropy_sum
from titan_glm52.model.options import ModelOptions
from titan_glm52.parallelize import apply_compile


def run(backend: str, compile: bool, layers: int = 8):
    # sparse at 32 tokens; IndexShare FFFSSSFS (8 layers) or FFFS (4); MTP
    args = get_flavor("debug").replace(index_topk=8, num_hidden_layers=layers)
    # the indexers train through the sparse KL too (weight 0.5: the coefficient over a normaliser of
    # 1)
    model = GLM52Model(args, ModelOptions(dsa_backend=backend, indexer_loss_coeff=0.5))
    model.init_weights(seed=3)
    if compile:
        apply_compile(model, backend="aot_eager")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=g)
    # 3 documents, one shorter than index_topk
    cu = torch.tensor([0, 20, 32, 64], dtype=torch.int32)
    aux = AuxTerms()
    logits, mtp = model(tokens, cu, with_mtp=True, aux=aux)
    loss = cross_entropy_sum(logits[:, :-1], tokens[:, 1:]) + cross_entropy_sum(
        mtp[:, :-2], tokens[:, 2:]
    )
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    # the indexer KL of each layer (on Triton summed in the sparse backward), as logged
    grads["indexer_kl"] = torch.stack([aux.indexer_kl[i] for i in sorted(aux.indexer_kl)])
    return loss.detach(), grads


# eager: the debug flavor's 8 layers; compiled: its first 4 (full and shared layers, compiled blocks
# around the eager DSA calls), which halves the interpreter's minutes
@pytest.mark.parametrize("compile,layers", [(False, 8), (True, 4)])
def test_triton_backend_equals_torch_backend(compile, layers):
    ref_loss, ref_grads = run("torch", False, layers)
    loss, grads = run("triton", compile, layers)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert sorted(grads) == sorted(ref_grads) and any(".indexer." in n for n in grads)
    # the full layers (four of FFFSSSFS, three of FFFS) and the MTP layer
    full = 4 if layers == 8 else 3
    assert ref_grads["indexer_kl"].numel() == full + 1 and torch.all(ref_grads["indexer_kl"] > 0)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_compiled_blocks_do_not_recompile_when_the_kl_scale_changes():
    """Every step brings a new indexer-KL normaliser (the step's token count, in ``AuxTerms``); the
    compiled blocks read only whether the KL is on, so a new value must not recompile anything."""
    args = get_flavor("debug").replace(index_topk=8)
    model = GLM52Model(args, ModelOptions(indexer_loss_coeff=0.5))
    model.init_weights(seed=3)
    apply_compile(model, backend="eager")
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 20, 32, 64], dtype=torch.int32)
    kls = []
    for normaliser in (1.0, 2.0):  # KL weights 0.5, then 0.25
        aux = AuxTerms(tokens=torch.tensor(normaliser))
        with torch._dynamo.config.patch(error_on_recompile=normaliser == 2.0):
            logits = model(tokens, cu, aux=aux)
            logits.float().pow(2).mean().backward()
        kls.append(aux.indexer_kl_sum())
    assert torch.isfinite(kls[1]) and kls[1] > 0


def test_compiled_blocks_compile_once_per_kind_of_layer():
    """GLM-5.2's 78 layers (its dense prefix and IndexShare schedule, at the debug widths) stay
    below torch._dynamo's recompile_limit (8) in every compiled frame: a block compiles once per
    kind of layer (dense or MoE, with or without an indexer), not once per layer. A layer's own
    number reaching a compiled block as a constant (the KL sink's layer id did) made every layer
    compile the block's attention again, and past the limit the layers after ran it uncompiled."""
    full = get_flavor("glm52_744b")
    args = get_flavor("debug").replace(
        index_topk=8,
        num_hidden_layers=full.num_hidden_layers,
        first_k_dense_replace=full.first_k_dense_replace,
        index_topk_freq=full.index_topk_freq,
        index_topk_pattern=full.index_topk_pattern,
    )
    model = GLM52Model(args, ModelOptions(indexer_loss_coeff=0.5))
    model.init_weights(seed=3)
    apply_compile(model, backend="eager")
    torch._dynamo.reset()
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator())
    cu = torch.tensor([0, 20, 32, 64], dtype=torch.int32)
    # (the forward alone: dynamo traces, and guards, only there)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        model(tokens, cu, with_mtp=True, aux=AuxTerms())


@pytest.mark.parametrize("prepared", [True, False])
def test_compiled_blocks_break_only_at_the_eager_calls(prepared):
    """Compiled blocks break their graphs at the eager DSA calls themselves, not before them to
    build the ``torch.compiler.disable`` wrappers (``apply_compile`` builds them first;
    ``prepared=False`` empties the caches again, the case before that, and must show the extra
    breaks)."""
    from torch._dynamo.utils import counters
    from titan_glm52.model import attention

    args = get_flavor("debug").replace(
        index_topk=8, num_hidden_layers=4, num_nextn_predict_layers=0
    )
    model = GLM52Model(args, ModelOptions(dsa_backend="triton"))
    model.init_weights(seed=3)
    apply_compile(model, backend="eager")
    if not prepared:
        attention._EAGER.clear()
        attention._DSA_OPS.clear()
    torch._dynamo.reset()
    counters.clear()
    tokens = torch.randint(0, args.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    # (the forward alone: dynamo traces, and breaks, only there)
    model(tokens, torch.tensor([0, 32], dtype=torch.int32))
    builds = sum(
        v
        for k, v in counters["graph_break"].items()
        if k.startswith("Attempted to call function marked")
    )
    calls = sum(
        v
        for k, v in counters["graph_break"].items()
        if k.startswith("Skip calling `torch.compiler.disable")
    )
    assert calls >= 3 * args.num_hidden_layers // 2, dict(counters["graph_break"])
    assert (builds == 0) == prepared, dict(counters["graph_break"])
