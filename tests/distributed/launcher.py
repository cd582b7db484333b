"""Runs a function on N local processes (spawn, gloo, one thread each) and re-raises the first
failure."""

from __future__ import annotations

import os
import socket
import sys
import time

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, kwargs: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    try:
        fn(**kwargs)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    # The rank finished and tore its group down. Leave without interpreter teardown: rarely a C++
    # thread of the distributed stack aborts there ("terminate called without an active exception",
    # SIGABRT), which turned passing cases into failures (seen in CI on test_hf_load[ep2_fsdp2]);
    # train.py exits the same way. A raised exception never gets here: torch's spawn wrapper reports
    # it and exits 1.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(fn, world_size: int, timeout_s: float = 120.0, **kwargs) -> None:
    """Calls ``fn(**kwargs)`` on ``world_size`` spawned processes with a torchrun-like environment.

    ``fn`` must be importable (a module-level function). Raises the first rank's exception (with its
    traceback) or TimeoutError after ``timeout_s`` (the processes are then killed).
    """
    ctx = mp.start_processes(
        _entry,
        args=(world_size, free_port(), fn, kwargs),
        nprocs=world_size,
        start_method="spawn",
        join=False,
    )
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(
                f"{getattr(fn, '__name__', fn)} on {world_size} ranks did not finish in "
                f"{timeout_s} s"
            )
