"""Adam / AdamW whose step is this project's Triton kernel (``optimizer.implementation =
"triton"``).

They are ``torch.optim.Adam`` / ``AdamW`` in everything but ``step()``: the same constructor,
parameter groups, state (``step`` as a device fp32 counter, ``exp_avg``, ``exp_avg_sq`` shaped like
the parameter) and state dict, so checkpoints move freely between them and torch's fused optimizers.
The step

* runs one kernel per parameter on the local tensors (a DTensor's shard), largest first, so the GPU
  starts on the big tensors while the host launches the rest, and no DTensor dispatch runs per
  parameter. Each launch costs the host 40-100 us: with many small tensors the step is host-bound
  (the debug flavor on an H200: 10.9 ms against 0.7 ms for torch's fused kernel), with large ones
  the launches hide behind the GPU work (the proxy: 38 ms against 54);
* moves 28 bytes per fp32 parameter (torch's fused kernel moves 32 when it clips, writing the
  gradient back);
* with ``master_weights`` set (``training.master_weights = "optimizer"``: one process, no FSDP)
  reads each gradient from the parameter's bf16 compute copy and writes that copy from the updated
  fp32 master in the same pass (28 bytes per parameter as before: the bf16 gradient read is 2 bytes,
  the copy written 2; 30 with gradient accumulation, whose sum is fp32);
* takes the gradient clip as a multiplier (``grad_coef``) and a skip flag (``found_inf``), both
  device scalars, set for one step by ``clip_in_fused_step``: clipping and skipping a non-finite
  step need no host sync. The gradients are read, never written: after the step they are the
  unclipped ones.

Unsupported options (amsgrad, maximize, differentiable, capturable, fused, a tensor lr) are refused
by name.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class _TritonAdamStep:
    """The shared ``step`` of ``TritonAdam`` and ``TritonAdamW``."""

    _decoupled = False
    _default_weight_decay = 0.0

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float | None = None,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        name = type(self).__name__
        for option, value in (
            ("amsgrad", amsgrad),
            ("maximize", maximize),
            ("capturable", capturable),
            ("differentiable", differentiable),
            ("fused", fused),
            ("foreach", foreach),
        ):
            if value:
                raise ValueError(
                    f"{name} does not support {option}=True; use torch.optim.{name[6:]} "
                    "(optimizer.implementation = 'fused' or 'foreach') for it"
                )
        if isinstance(lr, torch.Tensor) or any(isinstance(b, torch.Tensor) for b in betas):
            raise ValueError(f"{name} takes lr and betas as floats")
        if weight_decay is None:  # torch's default of each class
            weight_decay = self._default_weight_decay
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False
        )
        # Adam's moments in this dtype (``[optimizer] state_dtype`` "bfloat16"; set by
        # build_optimizers before the first step), or None: the parameter's, as torch keeps them
        self.state_dtype: torch.dtype | None = None
        self.grad_coef: torch.Tensor | None = None
        self.found_inf: torch.Tensor | None = None
        # ``master_weights.MasterWeights`` when the parameters are fp32 masters of bf16 compute
        # weights: the gradients are read from the compute weights, which the kernel rewrites from
        # the updated masters.
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
                raise ValueError(
                    f"{type(self).__name__}: parameter group lr must be a float, got a tensor"
                )
            hyper = dict(
                lr=group["lr"],
                beta1=group["betas"][0],
                beta2=group["betas"][1],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                decoupled=self._decoupled,
            )
            for p in group["params"]:
                slot = self.master_weights.slot(p) if self.master_weights is not None else None
                # A gradient on the master itself comes first: torch's state-dict loading
                # initialises the state with zero gradients there and an lr-0 step
                # (torch.distributed.checkpoint.state_dict).
                grad = p.grad if p.grad is not None or slot is None else slot.grad
                if grad is None:
                    continue
                if grad.is_sparse or torch.is_complex(p):
                    raise ValueError(
                        f"{type(self).__name__}: sparse gradients and complex parameters are not "
                        "supported"
                    )
                local = _local(p)
                state = self.state[p]
                if not state:  # torch's fused layout, so state dicts are interchangeable
                    state["step"] = torch.zeros((), dtype=torch.float32, device=local.device)
                    for key in ("exp_avg", "exp_avg_sq"):
                        state[key] = torch.zeros_like(
                            p,
                            dtype=self.state_dtype or p.dtype,
                            memory_format=torch.preserve_format,
                        )
                else:
                    if state["step"].device != local.device or state["step"].dtype != torch.float32:
                        # a state dict from the for-loop / foreach optimizers keeps the count on
                        # the CPU
                        state["step"] = state["step"].to(device=local.device, dtype=torch.float32)
                    for key in ("exp_avg", "exp_avg_sq"):
                        # torch's load_state_dict casts the moments to the parameter's dtype, and
                        # a checkpoint may come from a run with the other state_dtype
                        if self.state_dtype not in (None, state[key].dtype):
                            state[key] = state[key].to(self.state_dtype)
                steps_by_device[local.device].append(state["step"])
                work.append(
                    (
                        local,
                        _local(grad),
                        _local(state["exp_avg"]),
                        _local(state["exp_avg_sq"]),
                        state["step"],
                        None if slot is None else slot.compute,
                        hyper,
                    )
                )
        skip = {}
        for device, steps in steps_by_device.items():
            torch._foreach_add_(steps, 1)
            if self.found_inf is not None:
                skip[device] = (
                    self.found_inf.detach()
                    .to(device=device, dtype=torch.float32, non_blocking=True)
                    .reshape(())
                )
                torch._foreach_sub_(steps, [skip[device]] * len(steps))
        coef = {}
        for local, grad, exp_avg, exp_avg_sq, step, copy_to, hyper in sorted(
            work, key=lambda w: -w[0].numel()
        ):
            dev = local.device
            if self.grad_coef is not None and dev not in coef:
                coef[dev] = self.grad_coef.detach().to(
                    device=dev, dtype=torch.float32, non_blocking=True
                )
            adam_step_(
                local,
                grad,
                exp_avg,
                exp_avg_sq,
                step,
                grad_coef=coef.get(dev),
                skip=skip.get(dev),
                copy_to=copy_to,
                **hyper,
            )
        return loss


class TritonAdam(_TritonAdamStep, torch.optim.Adam):
    """``torch.optim.Adam`` (L2 weight decay added to the gradient) stepped by the Triton kernel."""


class TritonAdamW(_TritonAdamStep, torch.optim.AdamW):
    """``torch.optim.AdamW`` (decoupled weight decay) stepped by the Triton kernel."""

    _decoupled = True
    _default_weight_decay = 1e-2


# ============================================================================ gradient norm and
# clip
@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    pp_mesh: DeviceMesh | None = None,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    scale_grads: bool = True,
) -> torch.Tensor:
    """Clips gradients in place to a total norm of ``max_norm`` and returns the total norm before
    clipping (a plain fp32 0-dim tensor, the same on every rank).

    Correct when parameters live on different meshes (dense on the FSDP mesh, routed experts on the
    expert-FSDP x EP mesh) or are plain tensors: the norm is computed per mesh, each reduced over
    its own mesh, then combined; with ``pp_mesh`` also over pipeline stages.

    ``scale_grads=False`` only computes and returns the total norm and leaves the gradients
    untouched: the caller applies ``clip_coefficient(total, max_norm)`` itself, e.g. inside a fused
    optimizer step (``clip_in_fused_step``), which saves the separate pass over all gradients.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            key = (
                (p.grad.device_mesh, tuple(p.grad.placements))
                if isinstance(p.grad, DTensor)
                else None
            )
            groups[key].append(p)
    device = params[0].device if params else torch.device("cpu")
    total = total_grad_norm(
        [[p.grad for p in group] for group in groups.values()],
        norm_type,
        device,
        pp_mesh=pp_mesh,
        error_if_nonfinite=error_if_nonfinite,
        foreach=foreach,
    )
    if scale_grads:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach)
    return total


# Gradients of at least this many elements get their own ``vector_norm`` on CUDA instead of a share
# of the foreach kernel: over the proxy's gradients (4.7 G bf16 values, 78 tensors; one H200) the
# foreach kernel reads 2.3 TB/s (4.20 ms), one reduction per large tensor with the rest on foreach
# 3.3 TB/s (2.92 ms; bench/results/2026-12-02_h200_e2e.md, "The stacked gate / up weight; the
# gradient norm").
FOREACH_NORM_MAX_NUMEL = 1 << 22


def _plain_norm_fp32(
    grads: list[torch.Tensor], norm_type: float, foreach: bool | None
) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm`` of plain low-precision gradients, accumulated in fp32 as if
    they were widened first (the foreach kernel and ``vector_norm`` widen each element on load). On
    CUDA the tensors of at least ``FOREACH_NORM_MAX_NUMEL`` elements take ``vector_norm`` (faster
    there), the rest the foreach kernel: the same per-tensor norms as ``get_total_norm``'s up to
    fp32 summation order."""
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        by_device[g.device].append(g)
    norms = []
    for device, gs in by_device.items():
        if foreach is not False and device.type == "cuda":
            small = [g for g in gs if g.numel() < FOREACH_NORM_MAX_NUMEL]
            norms.extend(
                torch._foreach_norm(small, norm_type, dtype=torch.float32) if small else []
            )
            gs = [g for g in gs if g.numel() >= FOREACH_NORM_MAX_NUMEL]
        norms.extend(torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in gs)
    return torch.linalg.vector_norm(torch.stack([n.to(grads[0].device) for n in norms]), norm_type)


@torch.no_grad()
def total_grad_norm(
    groups: list[list[torch.Tensor]],
    norm_type: float = 2.0,
    device: torch.device | None = None,
    *,
    pp_mesh: DeviceMesh | None = None,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """The total norm of gradients given in groups (each group's tensors on one mesh with one
    placement, or plain tensors), as ``clip_grad_norm_`` computes it. Plain bf16 / fp16 gradients
    (``master_weights``) are accumulated in fp32, so the norm equals that of the same gradients
    widened to fp32 (up to fp32 summation order on CUDA, where the large ones take another kernel:
    ``_plain_norm_fp32``)."""
    norms = []
    for grads in (g for g in groups if g):
        if not isinstance(grads[0], DTensor) and grads[0].dtype in (torch.bfloat16, torch.float16):
            # (non-finite: raised below for the total)
            n = _plain_norm_fp32(grads, norm_type, foreach)
        else:
            n = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    device = norms[0].device if norms else (device or torch.device("cpu"))
    norms = [n.to(device=device, dtype=torch.float32) for n in norms]
    if math.isinf(norm_type):
        total = torch.stack(norms).max() if norms else torch.zeros((), device=device)
    else:
        total = (
            torch.stack([n**norm_type for n in norms]).sum()
            if norms
            else torch.zeros((), device=device)
        )
    if pp_mesh is not None:
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(total, op=op, group=pp_mesh.get_group())
    if not math.isinf(norm_type):
        total = total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()})"
        )
    return total


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor ``torch.nn.utils.clip_grads_with_norm_`` multiplies every gradient by, computed
    the same way: ``clamp(max_norm / (total_norm + 1e-6), max=1)`` (exactly 1.0 when no clipping is
    needed)."""
    return torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)


def _is_triton_adam(o: torch.optim.Optimizer) -> bool:
    return isinstance(o, (TritonAdam, TritonAdamW))


def folds_clip(optimizers: Iterable[torch.optim.Optimizer]) -> bool:
    """True when every optimizer can apply the clip inside its step kernel: torch's fused Adam /
    AdamW (all parameter groups ``fused=True``; it divides every gradient by
    ``optimizer.grad_scale``) or this project's ``TritonAdam`` / ``TritonAdamW`` (they multiply by
    ``optimizer.grad_coef``). foreach / for-loop Adam refuse a ``grad_scale``."""
    opts = list(optimizers)
    return bool(opts) and all(
        _is_triton_adam(o)
        or (
            isinstance(o, (torch.optim.Adam, torch.optim.AdamW))
            and all(g.get("fused") for g in o.param_groups)
        )
        for o in opts
    )


@contextlib.contextmanager
def clip_in_fused_step(
    optimizers: Iterable[torch.optim.Optimizer],
    total_norm: torch.Tensor,
    max_norm: float,
    skip: torch.Tensor | None = None,
) -> Iterator[None]:
    """Gradient clipping folded into the optimizer's step kernel, instead of a separate in-place
    multiply over all gradients before the step (use ``clip_grad_norm_(..., scale_grads=False)`` for
    ``total_norm``).

    * torch's fused Adam / AdamW: inside the block ``step()`` divides each gradient by ``1 /
      clip_coefficient(total_norm, max_norm)`` (its ``grad_scale``) and writes the divided gradient
      back to ``.grad``, so the gradients after the step are clipped, as with the in-place clip.
      With clipping inactive the scale is exactly 1.0 and the step is bitwise the one after the
      in-place clip; with clipping active ``g / (1 / c)`` can differ from ``g * c`` in the last fp32
      bit.
    * ``TritonAdam`` / ``TritonAdamW``: the kernel multiplies each gradient by the coefficient
      (``grad_coef``), the in-place clip's product; it never writes the gradients, so after the step
      they are the unclipped ones.

    ``skip``: a bool tensor; where True the kernel leaves parameters, moments and the step count
    untouched (the optimizer's ``found_inf``, as under a GradScaler), so a non-finite step is
    skipped without a host sync.

    The scale is a 0-dim fp32 tensor on ``total_norm``'s device, computed without a host sync; under
    DTensor parameters (FSDP2, EP) DTensor treats such a scalar tensor as replicated. The attributes
    are removed on exit (also on an exception), so they never reach a later step or a checkpoint.
    """
    opts = list(optimizers)
    if not folds_clip(opts):
        raise ValueError(
            "clip_in_fused_step needs torch's fused Adam/AdamW (fused=True) or TritonAdam(W); got "
            f"{[type(o).__name__ for o in opts]}: clip the gradients in place instead"
        )
    for o in opts:
        if any(getattr(o, a, None) is not None for a in ("grad_scale", "grad_coef", "found_inf")):
            raise RuntimeError(
                f"{type(o).__name__} already has a grad_scale / grad_coef / found_inf (a "
                "GradScaler?): "
                "not folding the clip into it"
            )
    coef = clip_coefficient(total_norm.detach().to(torch.float32), max_norm)
    scale = None if all(_is_triton_adam(o) for o in opts) else torch.reciprocal(coef)
    found_inf = (
        None
        if skip is None
        else skip.detach().to(device=coef.device, dtype=torch.float32).reshape(())
    )
    try:
        for o in opts:
            if _is_triton_adam(o):
                o.grad_coef = coef
            else:
                o.grad_scale = scale
            if found_inf is not None:
                # A skipped step's grads are non-finite: the scaled gradient (NaN) is never used,
                # the kernel returns before touching anything.
                o.found_inf = found_inf
        yield
    finally:
        for o in opts:
            if _is_triton_adam(o):
                o.grad_coef = o.found_inf = None
            else:
                o.__dict__.pop("grad_scale", None)
                o.__dict__.pop("found_inf", None)


# ============================================================================ building
def build_optimizers(model_parts: list[torch.nn.Module], cfg, master_weights=None):
    """torchtitan's ``OptimizersContainer`` over ``model_parts`` for the ``[optimizer]`` section
    ``cfg``: Adam or AdamW, torch's ("fused", "foreach", "for-loop") or this project's Triton step
    ("triton"), which also holds ``master_weights`` (``MasterWeights`` or None) where the trainer
    keeps fp32 masters in the optimizer."""
    from torchtitan.components.optimizer import OptimizersContainer

    if cfg.implementation == "triton":
        opt_cls, impl = (TritonAdamW if cfg.name == "AdamW" else TritonAdam), {}
    else:
        opt_cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
        impl = {
            "fused": {"fused": True},
            "foreach": {"foreach": True},
            "for-loop": {"foreach": False},
        }[cfg.implementation]
    optimizers = OptimizersContainer(
        model_parts,
        opt_cls,
        dict(
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            **impl,
        ),
    )
    for opt in optimizers.optimizers:
        # (only the Triton step reads them; validate refuses other pairings)
        opt.master_weights = master_weights
        opt.state_dtype = torch.bfloat16 if cfg.state_dtype == "bfloat16" else None
    return optimizers
