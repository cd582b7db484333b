"""IndexShare: the one place that decides which layers run the DSA indexer ("full") and which reuse
the top-k of the nearest earlier full layer ("shared").

Precedence: an explicit ``indexer_types`` list > ``index_topk_pattern`` (a string of ``F``/``S``) >
(``index_topk_freq``, ``index_skip_topk_offset``). With the last form, 0-indexed layer ``i`` is full
iff ``max(i - offset + 1, 0) % freq == 0`` (transformers, vLLM and SGLang; equal to Megatron/slime's
1-indexed rule). GLM-5.2 (freq 4, offset 3) gives 21 full layers: 0, 1, 2, 6, 10, ..., 74.

The MTP layer is not part of the schedule: it always runs its own indexer (``has_indexer``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IndexShareSchedule:
    full: tuple[bool, ...]

    def __post_init__(self) -> None:
        if not self.full:
            raise ValueError("IndexShare schedule is empty (num_hidden_layers must be >= 1)")
        if not self.full[0]:
            raise ValueError(
                "IndexShare schedule starts with a shared layer: layer 0 has no earlier full layer "
                "to take its "
                f"top-k from (pattern {self.pattern}). Make layer 0 'full' (indexer_types / "
                "index_topk_pattern), "
                "or use index_skip_topk_offset >= 1 with index_topk_freq."
            )

    @property
    def num_layers(self) -> int:
        return len(self.full)

    @property
    def pattern(self) -> str:
        return "".join("F" if f else "S" for f in self.full)

    @property
    def full_layers(self) -> list[int]:
        return [i for i, f in enumerate(self.full) if f]

    def is_full(self, layer_id: int) -> bool:
        return self.full[layer_id]

    def has_indexer(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` runs its own indexer: the full layers, and the MTP layer (the
        id after the last decoder layer), which always does."""
        return layer_id >= self.num_layers or self.full[layer_id]

    def source_layer(self, layer_id: int) -> int:
        """The full layer whose top-k ``layer_id`` uses (itself when it is full)."""
        i = layer_id
        while not self.full[i]:
            i -= 1
        return i

    def indexer_types(self) -> list[str]:
        return ["full" if f else "shared" for f in self.full]


def build_schedule(
    num_layers: int,
    *,
    indexer_types: list[str] | None = None,
    index_topk_pattern: str | None = None,
    index_topk_freq: int | None = None,
    index_skip_topk_offset: int | None = None,
) -> IndexShareSchedule:
    """Builds (and validates) the schedule from the config keys, in precedence order."""
    if indexer_types is not None:
        bad = sorted(set(indexer_types) - {"full", "shared"})
        if bad:
            raise ValueError(f"indexer_types may only hold 'full'/'shared', got {bad}")
        if len(indexer_types) != num_layers:
            raise ValueError(
                f"indexer_types has {len(indexer_types)} entries for {num_layers} layers; "
                "give one per decoder layer (or drop it to derive the schedule)"
            )
        return IndexShareSchedule(tuple(t == "full" for t in indexer_types))
    if index_topk_pattern is not None:
        pattern = index_topk_pattern.upper()
        if set(pattern) - {"F", "S"} or len(pattern) != num_layers:
            raise ValueError(
                f"index_topk_pattern must be {num_layers} characters of 'F'/'S', got "
                f"{index_topk_pattern!r}"
            )
        return IndexShareSchedule(tuple(c == "F" for c in pattern))
    freq = 1 if index_topk_freq is None else int(index_topk_freq)
    if freq < 1:
        raise ValueError(f"index_topk_freq must be >= 1, got {index_topk_freq}")
    if freq == 1:
        return IndexShareSchedule((True,) * num_layers)
    if index_skip_topk_offset is None:
        raise ValueError(
            "index_topk_freq > 1 needs index_skip_topk_offset (codebases disagree on its default: "
            "transformers uses 2, Megatron 1, slime 0); set it explicitly or give indexer_types"
        )
    offset = int(index_skip_topk_offset)
    if offset < 0:
        raise ValueError(f"index_skip_topk_offset must be >= 0, got {offset}")
    return IndexShareSchedule(tuple(max(i - offset + 1, 0) % freq == 0 for i in range(num_layers)))
