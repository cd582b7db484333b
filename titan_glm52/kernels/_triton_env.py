"""Shared set-up for the Triton kernels: the interpreter switch as the caller set it, fixes to the
interpreter, and small launch helpers.

Whether kernels run in the Triton interpreter (slow, numpy-backed; meant for CPU tests) is the
caller's choice: ``TRITON_INTERPRET=1`` in the environment before the kernel modules are imported
(triton reads it when it decorates each ``@triton.jit`` kernel; ``tests/conftest.py`` sets it where
there is no GPU). This module reads it only when a wrapper runs (``interpreting``), and applies its
fixes to the interpreter at the first launch under it.
"""

from __future__ import annotations

import torch
import triton


def interpreting() -> bool:
    """Whether triton runs kernels in its interpreter (``TRITON_INTERPRET``, read at this call)."""
    return bool(triton.knobs.runtime.interpret)


def elementwise_block(block: int, n: int) -> int:
    """The block of an elementwise kernel over ``n`` elements: as given on the GPU; under the
    interpreter, which pays per program instance and per element of a block, the smallest power of
    two that holds ``n`` elements, between ``block`` and 65536 (an AdamW step over 2M parameters:
    14 s at 1024, 1 s at 65536; one over a 100-element norm weight: 24 ms at 65536, 6 ms at 1024).
    Results do not depend on the block (every element is computed on its own)."""
    if not interpreting():
        return block
    return max(block, min(1 << 16, triton.next_power_of_2(max(int(n), 1))))


def _fix_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter keeps scalars as 1-element arrays and turns them into loop bounds
    with ``int(array)``, which numpy >= 2.3 refuses for arrays with ndim > 0. Make ``__index__``
    take the element instead, so ``range(0, n, BLOCK)`` with a computed ``n`` works in the
    interpreter as it does when compiled."""
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
    """Triton 3.6's interpreter converts fp32 to bf16 by dropping the low 16 bits (round toward
    zero), while a compiled kernel rounds to nearest even (as torch does); its own RTNE path drops
    the carry into the exponent, and bf16 subnormals widen to zero. Convert as the GPU does (bf16 ->
    fp32 is exact: the bits shifted up), so interpreter tests see the numbers a compiled kernel
    produces. Its fp32 -> e4m3 conversion misrounds too (about 2% of the values of a random
    tile); that one goes through torch's, which rounds to nearest even."""
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

    def to_e4m3(data):
        # torch's fp32 -> e4m3 conversion rounds to nearest even, as the GPU's cvt.rn does
        wide = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
        return wide.to(torch.float8_e4m3fn).view(torch.uint8).numpy()

    def wrap(original):
        def patched(self, src, dst_type, *rest):
            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
                return interp.TensorHandle(to_bf16(src.data), dst_type.scalar)
            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
                return interp.TensorHandle(to_e4m3(src.data), dst_type.scalar)
            if src.dtype.scalar == tl.bfloat16 and dst_type.scalar == tl.float32:
                wide = (
                    np.ascontiguousarray(src.data).view(np.uint16).astype(np.uint32) << 16
                ).view(np.float32)
                return interp.TensorHandle(wide, dst_type.scalar)
            return original(self, src, dst_type, *rest)

        patched._titan_fixed = True
        return patched

    # create_fp_trunc is a lambda calling cast_impl; create_fp_to_fp carries an explicit rounding
    # mode (RTNE is the only one the kernels ask for on this conversion).
    builder.cast_impl = wrap(builder.cast_impl)
    builder.create_fp_to_fp = wrap(builder.create_fp_to_fp)


def _fix_interpreter_bf16_dot() -> None:
    """Triton 3.6's interpreter keeps bf16 values as their uint16 bits and multiplies those in
    ``tl.dot`` (it widens only fp8 operands). Widen bf16 operands to fp32 first (exact), as the
    tensor cores take them."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:  # pragma: no cover - layout of a future triton
        return
    builder = getattr(interp, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if original is None or getattr(original, "_titan_fixed", False):
        return

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        wide = (np.ascontiguousarray(h.data).view(np.uint16).astype(np.uint32) << 16).view(
            np.float32
        )
        return interp.TensorHandle(wide, tl.float32)

    def patched(self, a, b, d, *rest):
        return original(self, widen(a), widen(b), d, *rest)

    patched._titan_fixed = True
    builder.create_dot = patched


def _fix_interpreter_nested_repatch() -> None:
    """Triton 3.6's interpreter patches ``triton.language`` (every builtin, on the module objects)
    when a kernel launches and restores it when the kernel ends, and patches it again, the same way,
    at every call of a ``@triton.jit`` helper inside the kernel: about 1.7 ms a call, a third of the
    interpreter's time in the sparse MLA and top-k kernels, whose helpers run per program and loop
    step. Skip that repeat while a kernel's patch covering the helper's language modules is active
    (the helper then sees the same patched modules); results are unchanged, only the repeated
    patching goes. A kernel's patch also covers ``triton.language.core``, which the standard
    library's helpers (``tl.zeros``, ``tl.sum``, ``tl.max``) reach through their own globals: the
    interpreter would patch it for each of their calls (2,400 calls in the sparse MLA tests)."""
    try:
        import inspect
        import types

        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:  # pragma: no cover - layout of a future triton
        return
    if not hasattr(interp, "_patch_lang"):
        return  # pragma: no cover - a triton that patches the language differently
    grid_cls, fn_cls = (
        getattr(interp, "GridExecutor", None),
        getattr(interp, "InterpretedFunction", None),
    )
    if grid_cls is None or fn_cls is None or getattr(fn_cls.__call__, "_titan_fixed", False):
        return
    if not hasattr(fn_cls, "rewrite") or not hasattr(interp, "InterpreterError"):
        return  # pragma: no cover - a triton whose helper call works differently: keep it as it is
    # the language modules each running kernel's patch covers (innermost last)
    active: list[frozenset] = []
    cache: dict[int, frozenset] = {}

    def langs(fn) -> frozenset:
        key = id(fn.__globals__)
        if key not in cache:
            cache[key] = frozenset(
                id(v)
                for v in list(fn.__globals__.values())
                if inspect.ismodule(v) and v in (tl, tl.core)
            )
        return cache[key]

    grid_call, helper_call = grid_cls.__call__, fn_cls.__call__
    # a function whose globals hold triton.language.core alone: what ``_patch_lang`` patches for it
    core_only = types.FunctionType((lambda: None).__code__, {"core": tl.core})

    def run_kernel(self, *args, **kwargs):
        core_scope = interp._patch_lang(core_only)
        active.append(langs(self.fn) | {id(tl.core)})
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            active.pop()
            core_scope.restore()

    def call_helper(self, *args, **kwargs):
        if not active or not langs(self.fn) <= active[-1]:
            return helper_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    call_helper._titan_fixed = True
    grid_cls.__call__, fn_cls.__call__ = run_kernel, call_helper


def _fix_interpreter_type_bookkeeping() -> None:
    """Triton 3.6's interpreter spends about a fifth of its time, in the model tests, on type
    bookkeeping per operation: every block type, and every value, builds its shape as a
    ``tl.tuple`` (with a type of its own), every block type formats its name (and the tuple's) when
    built, though a kernel has few distinct shapes and few names are ever read, and every numpy
    view of a value rebuilds a dict of eighteen dtypes. Build each distinct shape once (the same
    values), format each name when first read (the same string) and look the dtypes up in one dict
    built once; the values computed are the same."""
    try:
        import builtins
        import inspect
        import math

        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:  # pragma: no cover - layout of a future triton
        return
    core = tl.core
    np_dtype = getattr(interp, "_get_np_dtype", None)
    if np_dtype is None or getattr(np_dtype, "_titan_fixed", False):
        return
    scalars = ("int1", "float16", "bfloat16", "float32", "float64", "float8e5", "float8e4nv")
    scalars += ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
    table = {getattr(tl, n): np_dtype(getattr(tl, n)) for n in scalars}
    pointer = np.dtype(np.uint64)

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        found = table.get(tt_dtype)
        return found if found is not None else np_dtype(tt_dtype)

    get_np_dtype._titan_fixed = True
    interp._get_np_dtype = get_np_dtype

    def lazy_name(fmt):
        def get(self):
            if "_name" not in self.__dict__:
                self.__dict__["_name"] = fmt(self)
            return self.__dict__["_name"]

        def put(self, value):
            self.__dict__["_name"] = value

        return property(get, put)

    def tuple_type_init(self, types, fields=None):
        self.types = types
        self.fields = fields or [""] * len(types)

    shapes: dict = {}  # dims -> (the shape as triton's tuple, its element count), built once

    def block_type_init(self, element_ty, shape):
        assert isinstance(shape, (list, core.tuple))
        self.element_ty = element_ty
        dims = builtins.tuple(core._unwrap_shape(shape))
        if not dims:
            raise TypeError("0d block_type is forbidden")
        if dims not in shapes:
            as_tuple = core.tuple(list(dims))
            shapes[dims] = (as_tuple, core.validate_block_shape(as_tuple))
        self.shape, self.numel = shapes[dims]

    consts: dict = {}  # dims -> (a value's element count, its shape as constants), built once

    def tensor_init(self, handle, type):
        self.handle = handle
        self.type = type
        self.dtype = type.scalar
        dims = builtins.tuple(type.shape) if type.is_block() else ()
        if dims not in consts:
            consts[dims] = (core.constexpr(math.prod(dims)), core.tuple(map(core.constexpr, dims)))
        self.numel, self.shape = consts[dims]

    def params(fn) -> list[str]:
        return list(inspect.signature(fn).parameters)

    if (
        params(core.tuple_type.__init__) != ["self", "types", "fields"]
        or params(core.block_type.__init__) != ["self", "element_ty", "shape"]
        or params(core.tensor.__init__) != ["self", "handle", "type"]
    ):
        return  # pragma: no cover - types built differently in a future triton: leave them
    core.tensor.__init__ = tensor_init
    core.tuple_type.__init__ = tuple_type_init
    core.tuple_type.name = lazy_name(
        lambda t: "[" + ",".join(f"{k}:{v}" for k, v in zip(t.fields, t.types)) + "]"
    )
    core.block_type.__init__ = block_type_init
    core.block_type.name = lazy_name(lambda t: f"<{t.shape}, {t.element_ty}>")


def _skip_interpreter_overflow_checks() -> None:
    """Triton 3.6's interpreter forms an overflow check for every 32-bit integer add, subtract and
    multiply (``sanitize_overflow``: each widened to int64 and compared with the int32 bounds), and
    hands it to ``device_assert``, which drops it unless the ``debug`` option is on (it is off by
    default). Those checks were about a fifth of the interpreter's time in the model tests. Without
    ``debug`` turn them off, which changes no value and no outcome."""
    try:
        import dataclasses

        from triton.runtime import interpreter as interp
    except ImportError:  # pragma: no cover - layout of a future triton
        return
    builder = getattr(interp, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if getattr(options, "sanitize_overflow", False) and not getattr(options, "debug", True):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


_interpreter_fixed = False  # the fixes below are in place (they stay for the process)


def _fix_interpreter() -> None:
    """Apply the interpreter fixes once; each fix also checks that it is not in place already."""
    global _interpreter_fixed
    if _interpreter_fixed:
        return
    _fix_interpreter_scalar_index()
    _fix_interpreter_bf16_rounding()
    _fix_interpreter_bf16_dot()
    _fix_interpreter_nested_repatch()
    _fix_interpreter_type_bookkeeping()
    _skip_interpreter_overflow_checks()
    _interpreter_fixed = True


def check_device(*tensors: torch.Tensor) -> None:
    """Ready a launch on ``tensors``: under the interpreter, its fixes in place (applied at the
    first call); otherwise every tensor must be on CUDA (a compiled kernel would read host memory).
    Every wrapper calls this before its first launch."""
    if interpreting():
        _fix_interpreter()
        return
    for t in tensors:
        if t.device.type != "cuda":
            raise RuntimeError(
                "the triton kernels need CUDA tensors (or TRITON_INTERPRET=1, set "
                "before the kernels are imported, for the CPU interpreter); got one "
                f"on {t.device}"
            )


def pow2(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum) (tl.dot wants every dimension >= 16)."""
    return max(minimum, triton.next_power_of_2(max(int(n), 1)))


__all__ = ["interpreting", "check_device", "elementwise_block", "pow2"]
