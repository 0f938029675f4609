"""The loss paths on every device present: the float64 references and derived bounds of
the rest of the suite, the masking promises bit for bit, and the chunked lm-head loss's
memory promise.

Each test runs on ``cpu``, always (so CI runs every test's own data and arithmetic, and a
broken test fails there first), and on ``cuda`` where a device is present (``python -m
pytest -k cuda tests/test_devices.py``, as tools/gpu_session.sh does). On CUDA the engine
runs its generic ``torch.where`` body (the CPU kernels are CPU-only),
``linear_policy_loss`` its out-of-place chunks and ``compiled=True`` inductor's Triton
kernels; on the CPU the CPU kernels and C++ code. The no-host-sync promises are
``tests/test_host_syncs.py``'s.

cuBLAS may reduce float32 products in TF32 and bfloat16 ones in bfloat16, outside the
float32-accumulation model of the bounds: both are switched off here (they are off by
default in PyTorch, except the bfloat16 reduction).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _bounds import assert_within
from _syncs import fake_cuda
from test_linear_loss import (
    CASES,
    assert_f64,
    backward_peak,
    case_inputs,
    float32_bounds,
    grads,
    linear,
    naive_loss,
    problem,
)
from torch import Tensor

import dapo_ops as d
from dapo_ops.objectives import OBJECTIVES
from dapo_ops.testing import Batch, make_batch, reference_with_bounds

#: The devices present: the CPU always, CUDA when there is one.
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
EXTRAS = {"plain": False, "kl-is": True}


def _objective_cases() -> list[Any]:
    """(device, objective class, mode, KL and IS weights or not): the whole grid on CUDA;
    on the CPU each objective with and without the extras, the modes in turn, so every
    objective, mode and extra runs there (22 of the 66 cases: the runtime annotation
    checker makes each case cost 0.2 s on 2 cores)."""
    cases = []
    for device in DEVICES:
        for i, cls in enumerate(OBJECTIVES):
            for j, mode in enumerate(MODES):
                for k, (name, kl_is) in enumerate(EXTRAS.items()):
                    if device == "cuda" or j == (i + k) % len(MODES):
                        ids = f"{device}-{cls.__name__}-{mode}-{name}"
                        cases.append(pytest.param(device, cls, mode, kl_is, id=ids))
    return cases


def _compiled_cases() -> list[Any]:
    """(device, objective class): three objectives on CUDA, Clip-Higher on the CPU
    (inductor compiles one objective's two graphs there in 8 s, 11 s with a cold cache,
    on 2 cores; the CPU's compiled paths are tests/test_compiled.py's)."""
    return [
        pytest.param(device, cls, id=f"{device}-{cls.__name__}")
        for device in DEVICES
        for cls in (d.ClipHigher, d.GSPO, d.SAPO)
        if device == "cuda" or cls is d.ClipHigher
    ]


@pytest.fixture(autouse=True)
def exact_matmuls() -> Iterator[None]:
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_tf32, matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_tf32, matmul.allow_bf16_reduced_precision_reduction = False, False
    try:
        yield
    finally:
        matmul.allow_tf32, matmul.allow_bf16_reduced_precision_reduction = saved


def on(device: str, b: Batch) -> Batch:
    return Batch(*(t.to(device) for t in b))


def to(device: str, options: dict[str, Any]) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in options.items()}


def loss_and_grad(fn: Callable[[Tensor], Tensor], logp: Tensor) -> tuple[Tensor, Tensor]:
    leaf = logp.detach().clone().requires_grad_(True)
    loss = fn(leaf)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad


def extras(b: Batch, kl_is: bool) -> dict[str, Any]:
    """A k3 KL penalty against reference log-probs ``-|logp + N(0, 0.3^2)|`` (reflected at
    0, as ``make_batch`` makes its log-probs: log-probabilities, never > 0) and IS weights
    in [0.5, 1.5), on ``b``'s device and in its dtype."""
    if not kl_is:
        return {}
    g = torch.Generator().manual_seed(2)
    noise = torch.randn(b.logp.shape, generator=g, dtype=torch.float64)
    ref = -(b.logp.cpu().double() + 0.3 * noise).abs()
    rho = torch.rand(b.logp.shape, generator=g) + 0.5
    return {
        "kl": d.KLPenalty(beta=0.1),
        "ref_logp": ref.to(b.logp),
        "is_weights": rho.to(b.logp),
    }


# --------------------------------------------------------------------------- objectives


@pytest.mark.parametrize(("device", "cls", "mode", "kl_is"), _objective_cases())
def test_every_objective_within_the_float64_bounds(
    device: str, cls: type, mode: str, kl_is: bool
) -> None:
    """float32: loss and gradient within the bounds any float32 evaluation of the same
    call meets (CUDA's expf/logf are within the 20 ulps the bounds allow)."""
    objective = cls()
    b = make_batch(objective, 6, 33, seed=5, dtype=torch.float32, per_token_advantages=True)
    opts = {"mode": mode, **extras(b, kl_is)}
    ref = reference_with_bounds(objective, b, **opts)
    g = on(device, b)
    loss, grad = loss_and_grad(
        lambda lp: d.policy_loss(objective, lp, *g[1:], **to(device, opts)), g.logp
    )
    assert loss.device.type == device and grad.dtype == torch.float32
    assert_within(loss.cpu(), ref.loss, ref.loss_err, f"{objective!r} {mode} loss")
    assert_within(grad.cpu(), ref.grad, ref.grad_err, f"{objective!r} {mode} gradient")


@pytest.mark.usefixtures("no_runtime_typecheck")  # dynamo cannot trace beartype's checks
@pytest.mark.parametrize(("device", "cls"), _compiled_cases())
def test_compiled_within_the_float64_bounds(device: str, cls: type) -> None:
    """``compiled=True`` (inductor's kernels: Triton on CUDA, C++ on the CPU) and
    ``CompiledPolicyLoss`` (ahead of time), with KL and IS weights, within the same
    bounds."""
    objective = cls()
    b = make_batch(objective, 6, 33, seed=6, dtype=torch.float32)
    opts = extras(b, True)
    ref = reference_with_bounds(objective, b, **opts)
    g, dev_opts = on(device, b), to(device, opts)
    aot = d.CompiledPolicyLoss(objective, kl=opts["kl"])
    runs = {
        "compiled=True": lambda lp: d.policy_loss(objective, lp, *g[1:], compiled=True, **dev_opts),
        "CompiledPolicyLoss": lambda lp: aot(
            lp, *g[1:], ref_logp=dev_opts["ref_logp"], is_weights=dev_opts["is_weights"]
        ),
    }
    for what, fn in runs.items():
        loss, grad = loss_and_grad(fn, g.logp)
        assert_within(loss.cpu(), ref.loss, ref.loss_err, f"{objective!r} {what} loss")
        assert_within(grad.cpu(), ref.grad, ref.grad_err, f"{objective!r} {what} gradient")


@pytest.mark.parametrize("cls", OBJECTIVES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("device", DEVICES)
def test_masked_garbage_changes_no_bit(device: str, cls: type) -> None:
    """NaN / inf at masked positions of every per-token input (and the empty row's
    advantage): the same loss and gradient bits, the sign of zeros included."""
    objective = cls()
    b = on(device, make_batch(objective, 6, 33, seed=7, dtype=torch.float32))
    opts = to(device, extras(b, True))
    clean = loss_and_grad(lambda lp: d.policy_loss(objective, lp, *b[1:], **opts), b.logp)
    m = b.mask
    dirty = {k: torch.where(m, v, math.nan) for k, v in opts.items() if isinstance(v, Tensor)}
    adv = torch.where(m.any(-1), b.advantages, -math.inf)
    lp = torch.where(m, b.logp, math.inf)
    old = torch.where(m, b.old_logp, math.nan)
    got = loss_and_grad(lambda x: d.policy_loss(objective, x, old, adv, m, **{**opts, **dirty}), lp)
    for x, y, what in zip(got, clean, ("loss", "gradient"), strict=True):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32)), f"{objective!r} {what}"


# --------------------------------------------------------------------------- linear loss


@pytest.mark.parametrize(("objective", "opts"), CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_linear_float64_equals_the_naive_path(
    device: str, objective: d.Objective, opts: dict[str, Any]
) -> None:
    """float64 on the device (the default backend) against the naive path on the CPU
    (autograd), 1e-10 relative."""
    p, opts = case_inputs(opts)
    want = grads(naive_loss(objective, p, opts), p)
    gp = {k: v.to(device) for k, v in p.items()}
    got_loss, got_grads = grads(linear(objective, gp, to(device, opts)), gp)
    assert_f64((got_loss.cpu(), [g.cpu() for g in got_grads]), want, f"{objective!r} {device}")


def _low_precision_cases() -> list[Any]:
    """(device, dtype, chunk): the four on CUDA; on the CPU each dtype once, the chunk
    settings in turn (the CPU's four are tests/test_linear_loss.py's, 1 s each)."""
    return [
        pytest.param(device, dtype, chunk, id=f"{device}-{str(dtype)[6:]}-chunk{chunk}")
        for device in DEVICES
        for i, dtype in enumerate((torch.float32, torch.bfloat16))
        for j, chunk in enumerate((None, 5))
        if device == "cuda" or i != j
    ]


@pytest.mark.parametrize(("device", "dtype", "chunk"), _low_precision_cases())
def test_linear_low_precision_within_derived_bounds(
    device: str, dtype: torch.dtype, chunk: int | None
) -> None:
    """float32 / bfloat16 hidden states and weights: loss and gradients within the bounds
    of ``tests/test_linear_loss.py`` (derived for any float32 accumulation)."""
    objective, coef = d.ClipHigher(), 0.05
    p = problem(4, 9, 16, 301, seed=3, dtype=dtype)
    gp = {k: v.to(device) for k, v in p.items()}
    loss, got = grads(linear(objective, gp, {"entropy_coef": coef, "chunk_size": chunk}), gp)
    assert all(x.dtype == dtype for x in got)
    want_loss, loss_err, want, errs = float32_bounds(objective, p, coef, dtype)
    assert_within(loss.cpu(), want_loss, loss_err, "loss")
    for name, x, y, e in zip(("hidden", "weight", "bias"), got, want, errs, strict=True):
        assert_within(x.cpu(), y, e, f"{dtype} d {name}")


def _extra_peak(device: str, rows: int, n: int, dim: int, vocab: int, **opts: Any) -> int:
    """Extra peak bytes (inputs excluded) of one float32 fwd+bwd of ``linear_policy_loss``
    over ``n`` tokens in ``rows`` rows: CUDA's ``max_memory_allocated``; on the CPU the
    allocator's peak as the profiler records it (``backward_peak`` of
    ``tests/test_linear_loss.py``), under the CUDA twin of ``tests/_syncs.py``, so the
    call takes the branches it takes on a GPU (out-of-place chunks)."""
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(rows, n // rows, dim, device=device, generator=gen)
    w = torch.randn(vocab, dim, device=device, generator=gen) * dim**-0.5
    h.requires_grad_(True)
    w.requires_grad_(True)
    tokens = torch.randint(0, vocab, (rows, n // rows), device=device, generator=gen)
    old = -torch.rand(rows, n // rows, device=device, generator=gen) * 10
    adv, mask = torch.randn(rows, device=device, generator=gen), tokens % 10 != 0

    def step() -> None:
        torch.autograd.backward(d.linear_policy_loss(h, w, tokens, old, adv, mask, **opts))

    if device == "cpu":
        with fake_cuda():
            return backward_peak(step)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


#: ``(tokens, d, vocab, chunk)`` and the scratch per device. CUDA: float32 logits of
#: 500 MiB, 8 MiB of scratch for the libraries' workspaces (passed on an H100,
#: 2026-11-28). CPU: 31 MiB of logits, chunks of 4 MiB, no scratch (measured 10.1 MiB
#: against a budget of 11.0 MiB; the whole logits would be 31 MiB).
MEMORY = {"cpu": ((1024, 64, 8000, 128), 0), "cuda": ((4096, 256, 32000, 1024), 8 * 2**20)}


@pytest.mark.parametrize("device", DEVICES)
def test_linear_extra_memory_is_the_gradients_plus_one_chunk(device: str) -> None:
    """Extra peak of one fwd+bwd (inputs excluded) with ``chunk_size`` rows per chunk: the
    weight and hidden gradients, one chunk's float32 logits and their gradient, the
    scratch of :data:`MEMORY`, and 10 % for the allocator's rounding and the small
    per-token tensors; less than the whole logits."""
    (n, dim, vocab, chunk), scratch = MEMORY[device]
    extra = _extra_peak(device, 4, n, dim, vocab, chunk_size=chunk)
    budget = 1.1 * ((vocab + n) * dim * 4 + 2 * chunk * vocab * 4 + scratch)
    assert extra <= budget, f"extra peak {extra / 2**20:.1f} MiB > {budget / 2**20:.1f} MiB"
    assert extra < n * vocab * 4, "as much as the whole logits: not chunked"
