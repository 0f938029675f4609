r"""The Triton kernels of :mod:`dapo_ops.logprobs._triton_linear` (which documents them).

Private. Importing this module imports Triton: :func:`dapo_ops.logprobs._triton_linear.kernels`
loads it on first use only, once per mode (``triton.jit`` reads ``TRITON_INTERPRET``
when a kernel is defined, and the interpreter re-reads each kernel's module globals, so
the kernels live at module level). No type annotations: Triton reads them as its own.
"""
# mypy: ignore-errors

import os

import triton
import triton.language as tl

from dapo_ops.logprobs._softmax_blocks import LOGP_FLOOR

#: The mode this module was loaded in (``dapo_ops._core._triton.load_kernels`` sets
#: ``TRITON_INTERPRET`` while it runs): under the interpreter a branch never compiled.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")

FLOOR = tl.constexpr(LOGP_FLOOR)

# Only builtins of triton.language and this module's own jit functions are called: the
# library's jit helpers (tl.zeros, tl.sum, tl.max) are defined when triton is imported,
# compiled or interpreted once for all, and this module may be loaded in the other mode.
# (Under the interpreter, _sum hands tl.standard._sum_combine to tl.reduce, which knows
# it and sums with numpy without calling it.)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _greater(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sum(x, axis: tl.constexpr):
    if INTERPRETED:  # the interpreter sums with numpy only for the library's own combine
        return tl.reduce(x, axis, tl.standard._sum_combine)
    return tl.reduce(x, axis, _add)


@triton.jit
def _max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _greater)


@triton.jit
def _narrow(x, dtype: tl.constexpr):
    """``x`` in ``dtype``, rounded to nearest even as a GPU's cast rounds. The interpreter
    (Triton 3.6 to 3.9) truncates a float32 -> bfloat16 cast, with
    ``fp_downcast_rounding="rtne"`` too, so there the bits are rounded first (finite
    ``x``: bias ``0x7FFF`` plus the kept last bit, then cut) and the cast is exact."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, ACC: tl.constexpr):
    # UPCAST (interpreter only): its bfloat16 dot is wrong; bfloat16 products are exact
    # in float32, so the float32 dot of the upcast tiles is the same arithmetic.
    # float64: Triton 3.6 to 3.8 cannot lower these kernels' accumulating float64 tl.dot
    # for sm_90 (their MMAv2 path asserts "fp64 don't support largeK MMA"; acc + tl.dot(a,
    # b) is folded into the same form; 3.9 lowers it), so the products are summed on the
    # CUDA cores (under the interpreter too, so CI runs this branch); small tiles.
    if ACC == tl.float64:  # noqa: SIM300 (ACC is the accumulator's dtype, not a constant)
        return acc + _sum(a[:, :, None].to(ACC) * b[None, :, :].to(ACC), 1)
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee", out_dtype=ACC)


@triton.jit
def _tanh(x):
    """``tanh`` from ``exp``, odd by construction: ``e = exp(-2|x|)`` in ``(0, 1]``."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _scaled(acc, temp, cap, HAS_CAP: tl.constexpr):
    """``(z / T, t)`` of raw logits ``z``: with the cap, ``(c t / T, t)``, ``t = tanh(z/c)``
    (``t`` unused without it)."""
    z, t = acc, acc
    if HAS_CAP:
        t = _tanh(acc / cap)
        z = t * cap
    return z / temp, t


@triton.jit
def _tile(h_ptr, w_ptr, b_ptr, rows, live, cols, col_ok, D,
          HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr,
          BT: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    """``h W^T + b`` for ``rows x cols``, in ACC; dead rows read as zeros."""
    acc = tl.full([BT, BV], 0.0, ACC)
    for k0 in range(0, D, BD):
        ks = k0 + tl.arange(0, BD)
        k_ok = ks < D
        h = tl.load(h_ptr + rows[:, None] * D + ks[None, :],
                    mask=live[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + cols[:, None] * D + ks[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        acc = _dot(h, tl.trans(w), acc, UPCAST, ACC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(ACC)[None, :]
    return acc


@triton.jit
def _rows(start, N, tok_ptr, valid_ptr, BT: tl.constexpr, HAS_VALID: tl.constexpr):
    rows = start + tl.arange(0, BT).to(tl.int64)
    ok = rows < N
    live = ok
    if HAS_VALID:
        live = ok & (tl.load(valid_ptr + rows, mask=ok, other=0) != 0)
    tok = tl.load(tok_ptr + rows, mask=ok, other=0)
    return rows, ok, live, tok


@triton.jit
def _grad(z, t, rows, ok, live, tok, cols, col_ok, lse_ptr, ent_ptr, a_ptr, b_ptr2, temp,
          HAS_B: tl.constexpr, HAS_CAP: tl.constexpr):  # fmt: skip
    """``G`` of a tile from its logits (``t = tanh(z_raw / c)`` with the cap) and the rows'
    lse, H, a, b."""
    lse = tl.load(lse_ptr + rows, mask=ok, other=0.0)
    a = tl.load(a_ptr + rows, mask=ok, other=0.0)
    lp = z - lse[:, None]
    p = tl.exp(lp)
    g = -a[:, None] * p
    if HAS_B:
        ent = tl.load(ent_ptr + rows, mask=ok, other=0.0)
        b = tl.load(b_ptr2 + rows, mask=ok, other=0.0)
        g -= b[:, None] * p * (tl.maximum(lp, FLOOR) + ent[:, None])
    g += tl.where(cols[None, :] == tok[:, None], a[:, None], 0.0)
    g = g / temp
    if HAS_CAP:
        g = g * (1.0 - t * t)
    return tl.where(live[:, None] & col_ok[None, :], g, 0.0)


@triton.jit
def _keep(g, rows, ok, a_ptr, b_ptr2, temp, eps, HAS_B: tl.constexpr):
    """The gradient filter's test of a tile of ``G``: some entry above
    ``eps (|a_t| + |b_t|) / T`` of its row (a tile below it everywhere is skipped)."""
    scale = tl.abs(tl.load(a_ptr + rows, mask=ok, other=0.0))
    if HAS_B:
        scale += tl.abs(tl.load(b_ptr2 + rows, mask=ok, other=0.0))
    over = tl.abs(g) > (eps * scale / temp)[:, None]
    return _max(_max(over.to(tl.int32), 1), 0) > 0


@triton.jit
def _finish(m, s0, s1, zy, rows, ok, logp_ptr, ent_ptr, lse_ptr):
    log_s0 = tl.log(s0)
    lse = m + log_s0
    tl.store(logp_ptr + rows, zy - lse, mask=ok)
    tl.store(ent_ptr + rows, log_s0 - s1 / s0, mask=ok)
    tl.store(lse_ptr + rows, lse, mask=ok)


@triton.jit
def fwd(h_ptr, w_ptr, b_ptr, tok_ptr, valid_ptr, logp_ptr, ent_ptr, lse_ptr, part_ptr, N, V,
        D, NSPLIT, temp, cap, HAS_BIAS: tl.constexpr, HAS_VALID: tl.constexpr,
        HAS_CAP: tl.constexpr, UPCAST: tl.constexpr, PARTIAL: tl.constexpr,
        ACC: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    """Program ``(i, s)``: token block ``i`` over vocabulary blocks ``s, s + NSPLIT, ...``;
    with ``PARTIAL`` (``NSPLIT > 1``) it writes its ``(m, s0, s1, z_y)`` to
    ``part[4, NSPLIT, N]`` for :func:`fwd_combine`, else the results."""
    split = tl.program_id(1)
    rows, ok, live, tok = _rows(
        tl.program_id(0).to(tl.int64) * BT, N, tok_ptr, valid_ptr, BT, HAS_VALID
    )
    m = tl.full([BT], -1.0e30, ACC)  # finite: exp(m - m_new) is never exp(-inf + inf)
    s0 = tl.full([BT], 0.0, ACC)
    s1 = tl.full([BT], 0.0, ACC)
    zy = tl.full([BT], 0.0, ACC)
    for v0 in range(split * BV, V, NSPLIT * BV):
        cols = v0 + tl.arange(0, BV).to(tl.int64)
        col_ok = cols < V
        z, _ = _scaled(_tile(h_ptr, w_ptr, b_ptr, rows, live, cols, col_ok, D,
                             HAS_BIAS, UPCAST, ACC, BT, BV, BD), temp, cap, HAS_CAP)  # fmt: skip
        z = tl.where(col_ok[None, :], z, float("-inf"))
        m_new = tl.maximum(m, _max(z, 1))
        alpha = tl.exp(m - m_new)
        x = z - m_new[:, None]
        e = tl.exp(x)
        s1 = alpha * (s1 + (m - m_new) * s0) + _sum(tl.where(e > 0, e * x, 0.0), 1)
        s0 = alpha * s0 + _sum(e, 1)
        m = m_new
        zy += _sum(tl.where(cols[None, :] == tok[:, None], z, 0.0), 1)
    if PARTIAL:
        at = part_ptr + split.to(tl.int64) * N + rows
        step = NSPLIT.to(tl.int64) * N
        tl.store(at, m, mask=ok)
        tl.store(at + step, s0, mask=ok)
        tl.store(at + 2 * step, s1, mask=ok)
        tl.store(at + 3 * step, zy, mask=ok)
    else:
        _finish(m, s0, s1, zy, rows, ok, logp_ptr, ent_ptr, lse_ptr)


@triton.jit
def fwd_combine(part_ptr, logp_ptr, ent_ptr, lse_ptr, N, NSPLIT, ACC: tl.constexpr,
                BT: tl.constexpr):  # fmt: skip
    """The splits' ``(m, s0, s1, z_y)`` merged in split order (``m`` the largest, the sums
    rescaled to it as in :func:`fwd`'s loop), then the results."""
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT).to(tl.int64)
    ok = rows < N
    step = NSPLIT.to(tl.int64) * N
    m = tl.full([BT], -1.0e30, ACC)
    for k in range(0, NSPLIT):
        m = tl.maximum(m, tl.load(part_ptr + k * N + rows, mask=ok, other=-1.0e30))
    s0 = tl.full([BT], 0.0, ACC)
    s1 = tl.full([BT], 0.0, ACC)
    zy = tl.full([BT], 0.0, ACC)
    for k in range(0, NSPLIT):
        at = part_ptr + k * N + rows
        mk = tl.load(at, mask=ok, other=-1.0e30)
        s0k = tl.load(at + step, mask=ok, other=0.0)
        alpha = tl.exp(mk - m)
        s1 += alpha * (tl.load(at + 2 * step, mask=ok, other=0.0) + (mk - m) * s0k)
        s0 += alpha * s0k
        zy += tl.load(at + 3 * step, mask=ok, other=0.0)
    s0 = tl.where(ok, s0, 1.0)  # rows past N (never stored): no log(0)
    _finish(m, s0, s1, zy, rows, ok, logp_ptr, ent_ptr, lse_ptr)


@triton.jit
def bwd_hidden(h_ptr, w_ptr, b_ptr, tok_ptr, valid_ptr, lse_ptr, ent_ptr, a_ptr, bb_ptr,
               gh_ptr, N, V, D, NSPLIT, temp, cap, eps, HAS_BIAS: tl.constexpr,
               HAS_VALID: tl.constexpr, HAS_B: tl.constexpr, HAS_CAP: tl.constexpr,
               FILTER: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr,
               BT: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    """Program ``(i, s)``: token block ``i``'s ``dh`` over vocabulary blocks ``s, s +
    NSPLIT, ...``, into ``gh[s]`` (``gh [NSPLIT, N, D]``; every split has a block). With
    ``FILTER`` (``gh`` zeroed) a tile that :func:`_keep` rejects adds nothing."""
    split = tl.program_id(1)
    first = split * BV
    gh_ptr += split.to(tl.int64) * N * D
    rows, ok, live, tok = _rows(
        tl.program_id(0).to(tl.int64) * BT, N, tok_ptr, valid_ptr, BT, HAS_VALID
    )
    stride = NSPLIT * BV
    for j in range(0, (V - first + stride - 1) // stride):  # this split's vocabulary blocks
        v0 = first + j * stride
        cols = v0 + tl.arange(0, BV).to(tl.int64)
        col_ok = cols < V
        z, t = _scaled(_tile(h_ptr, w_ptr, b_ptr, rows, live, cols, col_ok, D,
                             HAS_BIAS, UPCAST, ACC, BT, BV, BD), temp, cap, HAS_CAP)  # fmt: skip
        g = _grad(z, t, rows, ok, live, tok, cols, col_ok, lse_ptr, ent_ptr, a_ptr, bb_ptr,
                  temp, HAS_B, HAS_CAP)  # fmt: skip
        keep = True
        if FILTER:
            keep = _keep(g, rows, ok, a_ptr, bb_ptr, temp, eps, HAS_B)
        g = _narrow(g, w_ptr.dtype.element_ty)
        if keep:
            for k0 in range(0, D, BD):
                ks = k0 + tl.arange(0, BD)
                k_ok = ks < D
                w = tl.load(w_ptr + cols[:, None] * D + ks[None, :],
                            mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
                at = gh_ptr + rows[:, None] * D + ks[None, :]
                both = ok[:, None] & k_ok[None, :]
                # the first tile stores (no zeroed buffer), unless tiles may be skipped
                acc = tl.load(at, mask=both & ((j > 0) | FILTER), other=0.0)
                tl.store(at, _dot(g, w, acc, UPCAST, ACC), mask=both)
                tl.debug_barrier()  # this program's next read of the same rows sees it


@triton.jit
def bwd_weight(h_ptr, w_ptr, b_ptr, tok_ptr, valid_ptr, lse_ptr, ent_ptr, a_ptr, bb_ptr,
               gw_ptr, gb_ptr, scr_ptr, N, V, D, NPROG, temp, cap, eps,
               HAS_BIAS: tl.constexpr, HAS_VALID: tl.constexpr, HAS_B: tl.constexpr,
               HAS_CAP: tl.constexpr, NEED_W: tl.constexpr, NEED_BIAS: tl.constexpr,
               SCRATCH: tl.constexpr, FILTER: tl.constexpr, UPCAST: tl.constexpr,
               ACC: tl.constexpr,
               BT: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    """Persistent: program ``p`` of ``NPROG`` takes vocabulary blocks ``p, p + NPROG, ...``
    and accumulates each block's ``dW`` rows over the token tiles, in the weight gradient
    itself when it has the compute dtype, else (``SCRATCH``) in its own float32 rows
    ``scr[p]``, written out in the weight's dtype when the block is done. With ``FILTER``
    (the accumulators zeroed) a tile that :func:`_keep` rejects adds nothing to ``dW``
    (the bias gradient stays exact)."""
    pid = tl.program_id(0)
    lanes = tl.arange(0, BV).to(tl.int64)
    own = scr_ptr + pid.to(tl.int64) * BV * D
    for v0 in range(pid * BV, V, NPROG * BV):
        cols = v0 + lanes
        col_ok = cols < V
        col_sum = tl.full([BV], 0.0, ACC)
        for t0 in range(0, N, BT):
            rows, ok, live, tok = _rows(t0, N, tok_ptr, valid_ptr, BT, HAS_VALID)
            z, t = _scaled(_tile(h_ptr, w_ptr, b_ptr, rows, live, cols, col_ok, D,
                                 HAS_BIAS, UPCAST, ACC, BT, BV, BD), temp, cap, HAS_CAP)  # fmt: skip
            g = _grad(z, t, rows, ok, live, tok, cols, col_ok, lse_ptr, ent_ptr, a_ptr,
                      bb_ptr, temp, HAS_B, HAS_CAP)  # fmt: skip
            keep = True
            if FILTER:
                keep = _keep(g, rows, ok, a_ptr, bb_ptr, temp, eps, HAS_B)
            g = _narrow(g, w_ptr.dtype.element_ty)
            if NEED_BIAS:
                col_sum += _sum(g.to(ACC), 0)
            if NEED_W:  # noqa: SIM102 (a constexpr, then a runtime branch)
                if keep:
                    gt = tl.trans(g)
                    for k0 in range(0, D, BD):
                        ks = k0 + tl.arange(0, BD)
                        k_ok = ks < D
                        h = tl.load(h_ptr + rows[:, None] * D + ks[None, :],
                                    mask=live[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
                        if SCRATCH:
                            at = own + lanes[:, None] * D + ks[None, :]
                        else:
                            at = gw_ptr + cols[:, None] * D + ks[None, :]
                        both = col_ok[:, None] & k_ok[None, :]
                        # the first tile stores (no zeroed buffer) unless tiles may be skipped
                        acc = tl.load(at, mask=both & ((t0 > 0) | FILTER), other=0.0)
                        tl.store(at, _dot(gt, h, acc, UPCAST, ACC), mask=both)
                        tl.debug_barrier()  # this program's next read of the same rows sees it
        if NEED_W and SCRATCH:  # the block's rows, rounded once to the weight's dtype
            for k0 in range(0, D, BD):
                ks = k0 + tl.arange(0, BD)
                both = col_ok[:, None] & (ks < D)[None, :]
                acc = tl.load(own + lanes[:, None] * D + ks[None, :], mask=both, other=0.0)
                tl.store(gw_ptr + cols[:, None] * D + ks[None, :],
                         _narrow(acc, gw_ptr.dtype.element_ty), mask=both)  # fmt: skip
                if FILTER:  # zero again for the next block, whose tiles all add
                    tl.store(own + lanes[:, None] * D + ks[None, :],
                             tl.full([BV, BD], 0.0, ACC), mask=both)  # fmt: skip
            tl.debug_barrier()  # the next block's first tile overwrites these rows
        if NEED_BIAS:
            tl.store(gb_ptr + cols, col_sum, mask=col_ok)
