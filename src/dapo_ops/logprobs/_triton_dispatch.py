r"""The ``backend=`` switch, and the Triton path of the linear loss and the fused log-probs.

Private. :func:`use_triton` resolves ``backend`` (``"auto"``, ``"triton"``, ``"chunked"``);
:func:`triton_policy_loss` and :func:`triton_logprobs_entropy` run the kernels of
:mod:`dapo_ops.logprobs._triton_linear` under autograd. Between the two passes the engine works on
``[batch, seq]`` vectors, as :func:`dapo_ops.policy_loss` does: the objective's ``grad``
(or autograd of its ``term``) with KL, IS weights, aggregation and the normaliser gives
``a = d loss / d logp``, the entropy bonus ``b = d loss / d H``; every objective works,
sequence-level ones included, since every log-prob exists after pass 1. Backward runs
pass 2 with ``a`` and ``b`` scaled by the incoming gradient; ``create_graph=True``
differentiates the definition (the chunked path's :func:`reference_loss`).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from dapo_ops._core._rules import compute_dtype, masked
from dapo_ops._core._validate import InputError, check_option, is_compiling
from dapo_ops.engine.aggregation import loss_scale
from dapo_ops.logprobs._fused_linear import linear
from dapo_ops.logprobs._linear_loss import (
    LinearInputs,
    LinearSpec,
    _objective_terms,
    reference_loss,
)
from dapo_ops.logprobs._softcap import grad_through_cap
from dapo_ops.logprobs._softmax_blocks import grad_with_graph

Backend = Literal["auto", "triton", "chunked"]
BACKENDS = ("auto", "triton", "chunked")

#: What ``backend="auto"`` picks, per device type. The chunked path everywhere until the
#: kernels are measured on a GPU (issue 30); then ``"cuda": "triton"``.
AUTO: dict[str, str] = {}


def use_triton(
    backend: object, device: torch.device, chunk_size: int | None, truncated: bool = False
) -> bool:
    """Whether the call runs the Triton kernels; refuses what cannot run. The kernels do
    not truncate (top_k/top_p/min_p): ``"auto"`` then takes the chunked path, and an
    explicit ``"triton"`` is refused."""
    check_option("backend", backend, BACKENDS)  # type: ignore[arg-type]
    if backend == "triton" and truncated:
        raise InputError(
            "backend='triton' has no sampler truncation (top_k, top_p, min_p): use "
            "backend='chunked' (or 'auto') for a truncated distribution"
        )
    if backend == "auto":
        chosen = "chunked" if truncated else AUTO.get(device.type, "chunked")
    else:
        chosen = str(backend)
    if chosen != "triton":
        return False
    from dapo_ops._core._triton import interpreting

    if backend == "triton":
        if is_compiling():
            raise InputError(
                "backend='triton' runs eagerly only; under torch.compile use "
                "backend='chunked' (or 'auto')"
            )
        if chunk_size is not None:
            raise InputError(
                f"chunk_size={chunk_size} sets the chunked backend's chunks; backend='triton' "
                "walks tiles and takes no chunk_size"
            )
        if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
            raise InputError(
                f"backend='triton' needs CUDA tensors (or CPU tensors under Triton's "
                f"interpreter, TRITON_INTERPRET=1); got tensors on {device}"
            )
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise InputError(
            "backend='triton' needs the triton package (it ships with CUDA builds of torch)"
        ) from e
    return True


def _flat(h: Tensor, w: Tensor, b: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    flat = h.reshape(-1, h.shape[-1]).contiguous()
    return flat, w.contiguous(), None if b is None else b.contiguous()


def _engine(
    spec: LinearSpec, logp: Tensor, ent: Tensor, t: LinearInputs, with_grad: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The loss (0-dim), ``a`` and ``b`` (``[batch, seq]``, or None) from pass 1's vectors."""
    dtype = compute_dtype(logp, t.old_logp, t.adv)
    den = "local" if t.normalizer is None else t.normalizer
    scale = loss_scale(t.valid, mode=spec.loss.mode, normalizer=den, max_len=spec.loss.max_len, dtype=dtype)  # type: ignore[arg-type]  # fmt: skip
    loss, a = _objective_terms(spec.loss, logp.to(dtype), t, scale, with_grad)
    b = None
    if isinstance(t.coef, Tensor) or t.coef != 0.0:
        coef = torch.as_tensor(t.coef, dtype=dtype, device=logp.device)
        w = masked(t.valid, (-coef * scale).expand(t.valid.shape))
        loss = loss + (w * masked(t.valid, ent.to(dtype))).sum()
        b = w
    return loss, a, b


def _pass1(
    spec: LinearSpec, hidden: Tensor, weight: Tensor, bias: Tensor | None, t: LinearInputs,
    with_grad: bool,
) -> tuple[tuple[Tensor, Tensor, Tensor], tuple[Tensor, ...]]:  # fmt: skip
    """``(loss, logp, entropy)`` and what pass 2 needs: ``(lse, H, a[, b])``, flat."""
    from dapo_ops.logprobs._triton_linear import forward_stats

    h, w, b = _flat(hidden, weight, bias)
    tok, valid = t.tokens.reshape(-1), t.valid.reshape(-1).to(torch.int8)
    logp, ent, lse = forward_stats(h, w, b, tok, valid, spec.temperature, spec.softcap)
    shape = t.valid.shape
    loss, a, g_ent = _engine(spec, logp.view(shape), ent.view(shape), t, with_grad)
    a = logp.new_zeros(shape) if a is None else a.to(logp.dtype)
    upstream = (a,) if g_ent is None else (a, g_ent.to(logp.dtype))
    entropy = ent.view(shape) if spec.entropy else logp.new_zeros(0)
    return (loss, logp.view(shape), entropy), (lse, ent, *upstream)


class TritonPolicyLoss(torch.autograd.Function):
    """``(loss, logp, entropy)``: pass 1 and the engine in forward, pass 2 in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, spec: LinearSpec,
        t: LinearInputs,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        out, stats = _pass1(spec, hidden, weight, bias, t, True)
        ctx.spec, ctx.inputs = spec, t
        ctx.save_for_backward(hidden, weight, bias, *stats)
        ctx.mark_non_differentiable(out[1], out[2])
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, *_: Any) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        from dapo_ops.logprobs._triton_linear import backward_grads

        hidden, weight, bias, lse, ent, a, *rest = ctx.saved_tensors
        need = tuple(bool(n) for n in ctx.needs_input_grad[:3])
        if torch.is_grad_enabled():  # create_graph=True: differentiate the definition
            wanted = [x for x, n in zip((hidden, weight, bias), need, strict=True) if n]
            with torch.enable_grad():
                loss = reference_loss(ctx.spec, hidden, weight, bias, ctx.inputs)
                got = iter(torch.autograd.grad(loss, wanted, grad_out, create_graph=True))
            return (*(next(got) if n else None for n in need), None, None)
        g = grad_out.to(a.dtype)
        b_vec = (rest[0] * g).reshape(-1) if rest else None
        h, w, b = _flat(hidden, weight, bias)
        t = ctx.inputs
        tok, valid = t.tokens.reshape(-1), t.valid.reshape(-1).to(torch.int8)
        stats = (lse, ent, (a * g).reshape(-1), b_vec)
        scale = (ctx.spec.temperature, ctx.spec.softcap)
        gh, gw, gb = backward_grads(h, w, b, tok, valid, stats, scale, need)  # type: ignore[arg-type]
        return (None if gh is None else gh.view(hidden.shape), gw, gb, None, None)


def triton_policy_loss(
    spec: LinearSpec, h: Tensor, w: Tensor, b: Tensor | None, t: LinearInputs
) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, logp, entropy)`` of the checked inputs, on the kernels."""
    need = any(torch.is_grad_enabled() and x is not None and x.requires_grad for x in (h, w, b))
    if need:
        return TritonPolicyLoss.apply(h, w, b, spec, t)  # type: ignore[no-any-return,no-untyped-call]
    return _pass1(spec, h, w, b, t, False)[0]


class TritonLogpEntropy(torch.autograd.Function):
    """``(logp, entropy)`` of ``hidden [N, d]``: pass 1 forward, pass 2 backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor,
        temperature: float, softcap: float | None,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        from dapo_ops.logprobs._triton_linear import forward_stats

        h, w, b = _flat(hidden, weight, bias)
        logp, ent, lse = forward_stats(h, w, b, tokens, None, temperature, softcap)
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, ent)
        ctx.temperature, ctx.softcap = temperature, softcap
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor | None, grad_ent: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]  # fmt: skip
        from dapo_ops.logprobs._triton_linear import backward_grads

        hidden, weight, bias, tokens, lse, ent = ctx.saved_tensors
        need = tuple(bool(n) for n in ctx.needs_input_grad[:3])
        if not any(need) or (grad_logp is None and grad_ent is None):
            return (None,) * 6
        cdt = ent.dtype
        if torch.is_grad_enabled():  # create_graph=True: a differentiable gradient
            g = grad_through_cap(linear(hidden, weight, bias), ctx.softcap, cdt, lambda z: grad_with_graph(z, tokens, grad_logp, grad_ent, ctx.temperature, cdt))  # fmt: skip
            dtype = hidden.dtype
            return (
                (g.to(dtype) @ weight) if need[0] else None,
                (g.T @ hidden.to(cdt)).to(dtype) if need[1] else None,
                g.sum(dim=0).to(dtype) if need[2] else None,
                *(None,) * 3,
            )
        a = ent.new_zeros(ent.shape) if grad_logp is None else grad_logp.to(cdt).contiguous()
        b_vec = None if grad_ent is None else grad_ent.to(cdt).contiguous()
        h, w, b = _flat(hidden, weight, bias)
        scale = (ctx.temperature, ctx.softcap)
        grads = backward_grads(h, w, b, tokens, None, (lse, ent, a, b_vec), scale, need)  # type: ignore[arg-type]  # fmt: skip
        return (*grads, None, None, None)


def triton_logprobs_entropy(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor, temperature: float,
    softcap: float | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(logp, entropy)`` ``[N]`` in the compute dtype, for ``hidden [N, d]``."""
    return TritonLogpEntropy.apply(hidden, weight, bias, tokens, temperature, softcap)  # type: ignore[no-any-return,no-untyped-call]
