"""Per-rank GPU memory of a parallel layout, read from this project's own parallelization code on a
fake world.

``estimate_memory(request)`` initialises a FAKE process group of ``gpus`` ranks (``torch.testing``'s
``FakeStore``; no communication happens), then, for one representative rank of every pipeline rank,
runs the real path of the trainer: ``build_mesh`` -> ``choose_layout`` (the skip-aware splitter; an
invalid explicit layout is refused exactly as ``plan layout`` refuses it) -> ``GLM52Stage`` on the
meta device for each stage that rank holds -> ``parallelize_model`` (EP, AC, FSDP2). It then reads
what FSDP2 really allocates (``FSDPParam`` padded shard sizes and all-gather sizes), adds activation
estimates, and reports the PEAK of the bytes allocated over a training step (what
``torch.cuda.max_memory_allocated`` measures). ``python -m titan_glm52.plan memory`` prints it. One
process with ``training.master_weights = "optimizer"`` (``master_weights="optimizer"`` here) has no
FSDP: the modules are walked for their sizes alone and the step is the master-weights one (below,
"Masters in the optimizer").

Why one rank per pipeline rank is enough: FSDP2 pads every shard to ``ceil(dim / shard degree)``
rows, and EP splits the experts evenly (``ep`` divides ``n_routed_experts``), so all ranks of one
pipeline rank allocate the same bytes; only the stages held differ. The representative is the rank
at data-parallel coordinate 0.

Peak. The buffers of a step do not all exist at once: fp32 gradients appear unit by unit during
backward while the saved activations are being freed, the activations are largest when backward
starts, a block's recompute and workspace exist only during its own backward. So the plan walks the
step through its phases and reports the largest; each column of the table is what is alive at that
moment, and the columns add up to it. Held the whole
step (after the first): the fp32 master weights (padded local shard numel x 4, the model is built in
fp32) and the AdamW states (exp_avg + exp_avg_sq, 2 x 4 bytes per local trainable element; 2 x 2
with ``[optimizer] state_dtype = "bfloat16"``). The rest
follows torch 2.13's FSDP2 and pipelining (``torch/distributed/fsdp/_fully_shard``,
``torch/distributed/pipelining/stage.py``):

  * The trainer zeroes gradients with ``set_to_none`` after the optimizer step, so a step starts
    with no gradient.
  * FSDP2 keeps a unit's parameters unsharded (all-gather outputs in ``param_dtype``, ``padded shard
    numel x shard degree``) from its forward until its backward when it does not reshard after
    forward (pipeline parallelism, ``reshard_after_forward = "never"``, and "default" at dp_shard 1;
    ``output`` always unless "always"), else from its pre-backward all-gather, prefetched one unit
    ahead (the current and the next unit of the backward). Without pipeline parallelism every unit
    reshards right after its own backward.
  * A unit's post-backward (no pipeline parallelism) copies its unsharded ``param_dtype`` gradient
    into an fp32 reduce-scatter input (unsharded numel x 4), frees the former, and leaves the fp32
    sharded gradient (local numel x 4). The input is kept until the next unit's post-backward starts
    (one buffer in flight: torch's ``reduce_scatter_max_input_buffers`` default), the last one until
    the end of backward.
  * FSDP2 hooks the post-backward on a unit's forward inputs. The root module (the final norm) and
    the embedding take token ids, which need no gradient, so theirs run in the final callback at the
    end of backward: their ``param_dtype`` gradients wait until then, and a pending reduce-scatter
    input is freed only by the next unit that runs its own post-backward (the head's stays through
    the last block's backward).
  * The head runs once per loss chunk and once more for the MTP loss; each call runs its own
    post-backward, so a later call's backward sees the earlier calls' sharded gradient and
    reduce-scatter input.
  * Under pipeline parallelism torch's ``PipelineStage`` runs every backward with
    ``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)``: every unit of
    the rank stays unsharded all step, and FSDP2 upcasts each fresh ``param_dtype`` gradient into an
    unsharded fp32 accumulation (unsharded numel x 4 for every unit, whatever the number of
    micro-batches). The sharded fp32 gradients appear only in ``perform_reduce_grad`` after the last
    backward, when no activation is left.
  * The fused AdamW step runs in place (no temporaries); clipping reduces per-tensor norms and
    scales in place.

Phases, without pipeline parallelism (one micro-batch of ``local_batch_size x seq_len`` tokens), in
backward order over the steps head, MTP layer, final norm, blocks last to first, embedding (a step
is the FSDP units that run backward together: a block's unit and, under EP, its experts' unit):
  backward X        the sharded gradients of the steps already reduced; the unsharded parameters of
                    X and the steps after it (all, or X and the next when resharding after forward);
                    the activations saved for X and every step after it, plus the stage extras
                    below; transient: X's backward bytes (below), its unsharded ``param_dtype``
                    gradient, the pending reduce-scatter input and the waiting gradients of the
                    final norm and embedding
  reduce-scatter X X resharded and its activations freed; transient: its ``param_dtype`` gradient +
                    its fp32 reduce-scatter input
  end of backward   all sharded gradients + the last reduce-scatter input (the optimizer step
                    allocates nothing)
The forward never exceeds the first block's backward phase: it holds a subset of the same
activations and parameters and no gradient, and a block's forward temporaries are a subset of its
backward's. (It can exceed the head's phase: measured at 32K on the proxy, 127.3 GiB at the last
block's forward against 125.9 in the head's and 128.5 in the last block's backward;
``bench/memory_phases.py``.)

Masters in the optimizer (one process, ``master_weights.py``): held all step, the fp32 masters (4
bytes per element) and the bf16 compute copies the model trains on (2; ``params`` column), and
AdamW's states. Nothing is all-gathered or reduce-scattered: a step's backward leaves its bf16
gradient in place (autograd's accumulation takes the tensor it formed), so the walk is the one above
without FSDP's buffers:
  backward X        the bf16 gradients of the steps already run; the activations saved for X and
                    every step after it, plus the stage extras; transient: X's backward bytes and
                    its bf16 gradient
  end of backward   all bf16 gradients (the Triton step updates in place)
The final norm's and the embedding's gradients form at their own backward (no FSDP final callback).
With gradient accumulation (``grad_accumulation``) a hook adds each fresh bf16 gradient into an fp32
sum and frees it: the sums (4 bytes per trainable element) are held from the first micro-batch on,
an upper bound for the first.

Phases, with pipeline parallelism (per rank):
  backward X        all units unsharded + their fp32 accumulation; the activations of the in-flight
                    micro-batches (below), of which the one being run backward (a chunk of one of
                    the rank's stages in flight) holds only what X and the steps after it saved; the
                    schedule's buffers (below); transient: X's backward bytes + its fresh
                    ``param_dtype`` gradient
  gradient reduction the accumulation and the unsharded parameters of every unit (an upper bound:
                    each unit is resharded and its accumulation freed as it is reduced) + the
                    largest fp32 reduce-scatter input
  end of backward   all sharded gradients (the schedule's buffers stay until the next step)
Schedule buffers: ``PipelineStage`` allocates, for EVERY micro-batch of the step, a receive buffer
per stage input (not on the first stage) and per output gradient (not on the last): per micro-batch
and token a*D for the hidden states, twice with MTP (the next-token embeddings travel along), for
each of these. (The trainer steps the schedule with ``return_outputs=False``, so the last stage
keeps no ``output_chunks``.) In flight: every (stage, micro-batch) a rank has run forward but not
yet finished backward holds its stage's activations. 1F1B: stage s holds min(n_mb, pp - s)
micro-batches; GPipe: n_mb; multi-stage schedules (Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble, ZBVZeroBubble, DualPipeV): the real schedule object is built on the fake
pipeline group and its action list for this rank is replayed (F adds a chunk, B or W frees it; I
keeps it, since the weight gradient still needs the inputs); the chunks alive at the peak are used.

Saved activations (bytes per token of one micro-batch; ``a`` = bytes of ``param_dtype``, D hidden, H
heads, r = q_lora_rank, c = kv_lora_rank, p = qk_rope_head_dim, n = qk_nope_head_dim, v =
v_head_dim, K = index_topk, E experts, k = num_experts_per_tok, F = moe_intermediate_size, Fd =
intermediate_size, Fs = shared width, L = ``expert_load_factor``: routed rows a rank's experts
receive over the mean). Triton DSA backend assumed (``sparse_mla`` saves q, kv, indices, their valid
extent, out, lse); the indexer runs under no_grad (no indexer loss); an RMSNorm keeps its input, its
fp32 rstd and the normalised copy its weight multiplies:

  none       every tensor autograd keeps, per block:
             attention  a*(3D + 3r + H(n+p) + 2(c+p) + c + H(c+p) + Hc + Hv) + 4H (lse)
                        + 16 (3 rstd, extent) + 8p (complex RoPE tables of q and k)
                        + 4K on full layers (the int32 top-k; shared layers reference the same
                        tensor) + on the dense-prefix rows (min(K, S) of each sequence of S
                        tokens: one document per row assumed; packed documents of K to 2K
                        tokens put a larger share of rows there) a*(H(2(n+p) + 2v + n) + c)
                        + 4H (SDPA's q and k, v inside the wkv_b output, out, lse; the gathered
                        latents)
                        (3D: norm input, normalised copy, output; 3r: the q_norm's; (c+p) + c:
                        the kv_norm's; H(c+p): the latent query, a*Hp instead with
                        ``recompute_latent_query``, the default, in a block that is not
                        checkpointed: rebuilt in backward, its rope part kept)
             dense MLP  a*(3D + 4Fd) + 4;  MoE  a*3D + 4 + 4D + 4E (fp32 router input, scores)
                        + 32k (int64 routing indices, fp32 combine weights; + 16kL under EP:
                        the permutations)
                        + L*a*(kD + 4kF) (routed token copies, expert intermediates)
                        + a*kD + 12k (the combine's token-ordered copy of the routed rows, its
                        permutation and weights) + a*4Fs (shared expert); with
                        ``[moe] recompute_expert_inputs`` (default) L*a*2kF instead of
                        L*a*(kD + 4kF), L*a*(kD + 2kF) under EP (the received rows are kept)
  full       the block input a*D, plus 4K on full layers (the top-k a checkpointed full block
             returns is kept by the shared blocks' checkpoints)
  selective "op" (the policy of ``parallelize.py``): block input a*D, 4K on full layers, and the
             outputs of the matmuls with a tracked input and of the EP all-to-alls: attention a*(r +
             H(n+p) + (c+p) + D) + a*H(n+v) on the dense-prefix rows; dense MLP a*(2Fd + D); MoE 4E
             + a*(2Fs + D) + L*a*(2kF + kD) + EP only: L*a*kD (dispatch all-to-all) + a*kD (combine
             all-to-all); an integer N: every N-th block (1-based, forward order) as "full", the
             others as "none"
  extras     held through the whole backward of the micro-batch: 8 (positions) [+ 8 token ids on the
             first stage] + a*D with MTP (next-token embeddings; + a*D for the copy a middle stage
             sends on); not last
             stage: + a*D (stage output kept by the schedule); last stage: + a*3D + 4 (final norm:
             input, normalised copy, output) and, with MTP, + a*7D + 12 (enorm and hnorm copies,
             their concat, MTP norm) + the MTP block (a full MoE block). With
             ``mtp_token_chunk`` below the micro-batch's tokens the MTP layer's token-wise parts
             run in recomputed chunks: + a*2D instead of a*7D + 12 (the MTP norm's input and the
             MTP head's gradient; the input projection keeps only its rows, held anyway), and its
             block's MLP counts as ``mlp_token_chunk`` counts the main blocks' (at the MTP
             layer's chunk size). (All of these are freed after the MTP layer's backward: counting
             them through the whole backward is an upper bound.)
  logits     none kept, pipelined or not: the head runs the fused chunked loss (model/head.py; the
             trainer's, and the last pipeline stage's loss function), which keeps only the gradients
             it formed (see head)

Backward bytes of a step (on top of what it saved):
  block      a checkpointed block ("full", "op") rebuilds its "none" set while its own saved
             tensors are still held (for "op" the cached ones are shared: counted twice, an
             upper bound), plus the larger of the attention's and the MLP's backward workspace
             (they run one after the other):
             attention  a*H(2c+p) (gradient of the latent output, dQ) + 4(c+p) (fp32 dKV)
                        + 3aD (residual and input gradients) + a*H(c+p) where the latent query
                        is rebuilt, plus the DSA kernels' scratch: min(1 GiB, 2HKa per token)
                        (P and dS of the split backward; the indexer's 1 GiB score scratch of a
                        recompute comes before them); with the dense prefix, per prefix row
                        a*H(2(n+p) + 3v + n) (its output gradient, dQ, dK, dV, the wkv_b
                        output's gradient) and per token a*H(n+p) (the gathered queries'
                        full-size gradient), n = qk_nope_head_dim, p = qk_rope_head_dim,
                        v = v_head_dim
             MoE        3aD + the largest moment of the routed path (``moe_backward_peak``), walked
                        in the order autograd runs it with the saved tensors each step frees
                        subtracted (u = a*k per token, l = L*a*k on the experts' side, R: silu and
                        its product rebuilt, X: the gathered rows rebuilt, i.e.
                        ``recompute_expert_inputs`` in a block that is not checkpointed, without
                        EP): the shared expert 2aFs; the combine uD + 4k (its one-pass backward: the
                        rows' gradient and the weights' fp32 gradient), under EP lD (the
                        all-to-all); then with h = lD - uD: the down projection h + 2lF (R) / h +
                        lF, the product h + lF - lD + 3lF (R) / h - lD + 2lF, silu, the gate/up
                        GEMM's input gradient (one GEMM of the stacked ``w13``; + lD rebuilt rows
                        with X) and the [T, D] gradient back to the tokens (+ uD under EP). (The
                        SwiGLU steps are written for the unfused SwiGLU, which kept silu's output;
                        the fused SwiGLU of model/moe.py keeps and forms none, so they over-count by
                        lF, and the saved set by a*kF per token without R.) On an H200 (eager, bf16,
                        grouped GEMMs, 8192 tokens, three widths, rebuilt or kept;
                        tests/unit/test_moe_backward_memory.py) a MoE block's backward peaked
                        0.19-0.86 of T x (this term + 3aD) + its gradients above its start (0.41 /
                        0.86 at the proxy's widths, with the one-pass combine and the stacked
                        gate/up weight; bench/results/2026-12-02_h200_memory.md)
             dense MLP  a*(3Fd + 3D)
  head       the fused loss (model/head.py) forms each chunk's gradients at the end of forward, with
             every activation still held: one chunk of min(tokens, LOSS_CHUNK) tokens x vocab x 8
             (the fp32 logits and logsumexp's fp32 temporary; later the fp32 gradient and its
             param_dtype copy), plus the head weight's unsharded gradient, which it forms there and
             keeps until backward (where a scaled copy of it is made: the larger of the chunk and
             that copy is counted); with MTP the second loss runs while the first one's gradient is
             held. Counted in the head's backward step (the same tensors, all alive)

Context parallelism (``cp`` > 1, docs/context_parallel.md): every count above is per LOCAL token (a
micro-batch holds ``seq_len / cp`` tokens of each sequence per rank; the pipeline buffers and the
loss chunk too), the dense prefix's share is 0 (its rows run on the sparse kernels), the FSDP shards
are read from the real dp_shard x cp mesh, and the gathered key state of the global ``seq_len``
tokens, w = c + p latent values (and d_I = index_head_dim indexer values on layers with an indexer),
adds per local token:
  saved      a*(cp - 1)*w in a block that is not checkpointed ("none"): the sparse attention
             keeps the gathered latent rows (cp per local token) where it kept the local ones;
             nothing in "full" or "op" (the gather is recomputed, not kept: keeping it would
             grow the op policy's saved set with the CP degree)
  backward   (cp - 1)*4w (the fp32 gradient of the gathered rows beyond the local ones)
             + (2cp + 1)*a*w (that gradient in param_dtype, the laid-order buffer it is
             reordered into for the reduce-scatter, the reduce-scatter's output) + on indexer
             layers 2cp*a*d_I (the gathered indexer keys and their laid copy, alive in a
             recompute's top-k; counted at the backward's peak, an upper bound)
             (``cp_key_state_bytes``); a recompute's "none" set includes the saved term. The
             indexer's score scratch stays bounded by its 1 GiB budget (its rows are the global
             document lengths wide, so fewer rows fit), and comes before the sparse backward's.
  extras     8 (the local rows' global rows)

Checked against ``torch.cuda.max_memory_allocated`` on H200s
(bench/results/2026-12-02_h200_memory.md, "The measured peaks the plan is checked against";
tests/unit/test_plan_memory.py): the estimate is above every measured peak, by 0.3-4.3% on one GPU
without MTP and 5.0-5.1% on two; the MTP runs (before the gather-based MoE combine lowered real
peaks) by 5.4% on one GPU and 11.6% on two. The peaks with the Triton loss kernel are at or below
those. With the masters in the optimizer (one GPU, compiled and eager): 0.4-11.9% above 24 measured
peaks (4K: 3-5%, 16K: 0.4-8%, 32K: 3-12%), 26.5% above the 25th ("op" selective checkpointing at
32K); the same cells planned as FSDP on one rank are 2.5-7.1 GiB higher. By phase
(``bench/memory_phases.py``, eager, 32K AC none): each phase planned 0.5-8.1 GiB above its measured
peak (the MoE blocks 4.8-5.3, the dense first block with the embedding 8.1).

Not modelled: CUDA context and NCCL buffers (~1-3 GiB, outside the caching allocator), allocator
fragmentation (reserved over allocated), the indexer KL loss (``dsa.indexer_loss_coeff > 0`` saves
the indexer's q/k/weights, and under context parallelism its gathered keys and their gradient),
expert load imbalance beyond ``expert_load_factor``, torch.compile
buffers, a non-fused optimizer's temporaries (foreach AdamW allocates copies of the gradient/state
lists). The stated headroom is meant to cover these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from titan_glm52.model.args import GLM52ModelArgs
from titan_glm52.model.head import LOSS_CHUNK

GIB = 1024**3
PARAM_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# a request's dtype names (param_dtype, state_dtype) as the job config spells them: "bfloat16", ...
CONFIG_DTYPE = {name: str(dtype).removeprefix("torch.") for name, dtype in PARAM_DTYPES.items()}


# ===================================================================================== request /
# report
@dataclass(frozen=True)
class MemoryRequest:
    """What to plan: the model, the world and its degrees, the pipeline, the batch and the
    budget."""

    args: GLM52ModelArgs
    gpus: int
    pp: int = 1
    ep: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: the ranks left over
    schedule: str = "1F1B"
    stages_per_rank: int | None = None
    layers_per_stage: tuple[int, ...] | None = None
    seq_len: int = 4096
    local_batch_size: int = 1
    microbatch_size: int = 1
    ac_mode: str = "full"
    selective_ac_option: str = "op"
    param_dtype: str = "bf16"
    reshard_after_forward: str = "default"
    with_mtp: bool = True
    gpu_memory_gib: float = 141.0
    headroom: float = 0.10
    expert_load_factor: float = 1.0
    dense_prefix: bool = True  # [dsa] dense_prefix
    dense_masked_ratio: float = 0.0  # [dsa] dense_masked_ratio (used with dense_prefix)
    recompute_expert_inputs: bool = True  # [moe] recompute_expert_inputs
    recompute_latent_query: bool = True  # [dsa] recompute_latent_query
    mlp_token_chunk: int = 0  # [activation_checkpoint] mlp_token_chunk
    mtp_token_chunk: int = 0  # [activation_checkpoint] mtp_token_chunk
    # training.master_weights as resolved: "fsdp" or "optimizer" (one process)
    master_weights: str = "fsdp"
    # more than one micro-batch per optimizer step (training.global_batch_size)
    grad_accumulation: bool = False
    # [parallelism] context_parallel_degree: every sequence split over this many ranks
    cp: int = 1
    # [optimizer] state_dtype: Adam's two moments in "fp32" or "bf16"
    state_dtype: str = "fp32"

    @property
    def budget_bytes(self) -> float:
        return self.gpu_memory_gib * GIB * (1.0 - self.headroom)


@dataclass(frozen=True)
class Phase:
    """The bytes that change over a step, at one moment of it (module docstring, "Peak"); params and
    AdamW states are held the whole step and live in ``RankMemory``."""

    name: str
    grads: float = 0.0  # fp32 sharded gradients already reduced
    unsharded: float = 0.0  # FSDP all-gather outputs in param_dtype
    grad_accum: float = 0.0  # unsharded fp32 gradient accumulation (pipeline)
    activations: float = 0.0  # saved activations still held
    transient: float = 0.0  # recompute, backward workspace, loss chunk, FSDP gradient buffers

    @property
    def total(self) -> float:
        return self.grads + self.unsharded + self.grad_accum + self.activations + self.transient


@dataclass
class RankMemory:
    """Bytes of one representative rank (every rank of its pipeline rank holds the same) at its peak
    phase: the columns are what is alive at that moment, so they add up to the peak."""

    pp_rank: int
    rank: int
    stages: tuple[int, ...]
    layers: tuple[range, ...]
    local_params: int  # padded local elements (fp32 master)
    trainable_params: int
    params: float
    grads: float
    optimizer: float
    unsharded: float
    grad_accum: float
    activations: float
    transient: float
    in_flight: int  # (stage, micro-batch) chunks held at the activation peak
    units: int  # FSDP units on this rank
    phase: str = ""  # the phase of the peak
    phases: tuple[Phase, ...] = ()  # every phase considered, in step order

    @property
    def total(self) -> float:
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.unsharded
            + self.grad_accum
            + self.activations
            + self.transient
        )


@dataclass
class MemoryReport:
    request: MemoryRequest
    layers_per_stage: tuple[int, ...]
    stage_to_rank: tuple[int, ...]
    schedule: str
    stages_per_rank: int
    dp_shard: int
    efsdp: int
    n_microbatches: int
    tokens_per_microbatch: int
    ranks: list[RankMemory] = field(default_factory=list)

    @property
    def budget(self) -> float:
        return self.request.budget_bytes

    @property
    def fits(self) -> bool:
        return all(r.total <= self.budget for r in self.ranks)

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)


# ===================================================================================== activations
def block_bytes_per_token(
    args: GLM52ModelArgs,
    layer_id: int,
    mode: str,
    act_bytes: int,
    load: float = 1.0,
    ep: bool = True,
    prefix_share: float = 0.0,
    recompute_experts: bool = False,
    recompute_query: bool = False,
    mlp_chunked: bool = False,
    cp: int = 1,
) -> float:
    """Saved activation bytes per token of one block under an AC mode ("none" | "full" | "op"); see
    the module docstring for the terms. ``layer_id == num_hidden_layers`` is the MTP block.
    ``prefix_share``: the share of rows on the dense prefix (``[dsa] dense_prefix``).
    ``recompute_experts``: ``[moe] recompute_expert_inputs``, ``recompute_query``: ``[dsa]
    recompute_latent_query`` (both act in blocks that are not checkpointed, "none").
    ``mlp_chunked``: ``[activation_checkpoint] mlp_token_chunk`` splits this block's tokens: the MLP
    keeps only its input (and, in a MoE layer, each chunk's routing, 12k) and rebuilds the rest in
    backward. ``cp``: the context-parallel degree (per local
    token, the sparse attention keeps the gathered latent rows of ``cp`` tokens)."""
    a, d, h = act_bytes, args.hidden_size, args.num_attention_heads
    r, c, p = args.q_lora_rank, args.kv_lora_rank, args.qk_rope_head_dim
    n, v, kk = args.qk_nope_head_dim, args.v_head_dim, args.index_topk
    e, k, f = args.n_routed_experts, args.num_experts_per_tok, args.moe_intermediate_size
    fd, fs = args.intermediate_size, args.moe_intermediate_size * args.n_shared_experts
    moe, full = args.is_moe_layer(layer_id), args.index_share.has_indexer(layer_id)
    topk = 4 * kk if full else 0
    if mode == "full":
        return a * d + topk
    if mode == "none":
        latent_q = h * p if recompute_query else h * (c + p)  # rebuilt: its rope part stays
        attn = (
            a * (3 * d + 3 * r + h * (n + p) + (1 + cp) * (c + p) + c + latent_q + h * c + h * v)
            + 4 * h
            + 16
            + 8 * p
            + topk
            + prefix_share * (a * (h * (2 * (n + p) + 2 * v + n) + c) + 4 * h)
        )
        if moe:
            ints = 32 * k + (16 * k * load if ep else 0)
            # the routed token copies (kept under EP, regathered without it) and the experts'
            # intermediates (gate and up outputs, and silu and the product unless recomputed)
            routed = (k * d if ep or not recompute_experts else 0) + (
                2 if recompute_experts else 4
            ) * k * f
            routed_saved = ints + load * a * routed + a * k * d
            # the token chunks run the routed and the shared experts (model/moe.py)
            experts = 0.0 if mlp_chunked else routed_saved + a * 4 * fs
            mlp = a * 3 * d + 4 + 4 * d + 4 * e + experts + 12 * k
        else:
            mlp = a * 3 * d + 4 + (0.0 if mlp_chunked else a * 4 * fd)
        return attn + mlp
    if mode == "op":
        attn = a * (r + h * (n + p) + (c + p) + d) + prefix_share * a * h * (n + v)
        if moe:
            dispatch = load * a * k * d if ep else 0.0
            combine = a * k * d if ep else 0.0
            mlp = 4 * e + a * (2 * fs + d) + dispatch + load * a * (2 * k * f + k * d) + combine
        else:
            mlp = a * (2 * fd + d)
        return a * d + topk + attn + mlp
    raise ValueError(f"unknown activation mode {mode!r}")


def _block_modes(ac_mode: str, selective_option: str, n_blocks: int) -> list[str]:
    """The AC treatment of each block of a stage, in forward order, as ``parallelize.apply_ac``
    applies it."""
    if ac_mode == "none":
        return ["none"] * n_blocks
    if ac_mode == "full":
        return ["full"] * n_blocks
    if ac_mode != "selective":
        raise ValueError(
            f"activation checkpointing mode {ac_mode!r}: choose none, full or selective"
        )
    if selective_option == "op":
        return ["op"] * n_blocks
    if str(selective_option).isdigit() and int(selective_option) >= 1:
        every = int(selective_option)
        return ["full" if i % every == 0 else "none" for i in range(1, n_blocks + 1)]
    raise ValueError(f"selective AC option {selective_option!r}: use 'op' or a positive integer N")


# The DSA kernels' fixed scratch: kernels/sparse_mla.py SCRATCH_BYTES (P and dS of one chunk of
# queries in the backward) and kernels/indexer_topk.py SCRATCH_BYTES (fp32 scores + stash of one
# chunk of queries).
DSA_SCRATCH_BYTES = 1 << 30


def moe_backward_peak(
    args: GLM52ModelArgs,
    act_bytes: int,
    load: float = 1.0,
    ep: bool = False,
    recompute_experts: bool = False,
) -> float:
    """Bytes per token a MoE block's routed path holds at the largest moment of its backward beyond
    its saved set at the start, in the order autograd runs it (module docstring, "MoE"): the saved
    tensors each step frees are subtracted, the gradients and rebuilt inputs it forms added.
    ``recompute_experts``: the experts rebuild silu and its product (and, without EP, their gathered
    input rows) in backward."""
    a, d, k, f = act_bytes, args.hidden_size, args.num_experts_per_tok, args.moe_intermediate_size
    u, el = a * k, load * a * k  # one value per routed row: on the token side, on the experts' side
    rebuild_h, rebuild_x = recompute_experts, recompute_experts and not ep
    # shared expert first (autograd runs the nodes formed last first): its product's two factor
    # gradients
    fs = f * args.n_shared_experts
    # then the combine (one pass, model/moe.py ``combine_routed``): the rows' gradient and the
    # weights' fp32 gradient; EP: the gradient's all-to-all
    peaks = [2 * a * fs, u * d + 4 * k, el * d]
    held = el * d - u * d  # the expert outputs' gradient; the combine's token-order rows freed
    # down projection: its input gradient, with the rebuilt product (and silu's output while it
    # forms it)
    peaks.append(held + (2 if rebuild_h else 1) * el * f)
    held += (el * f if rebuild_h else 0) - el * d
    # the product: both factors' gradients (and silu's output, rebuilt); its output gradient and
    # factors freed
    peaks.append(held + (3 if rebuild_h else 2) * el * f)
    held -= 0 if rebuild_h else el * f
    # silu: the gate's gradient; the product's gradient and the gate freed
    peaks.append(held + el * f)
    held -= el * f
    # the gate/up GEMM (one, ``w13``): the input gradient (with the gathered rows rebuilt)
    x = el * d if rebuild_x else 0
    peaks.append(held + x + el * d)
    held += el * d - 2 * el * f - (0 if rebuild_x else el * d)
    # back to the tokens: the gather's (or, under EP, the dispatch all-to-all's) [T, D] gradient
    peaks.append(held + (u * d if ep else 0) + a * d)
    return max(peaks)


def backward_workspace(
    args: GLM52ModelArgs,
    layer_id: int,
    tokens: int,
    act_bytes: int,
    load: float = 1.0,
    prefix_share: float = 0.0,
    recompute_experts: bool = False,
    ep: bool = False,
    recompute_query: bool = False,
    moe_chunk: int = 0,
    cp: int = 1,
) -> float:
    """Bytes a block's backward allocates on top of the activations it saved (or recomputed), at its
    largest moment, for ``tokens`` tokens: the larger of the attention's and the MLP's (they run one
    after the other; see the module docstring for the terms). ``prefix_share``: the share of rows on
    the dense prefix. ``moe_chunk`` (``[activation_checkpoint] mlp_token_chunk``, when below
    ``tokens``): the routed path's backward holds one chunk's rebuilt activations and workspace at a
    time; ``cp``: the context-parallel degree (``tokens`` are this
    rank's)."""
    a, d, h = act_bytes, args.hidden_size, args.num_attention_heads
    c, p, kk = args.kv_lora_rank, args.qk_rope_head_dim, args.index_topk
    n, v = args.qk_nope_head_dim, args.v_head_dim
    fd = args.intermediate_size
    attn = tokens * (
        a * h * (2 * c + p) + 4 * (c + p) + 3 * a * d + (a * h * (c + p) if recompute_query else 0)
    ) + min(DSA_SCRATCH_BYTES, tokens * 2 * h * kk * a)
    if prefix_share > 0:
        attn += tokens * a * h * (prefix_share * (2 * (n + p) + 3 * v + n) + n + p)
    attn += tokens * cp_key_state_bytes(args, layer_id, a, cp)
    if args.is_moe_layer(layer_id) and 0 < moe_chunk < tokens:
        rebuilt = block_bytes_per_token(
            args, layer_id, "none", a, load, ep, 0.0, recompute_experts
        ) - (
            block_bytes_per_token(
                args, layer_id, "none", a, load, ep, 0.0, recompute_experts, False, True
            )
        )
        mlp = moe_chunk * (moe_backward_peak(args, a, load, ep, recompute_experts) + rebuilt)
        mlp += tokens * 3 * a * d
    elif args.is_moe_layer(layer_id):
        mlp = tokens * (moe_backward_peak(args, a, load, ep, recompute_experts) + 3 * a * d)
    elif 0 < moe_chunk < tokens:  # a chunk's rebuilt intermediates (4F) and its backward (3F)
        mlp = moe_chunk * a * 7 * fd + tokens * a * 3 * d
    else:
        mlp = tokens * a * (3 * fd + 3 * d)
    return max(attn, mlp)


def cp_key_state_bytes(args: GLM52ModelArgs, layer_id: int, act_bytes: int, cp: int) -> float:
    """Bytes per local token that context parallelism adds to a block's backward (0 at ``cp`` 1;
    module docstring, "Context parallelism"): the fp32 gradient of the gathered latent rows beyond
    the local ones, that gradient in ``act_bytes`` and the laid-order buffer it is reordered into,
    the reduce-scatter's output, and on layers with an indexer its gathered keys and their laid
    copy (a recompute's top-k; counted as if alive at the backward's peak)."""
    if cp == 1:
        return 0.0
    a, w = act_bytes, args.kv_lora_rank + args.qk_rope_head_dim
    extra = (cp - 1) * 4 * w + (2 * cp + 1) * a * w
    if args.index_share.has_indexer(layer_id):
        extra += 2 * cp * a * args.index_head_dim
    return extra


def loss_chunk_bytes(args: GLM52ModelArgs, tokens: int) -> float:
    """The fused loss on one chunk (model/head.py): the fp32 [chunk, vocab] logits and logsumexp's
    fp32 temporary (after them, the fp32 gradient and its param_dtype copy, no more). That is the
    torch path; on CUDA the Triton kernel (kernels/cross_entropy.py) needs only the param_dtype
    logits, so this is an upper bound there (the measured 1-GPU peaks fell by up to 2.9 GiB with it;
    the plan keeps the bound)."""
    return 8.0 * min(tokens, LOSS_CHUNK) * args.vocab_size


@dataclass(frozen=True)
class BlockActivations:
    layer_id: int  # num_hidden_layers = the MTP block
    mode: str  # "none" | "full" | "op"
    saved: float  # bytes per token kept from its forward to its backward
    # bytes alive on top of ``saved`` while its backward runs (recompute + workspace), all tokens
    backward: float


@dataclass(frozen=True)
class StageActivations:
    # bytes per token held through the whole backward of a micro-batch (stage boundary, norms, ...)
    extras: float
    blocks: tuple[BlockActivations, ...]  # forward order, the MTP block last
    head: float  # bytes of the loss chunk's backward on the stage with the head, else 0

    @property
    def saved_per_token(self) -> float:
        """Kept per in-flight micro-batch: the blocks' saved activations and the extras."""
        return self.extras + sum(b.saved for b in self.blocks)


def stage_activations(
    args: GLM52ModelArgs,
    layer_ids: range,
    is_first: bool,
    is_last: bool,
    with_mtp: bool,
    ac_mode: str,
    selective_option: str,
    act_bytes: int,
    load: float,
    ep: bool,
    tokens: int,
    prefix_share: float = 0.0,
    mask_per_token: float = 0.0,
    recompute_experts: bool = False,
    recompute_query: bool = False,
    moe_chunk: int = 0,
    cp: int = 1,
    mtp_chunk: int = 0,
) -> StageActivations:
    """Activations of one pipeline stage for micro-batches of ``tokens`` tokens (this rank's, under
    context parallelism of degree ``cp``; module docstring). ``mask_per_token``: the masked dense
    rows' selection mask, bytes per token of every block (saved with its attention, or rebuilt by
    its recompute). ``moe_chunk``: ``[activation_checkpoint] mlp_token_chunk``; ``mtp_chunk``:
    ``[activation_checkpoint] mtp_token_chunk`` (the MTP layer's, in place of ``moe_chunk``)."""
    a, d = act_bytes, args.hidden_size
    ids = list(layer_ids) + ([args.num_hidden_layers] if is_last and with_mtp else [])
    modes = _block_modes(ac_mode, selective_option, len(ids))
    blocks = []
    for b, m in zip(ids, modes):
        chunk = mtp_chunk if b == args.num_hidden_layers and mtp_chunk else moe_chunk
        # A checkpointed block ("full", "op") rebuilds its "none" set in backward while its own
        # saved tensors are still held (for "op" the cached ones are shared: counted twice, an upper
        # bound). (The experts' and the latent query's rebuilds act only in blocks that are not
        # checkpointed: model/recompute.py, can_recompute.)
        lean, lean_q = recompute_experts and m == "none", recompute_query and m == "none"
        chunked = 0 < chunk < tokens
        none = (
            block_bytes_per_token(
                args, b, "none", a, load, ep, prefix_share, lean, lean_q, chunked, cp
            )
            + mask_per_token
        )
        saved = (
            none if m == "none" else block_bytes_per_token(args, b, m, a, load, ep, prefix_share)
        )
        recompute = none if m != "none" else 0.0
        work = backward_workspace(
            args, b, tokens, a, load, prefix_share, lean, ep, lean_q, chunk, cp
        )
        blocks.append(BlockActivations(b, m, saved, tokens * recompute + work))
    extras = 8 + (a * d if with_mtp else 0)  # positions; next-token embeddings
    if cp > 1:
        extras += 8  # the local rows' global rows (CPContext.rows)
    if is_first:
        extras += 8  # token ids (the embedding backward)
    if not is_last:
        extras += a * d  # the stage output, kept for its backward
        if with_mtp and not is_first:
            extras += a * d  # the copy of the next-token embeddings it sends on
    else:
        extras += 3 * a * d + 4  # final norm: input, normalised copy, output (the head's chunks)
        if with_mtp and 0 < mtp_chunk < tokens:
            # the chunks keep their rows: the MTP norm's input, and the MTP head's gradient
            extras += 2 * a * d
        elif with_mtp:
            # enorm and hnorm normalised copies, concat (2D), MTP norm (3D)
            extras += 7 * a * d + 12
    return StageActivations(
        extras, tuple(blocks), loss_chunk_bytes(args, tokens) if is_last else 0.0
    )


# ===================================================================================== in-flight
# chunks
def _replay_peak(actions, chunk_bytes: dict[int, float]) -> list[int]:
    """The stages of the (stage, micro-batch) chunks alive at the byte peak while replaying one
    rank's actions."""
    from torch.distributed.pipelining.schedules import _ComputationType as C

    alive: set[tuple[int, int]] = set()
    peak, at_peak = -1.0, []

    def step(action) -> None:
        nonlocal peak, at_peak
        kind = action.computation_type
        if kind == C.OVERLAP_F_B:
            for sub in action.sub_actions:  # forward first: the conservative order
                step(sub)
            return
        key = (action.stage_index, action.microbatch_index)
        if kind == C.FORWARD:
            alive.add(key)
            total = sum(chunk_bytes[s] for s, _ in alive)
            if total > peak:
                peak, at_peak = total, sorted(s for s, _ in alive)
        elif kind in (C.FULL_BACKWARD, C.BACKWARD_WEIGHT):
            alive.discard(key)

    for action in actions:
        if action is not None:
            step(action)
    return at_peak


def _multi_stage_peak(
    schedule: str,
    pp_group,
    pp_rank: int,
    stage_ids: tuple[int, ...],
    num_stages: int,
    n_microbatches: int,
    chunk_bytes: dict[int, float],
) -> list[int]:
    """Builds the real multi-stage schedule for this rank's stages on the (fake) pipeline group and
    replays it."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    stages = [
        PipelineStage(
            nn.Linear(1, 1, device="meta"), s, num_stages, torch.device("cpu"), group=pp_group
        )
        for s in stage_ids
    ]
    try:
        sched = get_schedule_class(schedule)(
            stages, n_microbatches=n_microbatches, loss_fn=lambda out, tgt: out, scale_grads=False
        )
    except (ValueError, RuntimeError, AssertionError) as e:
        raise ValueError(
            f"schedule {schedule} with {n_microbatches} micro-batches and {num_stages} stages: {e}"
        ) from e
    return _replay_peak(sched.pipeline_order[pp_rank], chunk_bytes)


# ===================================================================================== FSDP reading
@dataclass
class _Unit:
    name: str
    local: int  # padded sharded elements
    trainable: int
    unsharded: int  # all-gather output elements (padded)
    grad_unsharded: int = 0  # of which trainable: the unsharded gradient's elements


def _fsdp_units(model: nn.Module) -> tuple[list[_Unit], int, int]:
    """FSDP units of a parallelized module, and the local/trainable elements of parameters FSDP does
    not manage."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    units, managed = [], set()
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state = fully_shard.state(module)
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
        for group in groups:
            unit = _Unit(name or "<root>", 0, 0, 0)
            for fp in group.fsdp_params:
                padded = math.prod(fp.padded_sharded_param_size)
                unit.local += padded
                unit.unsharded += padded * fp.mesh_info.shard_mesh_size
                if fp.sharded_param.requires_grad:
                    unit.trainable += padded
                    unit.grad_unsharded += padded * fp.mesh_info.shard_mesh_size
                managed.add(id(fp.sharded_param))
            units.append(unit)
    local = trainable = 0
    for p in model.parameters():
        if id(p) in managed:
            continue
        numel = (p.to_local() if isinstance(p, DTensor) else p).numel()
        local += numel
        trainable += numel if p.requires_grad else 0
    return units, local, trainable


# ===================================================================================== the backward
# walk
@dataclass
class _Step:
    """What runs backward together: the head, the MTP layer, the final norm (root unit), one block
    (its unit and, under EP, its experts' unit) or the embedding; with the saved bytes per token its
    backward frees and the bytes alive on top while it runs."""

    name: str
    units: list[_Unit] = field(default_factory=list)
    saved: float = 0.0
    backward: float = 0.0
    # The root module (final norm) and the embedding take token ids (no gradient), so FSDP has no
    # input to hook their post-backward on: it runs in the final callback, at the end of backward.
    deferred: bool = False

    @property
    def unsharded(self) -> int:
        return sum(u.unsharded for u in self.units)

    @property
    def grad_unsharded(self) -> int:
        return sum(u.grad_unsharded for u in self.units)

    @property
    def trainable(self) -> int:
        return sum(u.trainable for u in self.units)


def _step_key(unit_name: str):
    parts = unit_name.split(".")
    if unit_name == "output":
        return "head"
    if parts[0] == "mtp":
        return "mtp"
    if parts[0] == "layers":
        return int(parts[1])
    if parts[0] == "tok_embeddings":
        return "embedding"
    return "norm"  # the root unit: the final norm (nothing on a stage without it)


def _backward_steps(
    args: GLM52ModelArgs, units: list[_Unit], acts: StageActivations
) -> list[_Step]:
    """One stage's backward, in order: head, MTP layer, final norm, blocks last to first,
    embedding."""
    steps: dict = {
        "head": _Step("head", backward=acts.head),
        "mtp": _Step("MTP layer"),
        "norm": _Step("final norm", deferred=True),
    }
    for b in reversed(acts.blocks):
        key = "mtp" if b.layer_id >= args.num_hidden_layers else b.layer_id
        step = steps.setdefault(key, _Step(f"layer {b.layer_id}"))
        step.saved, step.backward = b.saved, b.backward
    steps["embedding"] = _Step("embedding", deferred=True)
    for u in units:
        key = _step_key(u.name)
        steps.setdefault(key, _Step(str(key))).units.append(u)
    return [st for st in steps.values() if st.units or st.saved or st.backward]


def _head_work(st: _Step, a: int, head_calls: int) -> float:
    """The fused loss (model/head.py) beyond one unsharded gradient of the head: at the end of
    forward a loss chunk's transient, in backward the scaled copy of the gradient it formed; with
    MTP the other loss's gradient, held from forward."""
    return max(st.backward, a * st.grad_unsharded) + (head_calls - 1) * a * st.grad_unsharded


def _unpipelined_phases(
    steps: list[_Step],
    extras: float,
    tokens: int,
    a: int,
    keep_all: bool,
    head_calls: int,
    loose_grads: float,
) -> list[Phase]:
    """Walks the backward of the one micro-batch (module docstring, "Peak", without pipeline
    parallelism)."""
    phases = []
    grads = loose_grads  # gradients of parameters FSDP does not manage: counted from the start
    prev_rs = 0.0  # the last reduce-scatter input, freed when the next reduce-scatter starts
    deferred: list[_Step] = []  # steps whose post-backward waits for the end of backward
    for i, st in enumerate(steps):
        later = steps[i:]
        live = (
            sum(x.unsharded for x in later)
            if keep_all
            else sum(x.unsharded for x in steps[i : i + 2])
        )
        live += sum(x.unsharded for x in deferred)
        waiting = a * sum(x.grad_unsharded for x in deferred)
        acts = tokens * (extras + sum(x.saved for x in later))
        held_grads, held_rs = grads, prev_rs
        work = st.backward
        if st.name == "head":
            work = _head_work(st, a, head_calls)
            if head_calls > 1:
                # Each loss (main, MTP) reduce-scatters its own gradient: the later one runs with
                # the earlier one's sharded gradient and reduce-scatter input alive.
                held_grads, held_rs = grads + 4.0 * st.trainable, 4.0 * st.grad_unsharded
        # While it runs: its transient and its unsharded param_dtype gradient.
        phases.append(
            Phase(
                f"backward {st.name}",
                held_grads,
                a * live,
                0.0,
                acts,
                work + a * st.grad_unsharded + held_rs + waiting,
            )
        )
        if st.deferred:
            deferred.append(st)
            continue
        # Post-backward: reshard, free the previous reduce-scatter input, copy the gradient into an
        # fp32 one.
        phases.append(
            Phase(
                f"reduce-scatter {st.name}",
                grads,
                a * (live - st.unsharded),
                0.0,
                acts - tokens * st.saved,
                (a + 4.0) * st.grad_unsharded + waiting,
            )
        )
        grads += 4.0 * st.trainable
        prev_rs = 4.0 * st.grad_unsharded
    for j, st in enumerate(deferred):  # the final callback: root first, then the embedding
        rest = deferred[j:]
        phases.append(
            Phase(
                f"reduce-scatter {st.name}",
                grads,
                a * sum(x.unsharded for x in rest[1:]),
                0.0,
                0.0,
                a * sum(x.grad_unsharded for x in rest) + 4.0 * st.grad_unsharded,
            )
        )
        grads += 4.0 * st.trainable
        prev_rs = 4.0 * st.grad_unsharded
    phases.append(Phase("end of backward", grads, 0.0, 0.0, 0.0, prev_rs))
    return phases


def _master_phases(
    steps: list[_Step],
    extras: float,
    tokens: int,
    a: int,
    head_calls: int,
    loose_trainable: int,
    trainable: int,
    accumulate: bool,
) -> list[Phase]:
    """Walks the backward of one process whose optimizer holds the masters (module docstring,
    "Masters in the optimizer"): no FSDP buffers; each step's bf16 gradient stays in place, or goes
    into an fp32 sum when accumulating."""
    phases = []
    grads = 4.0 * trainable if accumulate else a * loose_trainable
    for i, st in enumerate(steps):
        acts = tokens * (extras + sum(x.saved for x in steps[i:]))
        work = _head_work(st, a, head_calls) if st.name == "head" else st.backward
        phases.append(Phase(f"backward {st.name}", grads, 0.0, 0.0, acts, work + a * st.trainable))
        if not accumulate:
            grads += a * st.trainable
    phases.append(Phase("end of backward", grads))
    return phases


def _pipelined_phases(
    steps: dict[int, list[_Step]],
    acts: list[StageActivations],
    alive: list[int],
    tokens: int,
    a: int,
    units: list[_Unit],
    loose_grads: float,
    buffers: float,
    head_calls: int,
) -> list[Phase]:
    """The micro-batch backward of each stage in flight, the final gradient reduction and the end of
    backward (module docstring, "Peak", under pipeline parallelism). ``buffers``: the schedule's
    per-micro-batch buffers, held all step."""
    unsharded = a * sum(u.unsharded for u in units)
    accum = 4.0 * sum(u.grad_unsharded for u in units)
    held = tokens * sum(acts[s].saved_per_token for s in alive)
    phases = []
    for s in sorted(set(alive)):  # the chunk being run backward is one of stage s
        others = held - tokens * acts[s].saved_per_token
        for i, st in enumerate(steps[s]):
            phases.append(
                Phase(
                    f"backward {st.name}" + (f" (stage {s})" if len(set(alive)) > 1 else ""),
                    loose_grads,
                    unsharded,
                    accum,
                    buffers
                    + others
                    + tokens * (acts[s].extras + sum(x.saved for x in steps[s][i:])),
                    (_head_work(st, a, head_calls) if st.name == "head" else st.backward)
                    + a * st.grad_unsharded,
                )
            )
    rs = 4.0 * max((u.grad_unsharded for u in units), default=0)
    phases.append(Phase("gradient reduction", loose_grads, unsharded, accum, buffers, rs))
    phases.append(
        Phase(
            "end of backward",
            loose_grads + 4.0 * sum(u.trainable for u in units),
            0.0,
            0.0,
            buffers,
        )
    )
    return phases


def pipeline_buffer_bytes_per_token(
    args: GLM52ModelArgs, stage: int, num_stages: int, with_mtp: bool, act_bytes: int
) -> float:
    """Bytes per token of one micro-batch that torch's ``PipelineStage`` keeps for EVERY micro-batch
    of the step (module docstring): receive buffers for the stage inputs (not on the first stage)
    and for the gradients of its outputs (not on the last)."""
    # hidden states (+ next-token embeddings)
    per_tensor = act_bytes * args.hidden_size * (2 if with_mtp else 1)
    return per_tensor * ((stage > 0) + (stage < num_stages - 1))


# ===================================================================================== the plan
def _build_rank(req: MemoryRequest, layout, rank: int, pp_rank_expected: int):
    """Fake world at ``rank``: mesh, this rank's stages (meta, parallelized). Returns (mesh,
    modules, stage ids)."""
    from titan_glm52.distributed import build_mesh
    from titan_glm52.model.model import GLM52Model
    from titan_glm52.parallelize import parallelize_model
    from titan_glm52.pipeline import stage_modules

    args = req.args
    mesh = build_mesh(
        req.gpus,
        dp_replicate=req.dp_replicate,
        dp_shard=req.dp_shard,
        ep=req.ep,
        pp=req.pp,
        device_type="cpu",
        n_routed_experts=args.n_routed_experts,
        cp=req.cp,
    )
    pp_rank = mesh["pp"].get_local_rank()
    assert pp_rank == pp_rank_expected, (rank, pp_rank, pp_rank_expected)
    dtype = PARAM_DTYPES[req.param_dtype]

    def prepare(module: nn.Module) -> nn.Module:  # the trainer's _parallelize
        return parallelize_model(
            module,
            mesh,
            param_dtype=dtype,
            reduce_dtype=torch.float32,
            reshard_after_forward=req.reshard_after_forward,
            ac_mode=req.ac_mode,
            selective_ac_option=req.selective_ac_option,
            ep_enabled=req.ep > 1,
        )

    if req.pp == 1:
        with torch.device("meta"):
            return mesh, [prepare(GLM52Model(args, with_mtp=req.with_mtp))], (0,)
    built = [(spec.index, prepare(module)) for spec, module in stage_modules(args, layout, pp_rank)]
    return mesh, [m for _, m in built], tuple(s for s, _ in built)


def _check_request(req: MemoryRequest) -> None:
    """A request's own fields; the job's rules are the trainer's (``config.master_weights_blocker``,
    ``pipeline_split.microbatches``, ``parallelize.AC_MODES`` / ``RESHARD_POLICIES``)."""
    from titan_glm52.config import master_weights_blocker
    from titan_glm52.context_parallel import check_split
    from titan_glm52.parallelize import AC_MODES, RESHARD_POLICIES
    from titan_glm52.pipeline_split import microbatches

    if req.param_dtype not in PARAM_DTYPES:
        raise ValueError(f"param dtype {req.param_dtype!r}: choose one of {sorted(PARAM_DTYPES)}")
    if req.ac_mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode {req.ac_mode!r}: choose one of {AC_MODES}")
    if req.reshard_after_forward not in RESHARD_POLICIES:
        raise ValueError(
            f"reshard_after_forward {req.reshard_after_forward!r}: choose one of {RESHARD_POLICIES}"
        )
    if req.state_dtype not in ("fp32", "bf16"):
        raise ValueError(f"optimizer state dtype {req.state_dtype!r}: choose fp32 or bf16")
    for name in ("gpus", "seq_len", "local_batch_size", "cp"):
        if getattr(req, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(req, name)}")
    if req.cp > 1:
        check_split(req.seq_len, req.cp)
    if req.pp > 1:
        microbatches(req.local_batch_size, req.microbatch_size)
    if not 0 <= req.headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {req.headroom}")
    if req.gpu_memory_gib <= 0 or req.expert_load_factor <= 0:
        raise ValueError("gpu memory and expert load factor must be > 0")
    if req.master_weights not in ("fsdp", "optimizer"):
        raise ValueError(
            f"master weights {req.master_weights!r}: choose fsdp or optimizer "
            "(training.master_weights)"
        )
    dtype = CONFIG_DTYPE[req.param_dtype]
    if req.master_weights == "optimizer" and (
        why := master_weights_blocker(req.gpus, "triton", dtype)
    ):
        raise ValueError(f"training.master_weights: {why}")


def estimate_memory(req: MemoryRequest) -> MemoryReport:
    """Per-rank memory of ``req`` (module docstring). Raises ValueError (LayoutError for layouts)
    before any work for a request that cannot run, and when this process already has a default
    process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titan_glm52.distributed import validate_degrees
    from titan_glm52.parallelize import _reshard_policy
    from titan_glm52.pipeline_split import choose_layout, microbatches

    _check_request(req)
    args = req.args
    deg = validate_degrees(
        req.gpus, req.dp_replicate, req.dp_shard, req.ep, req.pp, args.n_routed_experts, req.cp
    )
    layout = choose_layout(
        args,
        req.schedule,
        req.pp,
        req.stages_per_rank,
        seq_len=req.seq_len,
        layers_per_stage=req.layers_per_stage,
        with_mtp=req.with_mtp,
    )
    pl = layout.placement
    if req.pp == 1 and pl.num_stages != 1:
        raise ValueError(
            f"pp 1 runs no pipeline schedule; got {pl.num_stages} stages from schedule "
            f"{pl.schedule}"
        )
    if dist.is_initialized():
        raise ValueError(
            "estimate_memory builds a fake world of its own; this process already has a default "
            "process group"
        )
    pipelined = req.pp > 1
    n_mb = microbatches(req.local_batch_size, req.microbatch_size) if pipelined else 1
    # this rank's tokens of a micro-batch: under context parallelism its part of each sequence
    tokens = (req.microbatch_size if pipelined else req.local_batch_size) * req.seq_len // req.cp
    act_bytes = torch.finfo(PARAM_DTYPES[req.param_dtype]).bits // 8
    report = MemoryReport(
        req,
        layout.layers_per_stage,
        pl.stage_to_rank,
        pl.schedule,
        pl.stages_per_rank,
        deg.dp_shard,
        deg.efsdp,
        n_mb,
        tokens,
    )
    # One document per row: its first index_topk rows run on the dense prefix; if it is at most
    # dense_masked_ratio x index_topk long, its later rows run on the masked dense path, with plain
    # keys and values for all its rows (another share of 1, an upper bound: it also counts the
    # prefix rows' queries and outputs again) and the selection mask, (S - K) x S per document: a
    # bool and its bf16 additive form, 3 (S - K) bytes per token.
    # (Under context parallelism every row runs on the sparse kernels.)
    kk, seq = args.index_topk, req.seq_len
    dense = req.dense_prefix and req.cp == 1
    prefix_share = min(kk, seq) / seq if dense else 0.0
    mask_per_token = 0.0
    if dense and req.dense_masked_ratio > 0 and kk < seq <= int(req.dense_masked_ratio * kk):
        prefix_share += 1.0
        mask_per_token = 3.0 * (seq - kk)
    acts = [
        stage_activations(
            args,
            spec.layers,
            spec.embedding,
            spec.head,
            spec.with_mtp,
            req.ac_mode,
            req.selective_ac_option,
            act_bytes,
            req.expert_load_factor,
            req.ep > 1,
            tokens,
            prefix_share,
            mask_per_token,
            req.recompute_expert_inputs,
            req.recompute_latent_query,
            req.mlp_token_chunk,
            req.cp,
            req.mtp_token_chunk,
        )
        for spec in layout.stages
    ]
    keep_all = pipelined or not _reshard_policy(
        req.reshard_after_forward, pipelined, deg.fsdp_shard
    )
    master = req.master_weights == "optimizer"
    ranks_per_pp = deg.dp_replicate * deg.dp_shard * deg.cp
    # Calls of the head per micro-batch: one per loss (model/head.py), two with MTP.
    head_calls = 2 if req.with_mtp else 1

    for pp_rank in range(req.pp):
        rank = pp_rank * ranks_per_pp
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=req.gpus)
        try:
            mesh, modules, stage_ids = _build_rank(req, layout, rank, pp_rank)
            units, steps, loose, loose_trainable = [], {}, 0, 0
            for s, module in zip(stage_ids, modules):
                u, lo, lt = _fsdp_units(module)
                units += u
                steps[s] = _backward_steps(args, u, acts[s])
                loose += lo
                loose_trainable += lt
            chunk = {s: acts[s].saved_per_token for s in stage_ids}
            if not pipelined:
                alive = list(stage_ids)
            elif pl.style == "single":
                s = stage_ids[0]
                alive = [s] * (n_mb if pl.schedule == "GPipe" else min(n_mb, req.pp - s))
            else:
                alive = _multi_stage_peak(
                    req.schedule,
                    mesh["pp"].get_group(),
                    pp_rank,
                    stage_ids,
                    pl.num_stages,
                    n_mb,
                    chunk,
                )
        finally:
            dist.destroy_process_group()
        local = sum(u.local for u in units) + loose
        trainable = sum(u.trainable for u in units) + loose_trainable
        if pipelined:
            buffers = (
                n_mb
                * tokens
                * sum(
                    pipeline_buffer_bytes_per_token(args, s, pl.num_stages, req.with_mtp, act_bytes)
                    for s in stage_ids
                )
            )
            phases = _pipelined_phases(
                steps,
                acts,
                alive,
                tokens,
                act_bytes,
                units,
                4.0 * loose_trainable,
                buffers,
                head_calls,
            )
        elif master:
            (s,) = stage_ids
            phases = _master_phases(
                steps[s],
                acts[s].extras,
                tokens,
                act_bytes,
                head_calls,
                loose_trainable,
                trainable,
                req.grad_accumulation,
            )
        else:
            (s,) = stage_ids
            phases = _unpipelined_phases(
                steps[s],
                acts[s].extras,
                tokens,
                act_bytes,
                keep_all,
                head_calls,
                4.0 * loose_trainable,
            )
        peak = max(phases, key=lambda ph: ph.total)
        report.ranks.append(
            RankMemory(
                pp_rank=pp_rank,
                rank=rank,
                stages=stage_ids,
                layers=tuple(layout.stages[s].layers for s in stage_ids),
                local_params=local,
                trainable_params=trainable,
                params=(4.0 + act_bytes * master) * local,
                grads=peak.grads,
                optimizer=(8.0 if req.state_dtype == "fp32" else 4.0) * trainable,
                unsharded=peak.unsharded,
                grad_accum=peak.grad_accum,
                activations=peak.activations,
                transient=peak.transient,
                in_flight=len(alive),
                units=len(units),
                phase=peak.name,
                phases=tuple(phases),
            )
        )
    return report


def request_from_job_config(
    cfg,
    gpus: int | None = None,
    *,
    gpu_memory_gib: float = 141.0,
    headroom: float = 0.10,
    expert_load_factor: float = 1.0,
) -> MemoryRequest:
    """The ``MemoryRequest`` of a parsed job config (``config.parse_job_config``): its model (as the
    trainer builds it), degrees, schedule, layout, batch, AC mode, precision and MTP. ``gpus``
    defaults to pp x dp_replicate x dp_shard x cp, which needs an explicit
    ``data_parallel_shard_degree``."""
    from titan_glm52.config import model_args, resolve_master_weights
    from titan_glm52.pipeline_split import parse_layout

    p, t = cfg.parallelism, cfg.training
    if gpus is None:
        if p.data_parallel_shard_degree < 1:
            raise ValueError(
                "parallelism.data_parallel_shard_degree = -1: pass gpus (the world size)"
            )
        gpus = (
            p.pipeline_parallel_degree
            * p.data_parallel_replicate_degree
            * p.data_parallel_shard_degree
            * p.context_parallel_degree
        )
    args = model_args(cfg)
    master = resolve_master_weights(cfg, gpus)  # the trainer's rule on a GPU
    # samples per micro-batch, all ranks
    per_step = t.local_batch_size * (
        gpus // (p.pipeline_parallel_degree * p.context_parallel_degree)
    )
    layout = parse_layout(p.pipeline_parallel_layout) if p.pipeline_parallel_layout else None
    return MemoryRequest(
        args=args,
        gpus=gpus,
        pp=p.pipeline_parallel_degree,
        ep=p.expert_parallel_degree,
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        schedule=p.pipeline_parallel_schedule,
        stages_per_rank=p.pipeline_parallel_stages_per_rank,
        layers_per_stage=layout,
        seq_len=t.seq_len,
        local_batch_size=t.local_batch_size,
        microbatch_size=p.pipeline_parallel_microbatch_size,
        ac_mode=cfg.activation_checkpoint.mode,
        selective_ac_option=cfg.activation_checkpoint.selective_ac_option,
        param_dtype="bf16" if t.mixed_precision_param == "bfloat16" else "fp32",
        reshard_after_forward=p.fsdp_reshard_after_forward,
        with_mtp=cfg.mtp.enable and args.num_nextn_predict_layers > 0,
        gpu_memory_gib=gpu_memory_gib,
        headroom=headroom,
        expert_load_factor=expert_load_factor,
        dense_prefix=cfg.dsa.dense_prefix,
        dense_masked_ratio=cfg.dsa.dense_masked_ratio,
        recompute_expert_inputs=cfg.moe.recompute_expert_inputs,
        recompute_latent_query=cfg.dsa.recompute_latent_query,
        mlp_token_chunk=cfg.activation_checkpoint.mlp_token_chunk,
        mtp_token_chunk=cfg.activation_checkpoint.mtp_token_chunk,
        master_weights=master,
        grad_accumulation=t.global_batch_size // per_step > 1,
        cp=p.context_parallel_degree,
        state_dtype="bf16" if cfg.optimizer.state_dtype == "bfloat16" else "fp32",
    )


# ===================================================================================== printing
def job_memory_check(cfg, world_size: int, gpu_memory_gib: float) -> tuple[bool, str]:
    """The trainer's start-up check (``training.memory_check``): (the plan's largest rank fits in
    ``gpu_memory_gib``, one line to log). Raises ValueError where the job cannot be planned."""
    report = estimate_memory(
        request_from_job_config(cfg, world_size, gpu_memory_gib=gpu_memory_gib)
    )
    worst = report.worst
    fits = worst.total <= gpu_memory_gib * GIB
    line = (
        f"memory plan: {worst.total / GIB:.1f} GiB per GPU at its peak ({worst.phase}"
        + (f", pp rank {worst.pp_rank}" if len(report.ranks) > 1 else "")
        + f") of this GPU's {gpu_memory_gib:.1f} GiB; the plan is an upper bound (python -m "
        "titan_glm52.plan "
        "memory; on H200s it was 0.4-12% above the measured peaks)"
    )
    if not fits:
        line += (
            ". More than the GPU has: the step will likely run out of memory there. Options: "
            "activation_checkpoint.mode 'selective' or 'full', "
            "activation_checkpoint.mtp_token_chunk or mlp_token_chunk, a shorter "
            "training.seq_len or smaller local_batch_size, more GPUs "
            "(parallelism.data_parallel_shard_degree / pipeline_parallel_degree); "
            "training.memory_check = false skips this check"
        )
    return fits, line


def _count(n: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(int(n))


def _layers(r: range) -> str:
    return str(r.start) if len(r) == 1 else f"{r.start}-{r.stop - 1}"


def format_report(report: MemoryReport, model_name: str) -> str:
    """The printout of ``plan memory``: setup lines, ``layers per stage:``, a table per pipeline
    rank, the budget and the verdict. Sizes in GiB (MiB when the largest rank is under 1 GiB)."""
    req, args = report.request, report.request.args
    master = req.master_weights == "optimizer"
    unit, scale = ("GiB", GIB) if report.worst.total >= GIB else ("MiB", 1024**2)
    lines = [
        f"model: {model_name}: {_count(args.num_params(req.with_mtp))} parameters, "
        f"{args.num_hidden_layers} "
        f"decoder layers, MTP layer: "
        f"{'yes' if req.with_mtp and args.num_nextn_predict_layers else 'no'}",
        f"world: {req.gpus} ranks = pp {req.pp} x dp_replicate {req.dp_replicate} x dp_shard "
        f"{report.dp_shard}"
        + (f" x cp {req.cp}" if req.cp > 1 else "")
        + f" (ep {req.ep} x efsdp {report.efsdp} for the routed experts); fake process group, "
        "meta device",
        f"schedule: {report.schedule}, {report.stages_per_rank} stage(s) per rank, "
        f"{len(report.layers_per_stage)} stages",
        f"layers per stage: {','.join(str(n) for n in report.layers_per_stage)}",
        f"batch: seq_len {req.seq_len}, local_batch_size {req.local_batch_size}, microbatch_size "
        f"{req.microbatch_size} -> {report.n_microbatches} micro-batch(es) of "
        f"{report.tokens_per_microbatch} tokens"
        + (
            f" per rank (context parallel {req.cp}: each rank holds 1/{req.cp} of every sequence "
            f"and gathers the latent and indexer keys of all {req.seq_len} in every layer)"
            if req.cp > 1
            else ""
        ),
        (
            f"precision: fp32 master weights in the optimizer with bf16 compute copies "
            "(master_weights optimizer, no "
            f"FSDP), bf16 "
            f"grads{' (summed in fp32: gradient accumulation)' if req.grad_accumulation else ''}, "
            "AdamW "
            f"2 x {req.state_dtype} states; AC {req.ac_mode}"
            if master
            else "precision: fp32 master weights, fp32 grads, AdamW "
            f"2 x {req.state_dtype} states, "
            f"{req.param_dtype} compute "
            f"(FSDP param_dtype), fp32 reduce; AC {req.ac_mode}"
        )
        + (f" ({req.selective_ac_option})" if req.ac_mode == "selective" else "")
        + ("" if master else f"; reshard_after_forward {req.reshard_after_forward}")
        + f"; expert load factor {req.expert_load_factor:g}"
        + f"; expert inputs {'recomputed' if req.recompute_expert_inputs else 'kept'}"
        + f"; latent query {'recomputed' if req.recompute_latent_query else 'kept'}",
        "ranks: one representative per pipeline rank (data-parallel coordinate 0): FSDP pads every "
        "shard to the "
        "same size and EP splits the experts evenly, so all ranks of a pipeline rank hold the same "
        "bytes",
        "activations: estimated from the widths (formulas: titan_glm52/memory_estimate.py "
        "docstring); the rest is "
        "read from FSDP2's shards",
        "",
        f"{unit} per GPU (one representative rank per pipeline rank):",
        f"{'pp':>3} {'rank':>5} {'stages':>7} {'layers':>11} {'params':>7} {'grads':>7} "
        f"{'AdamW':>7} "
        f"{'unshard':>7} {'gradacc':>7} {'activ':>7} {'transnt':>7} {'total':>7} {'mb':>3}  fits  "
        "peak at",
    ]
    for r in report.ranks:
        layers = ",".join(_layers(lr) for lr in r.layers)
        values = (
            r.params,
            r.grads,
            r.optimizer,
            r.unsharded,
            r.grad_accum,
            r.activations,
            r.transient,
            r.total,
        )
        lines.append(
            f"{r.pp_rank:>3} {r.rank:>5} {','.join(map(str, r.stages)):>7} {layers:>11} "
            + " ".join(f"{v / scale:7.2f}" for v in values)
            + f" {r.in_flight:>3}  {'yes' if r.total <= report.budget else 'NO ':<3}  {r.phase}"
        )
    states = f"AdamW states (2 x {req.state_dtype})"
    lines.append(
        'columns: what is alive at the peak, the phase named last (module docstring, "Masters in '
        'the optimizer"): fp32 masters + bf16 compute copies, gradients formed so far (bf16; fp32 '
        f"sums when accumulating), {states}, saved activations, transient (recompute, backward "
        "workspace, loss chunk, the gradient being formed)"
        if master
        else "columns: what is alive at the rank's peak, the phase named last (module docstring, "
        f'"Peak"): fp32 master params, fp32 sharded grads already reduced, {states}, FSDP '
        f"unsharded params ({req.param_dtype}), unsharded fp32 gradient accumulation (pipeline), "
        "saved activations of the in-flight micro-batches (mb) and the pipeline schedule's "
        "per-micro-batch buffers, transient (recompute, backward workspace, loss chunk, FSDP "
        "gradient buffers)"
    )
    worst = report.worst
    lines += [
        "",
        f"budget: {req.gpu_memory_gib:g} GiB x (1 - {req.headroom:g} headroom) = "
        f"{report.budget / scale:.2f} {unit} "
        "per GPU",
        f"largest: {worst.total / scale:.2f} {unit} on pp rank {worst.pp_rank} "
        f"({100 * worst.total / (req.gpu_memory_gib * GIB):.0f}% of the GPU)",
        "result: every rank fits"
        if report.fits
        else "result: DOES NOT FIT on pp rank(s) "
        + ",".join(str(r.pp_rank) for r in report.ranks if r.total > report.budget),
    ]
    return "\n".join(lines)
