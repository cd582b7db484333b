"""One training step's pieces that are not the model: its labels, loss terms, and numbers read back.

* ``mtp_labels``: the MTP head's labels from the main ones;
* ``StepLosses``: the step's loss terms by name, on the device, summed over micro-batches and ranks;
* ``Readback``: device scalars copied to the host behind the work that makes them, read without a
  stall;
* ``GpuMarks``: CUDA events that time a step's forward + backward and its update as the GPU ran
  them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_glm52.data import IGNORE_INDEX


def mtp_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels of the MTP head: position i predicts token i + 2, valid when i -> i+1 -> i+2 stay in
    one document."""
    nxt = torch.cat((labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)), dim=1)
    return torch.where(labels == IGNORE_INDEX, torch.full_like(nxt, IGNORE_INDEX), nxt)


@dataclass
class StepLosses:
    """A step's loss terms as added to the loss, fp64 device scalars summed over its micro-batches
    (and, after ``all_reduce``, over ranks).

    Attributes:
        ce: the cross-entropy over the global valid tokens.
        mtp: ``mtp.loss_weight`` x the MTP cross-entropy over the global valid MTP tokens.
        indexer_kl: ``dsa.indexer_loss_coeff`` x the indexer KL over the global valid tokens.
        moe_aux: ``moe.seq_aux_loss_coeff`` x the sequence balance loss over the global sequences.
        kl_per_token: the indexer KL over the global valid tokens (summed over indexer layers; a
            metric).
        total: the loss whose gradient the step applies (non-finite where the step must be skipped).
    """

    ce: torch.Tensor
    mtp: torch.Tensor
    indexer_kl: torch.Tensor
    moe_aux: torch.Tensor
    kl_per_token: torch.Tensor
    total: torch.Tensor

    @classmethod
    def zeros(cls, device: torch.device) -> StepLosses:
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(*torch.zeros(len(names), dtype=torch.float64, device=device).unbind())

    def all_reduce(self, group, names: tuple[str, ...] | None = None) -> None:
        """Sums the terms ``names`` (default: all) over ``group``, in one collective."""
        names = names or tuple(f.name for f in dataclasses.fields(self))
        flat = torch.stack([getattr(self, n) for n in names])
        dist.all_reduce(flat, group=group)
        for n, v in zip(names, flat.unbind()):
            setattr(self, n, v)

    def scalars(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class Readback:
    """Device scalars read by the host without stalling it: one copy into pinned host memory, queued
    behind the work that produces them, and an event after it. ``values()`` waits for that event
    only, not for work queued later (the next step's forward and backward). On CPU the values are
    read at once."""

    def __init__(self, scalars: dict[str, torch.Tensor], device: torch.device) -> None:
        self.names = list(scalars)
        flat = torch.cat(
            [v.detach().reshape(1).to(device, torch.float64) for v in scalars.values()]
        )
        self.event = None
        if device.type == "cuda":
            self.host = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
            self.host.copy_(flat, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = flat.cpu()

    def values(self) -> dict[str, float]:
        if self.event is not None:
            self.event.synchronize()
        return dict(zip(self.names, self.host.tolist()))


class GpuMarks:
    """CUDA events at the start of forward, the end of backward and the end of the optimizer step:
    the step's forward+backward and optimizer times as the GPU ran them. Elsewhere (CPU)
    ``seconds()`` is None and host times are exact."""

    def __init__(self, device: torch.device) -> None:
        self.events = []
        if device.type == "cuda":
            self.events = [torch.cuda.Event(enable_timing=True)]
            self.events[0].record()

    def record(self) -> None:
        if self.events:
            self.events.append(torch.cuda.Event(enable_timing=True))
            self.events[-1].record()

    def wait(self) -> None:
        """Blocks the host until the GPU has run everything up to the last mark."""
        if self.events:
            self.events[-1].synchronize()

    def seconds(self) -> tuple[float, float] | None:
        if len(self.events) != 3:
            return None
        self.wait()
        return (
            self.events[0].elapsed_time(self.events[1]) / 1e3,
            self.events[1].elapsed_time(self.events[2]) / 1e3,
        )

    def since(self, earlier: GpuMarks) -> float | None:
        """GPU seconds from ``earlier``'s last mark to this one's last (None on CPU)."""
        if not (self.events and earlier.events):
            return None
        self.wait()
        return earlier.events[-1].elapsed_time(self.events[-1]) / 1e3


@dataclass
class Launched:
    """A step whose work is queued on the device. Its host-side bookkeeping (``Trainer._finish``:
    counters, LR schedule, logging, checkpoint) waits for its numbers; when it ``overlaps``, that
    happens after the next step's forward and backward are queued, so the GPU finds the next step's
    work queued when this one ends."""

    step: int
    batches: list[dict]
    readback: Readback
    marks: GpuMarks
    # the step queued just before this one, still unfinished when this one was launched
    after: GpuMarks | None
    overlaps: bool
    log: bool
    memory: dict[str, float]
    t0: float
    t_data: float
    t_fb: float
    t_end: float = 0.0  # host time when the launch ended
    host_other_s: float = 0.0  # host time in this launch spent finishing the step before
