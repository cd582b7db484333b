"""Process groups and device meshes: cuda + nccl on GPU hosts, cpu + gloo elsewhere.

Layout of the ranks (outermost first)::

    pp x dp_replicate x dp_shard x cp   dense parameters (FSDP over dp_shard x cp,
                                                          HSDP: dp_replicate)
    pp x dp_replicate x efsdp x ep      routed experts   (EP over ep, FSDP over efsdp)
    with dp_shard x cp = efsdp x ep

Context-parallel ranks (``cp``, innermost: one CP group is consecutive ranks, inside a node where it
fits, since it gathers key state in every layer) hold parts of the same sequences; they join the
FSDP shard mesh of the parameters (torchtitan's dp_shard_cp), so the gradient reduction sums over
them too. Expert-parallel ranks are carved out of ``dp_shard x cp``, torchtitan-style (MoE is
token-local, and CP ranks hold different tokens): the ``ep`` ranks of one group are consecutive, so
on a GPU host the token all-to-all stays inside the node when possible. Every rank of
``dp_replicate x dp_shard`` reads different data (``ParallelMesh.dp``), including the ranks of one
EP group, which exchange tokens, not data; the ranks of one CP group read the same data
(``ParallelMesh["cp"]``) and split it; ``"dp_cp"`` holds all ranks of a pipeline stage (what the
losses and expert loads are summed over).

The meshes are kept by name in a ``ParallelMesh`` rather than sliced out of one root mesh by
flattened names, because slicing a flattened dim from the root mesh is deprecated from PyTorch 2.11
on.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

OPTION = {
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "ep": "parallelism.expert_parallel_degree",
    "pp": "parallelism.pipeline_parallel_degree",
    "cp": "parallelism.context_parallel_degree",
}


# ----------------------------------------------------------------------------------- process group
@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None  # None: single process without a process group


def init_distributed(timeout_s: float = 600.0, device_type: str | None = None) -> DistInfo:
    """Initialises the default process group from the torchrun environment.

    Promises: cuda + nccl (device ``cuda:LOCAL_RANK``, made current) when CUDA is available, cpu +
    gloo otherwise; ``device_type`` ("cuda" | "cpu") forces one. Without ``RANK``/``WORLD_SIZE`` in
    the environment it is a single process: no process group, rank 0 of 1. Calling it again returns
    the same answer (an existing default group is kept).
    """
    use_cuda = torch.cuda.is_available() if device_type is None else device_type == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ValueError(
            "init_distributed(device_type='cuda') but CUDA is not available on this host"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return DistInfo(
            dist.get_rank(), local_rank, dist.get_world_size(), device, dist.get_backend()
        )
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return DistInfo(0, 0, 1, device, None)
    backend = "nccl" if use_cuda else "gloo"
    kwargs = {"device_id": device} if use_cuda else {}
    dist.init_process_group(
        backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs
    )
    return DistInfo(dist.get_rank(), local_rank, dist.get_world_size(), device, backend)


def destroy_distributed() -> None:
    """Destroys the default process group if there is one."""
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------- degrees
@dataclass(frozen=True)
class ParallelDegrees:
    dp_replicate: int
    dp_shard: int
    ep: int
    pp: int
    world_size: int
    cp: int = 1

    @property
    def efsdp(self) -> int:
        """FSDP degree of the routed experts (``dp_shard * cp / ep``)."""
        return self.dp_shard * self.cp // self.ep

    @property
    def fsdp_shard(self) -> int:
        """Ranks the dense parameters are sharded over (``dp_shard * cp``)."""
        return self.dp_shard * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that read different data."""
        return self.dp_replicate * self.dp_shard


def validate_degrees(
    world_size: int,
    dp_replicate: int = 1,
    dp_shard: int = -1,
    ep: int = 1,
    pp: int = 1,
    n_routed_experts: int | None = None,
    cp: int = 1,
) -> ParallelDegrees:
    """Checks the degrees and fills ``dp_shard = -1`` (the ranks left over).

    Promises: ``pp * dp_replicate * dp_shard * cp == world_size``, ``ep`` divides ``dp_shard * cp``
    (EP ranks are carved out of the FSDP ranks, which include the CP ranks) and, when given,
    ``n_routed_experts``. Anything else raises ValueError naming the option and a fix.
    """
    for name, value in (("dp_replicate", dp_replicate), ("ep", ep), ("pp", pp), ("cp", cp)):
        if value < 1:
            raise ValueError(f"{OPTION[name]} = {value}: must be >= 1")
    others = dp_replicate * pp * cp
    if dp_shard == -1:
        if world_size % others:
            raise ValueError(
                f"{OPTION['dp_shard']} = -1 (use the ranks left over) but world size {world_size} "
                f"is not divisible by {OPTION['dp_replicate']} * {OPTION['pp']} * {OPTION['cp']} "
                f"= {others}; change those degrees"
            )
        dp_shard = world_size // others
    if dp_shard < 1:
        raise ValueError(
            f"{OPTION['dp_shard']} = {dp_shard}: must be >= 1, or -1 for the ranks left over"
        )
    if others * dp_shard != world_size:
        raise ValueError(
            f"parallel degrees do not multiply to the world size: {OPTION['pp']} ({pp}) * "
            f"{OPTION['dp_replicate']} ({dp_replicate}) * {OPTION['dp_shard']} ({dp_shard}) * "
            f"{OPTION['cp']} ({cp}) = {others * dp_shard} != {world_size} ranks; set "
            f"{OPTION['dp_shard']} = -1 to use the ranks left over, or launch "
            f"{others * dp_shard} processes"
        )
    shard = dp_shard * cp
    if shard % ep:
        what = OPTION["dp_shard"] + ("" if cp == 1 else f" x {OPTION['cp']}")
        raise ValueError(
            f"{OPTION['ep']} = {ep} must divide {what} = {shard} (expert-parallel ranks are carved "
            f"out of the FSDP ranks); choose an EP degree among {_divisors(shard)}"
        )
    if n_routed_experts is not None and n_routed_experts % ep:
        raise ValueError(
            f"{OPTION['ep']} = {ep} must divide the number of routed experts ({n_routed_experts}); "
            "choose one of "
            f"{[d for d in _divisors(n_routed_experts) if shard % d == 0]}"
        )
    return ParallelDegrees(dp_replicate, dp_shard, ep, pp, world_size, cp)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ----------------------------------------------------------------------------------- meshes
@dataclass
class ParallelMesh:
    """The meshes of one job, by name.

    ``mesh[name]`` is a 1-D mesh: ``"pp"``, ``"dp_replicate"``, ``"dp_shard"``, ``"cp"``,
    ``"efsdp"``, ``"ep"``, ``"dp"`` (the data-parallel ranks of this pipeline stage and CP
    coordinate: data sharding), ``"dp_cp"`` (every rank of this pipeline stage: loss and
    load-count all-reduces) or ``"dp_shard_cp"``. ``fsdp_mesh`` / ``expert_fsdp_mesh`` are what FSDP
    shards dense parameters / routed experts on.
    """

    degrees: ParallelDegrees
    device_type: str
    meshes: dict[str, DeviceMesh]
    # dp_shard x cp, or (dp_replicate, dp_shard x cp) = HSDP
    fsdp_mesh: DeviceMesh
    expert_fsdp_mesh: DeviceMesh  # efsdp, or (dp_replicate, efsdp); used under EP

    def __getitem__(self, name: str) -> DeviceMesh:
        if name not in self.meshes:
            raise KeyError(f"no mesh dim {name!r}; have {sorted(self.meshes)}")
        return self.meshes[name]

    @property
    def ep_enabled(self) -> bool:
        return self.degrees.ep > 1

    @property
    def pp_enabled(self) -> bool:
        return self.degrees.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.degrees.dp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.degrees.cp > 1


def build_mesh(
    world_size: int,
    dp_replicate: int = 1,
    dp_shard: int = -1,
    ep: int = 1,
    pp: int = 1,
    device_type: str | None = None,
    n_routed_experts: int | None = None,
    cp: int = 1,
) -> ParallelMesh:
    """Validates the degrees (``validate_degrees``) and builds the meshes on the default process
    group.

    Collective: every rank must call it with the same arguments. ``device_type`` defaults to "cuda"
    when CUDA is available, else "cpu". All meshes share one root (the world), as FSDP needs to
    compose with the EP-sharded expert weights.
    """
    deg = validate_degrees(world_size, dp_replicate, dp_shard, ep, pp, n_routed_experts, cp)
    if not dist.is_initialized() or dist.get_world_size() != world_size:
        have = dist.get_world_size() if dist.is_initialized() else "no"
        raise ValueError(
            f"build_mesh(world_size={world_size}) needs a default process group of that size "
            f"({have} ranks); call init_distributed() under torchrun first"
        )
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    world = init_device_mesh(device_type, (world_size,), mesh_dim_names=("world",))
    dims = (deg.pp, deg.dp_replicate, deg.dp_shard, deg.cp)
    grid = world._unflatten(0, dims, ("pp", "dp_replicate", "dp_shard", "cp"))
    dense = world._unflatten(
        0, (deg.pp, deg.dp_replicate, deg.fsdp_shard), ("pp", "dp_replicate", "dp_shard_cp")
    )
    sparse = world._unflatten(
        0, (deg.pp, deg.dp_replicate, deg.efsdp, deg.ep), ("pp", "dp_replicate", "efsdp", "ep")
    )
    data = world._unflatten(0, (deg.pp, deg.dp, deg.cp), ("pp", "dp", "cp"))
    stage = world._unflatten(0, (deg.pp, deg.dp * deg.cp), ("pp", "dp_cp"))
    meshes = {
        "pp": data["pp"],
        "dp": data["dp"],
        "cp": data["cp"],
        "dp_cp": stage["dp_cp"],
        "dp_replicate": grid["dp_replicate"],
        "dp_shard": grid["dp_shard"],
        "dp_shard_cp": dense["dp_shard_cp"],
        "efsdp": sparse["efsdp"],
        "ep": sparse["ep"],
    }
    hsdp = deg.dp_replicate > 1
    return ParallelMesh(
        deg,
        device_type,
        meshes,
        fsdp_mesh=dense["dp_replicate", "dp_shard_cp"] if hsdp else dense["dp_shard_cp"],
        expert_fsdp_mesh=sparse["dp_replicate", "efsdp"] if hsdp else sparse["efsdp"],
    )
