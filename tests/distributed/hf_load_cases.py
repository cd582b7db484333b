"""Per-rank bodies: an HF checkpoint (bf16 / fp32, or block-wise FP8) loaded into a sharded (FSDP /
EP) or pipelined model equals the full model."""

from __future__ import annotations

import torch

from tests.distributed.cases import debug_args, full
from titan_glm52.distributed import build_mesh, init_distributed
from titan_glm52.hf_checkpoint import load_hf_state
from titan_glm52.hf_export import save_hf_distributed
from titan_glm52.model.args import GLM52ModelArgs
from titan_glm52.model.model import GLM52Model
from titan_glm52.parallelize import parallelize_model
from titan_glm52.pipeline import stage_modules
from titan_glm52.pipeline_split import choose_layout


def loaded_model(args, mesh, hf_dir: str, pp: int, ep: int, with_mtp: bool = True):
    """The model (or this rank's 1F1B stage when ``pp > 1``) parallelized on ``mesh``, with
    ``hf_dir``'s weights."""
    if pp > 1:
        layout = choose_layout(args, "1F1B", pp, seq_len=32, with_mtp=with_mtp)
        ((_, model),) = stage_modules(args, layout, mesh["pp"].get_local_rank())
    else:
        with torch.device("meta"):
            model = GLM52Model(args, with_mtp=with_mtp)
    parallelize_model(model, mesh, ep_enabled=ep > 1)
    model.to_empty(device="cpu")
    load_hf_state(model, hf_dir, partial=pp > 1)
    return model


def check_hf_load(
    hf_dir: str,
    dp_shard: int = 1,
    ep: int = 1,
    pp: int = 1,
    args_from_checkpoint: bool = False,
    fp8_export_dir: str | None = None,
) -> None:
    """Every tensor of this rank's shards equals the single-process load, bitwise.

    ``args_from_checkpoint``: the model args come from ``hf_dir/config.json`` (else the debug
        flavor's).
    ``fp8_export_dir``: the sharded model is then exported there in the block-wise FP8 format,
    streamed (``save_hf_distributed``), for the caller to compare with the single-process export.
    """
    env = init_distributed()
    args = GLM52ModelArgs.from_hf_config(hf_dir) if args_from_checkpoint else debug_args()
    ref = GLM52Model(args)
    load_hf_state(ref, hf_dir)
    mesh = build_mesh(
        env.world_size,
        dp_shard=dp_shard,
        ep=ep,
        pp=pp,
        device_type="cpu",
        n_routed_experts=args.n_routed_experts,
    )
    model = loaded_model(args, mesh, hf_dir, pp, ep)
    expected = ref.state_dict()
    for name, t in model.state_dict().items():
        if "tokens_per_expert" not in name:
            assert torch.equal(full(t), expected[name]), name
    if fp8_export_dir is not None:
        writer = mesh["dp"].get_local_rank() == 0
        save_hf_distributed([model], args, fp8_export_dir, torch.bfloat16, writer=writer, fp8=True)
