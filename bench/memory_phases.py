"""Measured memory of a training step by phase, beside `plan memory`'s phases for the same job (one
process, eager).

    source bench/gpu_env.sh python3 bench/memory_phases.py --job.config_file
    train_configs/glm52_proxy.toml --training.seq_len 32768 \\
        --activation_checkpoint.mode none --mtp.no-enable [--out F.json]

Builds the trainer from the job config as ``train.py`` does and hooks the model's modules: the
forward of the final norm ends the forward (from there the head forms its loss gradients, "backward
head" in the plan), and each decoder block's, the MTP layer's and the final norm's backward is a
phase of its own. At each phase boundary it reads ``torch.cuda.memory_allocated`` and starts a new
peak (``reset_peak_memory_stats``), so every phase gets the bytes allocated when it starts and the
peak of ``max_memory_allocated`` within it; the step's peak is the largest. The embedding takes
token ids (no backward hook fires for it): its backward, the gradient norm and the update are
measured within the first block's phase, the last of a step. The steps run as ``train.py`` runs them
(``--training.steps``, default 3); the table is the last step's, next to the plan's total at the
phase of the same name (``memory_estimate.request_from_job_config``: params, AdamW states and what
that phase holds). Compile is refused: hooks on compiled blocks would be traced into them.

Prints one table last (GiB) and writes JSON to ``--out`` (and ``$OUT/memory_phases.json`` when $OUT
is set).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titan_glm52 import trainer as trainer_mod  # noqa: E402
from titan_glm52.config import parse_job_config  # noqa: E402
from titan_glm52.memory_estimate import GIB, estimate_memory, request_from_job_config  # noqa: E402


class PhaseRecorder:
    """Phase boundaries from module hooks: each boundary closes the running phase (its peak since it
    started) and opens the next one (the bytes allocated now, a fresh peak)."""

    def __init__(self) -> None:
        self.steps: list[list[dict]] = []
        self.current: dict | None = None

    def boundary(self, name: str) -> None:
        allocated = torch.cuda.memory_allocated()
        if self.current is not None:
            self.current["peak"] = torch.cuda.max_memory_allocated()
            self.steps[-1].append(self.current)
        torch.cuda.reset_peak_memory_stats()
        self.current = {"phase": name, "start": allocated}

    def new_step(self) -> None:
        self.boundary("forward")
        self.steps.append([])

    def close(self) -> None:
        if self.current is not None and self.steps:
            self.current["peak"] = torch.cuda.max_memory_allocated()
            self.steps[-1].append(self.current)
        self.current = None


def hook_model(model, rec: PhaseRecorder) -> None:
    def on_backward(name):
        return lambda module, grad_output: rec.boundary(f"backward {name}")

    model.tok_embeddings.register_forward_pre_hook(lambda module, args: rec.new_step())
    model.norm.register_forward_hook(lambda module, args, out: rec.boundary("backward head"))
    model.norm.register_full_backward_pre_hook(on_backward("final norm"))
    for i, block in model.layers.items():
        block.register_full_backward_pre_hook(on_backward(f"layer {i}"))
    if model.mtp is not None:
        model.mtp.register_full_backward_pre_hook(on_backward("MTP layer"))


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=None, help="JSON results")
    a, train_args = p.parse_known_args()
    if not torch.cuda.is_available():
        print("memory_phases.py needs a CUDA GPU", file=sys.stderr)
        return 1
    if "--training.steps" not in train_args:
        train_args += ["--training.steps", "3"]
    cfg = parse_job_config(
        train_args + ["--checkpoint.no-enable", "--metrics.no-enable-tensorboard"]
    )
    if cfg.compile.enable:
        print(
            "memory_phases.py measures eager steps: drop --compile.enable (hooks would be traced)",
            file=sys.stderr,
        )
        return 1
    trainer_mod.one_process_env()
    plan = estimate_memory(request_from_job_config(cfg, gpus=1))
    cfg.training.memory_check = False  # the trainer's start-up check would plan the same job again
    trainer = trainer_mod.Trainer(cfg)
    rec = PhaseRecorder()
    hook_model(trainer.model, rec)
    trainer.train()
    torch.cuda.synchronize()
    rec.close()
    measured = rec.steps[-1]
    (rank,) = plan.ranks
    fixed = rank.params + rank.optimizer
    planned = {ph.name: fixed + ph.total for ph in rank.phases}
    rows = []
    for m in measured:
        rows.append(
            {
                "phase": m["phase"],
                "start_gib": m["start"] / GIB,
                "peak_gib": m["peak"] / GIB,
                "planned_gib": planned[m["phase"]] / GIB if m["phase"] in planned else None,
            }
        )
    step_peak = max(r["peak_gib"] for r in rows)
    result = {
        "command": " ".join(sys.argv),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "master_weights": plan.request.master_weights,
        "seq_len": cfg.training.seq_len,
        "ac": cfg.activation_checkpoint.mode,
        "mtp": plan.request.with_mtp,
        "phases": rows,
        "step_peak_gib": step_peak,
        "planned_peak_gib": rank.total / GIB,
        "planned_peak_phase": rank.phase,
        "steps_recorded": len(rec.steps),
    }
    for path in filter(
        None,
        (
            a.out,
            os.path.join(os.environ["OUT"], "memory_phases.json")
            if os.environ.get("OUT")
            else None,
        ),
    ):
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    print(
        f"\nmemory by phase, last of {len(rec.steps)} steps (GiB; planned = params + AdamW + the "
        "plan's phase):"
    )
    print(f"{'phase':<24} {'start':>8} {'peak':>8} {'planned':>8}")
    for r in rows:
        plan_txt = f"{r['planned_gib']:8.2f}" if r["planned_gib"] is not None else f"{'':>8}"
        print(f"{r['phase']:<24} {r['start_gib']:8.2f} {r['peak_gib']:8.2f} {plan_txt}")
    print(
        f"step peak {step_peak:.2f} GiB; planned peak {rank.total / GIB:.2f} GiB at {rank.phase} "
        f"(master weights {plan.request.master_weights})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
