"""``compiled=True``: the one-graph compiled path (dapo_ops._compiled), here for ClipHigher
through ``token_level_loss`` (every objective: tests/test_objectives.py).

Its loss equals the reference composition up to summation order and its gradient up to
float rounding, kinks included (all paths follow ``clamp``'s convention: tested below on
ratios exactly on the bounds). Most properties run the graph with the cheap ``aot_eager``
backend (same graph, no C++ build); one test goes through inductor, as users do.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
from _strategies import make_batch
from hypothesis import given
from hypothesis import strategies as st
from test_fused import assert_loss_close, cases, fused_token_level_loss, reference

from dapo_ops import ClipHigher, InputError, token_level_loss
from dapo_ops._engine import LossSpec, generic_terms

pytestmark = pytest.mark.usefixtures("no_runtime_typecheck")


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
    return out, ref, lp_c.grad, lp_r.grad


def assert_grad_close(g: torch.Tensor, g_ref: torch.Tensor) -> None:
    assert g.dtype == g_ref.dtype
    low = g.dtype in (torch.bfloat16, torch.float16)
    torch.testing.assert_close(g.double(), g_ref.double(), rtol=1e-2 if low else 1e-6, atol=1e-12)


@given(cases(), st.sampled_from([1.0, -0.5]))
def test_matches_reference(c: dict[str, Any], grad_out: float) -> None:
    kw = {k: v for k, v in c["kw"].items() if k != "chunk_elems"}
    out, ref, g, g_ref = compiled_and_reference(
        c["logp"], c["old_logp"], c["adv"], c["mask"], grad_out=grad_out, **kw
    )
    assert_loss_close(out, ref)
    assert_grad_close(g, g_ref)


@pytest.mark.parametrize("normalizer", [None, 11, 40.0, "local", "tensor"])
def test_normalizer_forms(normalizer: Any) -> None:
    b = make_batch(4, 10, 5)
    if normalizer == "tensor":
        normalizer = torch.tensor(23, dtype=torch.int64)
    out, ref, g, g_ref = compiled_and_reference(
        b.logp, b.old_logp, b.advantages, b.mask, normalizer=normalizer
    )
    assert_loss_close(out, ref)
    assert_grad_close(g, g_ref)


def test_garbage_in_masked_positions_never_leaks() -> None:
    b = make_batch(5, 9, 3)
    logp = torch.where(b.mask, b.logp, torch.tensor(float("nan")))
    old = torch.where(b.mask, b.old_logp, torch.tensor(-float("inf")))
    adv = torch.where(b.mask, b.advantages[:, None], torch.tensor(float("inf")))
    out, ref, g, g_ref = compiled_and_reference(logp, old, adv, b.mask, dual_clip=3.0)
    assert bool(torch.isfinite(out)) and bool(torch.isfinite(g).all())
    assert_loss_close(out, ref)
    assert bool((g[~b.mask] == 0).all())
    assert_grad_close(g, g_ref)


def test_no_grad_and_retained_graph() -> None:
    b = make_batch(3, 8, 4)
    with torch.no_grad():
        value = fused_token_level_loss(
            b.logp, b.old_logp, b.advantages, b.mask, compiled="aot_eager"
        )
    assert_loss_close(value, reference(b.logp, b.old_logp, b.advantages, b.mask))
    lp = b.logp.clone().requires_grad_(True)
    loss = fused_token_level_loss(lp, b.old_logp, b.advantages, b.mask, compiled="aot_eager")
    loss.backward(retain_graph=True)
    assert lp.grad is not None
    g1 = lp.grad.clone()
    loss.backward()  # second backward recomputes the gradient
    torch.testing.assert_close(lp.grad, 2 * g1)


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
        assert_loss_close(out, ref)
        assert lp_c.grad is not None and lp_r.grad is not None
        assert_grad_close(lp_c.grad, lp_r.grad)


def test_bad_compiled_option() -> None:
    b = make_batch(2, 4, 0)
    with pytest.raises(InputError, match="compiled"):
        token_level_loss(b.logp, b.old_logp, b.advantages, b.mask, compiled="yes")  # type: ignore[call-overload]


def test_kl_and_is_weights_compiled_match_eager() -> None:
    """KL penalty and IS weights are on the compiled path too (one graph)."""
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
    assert_loss_close(out, ref)
    assert lp_c.grad is not None and lp_e.grad is not None
    assert_grad_close(lp_c.grad, lp_e.grad)


def test_recompile_limit_falls_back_to_eager_with_a_warning() -> None:
    torch._dynamo.reset()
    b = make_batch(3, 8, 1)
    with torch._dynamo.config.patch(recompile_limit=1):
        _recompile_twice(b)
    torch._dynamo.reset()


def _recompile_twice(b: Any) -> None:
    for mode in ("token_mean", "seq_mean_token_mean"):  # a second graph: over the limit
        lp_c = b.logp.clone().requires_grad_(True)
        lp_r = b.logp.clone().requires_grad_(True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fused_token_level_loss(
                lp_c, b.old_logp, b.advantages, b.mask, mode=mode, compiled="aot_eager"
            )
        fell_back = any("ran eagerly" in str(w.message) for w in caught)
        assert fell_back == (mode == "seq_mean_token_mean")
        ref = reference(lp_r, b.old_logp, b.advantages, b.mask, mode=mode)
        out.backward()
        ref.backward()
        assert_loss_close(out, ref)
        assert lp_c.grad is not None and lp_r.grad is not None
        assert_grad_close(lp_c.grad, lp_r.grad)


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
    assert_loss_close(out, ref)
    assert lp_c.grad is not None and lp_r.grad is not None
    assert_grad_close(lp_c.grad, lp_r.grad)


def test_import_leaves_dynamo_unloaded() -> None:
    """``import dapo_ops`` stays cheap: torch._dynamo (~1 s) only loads for compiled=True."""
    code = "import sys, dapo_ops; sys.exit(int('torch._dynamo' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
