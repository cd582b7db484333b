"""Compile the Triton DSA kernels for an H100/H200 (sm_90a) without a GPU and report registers,
spills and shared memory per kernel (``ptxas -v`` on the generated PTX).

    python bench/compile_check.py            # real GLM-5.2 shapes
    python bench/compile_check.py --small    # the small test shapes
    python bench/compile_check.py --only ws_bwd_ps \\
        --overrides '{"sparse_mla_ws": {"bwd_ps": {"stages": 6}}}'

``--overrides``: launch variants (``titan_glm52.kernels.tuning.launch_overrides``; JSON, or a
file of it such as ``bench/kernels.py --tune-out`` writes) compiled instead of the defaults.

Catches compile errors the interpreter cannot see (types of loop-carried values, unsupported
layouts, shared memory overflow) before spending GPU time.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

# real JITFunctions, not the interpreter (triton reads this when it decorates a kernel)
os.environ["TRITON_INTERPRET"] = "0"

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


SMEM_LIMIT = 232448  # opt-in shared memory per block on H100/H200


def _ptxas_report(ptx: str, arch: str = "sm_90a") -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        res = subprocess.run(
            [get_ptxas(90).path, f"-arch={arch}", "-v", path, "-o", os.path.join(d, "k.cubin")],
            capture_output=True,
            text=True,
        )
    txt = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", txt)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", txt)
    return (
        f"regs={regs.group(1) if regs else '?'} "
        f"spill_st/ld={spill.group(1) + '/' + spill.group(2) if spill else '?'}"
    )


def compile_one(
    fn,
    sig: dict,
    consts: dict,
    num_warps: int,
    num_stages: int,
    div16: tuple = (),
    options: dict | None = None,
) -> str:
    """sig: name -> type string for runtime args; consts: name -> value for constexpr args; options:
    further compile options the launch passes (e.g. enable_fp_fusion)."""
    signature = {}
    for name in fn.arg_names:
        signature[name] = "constexpr" if name in consts else sig[name]
    # like the runtime at real sizes: every pointer and every integer argument (strides, T, K...) is
    # a multiple of 16, which enables the widest vector copies and pipelining (and the most shared
    # memory)
    div16 = tuple(
        n for n in fn.arg_names if n not in consts and (sig[n].startswith("*") or sig[n] == "i32")
    )
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    if getattr(fn, "is_gluon", lambda: False)():  # a Gluon kernel (kernels/sparse_mla_ws.py)
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(fn, signature, constexprs=consts, attrs=attrs)
    else:
        src = ASTSource(fn, signature, constexprs=consts, attrs=attrs)
    t0 = time.time()
    k = triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages, **(options or {})},
    )
    if k.metadata.shared > SMEM_LIMIT:
        raise RuntimeError(
            f"shared memory {k.metadata.shared} B > {SMEM_LIMIT} B available per block on sm_90"
        )
    return (
        f"{fn.__name__:28s} {_ptxas_report(k.asm['ptx'])} smem={k.metadata.shared} "
        f"({time.time() - t0:.1f}s)"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--only", default="")
    ap.add_argument("--overrides", default="", help="launch overrides: JSON or a JSON file")
    args = ap.parse_args()
    from titan_glm52.kernels import (
        adam,
        cross_entropy,
        fp8_quant,
        indexer_loss,
        indexer_topk,
        indexer_topk_ws,
        linear_fp32,
        moe_routing,
        sparse_mla,
        sparse_mla_ws,
    )
    from titan_glm52.kernels.tuning import launch_overrides, parse

    failed = False
    modules = (
        indexer_topk,
        indexer_topk_ws,
        sparse_mla,
        sparse_mla_ws,
        indexer_loss,
        cross_entropy,
        adam,
        moe_routing,
        linear_fp32,
        fp8_quant,
    )
    with launch_overrides(parse(args.overrides)):
        for line in collect(args.small, args.only, *modules):
            failed |= "FAILED" in line
            print(line, flush=True)
    sys.exit(1 if failed else 0)


def collect(small: bool, only: str, *modules):
    for name, item in [spec for mod in modules for spec in mod.compile_specs(small)]:
        if only and only not in name:
            continue
        fn, sig, consts, nw, ns, div, *options = item
        try:
            yield f"{name:22s} " + compile_one(fn, sig, consts, nw, ns, div, *options)
        except Exception as e:  # report and go on: we want every failure in one run
            yield f"{name:22s} FAILED: {type(e).__name__}: {str(e)[:2000]}"


if __name__ == "__main__":
    main()
