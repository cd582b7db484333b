"""Tests for titan_glm52/plan.py: the ``python -m titan_glm52.plan layout`` command line.

The 744B cases run as real subprocesses; each imports torch (~3 s of CPU), so they start together in
one module fixture. The other cases call ``plan.main(argv)`` in this process (same parser, printing
and exit status).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from titan_glm52 import plan
from titan_glm52.hf_checkpoint import write_hf_config
from titan_glm52.model.args import _debug_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


SUBPROCESS_RUNS = {
    "pp8": ["layout", "--flavor", "glm52_744b", "--pp", "8"],
    "bad_pp4": [
        "layout",
        "--flavor",
        "glm52_744b",
        "--pp",
        "4",
        "--layers-per-stage",
        "20,20,20,18",
    ],
    "good_pp4": [
        "layout",
        "--flavor",
        "glm52_744b",
        "--pp",
        "4",
        "--layers-per-stage",
        "18,20,20,20",
    ],
}


@pytest.fixture(scope="module")
def results():
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "titan_glm52.plan", *argv],
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for name, argv in SUBPROCESS_RUNS.items()
    }
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        out[name] = (p.returncode, stdout, stderr)
    return out


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = plan.main(list(argv))
    except SystemExit as e:  # argparse usage errors
        rc = e.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _layers_line(stdout: str) -> list[int]:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("layers per stage:")]
    assert len(lines) == 1, stdout
    return [int(x) for x in lines[0].removeprefix("layers per stage:").strip().split(",")]


def _stage_lines(stdout: str) -> list[str]:
    return [ln for ln in stdout.splitlines() if ln.startswith("stage ")]


def test_layout_chooses_a_valid_split(results):
    rc, stdout, stderr = results["pp8"]
    assert rc == 0, stderr
    layout = _layers_line(stdout)
    assert len(layout) == 8 and sum(layout) == 78
    stages = _stage_lines(stdout)
    assert len(stages) == 8
    start = 0
    for s, (line, n) in enumerate(zip(stages, layout)):
        assert line.startswith(f"stage {s}: rank {s}, ")
        assert f"first layer {start} (full), {n} layers, cost share " in line
        start += n
    assert "tok_embeddings" in stages[0] and "norm, output, mtp" in stages[-1]


def test_layout_refuses_a_split_starting_on_a_shared_layer(results):
    rc, stdout, stderr = results["bad_pp4"]
    assert rc == 1
    assert "layers per stage:" not in stdout
    assert "stage 1 starts at layer 20, a shared layer (source layer 18)" in stderr
    assert stderr.rstrip().endswith("Nearest valid layout: 18,20,20,20")


def test_layout_accepts_a_valid_split(results):
    rc, stdout, stderr = results["good_pp4"]
    assert rc == 0, stderr
    assert _layers_line(stdout) == [18, 20, 20, 20]
    assert "given layout is valid" in stdout
    assert len(_stage_lines(stdout)) == 4


def test_layout_accepts_the_megatron_pp8_split(capsys):
    rc, stdout, stderr = _main(
        capsys,
        "layout",
        "--flavor",
        "glm52_744b",
        "--pp",
        "8",
        "--schedule",
        "1F1B",
        "--seq-len",
        "8192",
        "--layers-per-stage",
        "14,8,8,8,8,8,8,16",
    )
    assert rc == 0, stderr
    assert _layers_line(stdout) == [14, 8, 8, 8, 8, 8, 8, 16]
    assert len(_stage_lines(stdout)) == 8


def test_layout_reads_an_hf_config_and_a_v_schedule(capsys, tmp_path):
    write_hf_config(_debug_args(), str(tmp_path), torch.float32)  # 8 layers, full at 0, 1, 2, 6
    rc, stdout, stderr = _main(
        capsys, "layout", "--hf-config", str(tmp_path), "--pp", "2", "--schedule", "ZBVZeroBubble"
    )
    assert rc == 0, stderr
    layout = _layers_line(stdout)
    assert len(layout) == 4 and sum(layout) == 8
    ranks = [int(line.split("rank ")[1].split(",")[0]) for line in _stage_lines(stdout)]
    assert ranks == [0, 1, 1, 0]
    assert "rank 0: stages 0,3" in stdout
    rc, _, stderr = _main(
        capsys, "layout", "--flavor", "debug", "--hf-config", str(tmp_path), "--pp", "2"
    )
    # argparse: --flavor and --hf-config exclude
    assert rc == 2 and "not allowed with argument" in stderr


def test_layout_refuses_impossible_requests(capsys):
    rc, stdout, stderr = _main(
        capsys, "layout", "--pp", "4", "--schedule", "1F1B", "--stages-per-rank", "2"
    )
    assert rc == 1 and "1F1B runs one stage per rank" in stderr and stdout == ""
    rc, _, stderr = _main(
        capsys, "layout", "--pp", "8", "--schedule", "Interleaved1F1B", "--stages-per-rank", "3"
    )
    assert rc == 1 and "into 24 pipeline stages" in stderr and "only 21" in stderr
    rc, _, stderr = _main(capsys, "layout", "--pp", "4", "--layers-per-stage", "18,x")
    assert rc == 2 and "comma-separated integers" in stderr
    rc, _, stderr = _main(capsys)
    assert rc == 2 and "COMMAND" in stderr
