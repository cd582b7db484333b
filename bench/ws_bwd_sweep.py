"""A part of the Gluon sparse MLA backward (``bwd_ps``: P / dS; ``bwd_grad``: dKV atomics and dQ) under several of
its TUNE variants, side by side in one process: the whole backward (``sparse_mla._bwd``, chunked like training) at
T = 4K and 32K, one document, indexer top-2048, each variant's dq / dkv against the first variant's.

    python3 bench/ws_bwd_sweep.py bwd_grad '{"group_rows": 0}' '{"group_rows": -1}' '{"group_rows": 256}'
    python3 bench/ws_bwd_sweep.py bwd_ps '{}' '{"stages": 6}' '{"consumer_regs": 184, "loader_regs": 72}'
    python3 bench/ws_bwd_sweep.py bwd_grad '{}' '{"scratch_bytes": 2147483648}'

A variant's "scratch_bytes" sets ``sparse_mla.SCRATCH_BYTES`` (the backward's P / dS scratch, i.e. its chunk of
queries) instead of a TUNE key. Writes $OUT/ws_bwd_sweep_<part>.json; lines starting RESULT summarise.
"""
import json
import os
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402
import triton  # noqa: E402

from titan_glm52.kernels import sparse_mla as SM  # noqa: E402
from titan_glm52.kernels import sparse_mla_ws as W  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from ws_inputs import DEV, D_QK, D_V, bwd_inputs  # noqa: E402

part = sys.argv[1]
variants = [json.loads(a) for a in sys.argv[2:]] or [{}]
base = dict(W.TUNE[part])
base_scratch = SM.SCRATCH_BYTES
scale = D_QK ** -0.5
res = {"part": part, "variants": variants, "defaults": base}
for T in [4096, 32768]:
    q, kv, idx, kend, go, out, lse = bwd_inputs([T], 2, torch.Generator(device=DEV).manual_seed(5), scale)
    rows, ref = [], None
    for var in variants:
        tune = {**base, **var}
        SM.SCRATCH_BYTES = tune.pop("scratch_bytes", base_scratch)
        W.TUNE[part] = tune
        dq, dkv = SM._bwd(q, kv, idx, kend, out, lse, go, scale, D_V)
        if ref is None:
            ref = (dq, dkv)
        ms = triton.testing.do_bench(lambda: SM._bwd(q, kv, idx, kend, out, lse, go, scale, D_V), warmup=5, rep=300)
        rows.append(dict(variant=var, ms=ms, dq_max_abs=float((dq.float() - ref[0].float()).abs().max()),
                         dkv_max_abs=float((dkv.float() - ref[1].float()).abs().max()),
                         dkv_scale=float(ref[1].float().abs().max())))
        print(T, json.dumps(rows[-1]), flush=True)
    res[f"T{T}"] = rows
    del q, kv, idx, go, out, lse, ref
W.TUNE[part], SM.SCRATCH_BYTES = base, base_scratch
with open(os.path.join(os.environ.get("OUT", "/tmp"), f"ws_bwd_sweep_{part}.json"), "w") as f:
    json.dump(res, f, indent=1)
for T in [4096, 32768]:
    cells = [f"{json.dumps(r['variant'])} {r['ms']:.2f} ms (dq {r['dq_max_abs']:.3g}, dkv {r['dkv_max_abs']:.3g})"
             for r in res[f"T{T}"]]
    print(f"RESULT | {part} | T {T} | " + " | ".join(cells) + " |")
