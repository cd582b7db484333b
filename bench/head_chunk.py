"""The output head's fused linear + cross-entropy (``model/head.py``) at the proxy's widths, by
chunk size.

Each chunk forms its logits, the loss and their gradient, then the hidden-state and weight
gradients; the weight's gradient is accumulated over the chunks (``addmm_``). Larger chunks mean
fewer accumulations of the [vocab, hidden] gradient and longer reductions in its GEMM, at the price
of a larger logits buffer. Times the head's forward and backward (its GEMMs all run in the forward)
for each chunk size, interleaved, with CUDA events, and reports the peak memory the head adds.

    python3 bench/head_chunk.py [--tokens 32768] [--chunks 4096,8192,16384] [--reps 5] [--out
    head.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from titan_glm52.model.head import linear_cross_entropy_sum


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--dim", type=int, default=6144)
    p.add_argument("--vocab", type=int, default=154880)
    p.add_argument("--chunks", default="4096,8192,16384")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default="")
    a = p.parse_args()
    chunks = [int(c) for c in a.chunks.split(",")]
    dev = "cuda"
    if not torch.cuda.is_available():
        raise SystemExit("bench/head_chunk.py times CUDA kernels: run it on the GPU machine")
    g = torch.Generator(device=dev).manual_seed(0)
    h = (
        (torch.randn(a.tokens, a.dim, device=dev, generator=g) * 0.5)
        .to(torch.bfloat16)
        .requires_grad_()
    )
    w = (
        (torch.randn(a.vocab, a.dim, device=dev, generator=g) * 0.02)
        .to(torch.bfloat16)
        .requires_grad_()
    )
    labels = torch.randint(0, a.vocab, (a.tokens,), device=dev, generator=g)
    flops = 3 * 2 * a.tokens * a.dim * a.vocab

    def run(chunk):
        loss = linear_cross_entropy_sum(h, w, labels, chunk)
        loss.backward()
        h.grad = w.grad = None
        return loss

    # warm-up (Triton compile) and the losses, which must agree
    ref = {c: run(c).item() for c in chunks}
    peaks = {}
    for c in chunks:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run(c)
        torch.cuda.synchronize()
        peaks[c] = (torch.cuda.max_memory_allocated() - base) / 2**30
    times = {c: [] for c in chunks}
    for _ in range(a.reps):
        for c in chunks:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            run(c)
            e1.record()
            torch.cuda.synchronize()
            times[c].append(e0.elapsed_time(e1))
    rows = []
    for c in chunks:
        med = statistics.median(times[c])
        rows.append(
            dict(
                chunk=c,
                median_ms=med,
                ms=times[c],
                tflops=flops / med / 1e9,
                peak_gib=peaks[c],
                loss=ref[c],
            )
        )
        print(
            f"chunk {c:6d}: median {med:7.2f} ms (min {min(times[c]):7.2f}, max "
            f"{max(times[c]):7.2f}) "
            f"{flops / med / 1e9:5.0f} TFLOP/s, head's peak {peaks[c]:5.2f} GiB, loss {ref[c]:.6e}",
            flush=True,
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                dict(
                    device=torch.cuda.get_device_name(),
                    torch=torch.__version__,
                    tokens=a.tokens,
                    dim=a.dim,
                    vocab=a.vocab,
                    rows=rows,
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
