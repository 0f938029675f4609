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
    here = (tok >= 0) & (tok < V)
    hit = tl.arange(0, 2) == 0
    _zy, xy, _ty = _inputs(base, row, tok + tl.arange(0, 2), hit & here, tok, tau_ptr, par_ptr,
                           HAS_TAU, HAS_CAP, ACC)  # fmt: skip
    xy = _sum(tl.where(hit & here, xy, 0.0))
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
