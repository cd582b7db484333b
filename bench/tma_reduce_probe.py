"""Rate of fp32 reductions into a [T, 576] buffer by TMA (``cp.reduce.async.bulk.tensor`` .add, one
row of DC columns per operation) against ``red.global.add.v4.f32`` (``bench/atomic_probe.py``), in
the pattern of the sparse MLA backward's dKV: 64 random rows per step, DC columns of the program's
column block.

    python3 bench/tma_reduce_probe.py --out tma_reduce_rate.json
    python3 bench/tma_reduce_probe.py --ptx     # no GPU: lower the Gluon kernel for sm_90, print
                                                # its reductions

One H200 (``results/2026-12-03_h200_kernels.md``): no faster than ``red.v4``: 7.9e11 against
9.6e11 adds/s into dKV's 192-column slice at 32K rows (25 MB, in L2), 5.6e11 for both into all 576
columns (75 MB).

Each Gluon program stages a [64, DC] fp32 tile in shared memory and issues one TMA reduction per row
at the step's 64 row indices; with ``restage`` it rewrites the tile before every step (waiting for
the previous step's reductions to have read it), as a kernel that reduces a new product each step
must.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton._C.libtriton import ir

from atomic_probe import _red_kernel  # bench/atomic_probe.py: the red.v4 baseline
from attn_paths import time_fn  # bench/attn_paths.py: CUDA-event ms per call


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """``cp.reduce.async.bulk.tensor`` .add of shared tile ``src`` into ``tensor_desc`` at ``coord``
    (Triton 3.6's Gluon builds the op but has no Python wrapper for it on Hopper)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(
        ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
    )


@gluon.jit
def _tma_red_kernel(
    desc, idx_ptr, n_per, BK: gl.constexpr, DC: gl.constexpr, RESTAGE: gl.constexpr
):
    col0 = gl.program_id(0) * DC
    prog = gl.program_id(1)
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [gl.num_warps(), 1], [1, 0])
    stage = gl.allocate_shared_memory(gl.float32, [BK, DC], desc.layout)
    ones = gl.full([BK, DC], 1.0, gl.float32, layout)
    stage.store(ones)
    fence_async_shared()
    for i in range(0, n_per, BK):
        if RESTAGE:
            tma.store_wait(0)
            stage.store(ones)
            fence_async_shared()
        base = idx_ptr + prog * n_per + i
        for r in gl.static_range(BK):
            _tma_reduce_add(desc, [gl.load(base + r), col0], stage.slice(r, 1))
    tma.store_wait(0)


def _row_layout():
    """The staged tile's shared layout: unswizzled fp32, so that a [1, DC] box is one row of it."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def rate(
    kind: str, T: int, programs: int, per: int, dc: int, blocks: int, warps: int, reps: int = 3
) -> dict:
    dst = torch.zeros(T, blocks * dc, device="cuda")
    idx = torch.randint(0, T, (programs * per,), device="cuda", dtype=torch.int32)
    if kind == "red.v4":

        def launch():
            _red_kernel[(blocks, programs)](
                dst, idx, per, T, BK=64, DC=dc, NCB=blocks, SEQ=False, num_warps=warps
            )
    else:
        desc = TensorDescriptor.from_tensor(dst, [1, dc], _row_layout())

        def launch():
            _tma_red_kernel[(blocks, programs)](
                desc, idx, per, BK=64, DC=dc, RESTAGE=kind == "tma+restage", num_warps=warps
            )

    ms = time_fn(launch, reps, warmup=1)
    # every row got per x (times its index appears) ones: check one launch's sum
    dst.zero_()
    launch()
    torch.cuda.synchronize()
    ok = float(dst.sum()) == float(programs * per * blocks * dc)
    return dict(
        kind=kind,
        T=T,
        n_prog=programs,
        DC=dc,
        NCB=blocks,
        warps=warps,
        ms=ms,
        sum_ok=ok,
        adds_per_s=programs * per * blocks * dc / ms * 1e3,
    )


def ptx_reductions(dc: int = 64) -> list[str]:
    """The TMA reduction instructions of ``_tma_red_kernel`` lowered for sm_90 without a GPU (checks
    that the wrapper above still builds the op on the pinned Triton)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {
        "desc": f"tensordesc<fp32[1, {dc}],{_row_layout()!r}>",
        "idx_ptr": "*i32",
        "n_per": "i32",
        "BK": "constexpr",
        "DC": "constexpr",
        "RESTAGE": "constexpr",
    }
    src = GluonASTSource(
        _tma_red_kernel, sig, constexprs={"BK": 64, "DC": dc, "RESTAGE": True}, attrs={}
    )
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    return [ln.strip() for ln in ptx.splitlines() if "cp.reduce.async.bulk" in ln]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument(
        "--ptx",
        action="store_true",
        help="no GPU: print the kernel's sm_90 TMA reductions and stop",
    )
    a = p.parse_args()
    if a.ptx:
        lines = ptx_reductions()
        print(f"{len(lines)} TMA reductions, e.g. {lines[0] if lines else None}")
        return
    rows = []
    # (T, total columns, DC): dKV's 192-column slice (part 2's default) and all 576 columns at 32K,
    # 576 at 4K, and 512 columns with 64- and 128-column boxes (TMA boxes are powers of two)
    for T, cols, dc in (
        (32768, 192, 64),
        (32768, 576, 64),
        (4096, 576, 64),
        (32768, 512, 64),
        (32768, 512, 128),
    ):
        for kind in ("red.v4", "tma", "tma+restage"):
            if kind == "red.v4" and dc != 64:
                continue
            try:
                rows.append(rate(kind, T, 4096, 2048, dc, cols // dc, 4))
            except Exception as e:  # report the case that failed and go on with the others
                rows.append(dict(kind=kind, T=T, DC=dc, NCB=cols // dc, error=repr(e)[:300]))
    print(f"{'kind':>12} {'T':>6} {'DC':>4} {'NCB':>4} {'ms':>8} {'adds/s':>9} ok")
    for r in rows:
        if "error" in r:
            print(f"{r['kind']:>12} {r['T']:>6} {r['DC']:>4} {r['NCB']:>4} error {r['error']}")
            continue
        print(
            f"{r['kind']:>12} {r['T']:>6} {r['DC']:>4} {r['NCB']:>4} {r['ms']:>8.2f} "
            f"{r['adds_per_s']:>9.2e} "
            f"{r['sum_ok']}"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
