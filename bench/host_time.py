"""Host time per call of the products and their parts: where an FP8 product's host time goes.

    source bench/gpu_env.sh && python3 bench/host_time.py [--out host_time.json]

Shapes are small (a linear over 256 tokens, the routed experts over 2,048 rows), so the GPU finishes
each call before the host queues the next: the time per call of a loop without syncs is the host's.
Each row: the mean over ``--calls`` calls after 5 warm-ups, without a sync ("host") and with one
after every call ("synced"). The rows separate each registered op (``model/ops.py``:
``torch.library.Library``) from its implementation called directly and from the same implementation
registered through ``torch.library.custom_op``, each quantisation launch and one ``_scaled_mm_v2``
call (also over a new row count each call, against row counts met before), whole products forward
and backward in bf16 and FP8, a backward alone through the autograd engine against its formula
called directly (an FP8 linear, and ``expert_mm`` with one expert as a registered op with a bf16
formula), and some of these calls made from a second thread (as the autograd engine makes a CUDA
backward's). ``--profile`` adds torch.profiler's table of an FP8 linear's host ops. On CPU (no
Triton launches, emulated products) it runs the rows that do not need CUDA, as a check of the
script.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import titan_glm52.model.fp8_mm as M
import titan_glm52.model.expert_mm as EM

# the proxy's widths (a linear 6144 -> 2048, experts 6144 -> 4096); on CPU each width / 16
TOKENS, DIM, OUT_DIM, EXPERTS, EXPERT_ROWS, EXPERT_DIM = 256, 6144, 2048, 16, 2048, 4096


def per_call(fn, calls: int, cuda: bool) -> dict[str, float]:
    """Mean microseconds per call, without and with a sync after each."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(5):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
        sync()
    synced = (time.perf_counter() - t0) / calls
    return {"host_us": host * 1e6, "synced_us": synced * 1e6}


def per_call_in_thread(fn, calls: int, cuda: bool) -> dict[str, float]:
    """``per_call`` run in a new thread, as the autograd engine runs a CUDA backward (on its
    device thread)."""
    result: dict[str, dict[str, float]] = {}
    thread = threading.Thread(target=lambda: result.update(r=per_call(fn, calls, cuda)))
    thread.start()
    thread.join()
    return result["r"]


_TWIN = None


def _custom_op_twin():
    """``fp8_expert_mm``'s implementation registered through ``torch.library.custom_op`` (which
    adds a Python wrapper to each call), once per process; returns the op."""
    global _TWIN
    if _TWIN is None:
        _TWIN = torch.library.custom_op("titan_glm52_host_time::fp8_mm", mutates_args=())(M._fp8_mm)
    return _TWIN


def rows(device: torch.device, calls: int) -> dict[str, dict[str, float]]:
    cuda = device.type == "cuda"
    bf16 = torch.bfloat16 if cuda else torch.float32
    d, o, ed = (DIM, OUT_DIM, EXPERT_DIM) if cuda else (DIM // 16, OUT_DIM // 16, EXPERT_DIM // 16)
    twin = _custom_op_twin()
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, scale=1.0, grad=False):
        t = (torch.randn(*shape, generator=g, device=device) * scale).to(bf16)
        return t.requires_grad_(grad)

    x, w, dy = rand(TOKENS, d), rand(o, d, scale=0.02), rand(TOKENS, o)
    w3, n = w.unsqueeze(0), [TOKENS]
    xe, we = rand(EXPERT_ROWS, d, grad=True), rand(EXPERTS, ed, d, scale=0.02, grad=True)
    splits = [EXPERT_ROWS // EXPERTS + (e % 5 - 2) * 16 for e in range(EXPERTS)]
    splits[-1] += EXPERT_ROWS - sum(splits)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()

    def backward(y, *leaves):
        for leaf in leaves:
            leaf.grad = None
        y.backward(torch.ones_like(y))

    # the backward alone, through the autograd engine on a graph kept between calls, and the FP8
    # op's backward formula called directly (no engine): what the engine adds
    ones = torch.ones(TOKENS, o, device=device, dtype=bf16)
    y_bf16, y_fp8 = torch.nn.functional.linear(xr, wr), M.fp8_linear(xr, wr)
    y_op = EM.expert_mm(xr, wr.unsqueeze(0), n)  # a registered op with a bf16 formula
    ctx = types.SimpleNamespace(saved_tensors=(x, w3), splits=n, needs_input_grad=(True, True))

    cases = {
        "bf16 F.linear forward": lambda: torch.nn.functional.linear(x, w),
        "fp8_mm op, forward (no autograd)": lambda: M.fp8_expert_mm(x, w3, n),
        "fp8_mm implementation called directly": lambda: M._fp8_mm(x, w3, n),
        "fp8_mm implementation as a custom_op": lambda: twin(x, w3, n),
        "fp8_mm_input_grad op": lambda: M._input_grad(dy, w3, n),
        "fp8_mm_input_grad implementation directly": lambda: M._input_grad_impl(dy, w3, n),
        "fp8_mm_weight_grad op": lambda: M._weight_grad(dy, x, n, bf16),
        "fp8_mm_weight_grad implementation directly": lambda: M._weight_grad_impl(dy, x, n, bf16),
        "bf16 linear, forward + backward": lambda: backward(
            torch.nn.functional.linear(xr, wr), xr, wr
        ),
        "fp8 linear, forward + backward": lambda: backward(M.fp8_linear(xr, wr), xr, wr),
        "bf16 linear, backward alone (autograd)": lambda: y_bf16.backward(ones, retain_graph=True),
        "fp8 linear, backward alone (autograd)": lambda: y_fp8.backward(ones, retain_graph=True),
        "fp8 linear, backward formula called directly": lambda: M._backward(ctx, ones),
        "bf16 expert_mm, one expert, backward alone (autograd)": lambda: y_op.backward(
            ones, retain_graph=True
        ),
        "bf16 expert_mm, one expert, backward formula directly": lambda: EM._backward(ctx, ones),
        "bf16 experts (expert_mm), forward + backward": lambda: backward(
            EM.expert_mm(xe, we, splits), xe, we
        ),
        "fp8 experts (fp8_expert_mm), forward + backward": lambda: backward(
            M.fp8_expert_mm(xe, we, splits), xe, we
        ),
    }
    if cuda:
        from titan_glm52.kernels import fp8_quant as K

        wq, ws = K.quant_blocks(w3)
        aq, a_s = M._rows_per_segment(x, n)[0]
        mm_out = torch.empty(TOKENS, o, device=device, dtype=bf16)
        cases.update(
            {
                "Triton quant_rows": lambda: K.quant_rows(x),
                "Triton quant_cols": lambda: K.quant_cols(x),
                "Triton quant_blocks": lambda: K.quant_blocks(w3),
                "one block-scaled _scaled_mm_v2.out": lambda: M.scaled_mm(
                    aq, a_s, wq[0], ws[0], True, mm_out
                ),
                "torch.empty": lambda: torch.empty(TOKENS, d, device=device),
            }
        )
        # The same product over row counts it has not met before, a new count each call (the routed
        # experts' counts change every step), then over 16 of them in turn: what a new shape costs
        # the host (cuBLAS choosing an algorithm, a kernel's first load).
        steps = 2 * calls + 5  # per_call's calls
        src = rand(TOKENS + 16 * steps, d)
        shaped = [
            M._rows_per_segment(src[: TOKENS + 16 * i], [TOKENS + 16 * i])[0] for i in range(steps)
        ]
        outs = [torch.empty(a.shape[0], o, device=device, dtype=bf16) for a, _ in shaped]

        def scaled_mm_over(order):
            i = next(order)
            return M.scaled_mm(*shaped[i], wq[0], ws[0], True, outs[i])

        new_rows, seen_rows = itertools.cycle(range(steps)), itertools.cycle(range(16))
        cases["one block-scaled _scaled_mm_v2.out, a new row count each call"] = lambda: (
            scaled_mm_over(new_rows)
        )
        cases["one block-scaled _scaled_mm_v2.out, 16 row counts met before, in turn"] = lambda: (
            scaled_mm_over(seen_rows)
        )
    out = {name: per_call(fn, calls, cuda) for name, fn in cases.items()}
    # the same calls from a second thread (the backward's products run on the engine's thread);
    # on CUDA also the input gradient's parts, to find which one costs more there
    threaded = [
        "fp8_mm_input_grad implementation directly",
        "fp8_mm_weight_grad implementation directly",
        "bf16 linear, forward + backward",
    ]
    if cuda:
        threaded += [
            "Triton quant_rows",
            "Triton quant_blocks",
            "one block-scaled _scaled_mm_v2.out",
            "torch.empty",
        ]
    for name in threaded:
        out[f"{name}, from a second thread"] = per_call_in_thread(cases[name], calls, cuda)
    return out


def profile_fp8_linear(device: torch.device, calls: int) -> str:
    """torch.profiler's table of the host ops of an FP8 linear's forward + backward through
    autograd (both threads), by self CPU time: where its host time goes op by op."""
    bf16 = torch.bfloat16 if device.type == "cuda" else torch.float32
    d, o = (DIM, OUT_DIM) if device.type == "cuda" else (DIM // 16, OUT_DIM // 16)
    x = torch.randn(TOKENS, d, device=device).to(bf16).requires_grad_()
    w = (torch.randn(o, d, device=device) * 0.02).to(bf16).requires_grad_()

    def step():
        x.grad = w.grad = None
        y = M.fp8_linear(x, w)
        y.backward(torch.ones_like(y))

    for _ in range(5):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="JSON (also copied into $OUT when set)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also print torch.profiler's host-op table of an FP8 linear's forward + backward",
    )
    a = p.parse_args(argv)
    device = torch.device(a.device)
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "calls": a.calls,
        "rows": rows(device, a.calls),
    }
    for name, r in result["rows"].items():
        print(f"{name:50s} host {r['host_us']:9.1f} us   synced {r['synced_us']:9.1f} us")
    if a.profile:
        result["profile"] = profile_fp8_linear(device, min(a.calls, 50))
        print(result["profile"])
    paths = [a.out] if a.out else []
    if os.environ.get("OUT"):
        paths.append(os.path.join(os.environ["OUT"], os.path.basename(a.out or "host_time.json")))
    for path in paths:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
