"""Tests for titan_glm52/memory_plan.py and ``python -m titan_glm52.plan memory``.

Every case runs in this process over a fake process group (no communication); the debug cases take well under a
second each, the 744B config check a few seconds.
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from tests.unit.test_plan import _main
import torch.distributed as dist

from titan_glm52 import plan
from titan_glm52.memory_plan import GIB, MemoryRequest, plan_memory, request_from_job_config
from titan_glm52.model.args import _debug_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_744B = os.path.join(REPO, "train_configs", "glm52_744b.toml")




# ----------------------------------------------------------------------------------------- independent counts
def _stage_counts(args, layers: range, first: bool, last: bool, with_mtp: bool) -> tuple[int, int]:
    """(dense elements, routed-expert elements) of one stage, from the args' arithmetic (not from modules)."""
    d, v = args.hidden_size, args.vocab_size
    routed = args.n_routed_experts * 3 * d * args.moe_intermediate_size
    sched = args.index_share
    dense = experts = 0
    for i in layers:
        total = args._layer_params(i, sched.is_full(i), active=False)
        if args.is_moe_layer(i):
            dense, experts = dense + total - routed, experts + routed
        else:
            dense += total
    if first:
        dense += v * d
    if last:
        dense += d + v * d
        if with_mtp:
            dense += args._mtp_params(active=False) - routed
            experts += routed
    return dense, experts


def test_debug_bytes_per_rank_match_an_independent_count():
    args = _debug_args()
    req = MemoryRequest(args=args, gpus=8, pp=2, ep=2, seq_len=64, local_batch_size=4, microbatch_size=1,
                        ac_mode="full")
    report = plan_memory(req)
    assert not dist.is_initialized()  # the fake world is torn down
    assert (report.dp_shard, report.efsdp, report.n_microbatches, report.tokens_per_microbatch) == (4, 2, 4, 64)
    assert [r.rank for r in report.ranks] == [0, 4] and [r.stages for r in report.ranks] == [(0,), (1,)]
    total_local = 0
    for r in report.ranks:
        (layers,) = r.layers
        first, last = r.stages[0] == 0, r.stages[0] == 1
        dense, experts = _stage_counts(args, layers, first, last, with_mtp=True)
        # Debug widths divide evenly: no FSDP padding. Dense weights shard over dp_shard (4); routed experts over
        # ep (2) x efsdp (2).
        assert dense % 4 == 0 and experts % 4 == 0
        local = dense // 4 + experts // 4
        assert r.local_params == r.trainable_params == local
        assert r.params == 4 * local and r.grads == 4 * local and r.optimizer == 8 * local
        # Pipelined: every unit stays unsharded (bf16) and keeps an fp32 unsharded gradient.
        unsharded = dense + experts // 2  # EP still splits the experts; efsdp gathers its 2 shards
        assert r.unsharded == 2 * unsharded and r.grad_accum == 4 * unsharded
        total_local += local
    assert total_local * 4 == args.num_params(include_mtp=True)  # 4 = ranks per pipeline rank


def test_debug_activations_follow_the_stated_formula():
    """AC full: per micro-batch token a*D per block + 4K per full block + the stage boundary; 1F1B in flight."""
    args = _debug_args()
    req = MemoryRequest(args=args, gpus=8, pp=2, ep=2, seq_len=64, local_batch_size=4, ac_mode="full")
    report = plan_memory(req)
    a, d, k, v = 2, args.hidden_size, args.index_topk, args.vocab_size
    sched = args.index_share
    for r in report.ranks:
        (layers,) = r.layers
        first, last = r.stages[0] == 0, r.stages[0] == 1
        blocks = list(layers) + ([args.num_hidden_layers] if last else [])
        per_token = sum(a * d + (4 * k if i >= args.num_hidden_layers or sched.is_full(i) else 0) for i in blocks)
        per_token += 8 + a * d  # positions, next-token embeddings (MTP)
        per_token += 8 if first else 0
        per_token += a * d if not last else 2 * a * d + 4 + 6 * a * d + 8
        in_flight = min(4, 2 - r.stages[0])  # 1F1B: pp - stage
        assert r.in_flight == in_flight
        assert r.activations == pytest.approx(in_flight * 64 * per_token)
        # no logits are kept: the last stage's loss runs the head in chunks, one chunk (64 tokens here) transient
        assert r.transient >= (64 * v * (a + 8) if last else 0.0)
        parts = r.params + r.grads + r.optimizer + r.unsharded + r.grad_accum + r.activations + r.transient
        assert r.total == pytest.approx(parts)
    # AC none keeps far more than AC full; selective in between.
    totals = {}
    for mode in ("none", "selective", "full"):
        rep = plan_memory(MemoryRequest(args=args, gpus=8, pp=2, ep=2, seq_len=64, local_batch_size=4, ac_mode=mode))
        totals[mode] = rep.ranks[0].activations
    assert totals["none"] > totals["selective"] > totals["full"]


def test_interleaved_in_flight_matches_torch_warmup():
    """The replayed Interleaved1F1B schedule holds warmup + 1 chunks at its peak (torch's _get_warmup_ops)."""
    args = _debug_args()
    pp, v, n_mb = 2, 2, 4
    report = plan_memory(MemoryRequest(args=args, gpus=8, pp=pp, ep=2, dp_replicate=2, schedule="Interleaved1F1B",
                                       seq_len=32, local_batch_size=n_mb, ac_mode="full"))
    assert [r.stages for r in report.ranks] == [(0, 2), (1, 3)]
    for r in report.ranks:
        warmup = min((v - 1) * pp + 2 * (pp - 1 - r.pp_rank), n_mb * v)
        assert r.in_flight == warmup + 1


def test_no_pipeline_keeps_two_units_and_no_gradient_accumulation():
    args = _debug_args()
    report = plan_memory(MemoryRequest(args=args, gpus=4, ep=2, seq_len=64, local_batch_size=2, ac_mode="full"))
    (r,) = report.ranks
    assert r.grad_accum == 0 and r.in_flight == 1 and report.tokens_per_microbatch == 128
    assert r.local_params * 4 == args.num_params(include_mtp=True)
    assert 0 < r.unsharded < 2 * args.num_params(include_mtp=True)


# ----------------------------------------------------------------------------------------- CLI
def test_cli_exit_codes_and_layout_line(capsys):
    base = ["memory", "--flavor", "debug", "--gpus", "8", "--pp", "2", "--ep", "2", "--seq-len", "64",
            "--local-batch-size", "4"]
    rc, out, err = _main(capsys, *base)
    assert rc == 0, err
    assert "result: every rank fits" in out
    rc_layout, out_layout, _ = _main(capsys, "layout", "--flavor", "debug", "--pp", "2", "--seq-len", "64")
    layout_line = [ln for ln in out_layout.splitlines() if ln.startswith("layers per stage:")]
    assert rc_layout == 0 and layout_line and layout_line[0] in out.splitlines()
    rc, out, err = _main(capsys, *base, "--gpu-memory-gib", "0.001")
    assert rc == 2 and "DOES NOT FIT" in out
    rc, out, err = _main(capsys, *base, "--ep", "3")
    assert rc == 1 and "must divide" in err and out == ""


def test_cli_refuses_an_invalid_layout_like_layout(capsys):
    argv = ["--flavor", "glm52_744b", "--pp", "4", "--layers-per-stage", "20,20,20,18"]
    rc_l, out_l, err_l = _main(capsys, "layout", *argv)
    rc_m, out_m, err_m = _main(capsys, "memory", "--gpus", "256", "--ep", "32", *argv)
    assert rc_l == rc_m == 1 and out_m == ""
    assert err_m == err_l
    assert "stage 1 starts at layer 20, a shared layer (source layer 18)" in err_m
    assert err_m.rstrip().endswith("Nearest valid layout: 18,20,20,20")


def test_an_existing_process_group_is_refused():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(ValueError, match="already has a default process group"):
            plan_memory(MemoryRequest(args=_debug_args(), gpus=2))
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------- the 744B config
def test_744b_config_fits_h200_and_matches_its_comment():
    from titan_glm52.config import parse_job_config

    cfg = parse_job_config(["--job.config_file", CONFIG_744B])
    req = request_from_job_config(cfg)
    assert (req.gpus, req.pp, req.ep, req.ac_mode, req.param_dtype) == (256, 8, 32, "full", "bf16")
    report = plan_memory(req)
    assert report.fits
    assert report.worst.total < 0.8 * req.budget_bytes  # a margin, not a squeeze
    # The TOML comment quotes the tool's table: the same totals, in pipeline-rank order.
    with open(CONFIG_744B) as f:
        text = f.read()
    rows = re.findall(r"^#\s+(\d)\s+\d+\s+\d\s+[\d-]+\s+((?:[\d.]+\s+){8})\d+\s+yes$", text, re.M)
    assert [int(pp) for pp, _ in rows] == list(range(8))
    quoted = [float(values.split()[-1]) for _, values in rows]
    assert quoted == [round(r.total / GIB, 2) for r in report.ranks]
    # The quoted command gives the same request as the TOML.
    cmd = re.search(r"python -m titan_glm52\.plan (memory .*?)\n#\s+printed", text, re.S).group(1)
    argv = [tok for tok in cmd.replace("\\\n#", " ").split() if tok]
    ns = plan.build_parser().parse_args(argv)
    from_cli = dataclasses.replace(plan.memory_request(ns, req.args), dp_shard=32)  # the command leaves it -1
    assert from_cli == dataclasses.replace(req, selective_ac_option="op")  # unused with AC full


def test_too_small_gpu_does_not_fit():
    from titan_glm52.config import parse_job_config

    cfg = parse_job_config(["--job.config_file", CONFIG_744B])
    report = plan_memory(request_from_job_config(cfg, gpu_memory_gib=80.0))  # an 80 GB card
    assert not report.fits
    assert {r.pp_rank for r in report.ranks if r.total > report.budget} >= {3, 4, 5, 6}
