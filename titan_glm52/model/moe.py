"""Dense SwiGLU MLP and the sigmoid-routed MoE (router, grouped experts, shared expert, load statistics).

Routing (published GLM-5.2 / DeepSeek-V3 ``noaux_tc``): fp32 logits, ``s = sigmoid(logits)``; the expert
choice uses ``s + e_score_correction_bias`` (group-limited when ``n_group > 1``), the combine weights use the
unbiased ``s`` of the chosen experts, renormalised when ``norm_topk_prob`` and scaled by
``routed_scaling_factor``. ``tokens_per_expert`` accumulates the routed counts of every forward (not of
activation-checkpoint recomputes) for the aux-loss-free bias update.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F
from torch import nn

from titan_glm52.kernels import triton_available
from titan_glm52.model.args import GLM52ModelArgs
from titan_glm52.model.aux_loss import AuxLoss, in_backward
from titan_glm52.model.recompute import RecomputeSaved, can_recompute

logger = logging.getLogger(__name__)


class FeedForward(nn.Module):
    """``w2(silu(w1 x) * w3 x)``: the dense MLP of the first layers and the shared expert."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate_proj
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up_proj
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _grouped_mm_usable(x: torch.Tensor) -> bool:
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


_logged_loop_fallback = False


class GroupedExperts(nn.Module):
    """All routed experts as 3-D weights: w1/w3 ``[E, F, D]`` (gate/up), w2 ``[E, D, F]`` (down).

    ``forward(x, counts)`` takes tokens already sorted by expert (``counts[e]`` rows for expert e) — the
    interface expert parallelism dispatches into. It runs ``torch._grouped_mm`` on Hopper-class GPUs in bf16
    and an exact per-expert loop elsewhere (logged once, since the two round differently).
    """

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.use_grouped_mm: bool | None = None  # None = decide per call
        # Backward recomputes the inputs of the three GEMMs instead of keeping them ([moe] recompute_expert_inputs).
        self.recompute_inputs = True

    def forward(self, x: torch.Tensor, counts: torch.Tensor,
                gathered_from: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``gathered_from = (src, rows)`` says ``x == src[rows]`` with ``src`` kept by the caller for its own
        backward: with ``recompute_inputs`` the backward then gathers x again instead of keeping it."""
        w1, w2, w3 = self.w1, self.w2, self.w3
        if hasattr(w1, "to_local"):  # DTensor weights (FSDP/EP): compute on the local shard
            w1, w2, w3 = w1.to_local(), w2.to_local(), w3.to_local()
        use_gmm = _grouped_mm_usable(x) if self.use_grouped_mm is None else self.use_grouped_mm
        saved = (RecomputeSaved("MoE experts", "[moe] recompute_expert_inputs")
                 if self.recompute_inputs and can_recompute() else None)
        with saved if saved is not None else contextlib.nullcontext():
            if use_gmm:
                if saved is not None and gathered_from is not None:
                    src, rows = gathered_from
                    saved.recompute(x, lambda: src[rows], src, rows)
                offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
                h = self._swiglu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs),
                                 torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs), saved)
                return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
            global _logged_loop_fallback
            if not _logged_loop_fallback and x.is_cuda:
                logger.warning("MoE experts: torch._grouped_mm is not usable here (%s, %s); using the per-expert "
                               "loop", x.dtype, x.device)
                _logged_loop_fallback = True
            outs, start = [], 0
            for e, chunk in enumerate(torch.split(x, counts.tolist(), dim=0)):
                if saved is not None and gathered_from is not None:
                    src, rows = gathered_from[0], gathered_from[1][start:start + chunk.shape[0]]
                    saved.recompute(chunk, lambda src=src, rows=rows: src[rows], src, rows)
                start += chunk.shape[0]
                outs.append(self._swiglu(chunk @ w1[e].T, chunk @ w3[e].T, saved) @ w2[e].T)
            return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])

    @staticmethod
    def _swiglu(gate: torch.Tensor, up: torch.Tensor, saved: RecomputeSaved | None) -> torch.Tensor:
        """``silu(gate) * up`` (``swiglu``: it keeps only gate and up); with ``saved``, the result, which the down
        projection keeps, is recomputed from ``gate`` and ``up`` in backward."""
        h = swiglu(gate, up)
        if saved is not None:
            saved.recompute(h, lambda: swiglu(gate, up), gate, up)
        return h


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The routed experts' ``silu(gate) * up``, formed in fp32 and rounded once to the inputs' dtype, with the
    backward's ``d_gate`` and ``d_up`` likewise, from gate and up alone (no silu output kept or formed). On CUDA one
    Triton pass each way (``kernels/swiglu.py``); elsewhere the same formulas in torch (for fp32 inputs exactly
    the ops autograd runs for ``F.silu(gate) * up``)."""
    return _SwiGLU.apply(gate, up)


def _swiglu_kernel(gate: torch.Tensor) -> bool:
    return gate.is_cuda and gate.dtype in (torch.bfloat16, torch.float16, torch.float32) and triton_available()


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        if _swiglu_kernel(gate):
            from titan_glm52.kernels.swiglu import swiglu_forward  # lazy: importing the model must not import triton

            return swiglu_forward(gate, up)
        c = torch.promote_types(gate.dtype, torch.float32)
        return (F.silu(gate.to(c)) * up.to(c)).to(gate.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        if _swiglu_kernel(gate):
            from titan_glm52.kernels.swiglu import swiglu_backward

            return swiglu_backward(gate, up, grad)
        c = torch.promote_types(gate.dtype, torch.float32)
        g, u, d = gate.to(c), up.to(c), grad.to(c)
        return torch.ops.aten.silu_backward(d * u, g).to(gate.dtype), (d * F.silu(g)).to(up.dtype)


class Router(nn.Module):
    """fp32 sigmoid router; ``e_score_correction_bias`` steers the choice only."""

    def __init__(self, args: GLM52ModelArgs) -> None:
        super().__init__()
        self.num_experts, self.top_k = args.n_routed_experts, args.num_experts_per_tok
        self.n_group, self.topk_group = args.n_group, args.topk_group
        self.norm_topk_prob, self.scale = args.norm_topk_prob, args.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, args.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor):
        """Returns (scores ``[N, E]`` fp32, chosen experts ``[N, k]``, combine weights ``[N, k]`` fp32)."""
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            grouped = choice.detach().view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            keep = group_scores.topk(self.topk_group, dim=-1).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~mask.repeat_interleave(self.num_experts // self.n_group, dim=1),
                                        float("-inf"))
        idx = choice.detach().topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, idx, weights * self.scale


# Row dtypes whose float() is exact, so that mul(rows, fp32 w) computes exactly float(rows) * w.
_EXACT_IN_FP32 = (torch.bfloat16, torch.float16, torch.float32)


class _WeightedRowSum(torch.autograd.Function):
    """``out[t] = sum_r y[r, t]`` (``sum``'s accumulation: fp32 for bf16/fp16/fp32, rounded once to ``out_dtype``),
    with ``y[r, t] = out_dtype(float(rows[perm[r * n + t]]) * w[r, t])``; ``rows [k * n, D]``, ``w [k, n]`` fp32.

    The products are formed in fp32 and rounded straight into ``out_dtype`` (no fp32 copy of the rows, no fp32
    product tensor); the k rows of a token are reached through the permutation ``perm``, a gather, so the backward
    is a gather too (no scatter-add with atomics).
    """

    @staticmethod
    def forward(ctx, rows: torch.Tensor, w: torch.Tensor, perm: torch.Tensor, out_dtype: torch.dtype):
        k, n = w.shape
        r = rows.index_select(0, perm).view(k, n, rows.shape[-1])
        ctx.save_for_backward(r, w, perm)
        return _scale_rows(r, w, out_dtype).sum(0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        r, w, perm = ctx.saved_tensors
        k, n = w.shape
        grad_rows = grad_w = None
        if ctx.needs_input_grad[0]:  # d out[t] / d rows[perm[r*n+t]] = w[r, t] (through the fp32 product)
            g = _scale_rows(grad.unsqueeze(0).expand(k, n, grad.shape[-1]), w, r.dtype)
            inverse = torch.empty_like(perm)
            inverse[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
            grad_rows = g.view(k * n, -1).index_select(0, inverse)
            del g  # (before the weights' gradient below: k n D values fewer alive there)
        if ctx.needs_input_grad[1]:  # d out[t] / d w[r, t] = float(row): the fp32 dot product of grad and row
            r32 = r if r.dtype in _EXACT_IN_FP32 else r.float()
            g32 = grad.float()
            if torch.compiler.is_compiling():  # fused into one reduction, no [k, n, D] product in memory
                grad_w = (g32.unsqueeze(0) * r32).sum(-1)
            else:  # one slot at a time: an [n, D] fp32 product instead of [k, n, D] (6 GiB at 32K on the proxy)
                grad_w = torch.stack([(g32 * r32[j]).sum(-1) for j in range(k)])
        return grad_rows, grad_w, None, None


def _scale_rows(r: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``(r.float() * w[..., None]).to(out_dtype)``. In eager mode, for rows in bf16/fp16/fp32 and fp32 ``w``, one
    pass with no fp32 temporary: ``mul`` computes in the promoted fp32 and rounds into the ``out=`` tensor, which
    gives the same bits. (Compiled, the compiler fuses the casts of the plain expression itself.)"""
    if r.dtype in _EXACT_IN_FP32 and w.dtype == torch.float32 and not torch.compiler.is_compiling():
        return torch.mul(r, w.unsqueeze(-1), out=torch.empty(r.shape, dtype=out_dtype, device=r.device))
    return (r.float() * w.unsqueeze(-1)).to(out_dtype)


def combine_routed(routed: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """The routed part of the MoE output: ``out[t] = sum_j out_dtype(float(routed[p(t, j)]) * weights[t, j])``.

    ``routed [N * k, D]``: expert outputs in expert-sorted order (row p is flat choice ``order[p] = t * k + j``);
    ``weights [N, k]`` fp32 combine weights. Each product is rounded to ``out_dtype``; a token's k products are
    summed in fp32 (ascending expert order on CPU) and rounded once. That is the CPU numerics of the
    ``zeros.index_add_(0, token, products)`` this replaced, without its ``out_dtype`` atomics on GPU (which also
    rounded after every add, in a non-deterministic order) and without the fp32 copies of the ``[N * k, D]`` rows.
    """
    if weights.dtype != torch.float32:
        raise TypeError(f"combine_routed: the combine weights must be fp32 (the router's dtype), got {weights.dtype}")
    n, k = weights.shape
    # Sorted positions of each token's k rows, ascending (= ascending expert id), then slot-major:
    # row r * n + t of the permuted rows is token t's r-th expert.
    by_token = torch.argsort(order // k, stable=True).view(n, k)
    perm = by_token.t().reshape(-1)
    w = weights.reshape(-1)[order[perm]].view(k, n)
    return _WeightedRowSum.apply(routed, w, perm, out_dtype)


def expert_counts(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert, int64 ``[num_experts]``, without a host sync: ``torch.bincount`` reads the
    index range to the host on CUDA (two device-to-host syncs per MoE layer, which stall the host's kernel
    queue and FSDP's all-gathers behind it) and is a graph break under torch.compile. Integer adds: exact and
    order-independent."""
    return flat.new_zeros(num_experts).scatter_add_(0, flat, torch.ones_like(flat))


class MoE(nn.Module):
    def __init__(self, args: GLM52ModelArgs) -> None:
        super().__init__()
        self.num_experts = args.n_routed_experts
        self.router = Router(args)
        self.experts = GroupedExperts(args.n_routed_experts, args.hidden_size, args.moe_intermediate_size)
        self.shared_experts = FeedForward(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts)
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_routed_experts, dtype=torch.float32),
                             persistent=False)
        # Sequence-level balance loss (DeepSeek-V3): None = off; else alpha / global number of sequences.
        self.seq_aux_scale: float | None = None
        self.last_seq_aux: torch.Tensor | None = None

    def seq_aux_loss(self, scores: torch.Tensor, idx: torch.Tensor, rows: int) -> torch.Tensor:
        """``sum over sequences of sum_i f_i * P_i`` with ``f_i = E / (k S) * (tokens of the sequence routed to i)``
        and ``P_i`` the sequence mean of the normalised sigmoid scores."""
        e, k = self.num_experts, self.router.top_k
        seq = scores.shape[0] // rows
        chosen = torch.zeros_like(scores).scatter_(1, idx, 1.0).view(rows, seq, e)
        f = chosen.sum(1) * (e / (k * seq))
        p = (scores / scores.sum(-1, keepdim=True)).view(rows, seq, e).mean(1)
        return (f.detach() * p).sum()

    def forward(self, x: torch.Tensor, rows: int = 1) -> torch.Tensor:
        """``x [N, D]`` (``rows`` sequences of N / rows tokens) -> ``[N, D]``."""
        k = self.router.top_k
        scores, idx, weights = self.router(x)
        flat = idx.reshape(-1)
        counts = expert_counts(flat, self.num_experts)
        if not in_backward():
            with torch.no_grad():
                self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
        order = torch.argsort(flat, stable=True)
        token_of = order // k
        routed = self.experts(x[token_of], counts, gathered_from=(x, token_of))
        out = combine_routed(routed, weights, order, x.dtype) + self.shared_experts(x)
        if self.seq_aux_scale is not None and torch.is_grad_enabled():
            aux = self.seq_aux_loss(scores, idx, rows)
            if not in_backward():
                self.last_seq_aux = aux.detach() + (0 if self.last_seq_aux is None else self.last_seq_aux)
            out = AuxLoss.apply(out, aux * self.seq_aux_scale)
        return out
