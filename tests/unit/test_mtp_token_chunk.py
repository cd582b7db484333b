"""``[activation_checkpoint] mtp_token_chunk``: the MTP layer's token-wise parts (input projection,
its block's MLP, final norm) over chunks of tokens, each recomputed in backward. The same loss and
gradients as without, under every AC mode and compiled; what it stops keeping is what the memory
planner stops counting. (FSDP and pipeline parallelism: tests/distributed.)"""

import copy

import pytest
import torch

from titan_glm52.memory_estimate import stage_activations
from titan_glm52.model import recompute as recompute_mod
from titan_glm52.model.model import GLM52Model
from titan_glm52.model.options import ModelOptions
from titan_glm52.parallelize import parallelize_model
from tests.unit._sparse_debug import ARGS, model_and_tokens

CHUNK = 24  # 64 tokens: chunks of 24, 24 and 16


base = pytest.fixture(scope="module", name="base")(model_and_tokens)


def _with_chunk(base_model: GLM52Model, chunk: int) -> GLM52Model:
    model = GLM52Model(ARGS, ModelOptions(mtp_token_chunk=chunk))
    model.load_state_dict(base_model.state_dict())
    return model


def _step(model: GLM52Model, tokens: torch.Tensor):
    """The trainer's loss (the fused head with labels) and every gradient."""
    labels, mtp_labels = tokens.roll(-1, 1), tokens.roll(-2, 1)
    ce, mtp = model(tokens, with_mtp=True, labels=labels, mtp_labels=mtp_labels)
    loss = (ce + 0.3 * mtp) / tokens.numel()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _count_chunks(monkeypatch) -> list[int]:
    """Rows of every chunk that ``token_chunked`` runs (forward and recompute)."""
    rows = []
    real = recompute_mod._chunks

    def counted(fn, chunk, *xs):
        def fn_counted(*chunk_rows):
            rows.append(chunk_rows[0].shape[0])
            return fn(*chunk_rows)

        return real(fn_counted, chunk, *xs)

    # (``token_chunked`` runs ``_chunks`` through the cached ``_eager_chunks()``)
    monkeypatch.setattr(recompute_mod, "_eager_chunks", lambda: counted)
    return rows


@pytest.mark.parametrize(
    "mode,option", [("none", "op"), ("selective", "2"), ("selective", "op"), ("full", "op")]
)
def test_chunks_give_the_same_loss_and_gradients(base, mode, option, monkeypatch):
    """The loss bitwise (the head sees the same rows), every gradient to fp32 rounding (the chunks'
    weight gradients are summed chunk by chunk); the chunks really run, only in the MTP layer."""
    ref_model, chunked = copy.deepcopy(base[0]), _with_chunk(base[0], CHUNK)
    for m in (ref_model, chunked):
        parallelize_model(m, None, ac_mode=mode, selective_ac_option=option)
    rows = _count_chunks(monkeypatch)
    ref = _step(ref_model, base[1])
    assert rows == []
    loss, grads = _step(chunked, base[1])
    # input projection, MoE, final norm: 3 chunks each in forward, and again in backward; where
    # the MTP block is checkpointed ("op", "full"; "2" checkpoints blocks 2, 4, 6, 8 of 9) its
    # recompute runs its MoE chunks once more (torch may stop that recompute before the last)
    assert sorted(set(rows)) == [16, 24], rows
    assert len(rows) == 18 if option == "2" or mode == "none" else 18 < len(rows) <= 21, rows
    torch.testing.assert_close(loss, ref[0], rtol=0, atol=0)
    assert grads.keys() == ref[1].keys()
    for n in grads:
        torch.testing.assert_close(
            grads[n], ref[1][n], rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}"
        )


def test_chunks_compose_with_compile(base):
    """Compiled blocks (the MTP block's MoE chunks are an eager island inside its compiled forward)
    give the eager loss and gradients."""
    torch._dynamo.reset()
    ref = _step(copy.deepcopy(base[0]), base[1])
    model = _with_chunk(base[0], CHUNK)
    parallelize_model(model, None, ac_mode="none", compile=True, compile_backend="aot_eager")
    loss, grads = _step(model, base[1])
    torch.testing.assert_close(loss, ref[0], rtol=1e-5, atol=1e-6)
    for n in grads:
        torch.testing.assert_close(
            grads[n], ref[1][n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}"
        )


def test_options_reach_the_mtp_block_only():
    model = GLM52Model(ARGS, ModelOptions(mtp_token_chunk=CHUNK, mlp_token_chunk=40))
    assert model.mtp.token_chunk == model.mtp.block.moe.token_chunk == CHUNK
    assert {b.moe.token_chunk for b in model.layers.values() if b.moe_enabled} == {40}
    plain = GLM52Model(ARGS, ModelOptions(mlp_token_chunk=40))
    assert plain.mtp.token_chunk == 0 and plain.mtp.block.moe.token_chunk == 40


def _kept_bytes(module: torch.nn.Module, fn, *inputs: torch.Tensor) -> int:
    """Bytes of the storages ``fn``'s graph saves for backward beyond its inputs and the
    parameters of ``module`` (the rows a chunk's checkpoint keeps are views of the inputs)."""
    held = {t.untyped_storage().data_ptr() for t in (*inputs, *module.parameters())}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in held:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(storages.values())


def test_what_stops_being_kept_is_what_the_plan_stops_counting(base):
    """Around its block the MTP layer keeps, without chunks, the normalised copies of enorm, hnorm
    and its final norm, their fp32 rstd and the [T, 2D] concatenation eh_proj multiplies; with
    chunks nothing but its input rows. The difference is the planner's change of the last stage's
    extras (fp32 here: 4 bytes a value)."""
    t, d = base[1].numel(), ARGS.hidden_size
    emb_next, h, x = (torch.randn(t, d, requires_grad=True) for _ in range(3))
    kept = {}
    for chunk in (0, CHUNK):
        mtp = _with_chunk(base[0], chunk).mtp
        kept[chunk] = _kept_bytes(
            mtp, lambda e, g: mtp._by_rows(mtp._project, e, g), emb_next, h
        ) + _kept_bytes(mtp, lambda y: mtp._by_rows(mtp.norm, y), x)
    assert kept[CHUNK] == 0
    extras = {
        chunk: stage_activations(
            ARGS, range(0), False, True, True, "none", "op", 4, 1.0, False, t, mtp_chunk=chunk
        ).extras
        for chunk in (0, CHUNK)
    }
    assert kept[0] - kept[CHUNK] == t * (extras[0] - extras[CHUNK]) == t * (5 * 4 * d + 12)
