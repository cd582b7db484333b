"""Reading (and writing) the published block-wise FP8 checkpoint format.

The checkpoints here are written by this file's own quantiser (a loop over 128 x 128 blocks,
independent of ``titan_glm52.fp8_checkpoint``), from tiny random ``GlmMoeDsaForCausalLM`` models,
with the published set of tensors quantised and the rest in bf16, the block scales in another file
than their weights. Two tiny configs:

* ``ALIGNED``: every quantised dim is either below 128 (one partial block) or a multiple of 128.
  transformers' own FP8 loader (``from_pretrained(...,
  quantization_config=FineGrainedFP8Config(dequantize=True))``) reads it correctly, so ours is
  compared with it: dequantised weights bitwise, logits of a forward.
* ``RAGGED``: dims above 128 that are not multiples of 128 (192, 160, 136, 144), as GLM-5.2's
  ``kv_a_proj_with_mqa`` (576 rows). transformers 5.25's loader derives the block from the scale
  grid (``rows // scale_rows``), so it refuses or misreads these
  (``test_transformers_loader_misreads_partial_blocks`` pins that); ours is compared with this
  file's dequantiser and with transformers' ``_dequantize_fp8_weight`` (the dequantiser of its FP8
  backward, which handles partial blocks), and its logits with transformers' model holding those
  weights.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.parity.test_hf_parity import randomise
from titan_glm52 import GLM52Model, load_hf_model, save_hf_model
from titan_glm52 import hf_checkpoint
from titan_glm52.fp8_checkpoint import QUANTIZED_KEYS, DequantizedSlice, dequantize, quantize
from titan_glm52.hf_checkpoint import INDEX_NAME, hf_state_dict, hf_weight_files
from titan_glm52.model.args import GLM52ModelArgs
from titan_glm52.model.state_dict_adapter import ExpertSlice

transformers = pytest.importorskip("transformers")

BLOCK = 128
# 8 indexer heads, as in test_hf_parity: with fewer, keys whose every head scores below zero tie at
# 0 after the ReLU, and the two implementations break such ties differently.
COMMON = dict(
    vocab_size=97,
    num_hidden_layers=4,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    index_topk=6,
    index_n_heads=8,
    index_head_dim=16,
    index_topk_freq=4,
    index_skip_topk_offset=3,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    max_position_embeddings=512,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    n_group=1,
    topk_group=1,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
)
# q_a [128, 256], q_b [48, 128], kv_a [40, 256], kv_b [64, 32], o [256, 32], indexer wq_b [128,
# 128], wk [16, 256], dense MLP [256, 256], experts [64, 256] / [256, 64].
ALIGNED = dict(
    COMMON,
    hidden_size=256,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=128,
    kv_lora_rank=32,
    intermediate_size=256,
    moe_intermediate_size=64,
)
# q_a [160, 192], q_b [144, 160], kv_a [144, 192], kv_b [192, 136], o [192, 96], wq_b [128, 160], wk
# [16, 192], dense MLP [160, 192] / [192, 160], experts [136, 192] / [192, 136].
RAGGED = dict(
    COMMON,
    hidden_size=192,
    num_attention_heads=6,
    num_key_value_heads=6,
    q_lora_rank=160,
    kv_lora_rank=136,
    intermediate_size=160,
    moe_intermediate_size=136,
)
# The published list names modules that do not exist (``indexers_proj``): the loader must go by the
# files.
NOT_CONVERTED = [
    "lm_head",
    "model.embed_tokens",
    "model.layers.0.self_attn.indexers_proj",
    "model.layers.1.mlp.gate",
]
QUANTIZATION = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "modules_to_not_convert": NOT_CONVERTED,
    "quant_method": "fp8",
    "weight_block_size": [BLOCK, BLOCK],
}
# The published checkpoint's quantised weights, spelled out (the library's regex is checked against
# this).
_QUANTIZED_MODULES = (
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "o_proj",
    "indexer.wq_b",
    "indexer.wk",
    "gate_proj",
    "up_proj",
    "down_proj",
)


def is_quantized(key: str) -> bool:
    if not key.startswith("model.layers.") or not key.endswith(".weight") or ".mlp.gate." in key:
        return False
    return any(key.endswith(f".{m}.weight") for m in _QUANTIZED_MODULES)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This file's quantiser: block by block, ``s = amax / 448`` (1 for a zero block), ``w8 = e4m3(w
    / s)``."""
    w = w.float()
    rows, cols = w.shape
    scale = torch.empty(math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    w8 = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK]
            amax = blk.abs().max()
            scale[i, j] = amax / 448 if amax > 0 else 1.0
            w8[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = (
                (blk / scale[i, j]).clamp(-448, 448).to(torch.float8_e4m3fn)
            )
    return w8, scale


def dequantize_blocks(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """This file's dequantiser: each block times its scale, in float32."""
    out = torch.empty(w8.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = (slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK))
            out[blk] = w8[blk].float() * scale[i, j]
    return out


def write_fp8(tensors: dict[str, torch.Tensor], config: dict, out_dir: str) -> None:
    """An FP8 checkpoint of ``tensors`` (HF names): the published set quantised, the rest in bf16
    (the routing bias fp32); the weights in one file, the block scales in another, with an index."""
    os.makedirs(out_dir, exist_ok=True)
    weights, scales = {}, {}
    for key, t in tensors.items():
        if is_quantized(key):
            weights[key], scales[key + "_scale_inv"] = quantize_blocks(t)
        else:
            weights[key] = t.float() if "e_score_correction_bias" in key else t.to(torch.bfloat16)
    names = {
        "model-00001-of-00002.safetensors": weights,
        "model-00002-of-00002.safetensors": scales,
    }
    for name, part in names.items():
        save_file(
            {k: v.contiguous() for k, v in part.items()},
            os.path.join(out_dir, name),
            metadata={"format": "pt"},
        )
    weight_map = {k: name for name, part in names.items() for k in part}
    total = sum(t.numel() * t.element_size() for part in names.values() for t in part.values())
    with open(os.path.join(out_dir, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(dict(config, quantization_config=QUANTIZATION), f, indent=2)


def read_all(hf_dir: str) -> dict[str, torch.Tensor]:
    out = {}
    for key, path in hf_weight_files(hf_dir).items():
        with safe_open(path, "pt") as f:
            out[key] = f.get_tensor(key)
    return out


def reference_weights(fp8_dir: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as float32, the quantised ones dequantised by this file's loop."""
    raw = read_all(fp8_dir)
    return {
        k: dequantize_blocks(t, raw[k + "_scale_inv"]) if k + "_scale_inv" in raw else t.float()
        for k, t in raw.items()
        if not k.endswith("_scale_inv")
    }


def hf_tiny(cfg: dict, seed: int):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**cfg)).float().eval()
    randomise(model, seed)
    return model


def load_transformers_fp8(fp8_dir: str, dtype: torch.dtype = torch.float32):
    """transformers' own reading of an FP8 checkpoint on CPU: its fine-grained FP8 loader,
    dequantising."""
    from transformers import FineGrainedFP8Config, GlmMoeDsaForCausalLM

    model, info = GlmMoeDsaForCausalLM.from_pretrained(
        fp8_dir,
        quantization_config=FineGrainedFP8Config(dequantize=True),
        dtype=dtype,
        output_loading_info=True,
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors (``experts.gate_up_proj [E, 2F, D]``,
    ``experts.down_proj``) as the checkpoint's per-expert tensors, so they meet ours under the
    state-dict adapter's names."""
    out = {}
    for key, t in state.items():
        fused = re.fullmatch(r"(.+\.mlp\.experts)\.(gate_up_proj|down_proj)", key)
        if fused is None:
            out[key] = t
            continue
        for e in range(t.shape[0]):
            prefix = f"{fused.group(1)}.{e}."
            if fused.group(2) == "down_proj":
                out[prefix + "down_proj.weight"] = t[e]
            else:
                gate, up = t[e].chunk(2)
                out[prefix + "gate_proj.weight"], out[prefix + "up_proj.weight"] = gate, up
    return out


@pytest.fixture(scope="module")
def aligned(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_aligned")
    hf = hf_tiny(ALIGNED, 0)
    hf.save_pretrained(root / "src")
    with open(root / "src" / "config.json") as f:
        config = json.load(f)
    write_fp8(read_all(str(root / "src")), config, str(root / "fp8"))
    return root / "fp8"


@pytest.fixture(scope="module")
def ragged(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_ragged")
    hf = hf_tiny(RAGGED, 1)
    hf.save_pretrained(root / "src")
    with open(root / "src" / "config.json") as f:
        config = json.load(f)
    write_fp8(read_all(str(root / "src")), config, str(root / "fp8"))
    # The same model holding the dequantised weights, unquantised (fp32): what transformers runs as
    # reference.
    save_file(
        reference_weights(str(root / "fp8")),
        str(root / "src" / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return root


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 97, (2, 29), generator=torch.Generator().manual_seed(seed))


def max_rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


# --------------------------------------------------------------------------------------- the format
def test_the_checkpoints_hold_the_published_tensor_set(aligned):
    keys = set(hf_weight_files(str(aligned)))
    quantized = {k.removesuffix("_scale_inv") for k in keys if k.endswith("_scale_inv")}
    assert quantized == {k for k in keys if QUANTIZED_KEYS.fullmatch(k)}
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in quantized
    assert not {
        k
        for k in quantized
        if "weights_proj" in k or "mlp.gate." in k or "embed" in k or "lm_head" in k
    }
    raw = read_all(str(aligned))
    assert raw["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"].dtype == torch.float8_e4m3fn
    assert raw["model.layers.2.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (1, 2)
    assert raw["model.layers.2.self_attn.indexer.weights_proj.weight"].dtype == torch.bfloat16


def test_our_quantiser_is_the_blockwise_rule():
    g = torch.Generator().manual_seed(0)
    for shape in [(136, 192), (40, 256), (300, 129), (5, 7)]:
        w = torch.randn(shape, generator=g) * 0.1
        if shape[0] > BLOCK:
            w[:BLOCK, :BLOCK] = 0  # a zero block: scale 1, zeros
        w8, scale = quantize(w, (BLOCK, BLOCK))
        want8, want_scale = quantize_blocks(w)
        assert torch.equal(scale, want_scale) and torch.equal(w8.float(), want8.float()), shape
        assert torch.equal(dequantize(w8, scale, (BLOCK, BLOCK)), dequantize_blocks(w8, scale)), (
            shape
        )


class _Slice:
    """The part of safetensors' slice API the loader uses, over an in-memory tensor."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def get_shape(self) -> list[int]:
        return list(self.t.shape)

    def get_dtype(self) -> str:
        return {torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32", torch.bfloat16: "BF16"}[
            self.t.dtype
        ]

    def __getitem__(self, index):
        return self.t[index]


@pytest.mark.parametrize(
    "rows, cols",
    [
        ((0, 300), (0, 200)),
        ((100, 250), (3, 131)),
        ((129, 130), (127, 129)),
        ((256, 300), (128, 200)),
        ((7, 7), (0, 200)),
    ],
    ids=str,
)
def test_any_window_reads_its_own_blocks(rows, cols):
    """A window at any offset (FSDP / EP slices need not start on a block) dequantises with the
    scale blocks that cover it, as the whole weight would."""
    g = torch.Generator().manual_seed(1)
    w8, scale = quantize_blocks(torch.randn(300, 200, generator=g))
    src = DequantizedSlice(_Slice(w8), _Slice(scale), "w", (BLOCK, BLOCK))
    window = src[slice(*rows), slice(*cols)]
    assert window.dtype == torch.float32
    assert torch.equal(window, dequantize_blocks(w8, scale)[slice(*rows), slice(*cols)])


@pytest.mark.parametrize("rows", [(0, 272), (50, 200), (136, 272), (130, 140), (0, 3)], ids=str)
@pytest.mark.parametrize("experts", [(0, 3), (1, 2)], ids=str)
def test_expert_shards_dequantise_their_rows(monkeypatch, rows, experts):
    """The per-expert FP8 tensors of gate and up fill any shard of the stacked 3-D ``w13`` (cut
    through the experts and through the rows, off the 128-row blocks) with exactly its dequantised
    part."""
    E, F, D = 3, 136, 192
    g = torch.Generator().manual_seed(2)
    hf = {
        (e, part): quantize_blocks(torch.randn(F, D, generator=g))
        for e in range(E)
        for part in range(2)
    }
    full = torch.stack(
        [torch.cat([dequantize_blocks(*hf[e, part]) for part in range(2)]) for e in range(E)]
    )
    (e0, e1), (r0, r1) = experts, rows
    local = torch.full((e1 - e0, r1 - r0, D), float("nan"))
    dst = torch.empty(E, 2 * F, D)
    monkeypatch.setattr(
        hf_checkpoint, "local_view", lambda t: (local, tuple(local.shape), (e0, r0, 0))
    )
    for (e, part), (w8, scale) in hf.items():
        src = DequantizedSlice(_Slice(w8), _Slice(scale), f"expert {e}", (BLOCK, BLOCK))
        hf_checkpoint._copy_slice(src, f"expert {e} part {part}", dst, ExpertSlice(e, part, 2))
    assert torch.equal(local, full[e0:e1, r0:r1])


# --------------------------------------------------------------------- against transformers' loader
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_weights_equal_transformers_dequantised(aligned, dtype):
    ours = load_hf_model(str(aligned), dtype=dtype)
    theirs = per_expert(load_transformers_fp8(str(aligned), dtype).state_dict())
    got = hf_state_dict(ours)
    assert sorted(got) == sorted(theirs)
    for key, t in got.items():
        # transformers keeps some bf16 tensors (the router) in fp32
        if QUANTIZED_KEYS.fullmatch(key):
            assert t.dtype == theirs[key].dtype == dtype, key
        assert torch.equal(t, theirs[key].to(t.dtype)), key


def test_logits_equal_transformers(aligned):
    theirs = load_transformers_fp8(str(aligned))
    # transformers hard-codes eps 1e-6 for q_a/kv_a_layernorm (see test_hf_parity).
    ours = load_hf_model(str(aligned), dtype=torch.float32, latent_norm_eps=1e-6).eval()
    x = tokens(3)
    with torch.no_grad():
        ref, got = theirs(x).logits, ours(x)
    assert max_rel(got, ref) < 1e-4, f"max relative logit difference {max_rel(got, ref):.2e}"


def test_ragged_weights_equal_independent_dequantisation(ragged):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    fp8_dir = str(ragged / "fp8")
    raw = read_all(fp8_dir)
    got = hf_state_dict(load_hf_model(fp8_dir, dtype=torch.float32))
    want = reference_weights(fp8_dir)
    assert sorted(got) == sorted(want)
    for key, t in got.items():
        assert torch.equal(t, want[key]), key
        if key + "_scale_inv" in raw:
            theirs = _dequantize_fp8_weight(
                raw[key], raw[key + "_scale_inv"], [BLOCK, BLOCK], torch.float32
            )
            assert torch.equal(t, theirs), key


def test_ragged_logits_equal_transformers_on_the_dequantised_weights(ragged):
    from transformers import GlmMoeDsaForCausalLM

    theirs = GlmMoeDsaForCausalLM.from_pretrained(ragged / "src", dtype=torch.float32).eval()
    ours = load_hf_model(str(ragged / "fp8"), dtype=torch.float32, latent_norm_eps=1e-6).eval()
    x = tokens(4)
    with torch.no_grad():
        ref, got = theirs(x).logits, ours(x)
    assert max_rel(got, ref) < 1e-4, f"max relative logit difference {max_rel(got, ref):.2e}"


def test_transformers_loader_misreads_partial_blocks(ragged):
    """Why the ragged checkpoint is not compared with transformers' loader: it takes the block size
    as ``rows // scale_rows``, so a 192-wide weight with 2 scale columns reads as 96-wide blocks
    (and 576 rows with 5 scale rows, GLM-5.2's kv_a_proj_with_mqa, are refused). When this fails,
    transformers has fixed it: compare the ragged checkpoint with its loader directly."""
    try:
        theirs = per_expert(load_transformers_fp8(str(ragged / "fp8")).state_dict())
    except (RuntimeError, ValueError):
        return
    want = reference_weights(str(ragged / "fp8"))
    assert not torch.equal(
        theirs["model.layers.1.self_attn.q_a_proj.weight"],
        want["model.layers.1.self_attn.q_a_proj.weight"],
    )


# ----------------------------------------------------------------------------- the model and config
def test_an_fp8_config_builds_the_bf16_model(aligned, tmp_path):
    """The training model is never FP8: the FP8 checkpoint's config builds the model its bf16 config
    builds, and a bf16 export of a model loaded from FP8 carries no quantization_config
    (transformers reads it as bf16)."""
    with open(aligned / "config.json") as f:
        config = json.load(f)
    fp8_args = GLM52ModelArgs.from_hf_config(str(aligned))
    bf16_args = GLM52ModelArgs.from_hf_config(
        {k: v for k, v in config.items() if k != "quantization_config"}
    )
    assert fp8_args.quantization_config == QUANTIZATION
    assert fp8_args.replace(quantization_config=None, hf_source_keys=None) == bf16_args.replace(
        hf_source_keys=None
    )
    model = load_hf_model(str(aligned), dtype=torch.bfloat16)
    with torch.device("meta"):
        bf16_model = GLM52Model(bf16_args, with_mtp=False)
    assert {k: (v.shape, v.dtype) for k, v in model.state_dict().items()} == {
        k: (
            v.shape,
            torch.float32 if "e_score" in k or "tokens_per_expert" in k else torch.bfloat16,
        )
        for k, v in bf16_model.state_dict().items()
    }
    save_hf_model(model, str(tmp_path), dtype=torch.bfloat16)
    with open(tmp_path / "config.json") as f:
        assert "quantization_config" not in json.load(f)
    assert not any(k.endswith("_scale_inv") for k in hf_weight_files(str(tmp_path)))
    from transformers import GlmMoeDsaForCausalLM

    back = per_expert(
        GlmMoeDsaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).state_dict()
    )
    for key, t in hf_state_dict(model).items():
        assert torch.equal(back[key], t), key


def test_pipeline_stage_skips_other_stages_and_their_scales(aligned):
    """``partial=True`` (a pipeline stage) skips the other stages' weights and scales alike."""
    args = GLM52ModelArgs.from_hf_config(str(aligned))
    with torch.device("meta"):
        model = GLM52Model(args, with_mtp=False)
    del model.layers["3"]
    model.to_empty(device="cpu")
    hf_checkpoint.load_hf_state(model, str(aligned), partial=True)
    full = load_hf_model(str(aligned), dtype=torch.float32).state_dict()
    for key, t in model.state_dict().items():
        if "tokens_per_expert" not in key:
            assert torch.equal(t, full[key]), key


# ------------------------------------------------------------------------------------------------
# refusals
def rewrite(src, dst, drop: str | None = None, **quantization) -> str:
    """A copy of checkpoint ``src`` without tensor ``drop`` and with ``quantization_config`` updated
    (a value of None removes the key; ``quantization_config=None`` removes the whole config)."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    if "quantization_config" in quantization and quantization.pop("quantization_config") is None:
        del config["quantization_config"]
    for key, value in quantization.items():
        config["quantization_config"][key] = value
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    if drop is not None:
        with open(os.path.join(dst, INDEX_NAME)) as f:
            index = json.load(f)
        name = index["weight_map"].pop(drop)
        path = os.path.join(dst, name)
        with safe_open(path, "pt") as f:
            kept = {k: f.get_tensor(k) for k in f.keys() if k != drop}
        save_file(kept, path, metadata={"format": "pt"})
        with open(os.path.join(dst, INDEX_NAME), "w") as f:
            json.dump(index, f)
    return str(dst)


KEY = "model.layers.1.mlp.experts.2.up_proj.weight"


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(drop=KEY), KeyError, re.escape(f"'{KEY}_scale_inv' has no weight '{KEY}'")),
        (
            dict(drop=KEY + "_scale_inv"),
            ValueError,
            re.escape(f"'{KEY}' is F8_E4M3 but the checkpoint has no '{KEY}_scale_inv'"),
        ),
        (
            dict(weight_block_size=[64, 64]),
            ValueError,
            r"_scale_inv': shape \(\d+, \d+\) does not cover weight .* in blocks of \[64, "
            r"64\].*weight_block_size",
        ),
        (dict(weight_block_size=None), ValueError, r"quantization_config.weight_block_size: None"),
        (
            dict(quant_method="bitsandbytes"),
            ValueError,
            r"quantization_config.quant_method: 'bitsandbytes'",
        ),
        (dict(fmt="e5m2"), ValueError, r"quantization_config.fmt: 'e5m2'"),
        (dict(scale_fmt="ue8m0"), ValueError, r"quantization_config.scale_fmt: 'ue8m0'"),
        (
            dict(activation_scheme="static"),
            ValueError,
            r"quantization_config.activation_scheme: 'static'",
        ),
        (
            dict(quantization_config=None),
            ValueError,
            r"_scale_inv': .* holds FP8 block scales but its config.json has no "
            r"quantization_config",
        ),
    ],
    ids=[
        "scale_without_weight",
        "fp8_without_scale",
        "other_blocks",
        "no_blocks",
        "quant_method",
        "fmt",
        "scale_fmt",
        "static_activations",
        "no_quantization_config",
    ],
)
def test_bad_checkpoints_are_refused_in_one_line(aligned, tmp_path, change, error, match):
    bad = rewrite(aligned, tmp_path / "bad", **change)
    with pytest.raises(error, match=match) as info:
        load_hf_model(bad, dtype=torch.float32)
    assert "\n" not in str(info.value)


def test_the_checkpoint_config_decides_not_the_model_args(aligned, tmp_path):
    """``load_hf_state`` reads the checkpoint's own config.json: a model built from a flavor is
    refused too."""
    bad = rewrite(aligned, tmp_path / "bad", fmt="e5m2")
    model = load_hf_model(str(aligned), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"config.json quantization_config.fmt"):
        hf_checkpoint.load_hf_state(model, bad)


# -------------------------------------------------------------------------------------------------
# export
def test_fp8_export_is_the_published_format(aligned, tmp_path):
    """``save_hf_model(fp8=True)`` quantises the published set with the blockwise rule,
    transformers' FP8 loader reads it as we do, and ours reads it back."""
    model = load_hf_model(str(aligned), dtype=torch.float32)
    save_hf_model(model, str(tmp_path), dtype=torch.bfloat16, fp8=True)
    written, source = read_all(str(tmp_path)), read_all(str(aligned))
    assert sorted(written) == sorted(source)
    bf16 = hf_state_dict(model, torch.bfloat16)
    for key, t in written.items():
        assert t.dtype == source[key].dtype, key
        if key.endswith("_scale_inv") or t.dtype != torch.float8_e4m3fn:
            continue
        w8, scale = quantize_blocks(bf16[key])
        assert torch.equal(t.float(), w8.float()) and torch.equal(
            written[key + "_scale_inv"], scale
        ), key
    with open(tmp_path / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    assert {k: v for k, v in qc.items() if k != "modules_to_not_convert"} == {
        k: v for k, v in QUANTIZATION.items() if k != "modules_to_not_convert"
    }
    assert (
        "lm_head" in qc["modules_to_not_convert"]
        and "model.layers.1.mlp.gate" in qc["modules_to_not_convert"]
    )
    back = hf_state_dict(load_hf_model(str(tmp_path), dtype=torch.float32))
    theirs = per_expert(load_transformers_fp8(str(tmp_path)).state_dict())
    for key, t in back.items():
        assert torch.equal(t, theirs[key]), key
        if key + "_scale_inv" in written:
            assert torch.equal(t, dequantize_blocks(written[key], written[key + "_scale_inv"])), key


def test_fp8_load_and_fp32_export_give_the_checkpoint_back(ragged, tmp_path):
    """Dequantised in fp32 and quantised again, every block comes back byte for byte (partial blocks
    included)."""
    model = load_hf_model(str(ragged / "fp8"), dtype=torch.float32)
    save_hf_model(model, str(tmp_path), dtype=torch.float32, fp8=True)
    written, source = read_all(str(tmp_path)), read_all(str(ragged / "fp8"))
    assert sorted(written) == sorted(source)
    for key, t in source.items():
        if t.dtype == torch.float8_e4m3fn or key.endswith("_scale_inv"):
            assert written[key].dtype == t.dtype and torch.equal(
                written[key].view(torch.uint8), t.view(torch.uint8)
            ), key
