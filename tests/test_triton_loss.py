"""``CompiledPolicyLoss(backend="triton")``: the loss from log-probs as one Triton kernel
forward and one backward.

Run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, per test), where
a program covers 8 tokens and the final reduction 4 rows, so the shapes here (seq 1 to 19,
up to 7 rows) cross chunk and row-block edges. Float64 against the engine's float64 result
(``testing.F64_RTOL``): every objective with a Triton term, every KL form, and a
hypothesis property over all the options together; float32 with a KL penalty and IS
weights within the bounds of ``dapo_ops.testing.reference_with_bounds``
(``check_compiled_policy_loss``), every objective in two modes. The same checks on a GPU:
tests/test_cuda.py; the kernels compiled for one: tests/test_triton_compile.py.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from _bounds import round_bound
from _launches import record_launches
from hypothesis import given
from hypothesis import strategies as st

import dapo_ops as d
from dapo_ops import InputError, testing
from dapo_ops.engine._triton_loss import OBJECTIVES

pytestmark = [pytest.mark.slow, pytest.mark.triton, pytest.mark.usefixtures("triton_interpreter")]
KERNELS = "dapo_ops.engine._triton_loss_kernels"
pytest.importorskip("triton")

F64 = torch.float64
SUPPORTED = [
    d.ClipHigher(dual_clip=3.0),
    d.PolicyGradient(),
    d.RatioSurrogate(),
    d.CISPO(),
    d.TOPR(neg_coef=0.7),
    d.DRO(beta=0.5),
    d.SAPO(),
    d.DPPO(),
    d.DPPO(divergence="kl"),
]


def _batch(b: int = 5, s: int = 19, dtype: torch.dtype = F64, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, s, generator=g, dtype=F64) * 3
    logp = -(old + 0.3 * torch.randn(b, s, generator=g, dtype=F64)).abs()
    mask = torch.rand(b, s, generator=g) > 0.3
    mask[-1] = False  # an empty row
    return {
        "logp": logp.to(dtype),
        "old_logp": old.to(dtype),
        "advantages": torch.randn(b, generator=g, dtype=F64).to(dtype),
        "mask": mask,
        "ref_logp": -(logp + 0.2 * torch.randn(b, s, generator=g, dtype=F64)).abs().to(dtype),
        "is_weights": (torch.rand(b, s, generator=g, dtype=F64) + 0.5).to(dtype),
        "kl_weights": torch.rand(b, s, generator=g, dtype=F64).to(dtype),
    }


def _run(
    fn: Any, x: dict[str, Any], grad_out: float = 1.0, **kw: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    lp = x["logp"].detach().clone().requires_grad_(True)
    loss = fn(lp, x["old_logp"], x["advantages"], x["mask"], **kw)
    (loss * grad_out).backward()
    assert lp.grad is not None
    return loss.detach(), lp.grad


def _engine(
    objective: d.Objective, x: dict[str, Any], grad_out: float = 1.0, **options: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    call = {k: v for k, v in options.items() if k not in ("kl",)}

    def fn(lp: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        return d.policy_loss(objective, lp, *args, kl=options.get("kl"), **kw)

    return _run(fn, x, grad_out, **call)


def _close64(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], what: str) -> None:
    for a, b, name in zip(got, want, ("loss", "gradient"), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, name, a.dtype, b.dtype)
        tol = testing.F64_RTOL * (b.abs() + (b.abs().max() if b.numel() else 0.0))
        assert bool(((a - b).abs() <= tol).all()), f"{what}: {name} {a} vs {b}"


def _split(x: dict[str, Any], keys: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    return {k: x[k] for k in ("logp", "old_logp", "advantages", "mask")}, {k: x[k] for k in keys}


KL_CASES = [
    d.KLPenalty(beta=0.04, estimator=e, clamp=c, straight_through=through)
    for e in ("k1", "k2", "k3", "abs")
    for c, through in ((None, False), (0.05, False), (None, True))
]


@st.composite
def calls(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Any supported objective, mode, shape (chunk and row-block edges crossed or not),
    advantage layout, KL penalty with or without weights, IS weights and normaliser."""
    b, s, seed = draw(st.integers(1, 7)), draw(st.integers(1, 21)), draw(st.integers(0, 2**16))
    x = _batch(b, s, seed=seed)
    x["mask"][-1] = draw(st.booleans())  # the last row empty, or full
    layout = draw(st.sampled_from(["batch", "batch 1", "batch seq"]))
    if layout != "batch":
        x["advantages"] = x["advantages"][:, None]
    if layout == "batch seq":
        g = torch.Generator().manual_seed(seed)
        x["advantages"] = x["advantages"] * torch.rand(b, s, generator=g, dtype=F64) * 2
    kl = draw(st.sampled_from([None, *KL_CASES]))
    kw: dict[str, Any] = {"normalizer": draw(st.sampled_from([None, 3, 7.25, "tensor"]))}
    if kw["normalizer"] == "tensor":
        kw["normalizer"] = torch.tensor(5.0, dtype=F64)
    if kl is not None:
        kw["ref_logp"] = x["ref_logp"]
        if draw(st.booleans()):
            kw["kl_weights"] = x["kl_weights"]
    if draw(st.booleans()):
        kw["is_weights"] = x["is_weights"]
    mode = draw(st.sampled_from(testing.MODES))
    max_len = draw(st.sampled_from([None, 25]))
    objective = draw(st.sampled_from(SUPPORTED))
    options = {"objective": objective, "mode": mode, "max_len": max_len, "kl": kl}
    return options, x, kw  # the object is made in the test: beartype's checks draw from `random`


@given(calls())
def test_any_call_equals_the_engine_float64(
    call: tuple[dict[str, Any], dict[str, Any], dict[str, Any]],
) -> None:
    """Property: every combination of the options equals ``policy_loss`` to float64
    rounding (loss and gradient)."""
    options, x, kw = call
    fn = d.CompiledPolicyLoss(**options, backend="triton")
    want = _engine(fn.objective, x, mode=fn.mode, max_len=fn.max_len, kl=fn.kl, **kw)
    _close64(_run(fn, x, **kw), want, repr(fn))


@pytest.mark.parametrize("i", range(len(SUPPORTED)), ids=[repr(o) for o in SUPPORTED])
def test_every_objective_and_mode_float64(i: int) -> None:
    """Loss and gradient equal the engine's to float64 rounding; the modes taken in turn
    (every combination: the property above)."""
    objective, mode = SUPPORTED[i], testing.MODES[i % len(testing.MODES)]
    x = _batch(seed=i)
    fn = d.CompiledPolicyLoss(objective, mode=mode, max_len=23, backend="triton")  # type: ignore[arg-type]
    want = _engine(objective, x, mode=mode, max_len=23)
    _close64(_run(fn, x), want, f"{objective!r} {mode}")


@pytest.mark.parametrize("objective", SUPPORTED, ids=repr)
def test_every_objective_float32_within_bounds(objective: d.Objective) -> None:
    """float32 with a KL penalty and IS weights, within the float64 reference's bounds
    (the library's own conformance check, on this backend)."""
    for mode in ("token_mean", "seq_mean_token_mean"):
        testing.check_compiled_policy_loss(objective, mode=mode, backend="triton")  # type: ignore[arg-type]


@pytest.mark.parametrize("kl", KL_CASES, ids=repr)
def test_kl_estimators_weights_and_normalizers(kl: d.KLPenalty) -> None:
    """Every estimator, clamp and straight-through form, with IS and KL weights, per-token
    advantages and the normaliser as an integer, a non-integer float and a 0-dim tensor."""
    i = KL_CASES.index(kl)
    x = _batch(4, 13, seed=i)
    g = torch.Generator().manual_seed(i)
    x["advantages"] = x["advantages"][:, None] * torch.rand(4, 13, generator=g, dtype=F64)
    fn = d.CompiledPolicyLoss(d.ClipHigher(), kl=kl, backend="triton")
    normalizer = (None, 37, 40.5, torch.tensor(29.0, dtype=F64))[i % 4]  # all: the property
    kw = {"ref_logp": x["ref_logp"], "is_weights": x["is_weights"],
          "kl_weights": x["kl_weights"], "normalizer": normalizer}  # fmt: skip
    got = _run(fn, x, **kw)
    _close64(got, _engine(d.ClipHigher(), x, kl=kl, **kw), f"{kl!r} normalizer={normalizer!r}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_inputs(dtype: torch.dtype) -> None:
    """A float32 loss and a gradient in the input dtype: within one rounding of the float32
    engine's on the same rounded values (float32 within its own rounding)."""
    x = _batch(6, 17, dtype=dtype, seed=4)
    kw = {"ref_logp": x["ref_logp"], "is_weights": x["is_weights"]}
    kl = d.KLPenalty()
    fn = d.CompiledPolicyLoss(d.ClipHigher(), mode="seq_mean_token_mean", kl=kl, backend="triton")
    loss, grad = _run(fn, x, **kw)
    up = {k: v.float() if v.is_floating_point() else v for k, v in x.items()}
    want = _engine(d.ClipHigher(), up, kl=kl, mode="seq_mean_token_mean",
                   ref_logp=up["ref_logp"], is_weights=up["is_weights"])  # fmt: skip
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    n = int(x["mask"].sum())
    assert math.isclose(float(loss), float(want[0]), rel_tol=n * 2e-7, abs_tol=1e-7)
    g32 = want[1].double()
    bound = round_bound(g32.abs(), dtype) + 4e-7 * (g32.abs() + g32.abs().max())
    assert bool(((grad.double() - g32).abs() <= bound).all())


def test_masked_positions_change_nothing() -> None:
    """NaN and inf in every per-token input at masked positions (ids of the engine's
    contract): the same loss and gradient, bit for bit, and 0 gradient there."""
    x = _batch(5, 19, seed=7)
    x["advantages"] = x["advantages"][:, None].expand(5, 19).clone()
    kw_names = ("ref_logp", "is_weights", "kl_weights")
    fn = d.CompiledPolicyLoss(d.SAPO(), kl=d.KLPenalty(), backend="triton")
    clean, extra = _split(x, kw_names)
    want = _run(fn, clean, **extra)
    dirty = dict(x)
    for i, k in enumerate(("logp", "old_logp", "advantages", *kw_names)):
        bad = (math.nan, math.inf, -math.inf)[i % 3]
        dirty[k] = torch.where(x["mask"], x[k], bad)
    clean, extra = _split(dirty, kw_names)
    got = _run(fn, clean, **extra)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not bool(got[1][~x["mask"]].any())


@d.checked(False)  # checked mode would refuse the NaN before the kernel sees it
def test_nan_on_a_valid_token_is_reported() -> None:
    """A NaN log-prob on a valid token makes the loss NaN (never silently dropped)."""
    x = _batch(3, 9, seed=8)
    x["mask"][0, 0] = True
    x["logp"][0, 0] = math.nan
    loss = d.CompiledPolicyLoss(d.ClipHigher(), backend="triton")(
        x["logp"], x["old_logp"], x["advantages"], x["mask"]
    )
    assert bool(loss.isnan())


def test_backward_forms() -> None:
    """A scaled incoming gradient, a second backward through a retained graph, the
    no-grad forward and double backward (the definition differentiated): as the engine."""
    x = _batch(4, 11, seed=9)
    fn = d.CompiledPolicyLoss(d.ClipHigher(), mode="seq_mean_token_sum", backend="triton")
    _close64(
        _run(fn, x, grad_out=-2.5),
        _engine(d.ClipHigher(), x, -2.5, mode="seq_mean_token_sum"),
        "scaled",
    )
    lp = x["logp"].clone().requires_grad_(True)
    loss = fn(lp, x["old_logp"], x["advantages"], x["mask"])
    (g1,) = torch.autograd.grad(loss, lp, retain_graph=True)
    (g2,) = torch.autograd.grad(loss, lp)
    assert torch.equal(g1, g2)
    with torch.no_grad():
        assert torch.equal(fn(lp, x["old_logp"], x["advantages"], x["mask"]), loss.detach())
    lp = x["logp"].clone().requires_grad_(True)
    (g,) = torch.autograd.grad(
        fn(lp, x["old_logp"], x["advantages"], x["mask"]), lp, create_graph=True
    )
    (h,) = torch.autograd.grad((g * g).sum(), lp)
    lp2 = x["logp"].clone().requires_grad_(True)
    loss2 = d.policy_loss(
        d.ClipHigher(), lp2, x["old_logp"], x["advantages"], x["mask"], mode="seq_mean_token_sum"
    )
    (g_ref,) = torch.autograd.grad(loss2, lp2, create_graph=True)
    (h_ref,) = torch.autograd.grad((g_ref * g_ref).sum(), lp2)
    _close64((g.detach(), h), (g_ref.detach(), h_ref), "double backward")


def test_gradcheck_float64() -> None:
    x = _batch(3, 10, seed=10)
    fn = d.CompiledPolicyLoss(
        d.SAPO(), mode="seq_mean_token_mean", kl=d.KLPenalty(), backend="triton"
    )
    rest = (x["old_logp"], x["advantages"], x["mask"])
    lp = x["logp"].clone().requires_grad_(True)
    # fast mode: the gradient against finite differences along random directions
    assert torch.autograd.gradcheck(
        lambda t: fn(t, *rest, ref_logp=x["ref_logp"]), (lp,), fast_mode=True
    )


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_micro_batches_add_up(mode: str) -> None:
    """Micro-batches normalised by the step's global count add up to the whole batch."""
    x = _batch(6, 19, seed=11)
    fn = d.CompiledPolicyLoss(d.ClipHigher(), mode=mode, backend="triton")  # type: ignore[arg-type]
    den = d.global_normalizer(x["mask"], mode=mode)  # type: ignore[arg-type]
    whole = _run(fn, x)
    parts = [
        _run(fn, {k: v[sl] for k, v in x.items()}, normalizer=den)
        for sl in (slice(0, 2), slice(2, 6))
    ]
    total = sum(p[0] for p in parts)
    grad = torch.cat([p[1] for p in parts])
    _close64((torch.as_tensor(total), grad), whole, f"micro-batches {mode}")


def test_deterministic_and_counter_reset() -> None:
    """The same bits on every call (the chunk sums are reduced in a fixed order), and the
    ticket counter is back at 0 after each call."""
    x = _batch(7, 19, dtype=torch.float32, seed=12)
    fn = d.CompiledPolicyLoss(d.ClipHigher(), backend="triton")
    first = _run(fn, x)
    for _ in range(2):
        again = _run(fn, x)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    (kernel,) = fn.cache.values()
    assert all(int(c) == 0 for c in kernel.counters.values())


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (2, 1)])
def test_empty_and_degenerate_shapes(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(17)
    x = {"logp": -torch.rand(shape, generator=g, dtype=F64),
         "old_logp": -torch.rand(shape, generator=g, dtype=F64),
         "advantages": torch.randn(shape[0], generator=g, dtype=F64),
         "mask": torch.ones(shape, dtype=torch.bool)}  # fmt: skip
    for mode in testing.MODES:
        fn = d.CompiledPolicyLoss(d.ClipHigher(), mode=mode, backend="triton")  # type: ignore[arg-type]
        _close64(_run(fn, x), _engine(d.ClipHigher(), x, mode=mode), f"{shape} {mode}")


def test_strided_inputs_and_integer_mask() -> None:
    """Views with a row stride other than seq, a transposed (copied) input and an integer
    mask give the contiguous call's result."""
    x = _batch(5, 19, seed=13)
    wide = {k: torch.cat([v, v], dim=-1)[:, :19] if v.ndim == 2 else v for k, v in x.items()}
    wide["old_logp"] = x["old_logp"].T.contiguous().T  # column-major
    wide["mask"] = x["mask"].to(torch.int64)
    fn = d.CompiledPolicyLoss(d.CISPO(), backend="triton")
    got, want = _run(fn, wide), _run(fn, x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bad_options_and_devices() -> None:
    with pytest.raises(InputError, match=r"backend='triton'.*GSPO.*backend='inductor'"):
        d.CompiledPolicyLoss(d.GSPO(), backend="triton")

    @__import__("dataclasses").dataclass(frozen=True)
    class MyClip(d.ClipHigher):
        pass

    with pytest.raises(InputError, match="MyClip has none"):  # a subclass may change term()
        d.CompiledPolicyLoss(MyClip(), backend="triton")
    with pytest.raises(InputError, match=r"CompiledPolicyLoss\.backend"):
        d.CompiledPolicyLoss(d.ClipHigher(), backend="cuda")  # type: ignore[arg-type]
    assert set(OBJECTIVES) == {type(o) for o in SUPPORTED}


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _batch(2, 3, seed=14)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    fn = d.CompiledPolicyLoss(d.ClipHigher(), backend="triton")
    with pytest.raises(InputError, match="needs CUDA tensors"):
        fn(x["logp"], x["old_logp"], x["advantages"], x["mask"])


def test_inputs_changed_in_place_are_refused() -> None:
    """The inputs are saved for backward: an in-place change before it is refused (and a
    tensor normaliser reaches double backward)."""
    x = _batch(3, 9, seed=15)
    fn = d.CompiledPolicyLoss(d.ClipHigher(), backend="triton")
    lp, old = x["logp"].clone().requires_grad_(True), x["old_logp"].clone()
    loss = fn(lp, old, x["advantages"], x["mask"])
    old.add_(0.1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    den = torch.tensor(6.0, dtype=F64)
    lp = x["logp"].clone().requires_grad_(True)
    (g,) = torch.autograd.grad(
        fn(lp, x["old_logp"], x["advantages"], x["mask"], normalizer=den), lp, create_graph=True
    )
    want = _engine(d.ClipHigher(), x, normalizer=den)[1]
    _close64(
        (g.detach().sum(), g.detach()), (want.sum(), want), "double backward, tensor normaliser"
    )


#: ATen ops that allocate or re-describe memory without launching a kernel on a GPU.
NO_KERNEL = {"aten.empty.memory_format", "aten.view.default", "aten.view.dtype",
             "aten.detach.default", "aten.alias.default", "aten.unsqueeze.default",
             "aten.expand.default", "aten._unsafe_view.default", "aten.as_strided.default"}  # fmt: skip


def test_a_step_is_three_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``loss.backward()`` step launches the forward kernel, autograd's seed of the
    incoming gradient (``ones_like``) and the backward kernel, and no other operation that
    runs a kernel: every ATen op of the step, recorded outside the two Triton launches, is
    an allocation or a view. (Issue 30's target on a GPU: at most 3 launches.) Each
    launch states its warps and FP fusion."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: list[str] = []
    launches = record_launches(monkeypatch, KERNELS, ("loss_forward", "loss_backward"))

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if not launches.busy:  # the interpreter's own tensor work is the kernel's
                ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x = _batch(4, 19, dtype=torch.float32, seed=16)
    fn = d.CompiledPolicyLoss(d.ClipHigher(dual_clip=3.0), backend="triton")
    lp = x["logp"].clone().requires_grad_(True)
    with d.checked(False):  # as users run it: checked mode reads values on the host
        fn(lp, x["old_logp"], x["advantages"], x["mask"]).backward()  # builds the kernel
        lp.grad, launches.calls[:] = None, []
        with Record():
            fn(lp, x["old_logp"], x["advantages"], x["mask"]).backward()
    assert launches.names == ["loss_forward", "loss_backward"]
    assert [op for op in ops if op not in NO_KERNEL] == ["aten.ones_like.default"], ops
    # warps and FP fusion stated at each launch (dapo_ops._core._triton.launch_options)
    assert all(kw["enable_fp_fusion"] is True and kw["num_warps"] for _, kw in launches.calls)
