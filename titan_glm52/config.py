"""The job config: torchtitan 0.2.2's ``JobConfig`` (TOML + ``--section.key`` CLI) with this
project's sections.

``parse_job_config(argv)`` parses (CLI overrides TOML overrides defaults; unknown keys are refused
by torchtitan's ConfigManager) and then ``validate`` refuses every combination this project cannot
run, before any work, with a message that names the key and the fix. ``python train.py --help``
lists every option.
"""

import contextlib
import dataclasses
import importlib.util
import io
import os
import re
import sys
import tomllib
import types
import typing
from dataclasses import dataclass, field
from typing import Literal

from torchtitan.config import ConfigManager
from torchtitan.config import job_config as tt

from titan_glm52.errors import ConfigError
from titan_glm52.fp8_training import DEFAULT_FILTER as DEFAULT_FP8_FILTER
from titan_glm52.fp8_training import EXPERT_RECIPES as FP8_EXPERT_RECIPES
from titan_glm52.fp8_training import RECIPES as FP8_RECIPES
from titan_glm52.fp8_training import TORCHAO_RECIPES as FP8_TORCHAO_RECIPES
from titan_glm52.fp8_training import Fp8Spec
from titan_glm52.lora import ATTENTION_TARGETS, MLP_TARGETS, LoRASpec, target_refusal
from titan_glm52.model.args import GLM52ModelArgs, get_flavor
from titan_glm52.model.options import ModelOptions
from titan_glm52.parallelize import AC_MODES, RESHARD_POLICIES
from titan_glm52.pipeline_split import LayoutError, microbatches, parse_layout


@dataclass
class Model(tt.Model):
    name: str = "glm52"
    """Model family; only "glm52"."""

    flavor: str = "debug"
    """Built-in model args: "debug" (tiny, CPU), "glm52_proxy" (GLM-5.2 widths, 4 layers, 16
    experts), "glm52_744b" (the published config). Ignored when model.hf_config is set."""

    hf_config: str | None = None
    """A config.json (or a directory holding one, e.g. an HF checkpoint) to build the model from."""

    num_layers: int | None = None
    """Override num_hidden_layers of the chosen args (the IndexShare schedule is re-derived from
    freq/offset)."""

    n_routed_experts: int | None = None
    """Override the number of routed experts of the chosen args."""

    extend_positions: bool = False
    """Allow ``training.seq_len`` above the model's ``max_position_embeddings`` (RoPE then runs at
    positions the published model was not trained on). Off: such a sequence length is refused."""

    hf_assets_path: str = "embedded"
    """The tokenizer: an HF tokenizer directory (tokenizer.json), or "embedded" for the one shipped
    with the package (it matches the debug flavor's 2048-token vocabulary)."""

    converters: list[str] = field(default_factory=list)
    """FP8 training (docs/fp8_training.md), torchtitan's names: "quantize.linear.float8" runs the
    dense linears' products in FP8, "quantize.grouped_mm.float8" the routed experts'; their options
    are [quantize.linear.float8] and [quantize.grouped_mm.float8]. Other converters are refused."""


@dataclass
class Training(tt.Training):
    dataset: str = "embedded"
    """"embedded" (real English text shipped with the package, needs no network) or a local path (a
    file, directory or glob of .txt / .jsonl / .parquet files, or a saved HF dataset directory)."""

    seq_len: int = 256
    """Tokens per sample; documents are packed with cu_seqlens so attention never crosses them."""

    local_batch_size: int = 4
    """Samples per data-parallel rank per micro-batch."""

    master_weights: Literal["auto", "fsdp", "optimizer"] = "auto"
    """Where the fp32 master weights of bf16 training (``mixed_precision_param = "bfloat16"``) live.
    "fsdp": FSDP2 holds them (on one process a one-rank mesh, which casts and copies every parameter
    in each step and copies the gradients out to fp32). "optimizer" (one process only): no FSDP; the
    model trains on bf16 copies and the Triton Adam(W) step (``optimizer.implementation =
    "triton"``) updates the fp32 masters from the bf16 gradients and rewrites the copies in the same
    pass (``master_weights.py``): the same training, without those copies (37 of 256 ms per step on
    the proxy, H200) and with 2-4 bytes less gradient memory per parameter. "auto": "optimizer"
    where it applies (world size 1, the Triton step, bf16 compute), else "fsdp"."""

    mixed_precision_on_cpu: bool = False
    """On CPU the model computes in fp32 whatever ``mixed_precision_param`` says (bf16 matmuls are
    slow there); True applies it on CPU too (tests of the bf16 paths)."""

    memory_check: bool = True
    """On CUDA, before the process group starts, the first process of each node plans the job's peak
    memory per GPU (``memory_estimate.py``, as ``python -m titan_glm52.plan memory`` does; a few
    seconds), logs it beside the GPU's size, and warns when the plan exceeds the GPU (the plan is an
    upper bound: a warning, not an error). False skips it."""


@dataclass
class Parallelism(tt.Parallelism):
    context_parallel_degree: int = 1
    """Ranks every sequence is split over (docs/context_parallel.md): each holds 2 of its 2N zigzag
    chunks and all-gathers the compact key state (latent rows, indexer keys) of the whole sequence
    in every layer; the ranks join the FSDP ranks (parameters sharded over dp_shard x cp) and EP is
    carved out of dp_shard x cp. training.seq_len must be divisible by 2 x this degree."""

    pipeline_parallel_layout: str | None = None
    """Explicit layers per pipeline stage, e.g. "14,8,8,8,8,8,8,16" (validated: every stage must
    start on an IndexShare full layer). Unset: the skip-aware splitter balances the estimated cost
    per stage."""

    pipeline_parallel_stages_per_rank: int | None = None
    """Stages per pipeline rank: 1 for single-stage schedules (GPipe, 1F1B), >= 2 for looped ones
    (Interleaved1F1B, ...), 2 for V schedules (ZBVZeroBubble, DualPipeV). Unset: 1 or 2 by
    schedule."""


@dataclass
class Checkpoint(tt.Checkpoint):
    start_fresh_if_unusable: bool = False
    """When the checkpoint folder holds step folders but none of them is complete (a save that did
    not finish, a truncated or missing file), train from the start and leave them as they are. Off:
    such a folder is refused, naming each step folder and what is wrong with it."""


@dataclass
class ActivationCheckpoint(tt.ActivationCheckpoint):
    mlp_token_chunk: int = 0
    """> 0: every MLP (the dense ones, and the routed and shared experts of the MoE layers) runs
    over chunks of this many tokens, each chunk recomputed in backward, so that a step holds one
    chunk's intermediates at a time instead of the batch's: long sequences on few GPUs (at 128K
    tokens and top-8 the routed experts' dispatched copy alone is 12 GiB per MoE layer at GLM-5.2's
    width). The same math; the MLPs' forward runs twice. 0: the whole batch at once."""

    mtp_token_chunk: int = 0
    """> 0: the MTP layer's token-wise parts (its input projection with enorm and hnorm, its
    block's MLP, its final norm) run over chunks of this many tokens, each recomputed in backward,
    while the main blocks keep what mode and mlp_token_chunk say. The MTP layer runs backward
    first, when every main block still holds its activations: rebuilt chunk by chunk its MLP and
    norms add one chunk's intermediates to that peak instead of the whole sequence's (a
    checkpoint of the whole MTP block would rebuild them all there; with mode = "full" the block
    is recomputed and its chunks inside that recompute). The same math; those parts' forward
    runs twice. Needs mtp.enable. 0: the MTP layer's MLP as mlp_token_chunk says, the rest
    whole."""


@dataclass
class Optimizer(tt.Optimizer):
    implementation: Literal["for-loop", "foreach", "fused", "triton"] = "fused"
    """AdamW / Adam step: "fused" (torch's fused kernel), "foreach", "for-loop" (torch's), or
    "triton" (this project's kernel: one pass of 28 bytes per fp32 parameter on the local shards,
    the clip folded in; same math and state dict as torch's). "triton" launches one kernel per
    parameter tensor, ~40-100 us of host time each: it pays off where tensors are large (the proxy's
    103: +3.9% end to end on an H200), not where there are many small ones (the debug flavor's step:
    10.9 ms against 0.7 for "fused"); on CPU it runs only in the Triton interpreter
    (``TRITON_INTERPRET=1``; slow). With "fused" and "triton" the gradient clip and the skip of a
    non-finite step run inside the kernel (no host sync)."""

    state_dtype: Literal["float32", "bfloat16"] = "float32"
    """Adam's moments (exp_avg, exp_avg_sq): "float32", in the dtype of the trained parameters
    (the fp32 masters) as torch keeps them, or "bfloat16", as DeepSeek-V3 trained: 4 bytes of
    optimizer state per trainable parameter instead of 8, and 8 fewer bytes read and written per
    parameter by each step. The update is computed in fp32 either way; each moment is rounded (to
    nearest) when stored, so beta2 above 0.99 is refused with it (bf16 would round away most of a
    step's change to exp_avg_sq). Needs implementation = "triton"; checkpoints hold the moments in
    this dtype, and a resume from the other one converts them."""


@dataclass
class Data:
    text_field: str = "text"
    """Column / JSON field holding the text for .jsonl, .parquet and saved HF datasets."""

    format: Literal["auto", "text", "chat"] = "auto"
    """"text": every token trained, documents packed across rows. "chat": conversations (a
    messages_field of role/content messages, optional tools_field), rendered by the chat template,
    labels on the assistant's tokens only (train_on), whole conversations per row. "auto": chat when
    the dataset's first file has a messages_field (docs/fine_tuning.md)."""

    messages_field: str = "messages"
    """Column / JSON field holding a chat row's messages."""

    tools_field: str = "tools"
    """Column / JSON field holding a chat row's tool definitions (optional in a row)."""

    chat_template: str = ""
    """Chat template: "embedded" (the shipped GLM-style one), a .jinja / .json file, or a tokenizer
    directory; empty: the template of model.hf_assets_path's tokenizer."""

    train_on: Literal["assistant", "all"] = "assistant"
    """Chat rows: labels on the assistant's tokens (its text, tool calls, reasoning and end of
    turn), or on every token."""

    chat_overflow: Literal["truncate", "drop", "split", "error"] = "truncate"
    """A conversation longer than seq_len + 1 tokens: cut at the end of the row, left out, split
    over rows at message boundaries, or refused (all counted and logged)."""

    end_of_turn: list[str] = field(default_factory=list)
    """More end-of-turn marker texts (trained with the assistant's turn), beside eos and
    generation_config.json's eos ids."""

    seed: int = 0
    """Shuffling seed of the document order (deterministic; saved with the checkpoint position)."""

    same_global_batch: bool = False
    """Every data-parallel rank reads the one global stream and keeps its rows of each global batch,
    so the global batches do not depend on the number of ranks (runs on different layouts can be
    compared step for step). Off: each rank reads its own share of the documents (no redundant
    reading)."""

    prefetch: int = 2
    """Batches made ahead on a background thread while the step runs (tokenization is most of a
    batch's cost; the batches and the checkpointed position are exactly those without it). 0: made
    on the training loop."""

    document_masking: bool = True
    """Attention and the indexer stay inside each packed document (positions restart per document).
    False: each sample of seq_len tokens is one sequence (attention crosses document ends; the label
    across an end stays ignored), as in pre-training without document masking and in long-context
    benchmarks."""


@dataclass
class DSA:
    backend: Literal["auto", "torch", "triton"] = "auto"
    """Attention kernels: "torch" (reference, any device), "triton" (CUDA; on CPU only in the Triton
    interpreter, ``TRITON_INTERPRET=1``), "auto" = triton on CUDA else torch."""

    gluon_kernels: bool = True
    """With the triton backend on Hopper GPUs (H100/H200): the sparse MLA forward and backward and
    the indexer's scoring run warp-specialised Gluon kernels where they apply (GLM-5.2's head and
    indexer shapes, bf16); false runs the Triton kernels only (the same results, slower)."""

    mode: Literal["sparse", "dense_warmup"] = "sparse"
    """"sparse": top-k attention (DeepSeek-V3.2 sparse stage). "dense_warmup": dense causal
    attention, everything but the indexers frozen, indexers trained by the KL loss over all visible
    keys (DeepSeek-V3.2 stage 1)."""

    indexer_loss_coeff: float = 0.0
    """Weight of the indexer KL loss (0 = off in sparse mode). In sparse mode the KL is over the
    selected keys and the indexer's input is detached, so the indexer learns only from this loss."""

    freeze_indexer: bool = False
    """Keep the indexer weights fixed (no gradient, not in the optimizer)."""

    index_topk: int | None = None
    """Override index_topk of the model args."""

    dense_prefix: bool = True
    """The first index_topk tokens of a document see at most index_topk keys, so the top-k selects
    all of them and their attention is plain causal attention. True: run those rows (of every
    document of at least index_topk tokens) in the plain MLA form on a dense causal kernel (SDPA:
    cuDNN on H100/H200), the other rows on the sparse kernels. Same math, different rounding order;
    at 4K tokens a DSA layer's attention takes 25% less time (bench/attn_paths.py). A full layer
    that trains its indexer (indexer_loss_coeff > 0) also runs the sparse forward on those rows,
    without gradient, for the log-sum-exp its KL needs. False: every row on the sparse kernels (and
    no masked dense rows either). Under context parallelism every row runs on the sparse kernels
    whatever this says (the dense causal form of a prefix row needs keys that other ranks hold)."""

    dense_masked_ratio: float = 0.0
    """With dense_prefix: a document of index_topk < length <= dense_masked_ratio x index_topk
    tokens also runs its later rows in the plain MLA form, on SDPA (cuDNN on H100/H200) with a
    boolean mask of exactly the keys each row selected. Same math, different rounding order. Such a
    row selects at least 1 / ratio of the keys it sees, and the masked dense kernel then costs less
    than the sparse kernels (bench/attn_paths.py: at 4K tokens with top-2048, masked cuDNN 1.2 ns
    per visible pair against 3.1 ns per selected pair on the sparse kernels). 0 = off (default).
    Measured on one H200 (proxy, 4K, compiled, bench/results/2026-11-30_h200_e2e.md): with ratio 2,
    attention kernel time falls from 62 to 47 ms per step, but the step gains only 2.9% with AC
    none, and it loses 4.5% with selective AC (every second block recomputed; not explained yet).
    Hence off by default."""

    recompute_latent_query: bool = True
    """The sparse attention's backward forms the latent query ``[q_nope W_uk, q_rope]`` again
    instead of keeping it from forward, with the same bits (the same eager ops on the same inputs):
    H x kv_rank values per token and layer fewer held (64 KB at GLM-5.2's widths in bf16; its rope
    part stays), for one batched GEMM of 2 H nope kv_rank FLOPs per token in backward. Inactive in
    activation-checkpointed blocks, under other saved-tensor hooks and where the indexer KL loss
    keeps the latent query anyway. false: autograd keeps it."""

    recall_queries: int = 64
    """Queries per step (from the first sequence, one full layer) for the logged top-k recall
    against dense attention; 0 disables the metric."""


@dataclass
class MoE:
    bias_update_rate: float = 1e-3
    """Aux-loss-free balancing: after each step e_score_correction_bias += rate * sign(mean_load -
    load) from the global token counts (0 disables)."""

    seq_aux_loss_coeff: float = 0.0
    """DeepSeek-V3 sequence-level balance loss alpha * sum_i f_i * P_i per sequence (0 = off)."""

    grouped_mm: Literal["auto", "on", "off"] = "auto"
    """Routed experts' GEMMs: "on" = torch._grouped_mm (bf16 on Hopper-class GPUs), "off" = one
    cuBLAS GEMM per expert (model/expert_mm.py: less energy per product, but the host reads the
    expert counts in every MoE layer), "auto" = grouped below moe.PER_EXPERT_MIN_ROWS (8,192) routed
    rows per local expert where the GPU has it, per expert from there (why and the measurements:
    that constant's comment)."""

    recompute_expert_inputs: bool = True
    """The routed experts keep only their gate and up projections' outputs for backward and
    recompute the inputs of their GEMMs there: the token rows gathered into expert order (not under
    EP, where they arrive by all-to-all) and the SwiGLU product (the fused SwiGLU keeps no silu
    output), bitwise as in forward. Saves k*(D + F) activation values per token and MoE block (4.0
    GiB per MoE block at 32K tokens on the proxy) for a gather and one elementwise pass in backward.
    Inactive in activation-checkpointed blocks (their recompute already covers these) and under
    other saved-tensor hooks. false: autograd keeps them."""


@dataclass
class MTP:
    enable: bool = True
    """Train the multi-token-prediction layer (predicts token i+2 from position i)."""

    loss_weight: float = 0.3
    """Weight of the MTP cross-entropy in the total loss."""


@dataclass
class Faults:
    max_consecutive_nonfinite: int = 3
    """Stop the run after this many consecutive steps with a non-finite loss or gradient (each is
    skipped)."""

    inject_nan_at_steps: list[int] = field(default_factory=list)
    """Testing aid: make the loss NaN at these steps (the step is skipped and counted like a real
    fault)."""


@dataclass
class LoRA:
    enable: bool = False
    """Fine-tune LoRA adapters instead of the model: every base parameter is frozen (no gradient,
    no optimizer state, no fp32 master: kept in the compute dtype), and each target projection
    gets ``W + (alpha / rank) B A`` with trained ``A [rank, in]`` and ``B [out, rank]`` (B starts
    at 0). DCP checkpoints then hold the adapters only; the base weights come from
    ``checkpoint.initial_load_path`` (or the seeded init) at every start, resumes included. At the
    end the adapters are written in PEFT's format to ``<dump_folder>/adapters/step-N``, and
    ``checkpoint.last_save_in_hf`` exports the merged model."""

    rank: int = 16
    """The adapters' rank r."""

    alpha: float = 32.0
    """The scaling numerator: the update is (alpha / rank) B A (alpha / sqrt(rank) with
    use_rslora)."""

    dropout: float = 0.0
    """Dropout on each adapter's input (training only). Not with kv_b_proj (the attention folds
    its weight into the queries, where there is no input to drop) nor with activation
    checkpointing (its recompute would draw other masks)."""

    use_rslora: bool = False
    """Rank-stabilised LoRA: scale alpha / sqrt(rank) instead of alpha / rank."""

    target_modules: list[str] = field(default_factory=lambda: list(ATTENTION_TARGETS))
    """The adapted projections by their HF module names, as PEFT's target_modules: attention
    q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj (the default); MLP gate_proj,
    up_proj, down_proj (the dense layers' MLPs and the MoE layers' shared expert). The routed
    experts, the indexer, the router, the embedding and the head are refused (docs/fine_tuning.md
    says why); the MTP layer gets no adapters."""

    save_at_checkpoints: bool = False
    """Also write the PEFT adapter at every DCP checkpoint (``<dump_folder>/adapters/step-N``)."""

    base_model_name_or_path: str | None = None
    """``base_model_name_or_path`` of the written adapter_config.json (e.g. a hub id); unset:
    checkpoint.initial_load_path."""


@dataclass
class Float8Linear(tt.Float8Linear):
    recipe_name: str = "blockwise"
    """The FP8 recipe of the linears and the LM head (with ``model.converters`` holding
    "quantize.linear.float8"): "blockwise" is DeepSeek-V3's, e4m3 products accumulated in fp32 with
    activations and gradients scaled per 1 x 128 tile and weights per 128 x 128 block
    (docs/fp8_training.md). "tensorwise", "rowwise" and "rowwise_with_gw_hp" run the linears as
    torchao's Float8Linear (torchtitan's recipes; torchao needed), the head's fused loss staying
    block-wise. The weights, gradients, master weights and optimizer state stay as without FP8;
    checkpoints and the HF export are unchanged."""

    filter_fqns: list[str] = field(default_factory=lambda: list(DEFAULT_FP8_FILTER))
    """Linears whose name contains one of these stay bf16 (torchtitan's option). The default keeps
    the indexer and wkv_b (read directly by the absorbed attention) in bf16; linears whose
    dimensions are not multiples of 128 (wkv_a: 576 outputs) stay bf16 too. The output head's
    logits and its fused loss's gradients run in FP8 unless "output" is listed
    (docs/fp8_training.md: its speed and loss curve)."""


@dataclass
class Float8GroupedMM(tt.Float8GroupedMM):
    fqns: list[str] = field(default_factory=lambda: ["experts"])
    """The routed experts' modules (by a part of their name) whose products run in FP8 when
    ``model.converters`` holds "quantize.grouped_mm.float8"."""

    recipe_name: str = "blockwise"
    """The routed experts' FP8 recipe: "blockwise" (the linears' scaling, one GEMM per expert; the
    host reads the expert counts in every MoE layer) or "rowwise" (torchtitan's float8 MoE recipe
    through torchao: power-of-two scales per row, per feature and, for the weight gradient, per
    feature over each expert's rows; one grouped GEMM per product and no host sync; needs torchao
    on a GPU). docs/fp8_training.md has both recipes' speed."""


@dataclass
class QuantizedLinear(tt.QuantizedLinear):
    float8: Float8Linear = field(default_factory=Float8Linear)


@dataclass
class QuantizedGroupedMM(tt.QuantizedGroupedMM):
    float8: Float8GroupedMM = field(default_factory=Float8GroupedMM)


@dataclass
class Quantize(tt.Quantize):
    linear: QuantizedLinear = field(default_factory=QuantizedLinear)
    grouped_mm: QuantizedGroupedMM = field(default_factory=QuantizedGroupedMM)


@dataclass
class JobConfig(tt.JobConfig):
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    optimizer: Optimizer = field(default_factory=Optimizer)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    data: Data = field(default_factory=Data)
    dsa: DSA = field(default_factory=DSA)
    moe: MoE = field(default_factory=MoE)
    mtp: MTP = field(default_factory=MTP)
    faults: Faults = field(default_factory=Faults)
    lora: LoRA = field(default_factory=LoRA)
    quantize: Quantize = field(default_factory=Quantize)


def _refuse(key: str, why: str) -> None:
    raise ConfigError(f"{key}: {why}")


def master_weights_blocker(
    world_size: int | None, implementation: str, param_dtype: str
) -> str | None:
    """Why the optimizer cannot hold the fp32 master weights (``training.master_weights =
    "optimizer"``) of a job on ``world_size`` ranks with ``optimizer.implementation`` and
    ``training.mixed_precision_param``, or None where it can: the rule ``validate`` refuses by,
    "auto" chooses by and the memory planner checks by."""
    if world_size is not None and world_size != 1:
        return (
            f"'optimizer' is for one process with bf16 compute; with {world_size} ranks FSDP holds "
            "the master "
            "weights: set it to 'fsdp'"
        )
    if implementation != "triton":
        return (
            "'optimizer' needs the Triton step, which updates the masters and their bf16 copies in "
            "one pass: set "
            f"optimizer.implementation = 'triton' (is {implementation!r}) or master_weights = "
            "'fsdp'"
        )
    if param_dtype != "bfloat16":
        return (
            "'optimizer' keeps bf16 compute copies of fp32 masters: it is for one process with "
            "bf16 compute, "
            f"training.mixed_precision_param = 'bfloat16' (is {param_dtype!r})"
        )
    return None


def resolve_master_weights(
    cfg: JobConfig, world_size: int | None, bf16_compute: bool = True
) -> str:
    """``training.master_weights`` as the trainer runs it: "auto" is "optimizer" where nothing
    blocks it and the model computes in bf16 (``bf16_compute``: False on CPU without
    ``mixed_precision_on_cpu``), else "fsdp"."""
    mode = cfg.training.master_weights
    blocked = master_weights_blocker(
        world_size, cfg.optimizer.implementation, cfg.training.mixed_precision_param
    )
    if mode == "auto":
        mode = "optimizer" if bf16_compute and blocked is None else "fsdp"
    return mode


# the largest beta2 taken with optimizer.state_dtype "bfloat16" (validate: the rounding's dead band)
BF16_STATE_MAX_BETA2 = 0.99

# torchtitan options this trainer does not implement, by (dotted) section: "*" = every field. A
# value other than the default is refused, naming the key (and what to use instead, where the
# section has a hint), instead of being ignored.
_NOT_IMPLEMENTED = {
    "activation_checkpoint": (
        "per_op_sac_force_recompute_mm_shapes_by_fqns",
        "early_stop",
        "memory_budget",
        "visualize_memory_budget_pareto",
        "preserve_rng_state",
        "determinism_check",
        "debug",
    ),
    "comm": "*",
    "experimental": "*",
    "fault_tolerance": "*",
    "memory_estimation": "*",
    "quantize.linear.float8": (
        "enable_fsdp_float8_all_gather",
        "precompute_float8_dynamic_scale_for_fsdp",
        "emulate",
    ),
    "quantize.linear.mx": "*",
    "quantize.grouped_mm.mx": "*",
    "validation": "*",
    "training.dataloader": "*",
    "debug": ("deterministic", "deterministic_warn_only", "moe_force_load_balance"),
    "job": ("print_config", "save_config_file", "custom_config_module"),
    "metrics": ("disable_color_printing", "save_for_all_ranks", "enable_wandb"),
    "model": ("print_after_conversion",),
}
_INSTEAD = {
    "training.dataloader": "the data loader is this project's: data.prefetch makes batches on a "
    "background "
    "thread and pins them on GPUs"
}


def _refuse_not_implemented(cfg: JobConfig) -> None:
    for section, names in _NOT_IMPLEMENTED.items():
        value = cfg
        for part in section.split("."):
            value = getattr(value, part)
        default = type(value)()
        for name in (f.name for f in dataclasses.fields(value)) if names == "*" else names:
            if getattr(value, name) != getattr(default, name):
                why = _INSTEAD.get(
                    section, "a torchtitan option that titan_glm52 does not implement"
                )
                _refuse(
                    f"{section}.{name}", f"{why}; remove it (default {getattr(default, name)!r})"
                )


def _check_context_parallel(cfg: JobConfig) -> None:
    """The context-parallel options (docs/context_parallel.md): the zigzag split of every sequence
    and the all-gather of the key state are the one implementation; the dense prefix runs on the
    sparse kernels there, and the masked dense rows cannot (their keys would be other ranks')."""
    p = cfg.parallelism
    cp = p.context_parallel_degree
    if cp < 1:
        _refuse("parallelism.context_parallel_degree", f"{cp}: must be >= 1")
    if p.context_parallel_load_balancer != "headtail":
        _refuse(
            "parallelism.context_parallel_load_balancer",
            f"{p.context_parallel_load_balancer!r}: the split is the zigzag (head-tail) one; set "
            "'headtail'",
        )
    if p.context_parallel_rotate_method != "allgather":
        _refuse(
            "parallelism.context_parallel_rotate_method",
            f"{p.context_parallel_rotate_method!r}: DSA's context parallelism all-gathers the "
            "compact key state (a query's top-k keys may lie anywhere before it); set 'allgather'",
        )
    if cp == 1:
        return
    if cfg.training.seq_len % (2 * cp):
        _refuse(
            "training.seq_len",
            f"{cfg.training.seq_len} is not divisible by 2 x context_parallel_degree = {2 * cp} "
            "(every sequence is cut into that many equal chunks); choose a multiple",
        )
    if cfg.dsa.dense_masked_ratio != 0:
        _refuse(
            "dsa.dense_masked_ratio",
            "with context parallelism every row runs on the sparse kernels (a masked dense row "
            "needs its document's keys in the plain form, held by other ranks); set it to 0",
        )


def validate(cfg: JobConfig, world_size: int | None = None, device_type: str | None = None) -> None:
    """Refuses combinations this project cannot run; the message names the key and the fix.
    ``world_size`` and ``device_type`` ("cuda" or "cpu"), where known, are checked against too."""
    p = cfg.parallelism
    _check_types_and_ranges(cfg)
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        for key, value in (
            ("dsa.backend", cfg.dsa.backend),
            ("optimizer.implementation", cfg.optimizer.implementation),
        ):
            if value == "triton":
                _refuse(
                    key,
                    "'triton' on a machine without CUDA runs only in the Triton interpreter (slow, "
                    "for "
                    "tests): set TRITON_INTERPRET=1 before starting, or choose another value",
                )
    _refuse_not_implemented(cfg)
    if cfg.model.name != "glm52":
        _refuse("model.name", f"{cfg.model.name!r} is not supported; titan_glm52 trains 'glm52'")
    if p.tensor_parallel_degree != 1:
        _refuse(
            "parallelism.tensor_parallel_degree",
            "tensor parallelism is not implemented; use data/expert/"
            "pipeline parallelism (set it to 1)",
        )
    _check_context_parallel(cfg)
    if p.expert_tensor_parallel_degree != 1:
        _refuse(
            "parallelism.expert_tensor_parallel_degree",
            "expert tensor parallelism is not implemented; set 1",
        )
    if p.expert_parallel_comm_backend != "standard":
        _refuse(
            "parallelism.expert_parallel_comm_backend",
            "only 'standard' (all-to-all) is implemented",
        )
    if cfg.optimizer.name not in ("AdamW", "Adam"):
        _refuse("optimizer.name", f"{cfg.optimizer.name!r}; choose AdamW or Adam")
    if cfg.optimizer.early_step_in_backward:
        _refuse(
            "optimizer.early_step_in_backward",
            "the step runs after the gradient clip; set it to false",
        )
    if cfg.training.dataset_path is not None:
        _refuse(
            "training.dataset_path", 'put the path in training.dataset ("embedded" or a local path)'
        )
    if cfg.training.dtype != "float32":
        _refuse(
            "training.dtype",
            f"{cfg.training.dtype!r}: pure bf16 training (parameters, gradients and optimizer "
            "states in bf16) is not implemented; keep 'float32' and set "
            "training.mixed_precision_param = "
            "'bfloat16' (fp32 master weights, bf16 compute)",
        )
    if cfg.training.enable_cpu_offload:
        _refuse("training.enable_cpu_offload", "CPU offload is not implemented; set it to false")
    if cfg.dsa.mode == "dense_warmup":
        if cfg.dsa.freeze_indexer:
            _refuse(
                "dsa.freeze_indexer",
                "the dense warm-up trains only the indexers; unfreeze them or use "
                "dsa.mode = 'sparse'",
            )
        if cfg.dsa.indexer_loss_coeff <= 0:
            _refuse(
                "dsa.indexer_loss_coeff",
                "dsa.mode = 'dense_warmup' trains the indexers by the KL loss alone; "
                "set a coefficient > 0 (e.g. 1.0)",
            )
    if cfg.dsa.dense_masked_ratio != 0 and not cfg.dsa.dense_masked_ratio > 1:
        _refuse(
            "dsa.dense_masked_ratio",
            f"{cfg.dsa.dense_masked_ratio}: use 0 (off) or a ratio > 1 (documents up to "
            "that many times index_topk tokens)",
        )
    if cfg.dsa.freeze_indexer and cfg.dsa.indexer_loss_coeff > 0:
        _refuse(
            "dsa.freeze_indexer",
            "a frozen indexer cannot learn from dsa.indexer_loss_coeff > 0; set one of them off",
        )
    prof = cfg.profiling
    if prof.enable_profiling and prof.profile_freq < prof.profiler_warmup + prof.profiler_active:
        _refuse(
            "profiling.profile_freq",
            f"{prof.profile_freq} < profiler_warmup + profiler_active "
            f"({prof.profiler_warmup} + {prof.profiler_active}); raise it or shorten the window",
        )
    if cfg.checkpoint.enable and cfg.checkpoint.keep_latest_k == 1:
        _refuse(
            "checkpoint.keep_latest_k",
            "1 could delete the only good checkpoint while a new one is written; "
            "use 0 (keep all) or >= 2",
        )
    if cfg.checkpoint.async_mode != "disabled":
        _refuse(
            "checkpoint.async_mode", "asynchronous checkpointing is not supported; use 'disabled'"
        )
    if cfg.activation_checkpoint.mode not in AC_MODES:
        _refuse(
            "activation_checkpoint.mode",
            f"{cfg.activation_checkpoint.mode!r}: choose one of {AC_MODES}",
        )
    if cfg.activation_checkpoint.mtp_token_chunk > 0 and not cfg.mtp.enable:
        _refuse(
            "activation_checkpoint.mtp_token_chunk",
            f"{cfg.activation_checkpoint.mtp_token_chunk} chunks the MTP layer, which "
            "mtp.enable = false leaves out: set it to 0 or enable the MTP layer",
        )
    if p.fsdp_reshard_after_forward not in RESHARD_POLICIES:
        _refuse(
            "parallelism.fsdp_reshard_after_forward",
            f"{p.fsdp_reshard_after_forward!r}: choose one of {RESHARD_POLICIES}",
        )
    if cfg.compile.enable and "model" not in cfg.compile.components:
        _refuse(
            "compile.components",
            f"{cfg.compile.components}: titan_glm52 compiles the model's blocks (the loss "
            "is a fused kernel); include 'model' or set compile.enable false",
        )
    if cfg.compile.enable and cfg.compile.backend not in ("inductor", "aot_eager", "eager"):
        _refuse("compile.backend", "choose inductor, aot_eager or eager")
    if cfg.training.master_weights not in ("auto", "fsdp", "optimizer"):
        _refuse(
            "training.master_weights",
            f"{cfg.training.master_weights!r}: choose auto, fsdp or optimizer",
        )
    if cfg.training.master_weights == "optimizer" and (
        why := master_weights_blocker(
            world_size, cfg.optimizer.implementation, cfg.training.mixed_precision_param
        )
    ):
        _refuse("training.master_weights", why)
    if cfg.optimizer.state_dtype == "bfloat16" and cfg.optimizer.implementation != "triton":
        _refuse(
            "optimizer.state_dtype",
            "'bfloat16' moments need optimizer.implementation = 'triton' (torch's Adam keeps them "
            f"in the parameter's dtype; is {cfg.optimizer.implementation!r}); set it, or "
            "state_dtype 'float32'",
        )
    if cfg.optimizer.state_dtype == "bfloat16" and cfg.optimizer.beta2 > BF16_STATE_MAX_BETA2:
        # a stored moment moves only when a step changes it by half a bf16 step (up to 2^-8 of
        # it): (1 - beta2) |g^2 / v - 1| must pass that, so v would stop short of its target by
        # up to 2^-8 / (1 - beta2): 8% at beta2 0.95, 39% at 0.99, 390% at 0.999
        _refuse(
            "optimizer.state_dtype",
            f"'bfloat16' moments with beta2 {cfg.optimizer.beta2} > {BF16_STATE_MAX_BETA2}: "
            "bf16 rounds away most of each step's change to exp_avg_sq; lower "
            "optimizer.beta2 (DeepSeek-V3 trained bf16 moments at 0.95) or keep state_dtype "
            "'float32'",
        )
    if cfg.training.global_batch_size > 0 and world_size is not None:
        dp = world_size // max(p.pipeline_parallel_degree * p.context_parallel_degree, 1)
        per_step = cfg.training.local_batch_size * dp
        if cfg.training.global_batch_size % per_step:
            _refuse(
                "training.global_batch_size",
                f"{cfg.training.global_batch_size} is not a multiple of "
                f"local_batch_size x data-parallel degree = {per_step}; gradient accumulation "
                "needs a whole "
                "number of micro-batches",
            )
    for key, default in (
        ("pipeline_parallel_layers_per_stage", None),
        ("module_fqns_per_model_part", None),
        ("pipeline_parallel_schedule_csv", ""),
        ("pipeline_parallel_first_stage_less_layers", 1),
        ("pipeline_parallel_last_stage_less_layers", 1),
    ):
        if getattr(p, key) not in (default, None if default == "" else default):
            _refuse(
                f"parallelism.{key}",
                "the skip-aware splitter decides the stages (they must start on "
                "IndexShare full layers); give an explicit split with "
                "parallelism.pipeline_parallel_layout",
            )
    if p.pipeline_parallel_layout is not None:
        try:
            parse_layout(p.pipeline_parallel_layout)
        except LayoutError as e:
            _refuse("parallelism.pipeline_parallel_layout", str(e))
    if (
        p.pipeline_parallel_degree > 1
        and p.pipeline_parallel_expert_parallel_overlap
        and p.pipeline_parallel_schedule.lower() == "dualpipev"
    ):
        _refuse(
            "parallelism.pipeline_parallel_expert_parallel_overlap",
            "the DualPipeV EP overlap callback is torchtitan's for its own MoE; set it to false",
        )
    if p.pipeline_parallel_degree > 1:
        try:
            microbatches(cfg.training.local_batch_size, p.pipeline_parallel_microbatch_size)
        except ValueError as e:
            _refuse("parallelism.pipeline_parallel_microbatch_size", str(e))
    if cfg.lora.enable:
        _validate_lora(cfg)
    _validate_fp8(cfg)


# the model converters titan_glm52 implements (torchtitan's names)
FP8_LINEARS, FP8_EXPERTS = "quantize.linear.float8", "quantize.grouped_mm.float8"


def _validate_fp8(cfg: JobConfig) -> None:
    """``model.converters`` and the ``[quantize]`` options FP8 training uses."""
    for name in cfg.model.converters:
        if name not in (FP8_LINEARS, FP8_EXPERTS):
            _refuse(
                "model.converters",
                f"{name!r} is not implemented; the converters here are {FP8_LINEARS!r} and "
                f"{FP8_EXPERTS!r} (FP8 training, docs/fp8_training.md)",
            )
    linear, experts = cfg.quantize.linear.float8, cfg.quantize.grouped_mm.float8
    for key, value, default, converter in (
        ("quantize.linear.float8.recipe_name", linear.recipe_name, "blockwise", None),
        (
            "quantize.linear.float8.filter_fqns",
            linear.filter_fqns,
            list(DEFAULT_FP8_FILTER),
            FP8_LINEARS,
        ),
        ("quantize.grouped_mm.float8.fqns", experts.fqns, ["experts"], FP8_EXPERTS),
        ("quantize.grouped_mm.float8.recipe_name", experts.recipe_name, "blockwise", FP8_EXPERTS),
    ):
        used = (
            bool(cfg.model.converters) if converter is None else converter in cfg.model.converters
        )
        if value != default and not used:
            _refuse(
                key,
                f"{value!r} has no effect without the converter "
                f"{converter or FP8_LINEARS!r} in model.converters; add it, or leave the option "
                "at its default",
            )
    if not cfg.model.converters:
        return
    recipe = linear.recipe_name
    if recipe not in FP8_RECIPES:
        _refuse(
            "quantize.linear.float8.recipe_name",
            f"{recipe!r} is not implemented; use one of {FP8_RECIPES} (docs/fp8_training.md)",
        )
    if FP8_LINEARS in cfg.model.converters and recipe in FP8_TORCHAO_RECIPES:
        if importlib.util.find_spec("torchao") is None:
            _refuse(
                "quantize.linear.float8.recipe_name",
                f"{recipe!r} runs torchao's Float8Linear and torchao is not installed; pip "
                "install torchao, or use 'blockwise'",
            )
    if cfg.lora.enable:
        _refuse(
            "model.converters",
            "FP8 products with LoRA adapters are not implemented; remove the FP8 converters or "
            "set lora.enable false",
        )
    if experts.recipe_name not in FP8_EXPERT_RECIPES:
        _refuse(
            "quantize.grouped_mm.float8.recipe_name",
            f"{experts.recipe_name!r} is not implemented; use one of {FP8_EXPERT_RECIPES}",
        )
    if FP8_EXPERTS not in cfg.model.converters:
        return
    if experts.recipe_name == "blockwise" and cfg.moe.grouped_mm == "on":
        _refuse(
            "moe.grouped_mm",
            "'on' asks for one grouped bf16 GEMM, while the block-wise FP8 experts run one GEMM "
            "per expert; set it to 'auto' or 'off', set quantize.grouped_mm.float8.recipe_name "
            f"'rowwise', or drop the converter {FP8_EXPERTS!r}",
        )
    if experts.recipe_name == "rowwise" and cfg.moe.grouped_mm == "off":
        _refuse(
            "moe.grouped_mm",
            "'off' asks for one GEMM per expert, while the rowwise FP8 experts run one grouped "
            "GEMM; set it to 'auto' or 'on', or quantize.grouped_mm.float8.recipe_name "
            "'blockwise'",
        )


def _validate_lora(cfg: JobConfig) -> None:
    """The ``[lora]`` section's values and what LoRA cannot be combined with."""
    lo = cfg.lora
    if lo.rank < 1:
        _refuse("lora.rank", f"{lo.rank}: must be >= 1")
    if lo.alpha <= 0:
        _refuse("lora.alpha", f"{lo.alpha}: must be > 0")
    if not 0 <= lo.dropout < 1:
        _refuse("lora.dropout", f"{lo.dropout}: must be in [0, 1)")
    if not lo.target_modules:
        _refuse("lora.target_modules", f"empty; name some of {list(ATTENTION_TARGETS)}")
    for name in lo.target_modules:
        if (why := target_refusal(name)) is not None:
            _refuse("lora.target_modules", why)
    if lo.dropout > 0 and "kv_b_proj" in lo.target_modules:
        _refuse(
            "lora.dropout",
            "the attention folds kv_b_proj's weight into the queries (absorbed MLA), where no "
            "input exists to drop: set dropout = 0 or remove kv_b_proj from lora.target_modules",
        )
    if lo.dropout > 0 and cfg.activation_checkpoint.mode != "none":
        _refuse(
            "lora.dropout",
            "activation checkpointing recomputes without the forward's dropout masks: set "
            "dropout = 0 or activation_checkpoint.mode = 'none'",
        )
    ac = cfg.activation_checkpoint
    chunked = [k for k in ("mlp_token_chunk", "mtp_token_chunk") if getattr(ac, k) > 0]
    if lo.dropout > 0 and chunked and set(lo.target_modules) & set(MLP_TARGETS):
        _refuse(
            "lora.dropout",
            f"activation_checkpoint.{chunked[0]} recomputes the MLPs without the forward's "
            "dropout masks: set dropout = 0, that chunk to 0, or adapt attention modules only",
        )
    if cfg.dsa.mode != "sparse" or cfg.dsa.indexer_loss_coeff > 0:
        _refuse(
            "dsa.indexer_loss_coeff",
            "with lora.enable the indexers are frozen with the base model: set "
            "dsa.indexer_loss_coeff = 0 and dsa.mode = 'sparse'",
        )
    if cfg.moe.bias_update_rate != 0:
        _refuse(
            "moe.bias_update_rate",
            "with lora.enable the routing bias belongs to the frozen base model, which the "
            "adapter does not carry: set it to 0",
        )


def model_args(cfg: JobConfig) -> GLM52ModelArgs:
    """The model args of a job: the flavor or ``model.hf_config``, with the ``[model]`` / ``[dsa]``
    overrides; a ``training.seq_len`` past the args' ``max_position_embeddings`` is refused unless
    ``model.extend_positions``."""
    try:
        args = (
            GLM52ModelArgs.from_hf_config(cfg.model.hf_config)
            if cfg.model.hf_config
            else get_flavor(cfg.model.flavor)
        )
    except (OSError, ValueError) as e:
        key = "model.hf_config" if cfg.model.hf_config else "model.flavor"
        raise ConfigError(f"{key}: {e}") from e
    changes = {}
    if cfg.model.num_layers is not None:
        changes["num_hidden_layers"] = cfg.model.num_layers
        changes["first_k_dense_replace"] = min(args.first_k_dense_replace, cfg.model.num_layers)
    if cfg.model.n_routed_experts is not None:
        changes["n_routed_experts"] = cfg.model.n_routed_experts
    if cfg.dsa.index_topk is not None:
        changes["index_topk"] = cfg.dsa.index_topk
    try:
        args = args.replace(**changes) if changes else args
    except ValueError as e:
        raise ConfigError(f"model overrides ({', '.join(changes)}): {e}") from e
    if cfg.training.seq_len > args.max_position_embeddings and not cfg.model.extend_positions:
        _refuse(
            "training.seq_len",
            f"{cfg.training.seq_len} is above the model's max_position_embeddings "
            f"({args.max_position_embeddings}); shorten it, or set model.extend_positions to train "
            "there",
        )
    return args


def dsa_backend(cfg: JobConfig, device_type: str) -> str:
    """``dsa.backend`` as the model runs it: "auto" is triton on CUDA, torch elsewhere."""
    if cfg.dsa.backend == "auto":
        return "triton" if device_type == "cuda" else "torch"
    return cfg.dsa.backend


def model_options(cfg: JobConfig, device_type: str) -> ModelOptions:
    """The model's runtime options of a job on ``device_type`` ("cuda" or "cpu")."""
    d, m = cfg.dsa, cfg.moe
    trainable = (
        "indexers"
        if d.mode == "dense_warmup"
        else "all_but_indexers"
        if d.freeze_indexer
        else "all"
    )
    return ModelOptions(
        dsa_backend=dsa_backend(cfg, device_type),
        gluon_kernels=d.gluon_kernels,
        sparse_attention=d.mode == "sparse",
        # under context parallelism the prefix rows run on the sparse kernels (the same math): their
        # dense causal form would need keys held by other ranks
        dense_prefix=d.dense_prefix and cfg.parallelism.context_parallel_degree == 1,
        dense_masked_ratio=d.dense_masked_ratio,
        recompute_latent_query=d.recompute_latent_query,
        indexer_loss_coeff=d.indexer_loss_coeff,
        seq_aux_loss_coeff=m.seq_aux_loss_coeff,
        grouped_mm={"auto": None, "on": True, "off": False}[m.grouped_mm],
        recompute_expert_inputs=m.recompute_expert_inputs,
        mlp_token_chunk=cfg.activation_checkpoint.mlp_token_chunk,
        mtp_token_chunk=cfg.activation_checkpoint.mtp_token_chunk,
        trainable=trainable,
    )


# ------------------------------------------------------------------------------ types and ranges
# Smallest (and, where there is one, largest) value of the numeric options a value out of range
# would break.
_RANGES: dict[str, tuple[float | None, float | None]] = {
    "training.steps": (1, None),
    "training.seq_len": (2, None),
    "training.local_batch_size": (1, None),
    "training.global_batch_size": (-1, None),
    "training.max_norm": (0, None),
    "training.gc_freq": (1, None),
    "optimizer.lr": (0, None),
    "optimizer.eps": (0, None),
    "optimizer.weight_decay": (0, None),
    "optimizer.beta1": (0, 1),
    "optimizer.beta2": (0, 1),
    "lr_scheduler.warmup_steps": (0, None),
    "lr_scheduler.min_lr_factor": (0, 1),
    "checkpoint.interval": (1, None),
    "checkpoint.keep_latest_k": (0, None),
    "metrics.log_freq": (1, None),
    "data.prefetch": (0, None),
    "data.seed": (0, None),
    "dsa.recall_queries": (0, None),
    "dsa.index_topk": (1, None),
    "dsa.indexer_loss_coeff": (0, None),
    "moe.bias_update_rate": (0, None),
    "activation_checkpoint.mlp_token_chunk": (0, None),
    "activation_checkpoint.mtp_token_chunk": (0, None),
    "moe.seq_aux_loss_coeff": (0, None),
    "mtp.loss_weight": (0, None),
    "model.num_layers": (1, None),
    "model.n_routed_experts": (1, None),
    "parallelism.data_parallel_replicate_degree": (1, None),
    "parallelism.data_parallel_shard_degree": (-1, None),
    "parallelism.expert_parallel_degree": (1, None),
    "parallelism.pipeline_parallel_degree": (1, None),
    "parallelism.pipeline_parallel_microbatch_size": (1, None),
    "parallelism.pipeline_parallel_stages_per_rank": (1, None),
    "faults.max_consecutive_nonfinite": (1, None),
    "profiling.profile_freq": (1, None),
}


def _describe(hint) -> str:
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(hint))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    return (
        "None"
        if hint is type(None)
        else getattr(hint, "__name__", str(hint).replace("typing.", ""))
    )


def _fits(value, hint) -> bool:
    """Whether ``value`` (as TOML gives it) is a value of the annotation ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin is Literal:
        return value in args
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and (
            not args or all(_fits(v, args[0]) for v in value)
        )
    if origin is dict:
        return isinstance(value, dict)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # an annotation this check does not know: tyro and validate have the last word


def _check_types_and_ranges(cfg: JobConfig) -> None:
    """Every option's value has its annotated type (TOML values arrive unconverted) and every count
    its range."""
    for section in dataclasses.fields(cfg):
        part = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(part):
            continue
        hints = typing.get_type_hints(type(part))
        for f in dataclasses.fields(part):
            key, value = f"{section.name}.{f.name}", getattr(part, f.name)
            if dataclasses.is_dataclass(value):
                continue
            if not _fits(value, hints.get(f.name, typing.Any)):
                _refuse(
                    key,
                    f"expected {_describe(hints[f.name])}, got {value!r} ({type(value).__name__}); "
                    "fix it in the TOML file or on the command line",
                )
            low, high = _RANGES.get(key, (None, None))
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if (low is not None and value < low) or (high is not None and value > high):
                    bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
                    _refuse(key, f"{value} is out of range: must be {bounds}")


def lora_spec(cfg: JobConfig, base_dtype) -> LoRASpec | None:
    """The job's LoRA adapters (None without ``lora.enable``), the frozen base kept in
    ``base_dtype`` (the compute dtype)."""
    lo = cfg.lora
    if not lo.enable:
        return None
    return LoRASpec(
        rank=lo.rank,
        alpha=lo.alpha,
        dropout=lo.dropout,
        target_modules=tuple(lo.target_modules),
        use_rslora=lo.use_rslora,
        base_dtype=base_dtype,
    )


def fp8_spec(cfg: JobConfig) -> Fp8Spec | None:
    """The job's FP8 training (None without an FP8 converter in ``model.converters``)."""
    converters = cfg.model.converters
    if FP8_LINEARS not in converters and FP8_EXPERTS not in converters:
        return None
    return Fp8Spec(
        recipe=cfg.quantize.linear.float8.recipe_name,
        linears=FP8_LINEARS in converters,
        filter_fqns=tuple(cfg.quantize.linear.float8.filter_fqns),
        expert_fqns=tuple(cfg.quantize.grouped_mm.float8.fqns) if FP8_EXPERTS in converters else (),
        expert_recipe=cfg.quantize.grouped_mm.float8.recipe_name,
    )


class _ConfigManager(ConfigManager):
    def _validate_config(self) -> None:
        """torchtitan's checks concern its own tokenizer assets; ours are in ``validate``."""
        if self.config.model.tokenizer_path:
            _refuse(
                "model.tokenizer_path",
                "use model.hf_assets_path (a tokenizer directory or 'embedded')",
            )


def _config_file(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        key, _, value = arg.partition("=")
        if key in ("--job.config_file", "--job.config-file"):
            return value or (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def _tyro_message(text: str) -> str:
    """tyro's boxed command-line error as one line: its first paragraph, and a suggestion where it
    has one."""
    rows = [r.strip(" │╭╮╰╯─") for r in text.splitlines()]
    rows = [r for r in rows if r and not r.startswith(("For full helptext", "Argument helptext"))]
    body = " ".join(rows[1:] if len(rows) > 1 else rows)
    body = body.split("Perhaps you meant:")
    message = re.sub(r"\s+", " ", body[0]).strip()
    if len(body) > 1 and (hint := re.search(r"(--[\w.-]+)", body[1])):
        message += f"; did you mean {hint.group(1).replace('-', '_').replace('__', '--')}?"
    return message + "; `python train.py --help` lists every option"


def parse_job_config(argv: list[str]) -> JobConfig:
    """Parses TOML + CLI into a JobConfig (refusing unknown keys, wrong types and values out of
    range) and validates what needs no process group. ``-h`` / ``--help`` prints this project's
    options and exits."""
    argv = list(argv)
    if "-h" in argv or "--help" in argv:
        from titan_glm52.config_help import print_help

        print_help(JobConfig, _NOT_IMPLEMENTED)
        sys.exit(0)
    path = _config_file(argv)
    if path is not None and not os.path.isfile(path):
        raise ConfigError(
            f"job.config_file: {path} is not a file; give the path of a TOML config "
            "(e.g. train_configs/glm52_debug.toml)"
        )
    if path is not None:
        try:
            with open(path, "rb") as f:
                tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"job.config_file: {path} is not valid TOML ({e})") from None
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            cfg = _ConfigManager(JobConfig).parse_args(argv)
    except SystemExit:  # tyro printed a boxed error about the command line
        raise ConfigError(_tyro_message(errors.getvalue())) from None
    except ValueError as e:  # torchtitan's message names the class and the unknown keys
        m = re.search(r"Invalid field names in <class '[\w.]*?(\w+)'> data: (\{.*?\})", str(e))
        if m:
            raise ConfigError(
                f"unknown key(s) {m.group(2)} in the TOML section of {m.group(1)} "
                "(e.g. [model] for Model); `python train.py --help` lists every valid key"
            ) from e
        raise ConfigError(str(e)) from e
    except TypeError as e:  # a TOML section that is not a table, a value of another shape
        raise ConfigError(f"job.config_file: {path}: {e}") from e
    sys.stderr.write(errors.getvalue())
    validate(cfg)
    return cfg
