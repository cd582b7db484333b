"""The published block-wise FP8 checkpoint format (``GLM-5.2-FP8``, DeepSeek-V3 style): read and
write.

A quantised linear stores ``<name>.weight`` as ``float8_e4m3fn`` ``[out, in]`` and
``<name>.weight_scale_inv`` as float32 ``[ceil(out / B0), ceil(in / B1)]``, ``[B0, B1]`` being
``quantization_config.weight_block_size`` of ``config.json`` (``[128, 128]``); the weight is ``W[i,
j] = float(W8[i, j]) * scale_inv[i // B0, j // B1]``. The other tensors (embeddings, head, norms,
router, the indexer's ``weights_proj``, the MTP layer's own projections) stay in bf16 / fp32.

Reading: which tensors are quantised is decided by the files (a weight with a ``*_scale_inv`` beside
it), not by ``modules_to_not_convert``, whose published list names modules that do not exist.
``DequantizedSlice`` gives a quantised weight the slice API of safetensors, so a rank reads and
dequantises only the rows and columns it holds, with the block rows and columns of the scale that
cover them.

Writing: ``quantize_hf_tensors`` turns the 2-D linear weights of attention, indexer, dense MLP,
shared and routed experts into that format (``scale_inv = amax / 448`` per block), the set the
published checkpoint quantises.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
SCALE_SUFFIX = "_scale_inv"
_FP8_NAMES = ("F8_E4M3", "F8_E5M2")  # safetensors' names of the fp8 dtypes
_SCALE_DTYPES = ("F32", "BF16", "F16")

# The HF weights the published checkpoint quantises: every 2-D linear weight of the attention
# (indexer's wq_b and wk included), the dense MLP, the shared expert and the routed experts, in the
# backbone and the MTP layer.
QUANTIZED_KEYS = re.compile(
    r"model\.layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|indexer\.wq_b"
    r"|indexer\.wk)|mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj))\.weight"
)
# The linear weights that stay in bf16 (the router, the indexer's head weights, the MTP layer's
# input projection, the output head): listed in ``modules_to_not_convert`` so that loaders that go
# by the list keep them too.
_KEPT_LINEARS = re.compile(
    r"(lm_head|model\.layers\.\d+\.(mlp\.gate|self_attn\.indexer\.weights_proj|eh_proj))"
    r"\.weight"
)


@dataclass(frozen=True)
class BlockFp8:
    """The block-wise FP8 format of a checkpoint: e4m3 weights, one fp32 scale per ``block`` (rows,
    columns)."""

    block: tuple[int, int] = (128, 128)

    @classmethod
    def from_config(cls, qc: dict | None, where: str = "config.json") -> BlockFp8 | None:
        """The format ``quantization_config`` describes (None without one); refuses what this loader
        cannot read, naming the key and the fix."""
        if qc is None:
            return None

        def refuse(key: str, why: str) -> None:
            raise ValueError(f"{where} quantization_config.{key}: {why}")

        if qc.get("quant_method") != "fp8":
            refuse(
                "quant_method",
                f"{qc.get('quant_method')!r} is not read here; only block-wise 'fp8' is "
                "(convert the checkpoint to bf16 first, or start from the bf16 or FP8 release)",
            )
        if qc.get("fmt", "e4m3") != "e4m3":
            refuse(
                "fmt", f"{qc['fmt']!r} is not read here; only 'e4m3' (float8_e4m3fn) weights are"
            )
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            refuse(
                "activation_scheme",
                f"{qc['activation_scheme']!r} (static activation scales) is not read "
                "here; only 'dynamic', the published format, is",
            )
        if qc.get("scale_fmt", "float") != "float":
            refuse(
                "scale_fmt", f"{qc['scale_fmt']!r} is not read here; only 'float' (fp32 scales) is"
            )
        block = qc.get("weight_block_size")
        if not (
            isinstance(block, (list, tuple))
            and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)
        ):
            refuse(
                "weight_block_size",
                f"{block!r}: need two positive block sizes such as [128, 128] "
                "(per-tensor FP8 is not read here)",
            )
        return cls(tuple(block))

    def config(self, modules_to_not_convert: list[str]) -> dict:
        """The ``quantization_config`` of a checkpoint written in this format."""
        return {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "modules_to_not_convert": modules_to_not_convert,
            "quant_method": "fp8",
            "weight_block_size": list(self.block),
        }


def read_format(hf_dir: str) -> BlockFp8 | None:
    """The FP8 format of the checkpoint in ``hf_dir``, from its ``config.json`` (None: not
    quantised, or no ``config.json``, in which case a scale tensor in the files is refused by
    ``pair_scales``)."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return BlockFp8.from_config(json.load(f).get("quantization_config"), path)


def scale_key(weight_key: str) -> str:
    """``...weight`` -> ``...weight_scale_inv``."""
    return weight_key + SCALE_SUFFIX


def pair_scales(keys: Iterable[str], fmt: BlockFp8 | None, hf_dir: str) -> dict[str, str]:
    """Checkpoint weight key -> its scale's key, for every ``*_scale_inv`` among ``keys``.

    Refuses a scale whose weight is not in the checkpoint, and scales in a checkpoint whose
    ``config.json`` has no ``quantization_config`` (the block size would be a guess).
    """
    keys = set(keys)
    pairs = {}
    for key in sorted(keys):
        if not key.endswith(SCALE_SUFFIX):
            continue
        weight = key.removesuffix(SCALE_SUFFIX)
        if weight not in keys:
            raise KeyError(
                f"{key!r} has no weight {weight!r} in {hf_dir}: the checkpoint is incomplete "
                "(download or convert it again)"
            )
        if fmt is None:
            raise ValueError(
                f"{key!r}: {hf_dir} holds FP8 block scales but its config.json has no "
                "quantization_config; use the config.json that came with the FP8 checkpoint"
            )
        pairs[weight] = key
    return pairs


def checked_slice(src, key: str, scale, fmt: BlockFp8 | None):
    """The tensor ``key`` to read from: ``src`` itself (a safetensors slice) when it is not
    quantised, else a ``DequantizedSlice`` of it and ``scale`` (the slice of its ``*_scale_inv``,
    None when it has none). Refuses an fp8 tensor without a scale."""
    if scale is None:
        if src.get_dtype() in _FP8_NAMES:
            raise ValueError(
                f"{key!r} is {src.get_dtype()} but the checkpoint has no {scale_key(key)!r}: "
                "a quantised weight needs its block scales (download or convert it again)"
            )
        return src
    return DequantizedSlice(src, scale, key, fmt.block)


class DequantizedSlice:
    """A block-quantised weight behind the slice API of safetensors (``get_shape``, ``[rows,
    cols]``).

    Indexing reads only the asked elements of the fp8 weight and the scale blocks that cover them,
    and returns them dequantised in float32; the asked part may start anywhere, not only on a block
    boundary.
    """

    def __init__(self, weight, scale, key: str, block: tuple[int, int]) -> None:
        self.weight, self.scale, self.key, self.block = weight, scale, key, block
        shape = tuple(weight.get_shape())
        if weight.get_dtype() != "F8_E4M3":
            raise ValueError(
                f"{key!r} has block scales but is {weight.get_dtype()}, not F8_E4M3 "
                "(float8_e4m3fn); "
                "the checkpoint does not match quantization_config.fmt 'e4m3'"
            )
        if len(shape) != 2:
            raise ValueError(
                f"{key!r} has block scales but is {len(shape)}-D; only 2-D weights are "
                "block-quantised"
            )
        want = tuple(-(-n // b) for n, b in zip(shape, block))
        got = tuple(scale.get_shape())
        if got != want:
            raise ValueError(
                f"{scale_key(key)!r}: shape {got} does not cover weight {shape} in blocks of "
                f"{list(block)}, which needs {want}; set config.json quantization_config."
                "weight_block_size to the blocks the checkpoint was quantised with"
            )
        if scale.get_dtype() not in _SCALE_DTYPES:
            raise ValueError(
                f"{scale_key(key)!r} is {scale.get_dtype()}; block scales must be F32 (or BF16 / "
                "F16)"
            )
        self.shape = shape

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, index) -> torch.Tensor:
        rows, cols = _bounds(index, self.shape)
        if rows[0] == rows[1] or cols[0] == cols[1]:
            return torch.empty(rows[1] - rows[0], cols[1] - cols[0])
        (b0, b1) = self.block
        w8 = self.weight[rows[0] : rows[1], cols[0] : cols[1]]
        scale = self.scale[rows[0] // b0 : -(-rows[1] // b0), cols[0] // b1 : -(-cols[1] // b1)]
        return dequantize(w8, scale, self.block, (rows[0], cols[0]))


def _bounds(index, shape: tuple[int, int]) -> list[tuple[int, int]]:
    """(start, stop) per dim of a basic index made of unit-step slices (missing trailing dims:
    whole)."""
    index = index if isinstance(index, tuple) else (index,)
    if len(index) > len(shape) or not all(isinstance(s, slice) for s in index):
        raise IndexError(
            f"a quantised weight is read by slices of its {len(shape)} dims, got {index!r}"
        )
    index = index + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise IndexError(f"a quantised weight is read by unit-step slices, got {s!r}")
        out.append((start, max(start, stop)))
    return out


def dequantize(
    w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], offset: tuple[int, int] = (0, 0)
) -> torch.Tensor:
    """``float(w8) * scale`` blockwise, in float32.

    ``w8`` is the part at ``offset`` of a weight quantised in ``block``s, and ``scale`` the block
    rows and columns that cover it (``scale[0, 0]`` is the block holding ``w8[0, 0]``).
    """
    rows = (torch.arange(w8.shape[0]) + offset[0]) // block[0] - offset[0] // block[0]
    cols = (torch.arange(w8.shape[1]) + offset[1]) // block[1] - offset[1] // block[1]
    per_element = scale.float().index_select(0, rows).index_select(1, cols)
    return w8.float().mul_(per_element)


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w8, scale_inv)`` of a 2-D weight: per ``block``, ``scale_inv = amax / 448`` (1 for an
    all-zero block) and ``w8 = e4m3(w / scale_inv)``; the blocks of the last rows and columns may be
    partial."""
    rows, cols = w.shape
    b0, b1 = block
    nr, nc = -(-rows // b0), -(-cols // b1)
    w = w.float()
    padded = F.pad(w, (0, nc * b1 - cols, 0, nr * b0 - rows))  # zeros do not change a block's amax
    amax = padded.view(nr, b0, nc, b1).abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    per_element = scale_inv.repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
    w8 = (w / per_element).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return w8, scale_inv


def quantize_hf_tensors(tensors: dict[str, torch.Tensor], fmt: BlockFp8) -> dict[str, torch.Tensor]:
    """HF tensors -> the same in the FP8 format: each ``QUANTIZED_KEYS`` weight becomes its e4m3
    weight and ``*_scale_inv``; the others pass through unchanged."""
    out = {}
    for key, t in tensors.items():
        if QUANTIZED_KEYS.fullmatch(key):
            out[key], out[scale_key(key)] = quantize(t, fmt.block)
        else:
            out[key] = t
    return out


def kept_modules(keys: Iterable[str]) -> list[str]:
    """The linear modules among the HF weight ``keys`` that stay unquantised
    (``modules_to_not_convert``)."""
    return sorted(k.removesuffix(".weight") for k in keys if _KEPT_LINEARS.fullmatch(k))
