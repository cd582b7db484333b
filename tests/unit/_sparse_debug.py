"""The debug model that the AC and token-chunk tests compare runs of: sparse DSA at 32 tokens
(index_topk 8), IndexShare FFFSSSFS, an MoE MTP block."""

import torch

from titan_glm52 import GLM52Model, get_flavor

ARGS = get_flavor("debug").replace(index_topk=8)


def model_and_tokens() -> tuple[GLM52Model, torch.Tensor]:
    """The model initialised from seed 0 and two rows of 32 tokens."""
    torch.manual_seed(0)
    model = GLM52Model(ARGS)
    model.init_weights()
    tokens = torch.randint(1, ARGS.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    return model, tokens
