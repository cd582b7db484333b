"""Parallelism applied to a plain ``GLM52Model`` from outside: expert parallel, torch.compile,
activation checkpointing and FSDP2/HSDP, in that order (torchtitan's order, except that compile goes
inside the checkpoint, see ``apply_compile``); LoRA adapters (``lora.py``) and FP8 products
(``fp8_training.py``), when asked for, before all of them.

Parameter names never change: EP swaps the expert weights for DTensors and adds hooks, AC and
compile replace a module's ``forward`` on the instance (no
``_checkpoint_wrapped_module``/``_orig_mod`` in names), FSDP2 shards in place. A state dict
therefore has the same keys with and without parallelism.

Gradients are SUMMED over data-parallel ranks (no division by the DP degree): the loss of every rank
is already normalised by the global number of valid tokens (docs/architecture.md), so the sum over
ranks of the per-rank gradients is the single-process gradient.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Callable

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from titan_glm52.distributed import OPTION, ParallelMesh
from titan_glm52.fp8_training import Fp8Spec, apply_fp8
from titan_glm52.lora import LoRASpec, apply_lora
from titan_glm52.model.attention import Attention, prepare_compiled_calls
from titan_glm52.model.moe import GroupedExperts

logger = logging.getLogger(__name__)

AC_MODES = ("none", "full", "selective")
RESHARD_POLICIES = ("default", "always", "never")


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of this model (or pipeline stage) in forward order: ``layers`` then the MTP
    block."""
    blocks = list(model.layers.values()) if getattr(model, "layers", None) is not None else []
    if getattr(model, "mtp", None) is not None:
        blocks.append(model.mtp.block)
    return blocks


# ============================================================================ expert parallel
class ExpertParallel:
    """Hooks that turn a ``GroupedExperts`` into its expert-parallel shard.

    ``MoE.forward`` calls ``experts(x_sorted, counts, gathered_from=...)`` with this rank's tokens
    sorted by GLOBAL expert id (``counts[e]`` rows for expert e; ``MoE.tokens_per_expert`` has
    already counted them). The pre-hook sends each row to the EP rank that owns its expert
    (all-to-all with uneven splits), reorders the received rows by local expert and drops
    ``gathered_from`` (the rows no longer come from this rank's tokens), so the unchanged
    ``GroupedExperts.forward`` runs on the local shard (``w13`` and ``w2`` are DTensors ``Shard(0)``
    on the EP mesh; ``forward`` uses ``to_local()``). The post-hook undoes the reordering and sends
    the outputs back, so ``MoE`` sees exactly what it would see without EP.
    """

    def __init__(self, ep_mesh: DeviceMesh, num_experts: int) -> None:
        self.mesh, self.ep = ep_mesh, ep_mesh.size()
        if num_experts % self.ep:
            raise ValueError(
                f"{OPTION['ep']} = {self.ep} must divide n_routed_experts ({num_experts})"
            )
        self.num_local = num_experts // self.ep
        self.group = ep_mesh.get_group()
        self._pending: list[tuple[torch.Tensor, list[int], list[int]]] = []

    def dispatch(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x, counts = args
        # The rows sent on are received elsewhere: GroupedExperts cannot gather them again from
        # MoE's tokens.
        kwargs = {key: val for key, val in kwargs.items() if key != "gathered_from"}
        ep, n_local = self.ep, self.num_local
        # How many rows every source rank sends to each of my local experts: [src * n_local + local
        # expert].
        recv_counts = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, self.group))
        per_src = recv_counts.view(ep, n_local)
        in_splits = counts.view(ep, n_local).sum(1).tolist()
        out_splits = per_src.sum(1).tolist()
        x_recv = funcol.all_to_all_single_autograd(x, out_splits, in_splits, self.group)
        # x_recv is blocked (source rank, local expert); GroupedExperts needs (local expert, source
        # rank).
        sizes = per_src.reshape(-1)
        starts = (torch.cumsum(sizes, 0) - sizes).view(ep, n_local).t().reshape(-1)
        sizes_e = per_src.t().reshape(-1)
        total = sum(out_splits)
        first_e = torch.cumsum(sizes_e, 0) - sizes_e
        perm = torch.repeat_interleave(starts - first_e, sizes_e, output_size=total) + torch.arange(
            total, device=x.device
        )
        self._pending.append((perm, in_splits, out_splits))
        return (x_recv[perm], per_src.sum(0)), kwargs

    def combine(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        perm, in_splits, out_splits = self._pending.pop()
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        return funcol.all_to_all_single_autograd(out[inverse], in_splits, out_splits, self.group)


def _shard_dim0(param: nn.Parameter, mesh: DeviceMesh) -> nn.Parameter:
    """The rows of ``param`` this rank owns on ``mesh`` (even split of dim 0), as a DTensor
    parameter."""
    local = param.detach().chunk(mesh.size(), dim=0)[mesh.get_local_rank()].clone()
    dt = DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride()
    )
    return nn.Parameter(dt, requires_grad=param.requires_grad)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shards the routed experts of every MoE block over ``ep_mesh`` (dim 0 = experts) and installs
    the token dispatch/combine. The router, shared expert and load counts are untouched
    (replicated)."""
    for block in transformer_blocks(model):
        if not getattr(block, "moe_enabled", False):
            continue
        experts: GroupedExperts = block.moe.experts
        if getattr(experts, "_expert_parallel", None) is not None:
            raise RuntimeError("apply_expert_parallel was already applied to this model")
        ep = ExpertParallel(ep_mesh, experts.num_experts)
        for name in ("w13", "w2"):
            setattr(experts, name, _shard_dim0(getattr(experts, name), ep_mesh))
        experts._expert_parallel = ep
        # Never traced by torch.compile: host syncs (.tolist) and data-dependent splits; run
        # eagerly.
        experts.register_forward_pre_hook(torch.compiler.disable(ep.dispatch), with_kwargs=True)
        experts.register_forward_hook(torch.compiler.disable(ep.combine))


# ============================================================================ activation
# checkpointing Selective "op" policy: keep what is expensive to recompute and cheap to keep -- the
# outputs of the 2-D matmuls that autograd tracks (every nn.Linear, the router, the expert GEMMs,
# the DSA indexer projections) and of the EP all-to-alls (so the recompute sends nothing) -- and
# recompute the rest: norms, RoPE, activations, the attention core (its bmm/einsum scores are [T, H,
# k]: keeping them would cost more memory than the projections) and matmuls on untracked inputs (the
# indexer's chunked [chunk, T] scores, run under no_grad). "Tracked" means an input requires grad;
# grad mode itself cannot tell, since autograd Functions (the EP all-to-all, compiled regions,
# Triton kernels) run their forward with grad disabled.
_MATMULS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    # (model/expert_mm.py and model/fp8_mm.py, registered on import of the model)
    torch.ops.titan_glm52.expert_mm.default,
    torch.ops.titan_glm52.fp8_mm.default,
}
for _name in ("_grouped_mm", "_scaled_mm", "_scaled_grouped_mm"):
    if hasattr(torch.ops.aten, _name):
        _MATMULS.add(getattr(torch.ops.aten, _name).default)
# (Not wait_tensor: how often it is dispatched depends on where an AsyncCollectiveTensor is first
# used.)
_COMMS = set()
for _ns in ("_c10d_functional", "_c10d_functional_autograd"):
    try:
        _COMMS.add(getattr(torch.ops, _ns).all_to_all_single.default)
    except (AttributeError, RuntimeError):  # pragma: no cover - op not registered in this build
        pass
_SAVE_OPS = _MATMULS | _COMMS


def _op_sac_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    if func in _COMMS or (
        func in _MATMULS and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    ):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


try:  # torch's SAC modes, told to look only at the ops the policy may save (see _op_sac_context)
    from torch.utils.checkpoint import (
        _CachedTorchDispatchMode,
        _CachingTorchDispatchMode,
        _is_compiling,
    )

    class _SaveOpsCaching(_CachingTorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func not in _SAVE_OPS and not _is_compiling(func, args, kwargs):
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    class _SaveOpsCached(_CachedTorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func not in _SAVE_OPS and not _is_compiling(func, args, kwargs):
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    _HAVE_SAVE_OPS_MODES = True
except ImportError:  # pragma: no cover - private names moved
    _HAVE_SAVE_OPS_MODES = False


def _op_sac_context():
    """SAC contexts that match forward and recompute on the saveable ops only.

    torch's SAC matches EVERY op of the recompute to the forward by (op, call index) and fails when
    the recompute calls an op more often. Inside a block that happens legitimately with ops the
    policy never saves: the routed experts' own FSDP unit all-gathers (and records profiler ranges)
    in the recompute when it was prefetched in the forward, and MoE skips its load counting in the
    recompute. Ops outside ``_SAVE_OPS`` are always recomputed, so they bypass the matching (not
    under compile, where torch's partitioner applies the policy and needs every op tagged).
    """
    caching, cached = create_selective_checkpoint_contexts(_op_sac_policy)
    if (
        _HAVE_SAVE_OPS_MODES
        and type(caching) is _CachingTorchDispatchMode
        and type(cached) is _CachedTorchDispatchMode
    ):
        # Same objects (whatever this torch version's constructors take), with the bypass above.
        caching.__class__, cached.__class__ = _SaveOpsCaching, _SaveOpsCached
    return caching, cached


class _CheckpointedForward:
    """Stands in for ``module.forward``: the original forward under non-reentrant ``checkpoint``."""

    def __init__(self, forward: Callable, context_fn: Callable | None) -> None:
        self.forward, self.context_fn = forward, context_fn

    def __call__(self, *args, **kwargs):
        extra = {} if self.context_fn is None else {"context_fn": self.context_fn}
        # No RNG in a block (attention dropout is 0), so the RNG state need not be stashed.
        return checkpoint(
            self.forward, *args, use_reentrant=False, preserve_rng_state=False, **extra, **kwargs
        )


def apply_ac(model: nn.Module, mode: str, selective_option: str = "op") -> None:
    """Activation checkpointing per block (``layers`` and the MTP block).

    ``mode``: "none" | "full" (every block recomputed in backward) | "selective":
    ``selective_option`` "op" = op-level SAC with the policy above on every block, or an integer N =
    full checkpointing of every N-th block (1-based count in forward order; "1" = full). A recompute
    gives the same IndexShare top-k (deterministic) and does not count MoE loads again (MoE skips
    counting inside backward).
    """
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpoint.mode = {mode!r}: choose one of {AC_MODES}")
    if mode == "none":
        return
    every, context_fn = 1, None
    if mode == "selective":
        if selective_option == "op":
            context_fn = _op_sac_context
        elif str(selective_option).isdigit() and int(selective_option) >= 1:
            every = int(selective_option)
        else:
            raise ValueError(
                f"activation_checkpoint.selective_ac_option = {selective_option!r}: use 'op' or a "
                "positive integer N (checkpoint every N-th block)"
            )
    for i, block in enumerate(transformer_blocks(model), start=1):
        if i % every == 0:
            block.forward = _CheckpointedForward(block.forward, context_fn)


# ============================================================================ torch.compile
def apply_compile(model: nn.Module, backend: str = "inductor", fullgraph: bool = False) -> None:
    """Compiles every block's forward; call it before ``apply_ac`` so the checkpoint wraps the
    compiled forward (AC(compile(block))).

    Why not torchtitan's compile(AC(block)): every block has graph breaks, and dynamo runs a
    checkpointed region that contains one eagerly, so nothing would be compiled with AC on. Inside
    the checkpoint the compiled pieces run in the forward and again in the recompute (torchtitan
    does the same for its MoE blocks). Hooks (FSDP's, EP's) stay outside the compiled function
    because the block's ``forward`` is compiled, not its ``__call__``. The routed experts
    (``GroupedExperts.forward``: a per-expert loop over ``counts.tolist()`` or one
    ``torch._grouped_mm``) and the EP dispatch/combine run eagerly, as in torchtitan. Graph breaks
    that remain: the MoE count guard ``torch._C._current_graph_task_id()`` in MoE blocks and the
    torch DSA backend's ``int(tensor)`` chunk bounds.
    """
    tag_compile_caches()
    # the eager DSA calls built before tracing: no graph break to build them
    for m in model.modules():
        if isinstance(m, Attention):
            prepare_compiled_calls(m.backend, m.gluon)
    for block in transformer_blocks(model):
        if getattr(block, "moe_enabled", False):
            block.moe.experts.forward = torch.compiler.disable(block.moe.experts.forward)
        block.forward = torch.compile(
            _as_function(block.forward), backend=backend, fullgraph=fullgraph
        )


def source_tag(root: Path = Path(__file__).parent) -> str:
    """A hash of the package's Python source (every ``*.py`` under ``root``, by relative path)."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return f"titan_glm52-{digest.hexdigest()[:16]}"


def tag_compile_caches() -> None:
    """Adds ``source_tag()`` to torch.compile's cache keys (``torch.compiler.config.cache_key_tag``,
    after any tag the user set; once per process).

    Why: the backward formula of a registered op (``model/ops.py``) is not part of the keys of
    torch.compile's on-disk caches (pytorch/pytorch#144344), so a compiled backward cached by
    another version of this package would be loaded and run that version's formula. Seen on one
    H100: a version without an op loaded the compiled backward that a version with it had cached,
    and failed with "no attribute 'fp8_mm_grads'"
    (bench/results/2026-12-06_h100_fp8_backward_host.md)."""
    config = torch.compiler.config
    tag = source_tag()
    if tag not in config.cache_key_tag:
        config.cache_key_tag = f"{config.cache_key_tag}+{tag}" if config.cache_key_tag else tag


def _as_function(fn: Callable) -> Callable:
    """A plain function calling ``fn`` (torch.compile wants a function or module, not any
    callable)."""

    def forward(*args, **kwargs):
        return fn(*args, **kwargs)

    return forward


# ============================================================================ FSDP2 / HSDP
def _reshard_policy(policy: str, pp_enabled: bool, shard_degree: int) -> bool:
    """ "default": reshard after forward unless pipelined or unsharded (``shard_degree`` 1: FSDP
     only casts to
    ``param_dtype`` there, and resharding would redo that cast and copy for every unit in
    backward)."""
    if policy not in RESHARD_POLICIES:
        raise ValueError(
            f"parallelism.fsdp_reshard_after_forward = {policy!r}: choose one of {RESHARD_POLICIES}"
        )
    return {"always": True, "never": False}.get(policy, not pp_enabled and shard_degree > 1)


def apply_fsdp(
    model: nn.Module,
    mesh: ParallelMesh,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: str = "default",
) -> None:
    """FSDP2 units: ``tok_embeddings``; each block (with its routed experts as their own unit on the
    expert FSDP mesh under EP); the MTP layer; ``output``; the root (the final ``norm``). HSDP when
    dp_replicate > 1. The dense mesh is dp_shard x cp: context-parallel ranks shard the parameters
    too, and their gradients (each the gradient of its tokens' share of the loss) are summed.

    ``reshard_after_forward``: "always" | "never" | "default" (reshard blocks unless pipeline
    parallel or dp_shard is 1; ``output`` is kept unsharded unless "always": backward needs it first
    and the MTP head reuses it). Forward inputs are not cast (``cast_forward_inputs=False``): hidden
    states arrive in ``param_dtype`` from the embedding, and the fp32 RoPE tables in the packed
    context keep their precision.
    """
    reshard = _reshard_policy(reshard_after_forward, mesh.pp_enabled, mesh.degrees.fsdp_shard)
    mp = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )
    dense = {"mesh": mesh.fsdp_mesh, "mp_policy": mp}
    expert = {"mesh": mesh.expert_fsdp_mesh, "mp_policy": mp}

    expert_units = []

    def shard_block(block: nn.Module) -> None:
        if getattr(block, "moe_enabled", False) and mesh.ep_enabled:
            experts = block.moe.experts
            # EP already split dim 0; when the expert-FSDP degree exceeds the local experts, shard
            # dim 1.
            too_few = mesh.degrees.efsdp > experts.num_experts // mesh.degrees.ep
            fully_shard(
                experts,
                **expert,
                reshard_after_forward=reshard,
                shard_placement_fn=(lambda p: Shard(1)) if too_few else None,
            )
            expert_units.append(experts)
        fully_shard(block, **dense, reshard_after_forward=reshard)

    if getattr(model, "tok_embeddings", None) is not None:
        fully_shard(model.tok_embeddings, **dense, reshard_after_forward=reshard)
    for block in model.layers.values() if getattr(model, "layers", None) is not None else ():
        shard_block(block)
    if getattr(model, "mtp", None) is not None:
        shard_block(model.mtp.block)
        fully_shard(model.mtp, **dense, reshard_after_forward=reshard)
    if getattr(model, "output", None) is not None:
        # Its own unit (not grouped with ``norm``): the MTP head calls it a second time, alone.
        fully_shard(model.output, **dense, reshard_after_forward=reshard_after_forward == "always")
    fully_shard(model, **dense, reshard_after_forward=reshard)  # the rest: the final norm
    for m in model.modules():
        if isinstance(m, FSDPModule):
            unit_mesh = (
                mesh.expert_fsdp_mesh if any(m is e for e in expert_units) else mesh.fsdp_mesh
            )
            if unit_mesh.size() > 1:
                m.set_gradient_divide_factor(1.0)  # sum over ranks (see the module docstring)
                # Plain SUM collectives: exact for factor 1, needed on gloo (no PREMUL_SUM),
                # cheapest on NCCL.
                m.set_force_sum_reduction_for_comms(True)
            # A one-rank unit keeps FSDP's default, which is also a sum there: with a factor set,
            # FSDP copies the gradients as ``input / factor`` (an extra pass over every gradient, ~9
            # ms per step on the proxy).
    if mesh.ep_enabled:
        _set_ep_prefetch(model)


def _set_ep_prefetch(model: nn.Module) -> None:
    """Explicit forward prefetch along the blocks: the EP splits' device-to-host syncs would
    otherwise delay FSDP's implicit prefetch of the next block (and its experts)."""
    blocks = list(model.layers.values())
    for block, nxt in zip(blocks, blocks[1:]):
        mods = [nxt, nxt.moe.experts] if getattr(nxt, "moe_enabled", False) else [nxt]
        block.set_modules_to_forward_prefetch(mods)


# ============================================================================ entry point
def parallelize_model(
    model: nn.Module,
    mesh: ParallelMesh | None,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: str = "default",
    ac_mode: str = "none",
    selective_ac_option: str = "op",
    compile: bool = False,
    compile_backend: str = "inductor",
    ep_enabled: bool | None = None,
    lora: LoRASpec | None = None,
    fp8: Fp8Spec | None = None,
) -> nn.Module:
    """Applies LoRA -> FP8 -> EP -> compile -> AC -> FSDP2 in place and returns the model.

    ``lora``: adapt and freeze the model first (``lora.apply_lora``), so that every later step sees
    the adapters as ordinary parameters; FSDP2 units then hold frozen and trainable parameters.
    ``fp8``: the modules it names run their products in FP8 (``fp8_training.apply_fp8``; same
    parameters, same names).

    FSDP is applied when there is data, context or expert parallelism, and also on a mesh of one
    data-parallel rank when ``param_dtype`` is not fp32: that is how one GPU computes in bf16 with
    fp32 master weights. ``mesh=None`` skips FSDP (plain single process; cast the model yourself).
    ``ep_enabled`` defaults to the mesh's EP degree > 1 and must agree with it. Works on a model
    built on the meta device (initialise it after, e.g. ``to_empty`` + ``init_weights``).
    """
    mesh_ep = mesh is not None and mesh.ep_enabled
    if ep_enabled is None:
        ep_enabled = mesh_ep
    if ep_enabled != mesh_ep:
        raise ValueError(
            f"ep_enabled={ep_enabled} but the mesh has {OPTION['ep']} = "
            f"{mesh.degrees.ep if mesh is not None else 1}; build the mesh with the EP degree you "
            "want"
        )
    if lora is not None:
        apply_lora(model, lora)
    if fp8 is not None:
        apply_fp8(model, fp8)
    if ep_enabled:
        n = next(
            (
                b.moe.experts.num_experts
                for b in transformer_blocks(model)
                if getattr(b, "moe_enabled", 0)
            ),
            None,
        )
        if n is not None and n % mesh.degrees.ep:
            raise ValueError(
                f"{OPTION['ep']} = {mesh.degrees.ep} must divide n_routed_experts ({n})"
            )
        apply_expert_parallel(model, mesh["ep"])
    if compile:  # inside the checkpoint: see apply_compile
        apply_compile(model, backend=compile_backend)
    apply_ac(model, ac_mode, selective_ac_option)
    if mesh is not None and (
        mesh.dp_enabled or mesh.cp_enabled or ep_enabled or param_dtype != torch.float32
    ):
        apply_fsdp(
            model,
            mesh,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=reshard_after_forward,
        )
    elif mesh is None and (param_dtype != torch.float32 or reduce_dtype != torch.float32):
        logger.warning(
            "mesh=None: FSDP is not applied, so param_dtype=%s / reduce_dtype=%s are not used "
            "(parameters keep their dtype)",
            param_dtype,
            reduce_dtype,
        )
    return model
