"""A part of the Gluon sparse MLA backward (``bwd_ps``: P / dS; ``bwd_grad``: dKV atomics and dQ)
under several of its launch variants, side by side in one process: the whole backward
(``sparse_mla._bwd``, chunked like training) at T = 4K and 32K, one document, indexer top-2048,
each variant's dq / dkv against the first variant's.

    python3 bench/ws_bwd_sweep.py bwd_grad '{"group_rows": 0}' '{"group_rows": -1}'
    python3 bench/ws_bwd_sweep.py bwd_ps '{}' '{"stages": 6}' '{"consumer_regs": 184}'
    python3 bench/ws_bwd_sweep.py bwd_grad '{}' '{"scratch_bytes": 2147483648}'

A variant's keys are ``sparse_mla_ws`` launch overrides of the part, except "scratch_bytes": the
backward's P / dS scratch (``sparse_mla.SCRATCH_BYTES`` by default), i.e. its chunk of queries.
Writes $OUT/ws_bwd_sweep_<part>.json; lines starting RESULT summarise.
"""

import json
import os
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402
import triton  # noqa: E402

from titan_glm52.kernels import sparse_mla as SM  # noqa: E402
from titan_glm52.kernels import sparse_mla_ws as W  # noqa: E402
from titan_glm52.kernels.tuning import launch_overrides  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from ws_inputs import DEV, D_QK, D_V, bwd_inputs  # noqa: E402

part = sys.argv[1]
variants = [json.loads(a) for a in sys.argv[2:]] or [{}]
base = W.config(part)
scale = D_QK**-0.5
res = {"part": part, "variants": variants, "defaults": base}
for T in [4096, 32768]:
    gen = torch.Generator(device=DEV).manual_seed(5)
    q, kv, idx, kend, go, out, lse = bwd_inputs([T], 2, gen, scale)
    rows, ref = [], None

    def backward(q=q, kv=kv, idx=idx, kend=kend, out=out, lse=lse, go=go):
        return SM._bwd(q, kv, idx, kend, out, lse, go, scale, D_V)

    for var in variants:
        tune = dict(var)
        scratch = tune.pop("scratch_bytes", SM.SCRATCH_BYTES)
        with launch_overrides(
            {"sparse_mla_ws": {part: tune}, "sparse_mla": {"bwd": {"scratch_bytes": scratch}}}
        ):
            dq, dkv = backward()
            if ref is None:
                ref = (dq, dkv)
            ms = triton.testing.do_bench(backward, warmup=5, rep=300)
        rows.append(
            dict(
                variant=var,
                ms=ms,
                dq_max_abs=float((dq.float() - ref[0].float()).abs().max()),
                dkv_max_abs=float((dkv.float() - ref[1].float()).abs().max()),
                dkv_scale=float(ref[1].float().abs().max()),
            )
        )
        print(T, json.dumps(rows[-1]), flush=True)
    res[f"T{T}"] = rows
    del q, kv, idx, go, out, lse, ref, backward
with open(os.path.join(os.environ.get("OUT", "/tmp"), f"ws_bwd_sweep_{part}.json"), "w") as f:
    json.dump(res, f, indent=1)
for T in [4096, 32768]:
    cells = [
        f"{json.dumps(r['variant'])} {r['ms']:.2f} ms (dq {r['dq_max_abs']:.3g}, "
        f"dkv {r['dkv_max_abs']:.3g})"
        for r in res[f"T{T}"]
    ]
    print(f"RESULT | {part} | T {T} | " + " | ".join(cells) + " |")
