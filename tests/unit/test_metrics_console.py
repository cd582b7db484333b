"""The console line and the memory counters of ``titan_glm52/metrics.py`` (the FLOP count behind
MFU: test_metrics.py)."""

import torch

from titan_glm52 import metrics

LINE = {
    "loss/total": 2.5,
    "lr": 1e-4,
    "grad_norm": 0.5,
    "throughput/tokens_per_s_per_device": 1000.0,
    "memory/peak_allocated_gib": 3.0,
}


def test_memory_stats_on_cuda_counts_allocator_retries(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 4 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda d: {"num_alloc_retries": 5})
    assert metrics.memory_stats(torch.device("cuda", 0)) == {
        "memory/peak_allocated_gib": 3.0,
        "memory/peak_reserved_gib": 4.0,
        "memory/alloc_retries": 5.0,
    }
    assert list(metrics.memory_stats(torch.device("cpu"))) == ["memory/peak_rss_gib"]


def test_console_line_names_allocator_retries_only_when_there_are_some():
    quiet = metrics.format_line(3, 10, {**LINE, "memory/alloc_retries": 0.0}, 60.0)
    assert "retries" not in quiet and "mem 3.00GiB" in quiet
    loud = metrics.format_line(3, 10, {**LINE, "memory/alloc_retries": 2.0}, 60.0)
    assert "alloc retries 2" in loud
