"""Per-rank bodies of the distributed tests (run by ``launcher.run_cases``).

Every rank builds the debug model with the same seed, runs the single-process reference on the whole
global batch itself (once per group of processes for the cases that share it), then runs the
parallelized copy on its slice of the batch and compares.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from tests.losses import cross_entropy_sum
from titan_glm52.distributed import build_mesh, init_distributed
from titan_glm52.fp8_training import Fp8Spec, apply_fp8, is_fp8
from titan_glm52.model import attention as attention_mod
from titan_glm52.model.args import get_flavor
from titan_glm52.model.attention import Attention
from titan_glm52.model.model import GLM52Model
from titan_glm52.model.moe import MoE
from titan_glm52.model.options import ModelOptions
from titan_glm52.optimizer import TritonAdamW, clip_grad_norm_, clip_in_fused_step, folds_clip
from titan_glm52.parallelize import parallelize_model

SEQ, GLOBAL_BATCH, IGNORE = 32, 8, -100
RTOL, ATOL = 1e-4, 1e-5
# cpu (gloo) by default, also on GPU hosts; TITAN_GLM52_TEST_DEVICE=cuda runs the same cases on
# nccl.
DEVICE_TYPE = os.environ.get("TITAN_GLM52_TEST_DEVICE", "cpu")


def all_reduce_moe_load(model, dp_mesh) -> None:
    """Sums every ``MoE.tokens_per_expert`` over the data-parallel ranks in place (global expert
    loads)."""
    if dp_mesh is None or dp_mesh.size() == 1:
        return
    for m in model.modules():
        if isinstance(m, MoE):
            dist.all_reduce(m.tokens_per_expert, group=dp_mesh.get_group())


def debug_args(flavor: str = "debug"):
    # index_topk 8 < SEQ so DSA is really sparse; IndexShare FFFSSSFS; MTP on. "debug_fp8": the same
    # model at widths FP8's 128 x 128 blocks divide.
    return get_flavor(flavor).replace(index_topk=8)


# FP8 cases compute everything but the FP8 products in float64 (test_parallel_training.FP8_NOTE)
FP8_CASE_DTYPE = torch.float64
# What FP8 cases convert: the default (the linears, the routed experts and the output head)
FP8_CASE_SPEC = Fp8Spec()


def fp8_modules(model) -> list[str]:
    """The names of the modules that run their products in FP8."""
    return [n for n, m in model.named_modules() if is_fp8(m)]


def make_batch(vocab: int, rows: int = GLOBAL_BATCH) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(1, vocab, (rows, SEQ), generator=g)


def labels_of(tokens: torch.Tensor, shift: int) -> torch.Tensor:
    lab = torch.full_like(tokens, IGNORE)
    lab[:, :-shift] = tokens[:, shift:]
    return lab


def loss_on(model, tokens: torch.Tensor, n_main: int, n_mtp: int) -> torch.Tensor:
    """This slice's share of the global loss: summed token CE (main + MTP) / global valid-token
    counts."""
    logits, mtp_logits = model(tokens, with_mtp=True)
    return (
        cross_entropy_sum(logits, labels_of(tokens, 1)) / n_main
        + cross_entropy_sum(mtp_logits, labels_of(tokens, 2)) / n_mtp
    )


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def moe_counts(model) -> list[torch.Tensor]:
    return [m.tokens_per_expert.clone() for m in model.modules() if isinstance(m, MoE)]


@dataclasses.dataclass
class Reference:
    """The single process's training step on the whole global batch, and what the cases compare
    with: ``base`` the initialised model (untrained; the parallel copies start from it),
    ``converted`` the same with FP8 applied where asked (untrained), the loss, the gradients before
    and after the clip, the clipped norm, and after one AdamW step the parameters, both moments by
    parameter name and the MoE loads."""

    base: GLM52Model
    converted: GLM52Model
    tokens: torch.Tensor
    n_main: int
    n_mtp: int
    loss: torch.Tensor
    grads: dict
    norm: torch.Tensor
    clipped: dict
    params: dict
    moments: dict
    moe_counts: list


# A group's ranks run many cases one after another (launcher.run_cases) and most of them compare
# with the same reference: it is formed once per rank and group.
_REFERENCES: dict = {}


def reference(
    args, dsa_backend, spec, dtype, route_to_first_experts, ref_chunks, global_batch, device
) -> Reference:
    """The memoised ``Reference`` of these settings (``check_train_step`` says what each means)."""
    settings = (args, dsa_backend, spec, dtype, route_to_first_experts, ref_chunks, global_batch)
    key = (*map(repr, settings), str(device))
    if key not in _REFERENCES:
        _REFERENCES[key] = _form_reference(*settings, device)
    return _REFERENCES[key]


def _form_reference(
    args, dsa_backend, spec, dtype, route_to_first_experts, ref_chunks, global_batch, device
) -> Reference:
    torch.manual_seed(0)
    ref = GLM52Model(args, ModelOptions(dsa_backend=dsa_backend))
    ref.init_weights()
    if route_to_first_experts:
        with torch.no_grad():
            for m in ref.modules():
                if isinstance(m, MoE):
                    m.router.e_score_correction_bias[: args.n_routed_experts // 2] = 100.0
    ref.to(device, dtype)
    base = copy.deepcopy(ref)
    if spec is not None:  # (the parallel copy gets it from parallelize_model)
        apply_fp8(ref, spec)
    converted = copy.deepcopy(ref)
    tokens = make_batch(args.vocab_size, global_batch).to(device)
    n_main = int((labels_of(tokens, 1) != IGNORE).sum())
    n_mtp = int((labels_of(tokens, 2) != IGNORE).sum())
    # In ``ref_chunks`` accumulated micro-batches. AdamW eps 1e-6: with the default 1e-8, weights
    # whose gradient is ~1e-8 would turn fp32 rounding differences of the reductions into
    # different updates.
    loss = 0
    for chunk in tokens.chunk(ref_chunks):
        part = loss_on(ref, chunk, n_main, n_mtp)
        part.backward()
        loss = loss + part.detach()
    # The DSA indexer runs under no_grad (its own KL loss trains it), so its weights get no gradient
    # here.
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in ref.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.5)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.1)
    opt.step()
    params = dict(ref.named_parameters())
    return Reference(
        base=base,
        converted=converted,
        tokens=tokens,
        n_main=n_main,
        n_mtp=n_mtp,
        loss=loss,
        grads=grads,
        norm=norm,
        clipped={n: p.grad for n, p in params.items()},
        params={n: p.detach() for n, p in params.items()},
        moments={n: opt.state[p] for n, p in params.items() if p in opt.state},
        moe_counts=moe_counts(ref),
    )


def check_train_step(
    dp_replicate: int = 1,
    dp_shard: int = -1,
    ep: int = 1,
    ac_mode: str = "none",
    selective_ac_option: str = "op",
    compile: bool = False,
    compile_backend: str = "aot_eager",
    reshard_after_forward: str = "default",
    meta_init: bool = False,
    route_to_first_experts: bool = False,
    clip_in_step: str | None = None,
    dsa_backend: str = "torch",
    mtp_token_chunk: int = 0,
    fp8: bool = False,
    fp8_linears: str = "blockwise",
    fp8_experts: str = "blockwise",
    ref_chunks: int = 1,
    global_batch: int = GLOBAL_BATCH,
    **arg_overrides,
) -> None:
    """Loss, gradients, grad norm (after clipping), one AdamW step (parameters, both moments,
    clipped gradients) and MoE loads equal single-process.

    ``route_to_first_experts``: a large routing bias on the first half of the experts, so that under
    EP=2 the second EP rank receives no tokens at all (all-to-alls with zero splits, experts with
    empty input).
    ``clip_in_step``: ``"fused"`` / ``"triton"``: the parallel run uses torch's fused AdamW / this
    project's TritonAdamW on the DTensor parameters with the clip folded into its step (the
    trainer's paths for ``optimizer.implementation = "fused"`` / ``"triton"``); the reference still
    clips in place.
    ``dsa_backend``: "triton" runs the DSA kernels (in the interpreter on CPU) on both sides, whose
    sparse attention keeps the latent query that ``[dsa] recompute_latent_query`` (on) rebuilds in
    backward.
    ``mtp_token_chunk``: the parallel run's MTP layer in token chunks (``[activation_checkpoint]
    mtp_token_chunk``), the reference's whole.
    ``fp8``: the "debug_fp8" flavor with FP8 products (``FP8_CASE_SPEC``: the linears, the routed
    experts and the output head) on both sides: ``apply_fp8`` on the reference,
    ``parallelize_model(fp8=...)`` on the parallel copy; parameters, gradients and the FSDP compute
    and reduction in float64 (the FP8 products quantise from fp32 and compute in fp32), so that the
    parallel run's summation order cannot move an FP8 rounding (test_parallel_training.FP8_NOTE).
    ``fp8_linears``: the linears' FP8 recipe (``Fp8Spec.recipe``: torchao's Float8Linear for
    "tensorwise" and the rowwise ones).
    ``fp8_experts``: the routed experts' FP8 recipe (``Fp8Spec.expert_recipe``).
    ``global_batch``: rows of the global batch (fewer keep the Triton interpreter's cases short).
    ``ref_chunks``: the reference runs the global batch as this many accumulated micro-batches (the
    single process's gradient accumulation), summing their losses and gradients. FP8's weight
    gradient quantises its operands per 128 x 1 tile of the tokens (of each expert, for the routed
    experts), so it depends on which tokens one product sees: with FP8, pass the micro-batches that
    the parallel run forms (test_parallel_training.py says which). Without FP8 every split gives the
    same result up to fp32 rounding.
    """
    if dsa_backend == "triton" and DEVICE_TYPE == "cpu":
        # before the kernels are imported (lazily, below)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if fp8 and meta_init:
        raise NotImplementedError("fp8 cases run in float64; the meta-device path initialises fp32")
    env = init_distributed(device_type=DEVICE_TYPE)
    args = debug_args("debug_fp8" if fp8 else "debug").replace(**arg_overrides)
    spec = (
        dataclasses.replace(FP8_CASE_SPEC, recipe=fp8_linears, expert_recipe=fp8_experts)
        if fp8
        else None
    )
    dtype = FP8_CASE_DTYPE if fp8 else torch.float32
    ref = reference(
        args, dsa_backend, spec, dtype, route_to_first_experts, ref_chunks, global_batch, env.device
    )
    init_params = dict(ref.base.named_parameters())
    model = copy.deepcopy(ref.base)
    if mtp_token_chunk:
        model = GLM52Model(
            args, ModelOptions(dsa_backend=dsa_backend, mtp_token_chunk=mtp_token_chunk)
        )
        model.load_state_dict(ref.base.state_dict())
        model.to(env.device, dtype)
    local_ref = copy.deepcopy(ref.converted)
    tokens, n_main, n_mtp = ref.tokens, ref.n_main, ref.n_mtp
    ref_loss, ref_grads, ref_norm = ref.loss, ref.grads, ref.norm

    mesh = build_mesh(
        env.world_size,
        dp_replicate=dp_replicate,
        dp_shard=dp_shard,
        ep=ep,
        device_type=env.device.type,
        n_routed_experts=args.n_routed_experts,
    )
    parallelize_model(
        model,
        mesh,
        param_dtype=dtype,
        reduce_dtype=dtype,
        reshard_after_forward=reshard_after_forward,
        ac_mode=ac_mode,
        selective_ac_option=selective_ac_option,
        compile=compile,
        compile_backend=compile_backend,
        fp8=spec,
    )
    assert [n for n, _ in model.named_parameters()] == list(ref_grads), "parameter names changed"
    if spec is not None:
        converted = fp8_modules(model)
        assert converted == fp8_modules(ref.converted), converted
        assert any(n.endswith("moe.experts") for n in converted), converted
    # experts: EP shards dim 0 on "ep"; FSDP on "efsdp" shards dim 0 again, or dim 1 if too few
    if ep > 1:
        w13 = model.layers["3"].moe.experts.w13
        assert w13.device_mesh.mesh_dim_names[-2:] == ("efsdp", "ep"), w13.device_mesh
        too_few = mesh.degrees.efsdp > args.n_routed_experts // ep
        assert w13.placements[-1] == Shard(0) and (w13.placements[-2] == Shard(1)) == too_few, (
            w13.placements
        )
    dp = mesh["dp"]
    local = tokens.chunk(dp.size())[dp.get_local_rank()]
    # with the Triton DSA kernels: grad mode of each latent query formed (False: a rebuild)
    absorbed = []
    if dsa_backend == "triton":
        real_absorb = attention_mod._absorb
        attention_mod._absorb = lambda *a: (
            absorbed.append(torch.is_grad_enabled()) or real_absorb(*a)
        )
    loss = loss_on(model, local, n_main, n_mtp)
    loss.backward()
    if dsa_backend == "triton":
        attention_mod._absorb = real_absorb
        n_attn = sum(isinstance(m, Attention) for m in model.modules())
        # every query rebuilt once
        assert absorbed.count(True) == absorbed.count(False) == n_attn, absorbed

    total = loss.detach().clone()
    dist.all_reduce(total, group=dp.get_group())
    torch.testing.assert_close(total, ref_loss, rtol=RTOL, atol=ATOL)
    for name, p in model.named_parameters():
        if ref_grads[name] is None:
            assert p.grad is None, name
            continue
        torch.testing.assert_close(
            full(p.grad), ref_grads[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}"
        )
    # Before the all-reduce each rank has counted its own tokens by GLOBAL expert id (also under EP,
    # where the tokens are computed elsewhere), once per forward (not again in AC recomputes) ...
    with torch.no_grad():
        local_ref(local, with_mtp=True)
    for got, want in zip(moe_counts(model), moe_counts(local_ref)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # ... so the all-reduce over the data-parallel ranks gives the global load.
    all_reduce_moe_load(model, dp)
    for got, want in zip(moe_counts(model), ref.moe_counts):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    assert ref_norm > 0.5, (
        f"max_norm 0.5 does not clip (norm {float(ref_norm)}): the clip is not tested"
    )
    norm = clip_grad_norm_(model.parameters(), max_norm=0.5, scale_grads=clip_in_step is None)
    assert not isinstance(norm, DTensor)
    # (an fp32 norm, also of the float64 gradients of the FP8 cases)
    torch.testing.assert_close(norm, ref_norm.float(), rtol=RTOL, atol=ATOL)
    hyper = dict(lr=1e-3, eps=1e-6, weight_decay=0.1)
    if clip_in_step == "triton":
        opt = TritonAdamW(model.parameters(), **hyper)
    else:
        opt = torch.optim.AdamW(model.parameters(), fused=clip_in_step == "fused" or None, **hyper)
    if clip_in_step:
        assert folds_clip([opt])
        with clip_in_fused_step([opt], norm, max_norm=0.5):
            opt.step()
        assert getattr(opt, "grad_scale", None) is None and getattr(opt, "grad_coef", None) is None
    else:
        opt.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            full(p.detach()),
            ref.params[name],
            rtol=RTOL,
            atol=ATOL,
            msg=lambda m: f"{name} after AdamW: {m}",
        )
        if p.grad is None:
            continue
        # The first moment is (1 - beta1) x the clipped gradient: it shows whether the clip was
        # applied (the parameters after one Adam step hardly do, Adam's update is nearly invariant
        # to a gradient scale). The gradients left after the step are the clipped ones, except under
        # TritonAdamW (it never writes them).
        ref_state, state = ref.moments[name], opt.state[p]
        torch.testing.assert_close(
            full(state["exp_avg"]),
            ref_state["exp_avg"],
            rtol=RTOL,
            atol=ATOL,
            msg=lambda m: f"{name} exp_avg after AdamW: {m}",
        )
        torch.testing.assert_close(
            full(state["exp_avg_sq"]),
            ref_state["exp_avg_sq"],
            rtol=2 * RTOL,
            atol=ATOL**2,
            msg=lambda m: f"{name} exp_avg_sq after AdamW: {m}",
        )
        want = ref_grads[name] if clip_in_step == "triton" else ref.clipped[name]
        torch.testing.assert_close(
            full(p.grad),
            want,
            rtol=RTOL,
            atol=ATOL,
            msg=lambda m: f"{name} gradient after the step: {m}",
        )

    # a non-finite step is skipped inside the fused kernel (found_inf) on DTensor parameters too
    if clip_in_step:
        before = {name: full(p.detach()).clone() for name, p in model.named_parameters()}
        for p in model.parameters():
            if p.grad is not None:
                p.grad.fill_(float("nan"))
        nan_norm = clip_grad_norm_(model.parameters(), max_norm=0.5, scale_grads=False)
        assert not torch.isfinite(nan_norm)
        steps = {
            name: opt.state[p]["step"].clone()
            for name, p in model.named_parameters()
            if p in opt.state
        }
        with clip_in_fused_step([opt], nan_norm, max_norm=0.5, skip=~torch.isfinite(nan_norm)):
            opt.step()
        for name, p in model.named_parameters():
            assert torch.equal(full(p.detach()), before[name]), f"{name} changed on a skipped step"
            if name in steps:
                assert torch.equal(opt.state[p]["step"], steps[name]), (
                    f"{name}: the step count moved"
                )

    # the trainer's path: parallelize on meta, then materialise and initialise (layout-free init)
    if meta_init:
        with torch.device("meta"):
            meta_model = GLM52Model(args)
        parallelize_model(meta_model, mesh, ac_mode=ac_mode)
        meta_model.to_empty(device=env.device)
        meta_model.init_weights()
        for name, p in meta_model.named_parameters():
            torch.testing.assert_close(
                full(p.detach()),
                init_params[name],
                rtol=0,
                atol=0,
                msg=lambda m: f"{name} initialised sharded: {m}",
            )


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def check_backward_all_to_alls(ep: int = 2) -> None:
    """Selective AC keeps the EP all-to-all outputs: its backward issues as many all-to-alls as
    without AC (the gradient ones), full AC issues more (the recompute's)."""
    env = init_distributed(device_type=DEVICE_TYPE)
    args = debug_args()
    mesh = build_mesh(env.world_size, dp_shard=env.world_size, ep=ep, device_type=env.device.type)
    tokens = make_batch(args.vocab_size).to(env.device).chunk(env.world_size)[env.rank]
    a2a = {}
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        model = GLM52Model(args)
        model.init_weights()
        model.to(env.device)
        parallelize_model(model, mesh, ac_mode=mode)
        logits = model(tokens)
        counter = _OpCounter()
        with counter:
            logits.float().pow(2).mean().backward()
        a2a[mode] = sum(n for op, n in counter.counts.items() if "all_to_all_single" in op)
    assert a2a["none"] > 0 and a2a["selective"] == a2a["none"] < a2a["full"], a2a


def check_mixed_precision(
    ep: int = 1, compile: bool = False, compile_backend: str = "inductor", ac_mode: str = "none"
) -> None:
    """bf16 parameters with fp32 gradient reduction (the GPU setting): the loss is within bf16
    rounding of the fp32 single-process loss, gradients are finite fp32, and one optimizer step
    runs."""
    env = init_distributed(device_type=DEVICE_TYPE)
    args = debug_args()
    torch.manual_seed(0)
    ref = GLM52Model(args)
    ref.init_weights()
    ref.to(env.device)
    model = copy.deepcopy(ref)
    tokens = make_batch(args.vocab_size).to(env.device)
    n_main = int((labels_of(tokens, 1) != IGNORE).sum())
    n_mtp = int((labels_of(tokens, 2) != IGNORE).sum())
    with torch.no_grad():
        ref_loss = loss_on(ref, tokens, n_main, n_mtp)
    mesh = build_mesh(env.world_size, dp_shard=env.world_size, ep=ep, device_type=env.device.type)
    parallelize_model(
        model,
        mesh,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        ac_mode=ac_mode,
        compile=compile,
        compile_backend=compile_backend,
    )
    local = tokens.chunk(env.world_size)[env.rank]
    loss = loss_on(model, local, n_main, n_mtp)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref_loss, rtol=2e-2, atol=0)
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, name
        if p.grad is not None:
            assert p.grad.dtype == torch.float32 and torch.isfinite(full(p.grad)).all(), name
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
