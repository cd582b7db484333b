"""Profiler traces and CUDA memory snapshots on request (torchtitan's ``[profiling]`` options), on
CPU and GPU.

Traces: every ``profile_freq`` steps a ``torch.profiler`` window of ``profiler_warmup`` +
``profiler_active`` steps is recorded (CPU activity, plus CUDA on GPUs) and written as a Chrome
trace to ``<dump_folder>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json``. Memory
snapshots (CUDA only) record the allocator history from the start and dump
``<dump_folder>/<save_memory_snapshot_folder>/iteration_<step>/ rank<r>_memory_snapshot.pickle``
every ``profile_freq`` steps (open them at pytorch.org/memory_viz).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle

import torch

logger = logging.getLogger("titan_glm52")


class _Profiler:
    def __init__(self, cfg, folder: str, rank: int, device: torch.device, start_step: int) -> None:
        self.folder, self.rank, self.step_no = folder, rank, start_step
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        wait = cfg.profile_freq - cfg.profiler_warmup - cfg.profiler_active
        self.prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=wait, warmup=cfg.profiler_warmup, active=cfg.profiler_active
            ),
            on_trace_ready=self._save,
            record_shapes=True,
        )

    def _save(self, prof) -> None:
        out = os.path.join(self.folder, f"iteration_{self.step_no}")
        os.makedirs(out, exist_ok=True)
        prof.export_chrome_trace(os.path.join(out, f"rank{self.rank}_trace.json"))
        logger.info("profiler trace written to %s", out)

    def step(self) -> None:
        self.step_no += 1
        self.prof.step()


class _MemorySnapshot:
    def __init__(self, cfg, folder: str, rank: int, start_step: int) -> None:
        self.folder, self.rank, self.freq, self.step_no = folder, rank, cfg.profile_freq, start_step
        torch.cuda.memory._record_memory_history(max_entries=100000)

    def step(self) -> None:
        self.step_no += 1
        if self.step_no % self.freq == 0:
            out = os.path.join(self.folder, f"iteration_{self.step_no}")
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, f"rank{self.rank}_memory_snapshot.pickle"), "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)


@contextlib.contextmanager
def profiling(cfg, dump_folder: str, rank: int, device: torch.device, start_step: int):
    """Yields (profiler or None, memory snapshotter or None); each has ``step()`` to call once per
    step."""
    prof = snap = None
    if cfg.enable_profiling:
        if cfg.profile_freq < cfg.profiler_warmup + cfg.profiler_active:
            raise ValueError("profiling.profile_freq must be >= profiler_warmup + profiler_active")
        prof = _Profiler(
            cfg, os.path.join(dump_folder, cfg.save_traces_folder), rank, device, start_step
        )
    if cfg.enable_memory_snapshot:
        if device.type != "cuda":
            raise ValueError(
                "profiling.enable_memory_snapshot records the CUDA allocator; it needs a GPU"
            )
        snap = _MemorySnapshot(
            cfg, os.path.join(dump_folder, cfg.save_memory_snapshot_folder), rank, start_step
        )
    try:
        if prof is not None:
            prof.prof.__enter__()
        yield prof, snap
    finally:
        if prof is not None:
            prof.prof.__exit__(None, None, None)
        if snap is not None:
            torch.cuda.memory._record_memory_history(enabled=None)
