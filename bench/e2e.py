"""End-to-end training throughput on one GPU (or N of one host): our GLM-5.2 proxy vs torchtitan
0.2.2's DeepSeek-V3 at the same widths.

The peer stays on torchtitan 0.2.2: 0.3.0's DeepSeek-V3 imports
``torch.distributed.fsdp.DataParallelMeshDims`` (``torchtitan/models/deepseek_v3/mtp.py`` line 15),
which torch first exports in 2.12.0, and the GPU machine has 2.11 (bench/README.md, "The peer").

On the GPU machine (wheels carried in .whl/, see bench/gpu_env.sh):

    source bench/gpu_env.sh && python3 bench/e2e.py  # lean default matrix, < 9 min
    python3 bench/e2e.py --quick                     # 4K and 32K, compile off, AC selective
    python3 bench/e2e.py --real-mode --ac full       # ours as trained: MTP, indexer KL; 4K to 64K
    python3 bench/e2e.py --seq-lens 4096,16384,32768 --compile off,on --ac none,selective \\
        --steps 6 --warmup 3
    python3 bench/e2e.py --nproc 2 --parallel fsdp   # each side on 2 GPUs, FSDP over 2
    python3 bench/e2e.py --nproc 2 --parallel ep     # EP = 2 (carved out of FSDP's 2 ranks)
    python3 bench/e2e.py --seq-lens 4096 --trace     # + top GPU kernels of both sides
    python3 bench/e2e.py --quick --peer-args="--float8 rowwise"           # the peer in float8

Every cell of the matrix (seq_len x compile x AC) runs twice, each side in its own subprocess
(memory is released, an OOM or a crash loses only that cell, recorded as "OOM" / "error" with the
last lines of its log):

* ours: ``train.py --job.config_file train_configs/glm52_proxy.toml`` for warmup + steps steps with
  ``--metrics.log_freq 1 --data.no-document-masking --dsa.recall_queries 0 --checkpoint.no-enable``
  (one sequence per sample, so DSA is really sparse at 4K+), the cell's seq_len / AC mode / compile
  flag; its ``metrics.jsonl`` is averaged over the steps after the warm-up. MFU is the trainer's
  DSA-aware count (``titan_glm52/model/flops.py``). ``--real-mode`` trains ours as a real run
  does: MTP on (as ``--our-mtp on``) and the sparse stage's indexer KL loss, ``--mtp.enable
  --dsa.mode sparse --dsa.indexer_loss_coeff 0.01`` before any ``--our-args`` (which may override
  them), with 4K, 16K, 32K and 64K as the default ``--seq-lens``; the markdown notes then say so
  and give ours' MFU formula with its MTP and KL terms, and the JSON meta records ``real_mode``.
* peer: ``bench/e2e_tt_dsv3.py`` (torchtitan's DeepSeekV3Model, its AC / compile / MoE / SDPA
  attention, FSDP2 mixed precision on a 1-rank mesh, AdamW); MFU counts dense causal attention (see
  that file). On one GPU ``--peer-mp autocast`` runs the peer's own one-device path (torch.autocast)
  instead, which is often faster than its one-rank FSDP path (bench/results/2026-11-30_h200_e2e.md);
  ``--peer-mp fsdp,autocast`` runs both (the cell's "peer" and "peer_autocast") and reports ours
  against the faster ("ratio_best_peer"). A peer run that runs out of memory runs once more with
  full activation checkpointing (``--peer-oom-ac``; at 32K on one H200 it fits only so), marked in
  the table, so every cell has a ratio. ``--peer-args="--float8 rowwise"`` (or tensorwise) trains
  the peer with torchtitan's own float8 converters (see that file: the linears in float8, the
  routed experts where its grouped-mm converter takes them); the notes then say what ran in float8.

With ``--nproc N`` (N > 1) both sides run under ``python -m torch.distributed.run --standalone
--nproc_per_node N`` with the same mode: ``--parallel fsdp`` = FSDP over the N ranks (ours
``--parallelism.data_parallel_shard_degree N``, the peer ``--dp-shard N``), ``--parallel ep`` =
expert parallelism over the N ranks on top of that (ours also ``--parallelism.expert_parallel_degree
N``, the peer ``--ep N``; the EP ranks are the FSDP ranks, dp_shard stays N). ``--batch`` stays the
local batch per rank; every rank trains on different data.

tokens/s is per GPU = local tokens per step / mean step time over the timed steps (rank 0's; ours:
the trainer's ``time/step_s``, on a GPU the time from one step's end to the next's as the GPU ran
them); ratio = ours / peer tokens/s (the primary metric). Peak memory is the largest per-step
``torch.cuda.max_memory_allocated`` of the timed steps, the max over ranks when N > 1. Results:
``--out`` (JSON) and the markdown table beside it (``--md``), both copied into ``$OUT`` when it is
set; the table is printed last. ``--budget-s`` bounds the whole run: cells that cannot start in time
are "SKIPPED".
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_summary  # noqa: E402  (bench/trace_summary.py)

PEAK_BF16_TFLOPS = 989.0  # H100/H200 dense bf16, as titan_glm52.metrics uses for MFU
# The indexer KL coefficient of --real-mode: the one train_configs/glm52_debug.toml trains with.
REAL_MODE_INDEXER_KL = 0.01


def _csv(kind):
    def parse(text: str) -> list:
        values = [kind(v.strip()) for v in text.split(",") if v.strip()]
        if not values:
            raise argparse.ArgumentTypeError("empty list")
        return values

    return parse


def _choices(*allowed):
    def parse(text: str) -> list[str]:
        values = _csv(str)(text)
        bad = [v for v in values if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad}: choose from {allowed}")
        return values

    return parse


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--seq-lens",
        type=_csv(int),
        default=None,
        help="comma-separated (default 4096,16384,32768; with --real-mode 4096,16384,32768,65536)",
    )
    p.add_argument("--compile", type=_choices("off", "on"), default=["off"], help="off,on")
    p.add_argument(
        "--ac",
        type=_choices("none", "selective", "full"),
        default=["selective"],
        help="none,selective",
    )
    p.add_argument(
        "--sac-option",
        default="2",
        help="activation_checkpoint.selective_ac_option for both sides: N = every N-th block "
        "(torchtitan's default, and the proxy config's), 'op' = per-op SAC "
        "(each side's own policy)",
    )
    p.add_argument("--steps", type=int, default=4, help="timed steps per cell, after the warm-up")
    p.add_argument(
        "--warmup", type=int, default=2, help="untimed steps per cell (compile, allocator)"
    )
    p.add_argument(
        "--warmup-compiled",
        type=int,
        default=4,
        help="untimed steps per compile-on cell, both sides (at least --warmup): with 2, ours "
        "still "
        "compiled in the first timed step at 4K",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=1,
        help="local batch size (sequences per step per rank), both sides",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="GPUs (processes, under torchrun when > 1) per side and cell",
    )
    p.add_argument(
        "--parallel",
        choices=("fsdp", "ep"),
        default="fsdp",
        help="with --nproc N > 1: FSDP over N ranks, or EP = N on top of it (both sides)",
    )
    p.add_argument(
        "--quick", action="store_true", help="only 4K and 32K, compile off, AC selective"
    )
    p.add_argument(
        "--peer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run torchtitan's DeepSeek-V3 at the same widths",
    )
    p.add_argument(
        "--peer-mp",
        type=_choices("fsdp", "autocast"),
        default=["fsdp"],
        help="the peer's mixed-precision paths, one run each per cell: 'fsdp' (FSDP2 "
        "MixedPrecisionPolicy, a 1-rank mesh on one GPU), 'autocast' (torchtitan's one-device "
        "torch.autocast path; one GPU only). The first listed is the cell's 'peer' (the ratio), "
        "another one 'peer_<path>'; with two, 'ratio_best_peer' is ours / the faster",
    )
    p.add_argument(
        "--peer-oom-ac",
        choices=("off", "selective", "full"),
        default="full",
        help="when the peer runs out of memory at the cell's AC mode and this mode recomputes "
        "more, run "
        "it once more with this mode and report against that run (marked 'AC <mode>' in the "
        "table; the JSON keeps 'ac' and 'oom_at_ac'); 'off' = record the OOM",
    )
    p.add_argument(
        "--peer-sdpa",
        choices=("tt", "flash", "cudnn"),
        default="tt",
        help="the peer's SDPA backends: torchtitan's priority (cuDNN > flash > math) or pin one",
    )
    p.add_argument(
        "--our-mtp",
        choices=("on", "off"),
        default="on",
        help="ours trains the proxy's MTP layer (as its config does); "
        "'off' = no MTP, like the peer",
    )
    p.add_argument(
        "--real-mode",
        action="store_true",
        help="ours trains as a real run does: MTP on and the indexer KL in the sparse stage "
        f"(--dsa.indexer_loss_coeff {REAL_MODE_INDEXER_KL}, before --our-args, which may override "
        "it); 64K joins the default --seq-lens",
    )
    p.add_argument("--config", default="train_configs/glm52_proxy.toml", help="our job config")
    p.add_argument(
        "--our-args", default="", help="extra train.py arguments (e.g. '--model.flavor debug')"
    )
    p.add_argument(
        "--peer-args",
        default="",
        help="extra bench/e2e_tt_dsv3.py arguments (e.g. '--tiny'); a value that starts with '-' "
        "takes the = form: --peer-args='--float8 rowwise'",
    )
    p.add_argument(
        "--out",
        default=os.path.join(ROOT, "bench", "results", "e2e_latest.json"),
        help="JSON results (bench/results/e2e_h200.json holds the current table's cells; see "
        "bench/README.md)",
    )
    p.add_argument("--md", default=None, help="markdown table (default: --out with .md)")
    p.add_argument(
        "--logs",
        default=None,
        help="folder for every subprocess log (default: a temporary one, "
        "copied to $OUT/e2e_logs when $OUT is set)",
    )
    p.add_argument("--cell-timeout", type=float, default=300.0, help="seconds per subprocess")
    p.add_argument(
        "--budget-s", type=float, default=510.0, help="seconds for the whole run (0 = unbounded)"
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="profile one extra step per side and cell (torch.profiler, not timed) and report its "
        "top "
        "GPU kernels (bench/trace_summary.py) in the JSON and printed before the table",
    )
    a = p.parse_args(argv)
    if a.seq_lens is None:
        a.seq_lens = [4096, 16384, 32768] + ([65536] if a.real_mode else [])
    if a.quick:
        a.seq_lens, a.compile, a.ac = [4096, 32768], ["off"], ["selective"]
    if a.steps < 1 or a.warmup < 0 or a.warmup_compiled < 0 or a.batch < 1 or a.nproc < 1:
        p.error("--steps >= 1, --warmup >= 0, --warmup-compiled >= 0, --batch >= 1, --nproc >= 1")
    if a.parallel == "ep" and a.nproc < 2:
        p.error("--parallel ep needs --nproc >= 2 (EP degree = --nproc)")
    if "autocast" in a.peer_mp and a.nproc > 1:
        p.error(
            "--peer-mp autocast is the peer's one-device path: with --nproc > 1 use --peer-mp fsdp"
        )
    if a.real_mode and a.our_mtp == "off":
        p.error("--real-mode trains MTP: leave out --our-mtp off")
    if len(set(a.peer_mp)) != len(a.peer_mp):
        p.error(f"--peer-mp {','.join(a.peer_mp)}: each path once")
    a.md = a.md or os.path.splitext(a.out)[0] + ".md"
    return a


# ---------------------------------------------------------------------------------------------
# subprocesses
class Runner:
    """Runs one command per side and cell, in its own session (so a timeout kills its compile
    workers too), under the run's overall deadline."""

    def __init__(self, logs: str, cell_timeout: float, budget_s: float) -> None:
        self.logs, self.cell_timeout = logs, cell_timeout
        self.deadline = time.monotonic() + budget_s if budget_s > 0 else None
        self.env = dict(
            os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", PYTHONUNBUFFERED="1"
        )
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (ROOT, os.environ.get("PYTHONPATH")) if p
        )

    def run(self, cmd: list[str], name: str) -> dict:
        """{"rc", "wall_s", "log", "timed_out"} or {"skipped": True} when the budget is spent."""
        timeout = self.cell_timeout
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left < 15:  # not even the imports would finish
                return {"skipped": True}
            timeout = min(timeout, left)
        log = os.path.join(self.logs, name + ".log")
        t0 = time.monotonic()
        with open(log, "w") as f:
            f.write("$ " + shlex.join(cmd) + "\n")
            f.flush()
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=self.env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            timed_out = False
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
                rc = proc.wait()
        return {
            "rc": rc,
            "wall_s": time.monotonic() - t0,
            "log": log,
            "timed_out": timed_out,
            "cmd": shlex.join(cmd),
        }


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: str, n: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [ln.rstrip() for ln in f if ln.strip()]
    except OSError:
        return ""
    return "\n".join(lines[-n:])


_OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "out of memory")


def _failure(run: dict, status: str | None = None) -> dict:
    if run.get("skipped"):
        return {"status": "SKIPPED", "error": "time budget spent (--budget-s)"}
    tail = _tail(run["log"])
    if status is None:
        status = (
            "TIMEOUT"
            if run["timed_out"]
            else ("OOM" if any(m in tail for m in _OOM_MARKERS) else "error")
        )
    return {
        "status": status,
        "rc": run["rc"],
        "wall_s": run["wall_s"],
        "log": run["log"],
        "cmd": run["cmd"],
        "stderr_tail": tail,
    }


def launcher(a: argparse.Namespace, script: str) -> list[str]:
    """``python script`` at one GPU, else torchrun with --nproc processes on this host (the same for
    both sides)."""
    if a.nproc == 1:
        return [sys.executable, script]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(a.nproc),
        script,
    ]


def parallel_text(nproc: int, parallel: str) -> str:
    """The GPUs per side and the parallel mode, for the table's header."""
    if nproc == 1:
        return (
            "1 GPU per side (ours: the master weights where training.master_weights puts them, in "
            "the "
            "optimizer with the proxy config; the peer: the --peer-mp paths)"
        )
    if parallel == "fsdp":
        return f"{nproc} GPUs per side, FSDP (dp_shard {nproc})"
    return (
        f"{nproc} GPUs per side, EP {nproc} + FSDP (dp_shard {nproc}; "
        f"routed experts: ep {nproc} x efsdp 1)"
    )


# ----------------------------------------------------------------------------------------- our side
def cell_warmup(a: argparse.Namespace, compile_on: bool) -> int:
    """Untimed steps of a cell (the same on both sides)."""
    return max(a.warmup, a.warmup_compiled) if compile_on else a.warmup


def our_command(
    a: argparse.Namespace, seq_len: int, compile_on: bool, ac: str, dump: str
) -> list[str]:
    total = cell_warmup(a, compile_on) + a.steps + (1 if a.trace else 0)
    cmd = launcher(a, "train.py") + [
        "--job.config_file",
        a.config,
        "--training.steps",
        str(total),
        "--metrics.log_freq",
        "1",
        "--job.dump_folder",
        dump,
        "--training.seq_len",
        str(seq_len),
        "--training.local_batch_size",
        str(a.batch),
        "--activation_checkpoint.mode",
        ac,
        "--activation_checkpoint.selective_ac_option",
        a.sac_option,
        "--data.no-document-masking",
        "--dsa.recall_queries",
        "0",
        "--checkpoint.no-enable",
        "--metrics.no-enable-tensorboard",
    ]
    if compile_on:
        cmd.append("--compile.enable")
    if a.our_mtp == "off":
        cmd.append("--mtp.no-enable")
    if a.nproc > 1:  # EP ranks are carved out of the FSDP ranks: dp_shard stays N
        cmd += ["--parallelism.data_parallel_shard_degree", str(a.nproc)]
        if a.parallel == "ep":
            cmd += ["--parallelism.expert_parallel_degree", str(a.nproc)]
    if a.trace:  # the extra last step runs under the profiler and is left out of the averages
        cmd += [
            "--profiling.enable_profiling",
            "--profiling.save_traces_folder",
            "traces",
            "--profiling.profile_freq",
            str(total),
            "--profiling.profiler_warmup",
            "0",
            "--profiling.profiler_active",
            "1",
        ]
    return cmd + real_mode_args(a) + shlex.split(a.our_args)


def real_mode_args(a: argparse.Namespace) -> list[str]:
    """train.py arguments of ``--real-mode`` (none without it): MTP on and the sparse stage's
    indexer KL, whatever ``--config`` sets."""
    if not a.real_mode:
        return []
    return [
        "--mtp.enable",
        "--dsa.mode",
        "sparse",
        "--dsa.indexer_loss_coeff",
        str(REAL_MODE_INDEXER_KL),
    ]


def our_indexer_kl(a: argparse.Namespace) -> float | None:
    """The indexer KL coefficient ours ran with in the real mode: the last one given, so an
    ``--our-args`` override counts (None without ``--real-mode``: the config's own)."""
    if not a.real_mode:
        return None
    args, value = real_mode_args(a) + shlex.split(a.our_args), None
    for i, arg in enumerate(args):
        if arg.startswith("--dsa.indexer_loss_coeff="):
            value = arg.split("=", 1)[1]
        elif arg == "--dsa.indexer_loss_coeff" and i + 1 < len(args):
            value = args[i + 1]
    return float(value)


def _logged(timed: list[dict], key: str) -> str | None:
    """The name under which every timed step logged memory ``key``: the fullest rank's (the trainer
    all-reduces it) when logged, else rank 0's own; None when not logged."""
    for k in (key + "_max_over_ranks", key):
        if all(k in r for r in timed):
            return k
    return None


def summarize_ours(rows: list[dict], warmup: int, steps: int) -> dict:
    """Averages the trainer's per-step metrics over the steps after the warm-up."""
    timed = [r for r in rows if warmup < r["step"] <= warmup + steps]
    if len(timed) < steps:
        raise ValueError(
            f"metrics.jsonl has {len(timed)} steps after the warm-up, expected {steps}"
        )
    total_s = sum(r["time/step_s"] for r in timed)
    # a step's tokens are a whole number; tok/s x step_s gives it back up to float rounding
    # (63.99999999999999)
    tokens = sum(round(r["throughput/tokens_per_s_per_device"] * r["time/step_s"]) for r in timed)
    out = {
        "status": "ok",
        "step_s": total_s / len(timed),
        "tokens_per_s": tokens / total_s,
        "step_s_median": statistics.median(r["time/step_s"] for r in timed),
        "step_s_max": max(r["time/step_s"] for r in timed),
        "tokens_per_step": tokens / len(timed),
        "data_s": sum(r["time/data_s"] for r in timed) / len(timed),
        "forward_backward_s": sum(r["time/forward_backward_s"] for r in timed) / len(timed),
        "optimizer_s": sum(r["time/optimizer_s"] for r in timed) / len(timed),
        "tflops_per_device": sum(
            r["throughput/tflops_per_device"] * r["time/step_s"] for r in timed
        )
        / total_s,
        "loss_last": timed[-1].get("loss/total"),
        "records": rows,
    }
    if all("throughput/mfu_pct" in r for r in timed):
        out["mfu_pct"] = sum(r["throughput/mfu_pct"] * r["time/step_s"] for r in timed) / total_s
    for key, name in (
        ("memory/peak_allocated_gib", "peak_allocated_gib"),
        ("memory/peak_reserved_gib", "peak_reserved_gib"),
        ("memory/peak_rss_gib", "peak_rss_gib"),
    ):
        k = _logged(timed, key)
        if k:
            out[name] = max(r[k] for r in timed)
    # the caching allocator's retries (cumulative in the log) during the timed steps
    k = _logged(timed, "memory/alloc_retries")
    if k:
        before = [r[k] for r in rows if r["step"] <= warmup and k in r]
        out["alloc_retries"] = timed[-1][k] - (before[-1] if before else 0)
    return out


def run_ours(a, runner: Runner, seq_len: int, compile_on: bool, ac: str, name: str) -> dict:
    dump = tempfile.mkdtemp(prefix=f"e2e_{name}_")
    try:
        run = runner.run(our_command(a, seq_len, compile_on, ac, dump), name)
        if run.get("skipped") or run["rc"] != 0:
            return _failure(run)
        path = os.path.join(dump, "metrics.jsonl")
        try:
            with open(path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            out = summarize_ours(rows, cell_warmup(a, compile_on), a.steps)
        except (OSError, ValueError, KeyError) as e:
            return {**_failure(run, "error"), "error": f"{type(e).__name__}: {e}"}
        out.update(wall_s=run["wall_s"], log=run["log"], cmd=run["cmd"])
        if a.trace:
            traces = glob.glob(os.path.join(dump, "traces", "*", "rank0_trace.json"))
            # the trace is kept beside the logs, as the peer's is (the dump folder is removed below)
            if traces:
                out["trace_summary"] = trace_summary.summarize(traces[0])
                out["trace"] = shutil.copy(
                    traces[0], os.path.join(runner.logs, name + "_trace.json")
                )
            else:
                out["trace_summary"] = {"error": "no trace written"}
        return out
    finally:
        shutil.rmtree(dump, ignore_errors=True)


# ----------------------------------------------------------------------------------------- the peer
def run_peer(
    a, runner: Runner, seq_len: int, compile_on: bool, ac: str, name: str, mp: str = "fsdp"
) -> dict:
    out_json = os.path.join(runner.logs, name + ".json")
    cmd = launcher(a, os.path.join("bench", "e2e_tt_dsv3.py")) + [
        "--seq-len",
        str(seq_len),
        "--batch",
        str(a.batch),
        "--steps",
        str(a.steps),
        "--warmup",
        str(cell_warmup(a, compile_on)),
        "--ac",
        ac,
        "--sac-option",
        a.sac_option,
        "--compile",
        "on" if compile_on else "off",
        "--sdpa",
        a.peer_sdpa,
        "--mp",
        mp,
        "--out",
        out_json,
    ]
    if a.nproc > 1:
        cmd += ["--dp-shard", str(a.nproc), "--ep", str(a.nproc if a.parallel == "ep" else 1)]
    if a.trace:
        cmd += ["--trace", os.path.join(runner.logs, name + "_trace.json")]
    run = runner.run(cmd + shlex.split(a.peer_args), name)
    if run.get("skipped"):
        return _failure(run)
    result = None
    if os.path.exists(out_json):
        try:
            with open(out_json) as f:
                result = json.load(f)
        except ValueError:
            result = None
    if run["rc"] == 0 and result and result.get("status") == "ok":
        result.update(wall_s=run["wall_s"], log=run["log"], cmd=run["cmd"])
        if result.get("trace"):
            result["trace_summary"] = trace_summary.summarize(result.pop("trace"))
        return result
    fail = _failure(run, "OOM" if result and result.get("status") == "OOM" else None)
    if result and result.get("error"):
        fail["error"] = result["error"]
    return fail


AC_ORDER = ("none", "selective", "full")  # less to more recompute


def run_peer_fitting(
    a, runner: Runner, seq_len: int, compile_on: bool, ac: str, name: str, mp: str
) -> dict:
    """``run_peer`` at the cell's AC mode; if that runs out of memory and ``--peer-oom-ac``
    recomputes more, once more at that mode (at 32K the peer fits one H200 only with AC full): the
    result then carries ``ac`` (the mode it ran with) and ``oom_at_ac`` (the cell's)."""
    peer = run_peer(a, runner, seq_len, compile_on, ac, name, mp)
    if (
        peer["status"] != "OOM"
        or a.peer_oom_ac == "off"
        or AC_ORDER.index(a.peer_oom_ac) <= AC_ORDER.index(ac)
    ):
        return peer
    print(f"[e2e]   out of memory at AC {ac}: again with AC {a.peer_oom_ac}", flush=True)
    retry = run_peer(a, runner, seq_len, compile_on, a.peer_oom_ac, f"{name}_ac{a.peer_oom_ac}", mp)
    retry.update(ac=a.peer_oom_ac, oom_at_ac=ac)
    return retry


# ---------------------------------------------------------------------------------------------
# report
def environment() -> dict:
    """GPU name and versions, from a child process (the parent never touches CUDA)."""
    code = (
        "import json, torch\n"
        "try:\n import triton; tv = triton.__version__\nexcept Exception: tv = None\n"
        "try:\n from importlib.metadata import version; tt = version('torchtitan')\nexcept "
        "Exception: tt = None\n"
        "gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'\n"
        "print(json.dumps({'gpu': gpu, 'gpu_count': torch.cuda.device_count(), 'torch': "
        "torch.__version__,"
        " 'cuda': torch.version.cuda, 'triton': tv, 'torchtitan': tt}))\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
        )
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return {"gpu": "unknown"}


def _fmt(side: dict | None, key: str, spec: str) -> str:
    if side is None:
        return "-"
    if side.get("status") != "ok":
        return side.get("status", "?")
    value = side.get(key)
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def _peer_speed(side: dict | None) -> str:
    """The peer's tok/s, marked with the AC mode it ran with when it ran out of memory at the
    cell's."""
    text = _fmt(side, "tokens_per_s", ".0f")
    return (
        f"{text} (AC {side['ac']})"
        if side and side.get("oom_at_ac") and side.get("status") == "ok"
        else text
    )


def median_ratio(ours: dict, peer: dict) -> float:
    """ours / peer tok/s from each side's median timed step: a check on the mean-based ratio, which
    one slow step (a recompile, an allocator stall) on either side moves."""
    return (ours["tokens_per_step"] / ours["step_s_median"]) / (
        peer["tokens_per_step"] / peer["step_s_median"]
    )


def peer_keys(cell: dict) -> list[str]:
    """The cell's peer runs: "peer" (the first ``--peer-mp`` path), then "peer_<path>" for the
    others."""
    return [k for k in cell if k == "peer" or (k.startswith("peer_") and isinstance(cell[k], dict))]


def table_rows(cells: list[dict]) -> tuple[list[str], list[list[str]]]:
    head = [
        "config",
        "ours tok/s",
        "ours MFU %",
        "ours peak GiB",
        "ours data/fwd+bwd/opt s",
        "peer tok/s",
        "peer MFU %",
        "peer peak GiB",
        "ratio ours/peer",
        "ratio of median steps",
    ]
    extra = sorted({k for c in cells for k in peer_keys(c) if k != "peer"})
    head += [f"{k.replace('_', ' ')} tok/s" for k in extra] + (
        ["ratio vs best peer"] if extra else []
    )
    rows = []
    for c in cells:
        o, p = c["ours"], c.get("peer")
        if o.get("status") == "ok":
            breakdown = f"{o['data_s']:.3f}/{o['forward_backward_s']:.3f}/{o['optimizer_s']:.3f}"
        else:
            breakdown = o.get("status", "?")
        ratio = f"{c['ratio']:.2f}" if c.get("ratio") is not None else "-"
        ratio_median = f"{c['ratio_median']:.2f}" if c.get("ratio_median") is not None else "-"
        mem_key = (
            "peak_allocated_gib"
            if "peak_allocated_gib" in o or "peak_rss_gib" not in o
            else "peak_rss_gib"
        )
        rows.append(
            [
                c["config"],
                _fmt(o, "tokens_per_s", ".0f"),
                _fmt(o, "mfu_pct", ".1f"),
                _fmt(o, mem_key, ".1f"),
                breakdown,
                _peer_speed(p),
                _fmt(p, "mfu_pct", ".1f"),
                _fmt(p, "peak_allocated_gib", ".1f"),
                ratio,
                ratio_median,
            ]
            + [_peer_speed(c.get(k)) for k in extra]
            + (
                [f"{c['ratio_best_peer']:.2f}" if c.get("ratio_best_peer") is not None else "-"]
                if extra
                else []
            )
        )
    return head, rows


def text_table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]

    def line(r):
        return "  ".join(
            v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))
        )

    return "\n".join([line(head), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def real_mode_notes(m: dict) -> list[str]:
    """The notes' lines on ours in the real mode (none for a run without it, or an older report):
    what ran and ours' MFU formula, term by term as ``titan_glm52/model/flops.py`` counts it."""
    if not m.get("real_mode"):
        return []
    return [
        f"- ours ran in the real mode (`--real-mode`): MTP on, the DSA sparse stage with the "
        f"indexer KL loss at coefficient {m['our_indexer_loss_coeff']:g} "
        f"(`--dsa.indexer_loss_coeff`).",
        "- ours' MFU in the real mode = 3 F / step time / 989 TFLOP/s (backward = twice the "
        "forward, recomputation not counted), with the forward FLOPs F = 2 [T W + (L + 1) H (2 d_c "
        "+ d_r) P_sel + (L_I + 1) H_I (D_I + 1) (P_vis + P_sel) + (L - L_I) B ((H (d_qk + d_v) - H "
        "(2 d_c + d_r)) k (k + 1) / 2 + k d_c H (d_nope + d_v))]: T = B S tokens; W = the "
        "multiply-adds per token of every weight a token meets (the L = 4 layers' MLA projections "
        "and MLPs, the indexer projections of the L_I + 1 layers with an indexer, the head, and "
        "MTP's eh_proj 2D x D, its MoE layer and the head once more); P_sel = B sum_{t=1..S} "
        "min(k, t) selected and P_vis = B S (S + 1) / 2 visible (query, key) pairs per layer; k = "
        "index_topk = 2048; L_I = the IndexShare full layers (3, FFFS), + 1 for the MTP layer's "
        "block. The terms: the weights; the absorbed sparse attention core (H heads, latent d_c = "
        "512, RoPE d_r = 64) over the selected keys; the indexer's scores (H_I heads of D_I, then "
        "their weighted sum) over the visible keys and, for the KL, its logits once more over the "
        "selected keys; the dense prefix (`[dsa] dense_prefix`, on: each sequence's first k rows "
        "in the plain MLA form, plus their keys' up-projection, on the L - L_I layers without an "
        "indexer; the layers with one run those rows sparse, whose backward forms their KL; every "
        "sequence here is longer than k). Not counted: the KL's target (the attention's "
        "probabilities on those keys, which the attention computes anyway).",
    ]


def peer_float8_notes(cells: list[dict]) -> list[str]:
    """The notes' line on a peer that ran torchtitan's float8 converters (``--peer-args='--float8
    <recipe>'``), once per distinct outcome over the cells' successful peer runs: the recipe, the
    linears in float8 and whether the routed experts' grouped GEMMs were, with why not (none for a
    peer without float8, or an older report)."""
    seen = []
    for c in cells:
        for k in peer_keys(c):
            f8 = c[k].get("float8") if c[k].get("status") == "ok" else None
            if f8 and f8 not in seen:
                seen.append(f8)
    return [
        f"- peer in float8 (`--float8 {f8['recipe']}`, torchtitan's float8 converters): "
        f"{f8['linears']} linears in float8, {f8['linears_kept']} kept (filter_fqns "
        f"{', '.join(f8['filter_fqns'])}); the routed experts' grouped GEMMs "
        + ("in float8." if f8["grouped_experts"] else f"not in float8: {f8['why_not']}.")
        for f8 in seen
    ]


def markdown(report: dict) -> str:
    m, head, rows = report["meta"], *table_rows(report["cells"])
    env = m["environment"]
    nproc, parallel = m.get("nproc", 1), m.get("parallel", "fsdp")  # older reports: one GPU
    gpus = "1 GPU" if nproc == 1 else f"{nproc} GPUs, {parallel.upper()}"
    out = [
        f"# End-to-end training throughput ({gpus}): GLM-5.2 proxy (ours) vs torchtitan 0.2.2 "
        "DeepSeek-V3 (peer)",
        "",
        f"- date: {m['date']}",
        f"- GPU: {env.get('gpu')} (x{env.get('gpu_count')}; {nproc} used per side)",
        f"- parallelism: {parallel_text(nproc, parallel)}"
        + (
            "; both sides under `torch.distributed.run --standalone`, the same degrees"
            if nproc > 1
            else ""
        ),
        f"- torch {env.get('torch')} (CUDA {env.get('cuda')}), triton {env.get('triton')}, "
        f"torchtitan {env.get('torchtitan')}",
        f"- command: `{m['command']}`",
        f"- per cell: {m['warmup']} warm-up ({m.get('warmup_compiled', m['warmup'])} with compile) "
        "+ "
        f"{m['steps']} timed steps, local batch {m['batch']} per rank, "
        f"selective_ac_option {m['sac_option']!r}, our MTP {m['our_mtp']}; "
        f"wall {m['wall_s']:.0f} s",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
    ]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    out += [
        "",
        "Notes:",
        "",
        "- tok/s is per GPU: local tokens per step / mean step time of the timed steps (rank 0's); "
        "ratio = ours / peer tok/s. MFU is per GPU likewise. 'ratio of median steps' uses each "
        "side's median "
        "timed step instead of the mean: where the two differ, one side had a slow step.",
        "- ours: `train.py` with the proxy config (4 layers: 1 dense + 3 MoE, 16 experts top-8 + 1 "
        "shared, "
        "IndexShare FFFS, DSA top-2048, MTP as configured), bf16 compute with fp32 master weights "
        "(on one GPU in "
        "the Triton optimizer, training.master_weights 'auto'; on several FSDP2's "
        "MixedPrecisionPolicy), AdamW "
        "as the config sets it (optimizer.implementation and state_dtype; the proxy config's: "
        "'triton' with its moments in bf16, the peer's fused AdamW keeps fp32 moments), one "
        "sequence per "
        "sample (no document masking). "
        "MFU = the trainer's DSA-aware FLOPs (sparse MLA core over top-k keys, indexer over causal "
        "pairs, "
        "MTP layer and second head pass when MTP is on, the indexer KL's logits over the selected "
        "keys when its coefficient is > 0) / 989 TFLOP/s.",
        *real_mode_notes(m),
        "- peer: torchtitan 0.2.2 `DeepSeekV3Model` at the same widths (no indexer, no MTP), SDPA "
        "causal "
        "attention, GroupedExperts with torch._grouped_mm, its parallelize_deepseekv3 (AC, "
        "per-block compile) "
        "and apply_fsdp (bf16 / fp32 MixedPrecisionPolicy; at one GPU on a 1-rank mesh, or its "
        "torch.autocast "
        "one-device path with --peer-mp autocast; else applied by "
        "parallelize_deepseekv3 over torchtitan's ParallelDims meshes, with its EP when EP > 1), "
        "build_optimizers_with_moe_load_balancing (fused AdamW). "
        "MFU = (6 N_active T + 3 L 2 H (d_qk + d_v) B S(S+1)/2) / step time / 989 TFLOP/s "
        "(dense causal attention; "
        "`mfu_pct_tt` in the JSON uses torchtitan's own full S x S count).",
        *peer_float8_notes(report["cells"]),
        f"- AC 'selective' = activation_checkpoint.selective_ac_option {m['sac_option']!r} on both "
        "sides "
        "(an integer N: every N-th block fully recomputed; 'op': each side's own per-op policy). "
        "Compile = "
        "per-block torch.compile on both sides (routed experts' dispatch eager; the loss eager).",
        f"- peer SDPA backends: {m['peer_sdpa']} ('tt' = torchtitan's priority cuDNN > flash > "
        "math).",
        f"- peer mixed-precision paths: {', '.join(m.get('peer_mp', ['fsdp']))} (the first is "
        "'peer tok/s' and "
        "the ratio; 'fsdp' = FSDP2 MixedPrecisionPolicy, 'autocast' = torchtitan's one-device "
        "torch.autocast "
        "path; 'ratio vs best peer' = ours / the faster).",
        (
            "- ours trains MTP (one more MoE layer and a second pass through the 154,880-row head: "
            "about +50% "
            "FLOPs per token at 4K) and the peer has none, so the tok/s ratio understates ours; "
            + (
                "`--our-mtp off` without `--real-mode` compares like for like."
                if m.get("real_mode")
                else "`--our-mtp off` compares like for like."
            )
            if m["our_mtp"] == "on"
            else "- ours runs without MTP (`--our-mtp off`), like the peer; ours still runs the "
            "DSA indexer."
        ),
        "- peak GiB: the largest per-step torch.cuda.max_memory_allocated of the timed steps"
        + (", max over ranks." if nproc > 1 else "."),
        "- OOM / error / TIMEOUT / SKIPPED: that cell failed or did not run; the JSON holds the "
        "last log lines.",
        f"- a peer tok/s marked '(AC <mode>)': the peer ran out of memory at the cell's AC mode "
        "and ran again with "
        f"that one (`--peer-oom-ac {m.get('peer_oom_ac', 'off')}`); the ratio is against that run.",
    ]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    t_start = time.monotonic()
    logs = a.logs or tempfile.mkdtemp(prefix="e2e_logs_")
    os.makedirs(logs, exist_ok=True)
    runner = Runner(logs, a.cell_timeout, a.budget_s)
    env = environment()
    print(f"[e2e] {env}; logs in {logs}", flush=True)
    if env.get("gpu") not in ("cpu", "unknown") and env.get("gpu_count", 0) < a.nproc:
        print(f"[e2e] --nproc {a.nproc} but this host has {env.get('gpu_count')} GPUs", flush=True)
        return 2
    print(f"[e2e] {parallel_text(a.nproc, a.parallel)}", flush=True)
    cells = []
    for compile_flag in a.compile:
        for ac in a.ac:
            for seq_len in a.seq_lens:
                compile_on = compile_flag == "on"
                config = f"S={seq_len} compile={compile_flag} ac={ac}"
                tag = f"s{seq_len}_c{compile_flag}_{ac}"
                print(f"[e2e] {config}: ours ...", flush=True)
                ours = run_ours(a, runner, seq_len, compile_on, ac, "ours_" + tag)
                ok = ours["status"] == "ok"
                print(
                    f"[e2e]   ours {ours['status']}"
                    + (f" {ours['tokens_per_s']:.0f} tok/s" if ok else "")
                    + (
                        f", {ours['alloc_retries']:.0f} alloc retries"
                        if ok and ours.get("alloc_retries")
                        else ""
                    ),
                    flush=True,
                )
                cell = {
                    "config": config,
                    "seq_len": seq_len,
                    "compile": compile_flag,
                    "ac": ac,
                    "ours": ours,
                }
                for i, mp in enumerate(a.peer_mp if a.peer else []):
                    key = "peer" if i == 0 else f"peer_{mp}"
                    print(f"[e2e] {config}: {key} ({mp}) ...", flush=True)
                    peer = run_peer_fitting(a, runner, seq_len, compile_on, ac, key + "_" + tag, mp)
                    print(
                        f"[e2e]   {key} {peer['status']}"
                        + (f" {peer['tokens_per_s']:.0f} tok/s" if peer["status"] == "ok" else ""),
                        flush=True,
                    )
                    cell[key] = peer
                    if key == "peer" and ours["status"] == "ok" and peer["status"] == "ok":
                        cell["ratio"] = ours["tokens_per_s"] / peer["tokens_per_s"]
                        cell["ratio_median"] = median_ratio(ours, peer)
                fast = [
                    cell[k]["tokens_per_s"] for k in peer_keys(cell) if cell[k]["status"] == "ok"
                ]
                if len(a.peer_mp) > 1 and a.peer and ours["status"] == "ok" and fast:
                    cell["ratio_best_peer"] = ours["tokens_per_s"] / max(fast)
                cells.append(cell)
    report = {
        "meta": {
            "command": shlex.join(["python3", "bench/e2e.py", *argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "environment": env,
            "nproc": a.nproc,
            "parallel": a.parallel,
            "steps": a.steps,
            "warmup": a.warmup,
            "warmup_compiled": cell_warmup(a, True),
            "batch": a.batch,
            "sac_option": a.sac_option,
            "our_mtp": a.our_mtp,
            "real_mode": a.real_mode,
            "our_indexer_loss_coeff": our_indexer_kl(a),
            "peer_sdpa": a.peer_sdpa,
            "peer_mp": a.peer_mp,
            "peer_oom_ac": a.peer_oom_ac,
            "config": a.config,
            "peak_bf16_tflops": PEAK_BF16_TFLOPS,
            "wall_s": time.monotonic() - t_start,
        },
        "cells": cells,
    }
    for path, text in ((a.out, json.dumps(report, indent=1) + "\n"), (a.md, markdown(report))):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        for path in (a.out, a.md):
            dst = os.path.join(os.environ["OUT"], os.path.basename(path))
            if not os.path.exists(dst) or not os.path.samefile(path, dst):
                shutil.copy(path, dst)
        if not a.logs:
            shutil.copytree(logs, os.path.join(os.environ["OUT"], "e2e_logs"), dirs_exist_ok=True)
    for c in cells:
        for side in ("ours", *peer_keys(c)):
            s = c.get(side)
            if s and s.get("status") not in ("ok", None):
                print(
                    f"[e2e] {c['config']} {side}: {s['status']} "
                    f"{s.get('error', '')}\n{s.get('stderr_tail', '')}\n",
                    flush=True,
                )
    for c in cells:
        for side in ("ours", *peer_keys(c)):
            s = (c.get(side) or {}).get("trace_summary")
            if s and "kernels" in s:
                print(trace_summary.text(s, f"[trace] {c['config']} {side}:"), flush=True)
    print(f"[e2e] wrote {a.out} and {a.md}\n", flush=True)
    print(f"{parallel_text(a.nproc, a.parallel)}:", flush=True)
    print(text_table(*table_rows(cells)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
