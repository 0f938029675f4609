r"""The Triton row kernels of :mod:`dapo_ops.kernels.rows` (which documents them).

Private. Importing this module imports Triton: :func:`dapo_ops.kernels.rows.triton_kernels`
loads it on first use only, once per mode (``triton.jit`` reads ``TRITON_INTERPRET``
when a kernel is defined, and the interpreter re-reads each kernel's module globals, so
the kernels live at module level). No type annotations: Triton reads them as its own.

Both kernels read a block of logits ``z`` (a row stride apart, any float dtype), turn it
into the softmax's inputs ``x = cap(z) / T`` in ``ACC`` (float32, or float64 for float64
logits; ``T`` and the cap are read from a tensor of that dtype, never passed as Python
floats, which Triton would narrow to float32) and, with a truncation, drop the columns
whose raw logit is below the row's threshold ``tau`` (the chosen column always stays).
"""
# mypy: ignore-errors

import os

import triton
import triton.language as tl

#: The mode this module was loaded in (``dapo_ops._core._triton.load_kernels`` sets
#: ``TRITON_INTERPRET`` while it runs): under the interpreter a branch never compiled.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")

# Only builtins of triton.language and this module's own jit functions are called: the
# library's jit helpers (tl.sum, tl.max) are defined when triton is imported, compiled
# or interpreted once for all, and this module may be loaded in the other mode.


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _greater(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sum(x):
    if INTERPRETED:  # the interpreter sums with numpy only for the library's own combine
        return tl.reduce(x, 0, tl.standard._sum_combine)
    return tl.reduce(x, 0, _add)


@triton.jit
def _max(x):
    return tl.reduce(x, 0, _greater)


@triton.jit
def _tanh(x):
    """``tanh`` from ``exp``, odd by construction: ``e = exp(-2|x|)`` in ``(0, 1]``."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _narrow(x, dtype: tl.constexpr):
    """``x`` in ``dtype``, rounded to nearest even as a GPU's cast rounds. The interpreter
    (Triton 3.6 to 3.9) truncates a float32 -> bfloat16 cast, so there the bits are
    rounded first (finite ``x``: bias ``0x7FFF`` plus the kept last bit, then cut)."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _inputs(z_ptr, row, cols, ok, tok, tau_ptr, par_ptr, HAS_TAU: tl.constexpr,
            HAS_CAP: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """``(z, x, t)`` of one block of a row: the raw logits in ACC, ``x = cap(z) / T``
    (``-inf`` off the block, or dropped by the truncation), ``t = tanh(z / c)``."""
    z = tl.load(z_ptr + cols, mask=ok, other=0.0).to(ACC)
    temp = tl.load(par_ptr)
    x, t = z, z
    if HAS_CAP:
        t = _tanh(z / tl.load(par_ptr + 1))
        x = t * tl.load(par_ptr + 1)
    if ACC == tl.float32:  # noqa: SIM108, SIM300  IEEE division as ATen's (default: 2 ulps)
        x = tl.math.div_rn(x, temp)
    else:  # float64 division is IEEE
        x = x / temp
    keep = ok
    if HAS_TAU:
        keep = ok & ((z >= tl.load(tau_ptr + row)) | (cols == tok))
    return z, tl.where(keep, x, float("-inf")), t


@triton.jit
def _block_stats(x, m):
    """``(m', s0, s1)`` of a block against the running max ``m``: ``m' = max(m, max x)``,
    ``s0 = sum e^{x-m'}``, ``s1 = sum e^{x-m'} (x - m')`` (``-inf`` entries add 0)."""
    new = tl.maximum(m, _max(x))
    ref = tl.where(new == float("-inf"), 0.0, new)
    d = x - ref
    e = tl.exp(d)
    return new, ref, _sum(e), _sum(tl.where(e > 0.0, e * d, 0.0))


@triton.jit
def stats(z_ptr, z_stride, tok_ptr, tau_ptr, par_ptr, out_ptr, N, V,
          HAS_TAU: tl.constexpr, HAS_CAP: tl.constexpr, ACC: tl.constexpr,
          BLOCK: tl.constexpr):  # fmt: skip
    """Pass 1, a program per row: the online log-sum-exp over the row's ``V`` columns,
    ``out[0..3, row] = (m, s0, s1, x_y)``: the max, ``sum e^{x-m}``, ``sum e^{x-m}(x-m)``
    and the chosen column's ``x`` (0 when ``tok`` is not in ``[0, V)``)."""
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * z_stride
    tok = tl.load(tok_ptr + row)
    cols = tl.arange(0, BLOCK)
    ok = cols < V
    _z0, x, _t0 = _inputs(base, row, cols, ok, tok, tau_ptr, par_ptr, HAS_TAU, HAS_CAP, ACC)
    m, _r0, s0, s1 = _block_stats(x, _max(x))
    for start in range(BLOCK, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < V
        _zb, x, _tb = _inputs(base, row, cols, ok, tok, tau_ptr, par_ptr, HAS_TAU, HAS_CAP, ACC)
        new, ref, b0, b1 = _block_stats(x, m)
        dm = tl.where(m == float("-inf"), 0.0, m - ref)  # s0 = 0 there: no -inf * 0
        scale = tl.exp(dm)
        s1 = scale * (s1 + s0 * dm) + b1
        s0 = scale * s0 + b0
        m = new
    # The chosen column's two-wide block, its first lane live when ``tok`` is in [0, V):
    # block comparisons only (Triton 3.9's interpreter miscasts a scalar bool and'ed with a
    # block to int32, which a load refuses as a mask).
    pair = tok + tl.arange(0, 2)
    hit = (pair == tok) & (pair >= 0) & (pair < V)
    _zy, xy, _ty = _inputs(base, row, pair, hit, tok, tau_ptr, par_ptr,
                           HAS_TAU, HAS_CAP, ACC)  # fmt: skip
    xy = _sum(tl.where(hit, xy, 0.0))
    tl.store(out_ptr + row, m)
    tl.store(out_ptr + N + row, s0)
    tl.store(out_ptr + 2 * N + row, s1)
    tl.store(out_ptr + 3 * N + row, xy)


@triton.jit
def grad(z_ptr, z_stride, g_ptr, g_stride, tok_ptr, tau_ptr, par_ptr, lse_ptr, ent_ptr,
         a_ptr, b_ptr, V, HAS_TAU: tl.constexpr, HAS_CAP: tl.constexpr, HAS_B: tl.constexpr,
         ACC: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Pass 2, a program per ``(row, block of BLOCK columns)``: the gradient of
    ``a logp_y + b H`` w.r.t. the raw logits, ``G = (a (delta_y - p) - b p (l + H)) / T``
    (times ``1 - t^2`` with the cap), ``l = x - lse``, ``p = e^l``, written in ``g``'s
    dtype (``g`` may be ``z`` itself: each entry is read before it is written)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    tok = tl.load(tok_ptr + row)
    _z, x, t = _inputs(z_ptr + row * z_stride, row, cols, ok, tok, tau_ptr, par_ptr,
                       HAS_TAU, HAS_CAP, ACC)  # fmt: skip
    lp = x - tl.load(lse_ptr + row)
    p = tl.exp(lp)
    a = tl.load(a_ptr + row)
    g = -a * p
    if HAS_B:
        b = tl.load(b_ptr + row)
        g -= b * tl.where(p > 0.0, p * (lp + tl.load(ent_ptr + row)), 0.0)
    g += tl.where(cols == tok, a, 0.0)
    g = g / tl.load(par_ptr)
    if HAS_CAP:
        g = g * (1.0 - t * t)
    tl.store(g_ptr + row * g_stride + cols, _narrow(g, g_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _distill_terms(x, y, lse, lse_t, par_ptr, KIND: tl.constexpr):
    """``(s, t, p_s, p_t, m)`` of a block: the student's and teacher's log-probs floored at
    ``FLOOR`` (``par[2]``), their probabilities, and the JSD's mixture ``m`` (``par[3:5]``
    = ``log(1 - beta)``, ``log(beta)``)."""
    floor = tl.load(par_ptr + 2)
    s = tl.maximum(x - lse, floor)
    t = tl.maximum(y - lse_t, floor)
    ps = tl.exp(x - lse)
    pt = tl.exp(t)
    m = s
    if KIND == 2:
        a = s + tl.load(par_ptr + 3)
        b = t + tl.load(par_ptr + 4)
        hi = tl.maximum(a, b)
        m = hi + tl.log(tl.exp(a - hi) + tl.exp(b - hi))
    return s, t, ps, pt, m


@triton.jit
def distill_sums(z_ptr, z_stride, y_ptr, y_stride, par_ptr, lse_ptr, lse_t_ptr, out_ptr, N, V,
                 KIND: tl.constexpr, HAS_CAP: tl.constexpr, ACC: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    """Pass 1's second round, a program per row: ``out[0..1, row]`` the two sums of the
    whole-vocabulary kind ``KIND`` (0 forward KL: ``sum p_t (t - s)``, ``sum p_t``; 1
    reverse KL: ``sum p_s (s - t)`` twice; 2 JSD: ``sum p_t (t - m)``, ``sum p_s (s -
    m)``) over this rank's columns, the log-sum-exps known."""
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    lse_t = tl.load(lse_t_ptr + row)
    temp = tl.load(par_ptr)
    acc0 = tl.full([BLOCK], 0.0, ACC)  # tl.full, a builtin (tl.zeros is a jit helper)
    acc1 = tl.full([BLOCK], 0.0, ACC)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < V
        _zz, x, _tt = _inputs(z_ptr + row * z_stride, row, cols, ok, 0, par_ptr, par_ptr,
                              False, HAS_CAP, ACC)  # fmt: skip
        y = tl.load(y_ptr + row * y_stride + cols, mask=ok, other=0.0).to(ACC) / temp
        s, t, ps, pt, m = _distill_terms(x, y, lse, lse_t, par_ptr, KIND)
        if KIND == 0:
            acc0 += tl.where(ok, pt * (t - s), 0.0)
            acc1 += tl.where(ok, pt, 0.0)
        elif KIND == 1:  # the loss is the row's number too
            acc0 += tl.where(ok, ps * (s - t), 0.0)
            acc1 += tl.where(ok, ps * (s - t), 0.0)
        else:
            acc0 += tl.where(ok, pt * (t - m), 0.0)
            acc1 += tl.where(ok, ps * (s - m), 0.0)
    tl.store(out_ptr + row, _sum(acc0))
    tl.store(out_ptr + N + row, _sum(acc1))


@triton.jit
def distill_grad(z_ptr, z_stride, y_ptr, y_stride, g_ptr, g_stride, par_ptr, lse_ptr, lse_t_ptr,
                 row_ptr, coef_ptr, valid_ptr, V, KIND: tl.constexpr, HAS_CAP: tl.constexpr,
                 ACC: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Pass 2 of a whole-vocabulary kind, a program per ``(row, block of columns)``: ``G =
    coef (p_s r - p_t)`` (forward KL, ``r = sum p_t``), ``coef p_s (s - t - r)`` (reverse
    KL, ``r`` the loss), ``coef (1 - beta) p_s (s - m - r)`` (JSD, ``r = KL(s || m)``;
    ``par[5] = 1 - beta``), times the cap's ``1 - t^2``; ``coef`` per row is the token's
    weight over T (0 at masked and clamped tokens); a masked row's teacher logits are read
    as 0 (whatever they hold)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    _zz, x, tc = _inputs(z_ptr + row * z_stride, row, cols, ok, 0, par_ptr, par_ptr,
                         False, HAS_CAP, ACC)  # fmt: skip
    # A select, not ``ok & scalar``: Triton 3.9's interpreter miscasts a scalar bool and'ed
    # with a block (see ``stats``).
    live = tl.where(tl.load(valid_ptr + row) != 0, ok, False)
    y = tl.load(y_ptr + row * y_stride + cols, mask=live, other=0.0).to(ACC) / tl.load(par_ptr)
    s, t, ps, pt, m = _distill_terms(x, y, tl.load(lse_ptr + row), tl.load(lse_t_ptr + row),
                                     par_ptr, KIND)  # fmt: skip
    r = tl.load(row_ptr + row)
    if KIND == 0:
        g = ps * r - pt
    elif KIND == 1:
        g = ps * (s - t - r)
    else:
        g = tl.load(par_ptr + 5) * ps * (s - m - r)
    g = g * tl.load(coef_ptr + row)
    if HAS_CAP:
        g = g * (1.0 - tc * tc)
    g = tl.where(ok, g, 0.0)
    tl.store(g_ptr + row * g_stride + cols, _narrow(g, g_ptr.dtype.element_ty), mask=ok)


@triton.jit
def scaled_probs(z_ptr, z_stride, g_ptr, g_stride, par_ptr, lse_ptr, coef_ptr, V,
                 HAS_CAP: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """``G = coef p_s`` (times the cap's ``1 - t^2``), a program per ``(row, block)``: the
    part off the ids of a support path's gradient (``coef`` = alpha times the weight / T)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    _zz, x, tc = _inputs(z_ptr + row * z_stride, row, cols, ok, 0, par_ptr, par_ptr,
                         False, HAS_CAP, ACC)  # fmt: skip
    g = tl.exp(x - tl.load(lse_ptr + row)) * tl.load(coef_ptr + row)
    if HAS_CAP:
        g = g * (1.0 - tc * tc)
    g = tl.where(ok, g, 0.0)
    tl.store(g_ptr + row * g_stride + cols, _narrow(g, g_ptr.dtype.element_ty), mask=ok)
