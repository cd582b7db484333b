"""``python -m titan_glm52.plan``: plan the 744B model's parallel layout without any GPU.

    python -m titan_glm52.plan layout --flavor glm52_744b --pp 8 [--schedule 1F1B]
                                      [--stages-per-rank V] [--seq-len 4096]
                                      [--layers-per-stage 14,8,8,8,8,8,8,16]

    python -m titan_glm52.plan memory --flavor glm52_744b --gpus 256 --pp 8 --ep 32 [--cp N]
                                      [--dp-replicate R] [--schedule 1F1B] [--stages-per-rank V]
                                      [--layers-per-stage ...] [--seq-len 4096]
                                      [--local-batch-size 1] [--microbatch-size 1]
                                      [--ac full|selective|none] [--gpu-memory-gib 141]
                                      [--param-dtype bf16] [--master-weights fsdp|optimizer]
                                      [--grad-accumulation] [--optimizer-state-dtype bf16]

``layout`` prints the pipeline split (``pipeline_split.py`` decides it; this file only parses and
prints): a line ``layers per stage: a,b,...``, then one line per stage (rank, layers, first layer,
cost share, extra modules). With ``--layers-per-stage`` it checks that layout instead: exit status 1
and the reason on stderr when it is invalid, 0 and the same printout when it is valid.
``--hf-config`` reads a ``config.json`` instead of a flavor.

``memory`` builds each pipeline rank's stages on the meta device over a fake process group of
``--gpus`` ranks with the real mesh, pipeline and parallelize code and prints a per-rank table
(``memory_estimate.py`` computes it and documents the activation formulas), the ``layers per
stage:`` line and the budget. Exit status 0 when every rank fits in ``--gpu-memory-gib`` less
``--headroom``, 2 when one does not, 1 (message on stderr) when the request is invalid, e.g. a
layout ``layout`` would refuse.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from titan_glm52 import pipeline_split as ps
from titan_glm52.model.args import FLAVORS, GLM52ModelArgs, get_flavor


# ----------------------------------------------------------------------------------- shared options
def _add_model_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--flavor",
        choices=sorted(FLAVORS),
        default=None,
        help="model flavor from titan_glm52.model.args.FLAVORS (default: glm52_744b)",
    )
    group.add_argument(
        "--hf-config",
        metavar="PATH",
        default=None,
        help="a config.json (or a checkpoint directory holding one) instead of a flavor",
    )


def _load_model(ns: argparse.Namespace) -> tuple[str, GLM52ModelArgs]:
    if ns.hf_config is not None:
        return ns.hf_config, GLM52ModelArgs.from_hf_config(ns.hf_config)
    name = ns.flavor or "glm52_744b"
    return name, get_flavor(name)


def _layout(text: str) -> tuple[int, ...]:
    try:
        return ps.parse_layout(text)
    except ps.LayoutError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ------------------------------------------------------------------------------------- layout
def _add_layout_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "layout",
        help="pipeline split: layers per stage, ranks, cost shares",
        description="Choose (or check) the pipeline split: every stage starts on a full "
        "(indexer) layer; costs are forward FLOPs per token.",
    )
    _add_model_options(p)
    p.add_argument("--pp", type=int, required=True, help="pipeline parallel degree (ranks)")
    p.add_argument(
        "--schedule",
        default="1F1B",
        help="torch.distributed.pipelining schedule name (1F1B, GPipe, Interleaved1F1B, LoopedBFS, "
        "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV); default 1F1B",
    )
    p.add_argument(
        "--stages-per-rank",
        type=int,
        default=None,
        metavar="V",
        help="stages per rank (default: 1 for single-stage schedules, 2 otherwise)",
    )
    p.add_argument(
        "--seq-len", type=int, default=ps.DEFAULT_SEQ_LEN, help="sequence length for the cost model"
    )
    p.add_argument(
        "--layers-per-stage",
        type=_layout,
        default=None,
        metavar="N,N,...",
        help="check this layout instead of choosing one",
    )
    p.set_defaults(func=_cmd_layout)


def _layer_range(first: int, n: int) -> str:
    return f"layer {first}" if n == 1 else f"layers {first}-{first + n - 1}"


def _cmd_layout(ns: argparse.Namespace) -> int:
    model_name, args = _load_model(ns)
    plan = ps.choose_layout(
        args,
        ns.schedule,
        ns.pp,
        ns.stages_per_rank,
        seq_len=ns.seq_len,
        layers_per_stage=ns.layers_per_stage,
    )
    sched, pl = args.index_share, plan.placement
    n_moe = sum(args.is_moe_layer(i) for i in range(args.num_hidden_layers))
    print(
        f"model: {model_name}: {args.num_hidden_layers} decoder layers "
        f"({args.num_hidden_layers - n_moe} dense, "
        f"{n_moe} MoE), {len(sched.full_layers)} full / "
        f"{args.num_hidden_layers - len(sched.full_layers)} shared, "
        f"MTP layer: {'yes' if args.num_nextn_predict_layers else 'no'}"
    )
    print(
        f"schedule: {pl.schedule} ({pl.style} placement), pp {pl.pp_degree}, {pl.stages_per_rank} "
        "stage(s) per "
        f"rank, {pl.num_stages} stages; cost = forward FLOPs/token at seq_len {plan.seq_len}"
    )
    if ns.layers_per_stage is not None:
        print("given layout is valid")
    print(f"layers per stage: {','.join(str(n) for n in plan.layers_per_stage)}")
    total = plan.total_cost
    for s, (first, n, cost, names) in enumerate(
        zip(plan.first_layers, plan.layers_per_stage, plan.stage_costs, plan.module_names)
    ):
        # never SHARED for a plan that passed validation
        kind = "full" if sched.is_full(first) else "SHARED"
        extras = [m for m in names if not m.startswith("layers.")]
        print(
            f"stage {s}: rank {pl.stage_to_rank[s]}, {_layer_range(first, n)}, first layer {first} "
            f"({kind}), "
            f"{n} layers, cost share {100 * cost / total:.1f}%"
            + (f", + {', '.join(extras)}" if extras else "")
        )
    if pl.stages_per_rank > 1:
        for r, cost in enumerate(plan.rank_costs):
            print(
                f"rank {r}: stages {','.join(str(s) for s in pl.stages_of_rank(r))}, "
                f"cost share {100 * cost / total:.1f}%"
            )
    mean = total / pl.num_stages
    print(
        f"max stage cost / mean: {max(plan.stage_costs) / mean:.3f} "
        f"(max {max(plan.stage_costs):.3e} FLOPs/token, total {total:.3e})"
    )
    return 0


# ------------------------------------------------------------------------------------- memory
def _add_memory_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "memory",
        help="per-rank GPU memory of a parallel layout (fake world, meta model)",
        description="Build every pipeline rank's stages on the meta device over a fake process "
        "group with the real mesh/pipeline/parallelize code, read the FSDP2 shard "
        "sizes, add an activation estimate and check the budget. Exit status 0: every "
        "rank fits; 2: some rank does not; 1: the request is invalid (as `layout`).",
    )
    _add_model_options(p)
    p.add_argument(
        "--config",
        metavar="TOML",
        default=None,
        help="a training config (train_configs/*.toml) to plan; the options below override it. "
        "Without it: the 744B model, seq_len 4096, local batch 1, AC full, bf16, as below",
    )
    p.add_argument("--gpus", type=int, required=True, help="world size (ranks, one GPU each)")
    p.add_argument("--pp", type=int, default=None, help="pipeline parallel degree (default 1)")
    p.add_argument(
        "--cp",
        type=int,
        default=None,
        help="context parallel degree: every sequence split over this many ranks, which join the "
        "FSDP ranks (parallelism.context_parallel_degree; default 1)",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=None,
        help="expert parallel degree, carved out of dp_shard (default 1)",
    )
    p.add_argument("--dp-replicate", type=int, default=None, help="HSDP replicas (default 1)")
    p.add_argument(
        "--dp-shard", type=int, default=None, help="FSDP degree; -1 = the ranks left over (default)"
    )
    p.add_argument(
        "--schedule", default=None, help="pipeline schedule name, as for `layout` (default 1F1B)"
    )
    p.add_argument(
        "--stages-per-rank", type=int, default=None, metavar="V", help="stages per pipeline rank"
    )
    p.add_argument(
        "--layers-per-stage",
        type=_layout,
        default=None,
        metavar="N,N,...",
        help="explicit layout (validated as by `layout`); default: the splitter's choice",
    )
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default 4096)")
    p.add_argument(
        "--local-batch-size",
        type=int,
        default=None,
        help="samples per data-parallel rank per step (training.local_batch_size; default 1)",
    )
    p.add_argument(
        "--microbatch-size",
        type=int,
        default=None,
        help="samples per pipeline micro-batch (parallelism.pipeline_parallel_microbatch_size)",
    )
    p.add_argument(
        "--ac",
        choices=("full", "selective", "none"),
        default=None,
        help="activation checkpointing mode (default full)",
    )
    p.add_argument(
        "--selective-ac-option", default=None, help="'op' or N (every N-th block); default op"
    )
    p.add_argument(
        "--param-dtype",
        choices=("bf16", "fp32"),
        default=None,
        help="FSDP compute dtype (training.mixed_precision_param); master weights are fp32",
    )
    p.add_argument(
        "--reshard-after-forward",
        choices=("default", "always", "never"),
        default=None,
        help="parallelism.fsdp_reshard_after_forward (default: default)",
    )
    p.add_argument(
        "--mtp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="train the MTP layer (mtp.enable; default on)",
    )
    p.add_argument(
        "--dense-prefix",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="dsa.dense_prefix (default on): the first index_topk rows of each sequence on SDPA",
    )
    p.add_argument(
        "--recompute-expert-inputs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="moe.recompute_expert_inputs (default on): routed experts rebuild their GEMM inputs "
        "in "
        "backward instead of keeping them",
    )
    p.add_argument(
        "--recompute-latent-query",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="dsa.recompute_latent_query (default on): the sparse attention's backward rebuilds "
        "its latent "
        "query instead of keeping it",
    )
    p.add_argument(
        "--mlp-token-chunk",
        type=int,
        default=None,
        help="activation_checkpoint.mlp_token_chunk (default 0 = off): the routed experts over "
        "chunks of this many tokens, "
        "each rebuilt in backward",
    )
    p.add_argument(
        "--mtp-token-chunk",
        type=int,
        default=None,
        help="activation_checkpoint.mtp_token_chunk (default 0 = off): the MTP layer's input "
        "projection, MLP and final norm over chunks of this many tokens, each rebuilt in backward",
    )
    p.add_argument(
        "--dense-masked-ratio",
        type=float,
        default=None,
        help="dsa.dense_masked_ratio (default 0 = off): sequences of index_topk < S <= ratio x "
        "index_topk run their later rows on SDPA with a selection mask",
    )
    p.add_argument(
        "--master-weights",
        choices=("fsdp", "optimizer"),
        default=None,
        help="training.master_weights as the trainer resolves it: 'optimizer' (one GPU, bf16: the "
        "Triton AdamW step holds the fp32 masters, the model trains on bf16 copies, no FSDP; what "
        "'auto' picks with optimizer.implementation = 'triton', as in glm52_proxy.toml) or 'fsdp' "
        "(default)",
    )
    p.add_argument(
        "--optimizer-state-dtype",
        choices=("fp32", "bf16"),
        default=None,
        help="optimizer.state_dtype: 'bf16' keeps Adam's two moments in bf16 (with the Triton "
        "step, as glm52_proxy.toml does: 4 bytes per trainable parameter fewer) or 'fp32' "
        "(default)",
    )
    p.add_argument(
        "--grad-accumulation",
        action="store_true",
        help="several micro-batches per optimizer step (training.global_batch_size above the "
        "local batch x data-parallel ranks): with --master-weights optimizer the gradients are "
        "summed in fp32",
    )
    p.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=141.0,
        help="memory per GPU in GiB (default 141; an H200 reports 143771 MiB = 140.4 GiB)",
    )
    p.add_argument(
        "--headroom",
        type=float,
        default=0.10,
        help="fraction of the GPU left unplanned for the CUDA context, NCCL, fragmentation "
        "(default 0.10)",
    )
    p.add_argument(
        "--expert-load-factor",
        type=float,
        default=1.0,
        help="routed rows a rank's experts receive over the balanced mean (default 1.0)",
    )
    p.set_defaults(func=_cmd_memory)


# The memory command's options as the job config's keys (flag -> "section.key"); the flag values are
# that key's.
_JOB_KEYS = {
    "pp": "parallelism.pipeline_parallel_degree",
    "cp": "parallelism.context_parallel_degree",
    "ep": "parallelism.expert_parallel_degree",
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "schedule": "parallelism.pipeline_parallel_schedule",
    "stages_per_rank": "parallelism.pipeline_parallel_stages_per_rank",
    "microbatch_size": "parallelism.pipeline_parallel_microbatch_size",
    "reshard_after_forward": "parallelism.fsdp_reshard_after_forward",
    "seq_len": "training.seq_len",
    "local_batch_size": "training.local_batch_size",
    "ac": "activation_checkpoint.mode",
    "selective_ac_option": "activation_checkpoint.selective_ac_option",
    "mlp_token_chunk": "activation_checkpoint.mlp_token_chunk",
    "mtp_token_chunk": "activation_checkpoint.mtp_token_chunk",
    "dense_masked_ratio": "dsa.dense_masked_ratio",
}
_JOB_SWITCHES = {
    "mtp": "mtp.enable",
    "dense_prefix": "dsa.dense_prefix",
    "recompute_expert_inputs": "moe.recompute_expert_inputs",
    "recompute_latent_query": "dsa.recompute_latent_query",
}


def memory_job_config(ns: argparse.Namespace):
    """The job config a ``memory`` command describes: ``--config`` (a training TOML) or this tool's
    defaults, with every option given on the command line laid over it, checked by the trainer's own
    ``config.validate``."""
    from titan_glm52.config import ConfigError, parse_job_config, validate
    from titan_glm52.memory_estimate import CONFIG_DTYPE

    argv = (
        ["--job.config_file", ns.config]
        if ns.config
        else [
            "--model.flavor",
            "glm52_744b",
            "--training.seq_len",
            str(ps.DEFAULT_SEQ_LEN),
            "--training.local_batch_size",
            "1",
            "--activation_checkpoint.mode",
            "full",
            "--activation_checkpoint.selective_ac_option",
            "op",
            "--training.mixed_precision_param",
            "bfloat16",
        ]
    )
    if ns.flavor:
        argv += ["--model.flavor", ns.flavor]
    if ns.hf_config:
        argv += ["--model.hf_config", ns.hf_config]
    for flag, key in _JOB_KEYS.items():
        if getattr(ns, flag) is not None:
            argv += [f"--{key}", str(getattr(ns, flag))]
    for flag, key in _JOB_SWITCHES.items():
        if getattr(ns, flag) is not None:
            section, name = key.split(".")
            argv.append(f"--{section}.{name}" if getattr(ns, flag) else f"--{section}.no-{name}")
    if ns.layers_per_stage is not None:
        argv += ["--parallelism.pipeline_parallel_layout", ",".join(map(str, ns.layers_per_stage))]
    if ns.param_dtype is not None:
        argv += ["--training.mixed_precision_param", CONFIG_DTYPE[ns.param_dtype]]
    if ns.master_weights is not None:
        argv += ["--training.master_weights", ns.master_weights]
    if ns.optimizer_state_dtype is not None:
        argv += ["--optimizer.state_dtype", CONFIG_DTYPE[ns.optimizer_state_dtype]]
    # master weights in the optimizer and bf16 moments are the Triton step's, as the trainer's rule
    # has it
    if ns.master_weights == "optimizer" or ns.optimizer_state_dtype == "bf16":
        argv += ["--optimizer.implementation", "triton"]
    try:
        cfg = parse_job_config(argv)
        if ns.grad_accumulation:  # two micro-batches per optimizer step
            p = cfg.parallelism
            dp = ns.gpus // (p.pipeline_parallel_degree * p.context_parallel_degree)
            cfg.training.global_batch_size = 2 * cfg.training.local_batch_size * dp
        validate(cfg, ns.gpus)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    return cfg


def memory_request(ns: argparse.Namespace):
    """The ``MemoryRequest`` of parsed ``memory`` options: the trainer's request for
    ``memory_job_config(ns)``."""
    from titan_glm52.memory_estimate import request_from_job_config

    return request_from_job_config(
        memory_job_config(ns),
        ns.gpus,
        gpu_memory_gib=ns.gpu_memory_gib,
        headroom=ns.headroom,
        expert_load_factor=ns.expert_load_factor,
    )


def _cmd_memory(ns: argparse.Namespace) -> int:
    from titan_glm52.memory_estimate import format_report, estimate_memory

    report = estimate_memory(memory_request(ns))
    print(format_report(report, ns.hf_config or ns.flavor or ns.config or "glm52_744b"))
    return 0 if report.fits else 2


# ------------------------------------------------------------------------------------- entry point
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m titan_glm52.plan",
        description="Plan titan_glm52 parallel layouts (no GPU needed).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_layout_parser(sub)
    _add_memory_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    # a refused layout, schedule or config: the message says what and how to fix it
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
