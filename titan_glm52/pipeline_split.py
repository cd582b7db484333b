"""Skip-aware, schedule-aware pipeline splitting: which decoder layers each pipeline stage holds.

Pure logic (no process groups, no model): ``pipeline.py`` builds stages from what this module
decides, and ``python -m titan_glm52.plan layout`` prints it. The IndexShare schedule comes from
``args.index_share`` (``model/index_share.py``); nothing here re-derives it.

* ``stage_placement(schedule, pp_degree, stages_per_rank)``: how many stages a
  torch.distributed.pipelining schedule runs and which rank holds each (one per rank; loop order,
  stage s on rank s % pp; or V order).
* ``layer_costs(args, seq_len)`` and ``stage_extra_costs(args, seq_len)``: the cost model below.
* ``split_layers(schedule, num_stages, costs, first_extra, last_extra)``: the best split;
  ``validate_layout`` checks a given one; ``split(args, num_stages, ...)`` does either from the
  model args.
* ``stage_specs(layers_per_stage, stage_to_rank, with_mtp)``: what each stage holds (``StageSpec``);
  stage building (``pipeline.py``) executes that answer and decides nothing itself.
* ``parse_layout(text)``: ``parallelism.pipeline_parallel_layout`` as layers per stage (the one
  parser).
* ``choose_layout(args, schedule, pp_degree, ...)``: all of the above in one ``PipelineLayout``.

Cost model. The cost of a piece is its forward FLOPs per token at a given sequence length, from the
one FLOP model (``model/flops.py``, which the MFU metric uses too), averaged over the causal
positions of one sequence: a decoder layer's MLA projections, its sparse attention against
min(index_topk, position) keys, its indexer on full layers (against every causal key: the O(seq_len)
part) and its MLP. Backward and recompute scale every matmul alike, so the forward count balances
training as well. The first stage adds the embedding (a gather: 0 FLOPs); the last stage adds the
output head and, when the job trains it, the MTP layer (``eh_proj``, one MoE decoder layer with its
own indexer, and the head again), because MTP needs the last hidden states and the labels.
Communication (all-to-all, stage sends) and memory are not costed.

Splitter semantics. A stage never starts on a shared layer: IndexShare top-k indices are not sent
between stages, so every stage boundary sits right before a full layer. Among the splits into
exactly ``num_stages`` non-empty stages that respect this, ``split_layers`` returns one with the
smallest maximum stage cost (an exact dynamic program over the full layers, not a heuristic); among
those, the one with the smallest sum of squared stage costs; remaining ties go to the earliest cuts.
The splitter balances stages, not ranks: with several stages per rank the rank totals are reported
(``PipelineLayout.rank_costs``) but not optimised. An explicit layout is validated before any work
and refused with a ``LayoutError`` (a ``ValueError``) that names each stage starting on a shared
layer, that layer's source layer, and the valid layout nearest to the given one (smallest L1
distance in layers per stage; ties go to the earliest cuts).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from titan_glm52.model import flops
from titan_glm52.model.index_share import IndexShareSchedule

if TYPE_CHECKING:
    from titan_glm52.model.args import GLM52ModelArgs

DEFAULT_SEQ_LEN = 4096


class LayoutError(ValueError):
    """A pipeline layout that cannot run (bad explicit layout, or no valid split exists)."""


# ------------------------------------------------------------------------------------- placement
@dataclass(frozen=True)
class StagePlacement:
    """Stages of a pipeline schedule and the rank that holds each."""

    # the torch.distributed.pipelining name, e.g. "1F1B", "Interleaved1F1B", "ZBVZeroBubble"
    schedule: str
    style: str  # "single" (one stage per rank), "loop" (stage s on rank s % pp) or "v"
    pp_degree: int
    stages_per_rank: int
    stage_to_rank: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` holds, in stage order."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)


def stage_placement(
    schedule: str, pp_degree: int, stages_per_rank: int | None = None
) -> StagePlacement:
    """Number of stages and stage -> rank for a torch.distributed.pipelining schedule name.

    Single-stage schedules (``PipelineScheduleSingle`` subclasses: GPipe, 1F1B) hold one stage per
    rank. V schedules (ZBVZeroBubble, DualPipeV) hold two: rank r has stages r and 2*pp-1-r. Other
    multi-stage schedules (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble) hold
    ``stages_per_rank`` >= 2 stages in loop order: stage s on rank s % pp. ``stages_per_rank=None``
    means 1 for single-stage schedules, else 2 (torchtitan's default). Impossible combinations raise
    ``ValueError``.
    """
    # Imported here so that the splitting logic itself needs no torch; this module only reads class
    # names.
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
        ScheduleDualPipeV,
        ScheduleZBVZeroBubble,
        get_schedule_class,
    )

    cls = get_schedule_class(schedule)  # ValueError listing the valid names for an unknown one
    name = cls.__name__.removeprefix("Schedule")
    if not isinstance(pp_degree, int) or pp_degree < 1:
        raise ValueError(f"pipeline parallel degree must be an integer >= 1, got {pp_degree!r}")
    if stages_per_rank is not None and (
        not isinstance(stages_per_rank, int) or stages_per_rank < 1
    ):
        raise ValueError(f"stages_per_rank must be an integer >= 1, got {stages_per_rank!r}")

    if issubclass(cls, PipelineScheduleSingle):
        style = "single"
        if stages_per_rank not in (None, 1):
            raise ValueError(
                f"schedule {name} runs one stage per rank, got stages_per_rank={stages_per_rank}; "
                "use a multi-stage schedule (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, "
                "ZBVZeroBubble, DualPipeV) for more"
            )
        spr = 1
    elif issubclass(cls, (ScheduleZBVZeroBubble, ScheduleDualPipeV)):
        style = "v"
        if stages_per_rank not in (None, 2):
            raise ValueError(
                f"schedule {name} places stages in a V and needs exactly 2 stages per rank, got "
                f"stages_per_rank={stages_per_rank}"
            )
        spr = 2
    elif issubclass(cls, PipelineScheduleMulti):
        style = "loop"
        spr = 2 if stages_per_rank is None else stages_per_rank
        if spr < 2:
            raise ValueError(
                f"schedule {name} is a multi-stage schedule and needs stages_per_rank >= 2 (as "
                "torchtitan requires), got 1; use 1F1B or GPipe for one stage per rank"
            )
    else:  # not reachable with torch 2.13's schedule map; refuse rather than guess
        raise ValueError(
            f"schedule {name} is neither a single- nor a multi-stage pipeline schedule"
        )

    num_stages = pp_degree * spr
    if style == "v":
        ranks = tuple(s if s < pp_degree else num_stages - 1 - s for s in range(num_stages))
    else:
        ranks = tuple(s % pp_degree for s in range(num_stages))
    return StagePlacement(
        schedule=name, style=style, pp_degree=pp_degree, stages_per_rank=spr, stage_to_rank=ranks
    )


# ------------------------------------------------------------------------------------- cost model
def _check_seq_len(seq_len: int) -> None:
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be an integer >= 1, got {seq_len!r}")


def layer_costs(args: GLM52ModelArgs, seq_len: int = DEFAULT_SEQ_LEN) -> list[float]:
    """Forward FLOPs per token of each decoder layer (see the module docstring)."""
    _check_seq_len(seq_len)
    selected, visible = flops.mean_keys(seq_len, args.index_topk), flops.mean_keys(seq_len)
    return [
        flops.layer_flops(args, i, 1.0, selected, visible) for i in range(args.num_hidden_layers)
    ]


def stage_extra_costs(
    args: GLM52ModelArgs, seq_len: int = DEFAULT_SEQ_LEN, with_mtp: bool | None = None
) -> tuple[float, float]:
    """(first-stage extra, last-stage extra) in the units of ``layer_costs``.

    First: the embedding lookup, a gather counted as 0. Last: final norm + output head, and the MTP
        layer with
    ``with_mtp`` (default: when ``num_nextn_predict_layers`` is 1): ``eh_proj`` on the concatenated
    [embedding, hidden], one MoE decoder layer with its own indexer, and the head again.
    """
    _check_seq_len(seq_len)
    last = flops.head_flops(args)
    if args.num_nextn_predict_layers if with_mtp is None else with_mtp:
        last += flops.mtp_flops(
            args, 1.0, flops.mean_keys(seq_len, args.index_topk), flops.mean_keys(seq_len)
        )
    return 0.0, last


# ------------------------------------------------------------------------------------- splitting
def stage_costs(
    layers_per_stage: Sequence[int],
    costs: Sequence[float],
    first_extra: float = 0.0,
    last_extra: float = 0.0,
) -> list[float]:
    """Cost of each stage of a layout: its layers, plus the extras on the first and last stage."""
    prefix = _prefix_sums(costs)
    out, start = [], 0
    for k, n in enumerate(layers_per_stage):
        out.append(
            _stage_cost(prefix, k, len(layers_per_stage), start, start + n, first_extra, last_extra)
        )
        start += n
    return out


def _prefix_sums(costs: Sequence[float]) -> list[float]:
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    return prefix


def _stage_cost(
    prefix: list[float],
    k: int,
    num_stages: int,
    begin: int,
    end: int,
    first_extra: float,
    last_extra: float,
) -> float:
    # Every cost in this module goes through here, so equal splits give bit-identical costs.
    cost = prefix[end] - prefix[begin]
    if k == 0:
        cost += first_extra
    if k == num_stages - 1:
        cost += last_extra
    return cost


def _best_starts(
    starts: list[int],
    num_layers: int,
    num_stages: int,
    score: Callable[[int, int, int], object],
    combine: Callable[[object, object], object],
) -> list[int] | None:
    """Stage starts (a subset of ``starts``, beginning with 0) minimising the ``combine``-fold of
    ``score(stage, begin, end)`` over exactly ``num_stages`` non-empty stages; ``None`` when none
    exists.

    Backward DP over (stage, start). Among equal totals the smallest next start wins at each step,
    which gives the lexicographically earliest cuts when ``combine`` is addition.
    """
    table: list[dict[int, tuple[object, int]]] = [{} for _ in range(num_stages)]
    table[-1] = {
        b: (score(num_stages - 1, b, num_layers), num_layers) for b in starts if b < num_layers
    }
    for k in range(num_stages - 2, -1, -1):
        nxt = table[k + 1]
        for b in [0] if k == 0 else starts:
            best = None
            for e in starts:
                if e <= b or e not in nxt:
                    continue
                v = combine(score(k, b, e), nxt[e][0])
                if best is None or v < best[0]:
                    best = (v, e)
            if best is not None:
                table[k][b] = best
    if 0 not in table[0]:
        return None
    out, b = [], 0
    for k in range(num_stages):
        out.append(b)
        b = table[k][b][1]
    return out


def _starts_to_sizes(starts: list[int], num_layers: int) -> list[int]:
    return [e - b for b, e in zip(starts, starts[1:] + [num_layers])]


def _check_feasible(schedule: IndexShareSchedule, num_stages: int) -> None:
    if not isinstance(num_stages, int) or num_stages < 1:
        raise LayoutError(f"number of pipeline stages must be an integer >= 1, got {num_stages!r}")
    full = schedule.full_layers
    if num_stages > len(full):
        raise LayoutError(
            f"cannot split {schedule.num_layers} layers into {num_stages} pipeline stages: a stage "
            "must start on "
            f"a full (indexer) layer and there are only {len(full)} ({_fmt(full)}); use at most "
            f"{len(full)} "
            "stages (a smaller pp degree or fewer stages per rank)"
        )


def split_layers(
    schedule: IndexShareSchedule,
    num_stages: int,
    costs: Sequence[float],
    first_extra: float = 0.0,
    last_extra: float = 0.0,
) -> list[int]:
    """Layers per stage minimising the maximum stage cost, every stage starting on a full layer.

    Exact; ties on the maximum go to the smallest sum of squared stage costs, then to the earliest
    cuts. Raises ``LayoutError`` when ``num_stages`` exceeds the number of full layers.
    """
    if len(costs) != schedule.num_layers:
        raise ValueError(f"{len(costs)} layer costs for {schedule.num_layers} layers")
    _check_feasible(schedule, num_stages)
    L, starts, prefix = schedule.num_layers, schedule.full_layers, _prefix_sums(costs)

    def cost(k: int, b: int, e: int) -> float:
        return _stage_cost(prefix, k, num_stages, b, e, first_extra, last_extra)

    best = _best_starts(starts, L, num_stages, cost, max)
    assert best is not None  # feasibility was checked above
    cap = max(stage_costs(_starts_to_sizes(best, L), costs, first_extra, last_extra))

    def squared_under_cap(k: int, b: int, e: int) -> float:
        c = cost(k, b, e)
        return c * c if c <= cap else math.inf

    balanced = _best_starts(starts, L, num_stages, squared_under_cap, lambda a, b: a + b)
    assert balanced is not None  # the minimax split itself satisfies the cap
    return _starts_to_sizes(balanced, L)


def nearest_valid_layout(
    schedule: IndexShareSchedule, num_stages: int, target: Sequence[float]
) -> list[int]:
    """The valid layout (``num_stages`` non-empty stages, each starting on a full layer) with the
    smallest L1 distance to ``target`` (layers per stage, may be fractional); ties go to the
    smallest L1 distance of the cut positions, then to the earliest cuts. ``target`` must have
    ``num_stages`` entries."""
    _check_feasible(schedule, num_stages)
    if len(target) != num_stages:
        raise ValueError(f"target has {len(target)} entries for {num_stages} stages")
    bounds = [0.0]
    for n in target:
        bounds.append(bounds[-1] + n)

    def distance(k: int, b: int, e: int) -> tuple[float, float]:
        return abs((e - b) - target[k]), (abs(e - bounds[k + 1]) if k < num_stages - 1 else 0.0)

    best = _best_starts(
        schedule.full_layers,
        schedule.num_layers,
        num_stages,
        distance,
        lambda a, b: (a[0] + b[0], a[1] + b[1]),
    )
    assert best is not None
    return _starts_to_sizes(best, schedule.num_layers)


def _fmt(values: Sequence[int]) -> str:
    return ",".join(str(v) for v in values)


def validate_layout(
    schedule: IndexShareSchedule, num_stages: int, layers_per_stage: Sequence[int]
) -> list[int]:
    """Returns ``layers_per_stage`` as a list when it is a valid layout, else raises
    ``LayoutError``.

    Valid: ``num_stages`` entries, each >= 1, summing to the number of layers, and every stage
    starting on a full layer. The message names every problem (for a stage on a shared layer: the
    stage, its first layer and that layer's source layer) and the nearest valid layout.
    """
    given = list(layers_per_stage)
    if any(not isinstance(n, numbers.Integral) or isinstance(n, bool) for n in given):
        raise LayoutError(f"layers per stage must be integers, got {given!r}")
    given = [int(n) for n in given]
    _check_feasible(schedule, num_stages)
    L = schedule.num_layers
    problems = []
    if len(given) != num_stages:
        problems.append(f"it has {len(given)} stages but the schedule runs {num_stages}")
    if sum(given) != L:
        problems.append(f"it covers {sum(given)} layers but the model has {L}")
    for k, n in enumerate(given):
        if n < 1:
            problems.append(f"stage {k} has {n} layers (every stage needs at least one)")
    start = 0
    for k, n in enumerate(given):
        if 0 < start < L and n >= 1 and not schedule.is_full(start):
            problems.append(
                f"stage {k} starts at layer {start}, a shared layer (source layer "
                f"{schedule.source_layer(start)})"
            )
        start += max(n, 0)
    if not problems:
        return given
    target = given if len(given) == num_stages else [L / num_stages] * num_stages
    suggestion = nearest_valid_layout(schedule, num_stages, target)
    raise LayoutError(
        f"invalid pipeline layout {_fmt(given)} ({L} layers, {num_stages} stages): "
        + "; ".join(problems)
        + ". Every stage must start on a full (indexer) layer, since top-k indices are not sent "
        "across stages; "
        + f"full layers: {_fmt(schedule.full_layers)}."
        + f" Nearest valid layout: {_fmt(suggestion)}"
    )


def split(
    args: GLM52ModelArgs,
    num_stages: int,
    *,
    seq_len: int = DEFAULT_SEQ_LEN,
    explicit: Sequence[int] | None = None,
    with_mtp: bool | None = None,
) -> list[int]:
    """Layers per stage for the model: ``explicit`` validated (``LayoutError`` when bad, before any
    costing), else the best split under ``layer_costs``/``stage_extra_costs`` at ``seq_len``."""
    if explicit is not None:
        return validate_layout(args.index_share, num_stages, explicit)
    first, last = stage_extra_costs(args, seq_len, with_mtp)
    return split_layers(args.index_share, num_stages, layer_costs(args, seq_len), first, last)


@dataclass(frozen=True)
class StageSpec:
    """What one pipeline stage holds: its decoder layers, and whether it also holds the embedding
    (the first stage) and the final norm and output head (the last). ``with_mtp``: the job trains
    the MTP layer, which the last stage holds (``mtp``); every stage then passes the next tokens'
    embeddings on to it."""

    index: int
    rank: int
    layers: range
    embedding: bool
    head: bool
    with_mtp: bool

    @property
    def mtp(self) -> bool:
        return self.head and self.with_mtp

    @property
    def module_names(self) -> tuple[str, ...]:
        """The module FQNs the stage keeps, in the model's naming."""
        names = ["tok_embeddings"] if self.embedding else []
        names += [f"layers.{i}" for i in self.layers]
        if self.head:
            names += ["norm", "output"] + (["mtp"] if self.mtp else [])
        return tuple(names)


def stage_specs(
    layers_per_stage: Sequence[int], stage_to_rank: Sequence[int], with_mtp: bool
) -> tuple[StageSpec, ...]:
    """The stages of a layout, in stage order (``stage_to_rank[s]`` holds stage s)."""
    if not layers_per_stage or any(n < 1 for n in layers_per_stage):
        raise ValueError(f"every stage needs at least one layer, got {list(layers_per_stage)}")
    if len(stage_to_rank) != len(layers_per_stage):
        raise ValueError(
            f"{len(layers_per_stage)} stages but {len(stage_to_rank)} ranks in the placement"
        )
    specs, start, last = [], 0, len(layers_per_stage) - 1
    for s, n in enumerate(layers_per_stage):
        specs.append(
            StageSpec(
                s,
                stage_to_rank[s],
                range(start, start + n),
                embedding=s == 0,
                head=s == last,
                with_mtp=with_mtp,
            )
        )
        start += n
    return tuple(specs)


def microbatches(local_batch_size: int, microbatch_size: int) -> int:
    """Pipeline micro-batches per step: ``local_batch_size`` samples in micro-batches of
    ``microbatch_size``."""
    if microbatch_size < 1 or local_batch_size % microbatch_size:
        raise ValueError(
            f"the micro-batch size {microbatch_size} must divide the local batch size "
            f"{local_batch_size} (training.local_batch_size)"
        )
    return local_batch_size // microbatch_size


def parse_layout(text: str) -> tuple[int, ...]:
    """``parallelism.pipeline_parallel_layout``, e.g. "14,8,8,8,8,8,8,16", as layers per stage."""
    try:
        return tuple(int(v) for v in text.replace(" ", "").split(",") if v != "")
    except ValueError:
        raise LayoutError(
            f"{text!r}: expected comma-separated integers (layers per stage), e.g. "
            '"14,8,8,8,8,8,8,16"'
        ) from None


# ------------------------------------------------------------------------------------- whole layout
@dataclass(frozen=True)
class PipelineLayout:
    """The splitter's answer: the schedule's placement, what every stage holds and what it costs."""

    placement: StagePlacement
    stages: tuple[StageSpec, ...]
    stage_costs: tuple[float, ...]  # forward FLOPs per token, extras included
    seq_len: int

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        return tuple(len(s.layers) for s in self.stages)

    @property
    def first_layers(self) -> tuple[int, ...]:
        return tuple(s.layers.start for s in self.stages)

    @property
    def module_names(self) -> tuple[tuple[str, ...], ...]:
        return tuple(s.module_names for s in self.stages)

    @property
    def total_cost(self) -> float:
        return sum(self.stage_costs)

    @property
    def rank_costs(self) -> tuple[float, ...]:
        """Sum of the stage costs each rank holds."""
        out = [0.0] * self.placement.pp_degree
        for s, c in enumerate(self.stage_costs):
            out[self.placement.stage_to_rank[s]] += c
        return tuple(out)

    def stages_of_rank(self, rank: int) -> tuple[StageSpec, ...]:
        return tuple(s for s in self.stages if s.rank == rank)


def choose_layout(
    args: GLM52ModelArgs,
    schedule: str,
    pp_degree: int,
    stages_per_rank: int | None = None,
    *,
    seq_len: int = DEFAULT_SEQ_LEN,
    layers_per_stage: Sequence[int] | None = None,
    with_mtp: bool | None = None,
) -> PipelineLayout:
    """Placement, stages and costs for a schedule; ``layers_per_stage`` is validated when given.
    ``with_mtp`` (default: the args have an MTP layer) puts the MTP layer on the last stage and into
    its cost. Raises ``ValueError`` (``LayoutError`` for layouts) before any work when the request
    cannot run."""
    _check_seq_len(seq_len)
    if with_mtp is None:
        with_mtp = bool(args.num_nextn_predict_layers)
    elif with_mtp and not args.num_nextn_predict_layers:
        raise ValueError("with_mtp=True but the model args have num_nextn_predict_layers = 0")
    placement = stage_placement(schedule, pp_degree, stages_per_rank)
    layout = split(
        args, placement.num_stages, seq_len=seq_len, explicit=layers_per_stage, with_mtp=with_mtp
    )
    first, last = stage_extra_costs(args, seq_len, with_mtp)
    costs = stage_costs(layout, layer_costs(args, seq_len), first, last)
    return PipelineLayout(
        placement=placement,
        stages=stage_specs(layout, placement.stage_to_rank, with_mtp),
        stage_costs=tuple(costs),
        seq_len=seq_len,
    )
