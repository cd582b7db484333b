"""Rate of plain fp32 reductions into a [T, 576] buffer, the pattern of the sparse MLA backward's
dKV.

    python3 bench/atomic_probe.py --out atomic_rate.json

Each program adds a [64, DC] tile of ones at 64 rows per step (random rows, or consecutive ones with
"seq") and DC columns of its column block, as part 2 of the backward does, but with no loads or
products around it: the rate the L2 sustains for ``red.global.add.v4.f32``. One H200
(``results/2026-12-01_h200_dsa_kernels.md``): 9.7e11 adds/s into a 4K-row buffer (9.4 MB, in L2),
5.5e11 into a 32K-row one (75 MB, past L2).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from attn_paths import time_fn  # bench/attn_paths.py: CUDA-event ms per call


@triton.jit
def _red_kernel(
    dst_ptr,
    idx_ptr,
    n_per,
    T,
    BK: tl.constexpr,
    DC: tl.constexpr,
    NCB: tl.constexpr,
    SEQ: tl.constexpr,
):
    offs_c = tl.program_id(0) * DC + tl.arange(0, DC)
    prog = tl.program_id(1)
    ones = tl.full([BK, DC], 1.0, tl.float32)
    for i in range(0, n_per, BK):
        offs = prog * n_per + i + tl.arange(0, BK)
        rows = offs % T if SEQ else tl.load(idx_ptr + offs)
        tl.atomic_add(
            dst_ptr + rows.to(tl.int64)[:, None] * (NCB * DC) + offs_c[None, :], ones, sem="relaxed"
        )


def rate(
    T: int, programs: int, per: int, dc: int, blocks: int, seq: bool, warps: int, reps: int = 3
) -> dict:
    dst = torch.zeros(T, blocks * dc, device="cuda")
    idx = torch.randint(0, T, (programs * per,), device="cuda", dtype=torch.int32)

    def launch():
        _red_kernel[(blocks, programs)](
            dst, idx, per, T, BK=64, DC=dc, NCB=blocks, SEQ=seq, num_warps=warps
        )

    ms = time_fn(launch, reps, warmup=1)
    return dict(
        T=T,
        n_prog=programs,
        DC=dc,
        NCB=blocks,
        seq=seq,
        warps=warps,
        ms=ms,
        adds_per_s=programs * per * blocks * dc / ms * 1e3,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    cases = [
        (32768, 4096, 2048, 64, 9, False, 4),
        (32768, 4096, 2048, 64, 9, True, 4),
        (32768, 4096, 2048, 128, 5, False, 4),
        (32768, 4096, 2048, 64, 9, False, 8),
        (32768, 4096, 2048, 32, 18, False, 4),
        (4096, 4096, 2048, 64, 9, False, 4),
    ]
    rows = [rate(*c) for c in cases]
    print(f"{'T':>6} {'DC':>4} {'rows':>6} {'warps':>5} {'ms':>8} {'adds/s':>9}")
    for r in rows:
        print(
            f"{r['T']:>6} {r['DC']:>4} {'seq' if r['seq'] else 'random':>6} {r['warps']:>5} "
            f"{r['ms']:>8.2f} "
            f"{r['adds_per_s']:>9.2e}"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
