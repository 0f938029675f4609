r"""The two Triton kernels of ``CompiledPolicyLoss(backend="triton")`` (documented in
:mod:`dapo_ops.engine._triton_loss`).

Private. Importing this module imports Triton; it is loaded on first use, once per mode
(:func:`dapo_ops._core._triton.load_kernels`). Only builtins of ``triton.language`` and
this module's own jit functions are called (the library's jit helpers such as
``tl.sum`` are bound to the mode Triton was first imported in; under the interpreter
``_sum`` hands ``tl.standard._sum_combine`` to ``tl.reduce``, which knows it and sums with
numpy without calling it). No type annotations: Triton reads them as its own.

Parameters travel in a small tensor ``prm`` in the compute dtype (a Python float
argument would be rounded to float32): ``prm[0:4]`` the objective's, ``prm[4:7]`` the KL
penalty's ``beta``, ``log_ratio_clamp`` and ``clamp``, ``prm[7]`` the objective's
``log_ratio_clamp``, ``prm[8]`` the ``max_len`` of ``seq_mean_token_sum_norm``.
"""
# mypy: ignore-errors

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

#: The mode this module was loaded in (``dapo_ops._core._triton.load_kernels`` sets
#: ``TRITON_INTERPRET`` while it runs): under the interpreter a branch never compiled.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")

NAN_ALL = tl.constexpr(tl.PropagateNan.ALL)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _sum(x):
    if INTERPRETED:  # the interpreter sums with numpy only for the library's own combine
        return tl.reduce(x, 0, tl.standard._sum_combine)
    return tl.reduce(x, 0, _add)


@triton.jit
def _exp(x):
    """``e^x`` correctly rounded to within an ulp: libdevice's on a GPU, where ``tl.exp``
    is ``ex2.approx`` of ``x log2 e`` (its error grows with ``|x|``); numpy's under the
    interpreter."""
    if INTERPRETED:
        return tl.exp(x)
    return libdevice.exp(x)


@triton.jit
def _log(x):
    """``log x`` within an ulp (libdevice's on a GPU, not ``lg2.approx``)."""
    if INTERPRETED:
        return tl.log(x)
    return libdevice.log(x)


@triton.jit
def _clamp(x, lo, hi):
    """``torch.clamp(x, lo, hi)``: ``min(max(x, lo), hi)``, NaN kept."""
    return tl.minimum(tl.maximum(x, lo, propagate_nan=NAN_ALL), hi, propagate_nan=NAN_ALL)


@triton.jit
def _expm1(x):
    """``e^x - 1`` to a few ulps near 0 (Kahan: ``(u - 1) x / log u``, ``u = e^x``)."""
    u = _exp(x)
    um1 = u - 1.0
    safe = tl.where((u == 1.0) | (um1 == -1.0), 2.0, u)
    return tl.where(u == 1.0, x, tl.where(um1 == -1.0, -1.0, um1 * x / _log(safe)))


@triton.jit
def _objective(lp, old, lr, cl, r, a, zero, p0, p1, p2, p3, OBJ: tl.constexpr):
    """``(term, d term / d logp)`` per token: the formulas of the objective's ``term`` and
    ``grad``, numbered as ``_triton_loss.OBJECTIVES``; ``zero`` is a block of zeros (never
    ``0 * x``, which is NaN where ``x`` is not finite)."""
    if OBJ == 0:  # ClipHigher: [lo, hi] = [p0, p1] where A < 0, else [p3, p2] (p3 = -inf)
        neg = a < 0
        bounded = _clamp(r, tl.where(neg, p0, p3), tl.where(neg, p1, p2))
        term = -a * bounded
        g = tl.where((cl == lr) & (bounded == r), -a * r, zero)
    elif OBJ == 1:  # PolicyGradient
        term = -a * lp
        g = -a
    elif OBJ == 2:  # RatioSurrogate
        term = -a * r
        g = tl.where(cl == lr, -a * r, zero)
    elif OBJ == 3:  # CISPO: p0 = 1 - eps_low, p1 = 1 + eps_high
        w = _clamp(r, p0, p1)
        term = -w * a * lp
        g = -w * a
    elif OBJ == 4:  # TOPR: p0 = pos_coef, p1 = neg_coef
        w = tl.where(a > 0, zero + p0, tl.minimum(r, 1.0, propagate_nan=NAN_ALL) * p1)
        term = -w * a * lp
        g = -w * a
    elif OBJ == 5:  # DRO: p0 = beta
        term = -(lp * a - (0.5 * p0) * (lr * lr))
        g = p0 * lr - a
    elif OBJ == 6:  # SAPO: p0 = tau_pos, p1 = tau_neg
        tau = tl.where(a > 0, p0, p1)
        gate = 1.0 / (1.0 + _exp(-(tau * (r - 1.0))))
        term = -(gate * (4.0 / tau)) * a
        g = tl.where(cl == lr, -a * ((4.0 * gate * (1.0 - gate)) * r), zero)
    else:  # DPPO, OBJ 7 "tv", 8 "kl": p0 = delta_low, p1 = delta_high, p2 = is_cap, p3 = 1e-8
        p = _exp(lp)
        q = _exp(old)
        if OBJ == 7:
            up = (p - q) <= p1
            down = (p - q) >= -p0
        else:
            bkl = q * (old - lp) + (1.0 - q) * _log((1.0 - q + p3) / (1.0 - p + p3))
            up = (bkl <= p1) | (p <= q)
            down = (bkl <= p0) | (p >= q)
        inside = tl.where(a > 0, up, down)
        w = tl.where(inside, tl.minimum(r, p2, propagate_nan=NAN_ALL), zero)
        term = -a * w * lp
        g = -a * w
    return term, g


@triton.jit
def _kl(raw, zero, beta, lrc, cap, KL: tl.constexpr, ST: tl.constexpr, CAP: tl.constexpr):
    """``(beta k(delta), beta d k / d logp)`` of ``KLPenalty``: KL 1 k1, 2 k2, 3 k3, 4 abs."""
    delta = _clamp(raw, -lrc, lrc)
    if KL == 1:
        est = delta
        slope = zero + 1.0
    elif KL == 2:
        est = 0.5 * delta * delta
        slope = delta
    elif KL == 3:
        em = _expm1(-delta)
        est = em + delta
        slope = -em
    else:  # sign(delta), NaN kept
        est = tl.abs(delta)
        slope = tl.where(
            delta > 0, 1.0, tl.where(delta < 0, -1.0, tl.where(delta == 0, zero, delta))
        )
    keep = raw == delta
    if CAP:  # clamp's convention: the gradient passes on the bounds
        keep = keep & (tl.abs(est) <= cap)
        est = _clamp(est, -cap, cap)
    # straight-through: k2's gradient, of the raw log-ratio
    g = beta * raw if ST else tl.where(keep, beta * slope, zero)
    return beta * est, g


@triton.jit
def loss_forward(
    lp_ptr, old_ptr, adv_ptr, valid_ptr, ref_ptr, rho_ptr, kappa_ptr, prm_ptr, den_ptr,
    u_ptr, part_ptr, cnt_ptr, sem_ptr, loss_ptr, scale_ptr,
    T, C, NPROG, s_lp, s_old, s_adv, s_adv_t, s_valid, s_ref, s_rho, s_kappa, den_int,
    OBJ: tl.constexpr, KL: tl.constexpr, KL_ST: tl.constexpr, KL_CAP: tl.constexpr,
    HAS_RHO: tl.constexpr, HAS_KAPPA: tl.constexpr, MODE: tl.constexpr, DEN: tl.constexpr,
    WITH_GRAD: tl.constexpr, COMPUTE: tl.constexpr, BLOCK: tl.constexpr, RB: tl.constexpr,
):  # fmt: skip
    """Program ``(row, chunk)``: the masked per-token loss and ``u = d/dlogp`` of it (before
    the aggregation weight) for ``BLOCK`` tokens, the chunk's loss sum and token count in
    ``part``; the last program to finish (a ticket on ``sem``) reduces ``part`` in a fixed
    order, writes the loss and the aggregation weights and resets the ticket."""
    pid = tl.program_id(0)
    row = (pid // C).to(tl.int64)  # row * stride may pass 2^31
    offs = (pid % C) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < T
    m = tl.load(valid_ptr + row * s_valid + offs, mask=ok, other=0) != 0
    lp = tl.load(lp_ptr + row * s_lp + offs, mask=ok, other=0.0).to(COMPUTE)
    old = tl.load(old_ptr + row * s_old + offs, mask=ok, other=0.0).to(COMPUTE)
    a = tl.load(adv_ptr + row * s_adv + offs * s_adv_t, mask=ok, other=0.0).to(COMPUTE)
    lrc = tl.load(prm_ptr + 7)
    lr = lp - old
    cl = _clamp(lr, -lrc, lrc)
    p0, p1 = tl.load(prm_ptr), tl.load(prm_ptr + 1)
    p2, p3 = tl.load(prm_ptr + 2), tl.load(prm_ptr + 3)
    zero = tl.full([BLOCK], 0.0, COMPUTE)
    term, g = _objective(lp, old, lr, cl, _exp(cl), a, zero, p0, p1, p2, p3, OBJ)
    if HAS_RHO:
        rho = tl.load(rho_ptr + row * s_rho + offs, mask=ok, other=0.0).to(COMPUTE)
        term = term * rho
        g = g * rho
    if KL != 0:
        ref = tl.load(ref_ptr + row * s_ref + offs, mask=ok, other=0.0).to(COMPUTE)
        beta, klc, cap = tl.load(prm_ptr + 4), tl.load(prm_ptr + 5), tl.load(prm_ptr + 6)
        kv, kg = _kl(lp - ref, zero, beta, klc, cap, KL, KL_ST, KL_CAP)
        if HAS_KAPPA:
            kappa = tl.load(kappa_ptr + row * s_kappa + offs, mask=ok, other=0.0).to(COMPUTE)
            kv = kv * kappa
            kg = kg * kappa
        term = term + kv
        g = g + kg
    if WITH_GRAD:
        tl.store(u_ptr + row * T + offs, tl.where(m, g, zero), mask=ok)
    tl.store(part_ptr + pid, _sum(tl.where(m, term, zero)))
    tl.store(cnt_ptr + pid, _sum(m.to(tl.int32)))
    tl.debug_barrier()  # every thread's stores before the ticket (release)
    if tl.atomic_add(sem_ptr, 1, sem="acq_rel") == NPROG - 1:
        _finish(part_ptr, cnt_ptr, den_ptr, loss_ptr, scale_ptr, prm_ptr, den_int, NPROG // C, C,
                MODE, DEN, COMPUTE, RB)  # fmt: skip
        tl.atomic_xchg(sem_ptr, 0)


@triton.jit
def _rows(part_ptr, cnt_ptr, rows, live, C, COMPUTE: tl.constexpr, RB: tl.constexpr):
    """Loss sums and token counts (int32) of ``rows``, their chunks added in order."""
    s = tl.full([RB], 0.0, COMPUTE)
    n = tl.full([RB], 0, tl.int32)
    for c in range(0, C):
        s += tl.load(part_ptr + rows * C + c, mask=live, other=0.0, volatile=True)
        n += tl.load(cnt_ptr + rows * C + c, mask=live, other=0, volatile=True)
    return s, n


@triton.jit
def _finish(part_ptr, cnt_ptr, den_ptr, loss_ptr, scale_ptr, prm_ptr, den_int, B, C,
            MODE: tl.constexpr, DEN: tl.constexpr, COMPUTE: tl.constexpr, RB: tl.constexpr):  # fmt: skip
    """``loss_scale`` and ``scaled_sum`` of :mod:`dapo_ops.engine.aggregation` on the chunk
    sums: MODE 0 token_mean, 1 seq_mean_token_mean, 2 seq_mean_token_sum, 3 its _norm.
    DEN 0: the local count; 1: the integer ``den_int``; 2: the 0-dim tensor at ``den_ptr``.
    Counts are added as integers and rounded to the compute dtype once, as
    ``loss_scale``'s."""
    zero = tl.full([RB], 0.0, COMPUTE)
    total = _sum(zero)
    count = _sum(tl.full([RB], 0, tl.int64))
    seqs = count
    for r0 in range(0, B, RB):
        rows = r0 + tl.arange(0, RB)
        live = rows < B
        s, n = _rows(part_ptr, cnt_ptr, rows, live, C, COMPUTE, RB)
        total += _sum(s)
        count += _sum(n.to(tl.int64))
        seqs += _sum((n > 0).to(tl.int64))
    nil = _sum(zero)  # 0 in the compute dtype (total may be NaN: the weights never are)
    if DEN == 0 and MODE == 0:
        den = nil + count.to(COMPUTE)
    elif DEN == 0:
        den = nil + seqs.to(COMPUTE)
    elif DEN == 1:
        den = nil + den_int
    else:
        den = nil + tl.load(den_ptr).to(COMPUTE)
    # a count of 0 (or a normaliser of 0) is replaced by 1: the loss is then 0
    w = 1.0 / tl.where(den == 0, 1.0, den)
    if MODE == 3:
        w = w / tl.load(prm_ptr + 8)
    if MODE == 1:
        loss = nil
        for r0 in range(0, B, RB):
            rows = r0 + tl.arange(0, RB)
            live = rows < B
            s, n = _rows(part_ptr, cnt_ptr, rows, live, C, COMPUTE, RB)
            wr = w / tl.where(n == 0, 1.0, n.to(COMPUTE))
            loss += _sum(tl.where(live, s * wr, zero))
            tl.store(scale_ptr + rows, wr, mask=live)
    else:
        loss = total * w
        tl.store(scale_ptr, w)
    tl.store(loss_ptr, loss)


@triton.jit
def loss_backward(u_ptr, scale_ptr, go_ptr, out_ptr, T, C, s_out, PER_ROW: tl.constexpr,
                  COMPUTE: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """``d loss / d logp = u * (w_row * grad_out)``, in the dtype of ``out``."""
    pid = tl.program_id(0)
    row = (pid // C).to(tl.int64)
    offs = (pid % C) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < T
    w = tl.load(scale_ptr + row * PER_ROW) * tl.load(go_ptr).to(COMPUTE)
    u = tl.load(u_ptr + row * T + offs, mask=ok, other=0.0)
    tl.store(out_ptr + row * s_out + offs, (u * w).to(out_ptr.dtype.element_ty), mask=ok)
