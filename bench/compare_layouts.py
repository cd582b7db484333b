"""Train one config under several parallel layouts on the same global batches and compare with the
first layout.

For the multi-GPU checks of the parallel layouts: e.g. on 2 H200s, the proxy config on 1 GPU vs
FSDP=2 vs EP=2 (vs PP=2). Every run uses ``--data.same_global_batch`` and the layout-independent
init, so the loss curves must agree up to bf16 rounding (and the nondeterministic fp32 atomics of
the attention backward).

    source bench/gpu_env.sh
    python3 bench/compare_layouts.py --steps 30 --global-rows 2 \\
        --layout "1gpu=1:" \\ --layout "fsdp2=2:--parallelism.data_parallel_shard_degree 2" \\
        --layout "ep2=2:--parallelism.expert_parallel_degree 2" \\ --layout
        "pp2=2:--parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule
        1F1B"

``--layout NAME=NPROC:ARGS`` (repeatable); the local batch is ``global_rows / (NPROC / pp)``. Prints
one table last (tokens/s per GPU, MFU, peak memory of the fullest rank, max loss difference to the
first layout) and writes JSON to ``--out`` (and ``$OUT`` when set).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_layout(text: str) -> tuple[str, int, list[str]]:
    name, rest = text.split("=", 1)
    nproc, args = rest.split(":", 1)
    return name, int(nproc), shlex.split(args)


def run_layout(name, nproc, extra, a, folder) -> dict:
    pp = 1
    if "--parallelism.pipeline_parallel_degree" in extra:
        pp = int(extra[extra.index("--parallelism.pipeline_parallel_degree") + 1])
    dp = nproc // pp
    if a.global_rows % dp:
        return {"status": "error", "why": f"global rows {a.global_rows} not divisible by dp {dp}"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        os.path.join(ROOT, "train.py"),
        "--job.config_file",
        a.config,
        "--job.dump_folder",
        folder,
        "--training.steps",
        str(a.steps),
        "--training.seq_len",
        str(a.seq_len),
        "--training.local_batch_size",
        str(a.global_rows // dp),
        "--data.same_global_batch",
        "--metrics.log_freq",
        "1",
        "--checkpoint.no-enable",
        "--metrics.no-enable-tensorboard",
        *a.common,
        *extra,
    ]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=a.timeout)
    out = {
        "name": name,
        "nproc": nproc,
        "args": extra,
        "wall_s": round(time.time() - t0, 1),
        "command": " ".join(shlex.quote(c) for c in cmd),
    }
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).splitlines()
        first_tb = next(
            (
                i
                for i, line in enumerate(lines)
                if line.startswith("Traceback") or "Traceback (most recent call last)" in line
            ),
            max(0, len(lines) - 25),
        )
        # the first rank's traceback, then the end
        log = lines[first_tb : first_tb + 60] + ["..."] + lines[-15:]
        oom = any("out of memory" in line.lower() for line in lines)
        out.update(status="OOM" if oom else "error", log=log)
        print("\n".join(log), flush=True)
        return out
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    timed = rows[a.warmup :]
    step_s = sum(r["time/step_s"] for r in timed)
    out.update(
        status="ok",
        losses=[r["loss/total"] for r in rows],
        grad_norms=[r["grad_norm"] for r in rows],
        tokens_per_s_per_gpu=sum(
            r["throughput/tokens_per_s_per_device"] * r["time/step_s"] for r in timed
        )
        / step_s,
        mfu_pct=(sum(r.get("throughput/mfu_pct", 0.0) * r["time/step_s"] for r in timed) / step_s),
        peak_gib_fullest_rank=max(
            r.get(
                "memory/peak_allocated_gib_max_over_ranks",
                r.get("memory/peak_rss_gib_max_over_ranks", 0.0),
            )
            for r in rows
        ),
    )
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--layout", action="append", required=True, help="NAME=NPROC:EXTRA_ARGS (repeatable)"
    )
    p.add_argument("--config", default=os.path.join(ROOT, "train_configs", "glm52_proxy.toml"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument(
        "--warmup", type=int, default=3, help="steps left out of the throughput averages"
    )
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument(
        "--global-rows", type=int, default=2, help="sequences per step over all data-parallel ranks"
    )
    p.add_argument("--common", default="", help="extra train.py arguments for every layout")
    p.add_argument("--timeout", type=int, default=480)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "layouts.json"))
    a = p.parse_args(argv)
    a.common = shlex.split(a.common)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for text in a.layout:
            name, nproc, extra = parse_layout(text)
            print(f"[layouts] {name}: {nproc} processes {' '.join(extra)}", flush=True)
            results.append(run_layout(name, nproc, extra, a, os.path.join(tmp, name)))
            print(f"[layouts]   {results[-1]['status']} in {results[-1]['wall_s']} s", flush=True)
    ref = results[0] if results and results[0]["status"] == "ok" else None
    for r in results:
        if ref is not None and r["status"] == "ok":
            diffs = [abs(x - y) / abs(y) for x, y in zip(r["losses"], ref["losses"])]
            r["max_rel_loss_diff_vs_first"] = max(diffs)
            r["final_rel_loss_diff_vs_first"] = diffs[-1]
    doc = {
        "config": a.config,
        "steps": a.steps,
        "seq_len": a.seq_len,
        "global_rows": a.global_rows,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "results": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    if os.environ.get("OUT") and os.path.dirname(os.path.abspath(a.out)) != os.path.abspath(
        os.environ["OUT"]
    ):
        with open(os.path.join(os.environ["OUT"], os.path.basename(a.out)), "w") as f:
            json.dump(doc, f, indent=1)
    print(
        f"\n{'layout':<10} {'gpus':>4} {'status':>7} {'tok/s/gpu':>10} {'MFU %':>6} "
        f"{'peak GiB':>9} "
        f"{'max rel dloss':>14} {'final loss':>11}"
    )
    for r in results:
        if r["status"] != "ok":
            print(f"{r['name']:<10} {r['nproc']:>4} {r['status']:>7}")
            continue
        print(
            f"{r['name']:<10} {r['nproc']:>4} {'ok':>7} {r['tokens_per_s_per_gpu']:>10.0f} "
            f"{r['mfu_pct']:>6.1f} "
            f"{r['peak_gib_fullest_rank']:>9.1f} {r.get('max_rel_loss_diff_vs_first', 0.0):>14.2e} "
            f"{r['losses'][-1]:>11.4f}"
        )
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
