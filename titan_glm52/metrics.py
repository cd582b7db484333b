"""Training metrics: the DSA-aware FLOP count behind MFU, and the console + TensorBoard logger.

FLOPs of one training step (forward x 3: backward costs twice the forward; recomputation is not counted):

    forward = 2 * N_active * tokens                                   (every matmul with a weight)
            + sum over attention layers of 2 * H * (D_qk + D_v) * P_sparse        (sparse MLA core)
            + sum over full-indexer layers of 2 * H_I * D_I * P_causal            (indexer scores)

* ``N_active``: parameters touched per token: attention projections, indexers of the full layers only, dense
  MLPs, router + top-k routed + shared experts, final norm, output head; plus, with MTP, the MTP layer's and
  ``eh_proj`` and the head once more. The embedding lookup is not a matmul and is excluded.
* The sparse core runs in the absorbed form: ``D_qk = kv_lora_rank + qk_rope_head_dim`` (576) and
  ``D_v = kv_lora_rank`` (512); the up-projections around it are weights, counted in ``N_active``.
* ``P_sparse = sum over documents of sum_p min(index_topk, p + 1)``: each query attends to at most top-k of its
  visible keys; ``P_causal = sum over documents of L (L + 1) / 2``: the indexer scores every visible key.
  In dense mode (DSA warm-up) ``P_sparse`` is replaced by ``P_causal``.
* Dense prefix (``[dsa] dense_prefix``): on every attention layer, the first ``index_topk`` rows of each document of
  at least ``index_topk`` tokens (``P_prefix = index_topk (index_topk + 1) / 2`` pairs per such document) run in
  the plain form instead: ``2 * H * (qk_head_dim + v_head_dim)`` per pair (256 + 256 for GLM-5.2), plus their
  keys' up-projection ``2 * kv_lora_rank * H * (qk_nope_head_dim + v_head_dim)`` per row. The absorbed-form work
  those rows still do and discard (and, on layers that train their indexer, the gradient-free sparse forward
  that gives the KL their log-sum-exp) is not counted.
* Masked dense (``[dsa] dense_masked_ratio``): a document of ``index_topk < L <= ratio * index_topk`` tokens runs its
  later rows in the plain form too, counted per selected pair (``index_topk`` per row; the masked-out pairs the
  kernel also visits are not counted), plus the up-projection of all its ``L`` keys.

Per device: a data-parallel rank's tokens and FLOPs are divided by the devices that share them (its pipeline
stages), as torchtitan does; MFU = FLOPs per device / step time / bf16 peak.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time

import torch

from titan_glm52.model.args import GLM52ModelArgs

logger = logging.getLogger("titan_glm52")

# Dense bf16 tensor-core peaks (FLOP/s) by device-name fragment.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "B200": 2250e12, "GB200": 2500e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16.items():
        if key in name:
            return value
    return None


def _pairs(doc_lengths: torch.Tensor, k: int | None) -> int:
    lengths = doc_lengths.to(torch.int64)
    causal = lengths * (lengths + 1) // 2
    if k is None:
        return int(causal.sum())
    capped = torch.where(lengths <= k, causal, k * (k + 1) // 2 + (lengths - k) * k)
    return int(capped.sum())


def step_flops(args: GLM52ModelArgs, doc_lengths: torch.Tensor, with_mtp: bool, sparse: bool = True,
               dense_prefix: bool = False, dense_masked_ratio: float = 0.0) -> float:
    """Training FLOPs (forward + backward) for the given documents (their lengths sum to the token count).
    ``dense_prefix``: the model runs with ``[dsa] dense_prefix``; ``dense_masked_ratio``: with its
    ``[dsa] dense_masked_ratio`` (0 = off)."""
    tokens = int(doc_lengths.sum())
    n_active = args.num_active_params(include_mtp=False, include_head=True)
    attn_layers = args.num_hidden_layers
    index_layers = len(args.index_share.full_layers)
    if with_mtp:
        n_active += args._mtp_params(active=True) + args.vocab_size * args.hidden_size
        attn_layers += 1
        index_layers += 1
    p_sparse = _pairs(doc_lengths, args.index_topk if sparse else None)
    p_causal = _pairs(doc_lengths, None)
    d_qk, d_v = args.kv_lora_rank + args.qk_rope_head_dim, args.kv_lora_rank
    h = args.num_attention_heads
    forward = (2 * n_active * tokens
               + attn_layers * 2 * h * (d_qk + d_v) * p_sparse
               + index_layers * 2 * args.index_n_heads * args.index_head_dim * p_causal)
    if dense_prefix and sparse:
        k = args.index_topk
        lengths = doc_lengths.to(torch.int64)
        docs = int((lengths >= k).sum())
        # per selected pair, the plain form's work over the absorbed form's; per key, its up-projection
        extra = 2 * h * (args.qk_head_dim + args.v_head_dim) - 2 * h * (d_qk + d_v)
        up = 2 * args.kv_lora_rank * h * (args.qk_nope_head_dim + args.v_head_dim)
        forward += attn_layers * docs * (extra * (k * (k + 1) // 2) + up * k)
        if dense_masked_ratio > 0:
            short = lengths[(lengths > k) & (lengths <= int(dense_masked_ratio * k))]
            forward += attn_layers * int((extra * k * (short - k) + up * short).sum())
    return 3.0 * forward


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak memory in GiB since the last reset (device memory on CUDA, process RSS on CPU)."""
    if device.type == "cuda":
        return {"memory/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30,
                "memory/peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2 ** 30}
    return {"memory/peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


class MetricsLogger:
    """One console line per log step, TensorBoard scalars (``tb_folder``) and the same scalars as JSON lines
    (``jsonl_path``, one object per log step); written by one rank only."""

    def __init__(self, tb_folder: str | None, jsonl_path: str | None, enabled: bool) -> None:
        self.writer = None
        self.jsonl = None
        self.enabled = enabled
        if enabled and tb_folder:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(tb_folder, exist_ok=True)
            self.writer = SummaryWriter(tb_folder)
        if enabled and jsonl_path:
            os.makedirs(os.path.dirname(jsonl_path) or ".", exist_ok=True)
            self.jsonl = open(jsonl_path, "a")

    def log(self, step: int, scalars: dict[str, float], line: str) -> None:
        if not self.enabled:
            return
        logger.info(line)
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
            self.jsonl.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()


def format_line(step: int, total_steps: int, s: dict[str, float], eta_s: float) -> str:
    parts = [f"step {step:>5}/{total_steps}", f"loss {s['loss/total']:.4f}"]
    for key, short in (("loss/ce", "ce"), ("loss/mtp", "mtp"), ("loss/indexer_kl", "kl"), ("loss/moe_aux", "aux")):
        if key in s:
            parts.append(f"{short} {s[key]:.4f}")
    parts += [f"lr {s['lr']:.2e}", f"gnorm {s['grad_norm']:.3f}", f"tok/s/gpu {s['throughput/tokens_per_s_per_device']:.0f}"]
    if "throughput/mfu_pct" in s:
        parts.append(f"mfu {s['throughput/mfu_pct']:.1f}%")
    mem = s.get("memory/peak_allocated_gib", s.get("memory/peak_rss_gib"))
    if mem is not None:
        parts.append(f"mem {mem:.2f}GiB")
    if s.get("faults/skipped_steps", 0):
        parts.append(f"skipped {int(s['faults/skipped_steps'])}")
    parts.append(f"eta {time.strftime('%H:%M:%S', time.gmtime(max(eta_s, 0)))}")
    return "  ".join(parts)
