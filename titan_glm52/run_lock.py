"""One job per output folder: a lock file in ``job.dump_folder`` that names its holder.

The job's first process creates ``<dump_folder>/.titan_glm52.lock`` (host, process id, start time)
before any work and refreshes its time stamp every ``HEARTBEAT_S`` seconds; a second job on the
folder is refused with the holder named. A lock left by a job that died is not stuck: it is taken
over when its process is gone (same host) or its time stamp is older than ``STALE_S`` (any host, a
job that stopped refreshing it).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

from titan_glm52.errors import UserError

logger = logging.getLogger("titan_glm52")

LOCK_NAME = ".titan_glm52.lock"
HEARTBEAT_S = 30.0
STALE_S = 600.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def _stale(holder: dict, age_s: float) -> str | None:
    """Why the lock of ``holder`` (its file last refreshed ``age_s`` ago) is stale, or None if it is
    live."""
    if holder.get("host") == socket.gethostname() and not _alive(int(holder.get("pid", -1))):
        return f"its process {holder.get('pid')} is gone"
    if age_s > STALE_S:
        return f"it was last refreshed {age_s:.0f} s ago"
    return None


class OutputLock:
    """The lock of ``folder`` for this process (``acquire`` / ``release``; a context manager)."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, LOCK_NAME)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._held = False

    def acquire(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        for _ in range(2):  # (a second try after removing a stale lock)
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_or_refuse()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self._held = True
            self._thread = threading.Thread(target=self._heartbeat, daemon=True, name="output-lock")
            self._thread.start()
            return
        raise UserError(f"{self.path}: could not take the lock of this output folder")

    def _take_over_or_refuse(self) -> None:
        try:
            with open(self.path) as f:
                holder = json.load(f)
            age = time.time() - os.path.getmtime(self.path)
        except (OSError, ValueError):  # half-written or gone meanwhile: treat as stale
            holder, age = {}, STALE_S + 1
        why = _stale(holder, age)
        if why is None:
            raise UserError(
                f"job.dump_folder {os.path.dirname(self.path)} is in use by a job started "
                f"{holder.get('started')} "
                f"on host {holder.get('host')} (pid {holder.get('pid')}; lock file {self.path}, "
                "refreshed "
                f"{age:.0f} s ago). Wait for it to end, use another --job.dump_folder, or delete "
                "the lock file if "
                "that job is gone"
            )
        logger.warning(
            "taking over %s from the job of %s (pid %s): %s",
            self.path,
            holder.get("host"),
            holder.get("pid"),
            why,
        )
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        if not self._held:
            return
        self._stop.set()
        self._held = False
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
