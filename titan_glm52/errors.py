"""Refusals a person reads: the errors this project raises on purpose, and how a run reports them.

A ``UserError`` is a refusal made on purpose: its message names the key or file and the fix.
``train.py`` reports one as a single line, once for the whole job (by the first rank that hits it),
and exits with status 2, without a traceback; under torchrun the line is also the root cause in
torchrun's closing summary (through the error file torchrun gives every worker). Any other exception
keeps its traceback. ``TITAN_GLM52_TRACEBACK=1`` shows the traceback of a refusal too.
"""

from __future__ import annotations

import json
import os
import sys
import time

EXIT_REFUSED = 2
TRACEBACK_ENV = "TITAN_GLM52_TRACEBACK"


class UserError(Exception):
    """A refusal on purpose; the message names the key or file and the fix."""


class ConfigError(UserError, ValueError):
    """A job config that cannot work; the message names the key and the fix."""


class DataError(UserError, ValueError):
    """A dataset or tokenizer that cannot be read as configured; the message names the file and the
    fix."""


class CheckpointError(UserError):
    """A checkpoint that cannot be loaded, resumed or written; the message names the folder and the
    fix."""


class TrainingStopped(UserError):
    """The run stopped on purpose (e.g. too many consecutive non-finite steps); what is on disk is
    intact."""


def show_tracebacks() -> bool:
    return os.environ.get(TRACEBACK_ENV, "0") not in ("", "0")


def _first_to_report() -> bool:
    """Whether this process is the first of its job to report a refusal. Under torchrun the ranks
    share the agent's key-value store (MASTER_ADDR / MASTER_PORT) and count reports there; elsewhere
    a process is alone."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "MASTER_ADDR" not in os.environ:
        return True
    try:
        import datetime

        from torch.distributed import TCPStore

        store = TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=10),
        )
        return store.add(f"titan_glm52/refusals/{os.environ['TORCHELASTIC_RUN_ID']}", 1) == 1
    except Exception:  # no store to agree on: every rank reports rather than none
        return True


def _write_error_file(message: str) -> None:
    """torchrun's per-worker error file, which its closing summary prints as the failure's
    "traceback"."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    with open(path, "w") as f:
        json.dump(
            {
                "message": {
                    "message": message,
                    "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))},
                }
            },
            f,
        )


def report_refusal(error: UserError) -> None:
    """Prints ``error`` as one line (if this process is the first of the job to report) and ends the
    process with ``EXIT_REFUSED``. Other ranks wait a moment first, so that torchrun names the
    reporting rank as the root cause."""
    message = f"error: {error}"
    if _first_to_report():
        _write_error_file(message)
        print(message, file=sys.stderr, flush=True)
    else:
        time.sleep(2.0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_REFUSED)
