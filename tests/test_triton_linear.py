"""backend="triton": the Triton kernels of the linear loss and the fused log-probs.

Run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set per test, so
no other module sees it); skipped when triton is not installed. Small shapes that are not
multiples of the interpreter's tiles (16 tokens x 32 vocabulary x 16 hidden): vocab 13
(less than one tile) and 45 (two, ragged), 24 and 36 tokens, hidden dim 5 and 16.
Float64 results against the naive path within ``testing.F64_RTOL`` (the kernels run in
float64 too); float32 and bfloat16 within the derived bounds of
``tests/test_linear_loss.py``. The same cases run on a GPU in ``tests/test_cuda.py``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from _bounds import assert_within, fused_reference, unit_roundoff
from _launches import record_launches
from _strategies import projection_leaves
from test_linear_loss import (
    CASES,
    assert_f64,
    assert_micro_batches_add_up,
    assert_within_float32_bounds,
    case_inputs,
    grads,
    linear,
    naive_loss,
    problem,
)

import dapo_ops as d
from dapo_ops import testing
from dapo_ops.logprobs import _triton_linear as triton_linear
from dapo_ops.logprobs._triton_linear import INTERPRET_BLOCKS
from dapo_ops.objectives import OBJECTIVES

# slow: Triton's interpreter (README's fast subset, -m "not slow and not distributed", leaves it out)
pytestmark = [pytest.mark.slow, pytest.mark.triton]

pytest.importorskip("triton")
F64 = torch.float64
TRITON = {"backend": "triton"}


@pytest.fixture(autouse=True)
def _interpreted(triton_interpreter: None) -> None:
    """Every test here under Triton's interpreter (tests/conftest.py)."""


def without_chunks(opts: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in opts.items() if k != "chunk_size"} | TRITON


@pytest.mark.parametrize(("objective", "opts"), CASES)
def test_float64_equals_naive(objective: d.Objective, opts: dict[str, Any]) -> None:
    """The linear loss's float64 cases (bias, temperature, KL, IS weights, entropy bonus,
    sequence objectives) on the kernels: loss and the three gradients."""
    p, opts = case_inputs(opts)
    got = grads(linear(objective, p, without_chunks(opts)), p)
    assert_f64(got, grads(naive_loss(objective, p, opts), p), "triton vs naive")


@pytest.mark.parametrize("i", range(len(OBJECTIVES)), ids=[c.__name__ for c in OBJECTIVES])
def test_every_objective_and_mode(i: int) -> None:
    """Every objective, each with one aggregation mode (all modes across them), entropy
    bonus and temperature, vocab 45 (two tiles) and no bias on odd ones."""
    objective, mode = OBJECTIVES[i](), testing.MODES[i % len(testing.MODES)]
    p = problem(4, 6, 5, 45, seed=10 + i)
    opts: dict[str, Any] = {"mode": mode, "temperature": 0.8, "entropy_coef": 0.03}
    bias = i % 2 == 0
    got = grads(linear(objective, p, opts | TRITON), p, bias=bias)
    assert_f64(got, grads(naive_loss(objective, p, opts), p, bias=bias), f"{objective!r} {mode}")


@pytest.mark.parametrize("objective", [d.ClipHigher(), d.GSPO()])
def test_micro_batches_add_up(objective: d.Objective) -> None:
    """Micro-batches normalised by the step's global count add up to the whole batch."""
    opts: dict[str, Any] = {"mode": "seq_mean_token_mean", "entropy_coef": 0.02} | TRITON
    assert_micro_batches_add_up(
        objective, problem(), opts, [slice(0, 1), slice(1, 4)], repr(objective)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_within_derived_bounds(dtype: torch.dtype) -> None:
    """float32 / bfloat16 inputs (tiles accumulated in float32, ``G`` rounded to the input
    dtype before its matmuls): within the bounds of the exact values."""
    p = problem(4, 9, 16, 100, seed=3, dtype=dtype)
    assert_within_float32_bounds(d.ClipHigher(), p, 0.05, dtype, TRITON)


def test_masked_positions_change_nothing() -> None:
    """NaN / inf hidden rows and per-token inputs at masked positions, -100 ids there: the
    same loss and gradients, bit for bit."""
    p = problem(dtype=torch.float32)
    mask = p["mask"]
    dirty = dict(p)
    dirty["hidden"] = torch.where(mask[..., None], p["hidden"], math.nan)
    for k in ("old", "ref", "rho"):
        dirty[k] = torch.where(mask, p[k], math.inf)
    dirty["tokens"] = torch.where(mask, p["tokens"], -100)
    results = []
    for q in (p, dirty):
        opts = {"kl": d.KLPenalty(), "ref_logp": q["ref"], "is_weights": q["rho"]}
        results.append(grads(linear(d.ClipHigher(), q, opts | {"entropy_coef": 0.05} | TRITON), q))
    (l0, g0), (l1, g1) = results
    assert torch.equal(l0, l1)
    for x, y in zip(g0, g1, strict=True):
        assert torch.equal(x, y)


def test_diagnostics_and_no_grad() -> None:
    """The diagnostics' log-probs and entropies equal the chunked path's (float64, within
    F64_RTOL); under no_grad the same loss as with autograd."""
    p = problem()
    args = (p["hidden"], p["weight"], p["tokens"], p["old"], p["adv"], p["mask"])
    kw: dict[str, Any] = {"bias": p["bias"], "temperature": 0.9}
    loss, diag = d.linear_policy_loss_with_diagnostics(*args, **kw, backend="triton")
    ref_loss, ref = d.linear_policy_loss_with_diagnostics(*args, **kw, backend="chunked")
    mask = p["mask"]
    for got, want in ((diag.logp, ref.logp), (diag.entropy, ref.entropy), (loss, ref_loss)):
        assert_within(got[mask] if got.ndim else got, want[mask] if want.ndim else want,
                      testing.F64_RTOL * (want.abs().max() + 1), "diagnostics")  # fmt: skip
    h = p["hidden"].clone().requires_grad_(True)
    with_grad = d.linear_policy_loss(h, *args[1:], **kw, backend="triton")
    assert torch.equal(with_grad.detach(), loss)


def test_fused_logprobs_entropy() -> None:
    """Log-probs and entropies with gradients from both outputs (float64 gradcheck), and
    one output's gradient alone."""
    g = torch.Generator().manual_seed(4)
    h, w, b, tokens = projection_leaves(g, (2, 5), 5, 20)

    def fn(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(d.fused_logprobs_entropy(h, w, tokens, bias=b, temperature=0.7, **TRITON))

    assert torch.autograd.gradcheck(fn, (h, w, b), fast_mode=True)
    logp, ent = fn(h, w, b)
    want = d.fused_logprobs_entropy(h, w, tokens, bias=b, temperature=0.7)
    for x, y in ((logp, want.logp), (ent, want.entropy)):
        assert_within(x.detach(), y.detach(), testing.F64_RTOL * (y.abs() + 1), "fused")
    (gw,) = torch.autograd.grad(ent.sum(), [w])
    (gw_want,) = torch.autograd.grad(want.entropy.sum(), [w])
    assert_within(gw, gw_want, testing.F64_RTOL * (gw_want.abs() + gw_want.abs().max()), "dW")


def test_softcap() -> None:
    """The final-logit cap in the kernels (``tanh`` from ``exp``, its derivative in the
    gradient tiles): float64 loss and gradients against the naive path with the cap (a
    cap of 2: logits of a few units), and the fused log-probs' gradcheck with it."""
    from test_softcap import naive_policy

    p = problem(4, 6, 5, 45, seed=1)
    p["hidden"] = p["hidden"] * 3
    opts: dict[str, Any] = {"softcap": 2.0, "temperature": 0.8, "entropy_coef": 0.03}
    got = grads(linear(d.ClipHigher(), p, opts | TRITON), p)
    assert_f64(got, grads(naive_policy(d.ClipHigher(), p, opts), p), "triton softcap")
    h, w, b, tokens = projection_leaves(torch.Generator().manual_seed(5), (2, 5), 5, 20)

    def fn(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = d.fused_logprobs_entropy(h, w, tokens, bias=b, softcap=1.5, **TRITON)
        return tuple(out)

    assert torch.autograd.gradcheck(fn, ((3 * h.detach()).requires_grad_(), w, b), fast_mode=True)


def test_launches_state_warps_and_fp_fusion(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fwd+bwd of the linear loss with bias launches pass 1 (split over the vocabulary:
    two blocks of 32 here, and the splits' merge) and both pass-2 kernels, once each, with
    the warps and FP fusion stated (``launch_options``: Triton 3.9 warns when fusion is
    left to its default, which Triton 3.10 turns off)."""
    kernels = ("fwd", "fwd_combine", "bwd_hidden", "bwd_weight")
    launches = record_launches(monkeypatch, "dapo_ops.logprobs._triton_kernels", kernels)
    p = problem(vocab=45, dtype=torch.float32)
    grads(linear(d.ClipHigher(), p, TRITON), p)  # bias included
    assert sorted(launches.names) == sorted(kernels)
    assert all(kw["enable_fp_fusion"] is True and kw["num_warps"] for _, kw in launches.calls)


@pytest.mark.parametrize("sms", [1, 4, 6, 8, 64])
def test_vocabulary_splits(monkeypatch: pytest.MonkeyPatch, sms: int) -> None:
    """Pass 1 and the hidden gradient split over the vocabulary (about one program per
    multiprocessor: here 20 tokens, 2 token blocks, vocab 100 in 4 blocks, so 1, 2, 3, 4
    and, capped by the blocks, 4 splits): log-probs, entropies and all three gradients
    equal the float64 reference whatever the split."""
    monkeypatch.setattr(triton_linear, "INTERPRET_SMS", sms)
    b = INTERPRET_BLOCKS
    want = {1: 1, 4: 2, 6: 3, 8: 4, 64: 4}[sms]
    assert triton_linear._splits(torch.device("cpu"), 20, 100, b, None) == want
    h, w, bias, tok = projection_leaves(torch.Generator().manual_seed(sms), (20,), 16, 100)
    with torch.no_grad():
        z = torch.log_softmax(h @ w.T + bias, -1)
    a = torch.linspace(-1, 1, 20, dtype=F64)
    got = d.fused_logprobs_entropy(h, w, tok, bias=bias, **TRITON)
    loss = (a * got.logp).sum() + got.entropy.sum()
    want_loss = (a * z.gather(1, tok[:, None])[:, 0]).sum() - (z.exp() * z).sum()
    assert torch.allclose(loss, want_loss, rtol=1e-12)
    gs = torch.autograd.grad(loss, (h, w, bias))
    h2, w2, b2 = (x.detach().requires_grad_(True) for x in (h, w, bias))
    z2 = torch.log_softmax(h2 @ w2.T + b2, -1)
    ref = (a * z2.gather(1, tok[:, None])[:, 0]).sum() - (z2.exp() * z2).sum()
    for x, y in zip(gs, torch.autograd.grad(ref, (h2, w2, b2)), strict=True):
        assert torch.allclose(x, y, rtol=1e-10, atol=1e-12)


def assert_bfloat16_tiles_round_to_nearest_even(device: str) -> None:
    """The case of :func:`test_bfloat16_gradient_tiles_round_to_nearest_even` on
    ``device`` (tests/test_cuda.py runs it compiled on a GPU)."""
    n = 16
    bits = [0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x3F7FFFFF, 0x3F7F8000,
            0xBF808000, 0xBF818000, 0xBFFFFFFF, 0x40490FDB, 0xC0490FDB, 0x00C00000,
            0x3EAAAAAB, 0x3F7F7FFF, 0x477FFF00, 0x80000000]  # fmt: skip
    a = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    h = torch.eye(n, dtype=torch.bfloat16)
    w = torch.zeros(2, n, dtype=torch.bfloat16)
    w[1] = 1.0
    bias = torch.tensor([0.0, -200.0], dtype=torch.bfloat16)
    tok = torch.ones(n, dtype=torch.int64)
    stats = (torch.zeros(n), torch.zeros(n), a, None)  # lse 0 and H 0: p = (1, 0)
    on = [x if x is None else x.to(device) for x in (h, w, bias, tok, *stats)]
    got = triton_linear.backward_grads(
        *on[:4], None, tuple(on[4:]), (1.0, None), (True, True, True)
    )  # type: ignore[arg-type]
    dh, dw, db = (x.cpu() for x in got)  # type: ignore[union-attr]
    want = a.to(torch.bfloat16)
    assert torch.equal(dw[1], want) and torch.equal(dw[0], -want)
    assert torch.equal(dh, want[:, None].expand(n, n))
    total = want.double().sum().to(torch.bfloat16)  # ~65550: any float32 order rounds to it
    assert torch.equal(db, torch.stack([-total, total]))


def test_bfloat16_gradient_tiles_round_to_nearest_even() -> None:
    """``G`` is rounded to bfloat16 before the matmuls, and the weight gradient's float32
    rows when written out, to nearest even, as a GPU's cast rounds (the interpreter's
    own cast truncates: the kernels round the bits first). A case where ``G`` is exactly
    ``+-a``: vocabulary 2, the sampled column's probability 0 in float32 (its bias
    -200), so the other's is 1; ``h`` the identity and ``W`` ones in the sampled row, so
    ``dW`` and ``dh`` are one rounded ``G`` entry each. The values ``a``: ties either
    way (to even), just above and below a tie, a carry into the exponent, negative ones
    and one below the smallest normal bfloat16."""
    assert_bfloat16_tiles_round_to_nearest_even("cpu")


def _filter_case(dtype: torch.dtype) -> tuple[Any, ...]:
    """20 tokens x vocab 100 (2 x 4 interpreter tiles): the vocabulary past 32 is pushed
    down by the bias except column 70 (which alone keeps its tile in the first token
    block), and 3 tokens (in the second token block) are ids past 64, so that some tiles
    of G pass the filter and others do not, none of them near the bound."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(20, 16, generator=g, dtype=F64)
    w = torch.randn(100, 16, generator=g, dtype=F64) * 0.5
    bias = torch.full((100,), -9.0, dtype=F64)
    bias[:32], bias[70] = 0.0, 0.0
    tok = torch.randint(0, 32, (20,), generator=g)
    tok[17:] = torch.tensor([70, 71, 99])
    a, b = torch.randn(20, generator=g, dtype=F64), 0.3 * torch.randn(20, generator=g, dtype=F64)
    return h.to(dtype), w.to(dtype), bias.to(dtype), tok, a, b


@pytest.mark.parametrize("dtype", [F64, torch.bfloat16])
def test_gradient_filter_skips_exactly_the_tiles_below_the_bound(dtype: torch.dtype) -> None:
    """The opt-in filter (``backward_grads(filter_eps=...)``, private until a GPU shows it
    pays): a tile of G is skipped in both pass-2 kernels when every entry is at most
    ``eps (|a_t| + |b_t|) / T``, so dh and dW are the products of G with the skipped
    tiles zeroed (within the derived bounds of those products), and differ from the exact
    ones by at most that bound times the skipped rows of W (of h); the bias gradient sums
    the whole G. bfloat16 weights take the persistent kernel's float32 rows, zeroed again
    between vocabulary blocks. The case is checked to be decided: every tile is kept or
    skipped whatever rounding within G's bound the kernel's G carries."""
    h, w, bias, tok, a, b = _filter_case(dtype)
    temp, eps = 0.7, 1e-3
    compute = F64 if dtype == F64 else torch.float32
    a, b = a.to(compute).double(), b.to(compute).double()  # the values the kernel is given
    full = fused_reference(h, w, tok, bias=bias, temperature=temp, w_logp=a, w_entropy=b)
    big_g, g_err = full.soft.grad, full.soft.grad_err
    bound = eps * (a.abs() + b.abs()) / temp
    u = unit_roundoff(compute)  # the threshold's own rounding in the kernel: 3 operations
    over = (big_g.abs() - g_err > (bound * (1 + 4 * u))[:, None]).double()
    maybe = (big_g.abs() + g_err > (bound * (1 - 4 * u))[:, None]).double()

    def per_tile(x: torch.Tensor) -> torch.Tensor:  # interpreter tiles: 16 tokens x 32 vocab
        return torch.nn.functional.pad(x, (0, 28, 0, 12)).view(2, 16, 4, 32).amax((1, 3))

    tiles = per_tile(over)
    assert torch.equal(tiles, per_tile(maybe)), "a tile lies within rounding of the bound"
    assert 0 < tiles.sum() < tiles.numel(), tiles  # some tiles kept, some skipped
    kept = tiles.repeat_interleave(16, 0)[:20].repeat_interleave(32, 1)[:, :100]
    z = (h.double() @ w.double().T + bias.double()) / temp
    ent = full.soft.entropy
    stats = tuple(x.to(compute) for x in (torch.logsumexp(z, -1), ent, a, b))
    got = triton_linear.backward_grads(
        h, w, bias, tok, None, stats, (temp, None), (True, True, True), filter_eps=eps
    )  # type: ignore[arg-type]
    want = fused_reference(
        h, w, tok, bias=bias, temperature=temp, w_logp=a, w_entropy=b, keep=kept
    )  # fmt: skip
    for x, y, e, name in (
        (got[0], want.grad_hidden, want.grad_hidden_err, "d hidden"),
        (got[1], want.grad_weight, want.grad_weight_err, "d weight"),
        (got[2], full.grad_bias, full.grad_bias_err, "d bias"),
    ):
        assert x is not None and x.dtype == dtype
        assert_within(x, y, e, f"{dtype} {name}")
    # the documented bound on what the filter leaves out (exact values)
    skipped = (1 - kept) * bound[:, None]
    w_abs, h_abs = w.double().abs(), h.double().abs()
    assert ((want.grad_hidden - full.grad_hidden).abs() <= skipped @ w_abs + 1e-15).all()
    assert ((want.grad_weight - full.grad_weight).abs() <= skipped.T @ h_abs + 1e-15).all()


def test_backend_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad backend, chunk_size with the kernels, and CPU tensors without the
    interpreter are refused, naming the argument."""
    p = problem(dtype=torch.float32)
    args = (p["hidden"], p["weight"], p["tokens"], p["old"], p["adv"], p["mask"])
    with pytest.raises(ValueError, match="backend"):  # InputError, or the annotation's
        d.linear_policy_loss(*args, backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(d.InputError, match="chunk_size"):
        d.linear_policy_loss(*args, backend="triton", chunk_size=4)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(d.InputError, match="TRITON_INTERPRET"):
        d.fused_logprobs_entropy(p["hidden"], p["weight"], p["tokens"], backend="triton")
    auto = d.linear_policy_loss(*args)  # "auto": the chunked path on CPU
    assert torch.equal(auto, d.linear_policy_loss(*args, backend="chunked"))


def test_tile_sweep_runs_each_kernel() -> None:
    """benchmarks/tile_sweep.py (a GPU session's tile timing) calls the kernels as they are
    today: its runner of each kernel, at the interpreter's tiles, gives pass 1's log-probs,
    or only ``dh``, or only ``dW``."""
    sweep = pytest.importorskip("benchmarks.tile_sweep", reason="run from the repository root")
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(20, 16, generator=g), torch.randn(45, 16, generator=g)
    tok = torch.randint(0, 45, (20,), generator=g)
    logp, _, _ = sweep._runner(h, w, tok, "fwd", INTERPRET_BLOCKS)()
    want = torch.log_softmax(h @ w.T, dim=-1).gather(1, tok[:, None])[:, 0]
    assert torch.allclose(logp, want, atol=1e-5)
    gh, gw, gb = sweep._runner(h, w, tok, "hidden", INTERPRET_BLOCKS)()
    assert gh.shape == h.shape and gw is None and gb is None
    gh, gw, gb = sweep._runner(h, w, tok, "weight", INTERPRET_BLOCKS)()
    assert gh is None and gw.shape == w.shape and gb is None
    gh, gw, gb = sweep._runner(h, w, tok, "weight", INTERPRET_BLOCKS, sweep.FILTER_EPS)()
    assert gh is None and gw.shape == w.shape and gb is None
    assert set(sweep.CANDIDATES) == {f.name for f in dataclasses.fields(triton_linear.KernelTiles)}
