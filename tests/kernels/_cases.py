"""Small packed inputs shared by the interpreter kernel tests."""

from __future__ import annotations

import torch


def cu_seqlens(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def indices_for(lengths, topk: int, seed: int, shuffle: bool = True, empty_rows=()) -> torch.Tensor:
    """Top-k indices of a random indexer (reference), slots shuffled so -1s sit anywhere;
    ``empty_rows`` -> all -1."""
    from titan_glm52.kernels import reference as R

    g = gen(seed + 1000)
    total = sum(lengths)
    idx = R.indexer_topk(
        torch.randn(total, 2, 8, generator=g),
        torch.randn(total, 8, generator=g),
        torch.randn(total, 2, generator=g),
        cu_seqlens(lengths),
        topk,
        1.0,
    )
    if shuffle:
        idx = torch.stack([row[torch.randperm(topk, generator=g)] for row in idx])
    for r in empty_rows:
        idx[r] = -1
    return idx.contiguous()


def cos_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """1 - 2<a,b>/(|a|^2+|b|^2) (FlashMLA / TileLang similarity metric); 0 for identical tensors."""
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    den = (a * a).sum() + (b * b).sum()
    return 0.0 if den == 0 else float(1 - 2 * (a * b).sum() / den)


def fp8_dequantised(t: torch.Tensor, tile_rows: int, tile_cols: int) -> torch.Tensor:
    """The quantise-then-dequantise reference of FP8 training: ``t [R, C]`` cut into tiles of
    ``tile_rows x tile_cols`` (the last ones short), each scaled so that its largest magnitude maps
    to e4m3's 448, rounded to e4m3 and scaled back; fp32."""
    r, c = t.shape
    pr, pc = -(-r // tile_rows) * tile_rows, -(-c // tile_cols) * tile_cols
    padded = torch.zeros(pr, pc, dtype=torch.float32, device=t.device)
    padded[:r, :c] = t.float()
    tiles = padded.view(pr // tile_rows, tile_rows, pc // tile_cols, tile_cols)
    amax = tiles.abs().amax((1, 3), keepdim=True).clamp_min(1e-12)
    q = (tiles * (torch.tensor(448.0, device=t.device) / amax)).clamp(-448, 448)
    back = q.to(torch.float8_e4m3fn).float() * (amax / 448.0)
    return back.view(pr, pc)[:r, :c]


def check_fp8(device, splits, dim: int, hidden: int, tol: float, seed: int = 0) -> None:
    """FP8 training on ``device``: (1) the Triton quantisation kernels equal the torch formulas of
    ``model/fp8_mm.py`` bit for bit (1 x 128 tiles in segments padded to ``ROW_ALIGN`` rows with
    their scales per segment, 128 x 1 tiles per expert written transposed, 128 x 128 blocks both
    ways; one segment without a segment or tile table); (2) ``fp8_expert_mm``'s output and
    both gradients, and ``fp8_linear``'s output, equal quantise-then-matmul references written
    here (activations and gradients per 1 x 128 tile of the contraction, weights per 128 x 128
    block, the weight gradient's operands per 128 x 1 tile of each expert's rows) within ``tol``
    (relative, the whole tensor)."""
    from titan_glm52.kernels import fp8_quant as K
    from titan_glm52.model import fp8_mm as M

    g = torch.Generator(device=device).manual_seed(seed)
    rows = sum(splits)
    act = torch.bfloat16 if device != "cpu" else torch.float32
    x = (torch.randn(rows, dim, generator=g, device=device) * 2).to(act)
    w = (torch.randn(len(splits), 2 * hidden, dim, generator=g, device=device) * 0.02).to(act)
    dy = torch.randn(rows, 2 * hidden, generator=g, device=device).to(act)
    x16, w16 = x.to(torch.bfloat16), w.to(torch.bfloat16)

    def same_bits(a, b):
        assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    qr, sr = M.quant_rows(x16)
    padded = [-(-n // K.ROW_ALIGN) * K.ROW_ALIGN for n in splits]
    qs, ss = K.quant_rows(x16, M.segments_of(splits, x.device), sum(padded))
    kb, start, first = dim // 128, 0, 0
    for n, p in zip(splits, padded):  # rows from a multiple of ROW_ALIGN, scales M-contiguous
        same_bits(qs[first : first + n], qr[start : start + n])
        got = ss[first * kb : (first + p) * kb].view(kb, p).t()[:n]
        assert torch.equal(got, sr[start : start + n])
        start, first = start + n, first + p
    q1, s1 = K.quant_rows(x16)  # one segment, no segment table (a linear's input)
    p1 = -(-rows // K.ROW_ALIGN) * K.ROW_ALIGN
    same_bits(q1[:rows], qr)
    assert torch.equal(s1.view(kb, p1).t()[:rows], sr)
    qt, st = K.quant_cols(x16, M.tiles_of(splits, x.device))
    qtr, str_ = M.quant_cols(x16, splits)
    same_bits(qt, qtr)
    assert torch.equal(st, str_)
    qt1, st1 = K.quant_cols(x16)  # one segment, no tile table
    qtr1, str1 = M.quant_cols(x16, [rows])
    same_bits(qt1, qtr1)
    assert torch.equal(st1, str1)
    for transpose in (False, True):
        qb, sb = K.quant_blocks(w16, transpose)
        qbr, sbr = M.quant_blocks(w16, transpose)
        same_bits(qb, qbr)
        assert torch.equal(sb, sbr)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = M.fp8_expert_mm(xg, wg, splits)
    out.backward(dy)
    xd, dyd = fp8_dequantised(x, 1, 128), fp8_dequantised(dy, 1, 128)
    ref_out, ref_dx, ref_dw, start = [], [], [], 0
    for e, n in enumerate(splits):
        we = fp8_dequantised(w[e], 128, 128)
        ref_out.append(xd[start : start + n] @ we.t())
        ref_dx.append(dyd[start : start + n] @ we)
        ref_dw.append(
            fp8_dequantised(dy[start : start + n], 128, 1).t()
            @ fp8_dequantised(x[start : start + n], 128, 1)
        )
        start += n
    assert rel(out, torch.cat(ref_out)) < tol
    assert rel(xg.grad, torch.cat(ref_dx)) < tol
    assert rel(wg.grad, torch.stack(ref_dw)) < tol
    empty = [e for e, n in enumerate(splits) if n == 0]
    assert all(wg.grad[e].abs().max() == 0 for e in empty)
    lin = M.fp8_linear(x, w[0])
    assert rel(lin, xd @ fp8_dequantised(w[0], 128, 128).t()) < tol
    # FP8's own error against the plain products: e4m3 keeps 3 mantissa bits
    plain = torch.cat([x[a : a + n].float() @ w[e].float().t() for e, a, n in M._spans(splits)])
    assert rel(out, plain) < 0.05


def check_fp8_head(device, rows: int, dim: int, vocab: int, chunk: int, piece: int, tol: float):
    """The LM head's fused loss in FP8 (``model/fp8_mm.Fp8HeadProducts`` through
    ``model/head.linear_cross_entropy_sum``) on ``device``, ``chunk`` tokens at a time and the
    weight gradient of a later chunk ``piece`` vocabulary rows at a time: the loss and both
    gradients equal quantise-then-matmul references written here (the logits from ``h`` per 1 x 128
    tile and W per 128 x 128 block; ``dh`` from each chunk's logit gradient per 1 x 128 tile and W;
    ``dW`` summed over the chunks of the gradient and ``h`` per 128 x 1 tile of the chunk's tokens)
    within ``tol`` (relative, the whole tensor), and stay within FP8's error of the plain loss."""
    import torch.nn.functional as F

    from titan_glm52.model import fp8_mm as M
    from titan_glm52.model.head import linear_cross_entropy_sum

    g = torch.Generator(device=device).manual_seed(5)
    act = torch.bfloat16 if device != "cpu" else torch.float32
    h = torch.randn(rows, dim, generator=g, device=device).to(act)
    w = (torch.randn(vocab, dim, generator=g, device=device) * 0.05).to(act)
    labels = torch.randint(0, vocab, (rows,), generator=g, device=device)
    labels[::7] = -100
    scale = 0.37

    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    old_piece, M.Fp8HeadProducts.PIECE = M.Fp8HeadProducts.PIECE, piece
    try:
        loss = linear_cross_entropy_sum(hg, wg, labels, chunk, products=M.Fp8HeadProducts)
        (loss * scale).backward()
    finally:
        M.Fp8HeadProducts.PIECE = old_piece

    wd, wtd = fp8_dequantised(w, 128, 128), fp8_dequantised(w.t(), 128, 128)
    ref_loss, ref_dh, ref_dw = 0.0, [], torch.zeros(vocab, dim, device=device)
    for h_c, l_c in zip(h.split(chunk), labels.split(chunk)):
        z = (fp8_dequantised(h_c, 1, 128) @ wd.t()).to(act).float()  # rounded as the GEMM's output
        ref_loss += F.cross_entropy(z, l_c, ignore_index=-100, reduction="sum")
        dz = torch.softmax(z, 1) - F.one_hot(l_c.clamp_min(0), vocab)
        dz = (dz * (l_c != -100)[:, None]).to(act)
        ref_dh.append(fp8_dequantised(dz, 1, 128) @ wtd.t())
        ref_dw += fp8_dequantised(dz, 128, 1).t() @ fp8_dequantised(h_c, 128, 1)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    assert abs(loss.item() - ref_loss.item()) < tol * abs(ref_loss.item())
    assert rel(hg.grad, torch.cat(ref_dh) * scale) < tol
    assert rel(wg.grad, ref_dw * scale) < tol
    # FP8's own error against the plain loss
    plain = F.cross_entropy((h.float() @ w.float().t()), labels, reduction="sum")
    assert abs(loss.item() - plain.item()) < 0.02 * abs(plain.item())


def check_fp8_rowwise(device, counts, dim: int, hidden: int, tol: float, seed: int = 0) -> None:
    """The routed experts' rowwise FP8 product (``model/fp8_grouped.py``) on ``device``: the rows
    laid out by ``aligned_layout`` (each expert on a multiple of 16 rows), the product, the rows
    taken back; its output and both gradients equal a reference built from torchao's own torch
    formulas (``tensor_to_scale`` with power-of-two scales and ``to_fp8_saturated``; for the
    weight gradient on each expert's rows alone, as ``torch_to_float8_per_group_colwise`` does),
    within ``tol`` (relative, the whole tensor)."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    from titan_glm52.model import fp8_grouped as G
    from titan_glm52.model.expert_mm import _spans

    def deq(t, dim_):  # torchao's rowwise quantisation along dim_, back in fp32
        s = tensor_to_scale(
            t, torch.float8_e4m3fn, scaling_granularity=ScalingGranularity.AXISWISE,
            axiswise_dim=dim_, round_scales_to_power_of_2=True,
        )  # fmt: skip
        return to_fp8_saturated(t.float() * s, torch.float8_e4m3fn).float() / s

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    g = torch.Generator(device=device).manual_seed(seed)
    rows = sum(counts)
    act = torch.bfloat16 if device != "cpu" else torch.float32  # CPU: no rounding of the result

    # Power-of-two scales change no value that stays a normal e4m3 number (they shift exponents),
    # only those driven into e4m3's subnormals: so magnitudes 2^-8 to 2^8 apart by row and by
    # column, so that a scale along the wrong dimension changes results.
    def spread(*shape):
        t = torch.randn(*shape, generator=g, device=device)
        for d in (-2, -1):
            size = [1] * len(shape)
            size[d] = shape[d]
            t = t * torch.exp2(torch.randint(-8, 9, size, generator=g, device=device).float())
        return t

    x = spread(rows, dim).to(act)
    w = (spread(len(counts), 2 * hidden, dim) * 0.02).to(act)
    dy = spread(rows, 2 * hidden).to(act)
    c = torch.tensor(counts, device=device)
    dest, ends, total = G.aligned_layout(c, rows)
    assert total % G.ALIGN == 0 and total >= rows + (G.ALIGN - 1) * len(counts)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]]).tolist()
    assert all(s % G.ALIGN == 0 for s in starts) and ends[-1].item() == total

    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = G.rowwise_grouped_mm(G.to_aligned(xg, dest, total), wg, ends).index_select(0, dest)
    out.backward(dy)

    xd, dyd = deq(x, -1), deq(dy, -1)
    wf = deq(w.transpose(-2, -1), -2).transpose(-2, -1)  # per output feature, over K
    wb = deq(w.transpose(-2, -1), -1).transpose(-2, -1)  # per input feature, over N
    ref_out, ref_dx, ref_dw, start = [], [], [], 0
    for e, n in enumerate(counts):
        r = slice(start, start + n)
        ref_out.append(xd[r] @ wf[e].t())
        ref_dx.append(dyd[r] @ wb[e])
        # (torchao's per-group reference cannot take an expert without rows)
        ref_dw.append(deq(dy[r], 0).t() @ deq(x[r], 0) if n else w[e].float() * 0)
        start += n
    errs = [rel(out, torch.cat(ref_out)), rel(xg.grad, torch.cat(ref_dx))]
    errs.append(rel(wg.grad, torch.stack(ref_dw)))
    assert max(errs) < tol, errs
    assert all(wg.grad[e].abs().max() == 0 for e, n in enumerate(counts) if n == 0)
    # FP8's own error against the plain products
    plain = torch.cat([x[s : s + n].float() @ w[e].float().t() for e, s, n in _spans(counts)])
    assert rel(out, plain) < 0.05


def _tensorwise(x, dtype):
    """``x`` in fp32 as its FP8 copy of ``dtype`` with one scale sees it: ``q(x s) / s``, ``s =
    max(dtype) / max(amax, 1e-12)`` computed in float64, not rounded (torchao's tensorwise)."""
    from titan_glm52.model.fp8_grouped import EPS

    fmax = torch.finfo(dtype).max
    s = (fmax / x.float().abs().amax().clamp_min(EPS).double()).float()
    return (x.float() * s).clamp(-fmax, fmax).to(dtype).float() / s


def torchao_recipe_products(recipe: str, x, w, dy):
    """(y, dx, dw) of ``y = x w^T`` in torchao's linear recipe ``recipe`` (as its
    ``Float8LinearConfig.from_recipe_name`` configures it), each product on the dequantised
    operands in fp32, rounded once to bf16. The rowwise recipes' scaling (e4m3, power-of-two scales
    per slice) is the rowwise experts' (``fp8_grouped.quant_dequant``)."""
    from titan_glm52.model.fp8_grouped import quant_dequant as rows

    e4m3, e5m2, bf16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
    if recipe == "tensorwise":  # e4m3 forward, e5m2 gradients
        xs, ws, ds = _tensorwise(x, e4m3), _tensorwise(w, e4m3), _tensorwise(dy, e5m2)
        return (xs @ ws.t()).to(bf16), (ds @ ws).to(bf16), (ds.t() @ xs).to(bf16)
    # per row of x and dy, per output feature of w
    y = (rows(x, 1) @ rows(w, 1).t()).to(bf16)
    if recipe == "rowwise":  # dx: w per input feature; dw: dy and x per feature over the tokens
        return y, (rows(dy, 1) @ rows(w, 0)).to(bf16), (rows(dy, 0).t() @ rows(x, 0)).to(bf16)
    # rowwise_with_gw_hp: dx with one power-of-two scale for w; dw in bf16, not quantised
    dx = rows(dy, 1) @ rows(w, (0, 1))
    return y, dx.to(bf16), (dy.float().t() @ x.float()).to(bf16)


def check_torchao_linear(device, recipe: str, rows: int, dim: int, out: int, tol: float) -> None:
    """torchao's Float8Linear of ``recipe`` (what ``fp8_training.apply_fp8`` puts in a linear's
    place) on bf16 ``x [rows, dim]`` and ``w [out, dim]``: its output, input gradient and weight
    gradient equal ``torchao_recipe_products`` within ``tol`` of each result's largest element
    (fp32 summation order, bf16 rounding, and on a GPU cuBLAS's fast FP8 accumulation, which
    torchao asks for in the forward), while the other recipes' formulas differ by more than twice
    that (rows and features of four orders of magnitude make the scaling granularity show)."""
    from torch import nn

    from titan_glm52.fp8_training import TORCHAO_RECIPES, Fp8Spec, apply_fp8

    g = gen(0)
    model = nn.ModuleDict({"proj": nn.Linear(dim, out, bias=False)}).to(device, torch.bfloat16)
    with torch.no_grad():
        model.proj.weight.copy_(torch.randn(out, dim, generator=g) / dim**0.5)
    apply_fp8(model, Fp8Spec(recipe=recipe, expert_fqns=()))
    x = torch.randn(rows, dim, generator=g) * torch.logspace(-2, 2, rows)[:, None]
    dy = torch.randn(rows, out, generator=g) * torch.logspace(2, -2, out)
    x = x.to(device, torch.bfloat16).requires_grad_()
    dy = dy.to(device, torch.bfloat16)
    y = model.proj(x)
    y.backward(dy)
    got = (y, x.grad, model.proj.weight.grad)
    w = model.proj.weight.detach()

    def err(a, b) -> float:
        return float((a.float() - b.float()).abs().max() / b.float().abs().max())

    want = torchao_recipe_products(recipe, x.detach(), w, dy)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert err(a, b) <= tol, (recipe, name, err(a, b))
    for other in TORCHAO_RECIPES:
        theirs = torchao_recipe_products(other, x.detach(), w, dy)
        assert other == recipe or max(map(err, got, theirs)) > 2 * tol, other
