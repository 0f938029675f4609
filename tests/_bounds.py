"""Rounding-error bounds: the tolerances of the numerical tests, derived, not tuned.

A float32 (or bfloat16) result is compared with an exact reference computed in float64
on the same input values, and must lie within a bound derived from the computation. Two
float32 paths are never compared with each other directly: they may round differently
(a different order of summation on another CPU, thread count or kernel), and each is
only promised to be close to the exact value. The model (Higham, *Accuracy and
Stability of Numerical Algorithms*, 2nd ed., chapters 2-4), with ``u`` the unit
roundoff of the dtype that does the arithmetic (``eps / 2``: ``2**-24`` for float32,
``2**-53`` for float64, ``2**-8`` for bfloat16):

- ``+ - * /`` and ``sqrt`` are correctly rounded: ``fl(a op b) = (a op b)(1 + d)``,
  ``|d| <= u``; a conversion to a narrower dtype rounds once, by at most ``u`` of the
  value or, below the smallest normal number (gradual underflow), half the spacing of
  the subnormals (:func:`round_bound`).
- A sum of ``n`` terms, **in any order** (sequential, pairwise, SIMD lanes, split across
  threads), is within ``gamma(n - 1) * sum |x_i|`` of the exact sum, with
  ``gamma(k) = k u / (1 - k u)``. So is each entry of a matrix product (``n`` the inner
  dimension). This is the bound that holds whatever order ATen picks on AVX-512, AVX2,
  the scalar ``default`` path or any thread count.
- ``exp``, ``log`` and the other elementary functions are within :data:`FUNC_ULPS` units
  in the last place, i.e. a relative error of at most ``2 * FUNC_ULPS * u``.

The float64 reference is itself a float64 evaluation; the bounds below add its own
rounding (the same derivation with float64's ``u``), so they bound
``|computed - reference|``, and also serve to compare two float64 computations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

F64 = torch.float64

#: Accuracy assumed of every elementary function (exp, log, ...) of ATen, in ulps: the
#: loosest exp ATen ships for its CPU kernels, the vectorised ``exp_u20`` ("ULP=20" in
#: ATen/cpu/vec), bounds them all; SLEEF's (AVX2, AVX-512) are within 1 ulp, libm's (the
#: ``default`` capability) within 1-2, CUDA's ``expf``/``logf`` within 2.
FUNC_ULPS = 20


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u = eps / 2``: the largest relative error of one correctly rounded operation."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype) -> float:
    """``gamma(n) = n u / (1 - n u)``: relative error bound of ``n`` chained roundings;
    ``gamma(n - 1) * sum |x|`` bounds a sum of ``n`` terms in any order."""
    nu = max(n, 0) * unit_roundoff(dtype)
    assert nu < 0.5, f"gamma({n}) is not a useful bound in {dtype}"
    return nu / (1 - nu)


def gamma_ref(n: int, dtype: torch.dtype) -> float:
    """``gamma(n)`` in ``dtype`` plus ``gamma(n)`` in float64: a bound on the computed value's
    distance to a reference that is itself a float64 *evaluation* of the exact value. So a
    float64 computation may be checked against another float64 one, too."""
    return gamma(n, dtype) + gamma(n, F64)


def func_rel(dtype: torch.dtype) -> float:
    """Relative error bound of one elementary-function evaluation: FUNC_ULPS ulps."""
    return 2 * FUNC_ULPS * unit_roundoff(dtype)


def round_bound(x_abs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``|fl(x) - x|`` for one rounding of ``x`` to ``dtype``: ``u |x| + tiny * eps / 2``
    (the second term is half the subnormal spacing, for results that underflow)."""
    info = torch.finfo(dtype)
    return unit_roundoff(dtype) * x_abs + info.smallest_normal * info.eps / 2


def sum_bound(abs_sum: torch.Tensor | float, n: int, dtype: torch.dtype) -> torch.Tensor | float:
    """``|fl(sum x) - sum x| <= gamma(n - 1) * sum |x|``, for ``n`` terms in any order (with
    the float64 reference's own ``gamma``: :func:`gamma_ref`)."""
    return gamma_ref(max(n - 1, 0), dtype) * abs_sum


def matmul_bound(a_abs: torch.Tensor, b_abs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Entrywise bound on ``fl(a @ b) - a @ b``: ``gamma(k) * (|a| @ |b|)``, ``k`` the inner
    dimension (the products round once each, the sum of ``k`` of them at most ``k - 1``
    times; with the reference's own: :func:`gamma_ref`). Arguments ``|a|``, ``|b|``."""
    return gamma_ref(a_abs.shape[-1], dtype) * (a_abs @ b_abs)


def assert_within(
    got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor | float, what: str = ""
) -> None:
    """``|got - want| <= bound`` entrywise (``want`` the exact float64 reference).

    Equal infinities and NaN in the same places count as equal. The message gives the
    worst entry as a fraction of its bound, so a failure says by how much it was missed.
    """
    got64, want64 = got.detach().to(F64), want.detach().to(F64)
    assert got64.shape == want64.shape, (what, got64.shape, want64.shape)
    bound64 = torch.as_tensor(bound, dtype=F64).expand_as(want64)
    same = (got64 == want64) | (got64.isnan() & want64.isnan())
    err = torch.where(same, torch.zeros_like(got64), (got64 - want64).abs())
    bad = ~(err <= bound64)  # NaN in err (NaN on one side only) counts as bad
    if bool(bad.any()):
        ratio = torch.where(bad, err / bound64, torch.zeros_like(err)).nan_to_num(math.inf)
        i = int(ratio.argmax())
        idx = tuple(int(k) for k in torch.unravel_index(torch.tensor(i), got64.shape))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} entries outside the bound; worst at "
            f"{idx}: got {got64.flatten()[i].item()!r}, exact {want64.flatten()[i].item()!r}, "
            f"|error| {err.flatten()[i].item():.3e} > bound {bound64.flatten()[i].item():.3e} "
            f"({ratio.flatten()[i].item():.3g} x the bound)"
        )


# --------------------------------------------------------------------------- softmax


@dataclass
class SoftmaxReference:
    """Exact (float64) log-probs, entropies and logits gradient of a row-wise softmax, and
    bounds on the error of any evaluation in ``dtype`` arithmetic (see
    :func:`softmax_reference`). Gradient bounds exclude the final rounding to the
    gradient's dtype: add :meth:`rounded` for bfloat16/float16 gradients."""

    logp: torch.Tensor  # [rows]
    entropy: torch.Tensor  # [rows]
    grad: torch.Tensor  # [rows, vocab]: d(sum a logp + b H)/d logits
    logp_err: torch.Tensor
    entropy_err: torch.Tensor
    grad_err: torch.Tensor  # in the compute dtype, before any rounding to the input dtype
    dtype: torch.dtype  # the compute dtype

    def grad_bound(self, grad_dtype: torch.dtype) -> torch.Tensor:
        """The gradient bound for a gradient returned in ``grad_dtype``: ``grad_err``, plus
        one rounding of the result, ``round_bound(|g| + grad_err)``, when ``grad_dtype`` is
        narrower than the compute dtype (bfloat16/float16 logits)."""
        if grad_dtype == self.dtype:
            return self.grad_err
        return self.grad_err + round_bound(self.grad.abs() + self.grad_err, grad_dtype)


def softmax_reference(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    w_logp: torch.Tensor | None = None,
    w_entropy: torch.Tensor | None = None,
    logits_err: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> SoftmaxReference:
    r"""Exact values, and error bounds for ``dtype`` arithmetic, of ``log p_y``, ``H`` and
    ``d(sum_t a_t log p_{t,y_t} + b_t H_t) / d logits`` for ``p = softmax(logits / T)``.

    ``logits [..., V]`` are the values the computation sees (already rounded to its input
    dtype; ``-inf`` allowed: a masked vocabulary entry); ``tokens [...]``; ``w_logp``
    (``a``) and ``w_entropy`` (``b``) the upstream gradients, None meaning 0;
    ``logits_err`` an entrywise bound on an error the logits already carry (the
    float32 ``hidden @ W.T`` of the fused path), 0 by default. Derivation, per row, with
    ``z = x / T``, ``Z = max |z|``, ``E = max logits_err / T``, ``f = 2 FUNC_ULPS u``:

    1. ``z`` rounds by ``u Z``; ``z - max z`` by ``2 u Z`` more; ``exp`` of it by ``f``
       relative; their sum of ``V`` positive terms by ``gamma(V)`` relative; its ``log``
       (in ``[0, log V]``) by ``f (1 + log V)``; adding ``max z`` by ``u (Z + log V)``.
       So ``lse`` and every ``log p_v = z_v - lse`` (``|log p_v| <= 2 Z + log V``) are
       off by at most ``d_log = gamma(V) + f (1 + log V) + 8 u (Z + log V) + 2 E``,
       whichever of the equivalent formulas is evaluated (fused ``log_softmax``,
       ``lse`` then subtract, ``exp`` after a shift), and ``p_v = exp(log p_v)`` is off
       by ``d_p = d_log + f`` relative.
    2. ``H = -sum_v p_v log p_v``: the terms are off by ``p_v (|log p_v| d_p + d_log)``,
       their sum by ``gamma(V) H`` more: ``|dH| <= d_log + (d_p + gamma(V)) H``, bounded
       by ``2 d_p (1 + H)`` (the ``lse - sum p z`` form: the same terms).
    3. ``dL/dx_v = (a (delta_vy - p_v) - b p_v (log p_v + H)) / T``. Perturbing ``p_v``,
       ``log p_v`` and ``H`` as above, plus (autograd of the naive code) the ``sum_w``
       of the upstream gradient over the row, ``gamma(V) (|a| + |b| (1 + H))``, gives
       ``4 d_p p_v (|a| + |b| (2 + |log p_v| + 2 H)) / T``; the few products and the
       final ``a delta_vy`` add ``4 u (|dL/dx_v| + |a| delta_vy / T)``.
    """
    x = logits.detach().to(F64)
    vocab = x.shape[-1]
    # the computation's rounding plus the float64 reference's own (see module docstring)
    u = unit_roundoff(dtype) + unit_roundoff(F64)
    f = func_rel(dtype) + func_rel(F64)
    z = x / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    p = logp_all.exp()
    finite_lp = torch.where(p > 0, logp_all, torch.zeros_like(logp_all))  # 0 * (-inf) -> 0
    entropy = -(p * finite_lp).sum(-1)
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    z_max = torch.where(z.isfinite(), z.abs(), torch.zeros_like(z)).amax(-1)
    extra = (
        torch.zeros_like(z_max) if logits_err is None else logits_err.to(F64).amax(-1) / temperature
    )
    log_v = math.log(vocab)
    d_log = gamma_ref(vocab, dtype) + f * (1 + log_v) + 8 * u * (z_max + log_v) + 2 * extra
    d_p = d_log + f

    a = torch.zeros_like(logp) if w_logp is None else w_logp.detach().to(F64).expand_as(logp)
    b = torch.zeros_like(logp) if w_entropy is None else w_entropy.detach().to(F64).expand_as(logp)
    a_, b_, h_ = a.unsqueeze(-1), b.unsqueeze(-1), entropy.unsqueeze(-1)
    onehot = torch.zeros_like(z).scatter_(-1, tokens.unsqueeze(-1), 1.0)
    grad = (a_ * (onehot - p) - b_ * p * (finite_lp + h_)) / temperature
    coef = a_.abs() + b_.abs() * (2 + finite_lp.abs() + 2 * h_)
    grad_err = 4 * d_p.unsqueeze(-1) * p * coef / temperature + 4 * u * (
        grad.abs() + a_.abs() * onehot / temperature
    )
    return SoftmaxReference(
        logp=logp,
        entropy=entropy,
        grad=grad,
        logp_err=d_log,
        entropy_err=2 * d_p * (1 + entropy),
        grad_err=grad_err,
        dtype=dtype,
    )


@dataclass
class FusedReference:
    """Exact gradients of the fused ``hidden @ W.T (+ b)`` -> softmax path and their bounds."""

    soft: SoftmaxReference  # log-probs, entropies and the logits gradient G
    grad_hidden: torch.Tensor
    grad_weight: torch.Tensor
    grad_bias: torch.Tensor
    grad_hidden_err: torch.Tensor
    grad_weight_err: torch.Tensor
    grad_bias_err: torch.Tensor


def fused_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    w_logp: torch.Tensor | None = None,
    w_entropy: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> FusedReference:
    r"""Exact values and error bounds of log-probs, entropies and the gradients w.r.t.
    ``hidden [rows, d]``, ``weight [V, d]`` and ``bias [V]`` of the logits
    ``z = hidden @ weight.T + bias`` computed in the inputs' dtype (float32 or bfloat16,
    the products accumulated in float32 at least), softmax math in float32.

    With ``g = gamma(.)`` of the float32 accumulation and ``r(.)`` :func:`round_bound` of
    the input dtype (zero work for float32 inputs: a float32 result is not rounded again):

    - ``z``: ``g(d + 1) (|h| @ |W|.T + |b|)``, plus ``r(|z|)`` for a bfloat16 ``z``;
      that enters :func:`softmax_reference` as ``logits_err``, giving ``G`` (the
      gradient w.r.t. the logits) within ``G_err``, and ``G`` rounded to the input dtype
      before the matmuls is within ``G_err' = G_err + r(|G| + G_err)``;
    - ``dh = G @ W``: ``G_err' @ |W| + g(V) (|G| + G_err') @ |W|``, plus ``r`` of it;
    - ``dW = G.T @ h``, summed over blocks of rows: ``G_err'.T @ |h| + g(rows) (...)``,
      plus ``r(|G|.T @ |h|)`` for the per-block rounding of a bfloat16 matmul, plus
      ``r`` of the result; ``db = G.sum(0)``: the same with ``|h| = 1``.

    ``keep`` (0/1, ``[rows, V]``, None meaning all ones): the entries of ``G`` the
    matmuls see (a gradient filter's kept tiles); ``G`` and its bound are multiplied by
    it, so the gradients and bounds are those of the filtered sums.
    """
    in_dtype = hidden.dtype
    acc = torch.float64 if in_dtype == torch.float64 else torch.float32
    narrow = in_dtype not in (torch.float32, torch.float64)

    def rnd(x_abs: torch.Tensor) -> torch.Tensor:
        return round_bound(x_abs, in_dtype) if narrow else torch.zeros_like(x_abs)

    h, w = hidden.detach().to(F64), weight.detach().to(F64)
    b = None if bias is None else bias.detach().to(F64)
    h_abs, w_abs = h.abs(), w.abs()
    z = h @ w.T if b is None else h @ w.T + b
    z_err = gamma_ref(h.shape[-1] + 1, acc) * (h_abs @ w_abs.T + (0 if b is None else b.abs()))
    z_err = z_err + rnd(z.abs() + z_err)
    soft = softmax_reference(
        z,
        tokens,
        temperature=temperature,
        w_logp=w_logp,
        w_entropy=w_entropy,
        logits_err=z_err,
        dtype=acc,
    )
    g, g_err = soft.grad, soft.grad_err
    if keep is not None:
        g, g_err = g * keep, g_err * keep
    g_err = g_err + rnd(g.abs() + g_err)  # the gradient rounded to the input dtype
    g_mag = g.abs() + g_err
    rows, vocab = g.shape
    gh = g @ w
    gh_err = g_err @ w_abs + gamma_ref(vocab, acc) * (g_mag @ w_abs)
    gh_err = gh_err + rnd(gh.abs() + gh_err)
    gw = g.T @ h
    gw_err = g_err.T @ h_abs + gamma_ref(rows, acc) * (g_mag.T @ h_abs) + rnd(g_mag.T @ h_abs)
    gw_err = gw_err + rnd(gw.abs() + gw_err)
    gb = g.sum(0)
    gb_err = g_err.sum(0) + gamma_ref(rows, acc) * g_mag.sum(0) + rnd(g_mag.sum(0))
    gb_err = gb_err + rnd(gb.abs() + gb_err)
    return FusedReference(soft, gh, gw, gb, gh_err, gw_err, gb_err)


# --------------------------------------------------------------------------- policy loss


@dataclass
class LossReference:
    """Exact (float64) Clip-Higher token-level loss and its gradient w.r.t. ``logp``, with
    error bounds for ``dtype`` arithmetic (see :func:`loss_reference`)."""

    loss: torch.Tensor
    loss_err: torch.Tensor
    grad: torch.Tensor
    grad_err: torch.Tensor


def loss_reference(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    dtype: torch.dtype,
    extra_terms: int = 0,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = None,
    **options: object,
) -> LossReference:
    r"""``token_level_loss`` (Clip-Higher, optional dual clip, no KL) evaluated in float64 on the
    same inputs, and bounds for any evaluation in ``dtype`` (a micro-batch split, another
    summation order, a compiled kernel). ``options`` go to ``token_level_loss`` (``mode``,
    ``normalizer``, ``max_len``); ``extra_terms`` counts additions the caller makes on top
    (summing micro-batch losses).

    With ``d = logp - old_logp`` clamped to ``+-log_ratio_clamp`` (``|d| <= D``),
    ``r = exp(d)``, per-token loss
    ``l = -A clip(r)`` and aggregation weights ``w`` (1 over exact counts):

    - ``d`` rounds by ``u |d|``, ``r`` is then off by ``f + u D`` relative, ``clip`` is
      exact, ``* A`` rounds once: ``|dl| <= (f + u (D + 1)) |l|``; the aggregation, a
      positive combination of at most ``n = batch * seq`` terms with two divisions by
      counts, adds ``gamma(n + 2 + extra_terms)``: the loss is off by at most
      ``(f + u (D + 1) + gamma(n + 2 + extra_terms)) * aggregate(|l|)``.
    - The gradient ``w (-A r)`` (0 where the clip acts): ``r`` as above, ``w`` three
      roundings, two products: ``(f + u (D + 6)) |grad|``. Where ``r`` lies within its
      own error bound of a clip boundary (``1 - eps_low``, ``1 + eps_high``, the dual
      clip) the clip
      decision may go either way in ``dtype``, so there the bound is the whole unclipped
      gradient ``|w A r|``.

    Each bound adds the same terms in float64 for the reference's own rounding.
    """
    from dapo_ops import token_level_aggregate, token_level_loss

    lp = logp.detach().to(F64).requires_grad_(True)
    old, adv = old_logp.detach().to(F64), advantages.detach().to(F64)
    loss = token_level_loss(
        lp, old, adv, mask, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip, **options
    )
    (grad,) = torch.autograd.grad(loss, lp)

    agg_options = {k: v for k, v in options.items() if k in ("mode", "normalizer", "max_len")}
    clamp = float(options.get("log_ratio_clamp", 20.0))  # type: ignore[arg-type]
    raw = torch.where(mask.bool(), lp.detach() - old, torch.zeros_like(old))
    d = raw.clamp(-clamp, clamp)  # the loss sees the clamped log-ratio
    ratio = d.exp()
    adv_t = adv.view(-1, *([1] * (d.ndim - 1))).expand_as(d) if adv.ndim < d.ndim else adv
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    negative = ratio.maximum(clipped)
    if dual_clip is not None:
        negative = negative.clamp(max=dual_clip)
    per_token = torch.where(
        mask.bool(), -adv_t * torch.where(adv_t >= 0, ratio.minimum(clipped), negative), 0.0
    )
    weights_leaf = per_token.abs().requires_grad_(True)
    agg_abs = token_level_aggregate(weights_leaf, mask, **agg_options)  # type: ignore[arg-type]
    (weights,) = torch.autograd.grad(agg_abs, weights_leaf)

    big_d = float(d.abs().max()) if d.numel() else 0.0
    n = d.numel() + 2 + extra_terms
    loss_rel = grad_rel = r_rel = 0.0
    for dt in (dtype, F64):
        u, f = unit_roundoff(dt), func_rel(dt)
        loss_rel += f + u * (big_d + 1) + gamma(n, dt)
        grad_rel += f + u * (big_d + 6)
        r_rel += f + u * (big_d + 1)
    unclipped = (weights * adv_t * ratio).abs()
    # within rounding of the log-ratio clamp, whether it stops the gradient may go either way
    near = (raw.abs() - clamp).abs() <= 2 * unit_roundoff(dtype) * raw.abs()
    for edge in (1 - eps_low, 1 + eps_high, *(() if dual_clip is None else (dual_clip,))):
        near |= (ratio - edge).abs() <= 2 * r_rel * ratio
    grad_err = grad_rel * grad.abs() + torch.where(near & mask.bool(), unclipped, 0.0)
    return LossReference(loss.detach(), loss_rel * agg_abs.detach(), grad, grad_err)


# --------------------------------------------------------------------------- advantages


def scale_of(
    rewards: torch.Tensor, ids: list[int], scale: str, *, eps: float = 0.0, unbiased: bool = True
) -> torch.Tensor:
    """The denominator ``s`` of every sample's advantage, in float64: its group's std, the
    batch std, or 1 (plus ``eps``)."""
    r = rewards.double().flatten()
    if scale == "none":
        return torch.ones_like(r)
    if scale == "batch":
        std = r.std(unbiased=unbiased) if r.numel() > 1 else torch.tensor(0.0, dtype=F64)
        return torch.full_like(r, float(std) + eps)
    out = torch.zeros_like(r)
    for gid in set(ids):
        idx = torch.tensor([i for i, x in enumerate(ids) if x == gid])
        x = r[idx]
        out[idx] = (float(x.std(unbiased=unbiased)) if len(idx) > 1 else 0.0) + eps
    return out


def advantage_bound(
    rewards: torch.Tensor,
    want: torch.Tensor,
    s: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    *,
    input_roundings: int = 0,
) -> torch.Tensor:
    """Bound on ``|computed - exact|`` of advantages ``want`` with denominators ``s``.

    The statistics are float64 sums over at most ``N`` rewards of magnitude at most
    ``M`` (mean, centring, variance, sqrt, one or two divisions): the residual and ``s``
    are each off by ``gamma(N + 6) M``, so the advantage by ``gamma(N + 6) (M / s)
    (1 + |A|)``; doubled for the float64 reference's own rounding; plus
    ``gamma(input_roundings) (M / s) (1 + |A|)`` for rewards that were themselves rounded
    (``M`` is then the magnitude of the exact rewards, passed as ``rewards``); then the
    result is rounded once to ``out_dtype``. (A degenerate group is 0 on both sides.)
    """
    m = rewards.double().abs().max()
    s = s.view_as(want)
    cond = torch.where(s > 0, m / s, torch.full_like(s, math.inf))
    rel = 2 * gamma(rewards.numel() + 6, F64) + gamma(input_roundings, F64)
    f64 = rel * cond * (1 + want.abs())
    return f64 if out_dtype == F64 else f64 + round_bound(want.abs() + f64, out_dtype)
