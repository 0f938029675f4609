"""``softcap``: final-logit soft-capping on the fused output-projection paths.

Each path against the naive composition written here (``h @ W.T + b``, then
``c * tanh(z / c)``, then ``/ T``, then the truncation, ``log_softmax``, the objective),
float64, values and the gradients of hidden, weight and bias, within
:data:`dapo_ops.testing.F64_RTOL`: :func:`linear_policy_loss` (token and sequence
objectives, entropy bonus, top-k/top-p, chunk sizes off the vocabulary and token counts),
:func:`fused_logprobs_entropy` and :func:`linear_distill_loss` (every kind, the top-k
paths; the teacher's logits are inputs, left as given). gradcheck on tiny shapes, masked
garbage bitwise, ``softcap=None`` the same bits as without the option, bfloat16, and
``torch.compile``. The row kernels' cap: ``tests/test_row_kernels.py``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from _bounds import assert_within
from test_linear_distill import fused as distill_fused
from test_linear_distill import problem as distill_problem
from test_linear_loss import assert_f64, grads, problem
from torch import Tensor

import dapo_ops as d
from dapo_ops import testing

F64 = torch.float64


def capped(z: Tensor, opts: dict[str, Any]) -> Tensor:
    """The scaled logits the sampler sees: ``cap(z) / T`` (then the truncation)."""
    c, temp = opts.get("softcap"), opts.get("temperature", 1.0)
    z = z if c is None else c * torch.tanh(z / c)
    return z / temp


def naive_log_softmax(z: Tensor, tokens: Tensor, opts: dict[str, Any]) -> Tensor:
    """``log_softmax`` of the capped, scaled, truncated logits (vLLM's order)."""
    x = capped(z, opts)
    k, top_p = opts.get("top_k"), opts.get("top_p")
    keep = torch.ones_like(x, dtype=torch.bool)
    if k is not None:
        keep &= x >= x.topk(k, dim=-1).values[..., -1:]
    if top_p is not None:
        xs = torch.where(keep, x, -math.inf)
        probs, order = torch.softmax(xs, -1).sort(dim=-1, descending=True)
        ahead = probs.cumsum(-1) - probs
        keep &= torch.zeros_like(keep).scatter(-1, order, ahead < top_p)
    keep |= torch.zeros_like(keep).scatter(-1, tokens[..., None], True)
    return torch.log_softmax(torch.where(keep, x, -math.inf), -1)


def naive_policy(objective: d.Objective, p: dict[str, Tensor], opts: dict[str, Any]) -> Any:
    coef = opts.get("entropy_coef", 0.0)

    def fn(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        lp = naive_log_softmax(h @ w.T + b, p["tokens"], opts)
        logp = lp.gather(-1, p["tokens"][..., None]).squeeze(-1)
        loss = d.policy_loss(objective, logp, p["old"], p["adv"], p["mask"])
        ent = -(lp.exp() * lp.clamp(min=-1e4)).sum(-1)
        return loss + d.entropy_bonus(ent, p["mask"], coef=coef) if coef else loss

    return fn


def fused_policy(objective: d.Objective, p: dict[str, Tensor], opts: dict[str, Any]) -> Any:
    def fn(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        args = (p["tokens"], p["old"], p["adv"], p["mask"])
        return d.linear_policy_loss(h, w, *args, objective=objective, bias=b, **opts)

    return fn


POLICY_CASES = [
    pytest.param(d.ClipHigher(), {"softcap": 2.0, "temperature": 0.7, "chunk_size": 5}, id="clip-c2-T0.7"),
    pytest.param(d.ClipHigher(), {"softcap": 30.0, "entropy_coef": 0.05, "chunk_size": 7}, id="clip-c30-entropy"),
    pytest.param(d.ClipHigher(), {"softcap": 1.5, "top_k": 4, "temperature": 0.8, "chunk_size": 5}, id="top-k"),
    pytest.param(d.ClipHigher(), {"softcap": 1.5, "top_p": 0.7, "entropy_coef": 0.02, "chunk_size": 7}, id="top-p-entropy"),
    pytest.param(d.GSPO(), {"softcap": 2.0, "temperature": 1.3, "chunk_size": 4}, id="gspo-walked-twice"),
    pytest.param(d.GSPO(), {"softcap": 2.0, "entropy_coef": 0.03, "chunk_size": 13}, id="gspo-two-sequences"),
]  # fmt: skip


@pytest.mark.parametrize(("objective", "opts"), POLICY_CASES)
def test_linear_policy_loss_equals_naive(objective: d.Objective, opts: dict[str, Any]) -> None:
    p = problem(seed=1)
    p["hidden"] = p["hidden"] * 3  # logits of a few units: a cap of 1.5 or 2 bites
    got = grads(fused_policy(objective, p, opts), p)
    assert_f64(got, grads(naive_policy(objective, p, opts), p), "softcap vs naive")
    uncapped = grads(fused_policy(objective, p, opts | {"softcap": None}), p)
    assert not torch.allclose(got[0], uncapped[0])  # the cap changed the loss


@pytest.mark.parametrize(
    "opts",
    [{"softcap": 2.0, "temperature": 0.6, "chunk_size": 7}, {"softcap": 1.5, "top_p": 0.8, "chunk_size": 5}],
)  # fmt: skip
def test_fused_logprobs_entropy_equals_naive(opts: dict[str, Any]) -> None:
    """Log-probs, entropies and the gradients of an upstream mix of both."""
    p = problem(seed=2)
    h0, tokens = p["hidden"] * 3, p["tokens"]
    up = torch.randn(2, *tokens.shape, generator=torch.Generator().manual_seed(0), dtype=F64)

    def fused(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        out = d.fused_logprobs_entropy(h, w, tokens, bias=b, **opts)
        return (up[0] * out.logp + up[1] * out.entropy).sum()

    def naive(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        lp = naive_log_softmax(h @ w.T + b, tokens, opts)
        ent = -(lp.exp() * lp.clamp(min=-1e4)).sum(-1)
        return (up[0] * lp.gather(-1, tokens[..., None]).squeeze(-1) + up[1] * ent).sum()

    q = p | {"hidden": h0}
    assert_f64(grads(fused, q), grads(naive, q), "fused_logprobs_entropy")


DISTILL_CASES = [
    {"kind": "forward_kl", "softcap": 2.0, "temperature": 0.8, "chunk_size": 4},
    {"kind": "reverse_kl", "softcap": 1.5, "chunk_size": 7},
    {"kind": "jsd", "beta": 0.3, "softcap": 3.0, "temperature": 1.4, "mode": "seq_mean_token_mean"},
    {"softcap": 2.0, "topk": 3, "chunk_size": 4},
    {"softcap": 2.0, "teacher_ids": True, "log_prob_min_clamp": -3.0, "chunk_size": 7},
    {"softcap": 2.0, "teacher_ids": True, "topk_tail": "bucket", "is_weights": True, "chunk_size": 4},
    {"softcap": 1.5, "topk": 3, "topk_tail": "renormalize", "temperature": 0.8, "chunk_size": 7},
]  # fmt: skip


@pytest.mark.parametrize("opts", DISTILL_CASES, ids=lambda o: o.get("kind", "topk"))
def test_linear_distill_loss_equals_naive(opts: dict[str, Any]) -> None:
    """The student's logits capped, the teacher's as given (the caller caps them)."""
    from test_linear_distill import naive, values_and_grads

    p = distill_problem(3)
    p["hidden"] = p["hidden"] * 2
    opts = opts | {"bias": p["bias"]}

    def naive_capped(q: dict[str, Any], o: dict[str, Any]) -> Tensor:
        """The naive composition on the capped logits: ``hidden`` those, ``weight`` the
        identity (exact in float64), no bias; the teacher's logits as they are."""
        z = q["hidden"] @ q["weight"].T + q["bias"]
        zc = o["softcap"] * torch.tanh(z / o["softcap"])
        rest = {k: v for k, v in o.items() if k not in ("bias", "softcap")}
        return naive(q | {"hidden": zc, "weight": torch.eye(zc.shape[-1], dtype=F64)}, rest)

    got = values_and_grads(distill_fused, p, opts)
    want = values_and_grads(naive_capped, p, opts)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-11, atol=1e-12)
    assert not torch.allclose(
        got[0], values_and_grads(distill_fused, p, opts | {"softcap": None})[0]
    )


def _tiny(seed: int) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    h = (2 * torch.randn(2, 3, 3, generator=g, dtype=F64)).requires_grad_(True)
    w = torch.randn(7, 3, generator=g, dtype=F64).requires_grad_(True)
    b = torch.randn(7, generator=g, dtype=F64).requires_grad_(True)
    tokens = torch.randint(0, 7, (2, 3), generator=g)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    return h, w, b, tokens, mask


def test_gradcheck_and_double_backward() -> None:
    """float64 gradcheck of the three functions with the cap (chunks of 2 rows: 3
    chunks, one ragged), and gradgradcheck (``create_graph=True`` differentiates the
    definition) of the policy loss and the fused log-probs."""
    h, w, b, tokens, mask = _tiny(0)
    old = torch.full((2, 3), -2.0, dtype=F64)
    adv = torch.tensor([1.0, -0.5], dtype=F64)
    teacher = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(1), dtype=F64)
    kw: dict[str, Any] = {"softcap": 1.5, "temperature": 0.8, "chunk_size": 2}

    def policy(h: Tensor, w: Tensor, b: Tensor) -> Tensor:
        return d.linear_policy_loss(h, w, tokens, old, adv, mask, bias=b, entropy_coef=0.1, **kw)

    def fused(h: Tensor, w: Tensor, b: Tensor) -> tuple[Tensor, ...]:
        return tuple(d.fused_logprobs_entropy(h, w, tokens, bias=b, **kw))

    def distill(h: Tensor, w: Tensor, b: Tensor) -> Tensor:
        return d.linear_distill_loss(h, w, teacher, mask, bias=b, kind="jsd", **kw)

    for fn in (policy, fused, distill):
        assert torch.autograd.gradcheck(fn, (h, w, b))
    for fn in (policy, fused):
        assert torch.autograd.gradgradcheck(fn, (h, w, b))


def test_masked_garbage_and_none_bitwise() -> None:
    """NaN hidden rows and -100 ids at masked positions change nothing, bit for bit, with
    the cap; ``softcap=None`` gives the bits of a call without the option."""
    p = problem(dtype=torch.float32, seed=5)
    dirty = p | {"hidden": torch.where(p["mask"][..., None], p["hidden"], math.nan)}
    dirty["tokens"] = torch.where(p["mask"], p["tokens"], -100)
    for opts in ({"softcap": 2.0, "entropy_coef": 0.05, "chunk_size": 5}, {"softcap": 2.0, "top_k": 3}):  # fmt: skip
        (l0, g0), (l1, g1) = (grads(fused_policy(d.ClipHigher(), q, opts), q) for q in (p, dirty))
        assert torch.equal(l0, l1) and all(torch.equal(x, y) for x, y in zip(g0, g1, strict=True))
    teacher = torch.randn(*p["tokens"].shape, 13, generator=torch.Generator().manual_seed(2))
    for opts in ({}, {"entropy_coef": 0.05, "chunk_size": 5, "temperature": 0.7}):
        (l0, g0), (l1, g1) = (
            grads(fused_policy(d.ClipHigher(), p, opts | extra), p)
            for extra in ({}, {"softcap": None})
        )
        assert torch.equal(l0, l1) and all(torch.equal(x, y) for x, y in zip(g0, g1, strict=True))
    h, w, tok = p["hidden"], p["weight"], p["tokens"]
    a, c = d.fused_logprobs_entropy(h, w, tok), d.fused_logprobs_entropy(h, w, tok, softcap=None)
    assert torch.equal(a.logp, c.logp) and torch.equal(a.entropy, c.entropy)
    x = d.linear_distill_loss(h, w, teacher, p["mask"], kind="jsd")
    assert torch.equal(x, d.linear_distill_loss(h, w, teacher, p["mask"], kind="jsd", softcap=None))


def test_bfloat16_within_float64_reference() -> None:
    """bfloat16 inputs (the matmuls in bfloat16, the cap, softmax and loss in float32, the
    capped gradient rounded once before its matmuls) near the float64 values of the same
    rounded inputs: the loss to 1e-3, the gradients to 2 % of their largest entry."""
    p = problem(4, 6, 16, 40, seed=6, dtype=torch.bfloat16)
    opts = {"softcap": 2.0, "temperature": 0.9, "entropy_coef": 0.05, "chunk_size": 7}
    got = grads(fused_policy(d.ClipHigher(), p, opts), p)
    wide = {k: v.to(F64) if v.is_floating_point() else v for k, v in p.items()}
    want = grads(naive_policy(d.ClipHigher(), wide, opts), wide)
    assert_within(got[0].to(F64), want[0], 1e-3 * (1 + want[0].abs()), "loss")
    for x, y in zip(got[1], want[1], strict=True):
        assert x.dtype == torch.bfloat16
        assert_within(x, y, float(0.02 * y.abs().max()), "gradient")


@pytest.mark.usefixtures("no_runtime_typecheck")
def test_compile_fullgraph() -> None:
    """torch.compile(fullgraph=True, aot_eager): the chunks traced functionally, the cap
    included; float64, the eager values within F64_RTOL."""
    p = problem(seed=1)
    opts = {"softcap": 2.0, "entropy_coef": 0.05, "chunk_size": 5, "temperature": 0.8}
    fn = fused_policy(d.ClipHigher(), p, opts)
    q = distill_problem(4)
    dopts = {"kind": "reverse_kl", "softcap": 2.0, "chunk_size": 4, "bias": True}
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    assert_f64(grads(compiled, p), grads(fn, p), "compiled policy loss")
    dist = torch.compile(distill_fused, fullgraph=True, backend="aot_eager")
    from test_linear_distill import values_and_grads

    for x, y in zip(values_and_grads(dist, q, dopts), values_and_grads(distill_fused, q, dopts), strict=True):  # fmt: skip
        assert_within(x, y, testing.F64_RTOL * (y.abs() + y.abs().max()), "compiled distill")


@pytest.mark.usefixtures("no_runtime_typecheck")
@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, True, "30"])
def test_bad_softcap_names_it(bad: object) -> None:
    p = problem(dtype=torch.float32)
    h, w, tok, mask = p["hidden"], p["weight"], p["tokens"], p["mask"]
    calls = [
        lambda: d.linear_policy_loss(h, w, tok, p["old"], p["adv"], mask, softcap=bad),  # type: ignore[arg-type]
        lambda: d.fused_logprobs_entropy(h, w, tok, softcap=bad),  # type: ignore[arg-type]
        lambda: d.linear_distill_loss(h, w, torch.zeros(*tok.shape, 13), mask, softcap=bad),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(d.InputError, match="softcap"):
            call()
