"""This project's registered operators (``torch.ops.titan_glm52``): ``define(schema, impl, fake,
backward, setup_context)``.

An op is one node to ``torch.compile`` (kept whole in the graph) and to op-level activation
checkpointing (``parallelize._MATMULS`` can save its output). The ops are registered through
``torch.library.Library`` with ``torch.library.register_fake`` and ``register_autograd``, which is
what ``torch.library.custom_op`` does underneath, without its per-call Python wrapper: on one H200
that wrapper cost 30-35 us per call of an FP8 product's forward and 127 us of its input gradient
against 7 us for a ``Library`` op, and with the FP8 products registered this way the proxy trained
5-7% more tokens/s at 4K on an H100, where the host bounds the FP8 step
(bench/results/2026-12-06_h200_h100_fp8_head.md).

A backward formula registered here is not part of torch.compile's on-disk cache keys; the compiled
blocks' keys carry a hash of this package's source instead (``parallelize.tag_compile_caches``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

NAMESPACE = "titan_glm52"
_LIB = torch.library.Library(NAMESPACE, "DEF")


def define(
    schema: str,
    impl: Callable,
    fake: Callable,
    backward: Callable | None = None,
    setup_context: Callable | None = None,
) -> torch._ops.OpOverload:
    """Defines ``titan_glm52::<schema>`` with ``impl`` on every device, ``fake`` for meta and fake
    tensors and, if given, ``backward`` (with ``setup_context``, as ``register_autograd`` takes
    them); returns the op (``torch.ops.titan_glm52.<name>.default``), to be called like ``impl``."""
    name = schema.split("(", 1)[0]
    qualname = f"{NAMESPACE}::{name}"
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, fake, lib=_LIB)
    if backward is not None:
        torch.library.register_autograd(qualname, backward, setup_context=setup_context, lib=_LIB)
    return getattr(getattr(torch.ops, NAMESPACE), name).default


__all__ = ["define"]
