"""Per-rank body: a sharded (FSDP / EP) or pipelined model exported unit by unit with
``save_hf_distributed``."""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor

import titan_glm52.hf_export as hf_export
from tests.distributed.cases import debug_args
from titan_glm52.distributed import build_mesh, init_distributed
from tests.distributed.hf_load_cases import loaded_model


class UnitWatch:
    """Asserts that this rank never holds more than one unit's full tensors: at every gather
    (``full_tensor``) and every file write, the tensors of the previously written unit are gone, and
    a non-writer holds no earlier gather. Tracks the gathered tensors and the tensors handed to
    ``save_file`` through weak references."""

    def __init__(self, writer: bool) -> None:
        self.writer, self.gathered, self.written, self.files = writer, [], [], 0
        self._full_tensor, self._save_file = DTensor.full_tensor, hf_export.save_file

        def full_tensor(dtensor, *args, **kwargs):
            return self.full_tensor(dtensor, *args, **kwargs)

        DTensor.full_tensor, hf_export.save_file = full_tensor, self.save_file

    def restore(self) -> None:
        DTensor.full_tensor, hf_export.save_file = self._full_tensor, self._save_file

    @staticmethod
    def _alive(refs) -> int:
        return sum(r() is not None for r in refs)

    def full_tensor(self, dtensor: DTensor, *args, **kwargs) -> torch.Tensor:
        assert self._alive(self.written) == 0, "a written unit is still held at the next gather"
        if not self.writer:
            assert self._alive(self.gathered) == 0, "a non-writer kept a gathered tensor"
        out = self._full_tensor(dtensor, *args, **kwargs)
        self.gathered.append(weakref.ref(out))
        return out

    def save_file(self, tensors, path, metadata=None):
        assert self.writer
        assert self._alive(self.written) == 0, (
            "the previous unit is still held when the next one is written"
        )
        self._save_file(tensors, path, metadata=metadata)
        self.written = self.gathered + [weakref.ref(t) for t in tensors.values()]
        self.gathered = []
        self.files += 1


def check_hf_export(
    src_dir: str,
    out_dir: str,
    dp_shard: int = 1,
    ep: int = 1,
    pp: int = 1,
    dp_replicate: int = 1,
    with_mtp: bool = True,
) -> None:
    env = init_distributed()
    args = debug_args()
    mesh = build_mesh(
        env.world_size,
        dp_replicate=dp_replicate,
        dp_shard=dp_shard,
        ep=ep,
        pp=pp,
        device_type="cpu",
        n_routed_experts=args.n_routed_experts,
    )
    model = loaded_model(args, mesh, src_dir, pp, ep, with_mtp)
    writer = mesh["dp"].get_local_rank() == 0
    export_args = args if with_mtp else args.replace(num_nextn_predict_layers=0)
    watch = UnitWatch(writer)
    try:
        hf_export.save_hf_distributed([model], export_args, out_dir, torch.bfloat16, writer=writer)
    finally:
        watch.restore()
    if writer:
        assert watch.files == len({hf_export.unit_of(k, export_args) for k in model.state_dict()})
    else:
        assert watch.files == 0
