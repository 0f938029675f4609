"""linear_policy_loss: the policy loss from hidden states, gradients formed in forward.

Float64 results against the naive path (``h @ W.T`` -> ``log_softmax`` -> ``gather`` ->
``policy_loss``, autograd) and the composed one (``fused_logprobs_entropy`` ->
``policy_loss``) within :data:`dapo_ops.testing.F64_RTOL` of each entry plus the largest
(10^6 float64 ulps: far above any reordering of the same sums, far below a wrong
formula); float32 and bfloat16 results against the exact values within the bounds of
``tests/_bounds.py`` (``fused_reference``), widened by the effect of the log-probs' own
error on the loss's gradient (derived in :func:`float32_bounds`). The conformance suite
runs it on every objective (``tests/test_objectives.py``, ``testing.check_linear_loss``).
No timings here: ``benchmarks/``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _bounds import assert_within, fused_reference, gamma_ref, unit_roundoff
from torch import Tensor

import dapo_ops as d
from dapo_ops import testing
from dapo_ops.objectives import OBJECTIVES
from dapo_ops.objectives.base import is_token_local

F64 = torch.float64
RTOL = testing.F64_RTOL


def problem(
    batch: int = 4,
    seq: int = 6,
    hidden_dim: int = 5,
    vocab: int = 13,
    *,
    seed: int = 0,
    dtype: torch.dtype = F64,
    shifts: tuple[float, ...] = (-0.5, -0.1, 0.0, 0.1, 0.5),
) -> dict[str, Tensor]:
    """A ragged batch (first row full, last empty) whose old log-probs differ from the
    current ones by one of ``shifts`` per token (exp of them: ratios 0.61 .. 1.65, each
    at least 5 % away from Clip-Higher's bounds 0.8 and 1.28)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, hidden_dim, generator=g, dtype=F64)
    weight = torch.randn(vocab, hidden_dim, generator=g, dtype=F64) * 0.7
    bias = torch.randn(vocab, generator=g, dtype=F64) * 0.3
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    lengths = torch.randint(1, seq + 1, (batch,), generator=g)
    lengths[0], lengths[-1] = seq, 0
    mask = torch.arange(seq) < lengths[:, None]
    low = tuple(t.to(dtype).to(F64) for t in (hidden, weight, bias))
    with torch.no_grad():
        logp = torch.log_softmax(low[0] @ low[1].T + low[2], -1)
        logp = logp.gather(-1, tokens[..., None]).squeeze(-1)
    pick = torch.randint(0, len(shifts), (batch, seq), generator=g)
    old = logp - torch.tensor(shifts, dtype=F64)[pick]
    adv = torch.randn(batch, generator=g, dtype=F64)
    ref = logp + 0.2 * torch.randn(batch, seq, generator=g, dtype=F64)
    rho = torch.rand(batch, seq, generator=g, dtype=F64) + 0.5
    out = {"hidden": low[0], "weight": low[1], "bias": low[2], "old": old, "adv": adv}
    out = out | {"ref": ref, "rho": rho}
    small = F64 if dtype == F64 else torch.float32  # the per-token inputs: float32 at least
    out = {k: v.to(dtype if k in ("hidden", "weight", "bias") else small) for k, v in out.items()}
    return out | {"tokens": tokens, "mask": mask}


def grads(
    fn: Callable[..., Tensor], p: dict[str, Tensor], *, bias: bool = True
) -> tuple[Tensor, list[Tensor]]:
    leaves = [p[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    loss = fn(leaves[0], leaves[1], leaves[2] if bias else None)
    got = torch.autograd.grad(loss, leaves if bias else leaves[:2])
    return loss.detach(), list(got)


def naive_loss(
    objective: d.Objective, p: dict[str, Tensor], opts: dict[str, Any]
) -> Callable[..., Tensor]:
    """``h @ W.T (+ b)`` -> ``log_softmax`` -> ``gather`` -> ``policy_loss`` (- the bonus)."""
    coef, temperature = opts.get("entropy_coef", 0.0), opts.get("temperature", 1.0)
    rest = {k: v for k, v in opts.items() if k not in ("entropy_coef", "temperature", "chunk_size")}

    def fn(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        z = h @ w.T if b is None else h @ w.T + b
        all_lp = torch.log_softmax(
            z.to(torch.promote_types(z.dtype, torch.float32)) / temperature, -1
        )
        logp = all_lp.gather(-1, p["tokens"][..., None]).squeeze(-1)
        loss = d.policy_loss(objective, logp, p["old"], p["adv"], p["mask"], **rest)
        if coef:
            ent = -(all_lp.exp() * all_lp).sum(-1)
            loss = loss + d.entropy_bonus(
                ent,
                p["mask"],
                coef=coef,
                mode=rest.get("mode", "token_mean"),
                normalizer=rest.get("normalizer"),
            )
        return loss

    return fn


def composed_loss(
    objective: d.Objective, p: dict[str, Tensor], opts: dict[str, Any]
) -> Callable[..., Tensor]:
    """``fused_logprobs_entropy`` -> ``policy_loss`` (+ ``entropy_bonus``)."""
    coef, temperature = opts.get("entropy_coef", 0.0), opts.get("temperature", 1.0)
    rest = {k: v for k, v in opts.items() if k not in ("entropy_coef", "temperature", "chunk_size")}

    def fn(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        out = d.fused_logprobs_entropy(
            h, w, p["tokens"], bias=b, temperature=temperature, chunk_size=opts.get("chunk_size")
        )
        loss = d.policy_loss(objective, out.logp, p["old"], p["adv"], p["mask"], **rest)
        if coef:
            loss = loss + d.entropy_bonus(
                out.entropy,
                p["mask"],
                coef=coef,
                mode=rest.get("mode", "token_mean"),
                normalizer=rest.get("normalizer"),
            )
        return loss

    return fn


def linear(
    objective: d.Objective, p: dict[str, Tensor], opts: dict[str, Any]
) -> Callable[..., Tensor]:
    def fn(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return d.linear_policy_loss(
            h, w, p["tokens"], p["old"], p["adv"], p["mask"], objective=objective, bias=b, **opts
        )

    return fn


def assert_f64(
    got: tuple[Tensor, list[Tensor]], want: tuple[Tensor, list[Tensor]], what: str
) -> None:
    """Loss and gradients within F64_RTOL of each entry plus the largest."""
    assert_within(got[0], want[0], RTOL * (want[0].abs() + 1), f"{what}: loss")
    for name, x, y in zip(("hidden", "weight", "bias"), got[1], want[1], strict=False):
        assert x.dtype == y.dtype and x.shape == y.shape, (what, name)
        assert_within(x, y, RTOL * (y.abs() + y.abs().max()), f"{what}: d {name}")


# --------------------------------------------------------------------------- float64

CASES = [
    pytest.param(d.ClipHigher(), {}, id="clip-higher"),
    pytest.param(
        d.ClipHigher(dual_clip=3.0),
        {"mode": "seq_mean_token_mean", "temperature": 0.7, "chunk_size": 4},
        id="dual-clip-T0.7-chunk4",
    ),
    pytest.param(d.ClipHigher(), {"entropy_coef": 0.05, "chunk_size": 1}, id="entropy-chunk1"),
    pytest.param(
        d.ClipHigher(),
        {"kl": d.KLPenalty(), "mode": "seq_mean_token_sum_norm", "max_len": 9, "chunk_size": 5},
        id="kl-drgrpo",
    ),
    pytest.param(d.CISPO(), {"normalizer": 7.0, "chunk_size": 7}, id="cispo-normalizer"),
    pytest.param(
        d.GSPO(), {"mode": "seq_mean_token_mean", "chunk_size": 4}, id="gspo-walked-twice"
    ),
    pytest.param(
        d.GSPO(), {"mode": "seq_mean_token_mean", "chunk_size": 13}, id="gspo-two-sequences"
    ),
    pytest.param(d.VESPO(), {"entropy_coef": 0.01, "chunk_size": 2}, id="vespo"),
]


def case_inputs(opts: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """A CASES entry's problem and options (with reference log-probs and IS weights for a
    case with a KL penalty)."""
    p = problem()
    if "kl" in opts:
        opts = opts | {"ref_logp": p["ref"], "is_weights": p["rho"]}
    return p, opts


@pytest.mark.parametrize(("objective", "opts"), CASES)
def test_float64_equals_naive_and_composed(objective: d.Objective, opts: dict[str, Any]) -> None:
    p, opts = case_inputs(opts)
    got = grads(linear(objective, p, opts), p)
    assert_f64(got, grads(naive_loss(objective, p, opts), p), "vs naive")
    assert_f64(got, grads(composed_loss(objective, p, opts), p), "vs composed")


@pytest.mark.parametrize("objective", [d.ClipHigher(), d.GSPO(), d.PolicyGradient()])
def test_gradcheck_float64(objective: d.Objective) -> None:
    p = problem(3, 4, 3, 7, seed=1)
    for chunk in (None, 3):
        opts = {
            "temperature": 0.8,
            "entropy_coef": 0.1,
            "chunk_size": chunk,
            "mode": "seq_mean_token_mean",
        }
        fn = linear(objective, p, opts)
        args = tuple(p[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias"))
        assert torch.autograd.gradcheck(fn, args, fast_mode=True)


def test_double_backward_differentiates_the_definition() -> None:
    p = problem(2, 3, 3, 5, seed=2)
    fn = linear(d.ClipHigher(), p, {"entropy_coef": 0.1, "chunk_size": 2})
    args = tuple(p[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias"))
    assert torch.autograd.gradgradcheck(fn, args, fast_mode=True)


@pytest.mark.parametrize("mode", testing.MODES)
@pytest.mark.parametrize("objective", [d.ClipHigher(), d.GSPO()])
def test_micro_batches_add_up_with_the_global_normalizer(objective: d.Objective, mode: str) -> None:
    """Micro-batches of 1, 2 and 1 rows, each normalised by the step's count: their losses
    and weight gradients sum, and their hidden gradients concatenate, to the whole
    batch's (float64, within F64_RTOL of each entry plus the largest)."""
    opts: dict[str, Any] = {"mode": mode, "entropy_coef": 0.02, "chunk_size": 5}
    parts = [slice(0, 1), slice(1, 3), slice(3, 4)]
    assert_micro_batches_add_up(objective, problem(), opts, parts, f"{objective}, {mode}")


def assert_micro_batches_add_up(
    objective: d.Objective,
    p: dict[str, Tensor],
    opts: dict[str, Any],
    parts: list[slice],
    what: str,
) -> None:
    """The row slices ``parts`` of ``p``, each normalised by the step's global count
    (``opts["mode"]``): losses and weight gradients sum, hidden gradients concatenate, to
    the whole batch's (:func:`assert_f64`)."""
    whole = grads(linear(objective, p, opts), p)
    den = d.global_normalizer([p["mask"][s] for s in parts], mode=opts["mode"])
    pieces = []
    for s in parts:
        q = {
            k: v[s] if k in ("hidden", "tokens", "old", "adv", "mask") else v for k, v in p.items()
        }
        pieces.append(grads(linear(objective, q, opts | {"normalizer": den}), q))
    total = torch.stack([x[0] for x in pieces]).sum()
    summed = [
        torch.cat([x[1][0] for x in pieces]),
        sum(x[1][1] for x in pieces),
        sum(x[1][2] for x in pieces),
    ]
    assert_f64((total, summed), whole, f"{what}: micro-batches")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- float32, bfloat16


def float32_bounds(
    objective: d.Objective, p: dict[str, Tensor], coef: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor]]:
    """Exact loss and gradients of the ``dtype`` problem ``p`` (token mean), and bounds.

    The exact upstream gradients ``a = d loss / d logp`` and ``b = d loss / d H`` (float64
    autograd) enter ``fused_reference``, which bounds the gradients computed with them.
    The computed ``a`` differs: the log-probs it is formed from are off by ``e =
    logp_err``, so ``r = exp(logp - old)`` by a factor ``exp(+-(e + 2u |x|)) (1 + f)``
    (the subtraction, ``exp``'s ``f = 40 u``), and ``a = -w A r`` rounds a few times more:
    ``|da| <= |a| (expm1(e + 2u |x| + f) + 8u)``, no clip decision flipping (the
    problem's ratios stay 5 % from the bounds). ``b = -c w`` is off by ``4u |b|``. Both
    propagate through ``G = a (delta - p) - b p (log p + H)`` as ``|da| |delta - p| + |db|
    p (|log p| + H)`` per entry, and from there through the matmuls by ``|W|``, ``|h|``.
    The loss: ``sum_t |a_t| expm1(...)`` plus the bonus's ``c w H_err``, plus the rounding
    of every term and of the sum, ``64 u + gamma(2 n)`` of ``sum |w l| + c w H``.
    """
    u = unit_roundoff(torch.float32)
    rows = p["tokens"].numel()
    h = p["hidden"].to(F64).reshape(rows, -1)
    w, bias = p["weight"].to(F64), p["bias"].to(F64)
    mask = p["mask"]
    leaf = torch.log_softmax(h @ w.T + bias, -1)
    logp = leaf.gather(-1, p["tokens"].reshape(-1, 1)).squeeze(-1).view(mask.shape)
    lp = logp.clone().requires_grad_(True)
    ent = -(leaf.exp() * leaf).sum(-1).view(mask.shape)
    ent_leaf = ent.clone().requires_grad_(True)
    loss = d.policy_loss(objective, lp, p["old"], p["adv"], mask)
    loss = loss + d.entropy_bonus(ent_leaf, mask, coef=coef)
    a, b = torch.autograd.grad(loss, [lp, ent_leaf])
    exact = fused_reference(
        p["hidden"].reshape(rows, -1), p["weight"], p["tokens"].reshape(-1),
        bias=p["bias"], w_logp=a.reshape(-1), w_entropy=b.reshape(-1),
    )  # fmt: skip
    soft = exact.soft
    e = soft.logp_err.view(mask.shape)
    x = logp.abs() + p["old"].abs()
    da = (a.abs() * (torch.expm1(e + 2 * u * x + 40 * u) + 8 * u)).reshape(-1, 1)
    db = (4 * u * b.abs()).reshape(-1, 1)
    p_all = leaf.exp()
    onehot = torch.zeros_like(p_all).scatter_(-1, p["tokens"].reshape(-1, 1), 1.0)
    extra = da * (onehot - p_all).abs() + db * p_all * (leaf.abs() + ent.reshape(-1, 1))
    # the G entries rounded to a narrow dtype grow by their perturbation too
    extra = extra * (1 + 2 * unit_roundoff(dtype))
    errs = [
        (exact.grad_hidden_err + extra @ w.abs()).view(p["hidden"].shape),
        exact.grad_weight_err + extra.T @ h.abs(),
        exact.grad_bias_err + extra.sum(0),
    ]
    scale = d.engine.aggregation.loss_scale(mask, dtype=F64)
    with torch.no_grad():
        terms = (d.per_token_loss(objective, logp, p["old"], p["adv"], mask) * scale).abs().sum()
        bonus = (coef * scale * torch.where(mask, ent, 0.0)).sum()
        bonus_err = (coef * scale * torch.where(mask, soft.entropy_err.view(mask.shape), 0.0)).sum()
    loss_err = (a.abs() * torch.expm1(e + 2 * u * x + 40 * u)).sum() + bonus_err
    loss_err = loss_err + (64 * u + gamma_ref(2 * rows, torch.float32)) * (terms + bonus)
    want = [exact.grad_hidden.view(p["hidden"].shape), exact.grad_weight, exact.grad_bias]
    return loss.detach(), loss_err, want, errs


def assert_within_float32_bounds(
    objective: d.Objective,
    p: dict[str, Tensor],
    coef: float,
    dtype: torch.dtype,
    opts: dict[str, Any],
) -> None:
    """:func:`linear` on the ``dtype`` problem ``p`` with ``entropy_coef=coef`` and ``opts``:
    a float32 loss and ``dtype`` gradients, each within :func:`float32_bounds`."""
    loss, grad = grads(linear(objective, p, {"entropy_coef": coef} | opts), p)
    assert loss.dtype == torch.float32 and all(g.dtype == dtype for g in grad)
    want_loss, loss_err, want, errs = float32_bounds(objective, p, coef, dtype)
    assert_within(loss, want_loss, loss_err, "loss")
    for name, x, y, e in zip(("hidden", "weight", "bias"), grad, want, errs, strict=True):
        assert_within(x, y, e, f"{dtype} d {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("objective", [d.ClipHigher(), d.PolicyGradient()])
@pytest.mark.parametrize("chunk", [None, 5])
def test_low_precision_within_derived_bounds(
    objective: d.Objective, dtype: torch.dtype, chunk: int | None
) -> None:
    """float32 / bfloat16 hidden states and weights (softmax and loss in float32): the
    loss and the gradients, in the input dtype, within the derived bounds of the exact
    values of the same (rounded) inputs."""
    p = problem(4, 9, 16, 301, seed=3, dtype=dtype)
    assert_within_float32_bounds(objective, p, 0.05, dtype, {"chunk_size": chunk})


# --------------------------------------------------------------------------- rules


def test_masked_positions_change_nothing() -> None:
    """NaN / inf in the hidden rows, old log-probs, advantages (an empty row's), reference
    log-probs and IS weights at masked positions, and ids such as -100 there: the same
    loss and gradients, bit for bit."""
    p = problem(dtype=torch.float32)
    opts = {"kl": d.KLPenalty(), "entropy_coef": 0.05, "chunk_size": 4}
    mask = p["mask"]
    clean = dict(p)
    dirty = dict(clean)
    for value in (math.nan, math.inf, -math.inf):
        dirty["hidden"] = torch.where(mask[..., None], clean["hidden"], value)
        for k in ("old", "ref", "rho"):
            dirty[k] = torch.where(mask, clean[k], value)
        dirty["adv"] = torch.where(mask.any(-1), clean["adv"], value)
        dirty["tokens"] = torch.where(mask, clean["tokens"], -100)
        results = []
        for q in (clean, dirty):
            fn = linear(d.ClipHigher(), q, opts | {"ref_logp": q["ref"], "is_weights": q["rho"]})
            results.append(grads(fn, q))
        (l0, g0), (l1, g1) = results
        assert torch.equal(l0, l1), value
        for x, y in zip(g0, g1, strict=True):
            assert torch.equal(x, y), value


def test_token_local_declarations() -> None:
    """Which shipped objectives are chunked by tokens: each declares it in its own class
    body (a subclass does not inherit it), and each declaration holds (the conformance
    check compares the token layout with the [batch, seq] one, bit for bit)."""
    local = {c.__name__ for c in OBJECTIVES if is_token_local(c())}
    assert local == {
        "ClipHigher",
        "CISPO",
        "SAPO",
        "DPPO",
        "DRO",
        "PolicyGradient",
        "RatioSurrogate",
        "TOPR",
    }

    @dataclasses.dataclass(frozen=True)
    class Sub(d.ClipHigher):
        pass

    assert not is_token_local(Sub())
    for cls in OBJECTIVES:
        testing.check_token_local(cls())


def test_frozen_weight_no_grad_and_the_incoming_gradient() -> None:
    """Only what requires grad gets a gradient; under no_grad the same loss (the same
    operations); ``2 * loss`` doubles every gradient exactly; a retained graph gives the
    same gradients on a second backward."""
    p = problem(dtype=torch.float32)
    fn = linear(d.ClipHigher(), p, {"entropy_coef": 0.05})
    h = p["hidden"].clone().requires_grad_(True)
    loss = fn(h, p["weight"], p["bias"])
    (gh,) = torch.autograd.grad(loss, [h])
    with torch.no_grad():
        assert torch.equal(fn(p["hidden"], p["weight"], p["bias"]), loss.detach())
    leaves = [p[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    loss = fn(*leaves)
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    second = torch.autograd.grad(loss, leaves, retain_graph=True)
    double = torch.autograd.grad(2 * loss, leaves)
    assert torch.equal(first[0], gh)
    for a, b, c in zip(first, second, double, strict=True):
        assert torch.equal(a, b) and torch.equal(2 * a, c)


def test_diagnostics() -> None:
    """The log-probs and entropies the loss used (float64: the naive path's within
    F64_RTOL), and objective_diagnostics of them, with the entropy's masked mean."""
    p = problem()
    objective = d.ClipHigher()
    loss, diag = d.linear_policy_loss_with_diagnostics(
        p["hidden"],
        p["weight"],
        p["tokens"],
        p["old"],
        p["adv"],
        p["mask"],
        objective=objective,
        bias=p["bias"],
        chunk_size=5,
    )
    assert torch.equal(
        loss,
        d.linear_policy_loss(
            p["hidden"],
            p["weight"],
            p["tokens"],
            p["old"],
            p["adv"],
            p["mask"],
            objective=objective,
            bias=p["bias"],
            chunk_size=5,
        ),
    )
    all_lp = torch.log_softmax(p["hidden"] @ p["weight"].T + p["bias"], -1)
    logp = all_lp.gather(-1, p["tokens"][..., None]).squeeze(-1)
    ent = -(all_lp.exp() * all_lp).sum(-1)
    mask = p["mask"]
    for got, want in ((diag.logp, logp), (diag.entropy, ent)):
        assert not got.requires_grad
        assert_within(got[mask], want[mask], RTOL * (want[mask].abs() + 1), "diagnostics")
    expect = d.objective_diagnostics(
        objective, diag.logp, p["old"], p["adv"], mask, entropy=diag.entropy
    )
    for x, y in zip(diag.policy, expect, strict=True):
        assert torch.equal(x, y)
    assert_within(diag.policy.entropy, ent[mask].mean(), RTOL, "mean entropy")
    assert 0 < float(diag.policy.clip_frac_high) + float(diag.policy.clip_frac_low) < 1


@pytest.mark.usefixtures("no_runtime_typecheck")
def test_compile_fullgraph() -> None:
    """torch.compile(fullgraph=True, aot_eager) around the loss: within the float32 bounds
    of the exact values, as eager is."""
    p = problem(3, 5, 8, 64, seed=4, dtype=torch.float32)
    fn = linear(d.ClipHigher(), p, {"entropy_coef": 0.05, "chunk_size": 4})
    want_loss, loss_err, want, errs = float32_bounds(d.ClipHigher(), p, 0.05, torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for name, f in (("eager", fn), ("compiled", compiled)):
        loss, grad = grads(f, p)
        assert_within(loss, want_loss, loss_err, f"{name} loss")
        for x, y, e in zip(grad, want, errs, strict=True):
            assert_within(x, y, e, f"{name} gradient")


def backward_peak(run: Callable[[], None]) -> int:
    """Peak bytes of live tensors allocated while ``run`` runs (the profiler's events)."""
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    )
    with prof:
        run()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    cur = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def test_memory_is_the_weight_gradient_plus_one_chunk() -> None:
    """Forward and backward allocate the gradients (hidden, weight), one chunk's
    ``[chunk, vocab]`` float32 buffer and the entropy's scratch (one piece), and
    ``O(tokens)`` vectors: never a ``[tokens, vocab]`` tensor (here 16 x the chunk)."""
    batch, seq, dim, vocab, chunk = 4, 128, 32, 4096, 32
    p = problem(batch, seq, dim, vocab, seed=5, dtype=torch.float32)
    leaves = [p[k].clone().requires_grad_(True) for k in ("hidden", "weight")]

    def run() -> None:
        loss = d.linear_policy_loss(
            leaves[0],
            leaves[1],
            p["tokens"],
            p["old"].float(),
            p["adv"].float(),
            p["mask"],
            entropy_coef=0.1,
            chunk_size=chunk,
        )
        loss.backward()

    peak = backward_peak(run)
    grads_bytes = (batch * seq * dim + vocab * dim) * 4
    chunk_bytes = chunk * vocab * 4
    assert peak <= grads_bytes + 2 * chunk_bytes + 64 * batch * seq * 8, peak
    assert peak < batch * seq * vocab * 4 / 4


@pytest.mark.usefixtures("no_runtime_typecheck")  # the library's own checks
def test_bad_inputs_name_the_argument() -> None:
    p = problem(dtype=torch.float32)
    args = (p["hidden"], p["weight"], p["tokens"], p["old"], p["adv"], p["mask"])
    bad_tokens = torch.where(p["mask"], p["tokens"], -100).clone()
    bad_tokens[0, 0] = 13
    cases: list[tuple[dict[str, Any], str]] = [
        ({"objective": d.ClipHigher}, "objective"),
        ({"kl": d.KLPenalty()}, "ref_logp"),
        ({"entropy_coef": torch.tensor(0.1, requires_grad=True)}, "entropy_coef"),
        ({"entropy_coef": torch.ones(2)}, "entropy_coef"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"temperature": 0.0}, "temperature"),
    ]
    for kw, name in cases:
        with pytest.raises(d.InputError, match=name):
            d.linear_policy_loss(*args, **kw)
    with pytest.raises(d.InputError, match="tokens"):
        d.linear_policy_loss(args[0], args[1], bad_tokens, *args[3:])
    bad_tokens[0, 0] = -1  # checked after the chunks ran on clamped ids: still refused
    with pytest.raises(d.InputError, match=r"tokens must hold ids in \[0, vocab\)"):
        d.linear_policy_loss_with_diagnostics(args[0], args[1], bad_tokens, *args[3:])
    with pytest.raises(d.InputError, match="old_logp"):
        d.linear_policy_loss(args[0], args[1], args[2], args[3][:, :-1], *args[4:])
    with pytest.raises(d.InputError, match="hidden"):
        d.linear_policy_loss(args[0][0], *args[1:])


def test_the_docs_example_runs() -> None:
    """docs/linear_loss.md's drop-in example: the composed and one-pass steps agree."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "linear_loss.md").read_text()
    example = re.search(r"## Drop-in\n.*?```python\n(.*?)```", text, re.S)
    assert example, "docs/linear_loss.md lost its drop-in example"
    exec(compile(example.group(1), "docs/linear_loss.md", "exec"), {})
