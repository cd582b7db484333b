"""Triton DSA kernels at GLM-5.2 sizes in bf16 on a GPU, vs the fp32 reference (tolerances:
dsa_kernels.md 5.2).

H = 64, D_qk = 576, d_v = 512, topk = 2048, H_I = 32, D_I = 128, several documents per pack.
"""

from __future__ import annotations

import pytest
import torch

try:
    from ._cases import (
        check_fp8,
        check_fp8_head,
        check_fp8_rowwise,
        check_torchao_linear,
        cos_diff,
    )
except ImportError:
    from _cases import (
        check_fp8,
        check_fp8_head,
        check_fp8_rowwise,
        check_torchao_linear,
        cos_diff,
    )

from titan_glm52 import packed
from titan_glm52.kernels import reference as R
from titan_glm52.kernels.tuning import launch_overrides

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

H, D_QK, D_V, TOPK, H_I, D_I = 64, 576, 512, 2048, 32, 128
DEV = "cuda"


def _cu(lengths):
    return torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV
    )


def _indexer_inputs(total, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(total, H_I, D_I, generator=g, device=DEV).to(torch.bfloat16)
    k = torch.randn(total, D_I, generator=g, device=DEV).to(torch.bfloat16)
    w = torch.randn(total, H_I, generator=g, device=DEV) * H_I**-0.5
    return q, k, w


def _scores(q, k, w, starts, a, b, scale):
    """fp32 reference scores of rows a..b-1 against all keys 0..b-1 (-inf where not visible)."""
    kf = k[:b].float()
    acc = torch.zeros(b - a, b, device=DEV)
    for h in range(q.shape[1]):
        acc += w[a:b, h, None] * torch.relu(q[a:b, h].float() @ kf.T)
    acc *= scale
    keys = torch.arange(b, device=DEV)
    rows = torch.arange(a, b, device=DEV)
    vis = (keys[None] >= starts[a:b, None]) & (keys[None] <= rows[:, None])
    return acc.masked_fill(~vis, float("-inf"))


def test_indexer_topk_real_size():
    from titan_glm52.kernels.indexer_topk import indexer_topk

    lengths = [1500, 4596, 2096]  # one document shorter than topk
    total = sum(lengths)
    q, k, w = _indexer_inputs(total, 0)
    q[::5] = 0  # every 5th query scores every key 0: exact ties, must take the lowest rows
    cu = _cu(lengths)
    scale = D_I**-0.5
    out = indexer_topk(q, k, w, cu, TOPK, scale)
    torch.cuda.synchronize()
    assert torch.equal(out, indexer_topk(q, k, w, cu, TOPK, scale)), "not deterministic"
    starts = packed.doc_starts(cu, total)
    n = torch.clamp(torch.arange(total, device=DEV) - starts + 1, max=TOPK)
    valid = out >= 0
    assert torch.equal(valid.sum(1), n), "wrong number of selected keys"
    assert torch.equal(valid, torch.arange(TOPK, device=DEV)[None] < n[:, None]), (
        "-1 must come last"
    )
    rows = torch.arange(total, device=DEV)[:, None]
    o = out.long()
    assert bool(((o >= starts[:, None]) & (o <= rows) | ~valid).all()), (
        "index outside the visible window"
    )
    srt = torch.sort(torch.where(valid, o, torch.full_like(o, 1 << 40)), dim=1).values
    assert bool(((srt[:, 1:] != srt[:, :-1]) | (srt[:, 1:] == 1 << 40)).all()), "duplicate index"
    ties = rows[::5, 0]
    expect = starts[ties, None] + torch.arange(TOPK, device=DEV)[None]
    expect = torch.where(
        torch.arange(TOPK, device=DEV)[None] < n[ties, None],
        expect,
        torch.full_like(expect, 1 << 40),
    )
    assert torch.equal(srt[ties], expect), "exact ties must select the lowest rows"
    # value-set check: sorted selected scores equal the reference top-k scores (to fp32 summation
    # noise)
    worst, agree, cnt = 0.0, 0, 0
    for a in range(0, total, 512):
        b = min(total, a + 512)
        sc = _scores(q, k, w, starts, a, b, scale)
        top = torch.topk(sc, min(TOPK, b), dim=1).values
        ours = torch.gather(sc, 1, o[a:b].clamp(min=0)).masked_fill(~valid[a:b], float("-inf"))
        ours = torch.sort(ours, dim=1, descending=True).values
        fin = torch.isfinite(top[:, :TOPK])
        tol = 1e-5 * sc.masked_fill(~torch.isfinite(sc), 0).abs().amax(1, keepdim=True) + 1e-6
        diff = (ours[:, : top.shape[1]] - top).abs().masked_fill(~fin, 0)
        worst = max(worst, float((diff / tol).max()))
    ref = R.indexer_topk(q, k, w, cu, TOPK, scale)
    for t in range(0, total, 97):
        a_set = set(out[t][out[t] >= 0].tolist())
        b_set = set(ref[t][ref[t] >= 0].tolist())
        agree += len(a_set & b_set)
        cnt += len(b_set)
    print(
        f"indexer_topk real size: worst score gap {worst:.3f} x tol, set overlap {agree / cnt:.6f}"
    )
    assert worst <= 1.0, (
        f"selected scores differ from the reference top-k by {worst:.2f} x tolerance"
    )
    assert agree / cnt > 0.999, f"set overlap with the reference {agree / cnt:.5f}"


def test_indexer_score_ws_matches_triton():
    """The Gluon scoring kernel (``indexer_topk_ws``) writes the Triton kernel's scores bit for bit,
    and the same row max / min, over packed documents (one shorter than topk, queries of all-zero
    scores); ``indexer_topk`` then selects the same keys through either kernel."""
    import triton
    from titan_glm52.kernels import indexer_topk as IT
    from titan_glm52.kernels import indexer_topk_ws as WS

    lengths = [1500, 4596, 2096, 9000]
    total, width = sum(lengths), max(lengths)
    q, k, w = _indexer_inputs(total, 3)
    q[::7] = 0
    cu = _cu(lengths)
    starts = packed.doc_starts(cu, total).to(torch.int32)
    scale = D_I**-0.5
    hp, dp, bq = IT._config(H_I, D_I, q.dtype)

    def scores(gluon: bool):
        out = [
            torch.full(shape, float("nan"), device=DEV)
            for shape in ((total, width), (total,), (total,))
        ]
        if gluon:
            WS.score(q, k, w, starts, *out, 0, total, scale, TOPK)
        else:
            IT._score_kernel[(triton.cdiv(total, bq),)](
                q,
                k,
                w,
                starts,
                *out,
                0,
                total,
                scale,
                TOPK,
                q.stride(0),
                q.stride(1),
                k.stride(0),
                w.stride(0),
                out[0].stride(0),
                H=H_I,
                D=D_I,
                HP=hp,
                DP=dp,
                BQ=bq,
                IEEE=False,
                **IT.SCORE_LAUNCH,
            )
        # bit patterns (NaN where a kernel writes nothing)
        return [t.view(torch.int32) for t in out]

    for name, a, b in zip(("scores", "row max", "row min"), scores(True), scores(False)):
        assert torch.equal(a, b), (
            f"{name}: {int((a != b).sum())} entries differ from the Triton kernel's"
        )
    ws = IT.indexer_topk(q, k, w, cu, TOPK, scale, gluon=True)
    triton_only = IT.indexer_topk(q, k, w, cu, TOPK, scale, gluon=False)
    assert torch.equal(ws, triton_only), "selection differs from the Triton path's"


def _mla_inputs(lengths, seed, empty=(0, 1, 2)):
    from titan_glm52.kernels.indexer_topk import indexer_topk

    total = sum(lengths)
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(total, H, D_QK, generator=g, device=DEV).to(torch.bfloat16)
    kv = torch.randn(total, D_QK, generator=g, device=DEV).to(torch.bfloat16)
    qi, ki, wi = _indexer_inputs(total, seed + 1)
    idx = indexer_topk(qi, ki, wi, _cu(lengths), TOPK, D_I**-0.5)
    for r in empty:
        idx[r] = -1
    return q, kv, idx, (qi, ki, wi), g


# part 2 of the backward: the defaults and the other accepted column block (64 is the default)
@pytest.mark.parametrize("tune", [{}, {"DC": 128}])
def test_sparse_mla_real_size(tune):
    from titan_glm52.kernels.sparse_mla import sparse_mla

    lengths = [1000, 3096]
    q, kv, idx, _, g = _mla_inputs(lengths, 1)
    total = q.shape[0]
    scale = D_QK**-0.5
    go = torch.randn(total, H, D_V, generator=g, device=DEV).to(torch.bfloat16)
    qt, kvt = q.clone().requires_grad_(), kv.clone().requires_grad_()
    with launch_overrides({"sparse_mla": {"bwd_grad": tune}}):
        out, lse = sparse_mla(qt, kvt, idx, scale, D_V)
        out.backward(go)
    qr, kvr = q.float().requires_grad_(), kv.float().requires_grad_()
    r_out, r_lse = R.sparse_mla(qr, kvr, idx, scale, D_V)
    r_out.backward(go.float())
    out, lse = out.detach(), lse.detach()
    problems = []
    if out.dtype != torch.bfloat16 or lse.dtype != torch.float32:
        problems.append(f"dtypes {out.dtype} {lse.dtype}")
    # elementwise: bf16 output and bf16 P in the PV product; rows with few keys can cancel, hence
    # the abs part
    d_out = (out.float() - r_out.detach()).abs()
    bad = int((d_out > 1e-2 + 0.024 * r_out.detach().abs()).sum())
    metrics = {"out_max_abs": float(d_out.max()), "out_bad": bad, "out_cos": cos_diff(out, r_out)}
    fin = torch.isfinite(r_lse)
    d_lse = (lse[fin] - r_lse.detach()[fin]).abs()
    metrics.update(
        lse_max_abs=float(d_lse.max()),
        lse_inf_match=bool(torch.equal(fin, torch.isfinite(lse))),
        lse_bad=int((d_lse > 2e-5 + 3.1e-5 * r_lse.detach()[fin].abs()).sum()),
        dq_cos=cos_diff(qt.grad, qr.grad),
        dkv_cos=cos_diff(kvt.grad, kvr.grad),
    )
    print("sparse_mla real size:", metrics)
    if bad or metrics["out_cos"] > 1e-5:
        problems.append("out")
    if metrics["lse_bad"] or not metrics["lse_inf_match"]:
        problems.append("lse")
    if metrics["dq_cos"] > 1e-4 or metrics["dkv_cos"] > 1e-4:
        problems.append("grads")
    if not all(bool(torch.isfinite(t).all()) for t in (qt.grad, kvt.grad, out)):
        problems.append("non-finite")
    if not (
        torch.all(out[:3] == 0)
        and torch.all(qt.grad[:3] == 0)
        and torch.all(lse[:3] == float("-inf"))
    ):
        problems.append("empty rows")
    assert not problems, (problems, metrics)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the warp-specialised forward is for sm_90",
)
@pytest.mark.parametrize("tune", [{}, {"bk": 32, "stages": 4}])
def test_sparse_mla_ws_forward(tune):
    """The Gluon forward (sparse_mla_ws) against the fp32 reference and the Triton kernel: short
    documents (rows with a -1 tail), rows without a valid index, -1 holes inside rows, a kv row
    count other than q's."""
    from titan_glm52.kernels import sparse_mla as SM
    from titan_glm52.kernels import sparse_mla_ws as WS

    lengths = [37, 2100, 1959]
    q, kv, idx, _, _ = _mla_inputs(lengths, 5, empty=(0, 40, 41))
    idx[100, 3] = -1
    idx[2500, :700] = -1
    idx[3000, 1::2] = -1
    idx = idx.contiguous()
    kv = torch.cat([kv, torch.randn(5, D_QK, device=DEV).to(kv.dtype)])  # rows never selected
    assert WS.supported(q, kv, D_V)
    scale = D_QK**-0.5
    kend = SM.valid_extent(idx)
    with launch_overrides({"sparse_mla_ws": {"fwd": tune}}):
        out, lse = SM._fwd(q, kv, idx, kend, scale, D_V, gluon=True)
    t_out, t_lse = SM._fwd(q, kv, idx, kend, scale, D_V, gluon=False)
    r_out, r_lse = R.sparse_mla(q.float(), kv.float(), idx, scale, D_V)
    d_out = (out.float() - r_out).abs()
    fin = torch.isfinite(r_lse)
    metrics = {
        "out_max_abs": float(d_out.max()),
        "out_cos": cos_diff(out, r_out),
        "out_bad": int((d_out > 1e-2 + 0.024 * r_out.abs()).sum()),
        "lse_max_abs": float((lse[fin] - r_lse[fin]).abs().max()),
        "vs_triton_out_max_abs": float((out.float() - t_out.float()).abs().max()),
        "vs_triton_lse_max_abs": float((lse[fin] - t_lse[fin]).abs().max()),
    }
    print("sparse_mla_ws forward:", tune, metrics)
    assert metrics["out_bad"] == 0 and metrics["out_cos"] < 1e-5, metrics
    assert metrics["lse_max_abs"] < 1e-4 and torch.equal(fin, torch.isfinite(lse)), metrics
    assert metrics["vs_triton_out_max_abs"] <= 2**-6 and metrics["vs_triton_lse_max_abs"] < 1e-4, (
        metrics
    )
    for r in (0, 40, 41):
        assert torch.all(out[r] == 0) and torch.all(lse[r] == float("-inf"))


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the warp-specialised backward part 1 is for sm_90",
)
# the defaults (a 10-slot ring), a shallower ring, the smallest one
@pytest.mark.parametrize("tune", [{}, {"stages": 6}, {"stages": 4}])
def test_sparse_mla_ws_backward_part1(tune):
    """The Gluon part 1 of the backward (P, dS into the scratch) against the Triton kernel, on a
    chunk that starts mid-pack (row0 > 0); the whole backward through it is checked against the
    reference above."""
    from titan_glm52.kernels import sparse_mla as SM
    from titan_glm52.kernels import sparse_mla_ws as WS

    lengths = [37, 2100, 1959]
    q, kv, idx, _, g = _mla_inputs(lengths, 6, empty=(0, 40, 41))
    idx[2500, :700] = -1
    idx = idx.contiguous()
    assert WS.supported(q, kv, D_V)
    scale = D_QK**-0.5
    kend = SM.valid_extent(idx)
    out, lse = SM._fwd(q, kv, idx, kend, scale, D_V)
    go = torch.randn(q.shape[0], H, D_V, generator=g, device=DEV).to(torch.bfloat16)
    row0, n = 30, 3000
    got = [torch.full((n, TOPK, H), 7.0, dtype=q.dtype, device=DEV) for _ in range(2)]
    with launch_overrides({"sparse_mla_ws": {"bwd_ps": tune}}):
        WS.bwd_ps(q, kv, idx, kend, out, go, lse, got[0], got[1], scale, row0, n)
    want = [torch.full_like(got[0], 7.0) for _ in range(2)]
    SM._triton_bwd_ps(q, kv, idx, kend, out, go, lse, want[0], want[1], scale, row0, n)
    # only the slots part 2 reads (below each row's valid extent); past it each kernel leaves its
    # own step's tail
    used = (torch.arange(TOPK, device=DEV)[None, :] < kend[row0 : row0 + n, None])[:, :, None]
    for name, a, b in (("P", got[0], want[0]), ("dS", got[1], want[1])):
        diff = float(torch.where(used, a.float() - b.float(), 0.0).abs().max())
        print(
            f"sparse_mla_ws part 1 {name}: max abs diff {diff}, scale "
            f"{float(b.float().abs().max())}"
        )
        assert diff <= 1e-3 * float(b.float().abs().max()), (name, diff)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the warp-specialised backward part 2 is for sm_90",
)
@pytest.mark.parametrize("group_rows", [0, -1, 256])
def test_sparse_mla_ws_backward_part2(group_rows):
    """The Gluon part 2 (dKV by atomics, dQ) against the Triton kernel from the same P / dS scratch,
    on a chunk that starts mid-pack; dKV in fp32 before the cast (the atomics' order differs, so not
    bit for bit). In each program order (``group_rows``; 256 does not divide the chunk's 3000 rows:
    the programs past it must do nothing)."""
    from titan_glm52.kernels import sparse_mla as SM
    from titan_glm52.kernels import sparse_mla_ws as WS

    lengths = [37, 2100, 1959]
    q, kv, idx, _, g = _mla_inputs(lengths, 7, empty=(0, 40, 41))
    idx[2500, :700] = -1
    idx[3000, 1::2] = -1
    idx = idx.contiguous()
    scale = D_QK**-0.5
    kend = SM.valid_extent(idx)
    out, lse = SM._fwd(q, kv, idx, kend, scale, D_V)
    go = torch.randn(q.shape[0], H, D_V, generator=g, device=DEV).to(torch.bfloat16)
    row0, n = 30, 3000
    # slots part 1 leaves must not be read
    p = torch.full((n, TOPK, H), float("nan"), dtype=q.dtype, device=DEV)
    ds = p.clone()
    WS.bwd_ps(q, kv, idx, kend, out, go, lse, p, ds, scale, row0, n)
    grads = []
    for ws in (True, False):
        dq = torch.zeros_like(q)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=DEV)
        part2 = WS.bwd_grad if ws else SM._triton_bwd_grad
        with launch_overrides({"sparse_mla_ws": {"bwd_grad": {"group_rows": group_rows}}}):
            part2(q, kv, idx, kend, go, p, ds, dkv, dq, row0, n)
        grads.append((dq, dkv))
    (dq, dkv), (t_dq, t_dkv) = grads
    d_dq = float((dq.float() - t_dq.float()).abs().max())
    d_dkv = float((dkv - t_dkv).abs().max())
    print(
        f"sparse_mla_ws part 2: dq max abs diff {d_dq}, dkv {d_dkv} (scale "
        f"{float(t_dkv.abs().max())})"
    )
    assert torch.isfinite(dkv).all() and torch.isfinite(dq).all()
    assert d_dq <= 1e-2 * float(t_dq.float().abs().max()), d_dq
    assert d_dkv <= 1e-5 * float(t_dkv.abs().max()), d_dkv
    assert torch.all(dq[:row0] == 0) and torch.all(dq[row0 + n :] == 0)


def test_indexer_kl_real_size():
    from titan_glm52.kernels.indexer_loss import indexer_kl_sparse
    from titan_glm52.kernels.sparse_mla import sparse_mla

    lengths = [1000, 3096]
    q, kv, idx, (qi, ki, wi), g = _mla_inputs(lengths, 2)
    total = q.shape[0]
    scale, isc = D_QK**-0.5, D_I**-0.5
    with torch.no_grad():
        _, lse = sparse_mla(q, kv, idx, scale, D_V)
    grow = torch.rand(total, generator=g, device=DEV)
    a = [x.clone().requires_grad_() for x in (qi, ki, wi)]
    kl = indexer_kl_sparse(q, kv, scale, lse, *a, isc, idx)
    (kl * grow).sum().backward()
    b = [x.float().requires_grad_() for x in (qi, ki, wi)]
    r_kl = R.indexer_kl(q, kv, scale, *b, isc, _cu(lengths), indices=idx)
    (r_kl * grow).sum().backward()
    print(
        "indexer_kl real size: kl max abs",
        float((kl - r_kl).detach().abs().max()),
        "grad cos",
        [cos_diff(x.grad, y.grad) for x, y in zip(a, b)],
    )
    torch.testing.assert_close(kl, r_kl, atol=2e-3, rtol=2e-3)
    for name, x, y in zip(("q_idx", "k_idx", "w_idx"), a, b):
        assert torch.isfinite(x.grad).all(), name
        assert cos_diff(x.grad, y.grad) <= 1e-4, (name, cos_diff(x.grad, y.grad))
        torch.testing.assert_close(
            x.grad.float(), y.grad, atol=5e-2, rtol=5e-2, msg=lambda m: f"{name}: {m}"
        )
    assert torch.all(kl[:3] == 0)


@pytest.mark.parametrize("gluon", [True, False])
def test_sparse_mla_indexer_kl_real_size(gluon):
    """The KL formed in the sparse backward (bf16 P as stored) against the separate fp32 KL kernel
    on the same inputs: the KL and the indexer gradients, and the attention's own gradients equal
    to sparse_mla's."""
    from titan_glm52.kernels.indexer_loss import indexer_kl_sparse, sparse_mla_indexer_kl
    from titan_glm52.kernels.sparse_mla import sparse_mla

    lengths = [1000, 3096]
    q, kv, idx, (qi, ki, wi), g = _mla_inputs(lengths, 3)
    scale, isc, weight = D_QK**-0.5, D_I**-0.5, 0.25
    go = torch.randn(q.shape[0], H, D_V, generator=g, device=DEV).to(torch.bfloat16)
    runs = []
    for fused in (True, False):
        leaves = [x.clone().requires_grad_() for x in (q, kv, qi, ki, wi)]
        sink = torch.zeros((), device=DEV)
        if fused:
            out, _ = sparse_mla_indexer_kl(
                *leaves[:2], idx, scale, D_V, *leaves[2:], isc, weight, sink, gluon=gluon
            )
            loss = (out.float() * go.float()).sum()
        else:
            out, lse = sparse_mla(*leaves[:2], idx, scale, D_V, gluon=gluon)
            kl = indexer_kl_sparse(q, kv, scale, lse, *leaves[2:], isc, idx)
            sink += kl.sum().detach()
            loss = (out.float() * go.float()).sum() + weight * kl.sum()
        loss.backward()
        runs.append((sink, [x.grad for x in leaves]))
    (sink, grads), (r_sink, r_grads) = runs
    print(
        "fused indexer kl: sink",
        float(sink),
        "vs",
        float(r_sink),
        "grad cos",
        [cos_diff(a, b) for a, b in zip(grads, r_grads)],
    )
    torch.testing.assert_close(sink, r_sink, atol=0, rtol=5e-3)
    for name, a, b in zip(("q", "kv"), grads[:2], r_grads[:2]):
        # the same kernels; dKV's fp32 atomics add in another order
        assert cos_diff(a, b) <= 1e-6, (name, cos_diff(a, b))
    for name, a, b in zip(("q_idx", "k_idx", "w_idx"), grads[2:], r_grads[2:]):
        assert torch.isfinite(a).all(), name
        assert cos_diff(a, b) <= 1e-4, (name, cos_diff(a, b))


def test_fp8_products_real_size():
    """FP8 training's quantisation and products at the proxy's widths (``_cases.check_fp8``):
    the Triton quantisation equals the torch formulas bit for bit, and cuBLAS's block-scaled GEMMs
    equal the products of the dequantised operands up to bf16 rounding."""
    splits = [2048, 0, 1, 130, 3000, 127, 1790, 1096]  # 8192 routed rows, uneven, one empty
    check_fp8(DEV, splits, dim=6144, hidden=2048, tol=4e-3)


def test_fp8_rowwise_experts_real_size():
    """The routed experts' rowwise FP8 product through torchao's grouped GEMM at the proxy's
    widths (``_cases.check_fp8_rowwise``): equal to torchao's torch formulas on the dequantised
    operands up to bf16 rounding and the GEMM's FP8 accumulation."""
    counts = [2048, 0, 1, 130, 3000, 127, 1790, 1096]  # 8192 routed rows, uneven, one empty
    check_fp8_rowwise(DEV, counts, dim=6144, hidden=2048, tol=5e-3)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_torchao_linear_recipes_real_size(recipe):
    """The linears in torchao's recipes (``quantize.linear.float8.recipe_name``) at the proxy's
    wq_b width, through cuBLAS (``_cases.check_torchao_linear``)."""
    check_torchao_linear(DEV, recipe, rows=4096, dim=2048, out=6144, tol=1e-2)


def test_fp8_head_real_size():
    """The LM head's fused loss in FP8 at GLM-5.2's widths (``_cases.check_fp8_head``): two chunks,
    the second one's rows not a multiple of 16, its weight gradient in 16,384-row pieces."""
    check_fp8_head(DEV, 3000, dim=6144, vocab=154880, chunk=2048, piece=16384, tol=4e-3)
