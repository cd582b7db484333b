"""titan_glm52: a PyTorch-native training framework for GLM-5.2 (MLA + DSA with IndexShare, MoE,
MTP)."""

from titan_glm52.hf_checkpoint import hf_state_dict, load_hf_model, save_hf_model
from titan_glm52.model.args import FLAVORS, GLM52ModelArgs, get_flavor
from titan_glm52.model.model import GLM52Model

__all__ = [
    "GLM52Model",
    "GLM52ModelArgs",
    "FLAVORS",
    "get_flavor",
    "hf_state_dict",
    "load_hf_model",
    "save_hf_model",
]
