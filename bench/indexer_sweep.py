"""The indexer's top-k (``indexer_topk``) under several launch variants of its scoring, side by
side in one process: the whole call and the scoring alone (selection skipped), at T = 4K and 32K
in one document, each variant's selection against the first variant's (must be identical: the
scores are the same sums in the same order per head).

    python3 bench/indexer_sweep.py '{}' '{"BQ": 8}' '{"BQ": 8, "num_warps": 16}'
    python3 bench/indexer_sweep.py '{"ws": {}}' '{}' '{"ws": {"stages": 6}}'   # indexer_topk_ws

A variant's "ws" key takes the Gluon scoring kernel with those launch overrides (the "score" part
of ``indexer_topk_ws``); without it the Triton kernel runs (``gluon=False``) with the variant as
its "score" overrides. "scratch_bytes" sets the call's score scratch budget
(``indexer_topk.SCRATCH_BYTES`` by default), i.e. how many query rows a chunk holds.

Writes $OUT/indexer_sweep.json; lines starting RESULT summarise.
"""

import json
import os
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402
import triton  # noqa: E402

from titan_glm52.kernels import indexer_topk as IT  # noqa: E402
from titan_glm52.kernels import indexer_topk_ws as WS  # noqa: E402
from titan_glm52.kernels.tuning import launch_overrides  # noqa: E402

DEV, H_I, D_I, TOPK = "cuda", 32, 128, 2048
SKIP_SELECT = {"indexer_topk": {"select": {"skip": True}}}  # the scoring alone
variants = [json.loads(a) for a in sys.argv[1:]] or [{}]
res = {
    "variants": variants,
    "defaults": {**IT.SCORE_LAUNCH},
    "ws_defaults": dict(WS.DEFAULTS["score"]),
}
for T in [4096, 32768]:
    g = torch.Generator(device=DEV).manual_seed(0)
    qi = torch.randn(T, H_I, D_I, generator=g, device=DEV).to(torch.bfloat16)
    ki = torch.randn(T, D_I, generator=g, device=DEV).to(torch.bfloat16)
    wi = torch.randn(T, H_I, generator=g, device=DEV) * H_I**-0.5
    cu = torch.tensor([0, T], dtype=torch.int32, device=DEV)
    flop = 2 * H_I * D_I * (T * (T + 1) // 2 - TOPK * (TOPK + 1) // 2)  # rows past topk are scored
    rows, ref = [], None
    for spec in variants:
        var = dict(spec)
        scratch = var.pop("scratch_bytes", IT.SCRATCH_BYTES)
        ws = var.get("ws")
        if ws is not None:
            launch = {"indexer_topk_ws": {"score": ws}}
        else:
            launch = {"indexer_topk": {"score": var}}

        def call():
            return IT.indexer_topk(
                qi,
                ki,
                wi,
                cu,
                TOPK,
                D_I**-0.5,
                max_len=T,
                scratch_bytes=scratch,
                gluon=ws is not None,
            )

        with launch_overrides(launch):
            out = call()
            ref = out if ref is None else ref
            ms = triton.testing.do_bench(call, warmup=5, rep=200)
            with launch_overrides(SKIP_SELECT):
                score_ms = triton.testing.do_bench(call, warmup=5, rep=200)
        rows.append(
            dict(
                variant=spec,
                ms=ms,
                score_ms=score_ms,
                score_tflops=flop / score_ms / 1e9,
                identical=bool(torch.equal(out, ref)),
            )
        )
        print(T, json.dumps(rows[-1]), flush=True)
    res[f"T{T}"] = rows
with open(os.path.join(os.environ.get("OUT", "/tmp"), "indexer_sweep.json"), "w") as f:
    json.dump(res, f, indent=1)
for T in [4096, 32768]:
    cells = [
        f"{json.dumps(r['variant'])} {r['ms']:.2f} ms (score {r['score_ms']:.2f} ms, "
        f"{r['score_tflops']:.0f} TF{'' if r['identical'] else ', DIFFERENT'})"
        for r in res[f"T{T}"]
    ]
    print(f"RESULT | indexer_topk | T {T} | " + " | ".join(cells) + " |")
