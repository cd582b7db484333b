"""The peer of bench/e2e.py: torchtitan 0.2.2's own DeepSeek-V3 model, at our proxy's widths,
trained on one device or on the N GPUs of one host (under torchrun, FSDP or EP + FSDP).

    python3 bench/e2e_tt_dsv3.py --seq-len 4096 --ac selective --steps 4 --warmup 2 --out cell.json
    torchrun --standalone --nproc_per_node 2 bench/e2e_tt_dsv3.py --dp-shard 2 [--ep 2] ...
    python3 bench/e2e_tt_dsv3.py --float8 rowwise ...    # + torchtitan's float8 training converters

What runs (every piece is torchtitan 0.2.2's, used as a library; only this loop is ours):

* model: ``torchtitan.models.deepseek_v3.DeepSeekV3Model`` with ``DeepSeekV3ModelArgs`` = the
  ``glm52_proxy``
  widths: hidden 6144, 64 heads, MLA q_lora 2048 / kv_lora 512, qk_nope 192 + qk_rope 64, v 256,
  vocab 154,880, 4 layers (1 dense, inter 12,288; 3 MoE), ``MoEArgs`` 16 experts top-8 + 1 shared,
  moe_inter 2048, sigmoid scores, route_norm, route_scale 2.5, score after the experts (DeepSeek-V3
  671B's settings), aux-loss-free bias (load_balance_coeff 1e-3), ``GroupedExperts`` with
  use_grouped_mm (``torch._grouped_mm`` + torchtitan's Triton permute/pad kernel); attention
  ``attn_type="sdpa"`` with ``attn_mask_type="causal"`` (torchtitan's
  ``ScaledDotProductAttentionWrapper``: cuDNN > flash > math, is_causal); no MTP (0.2.2 has none).
  The RoPE table is plain (original_seq_len = seq_len: no YaRN rescaling).
* parallelisms: ``parallelize_deepseekv3`` (its AC -> per-block compile; with one rank it applies no
  FSDP), then ``torchtitan.models.llama4.infra.parallelize.apply_fsdp`` on a 1-rank mesh with
  ``MixedPrecisionPolicy(bf16, fp32)``: bf16 compute, fp32 master weights and gradients (our
  trainer's "fsdp" master weights on one GPU). ``--mp autocast``: torchtitan's own one-device path
  instead, ``maybe_enable_amp`` (``torch.autocast`` bf16 over fp32 parameters and gradients; no
  FSDP). Under torchrun with WORLD_SIZE = N > 1: ``ParallelDims(dp_shard=N, ep=E, world_size=N)``
  (``--dp-shard N``, ``--ep E``; dp_replicate = cp = tp = pp = etp = 1), its ``build_mesh``, and
  ``parallelize_deepseekv3`` applies EP (E > 1: routed experts sharded over the "ep" mesh, token
  all-to-all) and FSDP itself (dense parameters over "fsdp", routed experts over "efsdp" = N / E),
  with ``training.mixed_precision_param`` bf16 / reduce fp32, as torchtitan's trainer does. As
  there, FSDP's gradient division is off and the loss is the local sum / the global token count;
  clip_grad_norm_ gets ``ep_enabled``. Each rank draws its own random tokens (a generator seeded by
  rank) at the same local batch.
  AC: ``activation_checkpoint.mode`` none / selective (``selective_ac_option`` "2" = checkpoint
  every 2nd block, torchtitan's default and ours; "op" = its per-op SAC with DeepSeek-V3's save
  list) / full.
  Compile: ``compile.components = ["model"]`` (per-block ``torch.compile``, MoE blocks per child as
  torchtitan does; the loss stays eager, as ours).
* float8 (``--float8 rowwise|tensorwise``, default off): torchtitan's own converters from
  ``torchtitan.components.quantization.float8``, as its trainer applies ``--model.converters
  quantize.linear.float8,quantize.grouped_mm.float8 --quantize.linear.float8.recipe_name <recipe>
  --quantize.grouped_mm.float8.fqns experts``: built from the job config and applied to the model
  on meta, before parallelize; their ``post_optimizer_hook`` runs after every optimizer step (a
  step post-hook, as there). ``Float8LinearConverter`` (torchao's ``Float8Linear``, dynamic
  scaling) takes every ``nn.Linear`` whose dims are multiples of 16 but those named in
  ``filter_fqns`` = "output", "router.gate" (DeepSeek-V3's float8 settings): at the proxy's widths
  32 of 36 (each layer's wq_a, wq_b, wkv_a, wkv_b, wo, the dense MLP and the shared experts; the
  head and the 3 router gates stay bf16). FSDP float8 all-gather stays off (torchtitan asserts it
  off with a recipe). ``Float8GroupedMMConverter`` (the routed experts' grouped GEMMs) needs sm89+
  and imports torchao's ``MoETrainingConfig``, which torchao 0.18.0 no longer has: where it
  refuses, the routed experts stay bf16, the token-group alignment it set (16) goes back to 8, and
  the JSON's ``float8`` says so: {"recipe", "linears" (converted), "linears_kept", "filter_fqns",
  "emulate", "fsdp_float8_all_gather", "grouped_experts" (true / false), "why_not"} (null when
  off). Float8 asked for and nothing converted is an error. On CPU (the smoke test, compile off)
  torchtitan's ``emulate`` option lets the linear converter through; the recipe's torchao config
  does not take it, so the float8 matmuls run through CPU ``torch._scaled_mm``.
* optimizer: ``build_optimizers_with_moe_load_balancing`` (AdamW fused, lr 3e-4, betas 0.9/0.95, wd
  0.1, eps 1e-8, plus the expert-bias pre-step hook), grad clipping
  ``torchtitan.distributed.utils.clip_grad_norm_`` at 1.0, loss
  ``torchtitan.components.loss.cross_entropy_loss`` / tokens. Data: uniform random tokens of the
  vocabulary.

FLOPs (forward + backward = 3 x forward), per step of B x S tokens:

    flops       = 6 * N_active * B * S + n_layers * 3 * 2 * H * (d_qk + d_v) * B * S (S + 1) / 2
                (causal)
    flops_tt    = (6 * N_active + 6 * n_layers * H * (d_qk + d_v) * S) * B * S (torchtitan's own:
                full S x S)

``N_active`` is torchtitan's count (``get_moe_model_nparams_and_flops``): every parameter but the
embedding, with the routed experts scaled by top_k / num_experts (the output head included); d_qk =
192 + 64, d_v = 256.

Shims for CPU only (the CPU smoke test): torchtitan's ``parallel_dims.device_type`` is "cuda" when
no GPU is present (set to "cpu"), CPU ``torch.histc`` has no int64 kernel (cast through float), gloo
has no PREMUL_SUM (``set_force_sum_reduction_for_comms``), the experts use the for-loop path (the
Triton permute kernel needs a GPU), and EP's token permutation
(``torchtitan.models.moe.utils._permute``) uses torchtitan's own CPU fill
(``generate_permute_indices(use_cpu=True)``) instead of that Triton kernel. On CUDA nothing is
patched.

Per-GPU numbers: tokens/s = local tokens / rank 0's step time, MFU likewise; peak memory is the max
over ranks. Only rank 0 prints the steps and writes one JSON object to ``--out`` (status "ok" |
"OOM" | "error"); exit code 0 on "ok", 3 on OOM, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "B200": 2250e12}

# The proxy's widths (titan_glm52/model/args.py: glm52_proxy), in DeepSeekV3ModelArgs' names.
PROXY = dict(
    vocab_size=154880,
    dim=6144,
    inter_dim=12288,
    moe_inter_dim=2048,
    n_layers=4,
    n_dense_layers=1,
    n_heads=64,
    q_lora_rank=2048,
    kv_lora_rank=512,
    qk_nope_head_dim=192,
    qk_rope_head_dim=64,
    v_head_dim=256,
    norm_eps=1e-5,
    rope_theta=8e6,
)
PROXY_MOE = dict(num_experts=16, num_shared_experts=1, top_k=8)
# A tiny model with the same structure, for the CPU smoke test.
TINY = dict(
    vocab_size=2048,
    dim=64,
    inter_dim=128,
    moe_inter_dim=32,
    n_layers=3,
    n_dense_layers=1,
    n_heads=4,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=24,
    norm_eps=1e-5,
    rope_theta=1e4,
)
TINY_MOE = dict(num_experts=8, num_shared_experts=1, top_k=3)
# --float8: the linears kept in high precision, as torchtitan's DeepSeek-V3 float8 configs and
# tests filter them (the output head, the routers' gates).
FLOAT8_SKIP = ("output", "router.gate")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1, help="local batch size (sequences per step)")
    p.add_argument("--steps", type=int, default=4, help="timed steps (after the warm-up)")
    p.add_argument(
        "--warmup", type=int, default=2, help="untimed steps first (compile, allocator warm-up)"
    )
    p.add_argument("--ac", choices=("none", "selective", "full"), default="selective")
    p.add_argument(
        "--sac-option", default="2", help="selective_ac_option: 'op' or N (every N-th block)"
    )
    p.add_argument("--compile", choices=("off", "on"), default="off")
    p.add_argument(
        "--sdpa",
        choices=("tt", "flash", "cudnn"),
        default="tt",
        help="SDPA backends: torchtitan's priority (cuDNN > flash > math), or pin flash / cuDNN (+ "
        "math)",
    )
    p.add_argument("--tiny", action="store_true", help="tiny widths (CPU smoke test)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument(
        "--dp-shard", type=int, default=1, help="FSDP degree = the world size (run under torchrun)"
    )
    p.add_argument(
        "--ep", type=int, default=1, help="expert-parallel degree, carved out of --dp-shard"
    )
    p.add_argument(
        "--mp",
        choices=("fsdp", "autocast"),
        default="fsdp",
        help="one rank's mixed precision: FSDP2 on a one-rank mesh (bf16 params, fp32 masters and "
        "gradients) or torchtitan's own single-device path, maybe_enable_amp (torch.autocast bf16 "
        "over fp32 parameters and gradients)",
    )
    p.add_argument(
        "--float8",
        choices=("off", "rowwise", "tensorwise"),
        default="off",
        help="torchtitan's float8 training converters with this recipe (linears; the routed "
        "experts' grouped GEMMs where its converter takes them); needs sm89+, on CPU emulate",
    )
    p.add_argument("--out", default=None, help="JSON result path (default: stdout only)")
    p.add_argument(
        "--trace", default=None, help="also profile one extra step; Chrome trace written here"
    )
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------- CPU shims
def _cpu_shims() -> None:
    import torchtitan.distributed.parallel_dims as pd

    pd.device_type = "cpu"
    if getattr(torch.histc, "_e2e_int_shim", False):
        return
    histc = torch.histc

    def histc_any(input, bins=100, min=0, max=0, *, out=None):  # noqa: A002 - torch's signature
        if input.is_floating_point():
            return histc(input, bins=bins, min=min, max=max, out=out)
        return histc(input.float(), bins=bins, min=min, max=max).to(input.dtype)

    histc_any._e2e_int_shim = True
    torch.histc = histc_any

    # EP's _permute calls generate_permute_indices, whose default path is a Triton kernel;
    # torchtitan ships a CPU fill of the same indices behind use_cpu=True.
    import torchtitan.models.moe.utils as moe_utils

    permute_indices = moe_utils.generate_permute_indices

    def permute_indices_cpu(*args, **kwargs):
        return permute_indices(*args, **kwargs, use_cpu=True)

    moe_utils.generate_permute_indices = permute_indices_cpu


# ---------------------------------------------------------------------------------------------
# pieces
def model_args(seq_len: int, tiny: bool, grouped_mm: bool):
    from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs
    from torchtitan.models.moe import MoEArgs

    dims, moe = (TINY, TINY_MOE) if tiny else (PROXY, PROXY_MOE)
    args = DeepSeekV3ModelArgs(
        **dims,
        max_seq_len=seq_len,
        original_seq_len=seq_len,
        attn_type="sdpa",
        attn_mask_type="causal",
        moe_args=MoEArgs(
            **moe,
            score_func="sigmoid",
            route_norm=True,
            route_scale=2.5,
            score_before_experts=False,
            use_grouped_mm=grouped_mm,
            load_balance_coeff=1e-3,
        ),
    )
    # update_from_config (which we do not call: it wants a whole JobConfig) would set this;
    # TransformerBlock reads it.
    args.moe_impl = "standard"
    return args


def active_params(model: torch.nn.Module, args) -> tuple[int, int]:
    """(total, active) the way torchtitan's get_moe_model_nparams_and_flops counts them (embedding
    excluded from active; routed experts scaled by top_k / num_experts with its integer
    division)."""
    emb = experts = other = 0
    for name, p in model.named_parameters():
        if "embedding" in name:
            emb += p.numel()
        elif "moe.experts" in name:
            experts += p.numel()
        else:
            other += p.numel()
    active = other + experts * args.moe_args.top_k // args.moe_args.num_experts
    return emb + experts + other, active


def step_flops(args, n_active: int, batch: int, seq_len: int) -> tuple[float, float]:
    """(causal, torchtitan's full-attention) training FLOPs of one step."""
    tokens = batch * seq_len
    d_qk, d_v = args.qk_nope_head_dim + args.qk_rope_head_dim, args.v_head_dim
    pairs = batch * seq_len * (seq_len + 1) // 2
    causal = 6 * n_active * tokens + args.n_layers * 3 * 2 * args.n_heads * (d_qk + d_v) * pairs
    tt = (6 * n_active + 6 * args.n_layers * args.n_heads * (d_qk + d_v) * seq_len) * tokens
    return float(causal), float(tt)


def job_config(a: argparse.Namespace, dump_folder: str, on_gpu: bool = True):
    from torchtitan.config import JobConfig

    jc = JobConfig()
    # Read by parallelize_deepseekv3 when it applies FSDP / EP itself (world size > 1).
    jc.parallelism.data_parallel_shard_degree = a.dp_shard
    jc.parallelism.expert_parallel_degree = a.ep
    jc.training.mixed_precision_param = "bfloat16" if on_gpu else "float32"
    jc.training.mixed_precision_reduce = "float32"
    jc.job.dump_folder = dump_folder
    jc.training.seq_len = a.seq_len
    jc.training.local_batch_size = a.batch
    jc.activation_checkpoint.mode = a.ac
    jc.activation_checkpoint.selective_ac_option = a.sac_option
    jc.compile.enable = a.compile == "on"
    jc.compile.components = ["model"]
    jc.optimizer.name, jc.optimizer.lr, jc.optimizer.weight_decay = "AdamW", 3e-4, 0.1
    jc.optimizer.beta1, jc.optimizer.beta2, jc.optimizer.eps = 0.9, 0.95, 1e-8
    jc.optimizer.implementation = "fused"
    return jc


def apply_float8(a: argparse.Namespace, jc, dims, model: torch.nn.Module, on_gpu: bool):
    """torchtitan's float8 converters applied to ``model`` (on meta, before parallelize), as its
    trainer applies ``--model.converters quantize.linear.float8,quantize.grouped_mm.float8
    --quantize.linear.float8.recipe_name <recipe> --quantize.grouped_mm.float8.fqns experts`` with
    DeepSeek-V3's ``filter_fqns`` (FLOAT8_SKIP): each converter built from ``jc`` and applied, in
    that order. The linear converter's refusal (below sm89, or compile with emulate) is the run's
    error. The grouped-mm one may refuse (below sm89; an import its torchao lacks): then the routed
    experts stay in bf16, the token-group alignment it set is put back, and ``why_not`` says why.

    Returns (the applied converters, for their post-optimizer hook; what ran in float8, None when
    off). Raises when float8 was asked for and nothing was converted."""
    if a.float8 == "off":
        return [], None
    if not on_gpu and a.compile == "on":
        raise ValueError(
            f"--float8 {a.float8} on CPU runs torchtitan's emulate path, which it allows only "
            "with --compile off"
        )
    import torchtitan.models.moe.utils as moe_utils
    from torchao.float8.float8_linear import Float8Linear
    from torchtitan.components.quantization.float8 import (
        Float8GroupedMMConverter,
        Float8LinearConverter,
    )

    jc.model.converters = ["quantize.linear.float8", "quantize.grouped_mm.float8"]
    f8 = jc.quantize.linear.float8
    f8.recipe_name, f8.filter_fqns, f8.emulate = a.float8, list(FLOAT8_SKIP), not on_gpu
    jc.quantize.grouped_mm.float8.fqns = ["experts"]
    linear = Float8LinearConverter(jc, dims)
    linear.convert(model)
    applied = [linear]
    info = {
        "recipe": a.float8,
        "linears": sum(isinstance(m, Float8Linear) for m in model.modules()),
        "linears_kept": sum(type(m) is torch.nn.Linear for m in model.modules()),
        "filter_fqns": list(FLOAT8_SKIP),
        "emulate": f8.emulate,
        "fsdp_float8_all_gather": False,
        "grouped_experts": False,
        "why_not": None,
    }
    align = moe_utils.TOKEN_GROUP_ALIGN_SIZE_M
    try:
        grouped = Float8GroupedMMConverter(jc, dims)
        grouped.convert(model)
    except (ValueError, ImportError, AssertionError) as e:
        moe_utils.set_token_group_alignment_size_m(align)
        cause = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else ""
        info["why_not"] = f"{type(e).__name__}: {e}{cause}"[:400]
    else:
        applied.append(grouped)
        # the routed experts' weights swapped for torchao's float8 training tensor subclass
        info["grouped_experts"] = any(
            type(p.data) is not torch.Tensor
            for name, p in model.named_parameters()
            if ".moe.experts." in name
        )
        if not info["grouped_experts"]:
            info["why_not"] = "the grouped-mm converter swapped no routed expert weight"
    if not info["linears"] and not info["grouped_experts"]:
        raise RuntimeError(
            f"--float8 {a.float8}: torchtitan's converters converted nothing ({info['why_not']})"
        )
    print(
        f"[peer] float8 {a.float8}: {info['linears']} linears in float8, "
        f"{info['linears_kept']} kept; routed experts "
        + ("float8" if info["grouped_experts"] else f"not float8 ({info['why_not']})"),
        flush=True,
    )
    return applied, info


def build(a: argparse.Namespace, device: torch.device, dump_folder: str, world_size: int = 1):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, parallelize_deepseekv3
    from torchtitan.models.llama4.infra.parallelize import apply_fsdp

    on_gpu = device.type == "cuda"
    if a.sdpa != "tt":
        from torch.nn.attention import SDPBackend
        from torchtitan.models.attention import ScaledDotProductAttentionWrapper

        first = SDPBackend.FLASH_ATTENTION if a.sdpa == "flash" else SDPBackend.CUDNN_ATTENTION
        # instances take the class list
        ScaledDotProductAttentionWrapper.sdpa_backends = [first, SDPBackend.MATH]
    args = model_args(a.seq_len, a.tiny, grouped_mm=on_gpu)
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    n_total, n_active = active_params(model, args)
    jc = job_config(a, dump_folder, on_gpu)
    dims = ParallelDims(
        dp_replicate=1, dp_shard=a.dp_shard, cp=1, tp=1, pp=1, ep=a.ep, etp=1, world_size=world_size
    )
    mesh_note = None
    if world_size > 1:  # the meshes are needed: a failure is the cell's error
        dims.build_mesh()
    else:
        # the expert-bias hook asks for the "loss" mesh; build them now so a failure shows here
        try:
            dims.build_mesh()
        # noqa: BLE001 - private DeviceMesh APIs differ across torch versions
        except Exception as e:
            # With one rank every optional mesh is None (size 1), which is all torchtitan's code
            # asks here.
            mesh_note = (
                f"ParallelDims.build_mesh failed ({type(e).__name__}: {e}); optional meshes = None"
            )
            print(f"[peer] {mesh_note}", flush=True)
            dims.get_optional_mesh = lambda names: None
    # float8 (when asked) on the model on meta, before parallelize, as torchtitan's trainer
    converters, float8 = apply_float8(a, jc, dims, model, on_gpu)
    # AC, then compile; at one rank no FSDP, else EP (ep > 1) and FSDP over dims' meshes, as
    # torchtitan's trainer
    model = parallelize_deepseekv3(model, dims, jc)
    if world_size == 1 and a.mp == "fsdp":
        mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("fsdp",))
        apply_fsdp(
            model,
            mesh,
            param_dtype=torch.bfloat16 if on_gpu else torch.float32,
            reduce_dtype=torch.float32,
            pp_enabled=False,
            reshard_after_forward_policy="default",
            ep_degree=1,
        )
    # gloo has no PREMUL_SUM (torchtitan sets the divide factor to 1); a plain sum is the same
    if not on_gpu:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    model.train()
    optimizers = build_optimizers_with_moe_load_balancing([model], jc.optimizer, dims)
    # the converters' post-optimizer hook after every optimizer step, registered as torchtitan's
    # trainer does (float8 tensorwise scales for FSDP's float8 all-gather; that stays off here)
    if converters:
        optimizers.register_step_post_hook(
            lambda *args, **kwargs: [c.post_optimizer_hook([model]) for c in converters]
        )
    return args, model, optimizers, dims, n_total, n_active, mesh_note, float8


def run(a: argparse.Namespace) -> dict:
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.utils import clip_grad_norm_

    if a.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(a.device)
    # Under torchrun: its RANK / WORLD_SIZE / LOCAL_RANK (and MASTER_*); else a one-rank process
    # group over env:// on a free port, as our trainer's `python train.py` does.
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ["RANK"]) if launched else 0
    world_size = int(os.environ["WORLD_SIZE"]) if launched else 1
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if launched else 0
    if a.dp_shard != world_size:
        raise ValueError(
            f"--dp-shard {a.dp_shard} must equal the world size {world_size} (dp_replicate = cp = "
            "tp = "
            f"pp = 1); launch {a.dp_shard} processes with torchrun"
        )
    if a.ep < 1 or a.dp_shard % a.ep:
        raise ValueError(
            f"--ep {a.ep} must divide --dp-shard {a.dp_shard} (EP ranks are carved out of FSDP's)"
        )
    if device.type == "cuda":
        torch.cuda.set_device(local_rank if launched else (device.index or 0))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        _cpu_shims()
    if not launched:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    # the same seed on every rank, as DTensor's random init (the FSDP-sharded params) wants
    torch.manual_seed(0)
    main_rank = rank == 0
    # Each rank its own random tokens: a generator seeded by rank. Not the default one: on CUDA,
    # DTensor's RNG tracker sets every rank's device RNG state to rank 0's at the first random init,
    # so it would give every rank the same tokens. One rank keeps the default generator (the tokens
    # of the one-GPU runs).
    data_gen = None
    if world_size > 1:
        data_gen = torch.Generator(device=device)
        data_gen.manual_seed(rank)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    result: dict = {
        "side": "peer",
        "seq_len": a.seq_len,
        "batch": a.batch,
        "ac": a.ac,
        "sac_option": a.sac_option,
        "compile": a.compile,
        "steps": a.steps,
        "warmup": a.warmup,
        "device": str(device),
        "world_size": world_size,
        "dp_shard": a.dp_shard,
        "ep": a.ep,
        "mp": a.mp,
    }
    if device.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name(device)
    with tempfile.TemporaryDirectory() as dump:
        t_build = time.perf_counter()
        args, model, optimizers, dims, n_total, n_active, mesh_note, float8 = build(
            a, device, dump, world_size
        )
        sync()
        result.update(
            build_s=time.perf_counter() - t_build,
            params_total=n_total,
            params_active=n_active,
            sdpa=a.sdpa,
            grouped_mm=args.moe_args.use_grouped_mm,
            float8=float8,
        )
        if mesh_note:
            result["note"] = mesh_note
        flops, flops_tt = step_flops(args, n_active, a.batch, a.seq_len)
        tokens = a.batch * a.seq_len  # per rank
        global_tokens = tokens * world_size  # torchtitan's loss: local sum / global token count
        params = [p for p in model.parameters() if p.requires_grad]
        records = []
        amp = contextlib.nullcontext()
        if a.mp == "autocast":
            if world_size > 1:
                raise ValueError(
                    "--mp autocast is the one-rank path; with several ranks FSDP does mixed "
                    "precision"
                )
            from torchtitan.distributed.utils import maybe_enable_amp

            amp = maybe_enable_amp(dims, "bfloat16", device.type) if device.type == "cuda" else amp

        cuda = device.type == "cuda"

        def mark():
            """A CUDA event (GPU) or the host clock (CPU, where the work is done when the call
            returns)."""
            if cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                return ev
            return time.perf_counter()

        def seconds(t0, t1) -> float:
            return t0.elapsed_time(t1) / 1e3 if cuda else t1 - t0

        def one_step(step: int) -> dict:
            """Queues one step, as torchtitan's trainer does between log steps: no host sync (CUDA
            events time it). The host runs ahead of the GPU as our trainer's does (its step N + 1 is
            queued before N is read)."""
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            t0 = mark()
            seq = torch.randint(
                0, args.vocab_size, (a.batch, a.seq_len + 1), device=device, generator=data_gen
            )
            inputs, labels = seq[:, :-1], seq[:, 1:]
            t_data = mark()
            with amp:
                loss = cross_entropy_loss(model(inputs), labels) / global_tokens
            loss.backward()
            t_fb = mark()
            grad_norm = clip_grad_norm_(params, 1.0, foreach=True, ep_enabled=dims.ep_enabled)
            optimizers.step()
            optimizers.zero_grad()
            t_opt = mark()
            rec = {
                "step": step,
                "loss": loss.detach(),
                "grad_norm": grad_norm.detach(),
                "marks": (t0, t_data, t_fb, t_opt),
            }
            if cuda:  # the allocator's host-side counters: no sync
                rec["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                rec["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
            return rec

        def settle(recs: list[dict]) -> None:
            """After the steps: read their numbers. ``step_s`` runs from the previous step's end to
            this one's (the first step from its start), as the GPU ran them, gaps included; the
            phases from their own marks."""
            sync()
            prev_end = None
            for rec in recs:
                t0, t_data, t_fb, t_opt = rec.pop("marks")
                # loss: rank 0's local mean (not all-reduced: no extra collective per step)
                rec.update(
                    loss=float(rec["loss"]) * world_size,
                    grad_norm=float(rec["grad_norm"]),
                    step_s=seconds(prev_end if prev_end is not None else t0, t_opt),
                    data_s=seconds(t0, t_data),
                    forward_backward_s=seconds(t_data, t_fb),
                    optimizer_s=seconds(t_fb, t_opt),
                )
                prev_end = t_opt
                if main_rank:
                    print(
                        f"[peer] step {rec['step']}/{a.warmup + a.steps} loss {rec['loss']:.4f} "
                        "step "
                        f"{rec['step_s']:.3f}s mem {rec.get('peak_allocated_gib', 0):.1f}GiB",
                        flush=True,
                    )

        records.extend(one_step(step) for step in range(1, a.warmup + a.steps + 1))
        settle(records)
        # one more step under torch.profiler (not part of the timed steps), profiled on rank 0
        if a.trace:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            if main_rank:
                with torch.profiler.profile(activities=activities) as prof:
                    extra = one_step(a.warmup + a.steps + 1)
                    sync()
                prof.export_chrome_trace(a.trace)
                result["trace"] = a.trace
            else:
                extra = one_step(a.warmup + a.steps + 1)
            settle([extra])
    timed = records[a.warmup :]
    step_s = sum(r["step_s"] for r in timed) / len(timed)
    result.update(
        status="ok",
        records=records,
        tokens_per_step=tokens,
        flops_per_step=flops,
        flops_per_step_tt=flops_tt,
        step_s=step_s,
        step_s_median=statistics.median(r["step_s"] for r in timed),
        step_s_max=max(r["step_s"] for r in timed),
        data_s=sum(r["data_s"] for r in timed) / len(timed),
        forward_backward_s=sum(r["forward_backward_s"] for r in timed) / len(timed),
        optimizer_s=sum(r["optimizer_s"] for r in timed) / len(timed),
        tokens_per_s=tokens / step_s,
    )
    peak = next((v for k, v in PEAK_BF16.items() if k in result.get("device_name", "")), None)
    if peak:
        result["mfu_pct"] = 100.0 * flops / step_s / peak
        result["mfu_pct_tt"] = 100.0 * flops_tt / step_s / peak
    if device.type == "cuda":
        result["peak_allocated_gib"] = max(r["peak_allocated_gib"] for r in timed)
        result["peak_reserved_gib"] = max(r["peak_reserved_gib"] for r in timed)
        if world_size > 1:  # the fullest rank; "records" stay rank 0's
            peak = torch.tensor(
                [result["peak_allocated_gib"], result["peak_reserved_gib"]],
                dtype=torch.float64,
                device=device,
            )
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            result["peak_allocated_gib"], result["peak_reserved_gib"] = peak.tolist()
            result["peak_over"] = "max over ranks"
    return result


def _write(path: str | None, obj: dict) -> None:
    text = json.dumps(obj, indent=1)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if a.steps < 1 or a.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    base = {"side": "peer", "seq_len": a.seq_len, "ac": a.ac, "compile": a.compile}
    # Only rank 0 writes the result (or its own failure); every rank prints its traceback into the
    # shared log.
    main_rank = int(os.environ.get("RANK", 0)) == 0
    try:
        result = run(a)
        if main_rank:
            _write(a.out, result)
        if dist.get_world_size() > 1:
            dist.barrier()  # nobody tears down while another rank still reads its results
        return 0
    except torch.OutOfMemoryError as e:
        if main_rank:
            _write(a.out, {**base, "status": "OOM", "error": str(e).splitlines()[0][:400]})
        traceback.print_exc()
        return 3
    except Exception as e:  # noqa: BLE001 - every failure becomes a row of the table
        if main_rank:
            _write(a.out, {**base, "status": "error", "error": f"{type(e).__name__}: {e}"[:400]})
        traceback.print_exc()
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
