"""``compiled=True``: the one-graph compiled path (dapo_ops.engine._compiled), here for ClipHigher
through ``token_level_loss`` (every objective: tests/test_objectives.py).

Its loss and gradient, and the reference composition's, are each within a derived bound of
the float64 evaluation (tests/_bounds.py), kinks included (all paths follow ``clamp``'s
convention: tested below on ratios exactly on the bounds). Most properties run the graph with the cheap ``aot_eager``
backend (same graph, no C++ build); one test goes through inductor, as users do.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
from _bounds import F64, assert_within, func_rel, gamma
from _strategies import make_batch
from hypothesis import given
from hypothesis import strategies as st
from test_fused import (
    assert_grad_close,
    assert_loss_close,
    cases,
    exact,
    fused_token_level_loss,
    reference,
)

from dapo_ops import ClipHigher, InputError, checked, token_level_loss
from dapo_ops.engine._engine import LossSpec, generic_terms

# slow: compiles (README's fast subset, -m "not slow and not distributed", leaves it out)
pytestmark = [pytest.mark.usefixtures("no_runtime_typecheck"), pytest.mark.slow]


def compiled_and_reference(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    backend: str = "aot_eager",
    grad_out: float = 1.0,
    **kw: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch._dynamo.reset()  # a fresh graph each time: never the recompile-limit fallback
    lp_c = logp.detach().clone().requires_grad_(True)
    lp_r = logp.detach().clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out = fused_token_level_loss(lp_c, old_logp, adv, mask, compiled=backend, **kw)
    ref = reference(lp_r, old_logp, adv, mask, **kw)
    (out * grad_out).backward()
    (ref * grad_out).backward()
    assert lp_c.grad is not None and lp_r.grad is not None
    assert lp_c.grad.dtype == lp_r.grad.dtype == logp.dtype
    # each path within the derived bound of the exact (float64) loss and gradient
    want = exact(logp, old_logp, adv, mask, out.dtype, **kw)
    for loss, grad, what in ((out, lp_c.grad, "compiled"), (ref, lp_r.grad, "reference")):
        assert_loss_close(loss, want, f"{what} loss")
        assert_grad_close(grad, want, grad_out, f"{what} gradient")
    return out, ref, lp_c.grad, lp_r.grad


@given(cases(), st.sampled_from([1.0, -0.5]))
def test_matches_reference(c: dict[str, Any], grad_out: float) -> None:
    kw = {k: v for k, v in c["kw"].items() if k != "chunk_elems"}
    compiled_and_reference(c["logp"], c["old_logp"], c["adv"], c["mask"], grad_out=grad_out, **kw)


@pytest.mark.parametrize("normalizer", [None, 11, 40.0, "local", "tensor"])
def test_normalizer_forms(normalizer: Any) -> None:
    b = make_batch(4, 10, 5)
    if normalizer == "tensor":
        normalizer = torch.tensor(23, dtype=torch.int64)
    compiled_and_reference(b.logp, b.old_logp, b.advantages, b.mask, normalizer=normalizer)


def test_garbage_in_masked_positions_never_leaks() -> None:
    b = make_batch(5, 9, 3)
    logp = torch.where(b.mask, b.logp, torch.tensor(float("nan")))
    old = torch.where(b.mask, b.old_logp, torch.tensor(-float("inf")))
    adv = torch.where(b.mask, b.advantages[:, None], torch.tensor(float("inf")))
    out, _, g, _ = compiled_and_reference(logp, old, adv, b.mask, dual_clip=3.0)
    assert bool(torch.isfinite(out)) and bool(torch.isfinite(g).all())
    assert bool((g[~b.mask] == 0).all())


def test_no_grad_and_retained_graph() -> None:
    b = make_batch(3, 8, 4)
    with torch.no_grad():
        value = fused_token_level_loss(
            b.logp, b.old_logp, b.advantages, b.mask, compiled="aot_eager"
        )
    assert_loss_close(value, exact(b.logp, b.old_logp, b.advantages, b.mask, value.dtype))
    lp = b.logp.clone().requires_grad_(True)
    loss = fused_token_level_loss(lp, b.old_logp, b.advantages, b.mask, compiled="aot_eager")
    loss.backward(retain_graph=True)
    assert lp.grad is not None
    g1 = lp.grad.clone()
    loss.backward()  # second backward recomputes the gradient: g + g, doubling is exact
    assert torch.equal(lp.grad, 2 * g1)


# logp 0.2 and 1.1 against old 0: exact log-ratios, which log-probs shifted below 0 would
# round; only the ratios matter here, so checked mode (log-probs <= 0) is off.
@checked(False)
def test_kinks_follow_clamps_convention() -> None:
    """On a clip or dual-clip bound every path passes the full gradient; past it, none."""
    logp = torch.tensor([[0.2], [1.1]], dtype=torch.float64)
    old = torch.zeros_like(logp)
    ratio = logp.exp()
    # bounds equal to the ratios, exactly: 1 + eps_high (A > 0) and the dual clip (A < 0)
    eps_high, dual = float(ratio[0, 0]) - 1.0, float(ratio[1, 0])
    assert 1.0 + eps_high == float(ratio[0, 0])
    adv = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    valid = torch.ones_like(logp, dtype=torch.bool)
    scale = torch.tensor(1.0, dtype=torch.float64)
    spec = LossSpec(ClipHigher(eps_low=0.2, eps_high=eps_high, dual_clip=dual))
    _, grad = generic_terms(spec, logp, old, adv, valid, scale, None, None, True)
    assert grad is not None
    assert torch.equal(grad, -adv * ratio)  # full gradient on both bounds
    kw: dict[str, Any] = {"eps_high": eps_high, "dual_clip": dual, "mode": "seq_mean_token_sum"}
    for compiled in (False, "aot_eager"):
        lp = logp.clone().requires_grad_(True)
        fused_token_level_loss(lp, old, adv, valid, compiled=compiled, **kw).backward()
        assert lp.grad is not None
        assert torch.equal(lp.grad, -adv * ratio / 2)  # / 2: rows (the mode)
    lp = logp.clone().requires_grad_(True)
    reference(lp, old, adv, valid, **kw).backward()
    assert lp.grad is not None
    assert torch.equal(lp.grad, -adv * ratio / 2)
    # just outside each bound: no gradient
    _, grad = generic_terms(spec, logp + 1e-9, old, adv, valid, scale, None, None, True)
    assert grad is not None
    assert torch.equal(grad, torch.zeros_like(grad))


def test_public_api_with_inductor() -> None:
    """The path users take: ``token_level_loss(..., compiled=True)``, inductor, twice."""
    torch._dynamo.reset()
    for seed, shape in ((0, (6, 40)), (1, (5, 33))):  # a new shape: dynamic recompile
        b = make_batch(*shape, seed)
        lp_c = b.logp.clone().requires_grad_(True)
        lp_r = b.logp.clone().requires_grad_(True)
        out = token_level_loss(lp_c, b.old_logp, b.advantages, b.mask, dual_clip=3.0, compiled=True)
        ref = token_level_loss(lp_r, b.old_logp, b.advantages, b.mask, dual_clip=3.0)
        out.backward()
        ref.backward()
        want = exact(b.logp, b.old_logp, b.advantages, b.mask, torch.float32, dual_clip=3.0)
        assert lp_c.grad is not None and lp_r.grad is not None
        for loss, grad, what in ((out, lp_c.grad, "inductor"), (ref, lp_r.grad, "eager")):
            assert_loss_close(loss, want, f"{what} loss")
            assert_grad_close(grad, want, 1.0, f"{what} gradient")


def test_bad_compiled_option() -> None:
    b = make_batch(2, 4, 0)
    with pytest.raises(InputError, match="compiled"):
        token_level_loss(b.logp, b.old_logp, b.advantages, b.mask, compiled="yes")  # type: ignore[call-overload]


def test_kl_and_is_weights_compiled_match_eager() -> None:
    """KL penalty and IS weights are on the compiled path too (one graph): compiled and
    eager each within a derived bound of the float64 evaluation of the same loss.

    Bound: per valid token, the loss ``w l_pg + beta k3`` and its gradient are at most
    K = 30 operations and elementary functions on magnitudes ``|A| r w`` (policy
    gradient) and ``beta (e^x + |x| + 1)`` (k3, ``x = ref - logp``; ``beta (e^x + 1)`` for
    its gradient), so each is within ``c = K f + gamma(K)`` (float32, plus float64's) of
    its magnitude; the token mean adds ``gamma(n + 2)`` of the aggregated magnitudes.
    Where the ratio lies within its own rounding of a clip bound the clip decision may go
    either way: there the gradient bound is the whole ``|A| r w``.
    """
    torch._dynamo.reset()
    b = make_batch(5, 12, 3)
    ref_logp, w = b.old_logp - 0.1, torch.rand(5, 12) * 2
    kw: dict[str, Any] = {"ref_logp": ref_logp, "kl_beta": 0.04, "is_weights": w}
    lp_c = b.logp.clone().requires_grad_(True)
    lp_e = b.logp.clone().requires_grad_(True)
    out = token_level_loss(lp_c, b.old_logp, b.advantages, b.mask, compiled=True, **kw)
    ref = token_level_loss(lp_e, b.old_logp, b.advantages, b.mask, **kw)
    out.backward()
    ref.backward()
    assert lp_c.grad is not None and lp_e.grad is not None

    lp64 = b.logp.double().requires_grad_(True)
    kw64 = {"ref_logp": ref_logp.double(), "kl_beta": 0.04, "is_weights": w.double()}
    want = token_level_loss(lp64, b.old_logp.double(), b.advantages.double(), b.mask, **kw64)
    (want_grad,) = torch.autograd.grad(want, lp64)

    valid, n_valid = b.mask, int(b.mask.sum())
    lp, adv = b.logp.double(), b.advantages.double()[:, None]
    r = (lp - b.old_logp.double()).exp()
    x = ref_logp.double() - lp
    pg = adv.abs() * r * w.double()
    loss_mag = torch.where(valid, pg + 0.04 * (x.exp() + x.abs() + 1), 0.0).sum() / n_valid
    grad_mag = torch.where(valid, pg + 0.04 * (x.exp() + 1), 0.0) / n_valid
    c = sum(30 * func_rel(dt) + gamma(30, dt) for dt in (torch.float32, F64))
    n = valid.numel() + 2
    loss_bound = (c + gamma(n, torch.float32) + gamma(n, F64)) * loss_mag
    r_rel = 2 * c
    near = torch.zeros_like(r, dtype=torch.bool)
    for edge in (0.8, 1.28):
        near |= (r - edge).abs() <= r_rel * r
    grad_bound = c * grad_mag + torch.where(near & valid, pg / n_valid, 0.0)
    for loss, grad, what in ((out, lp_c.grad, "compiled"), (ref, lp_e.grad, "eager")):
        assert_within(loss, want, loss_bound, f"{what} loss")
        assert_within(grad, want_grad, grad_bound, f"{what} gradient")


def test_recompile_limit_falls_back_to_eager_with_a_warning() -> None:
    torch._dynamo.reset()
    b = make_batch(3, 8, 1)
    with torch._dynamo.config.patch(recompile_limit=1):
        _recompile_twice(b)
    torch._dynamo.reset()


def _recompile_twice(b: Any) -> None:
    for dtype in (torch.float32, torch.float64):  # one configuration, a second graph
        lp, old, adv = (t.to(dtype) for t in (b.logp, b.old_logp, b.advantages))
        lp_c = lp.clone().requires_grad_(True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fused_token_level_loss(lp_c, old, adv, b.mask, compiled="aot_eager")
        fell_back = any("ran eagerly" in str(w.message) for w in caught)
        assert fell_back == (dtype == torch.float64)
        out.backward()
        want = exact(lp, old, adv, b.mask, dtype)
        assert_loss_close(out, want)
        assert lp_c.grad is not None
        assert_grad_close(lp_c.grad, want)


def test_each_configuration_has_its_own_recompile_budget() -> None:
    """Distinct configurations (objective values, modes) compile a graph each without
    counting against one another's ``recompile_limit``: a process that uses more
    configurations than the limit never falls back to eager (it used to, for the ninth)."""
    torch._dynamo.reset()
    b = make_batch(3, 8, 1)
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for eps_high in (0.28, 0.3):
            for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
                lp_c = b.logp.clone().requires_grad_(True)
                fused_token_level_loss(
                    lp_c, b.old_logp, b.advantages, b.mask, compiled="aot_eager", mode=mode,
                    eps_high=eps_high,
                ).backward()  # fmt: skip
                want = exact(b.logp, b.old_logp, b.advantages, b.mask, torch.float32,
                             mode=mode, eps_high=eps_high)  # fmt: skip
                assert lp_c.grad is not None
                assert_grad_close(lp_c.grad, want)
    torch._dynamo.reset()


def test_configurations_past_the_cap_share_one_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new objective value every step (a schedule) does not compile without end: past
    MAX_CONFIGURATIONS the configurations share one function, and past its recompile
    limit the call warns and runs eagerly, as one shared function always did."""
    from dapo_ops.engine import _compiled

    torch._dynamo.reset()
    monkeypatch.setattr(_compiled, "_COMPILED", {})
    monkeypatch.setattr(_compiled, "MAX_CONFIGURATIONS", 2)
    b = make_batch(3, 8, 1)
    fell_back = []
    with torch._dynamo.config.patch(recompile_limit=1):
        for eps_high in (0.25, 0.26, 0.27, 0.28):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fused_token_level_loss(
                    b.logp, b.old_logp, b.advantages, b.mask, compiled="aot_eager",
                    eps_high=eps_high,
                )  # fmt: skip
            fell_back.append(any("ran eagerly" in str(w.message) for w in caught))
    assert fell_back == [False, False, False, True]
    assert len(_compiled._COMPILED) == 3  # two of their own, one shared
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_compiled_matches_eager() -> None:
    dev = torch.device("cuda")
    b = make_batch(8, 64, 7)
    lp_c = b.logp.to(dev).requires_grad_(True)
    lp_r = b.logp.to(dev).requires_grad_(True)
    args = (b.old_logp.to(dev), b.advantages.to(dev), b.mask.to(dev))
    out = token_level_loss(lp_c, *args, compiled=True)
    ref = token_level_loss(lp_r, *args)
    out.backward()
    ref.backward()
    want = exact(b.logp, b.old_logp, b.advantages, b.mask, torch.float32)
    assert lp_c.grad is not None and lp_r.grad is not None
    for loss, grad, what in ((out, lp_c.grad, "compiled"), (ref, lp_r.grad, "eager")):
        assert_loss_close(loss.cpu(), want, f"{what} loss")
        assert_grad_close(grad.cpu(), want, 1.0, f"{what} gradient")


def test_import_leaves_dynamo_unloaded() -> None:
    """``import dapo_ops`` stays cheap: torch._dynamo (~1 s) only loads for compiled=True."""
    code = "import sys, dapo_ops; sys.exit(int('torch._dynamo' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
