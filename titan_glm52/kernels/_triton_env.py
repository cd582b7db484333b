"""Shared set-up for the Triton DSA kernels: interpreter fallback on CPU and small launch helpers.

Importing this module makes a machine without CUDA run every ``@triton.jit`` kernel defined afterwards in the
Triton interpreter (slow, numpy-backed; meant for tests), unless ``TRITON_INTERPRET`` was set explicitly.
"""

from __future__ import annotations

import json
import os
import sys
import types

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402  (after the interpreter switch on purpose)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def elementwise_block(block: int) -> int:
    """The block of an elementwise kernel: as given on the GPU; 65536 under the interpreter, which pays per program
    instance (an AdamW step over 2M parameters: 14 s at 1024, 1 s at 65536) and whose results do not depend on the
    block (every element is computed on its own)."""
    return max(block, 1 << 16) if interpreting() else block


def _fix_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter keeps scalars as 1-element arrays and turns them into loop bounds with
    ``int(array)``, which numpy >= 2.3 refuses for arrays with ndim > 0. Make ``__index__`` take the element
    instead, so ``range(0, n, BLOCK)`` with a computed ``n`` works in the interpreter as it does when compiled."""
    try:
        from triton.runtime import interpreter as interp
    except ImportError:  # pragma: no cover - layout of a future triton
        return
    original = getattr(interp, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_titan_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._titan_fixed = True
    interp._patch_lang_tensor = patched


def _fix_interpreter_bf16_rounding() -> None:
    """Triton 3.6's interpreter converts fp32 to bf16 by dropping the low 16 bits (round toward zero), while a
    compiled kernel rounds to nearest even (as torch does); its own RTNE path drops the carry into the exponent,
    and bf16 subnormals widen to zero. Convert as the GPU does (bf16 -> fp32 is exact: the bits shifted up), so
    interpreter tests see the numbers a compiled kernel produces."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:  # pragma: no cover - layout of a future triton
        return
    builder = getattr(interp, "InterpreterBuilder", None)
    if builder is None or getattr(builder.cast_impl, "_titan_fixed", False):
        return

    def to_bf16(data):
        x = np.ascontiguousarray(data, dtype=np.float32)
        bits = x.view(np.uint32).astype(np.uint64)
        out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(x)
        out[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)  # stays a (quiet) NaN
        return out

    def wrap(original):
        def patched(self, src, dst_type, *rest):
            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
                return interp.TensorHandle(to_bf16(src.data), dst_type.scalar)
            if src.dtype.scalar == tl.bfloat16 and dst_type.scalar == tl.float32:
                wide = (np.ascontiguousarray(src.data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
                return interp.TensorHandle(wide, dst_type.scalar)
            return original(self, src, dst_type, *rest)
        patched._titan_fixed = True
        return patched

    # create_fp_trunc is a lambda calling cast_impl; create_fp_to_fp carries an explicit rounding mode (RTNE
    # is the only one the kernels ask for on this conversion).
    builder.cast_impl = wrap(builder.cast_impl)
    builder.create_fp_to_fp = wrap(builder.create_fp_to_fp)


if interpreting():
    _fix_interpreter_scalar_index()
    _fix_interpreter_bf16_rounding()


def check_device(*tensors: torch.Tensor) -> None:
    """Refuse CPU tensors unless the interpreter is on (a compiled kernel would read host memory)."""
    for t in tensors:
        if t.device.type != "cuda" and not interpreting():
            raise RuntimeError(
                "the triton DSA kernels need CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter); "
                f"got a tensor on {t.device}")


def pow2(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum) (tl.dot wants every dimension >= 16)."""
    return max(minimum, triton.next_power_of_2(max(int(n), 1)))


def load_tune(module: str, tune: dict) -> None:
    """Launch-parameter overrides from the JSON file named by $TITAN_DSA_TUNE_FILE (written by
    ``bench/kernels.py --sweep-only``): ``{"sparse_mla": {"bwd_grad": {"DC": 128, ...}}, ...}``."""
    path = os.environ.get("TITAN_DSA_TUNE_FILE")
    if not path:
        return
    with open(path) as f:
        data = json.load(f)
    for part, cfg in data.get(module, {}).items():
        if part in tune:
            tune[part] = dict(cfg)


def make_module_callable(module_name: str, fn_name: str) -> None:
    """Let ``titan_glm52.kernels.<module>(...)`` call the module's function of the same contract.

    ``from titan_glm52.kernels import sparse_mla`` yields the submodule once it is imported (a package attribute);
    making the module callable means code written as ``kernels.sparse_mla(q, kv, ...)`` works either way."""
    mod = sys.modules[module_name]

    class _CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return getattr(self, fn_name)(*args, **kwargs)

    mod.__class__ = _CallableModule


__all__ = ["interpreting", "check_device", "pow2", "load_tune", "make_module_callable"]
