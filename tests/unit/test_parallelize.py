"""parallelize.py / distributed.py in one process: degree checks, activation checkpointing (same
top-k, gradients and MoE loads as without), what selective AC keeps, torch.compile, gradient
clipping. Multi-process behaviour (FSDP, HSDP, EP) is tested in tests/distributed."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titan_glm52.distributed import ParallelMesh, build_mesh, init_distributed, validate_degrees
from titan_glm52.model.args import get_flavor
from titan_glm52.model.attention import Attention
from tests.losses import cross_entropy_sum
from titan_glm52.model.model import GLM52Model
from titan_glm52.model.moe import MoE
from titan_glm52.optimizer import clip_grad_norm_
from titan_glm52.parallelize import _reshard_policy, apply_ac, parallelize_model
from tests.unit._sparse_debug import model_and_tokens


# ----------------------------------------------------------------------------------------- degrees
def test_degrees_fill_dp_shard_and_carve_ep_out_of_it():
    d = validate_degrees(16, dp_replicate=2, dp_shard=-1, ep=2, pp=2, n_routed_experts=8)
    assert (d.dp_shard, d.efsdp, d.dp, d.ep) == (4, 2, 8, 2)


def test_degrees_must_multiply_to_world_size():
    with pytest.raises(ValueError, match=r"parallelism.data_parallel_shard_degree.*!= 8 ranks"):
        validate_degrees(8, dp_replicate=2, dp_shard=2)
    with pytest.raises(ValueError, match="parallelism.pipeline_parallel_degree"):
        validate_degrees(6, dp_shard=-1, pp=4)


def test_ep_must_divide_the_routed_experts():
    with pytest.raises(
        ValueError,
        match=r"parallelism.expert_parallel_degree = 4 must divide the number of routed "
        r"experts \(6\); choose one of \[1, 2\]",
    ):
        validate_degrees(4, dp_shard=4, ep=4, n_routed_experts=6)


def test_ep_must_divide_dp_shard():
    with pytest.raises(
        ValueError,
        match=r"expert_parallel_degree = 4 must divide "
        r"parallelism.data_parallel_shard_degree = 6",
    ):
        validate_degrees(6, dp_shard=6, ep=4)


@pytest.mark.parametrize("kw", [{"ep": 0}, {"dp_replicate": 0}, {"pp": -1}, {"dp_shard": 0}])
def test_degrees_below_one_are_refused(kw):
    with pytest.raises(ValueError, match="parallelism."):
        validate_degrees(4, **kw)


def test_single_process_without_torchrun(monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    env = init_distributed(device_type="cpu")
    assert (env.rank, env.world_size, env.device.type, env.backend) == (0, 1, "cpu", None)
    with pytest.raises(ValueError, match="init_distributed"):
        build_mesh(2, dp_shard=2)


def test_bad_options_are_refused():
    model = GLM52Model(get_flavor("debug"))
    with pytest.raises(ValueError, match="activation_checkpoint.mode"):
        apply_ac(model, "sometimes")
    with pytest.raises(ValueError, match="selective_ac_option"):
        apply_ac(model, "selective", "every")
    with pytest.raises(ValueError, match="fsdp_reshard_after_forward"):
        _reshard_policy("maybe", pp_enabled=False, shard_degree=2)
    # "default": reshard only what is sharded, and never under pipeline parallelism
    assert _reshard_policy("default", pp_enabled=False, shard_degree=2)
    assert not _reshard_policy("default", pp_enabled=False, shard_degree=1)
    assert not _reshard_policy("default", pp_enabled=True, shard_degree=2)
    assert _reshard_policy("always", pp_enabled=True, shard_degree=1)
    with pytest.raises(ValueError, match="ep_enabled=True"):
        parallelize_model(model, None, ep_enabled=True)
    # A mesh built without n_routed_experts: parallelize_model still refuses an EP degree not
    # dividing them.
    mesh = ParallelMesh(
        validate_degrees(3, dp_shard=3, ep=3), "cpu", {}, fsdp_mesh=None, expert_fsdp_mesh=None
    )
    with pytest.raises(
        ValueError,
        match=r"parallelism.expert_parallel_degree = 3 must divide n_routed_experts \(8\)",
    ):
        parallelize_model(model, mesh)


# ------------------------------------------------------------------------------------- AC / compile


base = pytest.fixture(scope="module", name="base")(model_and_tokens)


def _step(model, tokens):
    """Loss, grads, MoE loads, and the top-k of every attention call (forward, and recompute
    separately)."""
    fwd, rec = [], []

    def grab(mod, args, out):
        (rec if torch._C._current_graph_task_id() != -1 else fwd).append(out[1].clone())

    hooks = [m.register_forward_hook(grab) for m in model.modules() if isinstance(m, Attention)]
    logits, mtp = model(tokens, with_mtp=True)
    loss = (
        cross_entropy_sum(logits[:, :-1], tokens[:, 1:])
        + cross_entropy_sum(mtp[:, :-2], tokens[:, 2:])
    ) / 100
    loss.backward()
    for h in hooks:
        h.remove()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    loads = [m.tokens_per_expert.clone() for m in model.modules() if isinstance(m, MoE)]
    return loss.detach(), grads, loads, fwd, rec


@pytest.mark.parametrize("mode,option", [("full", "op"), ("selective", "op"), ("selective", "2")])
def test_ac_gives_same_topk_gradients_and_loads(base, mode, option):
    ref = _step(copy.deepcopy(base[0]), base[1])
    model = copy.deepcopy(base[0])
    parallelize_model(model, None, ac_mode=mode, selective_ac_option=option)
    loss, grads, loads, fwd, rec = _step(model, base[1])
    torch.testing.assert_close(loss, ref[0], rtol=0, atol=0)
    assert grads.keys() == ref[1].keys()
    for n in grads:
        torch.testing.assert_close(
            grads[n], ref[1][n], rtol=1e-6, atol=1e-7, msg=lambda m: f"{n}: {m}"
        )
    for got, want in zip(loads, ref[2]):  # recomputes do not count again
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(fwd) == len(ref[3]) and all(torch.equal(a, b) for a, b in zip(fwd, ref[3]))
    # Every recomputed block selected exactly the keys of its forward. Blocks in forward order:
    # layers 0-7, then the MTP block; recomputes come in backward (reverse) order. "2" checkpoints
    # blocks 2, 4, 6, 8.
    ckpt = list(range(9)) if option == "op" else [1, 3, 5, 7]
    assert len(rec) == len(ckpt)
    assert all(torch.equal(r, fwd[i]) for r, i in zip(rec[::-1], ckpt))


class _MatmulCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.total = self.untracked = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (
            torch.ops.aten.mm.default,
            torch.ops.aten.addmm.default,
            torch.ops.titan_glm52.expert_mm.default,
        ):
            self.total += 1
            self.untracked += not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("compile", [False, True])
def test_selective_ac_recomputes_only_untracked_matmuls(base, compile):
    counts = {}
    for mode in ("none", "selective", "full"):
        model = copy.deepcopy(base[0])
        parallelize_model(model, None, ac_mode=mode, compile=compile, compile_backend="aot_eager")
        fwd = _MatmulCounter()
        with fwd:
            loss = model(base[1]).float().pow(2).mean()
        bwd = _MatmulCounter()
        with bwd:
            loss.backward()
        counts[mode] = (fwd.untracked, bwd.total)
    untracked_fwd = counts["none"][0]
    assert untracked_fwd > 0  # the indexer's scores
    if not compile:  # compiled regions are opaque to the counter in the forward
        assert counts["selective"][1] == counts["none"][1] + untracked_fwd
    assert counts["none"][1] < counts["selective"][1] < counts["full"][1]


def test_compile_matches_eager_and_keeps_names(base):
    ref = _step(copy.deepcopy(base[0]), base[1])
    for ac_mode in ("none", "full"):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model = copy.deepcopy(base[0])
        parallelize_model(model, None, ac_mode=ac_mode, compile=True, compile_backend="aot_eager")
        assert [n for n, _ in model.named_parameters()] == [
            n for n, _ in base[0].named_parameters()
        ]
        assert model.state_dict().keys() == base[0].state_dict().keys()
        loss, grads, loads, fwd, _ = _step(model, base[1])
        torch.testing.assert_close(loss, ref[0], rtol=1e-5, atol=1e-6)
        for n in grads:
            torch.testing.assert_close(
                grads[n], ref[1][n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}"
            )
        for got, want in zip(loads, ref[2]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert all(torch.equal(a, b) for a, b in zip(fwd, ref[3]))
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 9  # compiled, also under AC


# ----------------------------------------------------------------------------------------- clipping
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_matches_torch(base, norm_type):
    a, b = copy.deepcopy(base[0]), copy.deepcopy(base[0])
    for m in (a, b):
        m(base[1]).float().pow(2).mean().backward()
    want = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.01, norm_type=norm_type)
    got = clip_grad_norm_(b.parameters(), 0.01, norm_type=norm_type)
    torch.testing.assert_close(got, want)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, msg=lambda m: f"{n}: {m}")


def test_compile_caches_tagged_with_the_source(tmp_path):
    """torch.compile's cache keys carry a hash of this package's source (``parallelize.
    tag_compile_caches``): a registered op's backward formula is not in those keys, so without the
    tag a compiled backward of another version of the package would be loaded. The hash changes
    with any source file's bytes or name, the tag keeps a tag the user set and is added once."""
    from titan_glm52.parallelize import source_tag, tag_compile_caches

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "ops.py").write_text("def backward(g):\n    return g\n")
    (tmp_path / "notes.txt").write_text("not source")
    first = source_tag(tmp_path)
    assert first.startswith("titan_glm52-") and source_tag(tmp_path) == first
    (tmp_path / "notes.txt").write_text("still not source")
    assert source_tag(tmp_path) == first
    (tmp_path / "model" / "ops.py").write_text("def backward(g):\n    return 2 * g\n")
    second = source_tag(tmp_path)
    assert second != first
    (tmp_path / "model" / "ops.py").rename(tmp_path / "model" / "ops2.py")
    assert source_tag(tmp_path) not in (first, second)

    config = torch.compiler.config
    with config.patch(cache_key_tag="users-tag"):  # (pytest's monkeypatch would delete it after)
        tag_compile_caches()
        tag_compile_caches()
        assert config.cache_key_tag == f"users-tag+{source_tag()}"
    with config.patch(cache_key_tag=""):
        model, _ = model_and_tokens()
        parallelize_model(model, None, compile=True, compile_backend="eager")
        assert config.cache_key_tag == source_tag()
