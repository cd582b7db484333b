"""Dense SwiGLU MLP and the sigmoid-routed MoE (router, grouped experts, shared expert, load
statistics).

Routing (published GLM-5.2 / DeepSeek-V3 ``noaux_tc``): fp32 logits, ``s = sigmoid(logits)``; the
expert choice uses ``s + e_score_correction_bias`` (group-limited when ``n_group > 1``), the combine
weights use the unbiased ``s`` of the chosen experts, renormalised when ``norm_topk_prob`` and
scaled by ``routed_scaling_factor``. ``tokens_per_expert`` accumulates the routed counts of every
forward (not of activation-checkpoint recomputes) for the aux-loss-free bias update.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from titan_glm52.kernels import triton_available
from titan_glm52.model.args import GLM52ModelArgs
from titan_glm52.model.aux_loss import AuxTerms, in_backward
from titan_glm52.model.expert_mm import expert_mm
from titan_glm52.model.fp32_linear import linear_fp32
from titan_glm52.model.options import ModelOptions
from titan_glm52.model.recompute import RecomputeSaved, can_recompute, token_chunked

if TYPE_CHECKING:
    from titan_glm52.context_parallel import CPContext


class FeedForward(nn.Module):
    """``w2(silu(w1 x) * w3 x)``: the dense MLP of the first layers and the shared expert."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate_proj
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up_proj
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# Mean routed rows per (local) expert from which "auto" forms the experts' products one cuBLAS GEMM
# per expert (expert_mm) instead of one torch._grouped_mm: on one H200 at 16,384 rows per expert
# (32K tokens, the proxy) the training step ran 3.2% faster that way, at 2,048 (4K tokens) 25%
# slower, since the host then waits for the expert counts in every MoE layer and its kernel launches
# no longer run ahead of the GPU (bench/results/2026-12-03_h200_e2e.md).
PER_EXPERT_MIN_ROWS = 8192


def _grouped_mm_usable(x: torch.Tensor) -> bool:
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    )


class GroupedExperts(nn.Module):
    """All routed experts as 3-D weights: ``w13 [E, 2F, D]`` (each expert's gate projection in rows
    ``:F``, its up projection in rows ``F:``; the checkpoint's ``gate_proj`` and ``up_proj``) and
    ``w2 [E, D, F]`` (down).

    ``forward(x, counts)`` takes tokens already sorted by expert (``counts[e]`` rows for expert e) —
    the interface expert parallelism dispatches into. Its products are either ``torch._grouped_mm``
    (bf16 on Hopper-class GPUs; no host sync) or ``expert_mm``, one ordinary GEMM per expert (any
    device and dtype; the host reads the counts): ``use_grouped_mm`` True / False, or None to take
    the grouped product on a GPU that has it below ``PER_EXPERT_MIN_ROWS`` rows per expert and
    ``expert_mm`` otherwise. Gate and up are one GEMM each way: forward ``x -> [gate | up]``,
    backward ``[d_gate | d_up] -> d_x`` in one product (two GEMMs would leave two partial ``d_x`` to
    add: a pass over the routed rows, 6.9 ms per step at 32K tokens on the proxy).
    """

    # the per-expert product (fp8_training.Fp8GroupedExperts runs it in FP8)
    per_expert_mm = staticmethod(expert_mm)

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden: int,
        use_grouped_mm: bool | None = None,
        recompute_inputs: bool = True,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.use_grouped_mm = use_grouped_mm  # None = decide per call
        # Backward recomputes the inputs of the two GEMMs instead of keeping them ([moe]
        # recompute_expert_inputs).
        self.recompute_inputs = recompute_inputs

    def forward(
        self,
        x: torch.Tensor,
        counts: torch.Tensor,
        gathered_from: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``gathered_from = (src, rows)`` says ``x == src[rows]`` with ``src`` kept by the caller
        for its own backward: with ``recompute_inputs`` the backward then gathers x again instead of
        keeping it."""
        w13, w2 = self.w13, self.w2
        if hasattr(w13, "to_local"):  # DTensor weights (FSDP/EP): compute on the local shard
            w13, w2 = w13.to_local(), w2.to_local()
        use_gmm = self.use_grouped_mm
        if use_gmm is None:
            use_gmm = _grouped_mm_usable(x) and x.shape[0] < PER_EXPERT_MIN_ROWS * w13.shape[0]
        saved = (
            RecomputeSaved("MoE experts", "[moe] recompute_expert_inputs")
            if self.recompute_inputs and can_recompute()
            else None
        )
        with saved if saved is not None else contextlib.nullcontext():
            if saved is not None and gathered_from is not None:
                src, rows = gathered_from
                saved.recompute(x, lambda: src[rows], src, rows)
            if use_gmm:
                return self._grouped(x, w13, w2, counts, saved, gathered_from)
            splits = counts.tolist()  # the host needs them to launch one product per expert
            h = self._swiglu(self.per_expert_mm(x, w13, splits), saved)
            return self.per_expert_mm(h, w2, splits)

    def _grouped(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        counts: torch.Tensor,
        saved: RecomputeSaved | None,
        gathered_from: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """The two products as ``torch._grouped_mm`` (the experts' row offsets stay on the
        device). ``gathered_from`` as in ``forward``: for a subclass that keeps copies of ``x``."""
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = self._swiglu(torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs), saved)
        return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)

    @staticmethod
    def _swiglu(gu: torch.Tensor, saved: RecomputeSaved | None) -> torch.Tensor:
        """``silu(gate) * up`` of ``gu = [gate | up]`` (``swiglu``: it keeps only ``gu``); with
        ``saved``, the result, which the down projection keeps, is recomputed from ``gu`` in
        backward."""
        h = swiglu(gu)
        if saved is not None:
            saved.recompute(h, lambda: swiglu(gu), gu)
        return h


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """The routed experts' ``silu(gate) * up`` of ``gu = [gate | up]`` (``[..., 2F]`` -> ``[...,
    F]``), formed in fp32 and rounded once to the input's dtype, with the backward's ``d_gu =
    [d_gate | d_up]`` likewise, from ``gu`` alone (no silu output kept or formed). On CUDA one
    Triton pass each way (``kernels/swiglu.py``); elsewhere the same formulas in torch (for fp32
    inputs exactly the ops autograd runs for ``F.silu(gate) * up``)."""
    return _SwiGLU.apply(gu)


# what the MoE's Triton kernels take
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _on_kernel(t: torch.Tensor) -> bool:
    """Whether the MoE's Triton kernels (kernels/swiglu.py, kernels/moe_routing.py) take ``t``:
    CUDA, their dtypes."""
    return t.is_cuda and t.dtype in _KERNEL_DTYPES and triton_available()


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gu)
        if _on_kernel(gu):
            # lazy: importing the model must not import triton
            from titan_glm52.kernels.swiglu import swiglu_forward

            return swiglu_forward(gu)
        c = torch.promote_types(gu.dtype, torch.float32)
        gate, up = gu.to(c).chunk(2, dim=-1)
        return (F.silu(gate) * up).to(gu.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (gu,) = ctx.saved_tensors
        if _on_kernel(gu):
            from titan_glm52.kernels.swiglu import swiglu_backward

            return swiglu_backward(gu, grad)
        c = torch.promote_types(gu.dtype, torch.float32)
        (g, u), d = gu.to(c).chunk(2, dim=-1), grad.to(c)
        return torch.cat((torch.ops.aten.silu_backward(d * u, g), d * F.silu(g)), dim=-1).to(
            gu.dtype
        )


class Router(nn.Module):
    """fp32 sigmoid router; ``e_score_correction_bias`` steers the choice only."""

    def __init__(self, args: GLM52ModelArgs) -> None:
        super().__init__()
        self.num_experts, self.top_k = args.n_routed_experts, args.num_experts_per_tok
        self.n_group, self.topk_group = args.n_group, args.topk_group
        self.norm_topk_prob, self.scale = args.norm_topk_prob, args.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, args.hidden_size))
        self.register_buffer(
            "e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32)
        )

    def forward(self, x: torch.Tensor):
        """Returns (scores ``[N, E]`` fp32, chosen experts ``[N, k]``, combine weights ``[N, k]``
        fp32)."""
        scores = torch.sigmoid(linear_fp32(x, self.weight))
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            grouped = choice.detach().view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            keep = group_scores.topk(self.topk_group, dim=-1).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(
                ~mask.repeat_interleave(self.num_experts // self.n_group, dim=1), float("-inf")
            )
        idx = choice.detach().topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, idx, weights * self.scale


# Row dtypes whose float() is exact, so that mul(rows, fp32 w) computes exactly float(rows) * w.
_EXACT_IN_FP32 = (torch.bfloat16, torch.float16, torch.float32)


def token_positions(order: torch.Tensor, k: int) -> torch.Tensor:
    """``[n, k]`` int64: the rows of each token's k choices in the expert-sorted order ``order``
    (flat choice ``t * k + j`` at row p), ascending (= ascending expert id)."""
    return torch.argsort(order // k, stable=True).view(-1, k)


def gather_sum(
    src: torch.Tensor,
    pos: torch.Tensor,
    w: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``out[t] = sum_j y[t, j]`` over j ascending, summed in fp32 (fp64 for fp64) and rounded once
    to ``out_dtype`` (default ``src``'s), with ``y[t, j] = src[pos[t, j]]``, or
    ``out_dtype(float(src[pos[t, j]]) * w[t, j])`` given fp32 weights ``w [n, k]``. One Triton pass
    on CUDA (``kernels/moe_routing.py``); the same sum in torch elsewhere (bitwise equal)."""
    out_dtype = out_dtype or src.dtype
    if _on_kernel(src) and out_dtype in _KERNEL_DTYPES:
        # lazy: the model must not import triton
        from titan_glm52.kernels.moe_routing import gather_sum as kernel

        return kernel(src, pos, w, out_dtype)
    acc = None
    for j in range(pos.shape[1]):
        y = src.index_select(0, pos[:, j])
        if w is not None:
            y = _scale_rows(y, w[:, j], out_dtype)
        acc = y.to(torch.promote_types(out_dtype, torch.float32)) if acc is None else acc + y
    return acc.to(out_dtype)


class _DispatchRows(torch.autograd.Function):
    """``x[token_of]`` (each token's row once per choice, in expert-sorted order) whose backward
    sums each token's k row gradients by a gather (``gather_sum`` over ``pos``: fp32, ascending
    expert, rounded once) instead of the scatter-add into zeros of an indexing's backward (atomics
    on the GPU, rounded after every add)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, token_of: torch.Tensor, pos: torch.Tensor):
        ctx.save_for_backward(pos)
        return x.index_select(0, token_of)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (pos,) = ctx.saved_tensors
        return gather_sum(grad, pos), None, None


def dispatch_rows(x: torch.Tensor, token_of: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``x[token_of]`` with a gather-sum backward; ``pos = token_positions(order, k)`` for
    ``token_of = order // k``."""
    return _DispatchRows.apply(x, token_of, pos)


class _WeightedRowSum(torch.autograd.Function):
    """``out[t] = gather_sum(rows, pos, w, out_dtype)[t]``: token t's k expert outputs ``rows[pos[t,
    j]]``, each scaled by ``w[t, j]`` in fp32 and rounded to ``out_dtype``, summed in fp32 and
    rounded once.

    Keeps ``rows`` itself (no permuted copy). Backward: ``d rows[pos[t, j]] =
    rows.dtype(float(grad[t]) * w[t, j])`` (a gather of grad; each row written once, no scatter-add)
    and ``d w[t, j]`` the fp32 dot product of ``grad[t]`` and ``rows[pos[t, j]]``; one Triton pass
    on CUDA, one slot at a time in torch elsewhere.
    """

    @staticmethod
    def forward(
        ctx, rows: torch.Tensor, w: torch.Tensor, pos: torch.Tensor, out_dtype: torch.dtype
    ):
        ctx.save_for_backward(rows, w, pos)
        return gather_sum(rows, pos, w, out_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, w, pos = ctx.saved_tensors
        if _on_kernel(rows) and grad.dtype == rows.dtype:
            from titan_glm52.kernels.moe_routing import combine_backward

            d_rows, d_w = combine_backward(grad, rows, pos, w)
            return d_rows, d_w, None, None
        k = pos.shape[1]
        d_rows = d_w = None
        # d out[t] / d rows[pos[t, j]] = w[t, j] (through the fp32 product)
        if ctx.needs_input_grad[0]:
            d_rows = torch.empty_like(rows)
            for j in range(k):
                d_rows.index_copy_(0, pos[:, j], _scale_rows(grad, w[:, j], rows.dtype))
        # d out[t] / d w[t, j] = float(row): the fp32 dot product of grad and row
        if ctx.needs_input_grad[1]:
            g32 = grad.float()  # (fp64 rows too: their products were formed from float(row))
            d_w = torch.stack(
                [(g32 * rows.index_select(0, pos[:, j]).float()).sum(-1) for j in range(k)], dim=1
            )
        return d_rows, d_w, None, None


def _scale_rows(r: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``(r.float() * w[..., None]).to(out_dtype)``. In eager mode, for rows in bf16/fp16/fp32 and
    fp32 ``w``, one pass with no fp32 temporary: ``mul`` computes in the promoted fp32 and rounds
    into the ``out=`` tensor, which gives the same bits. (Compiled, the compiler fuses the casts of
    the plain expression itself.)"""
    if r.dtype in _EXACT_IN_FP32 and w.dtype == torch.float32 and not torch.compiler.is_compiling():
        return torch.mul(
            r, w.unsqueeze(-1), out=torch.empty(r.shape, dtype=out_dtype, device=r.device)
        )
    return (r.float() * w.unsqueeze(-1)).to(out_dtype)


def combine_routed(
    routed: torch.Tensor,
    weights: torch.Tensor,
    order: torch.Tensor,
    out_dtype: torch.dtype,
    pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed part of the MoE output: ``out[t] = sum_j out_dtype(float(routed[p(t, j)]) *
    weights[t, j])``.

    ``routed [N * k, D]``: expert outputs in expert-sorted order (row p is flat choice ``order[p] =
    t * k + j``); ``weights [N, k]`` fp32 combine weights; ``pos``: ``token_positions(order, k)``
    when the caller has it. Each product is rounded to ``out_dtype``; a token's k products are
    summed in fp32 in ascending expert order and rounded once. That is the CPU numerics of the
    ``zeros.index_add_(0, token, products)`` this replaced, without its ``out_dtype`` atomics on GPU
    (which also rounded after every add, in a non-deterministic order) and without the fp32 copies
    of the ``[N * k, D]`` rows.
    """
    if weights.dtype != torch.float32:
        raise TypeError(
            f"combine_routed: the combine weights must be fp32 (the router's dtype), got "
            f"{weights.dtype}"
        )
    k = weights.shape[1]
    pos = token_positions(order, k) if pos is None else pos
    # [N, k]: token t's weight of its j-th expert in ascending order
    w = weights.reshape(-1)[order[pos]]
    return _WeightedRowSum.apply(routed, w, pos, out_dtype)


def expert_counts(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert, int64 ``[num_experts]``, without a host sync:
    ``torch.bincount`` reads the index range to the host on CUDA (two device-to-host syncs per MoE
    layer, which stall the host's kernel queue and FSDP's all-gathers behind it) and is a graph
    break under torch.compile. Integer adds: exact and order-independent."""
    return flat.new_zeros(num_experts).scatter_add_(0, flat, torch.ones_like(flat))


class MoE(nn.Module):
    def __init__(self, args: GLM52ModelArgs, options: ModelOptions | None = None) -> None:
        super().__init__()
        options = options or ModelOptions()
        self.num_experts = args.n_routed_experts
        self.router = Router(args)
        self.experts = GroupedExperts(
            args.n_routed_experts,
            args.hidden_size,
            args.moe_intermediate_size,
            options.grouped_mm,
            options.recompute_expert_inputs,
        )
        self.shared_experts = FeedForward(
            args.hidden_size, args.moe_intermediate_size * args.n_shared_experts
        )
        self.register_buffer(
            "tokens_per_expert",
            torch.zeros(args.n_routed_experts, dtype=torch.float32),
            persistent=False,
        )
        # The sequence-level balance loss (DeepSeek-V3) where the coefficient is > 0.
        self.seq_aux_loss_coeff = options.seq_aux_loss_coeff
        self.token_chunk = options.mlp_token_chunk  # [activation_checkpoint] mlp_token_chunk

    def seq_aux_loss(
        self, scores: torch.Tensor, idx: torch.Tensor, batch: int, cp: CPContext | None = None
    ) -> torch.Tensor:
        """``sum over sequences of sum_i f_i * P_i`` with ``f_i = E / (k S) * (tokens of the
        sequence routed to i)`` and ``P_i`` the sequence mean of the normalised sigmoid scores.

        Under context parallelism (``cp``: this rank holds part of each sequence) ``f`` counts the
        whole sequence (summed over the CP ranks; it carries no gradient) and ``P`` only this rank's
        tokens, over the whole length: the ranks' terms add up to the loss of the whole
        sequences."""
        e, k = self.num_experts, self.router.top_k
        seq = scores.shape[0] // batch
        chosen = torch.zeros_like(scores).scatter_(1, idx, 1.0).view(batch, seq, e)
        probs = (scores / scores.sum(-1, keepdim=True)).view(batch, seq, e)
        if cp is not None:
            f = cp.all_reduce(chosen.sum(1)) * (e / (k * cp.seq))
            return (f * probs.sum(1) / cp.seq).sum()
        f = chosen.sum(1) * (e / (k * seq))
        p = probs.mean(1)
        return (f.detach() * p).sum()

    def _routed(
        self,
        x: torch.Tensor,
        idx: torch.Tensor,
        weights: torch.Tensor,
        counts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The routed experts' part of the output for tokens ``x [n, D]`` with choices ``idx [n,
        k]`` and combine weights ``weights [n, k]``."""
        flat = idx.reshape(-1)
        counts = expert_counts(flat, self.num_experts) if counts is None else counts
        order = torch.argsort(flat, stable=True)
        token_of = order // idx.shape[1]
        pos = token_positions(order, idx.shape[1])
        routed = self.experts(dispatch_rows(x, token_of, pos), counts, gathered_from=(x, token_of))
        return combine_routed(routed, weights, order, x.dtype, pos)

    def _experts_of_tokens(
        self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The routed and the shared experts' output for tokens ``x`` routed by ``idx`` /
        ``weights``."""
        return self._routed(x, idx, weights) + self.shared_experts(x)

    def forward(
        self,
        x: torch.Tensor,
        batch: int = 1,
        aux: AuxTerms | None = None,
        cp: CPContext | None = None,
    ) -> torch.Tensor:
        """``x [N, D]`` (``batch`` sequences of N / batch tokens; under context parallelism ``cp``
        this rank's part of each) -> ``[N, D]``. The sequence balance loss is attached with
        ``aux``'s normaliser and recorded there (``AuxTerms``)."""
        scores, idx, weights = self.router(x)
        flat = idx.reshape(-1)
        counts = expert_counts(flat, self.num_experts)
        if not in_backward():
            with torch.no_grad():
                self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
        chunk = self.token_chunk
        # long sequences: bounded memory
        if chunk and x.shape[0] > chunk and torch.is_grad_enabled():
            out = token_chunked(self._experts_of_tokens, chunk, x, idx, weights)
        else:
            out = self._routed(x, idx, weights, counts) + self.shared_experts(x)
        if self.seq_aux_loss_coeff > 0 and torch.is_grad_enabled():
            aux = AuxTerms() if aux is None else aux
            out = aux.attach_seq_aux(
                out, self.seq_aux_loss(scores, idx, batch, cp), self.seq_aux_loss_coeff
            )
        return out
