"""Training metrics: the device's peak FLOP/s behind MFU, peak memory, and the console + TensorBoard
logger.

MFU = training FLOPs per device (``model/flops.py``, the one FLOP model; a data-parallel rank's
tokens and FLOPs are divided by the devices that share them, its pipeline stages, as torchtitan
does) / step time / the device's dense bf16 peak.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time

import torch


logger = logging.getLogger("titan_glm52")

# Dense bf16 tensor-core peaks (FLOP/s) by device-name fragment.
PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "B200": 2250e12,
    "GB200": 2500e12,
}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16.items():
        if key in name:
            return value
    return None


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak memory in GiB since the last reset (device memory on CUDA, process RSS on CPU); on CUDA
    also the caching allocator's retries since the start: each is a ``cudaMalloc`` that failed, so
    the allocator freed its cached blocks (a device-wide sync) and tried again. A count that grows
    means the run is near the device's capacity and losing speed to it."""
    if device.type == "cuda":
        return {
            "memory/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "memory/peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
            "memory/alloc_retries": float(
                torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
            ),
        }
    return {"memory/peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


class MetricsLogger:
    """One console line per log step, TensorBoard scalars (``tb_folder``) and the same scalars as
    JSON lines (``jsonl_path``, one object per log step); written by one rank only."""

    def __init__(self, tb_folder: str | None, jsonl_path: str | None, enabled: bool) -> None:
        self.writer = None
        self.jsonl = None
        self.enabled = enabled
        if enabled and tb_folder:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(tb_folder, exist_ok=True)
            self.writer = SummaryWriter(tb_folder)
        if enabled and jsonl_path:
            os.makedirs(os.path.dirname(jsonl_path) or ".", exist_ok=True)
            self.jsonl = open(jsonl_path, "a")

    def log(self, step: int, scalars: dict[str, float], line: str) -> None:
        if not self.enabled:
            return
        logger.info(line)
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
            self.jsonl.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()


def format_line(step: int, total_steps: int, s: dict[str, float], eta_s: float) -> str:
    parts = [f"step {step:>5}/{total_steps}", f"loss {s['loss/total']:.4f}"]
    for key, short in (
        ("loss/ce", "ce"),
        ("loss/mtp", "mtp"),
        ("loss/indexer_kl", "kl"),
        ("loss/moe_aux", "aux"),
    ):
        if key in s:
            parts.append(f"{short} {s[key]:.4f}")
    parts += [
        f"lr {s['lr']:.2e}",
        f"gnorm {s['grad_norm']:.3f}",
        f"tok/s/gpu {s['throughput/tokens_per_s_per_device']:.0f}",
    ]
    if "throughput/mfu_pct" in s:
        parts.append(f"mfu {s['throughput/mfu_pct']:.1f}%")
    mem = s.get("memory/peak_allocated_gib", s.get("memory/peak_rss_gib"))
    if mem is not None:
        parts.append(f"mem {mem:.2f}GiB")
    if s.get("memory/alloc_retries", 0):
        parts.append(f"alloc retries {int(s['memory/alloc_retries'])}")
    if s.get("faults/skipped_steps", 0):
        parts.append(f"skipped {int(s['faults/skipped_steps'])}")
    parts.append(f"eta {time.strftime('%H:%M:%S', time.gmtime(max(eta_s, 0)))}")
    return "  ".join(parts)
