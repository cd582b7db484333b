"""Runs functions on N local processes (forked from a fork server, gloo, one thread each): one
function (``run_on_ranks``, re-raises the first failure), or a test module's cases in groups that
share the processes (``run_cases``)."""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# What a rank imports, loaded once into the fork server from which every rank of this test process
# is forked. Why not spawn: each spawned rank imported torch, torchtitan and this project anew (3.5
# to 5.4 CPU-s apiece on a 2-core machine like CI's) for every group of every distributed module:
# tests/distributed under the README's command (2 workers) took 537 s spawned, 446 s forked. The
# server starts at the first launch, with this process's environment (TRITON_INTERPRET included),
# and never runs a case or touches a GPU, so every rank starts from the modules as imported.
_PRELOAD = [
    "tests.distributed.launcher",
    "tests.distributed.cases",
    "tests.distributed.cp_cases",
    "tests.distributed.hf_export_cases",
    "tests.distributed.hf_load_cases",
    "tests.distributed.lora_cases",
    "tests.distributed.pipeline_cases",
]


def _start(entry, args: tuple, nprocs: int):
    mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    return mp.start_processes(
        entry, args=args, nprocs=nprocs, start_method="forkserver", join=False
    )


def _host_store(world_size: int):
    """A TCPStore served by this process on a port the system picks and that stays bound until the
    store is dropped: the ranks' process group meets there (torchrun's agent store, which every rank
    joins as a client) and so do the launcher's own meetings. Why not a free port passed to rank 0:
    between finding it and rank 0 binding it, another process (a gloo connection of a parallel test
    worker) could take it."""
    return dist.TCPStore(
        "127.0.0.1", 0, world_size, True, datetime.timedelta(hours=1), wait_for_workers=False
    )


def _rank_env(rank: int, world_size: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # init_process_group joins the store at MASTER_PORT as a client instead of serving it
        TORCHELASTIC_USE_AGENT_STORE="True",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)


def _leave(code: int) -> None:
    """Tears the process group down and leaves without interpreter teardown: rarely a C++ thread of
    the distributed stack aborts there ("terminate called without an active exception", SIGABRT),
    which turned passing cases into failures (seen in CI on test_hf_load[ep2_fsdp2]); train.py exits
    the same way."""
    if code == 0 and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _entry(rank: int, world_size: int, port: int, fn, kwargs: dict) -> None:
    _rank_env(rank, world_size, port)
    try:
        fn(**kwargs)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # A raised exception never gets here: torch's spawn wrapper reports it and exits 1.
    _leave(0)


def run_on_ranks(fn, world_size: int, timeout_s: float = 120.0, **kwargs) -> None:
    """Calls ``fn(**kwargs)`` on ``world_size`` spawned processes with a torchrun-like environment.

    ``fn`` must be importable (a module-level function). Raises the first rank's exception (with its
    traceback) or TimeoutError after ``timeout_s`` (the processes are then killed).
    """
    store = _host_store(world_size)
    ctx = _start(_entry, (world_size, store.port, fn, kwargs), world_size)
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


# ----------------------------------------------------------------------------- grouped test cases
@dataclass(frozen=True)
class Case:
    """One distributed test case: ``fn(**kwargs)`` on ``world`` ranks, within ``timeout_s``."""

    fn: Callable[..., None]
    world: int
    kwargs: dict = field(default_factory=dict)
    timeout_s: float = 120.0


def run_cases(cases: dict[str, Case], report_dir: str) -> dict[str, str | None]:
    """Runs ``cases`` in their order, those of one world size in one group of processes, and
    returns name -> None (passed) or the failure's text (each failing rank's traceback).

    Why groups: a case's own work is 2-3 s here, and its ranks' start (the processes, gloo's
    rendezvous, the imports the fork server did not make) is paid once per group. In a group every
    case still builds its own model from its own seed, and dynamo's caches are cleared before
    each. A case that fails or times out ends its group (its ranks may have stopped at different
    collectives); the cases after it run in a new group.
    """
    results: dict[str, str | None] = {}
    for world in dict.fromkeys(c.world for c in cases.values()):
        pending = [name for name, c in cases.items() if c.world == world]
        while pending:
            folder = os.path.join(report_dir, f"world{world}_{len(results)}")
            os.makedirs(folder)
            results.update(_run_group(world, [(n, cases[n]) for n in pending], folder))
            pending = [n for n in pending if n not in results]
    return results


def _group_entry(rank: int, world: int, port: int, items: list, folder: str) -> None:
    _rank_env(rank, world, port)
    # a rank that dies by a signal (SIGSEGV, SIGABRT) leaves its Python stack for the report
    crash = open(os.path.join(folder, f"rank{rank}.crash"), "w")
    faulthandler.enable(crash)
    # The ranks meet in the parent's store after each case (keys of their own beside the process
    # group's), so no rank starts the next case while another still works in this one. Why: a case
    # whose ranks ran different collectives would otherwise pair its leftover ones with the next
    # case's and could pass both; this way it waits until the parent's deadline and fails alone.
    store = dist.PrefixStore(
        "launcher", dist.TCPStore("127.0.0.1", port, world, False, datetime.timedelta(hours=1))
    )
    with open(os.path.join(folder, f"rank{rank}.jsonl"), "a") as report:
        for name, case in items:
            try:
                torch._dynamo.reset()
                case.fn(**case.kwargs)
            except BaseException:
                report.write(json.dumps({"case": name, "error": traceback.format_exc()}) + "\n")
                report.flush()
                _leave(1)  # the other ranks may wait in a collective: the parent ends them
            _meet(store, name, world)
            report.write(json.dumps({"case": name}) + "\n")
            report.flush()
    _leave(0)


def _meet(store, key: str, world: int) -> None:
    """Counts this rank in at ``key`` and returns once all ``world`` ranks are in."""
    store.add(key, 1)
    while store.add(key, 0) < world:
        time.sleep(0.01)


def _reports(folder: str, world: int) -> list[dict[str, str | None]]:
    """Per rank: case -> None (passed) or its traceback, from the rank's report lines."""
    out = []
    for rank in range(world):
        seen: dict[str, str | None] = {}
        path = os.path.join(folder, f"rank{rank}.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    if line.endswith("\n"):
                        r = json.loads(line)
                        seen[r["case"]] = r.get("error")
        out.append(seen)
    return out


def _run_group(world: int, items: list[tuple[str, Case]], folder: str) -> dict[str, str | None]:
    """The cases that finished, in order, up to and including the first failure."""
    store = _host_store(world)  # held until the group's ranks are gone
    ctx = _start(_group_entry, (world, store.port, items, folder), world)
    current, deadline, stopped = 0, time.monotonic() + items[0][1].timeout_s, None
    while True:
        try:
            finished = ctx.join(timeout=1.0)
        except Exception as e:  # a rank exited non-zero; join ended the others
            finished, stopped = True, str(e)
        reports = _reports(folder, world)
        # A case passed once one rank reports it so: a rank writes that line only after every rank
        # met after the case. Why not wait for all ranks' lines: when the next case fails on one
        # rank, the others are ended, and one may not have written its line yet.
        while current < len(items) and any(
            items[current][0] in r and r[items[current][0]] is None for r in reports
        ):
            current += 1
            if current < len(items):
                deadline = time.monotonic() + items[current][1].timeout_s
        if finished:
            break
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            stopped = f"did not finish in {items[current][1].timeout_s} s on {world} ranks"
            break
    results: dict[str, str | None] = {name: None for name, _ in items[:current]}
    if current < len(items):
        name = items[current][0]
        errors = [f"rank {i}:\n{r[name]}" for i, r in enumerate(reports) if r.get(name)]
        for i in range(world):
            path = os.path.join(folder, f"rank{i}.crash")
            if os.path.exists(path) and (stack := open(path).read()):
                errors.append(f"rank {i} crashed:\n{stack}")
        results[name] = "\n".join(errors) or stopped or "the ranks left without a report"
    return results


def selected_cases(request, cases: dict[str, Case]) -> dict[str, Case]:
    """The cases that this pytest session runs of the module of ``request`` (a module fixture's):
    those named by the ``name`` argument of the selected tests that use the fixture, all of them if
    such a test takes no ``name``."""
    names = set()
    for item in request.session.items:
        if item.module is request.module and request.fixturename in item.fixturenames:
            spec = getattr(item, "callspec", None)
            if spec is None or "name" not in spec.params:
                return cases
            names.add(spec.params["name"])
    return {n: c for n, c in cases.items() if n in names}


def assert_passed(results: dict[str, str | None], name: str) -> None:
    """Fails the calling test with case ``name``'s failure from ``run_cases``, if it failed."""
    import pytest

    if results[name] is not None:
        pytest.fail(f"case {name}:\n{results[name]}", pytrace=False)
