"""The loss paths on a CUDA device: the same float64 references and derived bounds as the
CPU suite, the masking promises bit for bit, and no host sync where the docs promise none.

On CUDA the engine runs its generic ``torch.where`` body (the CPU kernels are CPU-only),
``linear_policy_loss`` its out-of-place chunks (2^27 logits elements by default), and
``compiled=True`` inductor's Triton kernels: none of that runs in CI, which has no GPU.
Skipped without a CUDA device; on one: ``python -m pytest tests/test_cuda.py``.
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
from test_bad_inputs import REGISTRY, Fresh, build, call, outputs
from test_linear_loss import (
    CASES,
    assert_f64,
    case_inputs,
    float32_bounds,
    grads,
    linear,
    naive_loss,
    problem,
)
from torch import Tensor

import dapo_ops as d
from dapo_ops.engine._triton_loss import OBJECTIVES as TRITON_OBJECTIVES
from dapo_ops.objectives import OBJECTIVES
from dapo_ops.testing import Batch, make_batch, reference_with_bounds

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = "cuda"
MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


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


def loss_and_grad(fn: Callable[[Tensor], Tensor], logp: Tensor) -> tuple[Tensor, Tensor]:
    leaf = logp.detach().clone().requires_grad_(True)
    loss = fn(leaf)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad


def extras(b: Batch, kl_is: bool) -> dict[str, Any]:
    """A k3 KL penalty and IS weights in [0.5, 1.5), on ``b``'s device."""
    if not kl_is:
        return {}
    g = torch.Generator().manual_seed(2)
    noise = torch.randn(b.logp.shape, generator=g, dtype=torch.float64)
    ref = (b.logp.cpu().double() + 0.3 * noise).to(b.logp.dtype)
    rho = (torch.rand(b.logp.shape, generator=g) + 0.5).to(b.logp.dtype)
    return {"kl": d.KLPenalty(beta=0.1), "ref_logp": ref, "is_weights": rho}


def to(device: str, options: dict[str, Any]) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in options.items()}


# --------------------------------------------------------------------------- objectives


@CUDA
@pytest.mark.parametrize("kl_is", [False, True], ids=["plain", "kl-is"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cls", OBJECTIVES, ids=lambda c: c.__name__)
def test_every_objective_within_the_float64_bounds(cls: type, mode: str, kl_is: bool) -> None:
    """float32 on the GPU: loss and gradient within the bounds any float32 evaluation of the
    same call meets (CUDA's expf/logf are within the 20 ulps the bounds allow)."""
    objective = cls()
    b = make_batch(objective, 6, 33, seed=5, dtype=torch.float32, per_token_advantages=True)
    opts = {"mode": mode, **extras(b, kl_is)}
    ref = reference_with_bounds(objective, b, **opts)
    g = on(DEV, b)
    loss, grad = loss_and_grad(
        lambda lp: d.policy_loss(objective, lp, *g[1:], **to(DEV, opts)), g.logp
    )
    assert loss.device.type == DEV and grad.dtype == torch.float32
    assert_within(loss.cpu(), ref.loss, ref.loss_err, f"{objective!r} {mode} loss")
    assert_within(grad.cpu(), ref.grad, ref.grad_err, f"{objective!r} {mode} gradient")


@CUDA
@pytest.mark.usefixtures("no_runtime_typecheck")  # dynamo cannot trace beartype's checks
@pytest.mark.parametrize("cls", [d.ClipHigher, d.GSPO, d.SAPO], ids=lambda c: c.__name__)
def test_compiled_within_the_float64_bounds(cls: type) -> None:
    """``compiled=True`` (inductor's Triton kernels) and ``CompiledPolicyLoss`` (ahead of
    time) on the GPU, with KL and IS weights, within the same bounds."""
    objective = cls()
    b = make_batch(objective, 6, 33, seed=6, dtype=torch.float32)
    opts = extras(b, True)
    ref = reference_with_bounds(objective, b, **opts)
    g, dev_opts = on(DEV, b), to(DEV, opts)
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


@CUDA
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cls", list(TRITON_OBJECTIVES), ids=lambda c: c.__name__)
def test_triton_loss_within_the_float64_bounds(cls: type, mode: str) -> None:
    """``CompiledPolicyLoss(backend="triton")`` (one kernel forward, one backward) with KL
    and IS weights, float32 on the GPU: within the float64 reference's bounds; bfloat16
    inputs: a float32 loss and a bfloat16 gradient; the same bits on a second call and
    the ticket counter back at 0."""
    objective = cls()
    b = make_batch(objective, 7, 4133, seed=9, dtype=torch.float32)  # 5 chunks, ragged
    opts = extras(b, True)
    ref = reference_with_bounds(objective, b, mode=mode, **opts)
    g, dev_opts = on(DEV, b), to(DEV, opts)
    run = d.CompiledPolicyLoss(objective, mode=mode, kl=opts["kl"], backend="triton")  # type: ignore[arg-type]
    tensors = {k: dev_opts[k] for k in ("ref_logp", "is_weights")}
    loss, grad = loss_and_grad(lambda lp: run(lp, *g[1:], **tensors), g.logp)
    assert_within(loss.cpu(), ref.loss, ref.loss_err, f"{objective!r} {mode} triton loss")
    assert_within(grad.cpu(), ref.grad, ref.grad_err, f"{objective!r} {mode} triton gradient")
    again = loss_and_grad(lambda lp: run(lp, *g[1:], **tensors), g.logp)
    assert torch.equal(again[0], loss) and torch.equal(again[1], grad)
    (kernel,) = run.cache.values()
    assert all(int(c) == 0 for c in kernel.counters.values())
    low = {k: v.bfloat16() for k, v in tensors.items()}
    loss16, grad16 = loss_and_grad(
        lambda lp: run(lp, g.old_logp.bfloat16(), g.advantages, g.mask, **low), g.logp.bfloat16()
    )
    assert loss16.dtype == torch.float32 and grad16.dtype == torch.bfloat16
    up = {k: v.float() for k, v in low.items()}
    want = loss_and_grad(
        lambda lp: run(lp, g.old_logp.bfloat16().float(), g.advantages, g.mask, **up),
        g.logp.bfloat16().float(),
    )
    assert torch.allclose(loss16, want[0], rtol=1e-5, atol=1e-7)
    assert torch.allclose(grad16.float(), want[1], rtol=2**-8, atol=1e-12)


@CUDA
@pytest.mark.parametrize("cls", OBJECTIVES, ids=lambda c: c.__name__)
def test_masked_garbage_changes_no_bit(cls: type) -> None:
    """NaN / inf at masked positions of every per-token input (and the empty row's
    advantage): the same loss and gradient bits, the sign of zeros included."""
    objective = cls()
    b = on(DEV, make_batch(objective, 6, 33, seed=7, dtype=torch.float32))
    opts = to(DEV, extras(b, True))
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


@CUDA
@pytest.mark.parametrize(("objective", "opts"), CASES)
def test_linear_float64_equals_the_naive_path(objective: d.Objective, opts: dict[str, Any]) -> None:
    """float64 on the GPU against the naive path on the CPU (autograd), 1e-10 relative."""
    p, opts = case_inputs(opts)
    want = grads(naive_loss(objective, p, opts), p)
    gp = {k: v.to(DEV) for k, v in p.items()}
    got_loss, got_grads = grads(linear(objective, gp, to(DEV, opts)), gp)
    assert_f64((got_loss.cpu(), [g.cpu() for g in got_grads]), want, f"{objective!r} cuda")


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 5])
def test_linear_low_precision_within_derived_bounds(dtype: torch.dtype, chunk: int | None) -> None:
    """float32 / bfloat16 hidden states and weights on the GPU: loss and gradients within
    the bounds of ``tests/test_linear_loss.py`` (derived for any float32 accumulation)."""
    objective, coef = d.ClipHigher(), 0.05
    p = problem(4, 9, 16, 301, seed=3, dtype=dtype)
    gp = {k: v.to(DEV) for k, v in p.items()}
    loss, got = grads(linear(objective, gp, {"entropy_coef": coef, "chunk_size": chunk}), gp)
    assert all(x.dtype == dtype for x in got)
    want_loss, loss_err, want, errs = float32_bounds(objective, p, coef, dtype)
    assert_within(loss.cpu(), want_loss, loss_err, "loss")
    for name, x, y, e in zip(("hidden", "weight", "bias"), got, want, errs, strict=True):
        assert_within(x.cpu(), y, e, f"{dtype} d {name}")


@CUDA
@pytest.mark.parametrize(("objective", "opts"), CASES)
def test_triton_float64_equals_the_naive_path(objective: d.Objective, opts: dict[str, Any]) -> None:
    """backend='triton' (the kernels of tests/test_triton_linear.py, compiled for the GPU)
    in float64 against the naive path on the CPU, 1e-10 relative."""
    p, opts = case_inputs(opts)
    want = grads(naive_loss(objective, p, opts), p)
    gp = {k: v.to(DEV) for k, v in p.items()}
    kernel_opts = {k: v for k, v in to(DEV, opts).items() if k != "chunk_size"}
    got_loss, got_grads = grads(linear(objective, gp, kernel_opts | {"backend": "triton"}), gp)
    assert_f64((got_loss.cpu(), [g.cpu() for g in got_grads]), want, f"{objective!r} triton")


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_low_precision_within_derived_bounds(dtype: torch.dtype) -> None:
    """backend='triton' with float32 / bfloat16 inputs on the GPU (float32 tiles with
    input_precision='ieee': no TF32), within the derived bounds."""
    objective, coef = d.ClipHigher(), 0.05
    p = problem(4, 9, 16, 301, seed=3, dtype=dtype)
    gp = {k: v.to(DEV) for k, v in p.items()}
    loss, got = grads(linear(objective, gp, {"entropy_coef": coef, "backend": "triton"}), gp)
    assert all(x.dtype == dtype for x in got)
    want_loss, loss_err, want, errs = float32_bounds(objective, p, coef, dtype)
    assert_within(loss.cpu(), want_loss, loss_err, "loss")
    for name, x, y, e in zip(("hidden", "weight", "bias"), got, want, errs, strict=True):
        assert_within(x.cpu(), y, e, f"{dtype} d {name}")


@CUDA
def test_triton_bf16_roundings_to_nearest_even() -> None:
    """The kernels' float32 -> bfloat16 casts (``G`` before its products, the weight
    gradient's rows) round to nearest even on the GPU, bit for bit as torch does: the
    rounding the interpreter tests emulate (tests/test_triton_linear.py)."""
    from test_triton_linear import assert_bfloat16_tiles_round_to_nearest_even

    assert_bfloat16_tiles_round_to_nearest_even(DEV)


def _extra_peak(rows: int, n: int, dim: int, vocab: int, dtype: torch.dtype, **opts: Any) -> int:
    """Extra peak bytes (``max_memory_allocated``, inputs excluded) of one fwd+bwd of
    ``linear_policy_loss`` over ``n`` tokens in ``rows`` rows."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    h = torch.randn(rows, n // rows, dim, device=DEV, generator=gen).to(dtype)
    w = (torch.randn(vocab, dim, device=DEV, generator=gen) * dim**-0.5).to(dtype)
    h.requires_grad_(True)
    w.requires_grad_(True)
    tokens = torch.randint(0, vocab, (rows, n // rows), device=DEV, generator=gen)
    old = -torch.rand(rows, n // rows, device=DEV, generator=gen) * 10
    adv, mask = torch.randn(rows, device=DEV, generator=gen), tokens % 10 != 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    d.linear_policy_loss(h, w, tokens, old, adv, mask, **opts).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@CUDA
def test_triton_bf16_weight_gradient_needs_no_float32_copy() -> None:
    """backend='triton' with bfloat16 weights, vocab 151936 x d 896 (a float32 weight
    gradient would be 519 MiB): the extra peak of one fwd+bwd is the bfloat16 gradients,
    the float32 ``dh``, the larger of its vocabulary splits' float32 partial sums (at most
    ``SPLIT_BYTES``) and the persistent kernel's float32 rows (a program per
    multiprocessor, 64 x d each), and 16 MiB for the per-token vectors and the allocator."""
    from dapo_ops.logprobs._triton_linear import SPLIT_BYTES

    n, dim, vocab = 1024, 896, 151936
    extra = _extra_peak(2, n, dim, vocab, torch.bfloat16, backend="triton")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    scratch = max(sms * 64 * dim * 4, SPLIT_BYTES)
    budget = (vocab + n) * dim * 2 + n * dim * 4 + scratch + 16 * 2**20
    assert extra <= budget, f"extra peak {extra / 2**20:.0f} MiB > {budget / 2**20:.0f} MiB"


@CUDA
def test_linear_extra_memory_is_the_gradients_plus_one_chunk() -> None:
    """Extra peak of one fwd+bwd (``max_memory_allocated``, inputs excluded) at 4096
    tokens x vocab 32000 (the float32 logits: 500 MiB): the weight and hidden gradients,
    one chunk's float32 logits and their gradient (``chunk_size=1024`` rows), 8 MiB of
    scratch, and 10 % for the allocator's rounding and the small per-token tensors."""
    n, dim, vocab, chunk = 4096, 256, 32000, 1024
    extra = _extra_peak(4, n, dim, vocab, torch.float32, chunk_size=chunk)
    budget = 1.1 * ((vocab + n) * dim * 4 + 2 * chunk * vocab * 4 + 8 * 2**20)
    assert extra <= budget, f"extra peak {extra / 2**20:.0f} MiB > {budget / 2**20:.0f} MiB"
    assert extra < n * vocab * 4, "as much as the whole logits: not chunked"


# --------------------------------------------------------------------------- no host sync


def _no_sync_calls(b: Batch) -> dict[str, Callable[[], object]]:
    logp = b.logp.detach().requires_grad_(True)
    opts = to(DEV, extras(b, True))
    ent = torch.rand_like(b.logp) * 3
    triton_loss = d.CompiledPolicyLoss(d.ClipHigher(), kl=opts["kl"], backend="triton")
    calls: dict[str, Callable[[], object]] = {
        f"policy_loss({cls.__name__}(), KL, IS) fwd+bwd": lambda cls=cls: d.policy_loss(
            cls(), logp, *b[1:], **opts
        ).backward()
        for cls in OBJECTIVES
    }
    calls |= {
        "token_level_loss fwd+bwd": lambda: d.token_level_loss(logp, *b[1:]).backward(),
        "policy_loss_with_diagnostics": lambda: d.policy_loss_with_diagnostics(
            d.ClipHigher(), logp, *b[1:]
        ),
        "global_normalizer": lambda: d.global_normalizer([b.mask[:3], b.mask[3:]]),
        "truncated_is_weights (sequence)": lambda: d.truncated_is_weights(
            b.old_logp, b.logp.detach(), b.mask, level="sequence", batch_normalize=True
        ),
        "rejection_mask (seq_mean)": lambda: d.rejection_mask(
            b.old_logp, b.logp.detach(), b.mask, level="seq_mean", upper=2.0
        ),
        "offpolicy_metrics": lambda: d.offpolicy_metrics(b.old_logp, b.logp.detach(), b.mask),
        "high_entropy_mask": lambda: d.high_entropy_mask(ent, b.mask, top_quantile=0.2),
        "kl_cov_mask": lambda: d.kl_cov_mask(b.logp.detach(), b.advantages, b.mask),
        "entropy_bonus": lambda: d.entropy_bonus(ent, b.mask, coef=0.01),
        "m2po_mask": lambda: d.m2po_mask(b.old_logp, b.logp.detach(), b.mask, threshold=0.04),
        "truncation_penalty": lambda: d.truncation_penalty(b.advantages, b.mask[:, 0], coef=0.5),
        "CompiledPolicyLoss(backend='triton') fwd+bwd": lambda: triton_loss(
            logp, *b[1:], ref_logp=opts["ref_logp"], is_weights=opts["is_weights"]
        ).backward(),
    }
    return calls


@CUDA
@d.checked(False)  # checked mode reads values on the host by design
def test_no_host_sync_where_none_is_promised() -> None:
    """``torch.cuda.set_sync_debug_mode('error')`` around the loss path and the
    diagnostics: an ``.item()``, a ``nonzero``, a blocking copy to the host raises."""
    b = on(DEV, make_batch(d.ClipHigher(), 6, 33, seed=8, dtype=torch.float32))
    calls = _no_sync_calls(b)
    for fn in calls.values():  # warm up: lazy CUDA init and caching allocator
        fn()
    torch.cuda.synchronize()
    failed = []
    for name, fn in calls.items():
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
        except RuntimeError as e:
            failed.append(f"{name}: {str(e).splitlines()[0]}")
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert not failed, "host syncs:\n" + "\n".join(failed)


#: The public functions that read a value on the host by design (measured on an H100 by
#: the test below), each a value check that raises ``InputError`` and is skipped under
#: ``torch.compile``; each docstring says so (checked on every machine, below).
DOCUMENTED_SYNCS: dict[str, str] = {
    "batch_diagnostics": "lengths finite and >= 0",
    "difficulty_band_mask": "a NaN or inf metric",
    "dynamic_sample_mask": "a NaN or inf metric",
    "fused_logprobs_entropy": "token ids in [0, vocab)",
    "gdpo_advantages": "components finite",
    "group_advantages": "rewards finite",
    "linear_distill_loss": "teacher ids in [0, vocab), none repeated on the tail paths",
    "linear_distill_loss_with_diagnostics": "teacher ids in [0, vocab)",
    "linear_policy_loss": "token ids in [0, vocab)",
    "linear_policy_loss_with_diagnostics": "token ids in [0, vocab)",
    "opo_advantages": "lengths finite and >= 0",
    "overlong_reward": "lengths finite and >= 0",
    "passk_advantages": "two samples in every group",
    "pf_ppo_resample": "weights finite; torch.multinomial",
    "token_logprobs": "token ids in [0, vocab)",
    "token_logprobs_and_entropy": "token ids in [0, vocab)",
}


def test_documented_syncs_are_in_the_docstrings() -> None:
    """Runs everywhere: each function of DOCUMENTED_SYNCS says "host sync" in its docstring."""
    for name in DOCUMENTED_SYNCS:
        doc = " ".join((getattr(d, name).__doc__ or "").split())
        assert "host sync" in doc, f"{name}: its docstring does not mention its host sync"


def _on_cuda(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.to(DEV)
    if isinstance(value, Fresh):  # a seeded generator: one on the device
        made = value.make()
        if isinstance(made, torch.Generator):
            return Fresh(lambda: torch.Generator(device=DEV).manual_seed(0))
    if isinstance(value, list):
        return [_on_cuda(v) for v in value]
    return value


@CUDA
@d.checked(False)  # checked mode reads values on the host by design
def test_every_public_function_runs_on_cuda() -> None:
    """Every function of the bad-input registry (so every public function) with valid
    arguments on the GPU: its tensors come back on the GPU, finite where the CPU's are,
    and no host sync but the documented ones (``set_sync_debug_mode('error')``)."""
    errors, synced = [], {}
    for s in REGISTRY:
        cpu_args = build(s, batch=4, seq=6)
        args = {k: _on_cuda(v) for k, v in cpu_args.items()}
        try:
            want, got = outputs(call(s, cpu_args)), outputs(call(s, args))  # got: warm-up too
        except Exception as e:
            errors.append(f"{s.name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        for w, x in zip(want, got, strict=True):
            if w.ndim and x.device.type != DEV:
                errors.append(f"{s.name}: an output on {x.device}")
            if x.dtype != w.dtype or x.shape != w.shape:
                errors.append(
                    f"{s.name}: {x.dtype}{tuple(x.shape)} != cpu's {w.dtype}{tuple(w.shape)}"
                )
            elif w.is_floating_point() and not torch.equal(w.isfinite(), x.cpu().isfinite()):
                errors.append(f"{s.name}: finite entries differ from the CPU's")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            call(s, args)
        except RuntimeError as e:
            synced[s.name] = str(e).splitlines()[0][:120]
        finally:
            torch.cuda.set_sync_debug_mode(0)
    unexpected = {k: v for k, v in synced.items() if k not in DOCUMENTED_SYNCS}
    report = "\n".join(errors + [f"{k}: host sync ({v})" for k, v in sorted(unexpected.items())])
    report += "\nno longer syncing: " + ", ".join(sorted(set(DOCUMENTED_SYNCS) - set(synced)))
    assert not errors and not unexpected and set(synced) == set(DOCUMENTED_SYNCS), report
