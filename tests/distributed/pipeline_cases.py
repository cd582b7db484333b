"""Per-rank body of the pipeline-parallel tests: stages cut by the skip-aware splitter, run by a
torch.distributed.pipelining schedule (optionally with FSDP / EP on the other mesh dims), against a
single-process reference on the whole global batch.

The layout-independent init (``model/init.py``) gives the stages exactly the reference's weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.distributed.cases import (
    FP8_CASE_DTYPE,
    FP8_CASE_SPEC,
    GLOBAL_BATCH,
    IGNORE,
    SEQ,
    debug_args,
    full,
    labels_of,
    make_batch,
)
from tests.losses import cross_entropy_sum
from titan_glm52.distributed import build_mesh, init_distributed
from titan_glm52.fp8_training import Fp8Spec, apply_fp8, is_fp8
from titan_glm52.model.aux_loss import AuxTerms
from titan_glm52.model.model import GLM52Model
from titan_glm52.model.moe import MoE
from titan_glm52.model.options import ModelOptions
from titan_glm52.optimizer import clip_grad_norm_
from titan_glm52.parallelize import parallelize_model
from titan_glm52.pipeline import build_pipeline_stages, build_schedule, micro_batch_bounds
from titan_glm52.pipeline_split import choose_layout
from titan_glm52.step import mtp_labels

RTOL, ATOL = 1e-4, 1e-5


def _reference(args, tokens: torch.Tensor, fp8: Fp8Spec | None = None, chunks: int = 1):
    """The single process on the whole batch, as ``chunks`` accumulated micro-batches, with the FP8
    products of ``fp8``."""
    ref = GLM52Model(args)
    ref.init_weights(seed=0)
    if fp8 is not None:
        apply_fp8(ref, fp8)
        ref.to(FP8_CASE_DTYPE)
    n_main = (labels_of(tokens, 1) != IGNORE).sum().item()
    n_mtp = (labels_of(tokens, 2) != IGNORE).sum().item()
    loss = 0
    for chunk in tokens.chunk(chunks):
        if fp8 is None:
            logits, mtp = ref(chunk, with_mtp=True)
            ce = cross_entropy_sum(logits, labels_of(chunk, 1))
            mtp = cross_entropy_sum(mtp, labels_of(chunk, 2))
        else:
            # the stages' fused head (pipeline.GLM52Stage.loss_sums): its gradient is rounded
            # otherwise than autograd's through the logits, an fp32 difference that FP8 amplifies
            ce, mtp = ref(
                chunk, with_mtp=True, labels=labels_of(chunk, 1), mtp_labels=labels_of(chunk, 2)
            )
        part = ce / n_main + mtp / n_mtp
        part.backward()
        loss = loss + part.detach()
    counts = {n: m.tokens_per_expert.clone() for n, m in ref.named_modules() if isinstance(m, MoE)}
    return ref, loss, n_main, n_mtp, counts


def check_pipeline(
    schedule: str,
    pp: int,
    dp_shard: int = 1,
    ep: int = 1,
    stages_per_rank: int | None = None,
    layout: list[int] | None = None,
    ac_mode: str = "none",
    mtp_token_chunk: int = 0,
    fp8: bool = False,
) -> None:
    """Loss, every gradient, the clipped grad norm and the MoE loads equal the single-process
    run. ``mtp_token_chunk``: the stages run the MTP layer in token chunks
    (``[activation_checkpoint] mtp_token_chunk``), the reference without them.

    ``fp8``: the "debug_fp8" flavor with FP8 products (``FP8_CASE_SPEC``: the linears, the routed
    experts and the output head) on both sides. The schedule runs micro-batches of one sequence and
    FP8's weight gradient quantises per 128 x 1 tile of the tokens one product sees (per expert for
    the routed experts), so the reference runs the same one-sequence micro-batches, accumulated (the
    single process's gradient accumulation). Both sides compute in float64 outside the FP8
    products, so that the schedule's summation order cannot move an FP8 rounding (see
    test_parallel_training.FP8_NOTE)."""
    if fp8 and (dp_shard != 1 or ep != 1):
        raise NotImplementedError("fp8: the stages are cast to float64 unsharded, after init")
    env = init_distributed()
    args = debug_args("debug_fp8" if fp8 else "debug")
    spec = FP8_CASE_SPEC if fp8 else None
    mesh = build_mesh(
        env.world_size,
        dp_shard=dp_shard,
        ep=ep,
        pp=pp,
        device_type="cpu",
        n_routed_experts=args.n_routed_experts,
    )
    tokens = make_batch(args.vocab_size)
    ref, ref_loss, n_main, n_mtp, ref_counts = _reference(
        args, tokens, spec, GLOBAL_BATCH if fp8 else 1
    )

    plan = choose_layout(args, schedule, pp, stages_per_rank, seq_len=SEQ, layers_per_stage=layout)
    pp_mesh = mesh["pp"]
    stages, parts = build_pipeline_stages(
        args,
        plan,
        pp_mesh.get_local_rank(),
        pp_mesh.get_group(),
        env.device,
        ModelOptions(mtp_token_chunk=mtp_token_chunk),
        lambda m: parallelize_model(m, mesh, ac_mode=ac_mode, ep_enabled=ep > 1, fp8=spec),
    )
    if fp8:  # every module that runs FP8 in the reference does so in one of the stages
        converted = [n for part in parts for n, m in part.named_modules() if is_fp8(m)]
        every = [None] * env.world_size
        dist.all_gather_object(every, converted)
        want = [n for n, m in ref.named_modules() if is_fp8(m)]
        assert sorted(n for names in every for n in names) == sorted(want), every
        assert any(n.endswith("moe.experts") for n in want), want
    for part in parts:
        part.to_empty(device=env.device)
        part.init_weights(seed=0)
        if fp8:
            part.to(FP8_CASE_DTYPE)
        if part.mtp is not None:
            assert part.mtp.block.moe.token_chunk == mtp_token_chunk

    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    local = tokens.chunk(dp_size)[dp_rank]
    losses = []

    last = next((part for part in parts if part.spec.head), None)

    def loss_fn(output, labels):
        ce, mtp = last.loss_sums(output, labels, mtp_labels(labels))
        loss = ce / n_main + mtp / n_mtp
        losses.append(loss.detach())
        return loss

    sched = build_schedule(stages, schedule, local.shape[0], loss_fn)  # micro-batches of one sample
    positions = torch.arange(SEQ).repeat(local.shape[0], 1)
    labels = labels_of(local, 1)
    has_first = any(s.is_first for s in stages)
    has_last = any(s.is_last for s in stages)
    for attempt in range(2):  # the first step also infers the stages' shapes on placeholder values
        losses.clear()
        for part in parts:
            part.zero_grad(set_to_none=True)
            for m in part.modules():
                if isinstance(m, MoE):
                    m.tokens_per_expert.zero_()
        kwargs = dict(
            target=labels if has_last else None,
            positions=positions,
            aux=AuxTerms(),
            bounds=micro_batch_bounds(positions, positions, local.shape[0]),
        )
        if has_first:
            sched.step(local, **kwargs)
        else:
            sched.step(**kwargs)

    total = torch.stack(losses).sum() if losses else torch.zeros(())
    dist.all_reduce(total)  # last-stage ranks hold the loss of their data-parallel slice
    torch.testing.assert_close(total, ref_loss, rtol=RTOL, atol=ATOL)

    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    checked = 0
    for part in parts:
        for name, p in part.named_parameters():
            if ref_grads[name] is None:  # the indexers learn only from their KL loss (off here)
                assert p.grad is None, name
                continue
            torch.testing.assert_close(
                full(p.grad),
                ref_grads[name],
                rtol=RTOL,
                atol=ATOL,
                msg=lambda m, name=name: f"{name}: {m}",
            )
            checked += 1
        for name, m in part.named_modules():
            if isinstance(m, MoE):
                load = m.tokens_per_expert.clone()
                dist.all_reduce(load, group=mesh["dp"].get_group())
                torch.testing.assert_close(load, ref_counts[name])
    assert checked > 0
    norm = clip_grad_norm_([p for part in parts for p in part.parameters()], 1e9, pp_mesh=pp_mesh)
    ref_norm = torch.nn.utils.get_total_norm(
        [p.grad for p in ref.parameters() if p.grad is not None]
    )
    torch.testing.assert_close(norm, ref_norm.float(), rtol=RTOL, atol=ATOL)  # (an fp32 norm)
    assert GLOBAL_BATCH % dp_size == 0
