"""FP8 training's quantisation kernels in the Triton interpreter and its products on CPU, against
quantise-then-matmul references (``_cases.check_fp8``; at real size on a GPU:
``test_kernels_gpu.py``)."""

from __future__ import annotations

import pytest

try:
    from ._cases import check_fp8, check_fp8_head, check_fp8_rowwise, check_torchao_linear
except ImportError:
    from _cases import check_fp8, check_fp8_head, check_fp8_rowwise, check_torchao_linear


@pytest.mark.parametrize(
    "splits",
    [
        [300],  # one segment (a linear), a short last tile
        [100, 0, 250, 1, 129],  # experts: uneven, one without rows, tiles cut at experts
    ],
)
def test_fp8_quantisation_and_products(splits):
    check_fp8("cpu", splits, dim=256, hidden=192, tol=1e-5)


@pytest.mark.parametrize("splits", [[300], [100, 0, 250, 1, 129]])
def test_fp8_products_on_the_kernel_path(monkeypatch, splits):
    """The products as CUDA runs them (the Triton quantisation, segments padded to ROW_ALIGN rows,
    per-segment scale views, each product's padded rows written over the next expert's rows or,
    past the end, into a scratch product), with the products of the dequantised operands in place
    of cuBLAS's: the same results as the CPU path's. The model's copy of the row alignment is the
    kernel's (the model does not import triton)."""
    from titan_glm52.kernels import fp8_quant as K
    from titan_glm52.model import fp8_mm as M

    assert M.ROW_ALIGN == K.ROW_ALIGN
    monkeypatch.setattr(M, "_on_kernel", lambda *ts: True)
    check_fp8("cpu", splits, dim=256, hidden=192, tol=1e-5)


def test_fp8_expert_tables_made_once_per_splits(monkeypatch):
    """On the kernel path a MoE layer's products and their backward meet the same splits several
    times: the segment and tile tables are made once per splits (``fp8_mm._table``), and a product
    over other splits gets its own."""
    import torch

    from titan_glm52.model import fp8_mm as M

    made = []
    for name in ("segments_of", "tiles_of"):
        real = getattr(M, name)
        monkeypatch.setattr(
            M, name, lambda s, d, real=real, name=name: made.append(name) or real(s, d)
        )
    monkeypatch.setattr(M, "_on_kernel", lambda *ts: True)
    monkeypatch.setattr(M, "_TABLES", {})
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(3, 128, 256, generator=g) * 0.05).requires_grad_()
    for splits in ([100, 0, 156], [100, 0, 156], [50, 50, 156]):
        x = torch.randn(256, 256, generator=g).requires_grad_()
        M.fp8_expert_mm(x, w, splits).sum().backward()
    assert sorted(made) == ["segments_of", "segments_of", "tiles_of", "tiles_of"]


@pytest.mark.parametrize("kernel_path", [False, True])
@pytest.mark.parametrize(
    "rows, chunk, piece",
    [
        (200, 4096, 16384),  # one chunk (its weight gradient written in place), padded rows
        (300, 128, 128),  # three chunks, the later ones' weight gradient in two pieces of 128 rows
    ],
)
def test_fp8_head_loss_and_gradients(monkeypatch, kernel_path, rows, chunk, piece):
    """The LM head's fused loss in FP8 (``_cases.check_fp8_head``), on the CPU path and on the
    kernel path (the Triton quantisation, as ``test_fp8_products_on_the_kernel_path``)."""
    if kernel_path:
        from titan_glm52.model import fp8_mm as M

        monkeypatch.setattr(M, "_on_kernel", lambda *ts: True)
    check_fp8_head("cpu", rows, dim=256, vocab=256, chunk=chunk, piece=piece, tol=1e-5)


def test_registered_ops_pass_torch_checks():
    """The FP8 product and its two gradient products as torch.library registers them
    (``model/ops.py``): schema, fake (meta) kernels, autograd registration and tracing, as
    ``torch.library.opcheck`` checks them, on the CPU path."""
    import torch

    from titan_glm52.model import fp8_mm as M

    g = torch.Generator().manual_seed(0)
    splits = [100, 0, 156]
    x = torch.randn(256, 256, generator=g).requires_grad_()
    w = (torch.randn(3, 128, 256, generator=g) * 0.05).requires_grad_()
    dy = torch.randn(256, 128, generator=g)
    torch.library.opcheck(M.fp8_expert_mm, (x, w, splits))
    torch.library.opcheck(M._input_grad, (dy, w.detach(), splits))
    torch.library.opcheck(M._weight_grad, (dy, x.detach(), splits, torch.float32))
    with torch.device("meta"):
        out = M.fp8_expert_mm(torch.empty(256, 256), torch.empty(3, 128, 256), splits)
    assert out.shape == (256, 128)


@pytest.mark.parametrize("counts", [[300], [100, 0, 250, 1, 129], [0, 0, 5]])
def test_fp8_rowwise_experts_product(counts):
    """The routed experts' rowwise FP8 product on the CPU path (``_cases.check_fp8_rowwise``):
    uneven experts, an expert without rows, experts whose rows are not multiples of 16."""
    check_fp8_rowwise("cpu", counts, dim=256, hidden=192, tol=1e-5)


@pytest.mark.parametrize("recompute", [False, True])
def test_fp8_rowwise_experts_module(recompute):
    """``Fp8RowwiseGroupedExperts`` (``apply_fp8`` with ``expert_recipe`` "rowwise"): its output
    and the gradients of its weights and of the tokens it gathers equal the two rowwise products
    and SwiGLU composed here on the experts' rows without the aligned layout, with its inputs kept
    or rebuilt in backward (``recompute_inputs``)."""
    import torch
    from torch import nn

    from titan_glm52.fp8_training import Fp8RowwiseGroupedExperts, Fp8Spec, apply_fp8
    from titan_glm52.model import fp8_grouped as G
    from titan_glm52.model.moe import GroupedExperts, swiglu

    torch.manual_seed(0)
    counts = [37, 0, 64, 5, 20]
    experts = GroupedExperts(len(counts), 128, 96, recompute_inputs=recompute)
    for p in experts.parameters():
        nn.init.normal_(p, std=0.05)
    done = apply_fp8(nn.ModuleDict({"experts": experts}), Fp8Spec(expert_recipe="rowwise"))
    assert done["fp8"] == {"experts": "routed experts (rowwise)"}
    assert type(experts) is Fp8RowwiseGroupedExperts and experts.use_grouped_mm

    src = torch.randn(60, 128, requires_grad=True)
    rows = torch.randint(0, 60, (sum(counts),))
    dy = torch.randn(sum(counts), 128)
    out = experts(src[rows], torch.tensor(counts), gathered_from=(src, rows))
    out.backward(dy)
    got = [out, src.grad, experts.w13.grad, experts.w2.grad]

    w13 = experts.w13.detach().clone().requires_grad_()
    w2 = experts.w2.detach().clone().requires_grad_()
    src2 = src.detach().clone().requires_grad_()
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    h = swiglu(G._EmulatedRowwise.apply(src2[rows], w13, ends))
    ref = G._EmulatedRowwise.apply(h, w2, ends)
    ref.backward(dy)
    for a, b in zip(got, [ref, src2.grad, w13.grad, w2.grad]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_torchao_linear_recipes_compute_their_formulas(recipe):
    """``quantize.linear.float8.recipe_name`` tensorwise / rowwise / rowwise_with_gw_hp:
    ``apply_fp8`` puts torchao's Float8Linear (on CPU through torch's ``_scaled_mm``) in the
    linear's place with the same weight, and it computes the recipe's formulas, not the other
    recipes' (``_cases.check_torchao_linear``); a linear whose width is not a multiple of 16 stays
    bf16."""
    from torch import nn

    from titan_glm52.fp8_training import Fp8Spec, apply_fp8, is_fp8

    model = nn.ModuleDict(
        {"proj": nn.Linear(256, 384, bias=False), "odd": nn.Linear(256, 40, bias=False)}
    )
    weight = model.proj.weight
    done = apply_fp8(model, Fp8Spec(recipe=recipe, expert_fqns=()))
    assert done["fp8"] == {"proj": f"linear ({recipe}, torchao)"}
    assert done["bf16"] == {"odd": "40 x 256 is not in multiples of 16"}
    assert is_fp8(model.proj) and model.proj.weight is weight and not is_fp8(model.odd)
    check_torchao_linear("cpu", recipe, rows=64, dim=256, out=384, tol=2e-3)
