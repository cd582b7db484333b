"""Host-to-device copies that do not make the host wait for the GPU.

A pageable host-to-device copy waits for the stream; a pinned one does not. The trainer, the model
and the pipeline stages send small host-made tensors (document bounds, token counts, flags) every
step this way, so that the host keeps queuing work ahead of the GPU.
"""

from __future__ import annotations

import torch


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a host sync (pinned first on CUDA)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def host_ints(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 ``values`` on ``device`` without a host sync."""
    return host_to_device(torch.tensor(values, dtype=torch.int64), device)
