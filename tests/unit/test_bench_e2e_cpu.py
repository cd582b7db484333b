"""bench/e2e.py plumbing on CPU: both sides train a tiny model for a few steps in their own
subprocesses, the JSON / markdown / table come out, and a failing cell is recorded without stopping
the run."""

import importlib.util
import gzip
import json
import os
import shlex
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_e2e_both_sides_tiny_on_cpu(tmp_path):
    pytest.importorskip("torchtitan.models.deepseek_v3")
    out = tmp_path / "e2e.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("OUT", None)
    proc = subprocess.run(
        [
            sys.executable,
            "bench/e2e.py",
            "--seq-lens",
            "64",
            "--compile",
            "off",
            "--ac",
            "selective",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--our-args=--model.flavor debug",
            "--peer-args=--tiny",
            "--out",
            str(out),
            "--logs",
            str(tmp_path / "logs"),
            "--budget-s",
            "0",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    (cell,) = report["cells"]
    ours, peer = cell["ours"], cell["peer"]
    if (
        peer["status"] != "ok"
        and "torchtitan" in peer.get("stderr_tail", "")
        and "Import" in peer.get("error", "")
    ):
        pytest.skip(f"torchtitan DeepSeek-V3 does not run on this CPU: {peer.get('error')}")
    assert ours["status"] == "ok", ours
    assert peer["status"] == "ok", peer
    assert ours["tokens_per_step"] == 64 and peer["tokens_per_step"] == 64
    assert len([r for r in ours["records"] if r["step"] > 1]) == 2 and len(peer["records"]) == 3
    for side in (ours, peer):
        assert side["tokens_per_s"] > 0 and side["step_s"] > 0
        assert side["forward_backward_s"] > 0 and side["optimizer_s"] >= 0 and side["data_s"] >= 0
    assert (
        peer["params_active"] < peer["params_total"]
        and peer["flops_per_step"] < peer["flops_per_step_tt"]
    )
    assert cell["ratio"] == pytest.approx(ours["tokens_per_s"] / peer["tokens_per_s"])
    timed = [r["step_s"] for r in peer["records"][1:]]  # (1 warm-up step)
    assert peer["step_s_median"] == statistics.median(timed) and ours["step_s_median"] > 0
    assert cell["ratio_median"] == pytest.approx(
        64 / ours["step_s_median"] / (64 / peer["step_s_median"])
    )
    md = (tmp_path / "e2e.md").read_text()
    assert "| S=64 compile=off ac=selective |" in md and "bench/e2e.py" in md
    table = proc.stdout.strip().splitlines()
    assert table[-1].startswith("S=64 compile=off ac=selective") and "ratio ours/peer" in table[-3]


def test_failing_cell_is_recorded(tmp_path):
    e2e = _load("e2e")
    runner = e2e.Runner(str(tmp_path), cell_timeout=60, budget_s=0)
    run = runner.run(
        [
            sys.executable,
            "-c",
            "import sys; print('x'); "
            "sys.exit('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 9 GiB')",
        ],
        "oom",
    )
    fail = e2e._failure(run)
    assert fail["status"] == "OOM" and "Tried to allocate" in fail["stderr_tail"]
    run = runner.run([sys.executable, "-c", "raise ValueError('boom')"], "err")
    fail = e2e._failure(run)
    assert fail["status"] == "error" and "ValueError: boom" in fail["stderr_tail"]
    run = e2e.Runner(str(tmp_path), cell_timeout=1, budget_s=0).run(
        [sys.executable, "-c", "import time; time.sleep(30)"], "slow"
    )
    assert e2e._failure(run)["status"] == "TIMEOUT"
    spent = e2e.Runner(str(tmp_path), cell_timeout=60, budget_s=5)
    assert e2e._failure(spent.run([sys.executable, "-c", "pass"], "late"))["status"] == "SKIPPED"
    head, rows = e2e.table_rows(
        [{"config": "S=1", "ours": {"status": "OOM"}, "peer": {"status": "error"}}]
    )
    assert rows == [["S=1", "OOM", "OOM", "OOM", "OOM", "error", "error", "error", "-", "-"]]
    assert e2e.text_table(head, rows).splitlines()[-1].startswith("S=1")


def test_summarize_ours_averages_after_warmup():
    e2e = _load("e2e")
    rows = [
        {
            "step": s,
            "time/step_s": t,
            "throughput/tokens_per_s_per_device": 100 / t,
            "time/data_s": 0.0,
            "time/forward_backward_s": t - 0.1,
            "time/optimizer_s": 0.1,
            "throughput/tflops_per_device": 1.0,
            "throughput/mfu_pct": m,
            "memory/peak_allocated_gib": g,
            "memory/alloc_retries": r,
        }
        for s, t, m, g, r in (
            (1, 9.0, 1.0, 50.0, 4.0),
            (2, 0.1 * 3, 10.0, 20.0, 4.0),
            (3, 0.1 * 3, 20.0, 21.0, 7.0),
        )
    ]
    out = e2e.summarize_ours(rows, warmup=1, steps=2)
    assert out["tokens_per_s"] == pytest.approx(200 / 0.6) and out["step_s"] == pytest.approx(0.3)
    # whole tokens: 100 / t * t is 99.99999999999999 for this t
    assert out["tokens_per_step"] == 100
    assert out["mfu_pct"] == pytest.approx(15.0) and out["peak_allocated_gib"] == 21.0
    assert out["alloc_retries"] == 3.0  # the cumulative count's growth over the timed steps
    with pytest.raises(ValueError):
        e2e.summarize_ours(rows, warmup=1, steps=3)


def test_trace_summary_groups_kernels_per_step(tmp_path):
    """bench/trace_summary.py: GPU kernel time per profiled step, by kernel name and by category."""
    ts = _load("trace_summary")
    events = [
        {"ph": "X", "cat": "kernel", "name": "_bwd_grad_kernel", "dur": 3000.0},
        {"ph": "X", "cat": "kernel", "name": "_bwd_grad_kernel", "dur": 1000.0},
        {
            "ph": "X",
            "cat": "kernel",
            "name": "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT",
            "dur": 2000.0,
        },
        {"ph": "X", "cat": "kernel", "name": "cutlass3x_GroupProblemShape_gemm", "dur": 1000.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "dur": 1000.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 9000.0},  # host side: not GPU time
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = ts.summarize(str(path), steps=2, top=3)
    assert s["gpu_ms_per_step"] == pytest.approx(4.0)  # 8 ms of GPU work over 2 steps
    cats = {c["category"]: c["ms_per_step"] for c in s["categories"]}
    assert cats == pytest.approx(
        {
            "dsa: sparse mla bwd": 2.0,
            "gemm (cublas/cutlass)": 1.0,
            "grouped gemm (moe)": 0.5,
            "copy / cat / index": 0.5,
        }
    )
    assert [k["name"] for k in s["kernels"]][0] == "_bwd_grad_kernel" and len(s["kernels"]) == 3
    assert s["kernels"][0]["calls_per_step"] == 1.0
    assert "GPU kernel time 4.0 ms/step" in ts.text(s)
    for name, cat in (
        ("_fwd_ws_kernel", "dsa: sparse mla fwd"),
        ("_bwd_ps_ws_kernel", "dsa: sparse mla bwd"),
        ("_bwd_grad_ws_kernel", "dsa: sparse mla bwd"),
        ("_bwd_kernel", "dsa: sparse mla bwd"),
        ("_swiglu_bwd_kernel", "elementwise"),
        ("_ce_rows_kernel", "reduce / softmax / norm"),
    ):
        assert ts.category(name) == cat, name


def test_trace_gemm_rates_by_op_and_shape(tmp_path):
    """``--gemms``: GEMM kernels joined to their aten op by "External id", grouped by op and input
    dims, with the FLOPs each op's dims give; a gzipped trace reads like a plain one."""
    ts = _load("trace_summary")
    events = [
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "aten::mm",
            "args": {"External id": 1, "Input Dims": [[4, 8], [8, 16]]},
        },
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "aten::addmm_",
            "args": {"External id": 2, "Input Dims": [[16, 8], [16, 4], [4, 8], [], []]},
        },
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "aten::_grouped_mm",
            "args": {"External id": 3, "Input Dims": [[32, 8], [2, 8, 16], [2]]},
        },
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "aten::bmm",
            "args": {"External id": 4, "Input Dims": [[2, 4, 8], [2, 8, 16]]},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "nvjet_a",
            "ts": 0.0,
            "dur": 1000.0,
            "args": {"External id": 1},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "nvjet_a",
            "ts": 2000.0,
            "dur": 3000.0,
            "args": {"External id": 1},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "nvjet_b",
            "ts": 6000.0,
            "dur": 500.0,
            "args": {"External id": 2},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "void at::cuda::detail::prepare_grouped_gemm_data",
            "ts": 7000.0,
            "dur": 1.0,
            "args": {"External id": 3},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "cutlass_grouped",
            "ts": 7010.0,
            "dur": 2000.0,
            "args": {"External id": 3},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "nvjet_c",
            "ts": 9100.0,
            "dur": 100.0,
            "args": {"External id": 4},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "_fwd_ws_kernel",
            "ts": 9500.0,
            "dur": 100.0,
            "args": {"External id": 5},
        },
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = ts.gemm_rates(ts._events(str(path)), steps=2)
    rows = {(r["op"], json.dumps(r["dims"])): r for r in got["shapes"]}
    mm = rows[("aten::mm", json.dumps([[4, 8], [8, 16]]))]
    assert mm["calls_per_step"] == 1 and mm["ms_per_step"] == pytest.approx(2.0)
    # two calls' FLOPs over their 4 ms
    assert mm["tflops"] == pytest.approx(2 * 2 * 4 * 8 * 16 / 4.0 / 1e9)
    assert rows[("aten::addmm_", json.dumps([[16, 8], [16, 4], [4, 8]]))][
        "tflops"
    ] == pytest.approx(2 * 16 * 4 * 8 / 0.5 / 1e9)
    grouped = rows[("aten::_grouped_mm", json.dumps([[32, 8], [2, 8, 16], [2]]))]
    assert grouped["calls_per_step"] == 0.5 and grouped["tflops"] == pytest.approx(
        2 * 32 * 8 * 16 / 2.0 / 1e9
    )
    assert ts.gemm_flops("aten::bmm", [[2, 4, 8], [2, 8, 16]]) == 2 * 2 * 4 * 8 * 16
    # k-grouped
    assert ts.gemm_flops("aten::_grouped_mm", [[8, 32], [32, 16], [2]]) == 2 * 8 * 32 * 16
    # the grouped op's setup kernel and the non-GEMM kernel are left out
    assert len(got["shapes"]) == 4
    assert [(c["at_ms"], c["ms"]) for c in got["calls"]] == [(0.0, 1.0), (2.0, 3.0), (7.01, 2.0)]
    assert "GEMM shapes" in ts.gemm_text(got)


def test_trace_timeline_exposed_communication():
    """Idle GPU time and NCCL time that no compute kernel overlaps (the exposed communication), per
    step."""
    ts = _load("trace_summary")
    kernels = [
        ("nvjet_gemm", 0.0, 10000.0),
        ("ncclDevKernel_AllGather", 5000.0, 10000.0),
        ("nvjet_gemm", 20000.0, 5000.0),
        ("ncclDevKernel_ReduceScatter", 22000.0, 10000.0),
        ("_fwd_kernel", 40000.0, 1000.0),
    ]
    tl = ts.timeline(kernels, steps=2)
    # span 41 ms; busy [0, 15] + [20, 32] + [40, 41] = 28 ms; NCCL 20 ms, of which [10, 15] and [25,
    # 32] exposed
    assert tl == pytest.approx(
        {"span_ms": 20.5, "busy_ms": 14.0, "idle_ms": 6.5, "nccl_ms": 10.0, "nccl_exposed_ms": 6.0}
    )
    assert ts.timeline([]) == {}
    host = [
        ("aten::item", 31000.0, 8000.0),
        ("ProfilerStep#7", 0.0, 50000.0),
        ("aten::mm", 100.0, 50.0),
    ]
    gaps = ts.idle_gaps(kernels, host, min_us=1000.0)
    assert [(g["ms"], g["after_kernel"], g["before_kernel"]) for g in gaps] == [
        (8.0, "ncclDevKernel_ReduceScatter", "_fwd_kernel"),
        (5.0, "ncclDevKernel_AllGather", "nvjet_gemm"),
    ]
    assert gaps[0]["host_ops"] == [["aten::item", 7.0]] and gaps[1]["host_ops"] == []


def test_trace_idle_profile_over_the_span_and_the_host():
    """Idle stretches of at least min_us: their total, split over tenths of the span, and the host
    ops (every nesting level, ProfilerStep left out) that overlapped them, per step."""
    ts = _load("trace_summary")
    kernels = [
        ("a", 0.0, 1000.0),
        ("b", 1010.0, 3990.0),
        ("c", 7000.0, 2000.0),
        ("d", 9500.0, 500.0),
    ]
    # span 10 ms; stretches: [1000, 1010] (10 us, below min_us), [5000, 7000], [9000, 9500]
    host = [
        ("ProfilerStep#1", 0.0, 10000.0),
        ("FSDP::pre_forward", 4500.0, 1000.0),
        ("aten::copy_", 4900.0, 400.0),
        ("Torch-Compiled Region: 1/0", 6000.0, 3200.0),
        ("aten::mm", 100.0, 50.0),
    ]
    got = ts.idle_profile(kernels, host, steps=2, min_us=20.0)
    assert got["idle_ms"] == pytest.approx(1.25)
    assert got["idle_ms_by_tenth"] == pytest.approx([0, 0, 0, 0, 0, 0.5, 0.5, 0, 0, 0.25])
    assert got["host_ops"] == [
        ["Torch-Compiled Region: 1/0", pytest.approx(0.6)],
        ["FSDP::pre_forward", pytest.approx(0.25)],
        ["aten::copy_", pytest.approx(0.15)],
    ]
    assert ts.idle_profile([], host) == {}


def test_trace_host_syncs_by_enclosing_ops():
    """Blocking CUDA runtime calls, per step, under the chain of host ops around them (per
    thread)."""
    ts = _load("trace_summary")
    host = [
        ("ProfilerStep#3", 0.0, 1000.0, 1),
        ("aten::bincount", 10.0, 100.0, 1),
        ("aten::max", 20.0, 50.0, 1),
        ("aten::item", 30.0, 30.0, 1),
        ("cudaStreamSynchronize", 40.0, 15.0, 1),
        ("aten::bincount", 200.0, 100.0, 1),
        ("aten::item", 210.0, 30.0, 1),
        ("cudaStreamSynchronize", 215.0, 5.0, 1),
        ("cudaStreamSynchronize", 400.0, 500.0, 1),  # at step level
        ("cudaLaunchKernel", 500.0, 1.0, 2),  # another thread, not a sync
        ("aten::copy_", 600.0, 50.0, 2),
        ("cudaMemcpy", 610.0, 2.0, 2),
    ]
    got = ts.host_syncs(host, steps=1)
    assert got == [
        {"site": "cudaStreamSynchronize", "calls_per_step": 1, "ms_per_step": pytest.approx(0.5)},
        {
            "site": "aten::bincount > aten::max > aten::item > cudaStreamSynchronize",
            "calls_per_step": 1,
            "ms_per_step": pytest.approx(0.015),
        },
        {
            "site": "aten::bincount > aten::item > cudaStreamSynchronize",
            "calls_per_step": 1,
            "ms_per_step": pytest.approx(0.005),
        },
        {
            "site": "aten::copy_ > cudaMemcpy",
            "calls_per_step": 1,
            "ms_per_step": pytest.approx(0.002),
        },
    ]
    assert ts.host_syncs(host, steps=2)[0]["calls_per_step"] == 0.5


def test_compiled_cells_get_the_longer_warmup():
    e2e = _load("e2e")
    a = e2e.parse_args(["--warmup", "2"])
    assert (e2e.cell_warmup(a, False), e2e.cell_warmup(a, True)) == (2, 4)
    a = e2e.parse_args(["--warmup", "5", "--warmup-compiled", "3"])
    assert (e2e.cell_warmup(a, False), e2e.cell_warmup(a, True)) == (5, 5)
    cmd = e2e.our_command(e2e.parse_args(["--steps", "3"]), 4096, True, "selective", "/tmp/x")
    assert cmd[cmd.index("--training.steps") + 1] == "7"


def _fake_runs(e2e, monkeypatch, fake_peer, ours_speed: float) -> None:
    """e2e.main with ``fake_peer`` for the peer's runs and ours at a fixed speed, no subprocesses,
    no $OUT."""

    def fake_ours(a, runner, seq_len, compile_on, ac, name):
        return {
            "status": "ok",
            "tokens_per_s": ours_speed,
            "tokens_per_step": seq_len,
            "step_s_median": seq_len / ours_speed,
            "mfu_pct": 1.0,
            "peak_allocated_gib": 1.0,
            "data_s": 0.0,
            "forward_backward_s": 1.0,
            "optimizer_s": 0.1,
        }

    monkeypatch.setattr(e2e, "run_peer", fake_peer)
    monkeypatch.setattr(e2e, "run_ours", fake_ours)
    monkeypatch.setattr(e2e, "environment", lambda: {"gpu": "cpu"})
    monkeypatch.delenv("OUT", raising=False)


def test_both_peer_paths_per_cell(tmp_path, monkeypatch):
    """--peer-mp fsdp,autocast: one peer run per path (``--mp`` passed on), the first as the cell's
    "peer" (the ratio), the other as "peer_autocast", and ours against the faster as
    "ratio_best_peer"; a failed path is left out of the best. The table gets a column per extra path
    and the best ratio."""
    e2e = _load("e2e")
    speeds = {("fsdp", 4096): 100.0, ("autocast", 4096): 125.0, ("fsdp", 8192): 90.0}
    seen = []

    def fake_peer(a, runner, seq_len, compile_on, ac, name, mp="fsdp"):
        seen.append((name, mp))
        if (mp, seq_len) not in speeds:
            return {"status": "OOM"}
        return {
            "status": "ok",
            "tokens_per_s": speeds[(mp, seq_len)],
            "tokens_per_step": seq_len,
            "step_s_median": seq_len / speeds[(mp, seq_len)],
            "mfu_pct": 1.0,
            "peak_allocated_gib": 1.0,
        }

    _fake_runs(e2e, monkeypatch, fake_peer, ours_speed=110.0)
    out = tmp_path / "e2e.json"
    assert (
        e2e.main(
            [
                "--seq-lens",
                "4096,8192",
                "--peer-mp",
                "fsdp,autocast",
                "--peer-oom-ac",
                "off",
                "--out",
                str(out),
                "--logs",
                str(tmp_path / "logs"),
            ]
        )
        == 0
    )
    assert [mp for _, mp in seen] == ["fsdp", "autocast"] * 2
    assert [name.split("_s")[0] for name, _ in seen] == ["peer", "peer_autocast"] * 2
    report = json.loads(out.read_text())
    a, b = report["cells"]
    assert a["ratio"] == pytest.approx(1.1) and a["ratio_best_peer"] == pytest.approx(110 / 125)
    assert a["peer_autocast"]["tokens_per_s"] == 125.0 and report["meta"]["peer_mp"] == [
        "fsdp",
        "autocast",
    ]
    assert b["peer_autocast"]["status"] == "OOM" and b["ratio_best_peer"] == pytest.approx(110 / 90)
    head, rows = e2e.table_rows(report["cells"])
    assert head[-2:] == ["peer autocast tok/s", "ratio vs best peer"]
    assert rows[0][-2:] == ["125", "0.88"] and rows[1][-2:] == ["OOM", "1.22"]
    assert "peer mixed-precision paths: fsdp, autocast" in (tmp_path / "e2e.md").read_text()
    # the peer's one-device path only on one GPU; one run per path
    for bad in (["--peer-mp", "autocast", "--nproc", "2"], ["--peer-mp", "fsdp,fsdp"]):
        with pytest.raises(SystemExit):
            e2e.parse_args(bad)


def test_peer_out_of_memory_runs_again_with_full_ac(tmp_path, monkeypatch):
    """--peer-oom-ac full (the default): a peer run that runs out of memory at the cell's AC mode
    runs once more with AC full, the cell's ratio is against that run and the table marks it; no
    second run when the cell is at AC full already, when the failure is not an OOM, or with
    --peer-oom-ac off."""
    e2e = _load("e2e")
    seen = []

    def fake_peer(a, runner, seq_len, compile_on, ac, name, mp="fsdp"):
        seen.append((seq_len, ac, name))
        if seq_len == 8192:
            return {"status": "error"}
        if ac != "full":
            return {"status": "OOM"}
        return {
            "status": "ok",
            "ac": ac,
            "tokens_per_s": 50.0,
            "tokens_per_step": seq_len,
            "step_s_median": seq_len / 50.0,
            "mfu_pct": 1.0,
            "peak_allocated_gib": 1.0,
        }

    _fake_runs(e2e, monkeypatch, fake_peer, ours_speed=100.0)
    out = tmp_path / "e2e.json"
    assert (
        e2e.main(
            [
                "--seq-lens",
                "4096,8192",
                "--ac",
                "none,full",
                "--out",
                str(out),
                "--logs",
                str(tmp_path / "logs"),
            ]
        )
        == 0
    )
    assert [(s, ac) for s, ac, _ in seen] == [
        (4096, "none"),
        (4096, "full"),
        (8192, "none"),
        (4096, "full"),
        (8192, "full"),
    ]
    assert seen[1][2].endswith("_acfull")
    report = json.loads(out.read_text())
    none4k, none8k, full4k, full8k = report["cells"]
    assert none4k["peer"]["oom_at_ac"] == "none" and none4k["peer"]["ac"] == "full"
    assert none4k["ratio"] == pytest.approx(2.0) and "oom_at_ac" not in full4k["peer"]
    assert (
        none8k["peer"]["status"] == "error"
        and "ratio" not in none8k
        and full8k["peer"]["status"] == "error"
    )
    head, rows = e2e.table_rows(report["cells"])
    col = head.index("peer tok/s")
    assert [r[col] for r in rows] == ["50 (AC full)", "error", "50", "error"]
    assert "--peer-oom-ac full" in (tmp_path / "e2e.md").read_text()
    seen.clear()
    assert (
        e2e.main(
            [
                "--seq-lens",
                "4096",
                "--ac",
                "none",
                "--peer-oom-ac",
                "off",
                "--out",
                str(out),
                "--logs",
                str(tmp_path / "logs"),
            ]
        )
        == 0
    )
    assert [(s, ac) for s, ac, _ in seen] == [(4096, "none")]
    assert json.loads(out.read_text())["cells"][0]["peer"]["status"] == "OOM"


def _train_args(cmd: list[str]) -> list[str]:
    return cmd[cmd.index("train.py") + 1 :]


def test_real_mode_trains_mtp_and_the_indexer_kl(monkeypatch):
    """--real-mode: ours' train.py arguments turn MTP and the sparse stage's indexer KL on (0.01)
    before --our-args, which can override the coefficient, and 64K joins the default seq lens."""
    from titan_glm52.config import parse_job_config

    e2e = _load("e2e")
    monkeypatch.chdir(ROOT)  # the job config's path in the command is relative to the repository
    plain = e2e.parse_args([])
    assert plain.seq_lens == [4096, 16384, 32768] and not plain.real_mode
    assert e2e.real_mode_args(plain) == [] and e2e.our_indexer_kl(plain) is None
    cfg = parse_job_config(_train_args(e2e.our_command(plain, 4096, False, "full", "/tmp/x")))
    assert cfg.dsa.indexer_loss_coeff == 0.0  # the proxy config's own
    real = e2e.parse_args(["--real-mode"])
    assert real.seq_lens == [4096, 16384, 32768, 65536] and real.our_mtp == "on"
    cfg = parse_job_config(_train_args(e2e.our_command(real, 65536, False, "full", "/tmp/x")))
    assert cfg.mtp.enable and cfg.dsa.mode == "sparse" and cfg.dsa.indexer_loss_coeff == 0.01
    assert e2e.our_indexer_kl(real) == 0.01
    assert e2e.parse_args(["--real-mode", "--seq-lens", "8192"]).seq_lens == [8192]
    override = e2e.parse_args(["--real-mode", "--our-args=--dsa.indexer_loss_coeff 0.1"])
    cmd = e2e.our_command(override, 4096, False, "full", "/tmp/x")
    assert cmd[-2:] == ["--dsa.indexer_loss_coeff", "0.1"]
    assert parse_job_config(_train_args(cmd)).dsa.indexer_loss_coeff == 0.1
    assert e2e.our_indexer_kl(override) == 0.1
    with pytest.raises(SystemExit):
        e2e.parse_args(["--real-mode", "--our-mtp", "off"])


@pytest.mark.parametrize("real_mode", [False, True])
def test_real_mode_in_the_notes_and_meta(tmp_path, monkeypatch, real_mode):
    """The JSON meta records real_mode and the coefficient; the markdown notes say the real mode ran
    and give ours' MFU formula with the MTP and indexer KL terms, only then."""
    e2e = _load("e2e")

    def fake_peer(a, runner, seq_len, compile_on, ac, name, mp="fsdp"):
        return {"status": "error"}

    _fake_runs(e2e, monkeypatch, fake_peer, ours_speed=100.0)
    out = tmp_path / "e2e.json"
    argv = ["--seq-lens", "4096", "--out", str(out), "--logs", str(tmp_path / "logs")]
    assert e2e.main(argv + (["--real-mode"] if real_mode else [])) == 0
    meta = json.loads(out.read_text())["meta"]
    assert meta["real_mode"] is real_mode
    assert meta["our_indexer_loss_coeff"] == (0.01 if real_mode else None)
    md = (tmp_path / "e2e.md").read_text()
    notes = (
        "ours ran in the real mode (`--real-mode`): MTP on, the DSA sparse stage with the indexer "
        "KL loss at coefficient 0.01",
        "(L_I + 1) H_I (D_I + 1) (P_vis + P_sel)",
        "MTP's eh_proj 2D x D, its MoE layer and the head once more",
    )
    assert all((n in md) is real_mode for n in notes)


def test_peer_float8_on_cpu(tmp_path):
    """The peer with ``--float8 rowwise`` on CPU: torchtitan's linear float8 converter through its
    emulate option (compile off), the tiny model's linears with dims of multiples of 16 in float8
    but the head and the router gates; the grouped-mm converter refuses below sm89, so the routed
    experts are not in float8 and the JSON says why. With compile on it is refused in one line."""
    pytest.importorskip("torchtitan.models.deepseek_v3")
    pytest.importorskip("torchao.float8")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    base = [sys.executable, "bench/e2e_tt_dsv3.py", "--tiny", "--device", "cpu", "--seq-len", "64"]
    base += ["--steps", "2", "--warmup", "1", "--float8", "rowwise"]
    out = tmp_path / "peer.json"
    proc = subprocess.run(
        base + ["--out", str(out)],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    peer = json.loads(out.read_text())
    f8 = peer["float8"]
    # 3 layers x (wq_a, wq_b, wkv_b, wo) + the dense MLP's 3 + 2 x the shared experts' 3; kept: the
    # 3 wkv_a (64 -> 40), the 2 router gates and the head
    assert (f8["recipe"], f8["linears"], f8["linears_kept"]) == ("rowwise", 21, 6)
    assert f8["filter_fqns"] == ["output", "router.gate"] and f8["emulate"] is True
    assert f8["grouped_experts"] is False and "SM89" in f8["why_not"]
    assert peer["status"] == "ok" and all(r["loss"] == r["loss"] for r in peer["records"])
    proc = subprocess.run(
        base + ["--compile", "on", "--out", str(out)],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    failed = json.loads(out.read_text())
    assert proc.returncode == 1 and failed["status"] == "error"
    assert "only with --compile off" in failed["error"] and "\n" not in failed["error"]


def test_float8_peer_in_the_notes(tmp_path, monkeypatch):
    """``--peer-args=--float8 rowwise`` reaches the peer's command line; the markdown notes get one
    line on what the peer ran in float8 (read from the peer JSON's "float8"), none without it."""
    e2e = _load("e2e")
    a = e2e.parse_args(["--peer-args=--float8 rowwise"])
    assert shlex.split(a.peer_args) == ["--float8", "rowwise"]
    f8 = {
        "recipe": "rowwise",
        "linears": 32,
        "linears_kept": 4,
        "filter_fqns": ["output", "router.gate"],
        "emulate": False,
        "fsdp_float8_all_gather": False,
        "grouped_experts": False,
        "why_not": "ImportError: no MoETrainingConfig",
    }

    def fake_peer(a, runner, seq_len, compile_on, ac, name, mp="fsdp"):
        return {
            "status": "ok",
            "tokens_per_s": 100.0,
            "tokens_per_step": seq_len,
            "step_s_median": seq_len / 100.0,
            "mfu_pct": 1.0,
            "peak_allocated_gib": 1.0,
            "float8": f8 if "--float8" in a.peer_args else None,
        }

    _fake_runs(e2e, monkeypatch, fake_peer, ours_speed=100.0)
    out = tmp_path / "e2e.json"
    argv = ["--seq-lens", "4096,8192", "--out", str(out), "--logs", str(tmp_path / "logs")]
    assert e2e.main(argv + ["--peer-args=--float8 rowwise"]) == 0
    md = (tmp_path / "e2e.md").read_text().splitlines()
    notes = [ln for ln in md if ln.startswith("- peer in float8")]
    assert notes == [
        (
            "- peer in float8 (`--float8 rowwise`, torchtitan's float8 converters): 32 linears in "
            "float8, 4 kept (filter_fqns output, router.gate); the routed experts' grouped GEMMs "
            "not in float8: ImportError: no MoETrainingConfig."
        )
    ]
    assert e2e.main(argv) == 0
    assert "- peer in float8" not in (tmp_path / "e2e.md").read_text()
    # the two runs' outcomes differ: one line each
    f8_seen = []

    def fake_peer_two(a, runner, seq_len, compile_on, ac, name, mp="fsdp"):
        f8_seen.append(dict(f8, linears=30 if seq_len == 8192 else 32))
        return {**fake_peer(a, runner, seq_len, compile_on, ac, name, mp), "float8": f8_seen[-1]}

    monkeypatch.setattr(e2e, "run_peer", fake_peer_two)
    assert e2e.main(argv + ["--peer-args=--float8 rowwise"]) == 0
    md = (tmp_path / "e2e.md").read_text().splitlines()
    assert len([ln for ln in md if ln.startswith("- peer in float8")]) == 2


def test_host_time_runs_on_cpu(tmp_path):
    """bench/host_time.py's CPU rows (the registered ops, their implementations called directly and
    as a ``torch.library.custom_op``, whole products in bf16 and FP8, a backward through the engine
    and its formula called directly, calls from a second thread) and its profile table run and are
    written out."""
    host_time = _load("host_time")
    out = tmp_path / "host_time.json"
    result = host_time.main(["--device", "cpu", "--calls", "2", "--out", str(out), "--profile"])
    assert json.loads(out.read_text()) == result
    rows = result["rows"]
    assert "fp8_mm implementation as a custom_op" in rows
    assert "fp8_mm_input_grad implementation directly, from a second thread" in rows
    for what in ("fp8 linear", "bf16 expert_mm, one expert"):
        assert any(k.startswith(what) and "backward alone (autograd)" in k for k in rows)
        assert any(k.startswith(what) and "formula" in k and "directly" in k for k in rows)
    assert all(r["host_us"] > 0 and r["synced_us"] > 0 for r in rows.values())
    assert "titan_glm52::fp8_mm_input_grad" in result["profile"]
