"""The Triton kernels compile for sm_90 (H100/H200) at the real GLM-5.2 sizes and fit in shared
memory, and so do the Gluon kernels of ``kernels/sparse_mla_ws.py`` and
``kernels/indexer_topk_ws.py`` (the only CPU check those can have: Gluon has no interpreter mode).

Runs on CPU: ``bench/compile_check.py`` lowers every kernel through Triton and the bundled ptxas
without a GPU, which catches what the interpreter cannot (loop-carried types, layouts, shared-memory
overflow).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _ptxas_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return os.path.exists(get_ptxas(90).path)
    except Exception:
        return False


@pytest.mark.skipif(not _ptxas_available(), reason="triton's bundled ptxas not available")
def test_compile_sm90_real_sizes():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "compile_check.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(res.stdout)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]


@pytest.mark.skipif(not _ptxas_available(), reason="triton's bundled ptxas not available")
def test_tma_reduce_probe_lowers_for_sm90():
    """``bench/tma_reduce_probe.py`` wraps an op Triton 3.6's Gluon builds but does not expose on
    Hopper (TMA reductions): on the pinned Triton its kernel lowers to one
    ``cp.reduce.async.bulk.tensor`` .add per tile row."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "tma_reduce_probe.py", "--ptx"],
        cwd=os.path.join(ROOT, "bench"),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stdout.startswith("64 TMA reductions"), res.stdout
    assert "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add" in res.stdout, res.stdout
