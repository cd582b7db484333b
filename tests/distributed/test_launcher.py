"""The grouped runner itself (``launcher.run_cases``): a case that passes on every rank passes; a
failure on one rank, a crash or a hang fails that case only, with its report, and the cases after it
still run and pass."""

import time

import torch
import torch.distributed as dist

from tests.distributed import launcher
from tests.distributed.launcher import Case, run_cases
from titan_glm52.distributed import init_distributed


def _sum_of_ones(rank0_meets_late: bool = False) -> None:
    init_distributed(device_type="cpu")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    if rank0_meets_late and dist.get_rank() == 0:
        # Rank 0 then leaves the meeting after this case 1 s late: rank 1 has failed the next case
        # by then, and the parent ends rank 0 before rank 0 reports this one as passed.
        meet = launcher._meet
        launcher._meet = lambda *args, **kwargs: (meet(*args, **kwargs), time.sleep(1.0))


def _fails_on_the_last_rank() -> None:
    init_distributed(device_type="cpu")
    if dist.get_rank() == dist.get_world_size() - 1:
        raise AssertionError("the last rank disagrees")
    dist.all_reduce(torch.ones(1))  # the other ranks wait here until the parent ends them


def _hangs() -> None:
    init_distributed(device_type="cpu")
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # no other rank joins


def _crashes() -> None:
    init_distributed(device_type="cpu")
    if dist.get_rank() == 1:
        import ctypes

        ctypes.string_at(0)  # SIGSEGV


def test_a_failure_a_crash_or_a_hang_fails_its_case_only(tmp_path):
    results = run_cases(
        {
            "first": Case(_sum_of_ones, 2, {"rank0_meets_late": True}),
            "fails": Case(_fails_on_the_last_rank, 2),
            "crashes": Case(_crashes, 2),
            "hangs": Case(_hangs, 2, timeout_s=5),
            "last": Case(_sum_of_ones, 2),
        },
        str(tmp_path),
    )
    assert results["first"] is None and results["last"] is None
    assert results["fails"].startswith("rank 1:") and "the last rank disagrees" in results["fails"]
    # faulthandler's stack of the rank that died
    assert "rank 1 crashed:" in results["crashes"] and "_crashes" in results["crashes"]
    assert results["hangs"] == "did not finish in 5 s on 2 ranks"
    # a new group after each of the three
    assert len(list(tmp_path.iterdir())) == 4
