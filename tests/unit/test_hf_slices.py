"""One expert's HF tensor into a shard of our stacked 3-D weight (``hf_checkpoint._copy_slice``):
the gate and up projections of an expert fill rows ``:F`` and ``F:`` of ``moe.experts.w13``, and a
shard that FSDP split along those rows (``Shard(1)`` when the expert-FSDP degree exceeds the local
experts) takes exactly its part of each. The distributed load tests cover dim-0 shards; this covers
every cut through the rows on one process."""

from __future__ import annotations

import pytest
import torch

from titan_glm52 import get_flavor, hf_checkpoint
from titan_glm52.model.state_dict_adapter import ExpertSlice, hf_to_ours

E, F, D = 3, 4, 5


class _Slice:
    """The part of safetensors' slice API that ``_copy_slice`` uses."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def get_shape(self) -> list[int]:
        return list(self.t.shape)

    def __getitem__(self, index):
        return self.t[index]


@pytest.mark.parametrize("rows", [(0, 2 * F), (0, 3), (3, 7), (F, 2 * F), (5, 6)], ids=str)
@pytest.mark.parametrize("experts", [(0, E), (1, 2)], ids=str)
def test_gate_and_up_fill_their_rows_of_any_shard(monkeypatch, rows, experts):
    g = torch.Generator().manual_seed(0)
    hf = {(e, part): torch.randn(F, D, generator=g) for e in range(E) for part in range(2)}
    # what w13 must hold: [E, 2F, D]
    full = torch.stack([torch.cat((hf[e, 0], hf[e, 1])) for e in range(E)])
    (e0, e1), (r0, r1) = experts, rows
    local = torch.full((e1 - e0, r1 - r0, D), float("nan"))
    dst = torch.empty(E, 2 * F, D)  # the global shape; the shard is ``local`` at (e0, r0, 0)
    monkeypatch.setattr(
        hf_checkpoint, "local_view", lambda t: (local, tuple(local.shape), (e0, r0, 0))
    )
    for (e, part), t in hf.items():
        hf_checkpoint._copy_slice(
            _Slice(t), f"expert {e} part {part}", dst, ExpertSlice(e, part, 2)
        )
    assert torch.equal(local, full[e0:e1, r0:r1])


def test_a_wrong_shape_is_refused(monkeypatch):
    local = torch.zeros(E, 2 * F, D)
    monkeypatch.setattr(
        hf_checkpoint, "local_view", lambda t: (local, tuple(local.shape), (0, 0, 0))
    )
    with pytest.raises(ValueError, match=r"checkpoint shape \(5, 5\) != model \(4, 5\)"):
        hf_checkpoint._copy_slice(_Slice(torch.zeros(F + 1, D)), "bad", local, ExpertSlice(0, 1, 2))


def test_hf_names_map_to_the_stacked_weight():
    args = get_flavor("debug")
    layer = args.first_k_dense_replace  # a MoE layer
    key = f"model.layers.{layer}.mlp.experts.{{e}}.{{p}}.weight"
    ours = f"layers.{layer}.moe.experts."
    assert hf_to_ours(key.format(e=2, p="gate_proj"), args) == (ours + "w13", ExpertSlice(2, 0, 2))
    assert hf_to_ours(key.format(e=2, p="up_proj"), args) == (ours + "w13", ExpertSlice(2, 1, 2))
    assert hf_to_ours(key.format(e=0, p="down_proj"), args) == (ours + "w2", ExpertSlice(0, 0, 1))
