"""FP8 training (``[quantize]``): DeepSeek-V3's block-wise FP8 products (or torchao's tensorwise and
rowwise recipes for the linears) applied to a plain ``GLM52Model`` from outside.

``apply_fp8(model, spec)`` runs in the parallelize recipe after LoRA and before EP, compile, AC and
FSDP. It changes the class of the chosen modules in place (or, for torchao's linears, puts a module
holding the same weight in their place), so every parameter keeps its object and its name
(checkpoints, the HF export and the optimizer see the same model):

* every ``nn.Linear`` whose name contains none of ``spec.filter_fqns`` and whose two dimensions are
  multiples of 128 becomes an ``Fp8Linear``: its forward is ``model/fp8_mm.fp8_linear``; with
  ``spec.recipe`` one of torchao's (``TORCHAO_RECIPES``: dimensions in multiples of 16) it is
  replaced by torchao's ``Float8Linear`` holding the same weight (a new module object, the same
  name and parameter);
* every routed experts' module (``GroupedExperts``) whose name contains one of
  ``spec.expert_fqns`` becomes ``Fp8GroupedExperts``: one block-wise FP8 GEMM per expert
  (``fp8_expert_mm``; cuBLAS has no block-scaled grouped GEMM on Hopper), or with
  ``spec.expert_recipe`` "rowwise" ``Fp8RowwiseGroupedExperts``: torchao's rowwise FP8 grouped
  GEMM, one per product (``model/fp8_grouped.py``);
* the output head (``OutputHead``), unless ``output`` is in ``spec.filter_fqns``, becomes an
  ``Fp8OutputHead``: its fused loss forms its three products in FP8 (``Fp8HeadProducts``),
  block-wise whatever ``spec.recipe`` says (torchao has no fused loss; docs/fp8_training.md).

The weights, their gradients, the fp32 master weights and the optimizer state stay as they are;
only the products run in FP8. What stays bf16 and why is docs/fp8_training.md's table: the router
and the indexer's head weights (fp32 products), the indexer's projections (they learn from the KL
alone), ``wkv_b`` (the absorbed attention reads it directly) and ``wkv_a`` (576 outputs, not a
multiple of 128).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

from titan_glm52.model.fp8_grouped import ALIGN, aligned_layout, rowwise_grouped_mm, to_aligned
from titan_glm52.model.fp8_mm import TILE, Fp8HeadProducts, fp8_expert_mm, fp8_linear
from titan_glm52.model.head import OutputHead, linear_cross_entropy_sum
from titan_glm52.model.moe import GroupedExperts

# the linears' recipes: "blockwise" is this project's; the others torchao's Float8Linear, by
# torchtitan's names
TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
RECIPES = ("blockwise", *TORCHAO_RECIPES)
# torch._scaled_mm (torchao's product) takes dimensions in multiples of 16
SCALED_MM_ALIGN = 16
EXPERT_RECIPES = ("blockwise", "rowwise")
# torchtitan's filter_fqns: linears whose name contains one of these stay bf16. Not the head
# ("output", torchtitan's default): in FP8 it made the proxy 1.16x bf16 at 32K tokens against 1.10x
# with it bf16, and its 300-step loss stayed within the spread of two bf16 data orders
# (bench/results/2026-12-06_h200_h100_fp8_head.md).
DEFAULT_FILTER = ("indexer", "wkv_b")


@dataclass(frozen=True)
class Fp8Spec:
    """What runs in FP8: ``linears`` (the dense ``nn.Linear`` products, less ``filter_fqns``) with
    ``recipe``'s scaling, and the routed experts named by ``expert_fqns`` (empty: none) with
    ``expert_recipe``'s."""

    recipe: str = "blockwise"
    linears: bool = True
    filter_fqns: tuple[str, ...] = DEFAULT_FILTER
    expert_fqns: tuple[str, ...] = ("experts",)
    expert_recipe: str = "blockwise"

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"Fp8Spec.recipe = {self.recipe!r}: choose one of {RECIPES}")
        if self.expert_recipe not in EXPERT_RECIPES:
            raise ValueError(
                f"Fp8Spec.expert_recipe = {self.expert_recipe!r}: choose one of {EXPERT_RECIPES}"
            )


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` without bias whose product runs in FP8 (``fp8_linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight)


class Fp8OutputHead(OutputHead):
    """The output head with its logits and its fused loss's products in FP8."""

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return fp8_linear(h, self.weight)
        return linear_cross_entropy_sum(h, self.weight, labels, products=Fp8HeadProducts)


class Fp8GroupedExperts(GroupedExperts):
    """``GroupedExperts`` whose products are block-wise FP8, one GEMM per expert."""

    per_expert_mm = staticmethod(fp8_expert_mm)


class Fp8RowwiseGroupedExperts(GroupedExperts):
    """``GroupedExperts`` whose two products are rowwise FP8 grouped GEMMs on the rows laid out
    by ``aligned_layout`` (``model/fp8_grouped.py``); the host never reads the expert counts."""

    def _grouped(self, x, w13, w2, counts, saved, gathered_from):
        dest, ends, total = aligned_layout(counts, x.shape[0])
        xa = to_aligned(x, dest, total)
        if saved is not None and gathered_from is not None:
            # the first product keeps the aligned copy: rebuilt in backward as x is
            src, rows = gathered_from
            saved.recompute(xa, lambda: to_aligned(src[rows], dest, total), src, rows, dest)
        h = self._swiglu(rowwise_grouped_mm(xa, w13, ends), saved)
        return rowwise_grouped_mm(h, w2, ends).index_select(0, dest)


def _kept_why(name: str, module: nn.Linear, spec: Fp8Spec, unit: int) -> str | None:
    """Why the linear or head ``name`` stays bf16, or None (``unit``: what its two dimensions must
    be multiples of)."""
    if module.bias is not None:
        return "has a bias"
    hit = next((f for f in spec.filter_fqns if f in name), None)
    if hit is not None:
        return f"filter_fqns {hit!r}"
    if module.in_features % unit or module.out_features % unit:
        return f"{module.out_features} x {module.in_features} is not in multiples of {unit}"
    return None


def _torchao_linears(model: nn.Module, names: list[str], recipe: str) -> None:
    """Replaces the linears ``names`` of ``model`` by torchao's ``Float8Linear`` of ``recipe``;
    each keeps its weight (``Float8Linear.from_float``)."""
    # lazy: torchao is needed by these recipes alone
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    config = Float8LinearConfig.from_recipe_name(recipe)
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, Float8Linear.from_float(getattr(owner, child), config=config))


def _is_torchao_linear(module: nn.Module) -> bool:
    # torchao is imported only when a recipe of its own converted a linear
    ao = sys.modules.get("torchao.float8.float8_linear")
    return ao is not None and isinstance(module, ao.Float8Linear)


def apply_fp8(model: nn.Module, spec: Fp8Spec) -> dict[str, dict[str, str]]:
    """Turns the modules ``spec`` names into their FP8 form in place (module docstring). Returns
    ``{"fp8": {name: what}, "bf16": {name: why}}`` over the linears and experts looked at. Call it
    before any parallelism."""
    done: dict[str, str] = {}
    kept: dict[str, str] = {}
    torchao = spec.recipe in TORCHAO_RECIPES
    swapped: list[str] = []  # linears torchao's Float8Linear replaces, after the walk
    for name, module in model.named_modules():
        if type(module) in (nn.Linear, OutputHead) and spec.linears:
            head = type(module) is OutputHead
            unit = SCALED_MM_ALIGN if torchao and not head else TILE
            why = _kept_why(name, module, spec, unit)
            if why is not None:
                kept[name] = why
            elif head:
                module.__class__ = Fp8OutputHead
                done[name] = "output head (blockwise)" if torchao else "output head"
            elif torchao:
                swapped.append(name)
                done[name] = f"linear ({spec.recipe}, torchao)"
            else:
                module.__class__ = Fp8Linear
                done[name] = "linear"
        elif type(module) is GroupedExperts:
            if any(f in name for f in spec.expert_fqns):
                dims = (*module.w13.shape[1:], *module.w2.shape[1:])
                rowwise = spec.expert_recipe == "rowwise"
                unit = ALIGN if rowwise else TILE
                if any(d % unit for d in dims):
                    kept[name] = f"expert weights {dims} are not in multiples of {unit}"
                    continue
                module.__class__ = Fp8RowwiseGroupedExperts if rowwise else Fp8GroupedExperts
                # rowwise: one grouped product; blockwise: one per expert (class docstrings)
                module.use_grouped_mm = rowwise
                done[name] = f"routed experts ({spec.expert_recipe})"
            else:
                kept[name] = "not in expert_fqns"
    if swapped:
        _torchao_linears(model, swapped, spec.recipe)
    return {"fp8": done, "bf16": kept}


def is_fp8(module: nn.Module) -> bool:
    return _is_torchao_linear(module) or isinstance(
        module, (Fp8Linear, Fp8OutputHead, Fp8GroupedExperts, Fp8RowwiseGroupedExperts)
    )


__all__ = [
    "EXPERT_RECIPES",
    "RECIPES",
    "TORCHAO_RECIPES",
    "Fp8GroupedExperts",
    "Fp8RowwiseGroupedExperts",
    "Fp8Linear",
    "Fp8OutputHead",
    "Fp8Spec",
    "apply_fp8",
    "is_fp8",
]
