"""bf16 compute weights with fp32 master weights on one process, without FSDP
(``training.master_weights = "optimizer"``).

On one GPU the default path wraps the model in FSDP2 on a one-rank mesh with a bf16
``MixedPrecisionPolicy``: the fp32 parameters are the masters, and every step FSDP casts them to
bf16 and copies them into its all-gather buffers and out again, then copies and casts every bf16
gradient to an fp32 one (about 30 bytes per parameter; 37 ms of the proxy's 256 ms step on an H200).
Here the model keeps a second, bf16 copy of every parameter (its *compute* weights) and trains on
those; the optimizer (``TritonAdam`` / ``TritonAdamW``) reads their bf16 gradients, updates the fp32
masters and writes the rounded result into the compute weights in the same pass.

The arithmetic is the FSDP path's on one rank: the compute weights are the masters rounded to bf16
(round to nearest even), the gradients are the bf16 gradients of those weights, widened exactly, and
with gradient accumulation they are summed in fp32 one micro-batch at a time (a post-accumulate hook
per parameter), as FSDP sums its fp32 reduce-scatter outputs. Training is bitwise the same
(tests/e2e, CPU), except where autograd sums several bf16 gradients into one tensor: FSDP's hooks
can change that order (with MTP, at the embedding output).

Like FSDP2's sharded and unsharded parameters, the module attributes are swapped: between steps the
modules hold the fp32 masters, so ``state_dict``, checkpoints, the HF export and the optimizer's
state see only them. During a step's forward and backward (activation recompute included) they hold
the compute weights. A master changed by anything other than the Triton step (a checkpoint load, an
in-place edit) is re-cast before the next forward; its version counter tells.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(eq=False)
class _Slot:
    master: nn.Parameter
    compute: nn.Parameter
    places: list[tuple[nn.Module, str]] = field(default_factory=list)
    version: int = -1  # the master's version counter when last cast
    # fp32 sum of the micro-batches' gradients (accumulation only)
    main_grad: torch.Tensor | None = None

    @property
    def grad(self) -> torch.Tensor | None:
        return self.main_grad if self.main_grad is not None else self.compute.grad


class MasterWeights:
    """The compute weights of ``modules``' parameters (each parameter once, also where modules share
    it); a frozen parameter already in ``dtype`` is left as it is (no master, no copy).

    ``accumulate``: sum the gradients of several backward passes per step in fp32 (gradient
    accumulation); without it each step has one backward and the optimizer reads the bf16 gradients
    directly.
    """

    def __init__(
        self,
        modules: Iterable[nn.Module],
        dtype: torch.dtype = torch.bfloat16,
        accumulate: bool = False,
    ) -> None:
        self._slots: dict[nn.Parameter, _Slot] = {}
        for root in modules:
            for module in root.modules():
                for name, p in module._parameters.items():
                    if p is None:
                        continue
                    if not p.requires_grad and p.dtype == dtype:
                        # Frozen and already in the compute dtype (LoRA's base weights): it needs
                        # no master, and the modules use it as it is.
                        continue
                    if p.dtype != torch.float32:
                        raise ValueError(
                            f"master weights are fp32; {type(module).__name__}.{name} is {p.dtype}"
                        )
                    slot = self._slots.get(p)
                    if slot is None:
                        compute = nn.Parameter(
                            torch.empty_like(p, dtype=dtype), requires_grad=p.requires_grad
                        )
                        slot = self._slots[p] = _Slot(p, compute)
                        if accumulate and p.requires_grad:
                            compute.register_post_accumulate_grad_hook(self._hook(slot))
                    slot.places.append((module, name))
        self._computing = False
        self.refresh()

    @staticmethod
    def _hook(slot: _Slot):
        def accumulate(compute: nn.Parameter) -> None:
            with torch.no_grad():
                if slot.main_grad is None:
                    slot.main_grad = compute.grad.to(torch.float32)
                else:
                    slot.main_grad.add_(compute.grad)
            compute.grad = None

        return accumulate

    def slot(self, master: torch.Tensor) -> _Slot | None:
        return self._slots.get(master)

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-casts every master whose version counter moved since its last cast (all of them the
        first time)."""
        for s in self._slots.values():
            if s.master._version != s.version:
                s.compute.copy_(s.master)
                s.version = s.master._version

    def _place(self, compute: bool) -> None:
        for s in self._slots.values():
            p = s.compute if compute else s.master
            for module, name in s.places:
                module._parameters[name] = p
        self._computing = compute

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """The modules hold the compute weights inside (forward and backward of one step), the
        masters after."""
        if self._computing:
            raise RuntimeError("MasterWeights.computing() is not reentrant")
        self.refresh()
        self._place(compute=True)
        try:
            yield
        finally:
            self._place(compute=False)

    def grads(self) -> list[torch.Tensor]:
        """This step's gradients (bf16, or fp32 when accumulating), one per parameter that has
        one."""
        return [g for g in (s.grad for s in self._slots.values()) if g is not None]

    def zero_grad(self) -> None:
        for s in self._slots.values():
            s.compute.grad = None
            s.main_grad = None


__all__ = ["MasterWeights"]
