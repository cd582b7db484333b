"""Per-rank body: an HF checkpoint loaded into a sharded (FSDP / EP) or pipelined model equals the full model."""

from __future__ import annotations

import torch

from tests.distributed.cases import debug_args, full
from titan_glm52.distributed import build_mesh, init_distributed
from titan_glm52.hf_checkpoint import load_hf_state
from titan_glm52.model.model import GLM52Model
from titan_glm52.parallelize import parallelize_model
from titan_glm52.pipeline import make_plan, stage_modules


def loaded_model(args, mesh, hf_dir: str, pp: int, ep: int, with_mtp: bool = True):
    """The model (or this rank's 1F1B stage when ``pp > 1``) parallelized on ``mesh``, with ``hf_dir``'s weights."""
    if pp > 1:
        plan = make_plan(args, "1F1B", pp, None, 32, None)
        ((_, model),) = stage_modules(args, plan, mesh["pp"].get_local_rank(), with_mtp)
    else:
        with torch.device("meta"):
            model = GLM52Model(args, with_mtp=with_mtp)
    parallelize_model(model, mesh, ep_enabled=ep > 1)
    model.to_empty(device="cpu")
    load_hf_state(model, hf_dir, partial=pp > 1)
    return model


def check_hf_load(hf_dir: str, dp_shard: int = 1, ep: int = 1, pp: int = 1) -> None:
    env = init_distributed()
    args = debug_args()
    ref = GLM52Model(args)
    load_hf_state(ref, hf_dir)
    mesh = build_mesh(env.world_size, dp_shard=dp_shard, ep=ep, pp=pp, device_type="cpu",
                      n_routed_experts=args.n_routed_experts)
    model = loaded_model(args, mesh, hf_dir, pp, ep)
    expected = ref.state_dict()
    for name, t in model.state_dict().items():
        if "tokens_per_expert" not in name:
            assert torch.equal(full(t), expected[name]), name
