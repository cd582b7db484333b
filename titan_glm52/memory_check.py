"""The trainer's start-up memory check (``training.memory_check``).

On CUDA the first process of each node plans the job's peak memory per GPU (the ``plan memory``
tool's estimate: a fake process group, the model on the meta device; a few seconds) and logs it
beside the GPU's size, as a warning where the plan exceeds it. The planner is imported only here,
and only on CUDA.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("titan_glm52")


def log_memory_check(cfg) -> None:
    """Logs the planned peak memory per GPU of job ``cfg`` (a warning where it exceeds the GPU;
    never an error: a job the plan cannot model still trains)."""
    if not torch.cuda.is_available() or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    from titan_glm52.memory_estimate import GIB, job_memory_check

    gib = torch.cuda.get_device_properties(0).total_memory / GIB
    try:
        fits, line = job_memory_check(cfg, int(os.environ.get("WORLD_SIZE", "1")), gib)
    except Exception as e:  # a job the plan cannot model must still train: say why, and go on
        logger.warning(
            "memory plan: not available for this job (%s: %s); training.memory_check = false skips "
            "it",
            type(e).__name__,
            e,
        )
        return
    (logger.info if fits else logger.warning)(line)
