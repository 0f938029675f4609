"""The engine's fused path for ClipHigher (dapo_ops.engine._engine) equals the reference composition.

Reference: ``token_level_aggregate(clip_higher_surrogate(...), mask, ...)`` under autograd.
The fused logp gradient is computed with the same roundings in the same order, so for a
plain ``loss.backward()`` it is compared *bitwise*; loss values differ by summation order.
Both write the per-token loss in the clamp form (``clipped_objective``); the tests below
also check that form against the spec where it matters: exact zeros where the clip is
active, even next to a bound.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _bounds import (
    F64,
    LossReference,
    assert_within,
    func_rel,
    gamma,
    loss_reference,
    round_bound,
)
from _strategies import MODES, make_batch
from hypothesis import given
from hypothesis import strategies as st

from dapo_ops import (
    ClipHigher,
    InputError,
    KLPenalty,
    checked,
    clip_higher_surrogate,
    kl_penalty,
    policy_loss,
    testing,
    token_level_aggregate,
    token_level_loss,
)
from dapo_ops.engine._engine import eager_body, fused_loss
from dapo_ops.engine.policy import prepare


def fused_token_level_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    chunk_elems: int | None = None,
    compiled: bool | str = False,
    mode: str = "token_mean",
    normalizer: Any = None,
    max_len: int | None = None,
    **clip: Any,
) -> torch.Tensor:
    """``token_level_loss`` through the engine, with the CPU block size (``chunk_elems``)
    and the compile backend (``compiled``: a backend name) exposed for these tests."""
    spec, tensors, den = prepare(
        ClipHigher(**clip), logp, old_logp, adv, mask, mode=mode, normalizer=normalizer,
        max_len=max_len, ref_logp=None, kl=None, is_weights=None, compiled=False,
    )  # fmt: skip
    spec = dataclasses.replace(spec, chunk_elems=chunk_elems)
    if compiled:
        from dapo_ops.engine._compiled import compiled_body

        backend = "inductor" if compiled is True else str(compiled)
        return fused_loss(spec, tensors, den, compiled_body(backend))
    return fused_loss(spec, tensors, den, eager_body)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def reference(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    **kw: Any,
) -> torch.Tensor:
    surrogate_kw = {
        k: kw[k] for k in ("eps_low", "eps_high", "dual_clip", "log_ratio_clamp") if k in kw
    }
    agg_kw = {k: kw[k] for k in ("mode", "normalizer", "max_len") if k in kw}
    per_token = clip_higher_surrogate(logp, old_logp, adv, mask, **surrogate_kw)
    return token_level_aggregate(per_token, mask, **agg_kw)


def both(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    grad_out: float = 1.0,
    chunk_elems: int | None = None,
    **kw: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fused loss, reference loss, fused logp grad, reference logp grad)."""
    lp_f = logp.detach().clone().requires_grad_(True)
    lp_r = logp.detach().clone().requires_grad_(True)
    fused = fused_token_level_loss(lp_f, old_logp, adv, mask, chunk_elems=chunk_elems, **kw)
    ref = reference(lp_r, old_logp, adv, mask, **kw)
    assert fused.dtype == ref.dtype and fused.shape == ref.shape == ()
    if mask.numel():  # both losses within the derived bound of the exact one
        want = exact(logp, old_logp, adv, mask, fused.dtype, **kw)
        assert_loss_close(fused, want, "fused loss")
        assert_loss_close(ref, want, "reference composition's loss")
    (fused * grad_out).backward()
    (ref * grad_out).backward()
    assert lp_f.grad is not None and lp_r.grad is not None
    return fused, ref, lp_f.grad, lp_r.grad


def exact(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    dtype: torch.dtype,
    **kw: Any,
) -> LossReference:
    """The loss and gradient in float64 on the same input values, with the bounds of an
    evaluation in ``dtype`` (the arithmetic dtype: float32, or float64 for float64 input)."""
    options = {k: v for k, v in kw.items() if k not in ("chunk_elems", "compiled")}
    return loss_reference(logp, old_logp, adv, mask, dtype=dtype, **options)


def assert_loss_close(got: torch.Tensor, want: LossReference, what: str = "loss") -> None:
    """A loss within ``(f + u (D + 1) + gamma(n + 2)) aggregate(|l|)`` of the exact one
    (tests/_bounds.loss_reference); any correct evaluation order meets it."""
    assert got.shape == ()
    if bool(want.loss.isnan()):  # a NaN on a valid token: the loss must say so
        assert bool(got.isnan()), what
        return
    assert_within(got, want.loss, want.loss_err, what)


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    batch = draw(st.integers(1, 6))
    seq = draw(st.integers(1, 24))
    seed = draw(st.integers(0, 2**31 - 1))
    b = make_batch(batch, seq, seed, spread=draw(st.sampled_from([0.01, 0.2, 0.5, 2.0, 30.0])))
    g = torch.Generator().manual_seed(seed + 1)
    dtype = draw(st.sampled_from(DTYPES))
    adv_layout = draw(st.sampled_from(["batch", "batch 1", "batch seq"]))
    adv = {
        "batch": b.advantages,
        "batch 1": b.advantages[:, None],
        "batch seq": b.advantages[:, None] * torch.rand(batch, seq, generator=g) * 2,
    }[adv_layout]
    if draw(st.booleans()):  # some zero advantages
        adv = torch.where(torch.rand(adv.shape, generator=g) < 0.3, 0.0, adv)
    mask = b.mask if draw(st.booleans()) else b.mask.to(torch.int64)
    return {
        "logp": b.logp.to(dtype),
        "old_logp": b.old_logp.to(draw(st.sampled_from([dtype, torch.float32]))),
        "adv": adv.to(draw(st.sampled_from([dtype, torch.float32]))),
        "mask": mask,
        "kw": {
            "mode": draw(st.sampled_from(MODES)),
            "dual_clip": draw(st.sampled_from([None, 3.0, 1.5])),
            "eps_low": draw(st.sampled_from([0.2, 0.0, 0.5])),
            "eps_high": draw(st.sampled_from([0.28, 0.0, 2.0])),
            "normalizer": draw(st.sampled_from([None, 7, 100.0])),
            "max_len": draw(st.sampled_from([None, 50])),
            "chunk_elems": draw(st.sampled_from([None, 1, 20, 10_000])),
        },
    }


@given(cases())
def test_matches_reference_bitwise_gradient(c: dict[str, Any]) -> None:
    _fused, _ref, g_fused, g_ref = both(c["logp"], c["old_logp"], c["adv"], c["mask"], **c["kw"])
    assert g_fused.dtype == c["logp"].dtype
    assert torch.equal(g_fused, g_ref)


@given(cases(), st.sampled_from([3.0, -0.5, 1e-3]))
def test_scaled_backward_matches(c: dict[str, Any], grad_out: float) -> None:
    _, _, g_fused, g_ref = both(
        c["logp"], c["old_logp"], c["adv"], c["mask"], grad_out=grad_out, **c["kw"]
    )
    want = exact(c["logp"], c["old_logp"], c["adv"], c["mask"], torch.float32, **c["kw"])
    assert_grad_close(g_fused, want, grad_out, "fused gradient")
    assert_grad_close(g_ref, want, grad_out, "reference gradient")


def assert_grad_close(
    got: torch.Tensor, want: LossReference, grad_out: float = 1.0, what: str = "gradient"
) -> None:
    """``got`` (the gradient of ``grad_out * loss``, in the input dtype) within the bound of
    the exact gradient times ``grad_out``: the float32 gradient's bound, scaled, plus the
    rounding of the product and two roundings to the input dtype (the reference rounds its
    gradient to bf16/fp16 before scaling it). Past the dtype's largest value the correctly
    rounded gradient is +-inf (fp16 tops out at 65504): expected there; within the bound of
    that edge, either is accepted."""
    scaled = want.grad * grad_out
    bound = abs(grad_out) * want.grad_err + round_bound(scaled.abs(), torch.float32)
    bound = bound + 2 * round_bound(scaled.abs() + bound, got.dtype)
    top = torch.finfo(got.dtype).max
    target = torch.where(scaled.abs() - bound > top, scaled.sign() * math.inf, scaled)
    edge = ((scaled.abs() - top).abs() <= bound) & got.isinf()
    edge &= got.double().sign() == scaled.sign()
    assert_within(torch.where(edge, scaled, got.double()), target, bound, what)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_garbage_in_masked_positions(mode: str, dtype: torch.dtype) -> None:
    b = make_batch(5, 9, 3)
    nan, inf = torch.tensor(float("nan")), torch.tensor(float("inf"))
    logp = torch.where(b.mask, b.logp, nan).to(dtype)
    old = torch.where(b.mask, b.old_logp, -inf).to(dtype)
    adv = torch.where(b.mask, b.advantages[:, None], inf)  # [batch, seq] with inf padding
    fused, _ref, g_fused, g_ref = both(logp, old, adv, b.mask, mode=mode, chunk_elems=18)
    assert bool(torch.isfinite(fused)) and bool(torch.isfinite(g_fused).all())
    assert torch.equal(g_fused, g_ref)
    assert bool((g_fused[~b.mask] == 0).all())


@pytest.mark.parametrize("mode", MODES)
def test_all_masked_batch(mode: str) -> None:
    logp = torch.full((3, 4), float("nan"))
    mask = torch.zeros(3, 4, dtype=torch.bool)
    fused, _, g_fused, _ = both(logp, logp, torch.ones(3), mask, mode=mode)
    assert fused.item() == 0.0 and bool((g_fused == 0).all())
    empty = torch.zeros(0, 5)
    fused, _, g_fused, _ = both(empty, empty, torch.zeros(0), empty.bool(), mode=mode)
    assert fused.item() == 0.0 and g_fused.shape == (0, 5)


# The log-ratios below are given as logp against old = 0, so that each ratio is exact;
# log-probs shifted below 0 would round them: checked mode (log-probs <= 0) is off.
@checked(False)
def test_clip_active_gives_exact_zero_and_log_ratio_clamp() -> None:
    # ratios e^-30 (clamped), 0.5, 1, 1.5, e^30 (clamped), for A > 0 and A < 0
    lr = torch.tensor([-30.0, math.log(0.5), 0.0, math.log(1.5), 30.0, 20.0])
    logp = lr.repeat(2, 1)
    old = torch.zeros_like(logp)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones_like(logp, dtype=torch.bool)
    for dual in (None, 3.0):
        _fused, _ref, g_fused, g_ref = both(logp, old, adv, mask, dual_clip=dual)
        assert torch.equal(g_fused, g_ref)
        nonzero = (g_fused != 0).tolist()
        # A > 0: the clamp stops lr = -30 (its unclipped branch would pass), the clip
        # stops r = 1.5, e^30 and e^20
        assert nonzero[0] == [False, True, True, False, False, False]
        # A < 0: the clip stops r = 0.5 and e^-30, the clamp stops lr = 30; lr = 20 sits
        # on the clamp bound, which passes the gradient (clamp's autograd is inclusive)
        # unless the dual clip (r > 3) stops it
        assert nonzero[1] == [False, False, True, True, False, dual is None]


def _near_bound_batch(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """Ratios within a few ulps of 1 - eps_low, 1 + eps_high and the dual bound 3."""
    g = torch.Generator().manual_seed(seed)
    n = 4096
    bounds = torch.tensor([0.8, 1.28, 3.0], dtype=torch.float64)
    target = bounds[torch.randint(0, 3, (n,), generator=g)]
    lr = torch.log(target) + torch.randint(-40, 41, (n,), generator=g).double() * 2e-8
    logp = lr.to(dtype).reshape(64, 64)
    old = torch.zeros_like(logp)
    adv = (torch.rand(64, 64, generator=g, dtype=torch.float64) * 8 - 4).to(dtype)
    return logp, old, adv


@pytest.mark.parametrize("adv_layout", ["batch 1", "batch seq"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@checked(False)  # ratios within ulps of a bound: logp against old = 0, as above
def test_near_bound_ratios_follow_the_spec(dtype: torch.dtype, adv_layout: str) -> None:
    """Within ulps of a bound the gradient is -A r inside [lo_A, hi_A] and exactly 0 out.

    The batch holds float ties (ratio outside the band, ``-A r == -A clip(r)`` after
    rounding), where ``torch.maximum``'s autograd would pass half the gradient.
    """
    logp, old, adv = _near_bound_batch(dtype, 0)
    if adv_layout == "batch 1":
        adv = adv[:, :1]
    mask = torch.ones_like(logp, dtype=torch.bool)
    r = torch.exp(logp - old)
    cl = r.clamp(0.8, 1.28)
    ties = (r != cl) & (-adv * r == -adv * cl) & (adv != 0)
    if dtype == torch.float32:
        assert int(ties.sum()) > 0
    for dual in (None, 3.0):
        _fused, _ref, g_fused, g_ref = both(logp, old, adv, mask, dual_clip=dual, chunk_elems=1000)
        assert torch.equal(g_fused, g_ref)
        cap = math.inf if dual is None else dual
        passes = torch.where(adv < 0, (r >= 0.8) & (r <= cap), r <= 1.28) & (adv != 0)
        assert torch.equal(g_fused != 0, passes)


@pytest.mark.parametrize("constant", ["old_logp", "advantages", "normalizer"])
def test_constants_that_require_grad_are_refused(constant: str) -> None:
    """A gradient through old_logp, the advantages or the normaliser would silently bend
    the policy gradient (``token_level_loss(logp, logp, ...)``): refused, with the hint."""
    b = make_batch(4, 7, 11, spread=0.5)
    args: dict[str, Any] = {
        "old_logp": b.old_logp,
        "advantages": b.advantages,
        "normalizer": torch.tensor(9.0),
    }
    args[constant] = args[constant].clone().requires_grad_(True)
    lp = b.logp.clone().requires_grad_(True)
    with pytest.raises(InputError, match=rf"{constant} requires grad.*detach\(\)"):
        fused_token_level_loss(
            lp, args["old_logp"], args["advantages"], b.mask, normalizer=args["normalizer"]
        )
    with torch.no_grad():  # no gradient is being recorded: nothing to bend
        fused_token_level_loss(
            lp, args["old_logp"], args["advantages"], b.mask, normalizer=args["normalizer"]
        )


@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("mode", MODES)
def test_gradcheck_float64(dual_clip: float | None, mode: str) -> None:
    b = make_batch(3, 5, 7, dtype=torch.float64, spread=0.3)

    def f(lp: torch.Tensor) -> torch.Tensor:
        return fused_token_level_loss(
            lp, b.old_logp, b.advantages, b.mask, mode=mode, normalizer=6.0, dual_clip=dual_clip,
            chunk_elems=5,
        )  # fmt: skip

    assert torch.autograd.gradcheck(f, (b.logp.clone().requires_grad_(True),))


def test_no_grad_and_inputs_untouched() -> None:
    b = make_batch(3, 8, 4)
    logp = b.logp.clone().requires_grad_(True)
    before = [t.clone() for t in (b.logp, b.old_logp, b.advantages)]
    with torch.no_grad():
        out = fused_token_level_loss(logp, b.old_logp, b.advantages, b.mask)
    assert not out.requires_grad
    assert_loss_close(out, exact(b.logp, b.old_logp, b.advantages, b.mask, out.dtype))
    for t, t0 in zip((logp.detach(), b.old_logp, b.advantages), before, strict=True):
        assert torch.equal(t, t0)


def test_float64_stays_float64() -> None:
    b = make_batch(3, 8, 4)
    fused, _ref, g_fused, g_ref = both(b.logp, b.old_logp, b.advantages.double(), b.mask)
    assert fused.dtype == torch.float64 and g_fused.dtype == torch.float32
    assert torch.equal(g_fused, g_ref)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"eps_low": 1.0}, "eps_low"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"log_ratio_clamp": 0.0}, "log_ratio_clamp"),
        ({"mode": "sum"}, "mode"),
        ({"normalizer": 0}, "normalizer"),
        ({"normalizer": float("inf")}, "normalizer"),
        ({"normalizer": float("nan")}, "normalizer"),
        ({"normalizer": "global"}, "normalizer"),
        ({"normalizer": torch.ones(2)}, "normalizer"),
        ({"max_len": 0}, "max_len"),
    ],
)
@pytest.mark.usefixtures("no_runtime_typecheck")  # the library's own checks, not beartype's
def test_bad_options_raise_like_the_reference(kwargs: dict[str, Any], match: str) -> None:
    b = make_batch(2, 3, 0)
    with pytest.raises(InputError, match=match):
        fused_token_level_loss(b.logp, b.old_logp, b.advantages, b.mask, **kwargs)
    with pytest.raises(InputError, match=match):
        reference(b.logp, b.old_logp, b.advantages, b.mask, **kwargs)


@pytest.mark.usefixtures("no_runtime_typecheck")
def test_bad_shapes_raise() -> None:
    b = make_batch(2, 3, 0)
    with pytest.raises(InputError, match="advantages"):
        fused_token_level_loss(b.logp, b.old_logp, torch.ones(3), b.mask)
    with pytest.raises(InputError, match="old_logp"):
        fused_token_level_loss(b.logp, b.old_logp[:1], b.advantages, b.mask)
    with pytest.raises(InputError, match="mask"):
        fused_token_level_loss(b.logp, b.old_logp, b.advantages, b.mask.float())


def _compiled(fn: Callable[..., Any], backend: str) -> Callable[..., Any]:
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=backend)


@pytest.mark.usefixtures("no_runtime_typecheck")
def test_traces_fullgraph_and_compiled_variant() -> None:
    b = make_batch(6, 20, 9)
    logp = torch.where(b.mask, b.logp, torch.tensor(float("nan")))
    kw: dict[str, Any] = {"dual_clip": 3.0, "mode": "seq_mean_token_mean"}
    want = exact(logp, b.old_logp, b.advantages, b.mask, torch.float32, **kw)

    def step(lp: torch.Tensor) -> torch.Tensor:
        return fused_token_level_loss(lp, b.old_logp, b.advantages, b.mask, **kw)

    # the whole loss (autograd.Function included) traced into one graph, no break
    lp = logp.clone().requires_grad_(True)
    out = _compiled(step, "aot_eager")(lp)
    out.backward()
    assert_loss_close(out, want)
    assert lp.grad is not None
    assert_within(lp.grad, want.grad, want.grad_err, "gradient")

    # the compiled-body variant (a cheap backend keeps the suite fast; the benchmark
    # uses inductor)
    lp = logp.clone().requires_grad_(True)
    out = fused_token_level_loss(lp, b.old_logp, b.advantages, b.mask, compiled="aot_eager", **kw)
    out.backward()
    assert_loss_close(out, want)
    assert lp.grad is not None
    assert_within(lp.grad, want.grad, want.grad_err, "gradient")


@checked(False)  # logp 40 and 25 (log-ratio clamp active) against old in (-4, 0)
def test_cpu_fast_path_needs_no_fallback_on_clean_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finite inputs (an active log-ratio clamp or inf padding included) and NaN in
    masked positions stay on the float-only CPU path; only a NaN log-ratio on a *valid*
    token sends its block to the `where`-based generic body."""
    import dapo_ops.engine._engine as engine

    calls: list[int] = []
    exact = engine.generic_terms

    def counting(*args: Any) -> Any:
        calls.append(1)
        return exact(*args)

    monkeypatch.setattr(engine, "generic_terms", counting)
    b = make_batch(6, 10, 5)
    far = b.logp.clone()
    far[0, :3] = torch.tensor([-40.0, 40.0, 25.0])  # the log-ratio clamp is active
    inf_pad = torch.where(b.mask, b.old_logp, torch.tensor(float("-inf")))  # lr = +inf there
    for logp, old in ((b.logp, b.old_logp), (far, b.old_logp), (b.logp, inf_pad)):
        for dual in (None, 3.0):
            for adv in (b.advantages, b.advantages[:, None] * torch.rand(6, 10)):
                fused, _ref, g_fused, g_ref = both(
                    logp, old, adv, b.mask, dual_clip=dual, chunk_elems=20
                )
                assert torch.equal(g_fused, g_ref)
    logp = torch.where(b.mask, b.logp, torch.tensor(float("nan")))
    _, _, g_fused, g_ref = both(logp, b.old_logp, b.advantages, b.mask, chunk_elems=20)
    assert torch.equal(g_fused, g_ref)
    assert not calls
    logp = b.logp.clone()
    logp[b.mask.nonzero()[0].tolist()] = float("nan")  # on a valid token: the loss is NaN
    fused, _, _, _ = both(logp, b.old_logp, b.advantages, b.mask, chunk_elems=20)
    assert calls and bool(fused.isnan())


def test_retained_graph_backward_twice_and_mutated_grad() -> None:
    """The gradient buffer is handed to the first backward; later ones recompute it."""
    b = make_batch(4, 9, 8)
    _, _, _, g_ref = both(b.logp, b.old_logp, b.advantages, b.mask, dual_clip=3.0)
    lp = b.logp.clone().requires_grad_(True)
    loss = fused_token_level_loss(lp, b.old_logp, b.advantages, b.mask, dual_clip=3.0)
    (g1,) = torch.autograd.grad(loss, lp, retain_graph=True)
    assert torch.equal(g1, g_ref)
    g1.zero_()  # the caller owns the returned buffer
    (g2,) = torch.autograd.grad(loss, lp, retain_graph=True)
    assert torch.equal(g2, g_ref)
    loss.backward(retain_graph=True)
    loss.backward()
    assert lp.grad is not None
    assert torch.equal(lp.grad, 2 * g_ref)  # g + g: doubling is exact


@given(cases())
def test_forward_without_grad_matches(c: dict[str, Any]) -> None:
    """The no-grad forward (its own buffers, no gradient) gives the same loss."""
    kw = c["kw"]
    with torch.no_grad():
        fused = fused_token_level_loss(c["logp"], c["old_logp"], c["adv"], c["mask"], **kw)
    assert_loss_close(
        fused, exact(c["logp"], c["old_logp"], c["adv"], c["mask"], fused.dtype, **kw)
    )


@pytest.mark.parametrize("adv_layout", ["batch", "batch seq"])
def test_huge_advantages_on_masked_rows_stay_out(adv_layout: str) -> None:
    """An inf advantage on a fully masked row: the float-only path would make 0 * inf."""
    b = make_batch(5, 12, 2)
    mask = b.mask.clone()
    mask[2] = False
    adv = b.advantages.clone()
    adv[2] = float("inf")
    if adv_layout == "batch seq":
        adv = torch.where(mask, adv[:, None], float("-inf"))
    for dual in (None, 3.0):
        fused, _ref, g_fused, g_ref = both(b.logp, b.old_logp, adv, mask, dual_clip=dual)
        assert bool(torch.isfinite(fused)) and bool(torch.isfinite(g_fused).all())
        assert torch.equal(g_fused, g_ref)


def test_default_dtype_float64_changes_nothing() -> None:
    b = make_batch(4, 9, 6)
    want = both(b.logp, b.old_logp, b.advantages, b.mask, dual_clip=3.0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = both(b.logp, b.old_logp, b.advantages, b.mask, dual_clip=3.0)
    finally:
        torch.set_default_dtype(before)
    assert got[0].dtype == torch.float32
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])


@pytest.mark.parametrize("chunk_elems", [None, 10])
def test_non_contiguous_inputs(chunk_elems: int | None) -> None:
    """Strided views (a column slice, a transpose) give the contiguous result."""
    b = make_batch(6, 11, 12)
    wide = torch.randn(6, 30)
    wide[:, 3:14] = b.logp
    logp = wide[:, 3:14]  # row stride 30
    old = b.old_logp.t().contiguous().t()  # column-major
    mask = b.mask.t().contiguous().t()
    adv = torch.randn(6, 11).t().contiguous().t()
    assert not (logp.is_contiguous() or old.is_contiguous() or mask.is_contiguous())
    for a in (b.advantages, adv):
        for dual in (None, 3.0):
            _fused, _ref, g_fused, g_ref = both(
                logp, old, a, mask, dual_clip=dual, chunk_elems=chunk_elems
            )
            want = both(b.logp, b.old_logp, a.contiguous(), b.mask, dual_clip=dual)
            assert torch.equal(g_fused, g_ref) and torch.equal(g_fused, want[2])


@given(cases(), st.sampled_from([float("nan"), float("inf"), -float("inf")]), st.data())
def test_masked_garbage_changes_nothing_bitwise(c: dict[str, Any], junk: float, data: Any) -> None:
    """The documented promise: masked positions change nothing, bit for bit (loss and
    gradient), whatever they hold and wherever (logp, old_logp, per-token advantages, or
    the per-row advantage of a fully masked row)."""
    logp, old, adv, mask = c["logp"], c["old_logp"], c["adv"], c["mask"].bool()
    kw = c["kw"]
    where = data.draw(st.sampled_from(["logp", "old_logp", "adv", "all"]))
    dirty = {"logp": logp, "old_logp": old, "adv": adv}
    bad = torch.tensor(junk)
    for name in ("logp", "old_logp") if where == "all" else (where,):
        if name != "adv":
            dirty[name] = torch.where(mask, dirty[name], bad.to(dirty[name].dtype))
    if where in ("adv", "all"):
        if adv.ndim == 2 and adv.shape[1] == mask.shape[1]:
            dirty["adv"] = torch.where(mask, adv, bad.to(adv.dtype))
        else:  # per-row: garbage on the rows with no valid token
            empty = ~mask.any(dim=-1)
            dirty["adv"] = torch.where(empty.view(adv.shape), bad.to(adv.dtype), adv)
    lp_c = logp.detach().clone().requires_grad_(True)
    lp_d = dirty["logp"].detach().clone().requires_grad_(True)
    clean = fused_token_level_loss(lp_c, old, adv, mask, **kw)
    dirt = fused_token_level_loss(lp_d, dirty["old_logp"], dirty["adv"], mask, **kw)
    clean.backward()
    dirt.backward()
    assert torch.equal(clean, dirt), (clean, dirt)
    assert lp_c.grad is not None and lp_d.grad is not None
    assert torch.equal(lp_c.grad, lp_d.grad)


@pytest.mark.parametrize("mutated", ["logp", "old_logp", "advantages"])
def test_in_place_change_between_forward_and_backward_raises(mutated: str) -> None:
    """The gradient is computed in the forward pass: a saved input changed in place
    before backward must raise (as torch does), never give the old gradient silently."""
    b = make_batch(3, 6, 9)
    leaf = b.logp.clone().requires_grad_(True)
    tensors = {"logp": leaf * 1.0, "old_logp": b.old_logp.clone(), "advantages": b.advantages}
    tensors["advantages"] = tensors["advantages"].clone()
    loss = fused_token_level_loss(
        tensors["logp"], tensors["old_logp"], tensors["advantages"], b.mask
    )
    with torch.no_grad():
        tensors[mutated].add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("with_kl_is", [False, True])
def test_double_backward_differentiates_the_definition(with_kl_is: bool) -> None:
    """``create_graph=True`` gives a gradient with a graph: its own derivative (e.g. a
    gradient penalty) equals the reference composition's, KL and IS weights included."""
    b = make_batch(4, 7, 10, dtype=torch.float64, spread=0.3)
    ref_logp, w = b.old_logp - 0.2, torch.rand(4, 7, dtype=torch.float64) * 2
    kw: dict[str, Any] = {"ref_logp": ref_logp, "kl_beta": 0.1, "is_weights": w}
    kw = kw if with_kl_is else {}
    lp_f = b.logp.clone().requires_grad_(True)
    lp_r = b.logp.clone().requires_grad_(True)
    fused = token_level_loss(lp_f, b.old_logp, b.advantages, b.mask, dual_clip=3.0, **kw)
    per_token = clip_higher_surrogate(lp_r, b.old_logp, b.advantages, b.mask, dual_clip=3.0)
    if with_kl_is:
        per_token = per_token * w + 0.1 * kl_penalty(lp_r, ref_logp, b.mask)
    ref = token_level_aggregate(per_token, b.mask)
    (g_f,) = torch.autograd.grad(fused, lp_f, create_graph=True)
    (g_r,) = torch.autograd.grad(ref, lp_r, create_graph=True)
    assert g_f.requires_grad
    # Two float64 evaluations of one per-token formula (token_mean: no sum enters a
    # gradient entry) of at most K = 30 operations and elementary functions: each entry
    # within c * S of the other, S the sum of the magnitudes of its contributions
    # (policy gradient |w A r| rho, k3's beta (e^(ref - logp) + 1)) over N, and c = 2 (K f +
    # gamma(K)). The second derivative of sum(g^2), 2 g dg, inherits 2 c S^2 from each
    # factor's error and its own rounding: 6 c S^2.
    r = (b.logp - b.old_logp).exp()
    s_t = (b.advantages[:, None].abs() * r * (w if with_kl_is else 1.0)).clamp(min=0)
    if with_kl_is:
        s_t = s_t + 0.1 * ((ref_logp - b.logp).exp() + 1)
    s_t = torch.where(b.mask, s_t, 0.0) / b.mask.sum()
    c = 2 * (30 * func_rel(F64) + gamma(30, F64))
    assert_within(g_f, g_r, c * s_t, "first derivative")
    (h_f,) = torch.autograd.grad(g_f.pow(2).sum(), lp_f)
    (h_r,) = torch.autograd.grad(g_r.pow(2).sum(), lp_r)
    assert_within(h_f, h_r, 6 * c * s_t.square(), "second derivative")
    assert bool(h_f.abs().sum() > 0)


@pytest.mark.parametrize("adv_layout", ["batch", "batch seq"])
@pytest.mark.parametrize("with_kl_is", [False, True])
def test_zero_advantages_keep_the_reference_sign_of_zero(adv_layout: str, with_kl_is: bool) -> None:
    """A = +0.0 (a group with equal rewards): autograd through the reference gives -0.0
    (``(w * -A) * r``) on valid unclipped tokens and +0.0 on clipped and masked ones; the
    CPU kernel gives the same bits, with and without KL (clamp acting) and IS weights."""
    b = make_batch(5, 12, 21, spread=0.5)
    adv = torch.zeros(5) if adv_layout == "batch" else torch.zeros(5, 12)
    adv[1] = 0.7  # one row with a signal
    extra: dict[str, Any] = {}
    if with_kl_is:
        noise = torch.randn(5, 12, generator=torch.Generator().manual_seed(2))
        ref = -(b.logp + noise).abs()  # log-probs: <= 0
        w = torch.rand(5, 12, generator=torch.Generator().manual_seed(3))
        extra = {"ref_logp": ref, "kl": KLPenalty(beta=0.1, estimator="k2", log_ratio_clamp=0.5)}
        extra["is_weights"] = w
    grads = []
    for loss in (policy_loss, testing.reference_loss):
        lp = b.logp.clone().requires_grad_(True)
        loss(ClipHigher(), lp, b.old_logp, adv, b.mask, **extra).backward()
        assert lp.grad is not None
        grads.append(lp.grad)
    assert torch.equal(grads[0], grads[1])
    assert torch.equal(grads[0].signbit(), grads[1].signbit())
    assert bool(grads[0].signbit().any())  # the case is exercised
