"""A split vocabulary against verl 0.9.1's own (``verl/utils/megatron/tensor_parallel.py``).

Gloo worlds of 2 and 3 CPU ranks (``tests/_dist.py``), joined into Megatron's parallel
state by ``megatron.core.parallel_state.initialize_model_parallel(tensor_model_parallel_
size=world)``: the real megatron-core, no stand-in (``.ci/integration`` installs it with
``--no-deps``; it imports on CPU without Transformer Engine or Apex, with warnings). Rank
``r`` holds the contiguous slice ``W_r [V_r, d]``, ``b_r [V_r]`` of the output layer and
the same flat ``hidden [tokens, d]`` and global ids (verl's remove-padding layout). Per
case (float32 and float64, temperature 1 and 0.7):

- **verl**: the rank's logits ``hidden @ W_r.T + b_r``, divided in place by the
  temperature, then, as verl's Megatron engine does (``MegatronEngineWithLMHead.
  _lm_head_logits_processor`` in ``verl/workers/engine/megatron/transformer_impl.py``),
  ``vocab_parallel_entropy`` of them and ``vocab_parallel_log_probs_from_logits`` of a
  clone, both on Megatron's tensor-parallel group; autograd takes ``sum a logp + b H``
  back through the logits to ``hidden``, ``W_r`` and ``b_r``;
- **ours**: ``fused_logprobs_entropy(hidden, W_r, tokens, bias=b_r, vocab_group=<the same
  group>, backend="two_pass")`` with the same upstream gradients.

The ranks' hidden-state gradients are summed (Megatron's convention: each is the rank's
partial sum) and the weight and bias slices concatenated; every output of both paths is
checked against the exact float64 values within ``fused_reference``'s bounds
(``tests/_bounds.py``) for the arithmetic that produced it. Two float paths are never
compared with each other directly.

What verl's functions allow, and how the test follows it:

- **Even splits only for the log-probs.** Megatron's ``vocab_parallel_cross_entropy``
  places rank ``r``'s slice at ``r * V_r`` (``VocabUtility.vocab_range_from_per_
  partition_vocab_size``): it assumes every rank holds ``V / tp`` ids. So the full parity
  (log-probs, entropies, gradients through both) runs on vocab 24 (12 + 12, 8 + 8 + 8);
  on vocab 23 (12 + 11, 8 + 8 + 7) verl's ``vocab_parallel_entropy``, which never
  locates its slice, is compared with the gradient through the entropy alone, and ours
  in full (the uneven split on our side).
- **float64**: Megatron's cross-entropy casts the logits to float32 (``.float()``), so
  verl's float64 log-probs and the logits gradient through them carry float32 rounding:
  they are held to the float32 softmax bound, chained through the float64 matmuls
  (:func:`f32_softmax_pairs`); verl's entropy stays in float64 and gets the float64
  bound, as all of ours does.

Teardown: ``destroy_model_parallel`` of megatron-core 0.16.1 leaves
``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` set, which would keep that group's gloo
threads alive past ``destroy_process_group`` (the ``leaked_threads`` check): every
``ProcessGroup`` still held by ``parallel_state`` is dropped after it. Megatron's extra
gloo groups are not made (``create_gloo_process_groups=False``: the default backend is
gloo already).
"""

from __future__ import annotations

import gc
import importlib.util
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _bounds import (
    F64,
    FusedReference,
    assert_within,
    fused_reference,
    gamma_ref,
    softmax_reference,
)
from _dist import can_list_threads, run_world
from torch import Tensor

import dapo_ops as d

pytest.importorskip("verl")
try:
    _megatron = importlib.util.find_spec("megatron.core")
except ModuleNotFoundError:
    _megatron = None
if _megatron is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

pytestmark = pytest.mark.integration

N, D = 13, 8
SPLITS = {2: {24: [12, 12], 23: [12, 11]}, 3: {24: [8, 8, 8], 23: [8, 8, 7]}}
DTYPES = (torch.float32, torch.float64)
TEMPERATURES = (1.0, 0.7)


def problem(vocab: int, dtype: torch.dtype) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(vocab)
    return {
        "hidden": torch.randn(N, D, generator=g, dtype=F64).to(dtype),
        "weight": (torch.randn(vocab, D, generator=g, dtype=F64) * 0.7).to(dtype),
        "bias": (torch.randn(vocab, generator=g, dtype=F64) * 0.3).to(dtype),
        "tokens": torch.randint(0, vocab, (N,), generator=g),
        "a": torch.randn(N, generator=g, dtype=F64).to(dtype),  # d loss / d logp
        "b": torch.randn(N, generator=g, dtype=F64).to(dtype),  # d loss / d entropy
    }


def case_names() -> list[tuple[str, int, torch.dtype, float]]:
    return [
        (f"V{v}-{str(dt)[6:]}-T{t}", v, dt, t)
        for v in (24, 23)
        for dt in DTYPES
        for t in TEMPERATURES
    ]


def _leaves(p: dict[str, Tensor], sl: slice) -> tuple[Tensor, Tensor, Tensor]:
    return (
        p["hidden"].clone().requires_grad_(True),
        p["weight"][sl].clone().requires_grad_(True),
        p["bias"][sl].clone().requires_grad_(True),
    )


def _verl(vtp: Any, p: dict[str, Tensor], sl: slice, t: float, even: bool) -> list[Tensor]:
    """verl's path on this rank: [logp (even splits), entropy, d hidden, d W_r, d b_r]."""
    h, w, b = _leaves(p, sl)
    logits = h @ w.T + b
    logits.div_(t)  # verl's engine: logits.div_(temperature)
    logits_bak = logits.clone()
    entropy = vtp.vocab_parallel_entropy(logits)
    loss = (p["b"] * entropy).sum()
    out = [entropy.detach()]
    if even:  # Megatron's cross-entropy assumes V / tp ids per rank
        logp = vtp.vocab_parallel_log_probs_from_logits(logits_bak, p["tokens"])
        loss = loss + (p["a"] * logp).sum()
        out.insert(0, logp.detach())
    return out + list(torch.autograd.grad(loss, [h, w, b]))


def _ours(p: dict[str, Tensor], sl: slice, t: float, group: Any) -> list[Tensor]:
    """Ours on this rank: [logp, entropy, d hidden, d W_r, d b_r]."""
    h, w, b = _leaves(p, sl)
    out = d.fused_logprobs_entropy(
        h, w, p["tokens"], bias=b, temperature=t, vocab_group=group, backend="two_pass"
    )
    loss = (p["a"] * out.logp + p["b"] * out.entropy).sum()
    return [out.logp.detach(), out.entropy.detach(), *torch.autograd.grad(loss, [h, w, b])]


def _worker(rank: int, world: int) -> dict[str, Any]:
    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as mpu
        from verl.utils.megatron import tensor_parallel as vtp

    mpu.initialize_model_parallel(
        tensor_model_parallel_size=world, create_gloo_process_groups=False
    )
    group = mpu.get_tensor_model_parallel_group()
    out: dict[str, Any] = {
        "megatron": (
            mpu.get_tensor_model_parallel_rank(),
            mpu.get_tensor_model_parallel_world_size(),
        )
    }
    for name, vocab, dtype, t in case_names():
        sizes = SPLITS[world][vocab]
        start = sum(sizes[:rank])
        sl = slice(start, start + sizes[rank])
        p = problem(vocab, dtype)
        even = len(set(sizes)) == 1
        out[name] = {"verl": _verl(vtp, p, sl, t, even), "ours": _ours(p, sl, t, group)}
    mpu.destroy_model_parallel()
    for key, value in list(vars(mpu).items()):  # what destroy_model_parallel leaves set
        if isinstance(value, dist.ProcessGroup):
            setattr(mpu, key, None)
    # The compile inside verl's vocab_parallel_entropy leaves a torch.fx tracer in a
    # reference cycle holding a dead weakref.proxy: collect it before _dist's teardown
    # walks gc.get_objects() (isinstance on a dead proxy raises ReferenceError).
    gc.collect()
    return out


def f32_softmax_pairs(
    p: dict[str, Tensor], temperature: float, exact: FusedReference
) -> list[tuple[Tensor, Tensor]]:
    """Bounds for verl's float64 path, whose log-probs Megatron computes in float32.

    The logits gradient is bounded by ``softmax_reference`` for float32 arithmetic (each
    operation of the mixed float32 / float64 evaluation rounds by at most float32's
    ``u``), on the float64 logits and their matmul error; it is then chained through the
    float64 matmuls as ``fused_reference`` chains it: ``dh = G W``, ``dW = G^T h``,
    ``db = sum G``. The entropy keeps ``exact``'s float64 bound. Returns (exact, bound) of
    [logp, entropy, d hidden, d weight, d bias]."""
    h, w = p["hidden"].to(F64), p["weight"].to(F64)
    z = h @ w.T + p["bias"].to(F64)
    z_err = gamma_ref(D + 1, F64) * (h.abs() @ w.abs().T + p["bias"].to(F64).abs())
    soft = softmax_reference(
        z,
        p["tokens"],
        temperature=temperature,
        w_logp=p["a"],
        w_entropy=p["b"],
        logits_err=z_err,
        dtype=torch.float32,
    )
    g, g_err = exact.soft.grad, soft.grad_err
    g_mag = g.abs() + g_err
    gh_err = g_err @ w.abs() + gamma_ref(w.shape[0], F64) * (g_mag @ w.abs())
    gw_err = g_err.T @ h.abs() + gamma_ref(N, F64) * (g_mag.T @ h.abs())
    gb_err = g_err.sum(0) + gamma_ref(N, F64) * g_mag.sum(0)
    return [
        (exact.soft.logp, soft.logp_err),
        (exact.soft.entropy, exact.soft.entropy_err),
        (exact.grad_hidden, gh_err),
        (exact.grad_weight, gw_err),
        (exact.grad_bias, gb_err),
    ]


def _gathered(results: list[dict[str, Any]], name: str, path: str) -> list[Tensor]:
    """The shared outputs as rank 0 has them (every rank's equal), the hidden gradient
    summed over the ranks, the weight and bias slices concatenated."""
    parts = [r[name][path] for r in results]
    k = len(parts[0]) - 3
    for other in parts[1:]:
        for x, y in zip(other[:k], parts[0][:k], strict=True):
            assert torch.equal(x, y), f"{name} {path}: the ranks disagree"
    gh = parts[0][k]
    for q in parts[1:]:
        gh = gh + q[k]  # in the gradient's dtype, as Megatron's all-reduce sums
    return [
        *parts[0][:k],
        gh,
        torch.cat([q[k + 1] for q in parts]),
        torch.cat([q[k + 2] for q in parts]),
    ]


def _pairs(ref: FusedReference, *, logp: bool = True) -> list[tuple[Tensor, Tensor]]:
    """(exact, bound) of [logp, entropy, d hidden, d weight, d bias], without the first
    when ``logp`` is False."""
    pairs = [
        (ref.soft.logp, ref.soft.logp_err),
        (ref.soft.entropy, ref.soft.entropy_err),
        (ref.grad_hidden, ref.grad_hidden_err),
        (ref.grad_weight, ref.grad_weight_err),
        (ref.grad_bias, ref.grad_bias_err),
    ]
    return pairs if logp else pairs[1:]


def _check(got: list[Tensor], pairs: list[tuple[Tensor, Tensor]], what: str) -> None:
    for i, (x, (want, bound)) in enumerate(zip(got, pairs, strict=True)):
        assert_within(x, want, bound, f"{what} output {i}")


@pytest.mark.parametrize("world", [2, 3])
def test_split_vocabulary_equals_verl_megatron(world: int, tmp_path: Path) -> None:
    results = run_world(_worker, world, tmp_path)
    assert [r["megatron"] for r in results] == [(r, world) for r in range(world)]
    if can_list_threads():
        assert [r["leaked_threads"] for r in results] == [[]] * world
    for name, vocab, dtype, t in case_names():
        p = problem(vocab, dtype)
        args = (p["hidden"], p["weight"], p["tokens"])
        opts: dict[str, Any] = {"bias": p["bias"], "temperature": t, "w_entropy": p["b"]}
        full = fused_reference(*args, w_logp=p["a"], **opts)
        ours = _gathered(results, name, "ours")
        assert all(x.dtype == dtype for x in ours), name
        _check(ours, _pairs(full), f"{name} ours")
        verl = _gathered(results, name, "verl")
        if len(set(SPLITS[world][vocab])) > 1:  # verl's entropy, the gradient through it
            entropy_only = fused_reference(*args, **opts)
            _check(verl, _pairs(entropy_only, logp=False), f"{name} verl entropy-only")
            continue
        # Megatron's cross-entropy computes in float32
        pairs = f32_softmax_pairs(p, t, full) if dtype == F64 else _pairs(full)
        _check(verl, pairs, f"{name} verl")
