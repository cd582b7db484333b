"""Runs one case of cases.py by hand: ``python -m tests.distributed.run_case WORLD CASE ['{"json":
"kwargs"}']``.

``TITAN_GLM52_TEST_DEVICE=cuda`` runs it on nccl with one GPU per process.
"""

import json
import sys
import time

from tests.distributed import cases
from tests.distributed.launcher import run_on_ranks

if __name__ == "__main__":
    world, name = int(sys.argv[1]), sys.argv[2]
    kwargs = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    t0 = time.monotonic()
    run_on_ranks(getattr(cases, name), world, timeout_s=600, **kwargs)
    print(f"OK {name} world={world} {kwargs} in {time.monotonic() - t0:.1f} s")
