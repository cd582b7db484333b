"""The optimizer step on the GPU: this project's Triton Adam(W) kernel against torch's fused AdamW,
on every parameter shape of a model flavor (fp32 parameters, gradients and moments, as FSDP2's
sharded state holds them).

    python3 bench/adam.py --flavor glm52_proxy --out /tmp/adam.json

Per variant: GPU time of one step (CUDA events, median of --steps after --warmup), the bytes it must
move per parameter and the bandwidth that makes, and the host time of the step() call alone (what
the launches cost). Variants: torch fused AdamW (no clip; 28 B/param), torch fused with the clip as
grad_scale (the "fused" path of the trainer; it writes the gradient back, 32 B/param), the Triton
kernel with the clip as grad_coef and a skip flag (the "triton" path; 28 B/param) for each --sweep
launch setting, and the Triton kernel with its moments in bf16 (``[optimizer] state_dtype =
"bfloat16"``, the default launch setting; 20 B/param). The Triton result after the timed steps is
checked against torch fused run on the same gradients (largest difference of the parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titan_glm52.kernels import adam as adam_kernel  # noqa: E402
from titan_glm52.model.args import get_flavor  # noqa: E402
from titan_glm52.model.model import GLM52Model  # noqa: E402
from titan_glm52.optimizer import TritonAdamW  # noqa: E402
from titan_glm52.optimizer import clip_in_fused_step  # noqa: E402

HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def shapes_of(flavor: str) -> list[torch.Size]:
    with torch.device("meta"):
        model = GLM52Model(get_flavor(flavor))
    return [p.shape for p in model.parameters()]


def time_steps(step, warmup: int, steps: int) -> tuple[float, float]:
    """(median GPU ms per step, median host ms of the call)"""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t = time.perf_counter()
        step()
        host.append((time.perf_counter() - t) * 1e3)
        b.record()
        torch.cuda.synchronize()
        gpu.append(a.elapsed_time(b))
    return statistics.median(gpu), statistics.median(host)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--flavor", default="glm52_proxy")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument(
        "--sweep", default="512x4,1024x4,1024x2,2048x4,4096x8", help="BLOCKxNUM_WARPS settings"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    shapes = shapes_of(args.flavor)
    n = sum(s.numel() for s in shapes)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=dev) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    # the smallest-index ones: checked after the timed steps
    init = [p.detach().clone() for p in params[:4]]
    norm = torch.tensor(5.0, device=dev)  # max_norm 1: the clip is active (coefficient ~0.2)
    skip = torch.tensor(False, device=dev)
    rows = []

    def record(name, bytes_per_param, gpu_ms, host_ms, **extra):
        rows.append(
            dict(
                variant=name,
                gpu_ms=round(gpu_ms, 3),
                host_ms=round(host_ms, 3),
                bytes_per_param=bytes_per_param,
                tb_per_s=round(n * bytes_per_param / gpu_ms / 1e9, 3),
                **extra,
            )
        )
        print(
            f"{name:<32} {gpu_ms:8.2f} ms GPU {host_ms:7.2f} ms host {rows[-1]['tb_per_s']:6.2f} "
            "TB/s",
            flush=True,
        )

    def clipped(opt):
        """One step of ``opt`` with the clip (max_norm 1 against a norm of 5) and the skip flag
        folded in."""

        def step():
            with clip_in_fused_step([opt], norm, 1.0, skip=skip):
                opt.step()

        return step

    fused = torch.optim.AdamW(params, fused=True, **HYPER)
    record("torch fused", 28, *time_steps(fused.step, args.warmup, args.steps))
    record(
        "torch fused + clip (grad_scale)", 32, *time_steps(clipped(fused), args.warmup, args.steps)
    )
    fused = None  # (its moments: 2 x 4 bytes per parameter)
    torch.cuda.empty_cache()

    default = (adam_kernel.BLOCK, adam_kernel.NUM_WARPS)
    for setting in args.sweep.split(","):
        block, warps = (int(v) for v in setting.split("x"))
        adam_kernel.BLOCK, adam_kernel.NUM_WARPS = block, warps
        record(
            f"triton + clip (grad_coef) {setting}",
            28,
            *time_steps(clipped(TritonAdamW(params, **HYPER)), args.warmup, args.steps),
            block=block,
            num_warps=warps,
        )
        torch.cuda.empty_cache()
    adam_kernel.BLOCK, adam_kernel.NUM_WARPS = default
    # [optimizer] state_dtype "bfloat16": the two moments stored in bf16 (20 B/param)
    opt = TritonAdamW(params, **HYPER)
    opt.state_dtype = torch.bfloat16
    record(
        "triton + clip, bf16 moments",
        20,
        *time_steps(clipped(opt), args.warmup, args.steps),
        state_dtype="bfloat16",
    )
    opt = None
    torch.cuda.empty_cache()

    # Agreement: three steps of each from the same start on the same (clipped) gradients.
    check = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    o_t, o_r = TritonAdamW(check, **HYPER), torch.optim.AdamW(ref, fused=True, **HYPER)
    for _ in range(3):
        # (torch's kernel writes the clipped gradient back)
        for p, q, src in zip(check, ref, params[:4]):
            p.grad, q.grad = src.grad.clone(), src.grad.clone()
        with clip_in_fused_step([o_t], norm, 1.0):
            o_t.step()
        with clip_in_fused_step([o_r], norm, 1.0):
            o_r.step()
    diff = max(float((a - b).detach().abs().max()) for a, b in zip(check, ref))
    scale = max(float(b.detach().abs().max()) for b in ref)
    differing = sum(int((a != b).sum()) for a, b in zip(check, ref)) / sum(b.numel() for b in ref)
    print(
        f"triton vs torch fused after 3 clipped steps: max abs diff {diff:.3e} (max |param| "
        f"{scale:.3e}), "
        f"{differing:.2%} of elements differ"
    )
    result = dict(
        flavor=args.flavor,
        params=n,
        tensors=len(shapes),
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        rows=rows,
        check=dict(max_abs_diff=diff, max_abs_param=scale, fraction_differing=differing),
        command=" ".join(["python3"] + sys.argv),
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
