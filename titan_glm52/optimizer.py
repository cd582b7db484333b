"""Adam / AdamW whose step is this project's Triton kernel (``optimizer.implementation = "triton"``).

They are ``torch.optim.Adam`` / ``AdamW`` in everything but ``step()``: the same constructor, parameter groups,
state (``step`` as a device fp32 counter, ``exp_avg``, ``exp_avg_sq`` shaped like the parameter) and state dict, so
checkpoints move freely between them and torch's fused optimizers. The step

* runs one kernel per parameter on the local tensors (a DTensor's shard), largest first, so the GPU starts on the
  big tensors while the host launches the rest, and no DTensor dispatch runs per parameter. Each launch costs the
  host 40-100 us: with many small tensors the step is host-bound (the debug flavor on an H200: 10.9 ms against
  0.7 ms for torch's fused kernel), with large ones the launches hide behind the GPU work (the proxy: 38 ms
  against 54);
* moves 28 bytes per fp32 parameter (torch's fused kernel moves 32 when it clips, writing the gradient back);
* with ``master_weights`` set (``training.master_weights = "optimizer"``: one process, no FSDP) reads each
  gradient from the parameter's bf16 compute copy and writes that copy from the updated fp32 master in the same
  pass (28 bytes per parameter as before: the bf16 gradient read is 2 bytes, the copy written 2; 30 with gradient
  accumulation, whose sum is fp32);
* takes the gradient clip as a multiplier (``grad_coef``) and a skip flag (``found_inf``), both device scalars,
  set for one step by ``parallelize.clip_in_fused_step``: clipping and skipping a non-finite step need no host
  sync. The gradients are read, never written: after the step they are the unclipped ones.

Unsupported options (amsgrad, maximize, differentiable, capturable, fused, a tensor lr) are refused by name.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class _TritonAdamStep:
    """The shared ``step`` of ``TritonAdam`` and ``TritonAdamW``."""

    _decoupled = False
    _default_weight_decay = 0.0

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float | None = None, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None) -> None:
        name = type(self).__name__
        for option, value in (("amsgrad", amsgrad), ("maximize", maximize), ("capturable", capturable),
                              ("differentiable", differentiable), ("fused", fused), ("foreach", foreach)):
            if value:
                raise ValueError(f"{name} does not support {option}=True; use torch.optim.{name[6:]} "
                                 "(optimizer.implementation = 'fused' or 'foreach') for it")
        if isinstance(lr, torch.Tensor) or any(isinstance(b, torch.Tensor) for b in betas):
            raise ValueError(f"{name} takes lr and betas as floats")
        if weight_decay is None:  # torch's default of each class
            weight_decay = self._default_weight_decay
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
        self.grad_coef: torch.Tensor | None = None
        self.found_inf: torch.Tensor | None = None
        # ``master_weights.MasterWeights`` when the parameters are fp32 masters of bf16 compute weights: the
        # gradients are read from the compute weights, which the kernel rewrites from the updated masters.
        self.master_weights = None

    @torch.no_grad()
    def step(self, closure=None):
        from titan_glm52.kernels.adam import adam_step_  # imports triton; only once a step runs

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        steps_by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        work = []
        for group in self.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                raise ValueError(f"{type(self).__name__}: parameter group lr must be a float, got a tensor")
            hyper = dict(lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                         weight_decay=group["weight_decay"], decoupled=self._decoupled)
            for p in group["params"]:
                slot = self.master_weights.slot(p) if self.master_weights is not None else None
                # A gradient on the master itself comes first: torch's state-dict loading initialises the state
                # with zero gradients there and an lr-0 step (torch.distributed.checkpoint.state_dict).
                grad = p.grad if p.grad is not None or slot is None else slot.grad
                if grad is None:
                    continue
                if grad.is_sparse or torch.is_complex(p):
                    raise ValueError(f"{type(self).__name__}: sparse gradients and complex parameters are not "
                                     "supported")
                local = _local(p)
                state = self.state[p]
                if not state:  # torch's fused layout, so state dicts are interchangeable
                    state["step"] = torch.zeros((), dtype=torch.float32, device=local.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif state["step"].device != local.device or state["step"].dtype != torch.float32:
                    # a state dict from the for-loop / foreach optimizers keeps the count on the CPU
                    state["step"] = state["step"].to(device=local.device, dtype=torch.float32)
                steps_by_device[local.device].append(state["step"])
                work.append((local, _local(grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                             state["step"], None if slot is None else slot.compute, hyper))
        skip = {}
        for device, steps in steps_by_device.items():
            torch._foreach_add_(steps, 1)
            if self.found_inf is not None:
                skip[device] = self.found_inf.detach().to(device=device, dtype=torch.float32,
                                                          non_blocking=True).reshape(())
                torch._foreach_sub_(steps, [skip[device]] * len(steps))
        coef = {}
        for local, grad, exp_avg, exp_avg_sq, step, copy_to, hyper in sorted(work, key=lambda w: -w[0].numel()):
            dev = local.device
            if self.grad_coef is not None and dev not in coef:
                coef[dev] = self.grad_coef.detach().to(device=dev, dtype=torch.float32, non_blocking=True)
            adam_step_(local, grad, exp_avg, exp_avg_sq, step, grad_coef=coef.get(dev),
                       skip=skip.get(dev), copy_to=copy_to, **hyper)
        return loss


class TritonAdam(_TritonAdamStep, torch.optim.Adam):
    """``torch.optim.Adam`` (L2 weight decay added to the gradient) stepped by the Triton kernel."""


class TritonAdamW(_TritonAdamStep, torch.optim.AdamW):
    """``torch.optim.AdamW`` (decoupled weight decay) stepped by the Triton kernel."""

    _decoupled = True
    _default_weight_decay = 1e-2


__all__ = ["TritonAdam", "TritonAdamW"]
