"""``python -m titan_glm52.plan``: plan the 744B model's parallel layout without any GPU.

    python -m titan_glm52.plan layout --flavor glm52_744b --pp 8 [--schedule 1F1B] [--stages-per-rank V]
                                      [--seq-len 4096] [--layers-per-stage 14,8,8,8,8,8,8,16]

``layout`` prints the pipeline split (``pipeline_split.py`` decides it; this file only parses and prints): a line
``layers per stage: a,b,...``, then one line per stage (rank, layers, first layer, cost share, extra modules).
With ``--layers-per-stage`` it checks that layout instead: exit status 1 and the reason on stderr when it is
invalid, 0 and the same printout when it is valid. ``--hf-config`` reads a ``config.json`` instead of a flavor.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from titan_glm52 import pipeline_split as ps
from titan_glm52.model.args import FLAVORS, GLM52ModelArgs, get_flavor


# ------------------------------------------------------------------------------------- shared options
def _add_model_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--flavor", choices=sorted(FLAVORS), default=None,
                       help="model flavor from titan_glm52.model.args.FLAVORS (default: glm52_744b)")
    group.add_argument("--hf-config", metavar="PATH", default=None,
                       help="a config.json (or a checkpoint directory holding one) instead of a flavor")


def _load_model(ns: argparse.Namespace) -> tuple[str, GLM52ModelArgs]:
    if ns.hf_config is not None:
        return ns.hf_config, GLM52ModelArgs.from_hf_config(ns.hf_config)
    name = ns.flavor or "glm52_744b"
    return name, get_flavor(name)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


# ------------------------------------------------------------------------------------- layout
def _add_layout_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("layout", help="pipeline split: layers per stage, ranks, cost shares",
                       description="Choose (or check) the pipeline split: every stage starts on a full "
                                   "(indexer) layer; costs are forward FLOPs per token.")
    _add_model_options(p)
    p.add_argument("--pp", type=int, required=True, help="pipeline parallel degree (ranks)")
    p.add_argument("--schedule", default="1F1B",
                   help="torch.distributed.pipelining schedule name (1F1B, GPipe, Interleaved1F1B, LoopedBFS, "
                        "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV); default 1F1B")
    p.add_argument("--stages-per-rank", type=int, default=None, metavar="V",
                   help="stages per rank (default: 1 for single-stage schedules, 2 otherwise)")
    p.add_argument("--seq-len", type=int, default=ps.DEFAULT_SEQ_LEN, help="sequence length for the cost model")
    p.add_argument("--layers-per-stage", type=_int_list, default=None, metavar="N,N,...",
                   help="check this layout instead of choosing one")
    p.set_defaults(func=_cmd_layout)


def _layer_range(first: int, n: int) -> str:
    return f"layer {first}" if n == 1 else f"layers {first}-{first + n - 1}"


def _cmd_layout(ns: argparse.Namespace) -> int:
    model_name, args = _load_model(ns)
    plan = ps.plan_pipeline(args, ns.schedule, ns.pp, ns.stages_per_rank, seq_len=ns.seq_len,
                            layers_per_stage=ns.layers_per_stage)
    sched, pl = args.index_share, plan.placement
    n_moe = sum(args.is_moe_layer(i) for i in range(args.num_hidden_layers))
    print(f"model: {model_name}: {args.num_hidden_layers} decoder layers ({args.num_hidden_layers - n_moe} dense, "
          f"{n_moe} MoE), {len(sched.full_layers)} full / {args.num_hidden_layers - len(sched.full_layers)} shared, "
          f"MTP layer: {'yes' if args.num_nextn_predict_layers else 'no'}")
    print(f"schedule: {pl.schedule} ({pl.style} placement), pp {pl.pp_degree}, {pl.stages_per_rank} stage(s) per "
          f"rank, {pl.num_stages} stages; cost = forward FLOPs/token at seq_len {plan.seq_len}")
    if ns.layers_per_stage is not None:
        print("given layout is valid")
    print(f"layers per stage: {','.join(str(n) for n in plan.layers_per_stage)}")
    total = plan.total_cost
    for s, (first, n, cost, names) in enumerate(zip(plan.first_layers, plan.layers_per_stage, plan.stage_costs,
                                                     plan.module_names)):
        kind = "full" if sched.is_full(first) else "SHARED"  # never SHARED for a plan that passed validation
        extras = [m for m in names if not m.startswith("layers.")]
        print(f"stage {s}: rank {pl.stage_to_rank[s]}, {_layer_range(first, n)}, first layer {first} ({kind}), "
              f"{n} layers, cost share {100 * cost / total:.1f}%" + (f", + {', '.join(extras)}" if extras else ""))
    if pl.stages_per_rank > 1:
        for r, cost in enumerate(plan.rank_costs):
            print(f"rank {r}: stages {','.join(str(s) for s in pl.stages_of_rank(r))}, "
                  f"cost share {100 * cost / total:.1f}%")
    mean = total / pl.num_stages
    print(f"max stage cost / mean: {max(plan.stage_costs) / mean:.3f} "
          f"(max {max(plan.stage_costs):.3e} FLOPs/token, total {total:.3e})")
    return 0


# ------------------------------------------------------------------------------------- entry point
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m titan_glm52.plan",
                                     description="Plan titan_glm52 parallel layouts (no GPU needed).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_layout_parser(sub)
    # `memory` (per-rank memory for a layout) is added here later: write `_add_memory_parser(sub)` next to
    # `_add_layout_parser`, reuse `_add_model_options`/`_load_model`, and have its handler return the exit status.
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except ValueError as e:  # a refused layout, schedule or config: the message says what and how to fix it
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
