"""Per-rank bodies of the context-parallel tests (run by ``launcher.run_cases``).

Every rank builds the debug model (index_topk 8 < the document lengths, 8 indexer heads, IndexShare
FFFSSSFS, MTP, the indexer KL and the MoE sequence loss on) with the same seed, runs the
single-process reference on the whole global batch of packed documents (once per group of
processes for the cases that share it), then runs its data-parallel
rows' zigzag part (``context_parallel.zigzag_split``) through the parallelized copy and compares the
loss, the auxiliary sums, every gradient, the expert loads and every layer's top-k rows.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import torch
import torch.distributed as dist

from tests.distributed.cases import DEVICE_TYPE, FP8_CASE_DTYPE, FP8_CASE_SPEC, fp8_modules, full
from titan_glm52.context_parallel import CPGroup, next_token_ids, zigzag_split
from titan_glm52.distributed import build_mesh, init_distributed
from titan_glm52.fp8_training import Fp8GroupedExperts, Fp8Linear, Fp8OutputHead, apply_fp8
from titan_glm52.model.args import get_flavor
from titan_glm52.model.attention import Attention
from titan_glm52.model.aux_loss import AuxTerms
from titan_glm52.model.fp8_mm import Fp8HeadProducts, fp8_expert_mm
from titan_glm52.model.head import linear_cross_entropy_sum
from titan_glm52.model.model import GLM52Model
from titan_glm52.model.moe import MoE
from titan_glm52.model.options import ModelOptions
from titan_glm52.parallelize import parallelize_model
from titan_glm52.step import mtp_labels

SEQ, IGNORE = 48, -100
RTOL, ATOL = 1e-4, 1e-5
# Documents per row: crossing the chunk boundaries (every 6 tokens at CP 4, 12 at CP 2), shorter
# than a chunk (1, 2, 3, 4, 5), longer than index_topk (8), a row that is one document.
ROWS = ([5, 19, 2, 22], [48], [13, 1, 30, 4], [3, 3, 42])
MTP_WEIGHT = 0.3


def cp_args(fp8: bool = False, **overrides):
    return get_flavor("debug_fp8" if fp8 else "debug").replace(index_topk=8, **overrides)


def packed_batch(vocab: int, rows=ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens ``[B, SEQ]``, labels): each label the next token of its document, else ignored."""
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(1, vocab, (len(rows), SEQ), generator=g)
    labels = torch.full_like(tokens, IGNORE)
    for b, lengths in enumerate(rows):
        at = 0
        for n in lengths:
            labels[b, at : at + n - 1] = tokens[b, at + 1 : at + n]
            at += n
    return tokens, labels


def cu_seqlens(rows) -> list[int]:
    bounds = [0]
    for lengths in rows:
        for n in lengths:
            bounds.append(bounds[-1] + n)
    return bounds


class TopkRecorder:
    """Every Attention's top-k of each forward, by layer (forward hooks, outside any graph)."""

    def __init__(self, model) -> None:
        self.seen: dict[int, list[torch.Tensor]] = {}
        for m in model.modules():
            if isinstance(m, Attention):
                m.register_forward_hook(self._hook(m.layer_id))

    def _hook(self, layer: int):
        def hook(module, args, out):
            if torch._C._current_graph_task_id() == -1:  # not an activation-checkpoint recompute
                self.seen.setdefault(layer, []).append(out[1].detach().clone())

        return hook

    def first(self) -> dict[int, torch.Tensor]:
        return {layer: outs[0] for layer, outs in self.seen.items()}


def _loss(model, tokens, labels, cu, aux, n_main, n_mtp, **kw):
    ce, mtp = model(
        tokens,
        cu,
        with_mtp=True,
        labels=labels,
        mtp_labels=kw.pop("mtp", None),
        aux=aux,
        **kw,
    )
    return ce / n_main + MTP_WEIGHT * mtp / n_mtp


def _same_selection(got: torch.Tensor, want: torch.Tensor, layer: int) -> None:
    """The same keys per row (the kernels list them in score or row order)."""
    assert got.shape == want.shape, (layer, got.shape, want.shape)
    differ = (got.sort(1).values != want.sort(1).values).any(1)
    assert not differ.any(), f"layer {layer}: the top-k differs in {int(differ.sum())} rows"


@dataclasses.dataclass
class Reference:
    """The single process's forward and backward on the global batch: ``base`` the initialised
    model (untrained), the batch, and the loss, the indexer KL and sequence-loss sums, the
    gradients, the expert loads and every layer's first top-k."""

    base: GLM52Model
    tokens: torch.Tensor
    labels: torch.Tensor
    mtp: torch.Tensor
    loss: torch.Tensor
    indexer_kl: torch.Tensor
    seq_aux: torch.Tensor
    grads: dict
    loads: list
    topk: dict
    # with FP8: what each FP8 product's weight gradient is formed from (``Fp8Records``)
    fp8: Fp8Records | None


# most cases of a group compare with the same reference (cases._REFERENCES says why)
_REFERENCES: dict = {}


@dataclasses.dataclass
class Fp8Records:
    """What the FP8 products' weight gradients of one forward and backward are formed from: per
    FP8 linear its input ``[T, in]`` and output gradient ``[T, out]``; per routed-expert weight
    (``<experts>.w13`` / ``.w2``) the expert-sorted rows of its product's input and output
    gradient, the rows per expert and each row's token; per call of the head's fused loss its
    input ``[T, D]``, its logits' gradient ``[T, V]`` (before the incoming gradient scales it) and
    that incoming gradient."""

    linears: dict = dataclasses.field(default_factory=dict)
    experts: dict = dataclasses.field(default_factory=dict)
    head: list = dataclasses.field(default_factory=list)


def _record_fp8(model) -> Fp8Records:
    """Records (``Fp8Records``) the next forward and backward of ``model``'s FP8 products."""
    rec = Fp8Records()

    def keep_grad(out, entry: list, at: int):
        out.register_hook(lambda g: entry.__setitem__(at, g.reshape(-1, g.shape[-1])))

    def linear_hook(name):
        def hook(module, args, out):
            rec.linears[name] = [args[0].detach().reshape(-1, module.in_features), None]
            keep_grad(out, rec.linears[name], 1)

        return hook

    def sorted_tokens(tokens: dict):
        def hook(router, args, out):
            # the expert-sorted rows' tokens, as MoE._routed orders them (by expert, then token)
            idx = out[1]
            tokens["of"] = torch.argsort(idx.reshape(-1), stable=True) // idx.shape[1]

        return hook

    def experts_mm(name, experts, tokens: dict):
        def mm(x, w, splits):
            out = fp8_expert_mm(x, w, splits)
            which = "w13" if w is experts.w13 else "w2"
            entry = [x.detach(), list(splits), tokens["of"], None]
            rec.experts[f"{name}.{which}"] = entry
            keep_grad(out, entry, 3)
            return out

        return mm

    def head_forward(head):
        def forward(h, labels=None):
            entry = {"h": [], "g": []}

            def products(weight, input_grad):
                mm = Fp8HeadProducts(weight, input_grad)
                weight_grad = mm.weight_grad

                def recorded(g, h_c, dw, dtype):
                    entry["g"].append(g.clone())
                    entry["h"].append(h_c.detach())
                    return weight_grad(g, h_c, dw, dtype)

                mm.weight_grad = recorded
                return mm

            out = linear_cross_entropy_sum(
                h.reshape(-1, h.shape[-1]), head.weight, labels, products=products
            )
            out.register_hook(lambda g: entry.__setitem__("scale", g))
            rec.head.append(entry)
            return out

        return forward

    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            m.register_forward_hook(linear_hook(name))
        elif isinstance(m, Fp8GroupedExperts):
            tokens: dict = {}
            router = model.get_submodule(name.rpartition(".")[0]).router
            router.register_forward_hook(sorted_tokens(tokens))
            m.per_expert_mm = experts_mm(name, m, tokens)
        elif isinstance(m, Fp8OutputHead):
            m.forward = head_forward(m)
    return rec


def _reference(args, options: ModelOptions, row_ids, device, spec=None) -> Reference:
    key = (repr(args), repr(options), row_ids, str(device), repr(spec))
    if key not in _REFERENCES:
        batch_rows = [ROWS[i] for i in row_ids]
        torch.manual_seed(0)
        ref = GLM52Model(args, options)
        ref.init_weights()
        # FP8 cases in float64 (cases.FP8_CASE_DTYPE says why)
        ref.to(device, FP8_CASE_DTYPE if spec else torch.float32)
        base = copy.deepcopy(ref)
        fp8 = None
        if spec is not None:
            apply_fp8(ref, spec)
            fp8 = _record_fp8(ref)
        tokens, labels = packed_batch(args.vocab_size, batch_rows)
        tokens, labels = tokens.to(device), labels.to(device)
        mtp = mtp_labels(labels)
        n_main, n_mtp = float((labels != IGNORE).sum()), float((mtp != IGNORE).sum())
        rec = TopkRecorder(ref)
        aux = AuxTerms(tokens=n_main, sequences=float(len(batch_rows)))
        loss = _loss(ref, tokens, labels, cu_seqlens(batch_rows), aux, n_main, n_mtp, mtp=mtp)
        loss.backward()
        _REFERENCES[key] = Reference(
            base=base,
            tokens=tokens,
            labels=labels,
            mtp=mtp,
            loss=loss.detach(),
            indexer_kl=aux.indexer_kl_sum().detach(),
            seq_aux=aux.seq_aux.detach(),
            grads={n: p.grad for n, p in ref.named_parameters()},
            loads=[m.tokens_per_expert for m in ref.modules() if isinstance(m, MoE)],
            topk=rec.first(),
            fp8=fp8,
        )
    return _REFERENCES[key]


def rank_rows(n_rows: int, dp: int, dp_rank: int, cp: int, cp_rank: int, device=None):
    """The global batch's flat token rows (``row * SEQ + column``) that data-parallel rank
    ``dp_rank`` and context-parallel rank ``cp_rank`` hold, in their local order: its data-parallel
    rows' zigzag part."""
    flat = torch.arange(n_rows * SEQ, device=device).view(n_rows, SEQ)
    per = n_rows // dp
    return zigzag_split(flat[dp_rank * per : (dp_rank + 1) * per], cp, cp_rank).reshape(-1)


def _fp8_weight_grads(ref: Reference, n_rows: int, dp: int, cp: int) -> dict:
    """The FP8 products' weight gradients the parallel run should form: on every rank the
    block-wise products over the 128-token tiles of its own rows (``rank_rows``; a routed expert's
    tiles over that rank's rows of the expert, the head's over the rank's tokens of each call of
    its fused loss), summed over the ranks, from the reference's records of those rows."""
    ranks = [rank_rows(n_rows, dp, d, cp, c) for d in range(dp) for c in range(cp)]
    # a rank's rows in its local order ascend, so filtering an expert's rows keeps the order the
    # rank's own sort by expert, then token, gives them
    assert all(bool((r[1:] > r[:-1]).all()) for r in ranks)

    def summed(x, splits, token_of, dy):
        """``[E, N, K]``: each rank's per-expert product over its rows, summed over the ranks (a
        linear is one expert holding every token)."""
        on = token_of.device
        expert_of = torch.repeat_interleave(
            torch.arange(len(splits), device=on), torch.tensor(splits, device=on)
        )
        grads = []
        for r in ranks:
            mine = torch.isin(token_of, r.to(on))
            counts = torch.bincount(expert_of[mine], minlength=len(splits)).tolist()
            grads.append(
                torch.ops.titan_glm52.fp8_mm_weight_grad(dy[mine], x[mine], counts, x.dtype)
            )
        return torch.stack(grads).sum(0)

    rec, want = ref.fp8, {}
    for name, (x, dy) in rec.linears.items():
        want[name + ".weight"] = summed(x, [len(x)], torch.arange(len(x), device=x.device), dy)[0]
    for name, entry in rec.experts.items():
        want[name] = summed(*entry)
    weight, grads = ref.base.output.weight, []
    products = Fp8HeadProducts(weight, False)
    for call in rec.head:  # the main loss's and the MTP loss's
        h, g = torch.cat(call["h"]), torch.cat(call["g"])
        for r in ranks:
            wg = products.weight_grad(g[r], h[r], None, weight.dtype)
            grads.append(call["scale"].to(wg.dtype) * wg)
    want["output.weight"] = torch.stack(grads).sum(0)
    return want


def check_cp_train_step(
    cp: int,
    dp_shard: int = -1,
    ep: int = 1,
    ac_mode: str = "none",
    compile: bool = False,
    dense_warmup: bool = False,
    dsa_backend: str = "torch",
    row_ids: tuple[int, ...] = tuple(range(len(ROWS))),
    fp8: bool = False,
    **arg_overrides,
) -> None:
    """Loss, indexer KL and sequence-loss sums, every gradient, the expert loads and every layer's
    top-k (identical key sets at every position) of CP (x FSDP / EP) equal the single-process run
    on the same global batch (``row_ids``: which of ``ROWS`` it holds).

    ``fp8``: the "debug_fp8" flavor in float64 with FP8 where training puts it by default (the
    linears, the routed experts, the head's fused loss) on both sides. A product's forward and
    input gradient quantise per token, so everything but the FP8 weights' gradients equals the
    reference; those quantise per 128 tokens of each rank's rows and are compared with the same
    products formed from the reference's records of those rows (``_fp8_weight_grads``)."""
    batch_rows = [ROWS[i] for i in row_ids]
    if dsa_backend == "triton" and DEVICE_TYPE == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    env = init_distributed(device_type=DEVICE_TYPE)
    args = cp_args(fp8, **arg_overrides)
    spec = FP8_CASE_SPEC if fp8 else None
    dtype = FP8_CASE_DTYPE if fp8 else torch.float32
    options = ModelOptions(
        dsa_backend=dsa_backend,
        sparse_attention=not dense_warmup,
        indexer_loss_coeff=1.0 if dense_warmup else 0.1,
        seq_aux_loss_coeff=0.01,
        trainable="indexers" if dense_warmup else "all",
        # the reference runs every row sparse as CP does (the dense prefix is tested against it)
        dense_prefix=False,
    )
    ref = _reference(args, options, row_ids, env.device, spec)
    model = copy.deepcopy(ref.base)
    tokens, labels, mtp = ref.tokens, ref.labels, ref.mtp
    n_main, n_mtp = float((labels != IGNORE).sum()), float((mtp != IGNORE).sum())

    mesh = build_mesh(
        env.world_size,
        dp_shard=dp_shard,
        ep=ep,
        cp=cp,
        device_type=env.device.type,
        n_routed_experts=args.n_routed_experts,
    )
    parallelize_model(
        model,
        mesh,
        param_dtype=dtype,
        reduce_dtype=dtype,
        ac_mode=ac_mode,
        compile=compile,
        compile_backend="aot_eager",
        fp8=spec,
    )
    if fp8:
        recorded = [*ref.fp8.linears, *{n.rpartition(".")[0] for n in ref.fp8.experts}, "output"]
        assert sorted(fp8_modules(model)) == sorted(recorded), fp8_modules(model)
    rec = TopkRecorder(model)
    dp, cpm = mesh["dp"], mesh["cp"]
    group = CPGroup.of(cpm.get_group())
    assert (group.rank, group.size) == (cpm.get_local_rank(), cp)
    rows = len(batch_rows) // dp.size()
    mine = slice(dp.get_local_rank() * rows, (dp.get_local_rank() + 1) * rows)

    def part(x):
        return zigzag_split(x[mine], cp, group.rank)

    aux = AuxTerms(tokens=n_main, sequences=float(len(batch_rows)))
    loss = _loss(
        model,
        part(tokens),
        part(labels),
        cu_seqlens(batch_rows[mine]),
        aux,
        n_main,
        n_mtp,
        mtp=part(mtp),
        cp=group,
        next_tokens=part(next_token_ids(tokens)),
    )
    loss.backward()

    world = dist.group.WORLD
    total = loss.detach().clone()
    dist.all_reduce(total, group=world)
    torch.testing.assert_close(total, ref.loss, rtol=RTOL, atol=ATOL)
    kl = aux.indexer_kl_sum().clone()
    dist.all_reduce(kl, group=world)
    torch.testing.assert_close(kl, ref.indexer_kl, rtol=RTOL, atol=ATOL)
    seq_aux = aux.seq_aux.clone()
    dist.all_reduce(seq_aux, group=world)
    torch.testing.assert_close(seq_aux, ref.seq_aux, rtol=RTOL, atol=ATOL)

    checked = 0
    grads = {**ref.grads, **(_fp8_weight_grads(ref, len(batch_rows), dp.size(), cp) if fp8 else {})}
    for name, p in model.named_parameters():
        if grads[name] is None:
            assert p.grad is None, name
            continue
        torch.testing.assert_close(
            full(p.grad), grads[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}"
        )
        checked += ".indexer." in name
    assert checked > 0, "no indexer gradient was compared: the KL is not tested"

    loads = [m.tokens_per_expert.clone() for m in model.modules() if isinstance(m, MoE)]
    for got, want in zip(loads, ref.loads):
        dist.all_reduce(got, group=world)
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    # this rank's rows of the reference's top-k, in local order, as rows of this data-parallel
    # rank's stream
    local_rows = rank_rows(
        len(batch_rows), dp.size(), dp.get_local_rank(), cp, group.rank, env.device
    )
    want = ref.topk
    got = rec.first()
    assert sorted(got) == sorted(want) and len(got) == args.num_hidden_layers + 1, sorted(got)
    offset = mine.start * SEQ  # the reference's rows are the whole batch's
    for layer, topk in got.items():
        ref_rows = want[layer][local_rows]
        _same_selection(topk, torch.where(ref_rows >= 0, ref_rows - offset, -1), layer)


def check_cp_pipeline(cp: int, pp: int, schedule: str = "1F1B") -> None:
    """CP x PP (stages cut by the skip-aware splitter, one sample per micro-batch): the loss, the
    auxiliary sums, every gradient and every layer's top-k equal the single-process run."""
    from titan_glm52.packed import cu_seqlens_from_positions, doc_positions
    from titan_glm52.pipeline import build_pipeline_stages, build_schedule, micro_batch_bounds
    from titan_glm52.pipeline_split import choose_layout

    env = init_distributed(device_type=DEVICE_TYPE)
    args = cp_args()
    options = ModelOptions(indexer_loss_coeff=0.1, seq_aux_loss_coeff=0.01, dense_prefix=False)
    ref = _reference(args, options, tuple(range(len(ROWS))), env.device)
    tokens, labels, mtp = ref.tokens, ref.labels, ref.mtp
    n_main, n_mtp = float((labels != IGNORE).sum()), float((mtp != IGNORE).sum())

    mesh = build_mesh(env.world_size, pp=pp, cp=cp, device_type="cpu")
    assert mesh["dp"].size() == 1
    group = CPGroup.of(mesh["cp"].get_group())
    layout = choose_layout(args, schedule, pp, None, seq_len=SEQ)
    pp_mesh = mesh["pp"]
    stages, parts = build_pipeline_stages(
        args,
        layout,
        pp_mesh.get_local_rank(),
        pp_mesh.get_group(),
        env.device,
        options,
        lambda m: parallelize_model(m, mesh),
    )
    for p in parts:
        p.to_empty(device=env.device)
        p.init_weights(seed=0)
    last = next((p for p in parts if p.spec.head), None)
    losses = []

    def loss_fn(output, target):
        lab, mtp_lab = target.unbind(-1)
        ce, mtp_sum = last.loss_sums(output, lab, mtp_lab)
        loss = ce / n_main + MTP_WEIGHT * mtp_sum / n_mtp
        losses.append(loss.detach())
        return loss

    def part(x):
        return zigzag_split(x, cp, group.rank)

    n_micro = len(ROWS)
    sched = build_schedule(stages, schedule, n_micro, loss_fn, context_parallel=True)
    cu = torch.tensor(cu_seqlens(ROWS), dtype=torch.int32)
    positions = doc_positions(cu, len(ROWS) * SEQ).view(len(ROWS), SEQ)
    assert torch.equal(cu_seqlens_from_positions(positions), cu)
    target = torch.stack((part(labels), part(mtp)), dim=-1)
    for attempt in range(2):  # the first step also infers the stages' shapes
        losses.clear()
        aux = AuxTerms(tokens=n_main, sequences=float(len(ROWS)))
        recs = [TopkRecorder(p) for p in parts] if attempt else []
        for p in parts:
            p.zero_grad(set_to_none=True)
        kwargs = dict(
            target=target if last is not None else None,
            positions=positions,
            aux=aux,
            bounds=micro_batch_bounds(positions, positions, n_micro),
            cp=group,
            next_tokens=part(next_token_ids(tokens)),
        )
        if any(s.is_first for s in stages):
            sched.step(part(tokens), **kwargs)
        else:
            sched.step(**kwargs)

    world = dist.group.WORLD
    total = torch.stack(losses).sum() if losses else torch.zeros(())
    dist.all_reduce(total, group=world)
    torch.testing.assert_close(total, ref.loss, rtol=RTOL, atol=ATOL)
    # (a stage without MoE layers has no sequence loss)
    sums = ((aux.indexer_kl_sum(), ref.indexer_kl), (aux.seq_aux, ref.seq_aux))
    for got, want in sums:
        got = torch.zeros(()) if got is None else got.clone()
        dist.all_reduce(got, group=world)
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    for p_ in parts:
        for name, p in p_.named_parameters():
            if ref.grads[name] is None:
                assert p.grad is None, name
                continue
            torch.testing.assert_close(
                full(p.grad), ref.grads[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}"
            )
    # each micro-batch is one row: its top-k rows are rows of that row's stream
    cols = part(torch.arange(SEQ)[None])[0]
    want = ref.topk
    for rec in recs:
        assert rec.seen
        for layer, outs in rec.seen.items():
            assert len(outs) == n_micro, (layer, len(outs))
            for m, got in enumerate(outs):
                ref_rows = want[layer][m * SEQ + cols]
                _same_selection(got, torch.where(ref_rows >= 0, ref_rows - m * SEQ, -1), layer)
