"""Per-rank bodies of the LoRA distributed tests (run by ``launcher.run_cases``).

Every rank builds the debug model with the same seed and random adapters, runs the single-process
reference on the whole global batch itself, then the parallelized copy (LoRA applied by the recipe,
before EP / compile / AC / FSDP) on its slice of the batch, and compares the loss, every adapter
gradient, the missing base gradients, and the adapter and merged HF files written from the shards.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from tests.distributed.cases import (
    ATOL,
    DEVICE_TYPE,
    IGNORE,
    RTOL,
    debug_args,
    full,
    labels_of,
    loss_on,
    make_batch,
)
from titan_glm52.distributed import build_mesh, init_distributed
from titan_glm52.hf_export import save_hf_distributed
from titan_glm52.lora import (
    TARGETS,
    LoRASpec,
    apply_lora,
    init_adapters_,
    is_adapter_key,
    save_adapter,
)
from titan_glm52.model.init import local_view
from titan_glm52.model.model import GLM52Model
from titan_glm52.parallelize import parallelize_model

SPEC = LoRASpec(rank=4, alpha=8, target_modules=tuple(TARGETS))


def _random_adapters(model, seed: int = 5) -> dict[str, torch.Tensor]:
    """Sets every adapter of an unsharded model to random values (B != 0, so that every adapter
    has a gradient) and returns them."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter_key(name):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
                out[name] = p.detach().clone()
    return out


@torch.no_grad()
def _copy_into_shards(model, values: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        if name in values:
            local, shape, offset = local_view(p)
            index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
            local.copy_(values[name].to(local.device)[index])


def _same_files(a: str, b: str) -> None:
    names = sorted(f for f in os.listdir(a) if f.endswith(".safetensors"))
    assert names == sorted(f for f in os.listdir(b) if f.endswith(".safetensors")), (a, b)
    for f in names:
        x, y = load_file(os.path.join(a, f)), load_file(os.path.join(b, f))
        assert x.keys() == y.keys(), f
        for k in x:
            assert torch.equal(x[k], y[k]), f"{f}: {k}"


def check_lora_train_step(
    out_dir: str,
    dp_shard: int = -1,
    ep: int = 1,
    ac_mode: str = "none",
    compile: bool = False,
    reshard_after_forward: str = "default",
) -> None:
    """Loss and every adapter gradient equal single-process; the base has no gradient; the adapter
    in PEFT's format and the merged HF export written from the shards equal the reference's files;
    the trainer's meta-device path initialises the adapters as one process does."""
    env = init_distributed(device_type=DEVICE_TYPE)
    args = debug_args()
    torch.manual_seed(0)
    ref = GLM52Model(args)
    ref.init_weights()
    ref.to(env.device)
    model = copy.deepcopy(ref)
    apply_lora(ref, SPEC)
    values = _random_adapters(ref)
    tokens = make_batch(args.vocab_size).to(env.device)
    n_main = int((labels_of(tokens, 1) != IGNORE).sum())
    n_mtp = int((labels_of(tokens, 2) != IGNORE).sum())
    ref_loss = loss_on(ref, tokens, n_main, n_mtp)
    ref_loss.backward()

    mesh = build_mesh(
        env.world_size, dp_shard=dp_shard, ep=ep, device_type=env.device.type, n_routed_experts=8
    )
    parallelize_model(
        model,
        mesh,
        ac_mode=ac_mode,
        compile=compile,
        compile_backend="aot_eager",
        reshard_after_forward=reshard_after_forward,
        lora=SPEC,
    )
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    _copy_into_shards(model, values)
    dp = mesh["dp"]
    loss = loss_on(model, tokens.chunk(dp.size())[dp.get_local_rank()], n_main, n_mtp)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=dp.get_group())
    torch.testing.assert_close(total, ref_loss.detach(), rtol=RTOL, atol=ATOL)
    ref_params = dict(ref.named_parameters())
    n_adapters = 0
    for name, p in model.named_parameters():
        if not is_adapter_key(name):
            assert not p.requires_grad and p.grad is None, name
            continue
        n_adapters += 1
        assert isinstance(p, DTensor), name
        torch.testing.assert_close(
            full(p.grad),
            ref_params[name].grad,
            rtol=RTOL,
            atol=ATOL,
            msg=lambda m: f"{name}: {m}",
        )
    assert n_adapters == len(values) > 0

    # the files written from the shards are the single-process ones
    rank0 = env.rank == 0
    save_adapter([ref], SPEC, args, f"{out_dir}/ref_adapter", writer=rank0)
    save_adapter([model], SPEC, args, f"{out_dir}/adapter", writer=dp.get_local_rank() == 0)
    save_hf_distributed([ref], args, f"{out_dir}/ref_hf", torch.float32, writer=rank0)
    save_hf_distributed([model], args, f"{out_dir}/hf", torch.float32, writer=rank0)
    if rank0:
        _same_files(f"{out_dir}/ref_adapter", f"{out_dir}/adapter")
        _same_files(f"{out_dir}/ref_hf", f"{out_dir}/hf")
    dist.barrier()

    # the trainer's path: LoRA on the meta device, then materialised and initialised
    with torch.device("meta"):
        meta_model = GLM52Model(args)
    parallelize_model(meta_model, mesh, lora=SPEC)
    meta_model.to_empty(device=env.device)
    meta_model.init_weights()
    init_adapters_(meta_model)
    fresh = copy.deepcopy(ref)
    init_adapters_(fresh)
    fresh_params = dict(fresh.named_parameters())
    for name, p in meta_model.named_parameters():
        if is_adapter_key(name):
            torch.testing.assert_close(full(p.detach()), fresh_params[name], rtol=0, atol=0)


def check_lora_mixed_precision(ep: int = 1) -> None:
    """The GPU setting: the frozen base kept in bf16 (no fp32 master), the adapters' fp32 masters
    in FSDP, bf16 compute with fp32 reduction, in units that hold both: the loss is within bf16
    rounding of fp32, the adapter gradients are finite fp32, and a step runs."""
    env = init_distributed(device_type=DEVICE_TYPE)
    args = debug_args()
    torch.manual_seed(0)
    ref = GLM52Model(args)
    ref.init_weights()
    ref.to(env.device)
    model = copy.deepcopy(ref)
    apply_lora(ref, SPEC)
    values = _random_adapters(ref)
    tokens = make_batch(args.vocab_size).to(env.device)
    n_main = int((labels_of(tokens, 1) != IGNORE).sum())
    n_mtp = int((labels_of(tokens, 2) != IGNORE).sum())
    with torch.no_grad():
        ref_loss = loss_on(ref, tokens, n_main, n_mtp)
    mesh = build_mesh(env.world_size, dp_shard=env.world_size, ep=ep, device_type=env.device.type)
    spec = dataclasses.replace(SPEC, base_dtype=torch.bfloat16)
    parallelize_model(
        model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, lora=spec
    )
    _copy_into_shards(model, values)
    loss = loss_on(model, tokens.chunk(env.world_size)[env.rank], n_main, n_mtp)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref_loss, rtol=2e-2, atol=0)
    trainable = []
    for name, p in model.named_parameters():
        if is_adapter_key(name):
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
            assert torch.isfinite(full(p.grad)).all() and full(p.grad).abs().max() > 0, name
            trainable.append(p)
        else:
            assert p.dtype == torch.bfloat16 and p.grad is None, name
    torch.optim.AdamW(trainable, lr=1e-3).step()
