"""DSA kernels.

``reference`` is plain torch (the definition and the ``torch`` backend). The Triton implementations
load lazily on first use, so importing this package never imports triton:

* ``triton_indexer_topk(q, k, weights, cu_seqlens, topk, scale, *, max_len=None, gluon=True)
  -> int32 [T, topk]``
* ``triton_sparse_mla(q, kv, indices, sm_scale, d_v, *, gluon=True)
  -> (out [T, H, d_v], lse [T, H] fp32)``
* ``triton_indexer_kl_sparse(q, kv, sm_scale, lse, q_idx, k_idx, w_idx, idx_scale, indices)
  -> fp32 [T]``
* ``triton_sparse_mla_indexer_kl(q, kv, indices, sm_scale, d_v, q_idx, k_idx, w_idx, idx_scale,
  weight, sink, *, gluon=True) -> (out, lse)``: ``sparse_mla`` whose backward also trains the
  indexer (the KL's target from the backward's own probabilities; the KL's sum into ``sink``)

``gluon=False`` keeps a call on the Triton kernels where the warp-specialised Gluon ones would
otherwise run (Hopper, GLM-5.2's shapes). ``titan_glm52.kernels.indexer_topk`` etc. are the modules;
the functions carry a ``triton_`` prefix here so that a package attribute never changes meaning when
a submodule gets imported. ``triton_kernels()`` returns them all at once and raises a clear error
when triton is missing. The kernels take CUDA tensors, or CPU tensors when the caller runs triton's
interpreter (``TRITON_INTERPRET=1`` in the environment before the kernel modules are imported; slow,
for tests). Benchmarks vary the launch parameters with ``tuning.launch_overrides``.
"""

from __future__ import annotations

import importlib
import importlib.util

_LAZY = {
    "triton_indexer_topk": ("indexer_topk", "indexer_topk"),
    "triton_sparse_mla": ("sparse_mla", "sparse_mla"),
    "triton_indexer_kl_sparse": ("indexer_loss", "indexer_kl_sparse"),
    "triton_sparse_mla_indexer_kl": ("indexer_loss", "sparse_mla_indexer_kl"),
}


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_kernels() -> dict:
    """``{"indexer_topk", "sparse_mla", "indexer_kl_sparse", "sparse_mla_indexer_kl"}`` -> the
    Triton implementations."""
    if not triton_available():
        raise RuntimeError(
            "[dsa] backend = 'triton' needs the triton package (pip install triton); "
            "use backend = 'torch' otherwise"
        )
    return {
        fn: getattr(importlib.import_module(f".{mod}", __name__), fn) for mod, fn in _LAZY.values()
    }


def __getattr__(name: str):
    if name in _LAZY:
        mod, fn = _LAZY[name]
        return getattr(importlib.import_module(f".{mod}", __name__), fn)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["triton_available", "triton_kernels", *_LAZY]
