"""GLM52ModelArgs: every field of the published GLM-5.2 ``config.json``, the flavors, and counts.

Field names are the ``config.json`` keys, so ``from_hf_config``/``to_hf_config`` are a plain copy
with validation. Two fields are this project's own (they are not written to ``config.json``):

* ``latent_norm_eps``: epsilon of ``q_a_layernorm``/``kv_a_layernorm``. The published model was
  trained (and is served by vLLM/SGLang) with ``rms_norm_eps``; ``transformers`` hard-codes 1e-6.
  ``None`` = ``rms_norm_eps``.
* ``index_norm_eps``: epsilon of the indexer's ``k_norm`` LayerNorm (1e-6 everywhere).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from titan_glm52.model.index_share import IndexShareSchedule, build_schedule

_CONFIG_JSON = os.path.join(os.path.dirname(os.path.dirname(__file__)), "glm52_config.json")


@dataclass
class GLM52ModelArgs:
    # Identity.
    architectures: list[str] = field(default_factory=lambda: ["GlmMoeDsaForCausalLM"])
    model_type: str = "glm_moe_dsa"
    dtype: str = "bfloat16"
    transformers_version: str | None = None
    # Widths.
    vocab_size: int = 154880
    hidden_size: int = 6144
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int = 64  # nominal for MLA; unused
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    qk_head_dim: int | None = None  # = nope + rope; derived when absent
    v_head_dim: int = 256
    head_dim: int | None = 192  # misleading in the published config; stored, never used
    hidden_act: str = "silu"
    intermediate_size: int = 12288
    # MoE.
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    mlp_layer_types: list[str] | None = None  # "dense" | "sparse" per layer; derived when absent
    routed_scaling_factor: float = 2.5
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    moe_router_dtype: str | None = "float32"
    ep_size: int = 1  # ignored (parallelism comes from the job config)
    # Positions.
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_theta": 8000000, "rope_type": "default"}
    )
    rope_interleave: bool = True
    max_position_embeddings: int = 1048576
    # Norms, misc.
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    # DSA indexer and IndexShare.
    index_topk: int = 2048
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk_freq: int | None = 4
    index_skip_topk_offset: int | None = 3
    index_topk_pattern: str | None = None
    indexer_types: list[str] | None = None
    indexer_rope_interleave: bool = True
    index_share_for_mtp_iteration: bool = True
    # MTP.
    num_nextn_predict_layers: int = 1
    # Tokens and head.
    tie_word_embeddings: bool = False
    eos_token_id: int | list[int] | None = field(default_factory=lambda: [154820, 154827, 154829])
    pad_token_id: int | None = 154820
    bos_token_id: int | None = None
    pretraining_tp: int = 1
    use_cache: bool = True
    quantization_config: dict[str, Any] | None = None
    # This project's own (not in config.json).
    latent_norm_eps: float | None = None
    index_norm_eps: float = 1e-6
    # Keys of a config.json that no field above covers, kept so that to_hf_config round-trips them.
    extra: dict[str, Any] = field(default_factory=dict)
    # The keys the source config.json had (None: built in code); to_hf_config writes those (and
    # always an explicit indexer_types, since codebases derive different defaults from freq/offset).
    hf_source_keys: tuple[str, ...] | None = None

    _OWN_FIELDS = ("latent_norm_eps", "index_norm_eps", "extra", "hf_source_keys")

    def __post_init__(self) -> None:
        if self.qk_head_dim is None:
            self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.mlp_layer_types is None:
            self.mlp_layer_types = [
                "sparse"
                if (i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0)
                else "dense"
                for i in range(self.num_hidden_layers)
            ]
        self.validate()

    # -----------------------------------------------------------------------------------------
    # checks
    def validate(self) -> None:
        """Refuses values this implementation does not support, naming the key and the fix."""

        def refuse(key: str, why: str) -> None:
            raise ValueError(f"GLM52ModelArgs.{key}: {why}")

        if self.qk_head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            refuse(
                "qk_head_dim",
                f"{self.qk_head_dim} != qk_nope_head_dim + qk_rope_head_dim "
                f"({self.qk_nope_head_dim} + {self.qk_rope_head_dim}); fix the config",
            )
        if self.qk_rope_head_dim % 2 or self.index_head_dim < self.qk_rope_head_dim:
            refuse(
                "qk_rope_head_dim",
                "must be even and <= index_head_dim (the indexer ropes its first "
                f"qk_rope_head_dim dims); got {self.qk_rope_head_dim} with index_head_dim "
                f"{self.index_head_dim}",
            )
        if self.hidden_act != "silu":
            refuse("hidden_act", f"only 'silu' (SwiGLU) is implemented, got {self.hidden_act!r}")
        if self.scoring_func != "sigmoid":
            refuse(
                "scoring_func", f"only 'sigmoid' routing is implemented, got {self.scoring_func!r}"
            )
        if self.topk_method != "noaux_tc":
            refuse(
                "topk_method",
                f"only 'noaux_tc' (bias-corrected top-k) is implemented, got {self.topk_method!r}",
            )
        if self.attention_bias:
            refuse("attention_bias", "GLM-5.2 has no attention biases; set attention_bias=false")
        if self.rope_type != "default":
            refuse(
                "rope_parameters.rope_type",
                f"only 'default' RoPE is implemented, got {self.rope_type!r}",
            )
        if len(self.mlp_layer_types) != self.num_hidden_layers or set(self.mlp_layer_types) - {
            "dense",
            "sparse",
        }:
            refuse("mlp_layer_types", f"needs {self.num_hidden_layers} entries of 'dense'/'sparse'")
        if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
            refuse(
                "n_group",
                f"n_routed_experts ({self.n_routed_experts}) must divide into n_group "
                f"({self.n_group}) groups and topk_group ({self.topk_group}) <= n_group",
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            refuse(
                "num_experts_per_tok",
                f"{self.num_experts_per_tok} > n_routed_experts {self.n_routed_experts}",
            )
        if self.index_topk < 1:
            refuse("index_topk", "must be >= 1")
        if self.num_nextn_predict_layers not in (0, 1):
            refuse(
                "num_nextn_predict_layers",
                f"0 or 1 MTP layers are supported, got {self.num_nextn_predict_layers}",
            )
        if self.tie_word_embeddings:
            refuse(
                "tie_word_embeddings",
                "GLM-5.2 has an untied lm_head; set tie_word_embeddings=false",
            )
        self.index_share  # builds (and so validates) the IndexShare schedule

    # ------------------------------------------------------------------------------------ derived
    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 10000.0))

    @property
    def rope_type(self) -> str:
        return self.rope_parameters.get("rope_type", "default")

    @property
    def latent_eps(self) -> float:
        return self.rms_norm_eps if self.latent_norm_eps is None else self.latent_norm_eps

    @property
    def index_share(self) -> IndexShareSchedule:
        return build_schedule(
            self.num_hidden_layers,
            indexer_types=self.indexer_types,
            index_topk_pattern=self.index_topk_pattern,
            index_topk_freq=self.index_topk_freq,
            index_skip_topk_offset=self.index_skip_topk_offset,
        )

    def is_moe_layer(self, layer_id: int) -> bool:
        """Backbone layers follow ``mlp_layer_types``; the MTP layer (id >= num_hidden_layers) is
        MoE."""
        return layer_id >= self.num_hidden_layers or self.mlp_layer_types[layer_id] == "sparse"

    # ------------------------------------------------------------------------------------- HF I/O
    @classmethod
    def from_hf_config(
        cls, path_or_dict: str | os.PathLike | dict[str, Any], **overrides: Any
    ) -> GLM52ModelArgs:
        """Reads a ``config.json`` (a file, a checkpoint directory holding one, or the dict)."""
        if isinstance(path_or_dict, dict):
            cfg = copy.deepcopy(path_or_dict)
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                cfg = json.load(f)
        if cfg.get("model_type", "glm_moe_dsa") != "glm_moe_dsa":
            raise ValueError(
                f"config.json model_type is {cfg['model_type']!r}; titan_glm52 reads 'glm_moe_dsa'"
            )
        names = {f.name for f in dataclasses.fields(cls)} - set(cls._OWN_FIELDS)
        if "rope_parameters" not in cfg and "rope_theta" in cfg:  # transformers 4.x style configs
            cfg["rope_parameters"] = {"rope_theta": cfg.pop("rope_theta"), "rope_type": "default"}
        known = {k: v for k, v in cfg.items() if k in names}
        extra = {k: v for k, v in cfg.items() if k not in names}
        known.update(overrides)
        return cls(**known, extra=extra, hf_source_keys=tuple(cfg))

    def to_hf_config(self) -> dict[str, Any]:
        """The ``config.json`` dict (keys sorted, as the published file)."""
        out = {
            f.name: copy.deepcopy(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if f.name not in self._OWN_FIELDS
        }
        out.update(copy.deepcopy(self.extra))
        out["indexer_types"] = self.index_share.indexer_types()
        if self.hf_source_keys is not None:
            keep = set(self.hf_source_keys) | {"indexer_types"}
            out = {k: v for k, v in out.items() if k in keep}
        else:
            for key in ("transformers_version", "quantization_config", "bos_token_id"):
                if out.get(key) is None:
                    out.pop(key, None)
        return dict(sorted(out.items()))

    def replace(self, **changes: Any) -> GLM52ModelArgs:
        """A copy with some fields changed; per-layer lists follow a change of num_hidden_layers."""
        if "num_hidden_layers" in changes:
            changes.setdefault("mlp_layer_types", None)
            if self.indexer_types is not None:
                changes.setdefault("indexer_types", None)
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------------------------- counts
    def _attention_params(self) -> int:
        d, h = self.hidden_size, self.num_attention_heads
        return (
            d * self.q_lora_rank
            + self.q_lora_rank
            + self.q_lora_rank * h * self.qk_head_dim
            + d * (self.kv_lora_rank + self.qk_rope_head_dim)
            + self.kv_lora_rank
            + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
            + h * self.v_head_dim * d
        )

    def _indexer_params(self) -> int:
        d, hi, di = self.hidden_size, self.index_n_heads, self.index_head_dim
        return self.q_lora_rank * hi * di + d * di + 2 * di + d * hi

    def _expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    def _router_params(self) -> int:
        return self.n_routed_experts * self.hidden_size

    def _mlp_params(self, layer_id: int, active: bool) -> int:
        if not self.is_moe_layer(layer_id):
            return 3 * self.hidden_size * self.intermediate_size
        routed = self.num_experts_per_tok if active else self.n_routed_experts
        return (routed + self.n_shared_experts) * self._expert_params() + self._router_params()

    def _layer_params(self, layer_id: int, has_indexer: bool, active: bool) -> int:
        return (
            self._attention_params()
            + 2 * self.hidden_size
            + self._mlp_params(layer_id, active)
            + (self._indexer_params() if has_indexer else 0)
        )

    def _mtp_params(self, active: bool) -> int:
        d = self.hidden_size
        mtp_id = self.num_hidden_layers
        return (
            self._layer_params(mtp_id, self.index_share.has_indexer(mtp_id), active)
            + 2 * d * d
            + 3 * d
        )

    def num_params(self, include_mtp: bool = True) -> int:
        """Trainable parameters (buffers such as e_score_correction_bias excluded)."""
        sched = self.index_share
        total = sum(
            self._layer_params(i, sched.is_full(i), False) for i in range(self.num_hidden_layers)
        )
        total += 2 * self.vocab_size * self.hidden_size + self.hidden_size
        if include_mtp and self.num_nextn_predict_layers:
            total += self._mtp_params(active=False)
        return total

    def num_active_params(self, include_mtp: bool = False, include_head: bool = True) -> int:
        """Parameters touched per token: routed top-k + shared experts, indexers only on full
        layers.

        The embedding lookup is excluded (it is a gather, not a matmul); the output head is included
        by default.
        """
        sched = self.index_share
        total = sum(
            self._layer_params(i, sched.is_full(i), True) for i in range(self.num_hidden_layers)
        )
        total += self.hidden_size
        if include_head:
            total += self.vocab_size * self.hidden_size
        if include_mtp and self.num_nextn_predict_layers:
            total += self._mtp_params(active=True)
        return total


def _debug_args() -> GLM52ModelArgs:
    return GLM52ModelArgs(
        vocab_size=2048,
        hidden_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=3,
        first_k_dense_replace=3,
        index_topk=16,
        index_n_heads=8,
        index_head_dim=16,
        index_topk_freq=4,
        index_skip_topk_offset=3,
        max_position_embeddings=4096,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        eos_token_id=0,
        pad_token_id=0,
    )


def _debug_fp8_args() -> GLM52ModelArgs:
    # The debug model at widths FP8 training's 128 x 128 blocks divide (hidden 128, q rank 128,
    # 4 heads of 16 + 16 / 32, MLPs 256 and 128), so that it runs FP8 products on CPU; kv_a (80
    # outputs) stays bf16, as the published model's (576) does.
    return _debug_args().replace(
        hidden_size=128,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_head_dim=32,
        v_head_dim=32,
        intermediate_size=256,
        moe_intermediate_size=128,
        index_head_dim=32,
    )


def _proxy_args() -> GLM52ModelArgs:
    # Every per-layer width of GLM-5.2 (hidden, MLA ranks and head dims, indexer, expert and dense
    # widths, top-8 + 1 shared routing, vocabulary); 4 layers (1 dense + 3 MoE, IndexShare FFFS) and
    # 16 experts so that bf16 training with fp32 master weights and AdamW fits one 141 GB H200.
    base = glm52_744b_args()
    return base.replace(num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=16)


def glm52_744b_args() -> GLM52ModelArgs:
    return GLM52ModelArgs.from_hf_config(_CONFIG_JSON)


FLAVORS = {
    "glm52_744b": glm52_744b_args,
    "glm52_proxy": _proxy_args,
    "debug": _debug_args,
    "debug_fp8": _debug_fp8_args,
}


def get_flavor(name: str) -> GLM52ModelArgs:
    if name not in FLAVORS:
        raise ValueError(f"unknown model flavor {name!r}; choose one of {sorted(FLAVORS)}")
    return FLAVORS[name]()
