"""Saved-tensor hooks that rebuild chosen tensors in backward instead of keeping them (the routed
experts' GEMM inputs, ``[moe] recompute_expert_inputs``; the sparse attention's latent query,
``[dsa] recompute_latent_query``)."""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint


def can_recompute() -> bool:
    """Autograd records this forward and no one else's saved-tensor hooks are installed: activation
    checkpointing (its recompute covers these tensors, and a recipe would keep its sources alive) or
    CPU offloading (``save_on_cpu``)."""
    return (
        torch.is_grad_enabled()
        and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    )


class RecomputeSaved(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep a recipe instead of chosen tensors: ``recompute(t, fn,
    *sources)`` registers a tensor that ops after it may save and the no-grad ``fn()`` that rebuilds
    it from ``sources`` (tensors held anyway). Every other saved tensor is kept as usual. A recipe
    must rebuild the same bits (a gather, an elementwise op or a GEMM rerun eagerly on the same
    inputs does); like autograd for the tensors it keeps, unpacking refuses a source that was
    modified in place since the forward."""

    def __init__(self, owner: str, option: str) -> None:
        self._rules: list[tuple[torch.Tensor, Recipe]] = []
        # for the error below: who rebuilds, and the option that stops it
        self.owner, self.option = owner, option
        super().__init__(self._pack, self._unpack)

    def recompute(self, t: torch.Tensor, fn, *sources: torch.Tensor) -> None:
        self._rules.append((t, Recipe(fn, sources, self)))

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        # autograd keeps the pack hook (so this object) with every tensor saved under it
        self._rules.clear()

    def _pack(self, t: torch.Tensor):
        for target, recipe in self._rules:
            # Autograd may hand over another Python object for the same tensor: compare what fixes
            # its values.
            if (
                t.data_ptr() == target.data_ptr()
                and t.shape == target.shape
                and t.stride() == target.stride()
                and t.dtype == target.dtype
                and t.device == target.device
            ):
                recipe.saves += 1
                return recipe
        return t

    @staticmethod
    def _unpack(packed):
        return packed.rebuild() if isinstance(packed, Recipe) else packed


class Recipe:
    """How to rebuild one tensor. Several saves of it (the gathered rows feed two GEMMs) share one
    rebuild: the first unpack keeps the result until the last of them has taken it (again per
    backward pass)."""

    __slots__ = ("fn", "sources", "versions", "saves", "_left", "_cached", "_who")

    def __init__(self, fn, sources: tuple[torch.Tensor, ...], hooks: RecomputeSaved) -> None:
        self.fn, self.sources, self.versions = fn, sources, tuple(s._version for s in sources)
        self.saves, self._left, self._cached = 0, 0, None
        self._who = (hooks.owner, hooks.option)

    def rebuild(self) -> torch.Tensor:
        if self._cached is None:
            if any(s._version != v for s, v in zip(self.sources, self.versions)):
                owner, option = self._who
                raise RuntimeError(
                    f"{owner}: a tensor that the backward recomputes from was modified in place "
                    f"after the forward ({option} = false keeps the tensors instead)"
                )
            with torch.no_grad():
                self._cached = self.fn()
            self._left = self.saves
        out = self._cached
        self._left -= 1
        if self._left <= 0:
            self._cached = None
        return out


def token_chunked(fn, chunk: int, *rows: torch.Tensor) -> torch.Tensor:
    """``fn(*rows)`` for row-wise ``fn`` (``rows`` share their first dimension), computed over
    chunks of ``chunk`` rows, each under activation checkpointing: forward and backward hold one
    chunk's intermediates and their gradients at a time instead of all rows' (an MLP at 128K
    tokens), and a chunk is recomputed in backward. Row for row the same products; weight gradients
    are summed chunk by chunk. Eager (a host loop with checkpoints in it): compiled callers run it
    as it is."""
    return _eager_chunks()(fn, chunk, *rows)


def _chunks(fn, chunk: int, *rows: torch.Tensor) -> torch.Tensor:
    outs = [
        checkpoint(
            fn, *(r[a : a + chunk] for r in rows), use_reentrant=False, preserve_rng_state=False
        )
        for a in range(0, rows[0].shape[0], chunk)
    ]
    return torch.cat(outs)


@functools.cache
def _eager_chunks():
    # wrapped at the first call: torch.compiler.disable imports dynamo (and with it Triton), which
    # importing the model must not
    return torch.compiler.disable(_chunks)
