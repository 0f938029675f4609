"""``CompiledPolicyLoss``: :func:`policy_loss` compiled ahead of time, called with light guards.

``policy_loss(..., compiled=True)`` goes through ``torch.compile``: every call evaluates
dynamo's guards and wrapper, about 15 us back to back and 100-150 us when other work has
evicted them from the caches (measured on a 2-core CPU), which at ``64 x 4096`` is as
much as the kernel. A :class:`CompiledPolicyLoss` instead traces the fused loss body once
per input signature (``torch.export``), compiles the graph with inductor (``compile_fx``:
the kernel of ``compiled=True``) and then calls the compiled function directly: the
per-call work is one dictionary lookup on the signature, the engine's autograd function
and the kernel (a whole fwd+bwd step at ``1 x 8``: 49 us against ``compiled=True``'s
85 us, one thread, docs/loss.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import torch
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._checked import checks_values
from dapo_ops._core._inputs import policy_tensors
from dapo_ops._core._rules import AGGREGATION_MODES, AggregationMode, Normalizer, compute_dtype
from dapo_ops._core._validate import InputError, check_option
from dapo_ops.engine._engine import LossInputs, LossSpec, fused_loss, generic_terms
from dapo_ops.engine.aggregation import check_max_len, check_normalizer, loss_scale, scaled_sum
from dapo_ops.engine.kl import KLPenalty
from dapo_ops.engine.policy import prepare
from dapo_ops.objectives.base import Objective, check_objective_value

#: (shape, dtype, stride, requires_grad) of each tensor argument (None when not given),
#: the device, and whether a normaliser is given.
Signature = tuple[Any, ...]

#: The compiled body: (logp, old_logp, adv, valid_u8, ref, rho, kappa, normalizer)
#: without the absent ones -> (loss, grad) or (loss,).
Kernel = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class CompiledPolicyLoss:
    r""":func:`policy_loss` for one objective and set of options, compiled ahead of time
    per input signature and called without dynamo.

    .. math::

        \mathcal{L} = \sum_{i,t} w_{i,t}\, m_{i,t}\,\big(\rho_{i,t}\,\ell_{i,t}
            + \beta\,\kappa_{i,t}\, k_{i,t}\big)

    exactly as :func:`policy_loss` (same arguments, same checks, same errors); the value
    and the gradient are those of ``policy_loss(..., compiled=True)``: the fused body
    (loss scale, objective term and analytic gradient, IS weights, KL) as one inductor
    graph. The object holds the options (``objective``, ``mode``, ``max_len``, ``kl``,
    ``backend``) and an explicit cache of compiled code, one entry per input signature.

    Guards: a call is looked up by the shape, dtype, strides and ``requires_grad`` of
    every tensor argument (absent ones included), their device and whether a normaliser
    is given; a number or 0-dim tensor normaliser is an input, so its value may change.
    A signature seen for the first time is checked in full (:func:`policy_loss`'s
    checks), traced and compiled (inductor: a few seconds; cached on disk by inductor
    across processes); later calls with it check only what cannot be part of the
    signature (the normaliser's value and the distributed rule). Values are never
    inspected (no host sync), except in checked mode (:class:`~dapo_ops.checked`), where
    every call checks them eagerly, outside the compiled graph.

    ``backend="inductor"`` exports the body with ``torch.export`` and compiles it;
    ``"eager"`` records the body's eager operations (``make_fx``: no dynamo, no compile
    step, for tests, debugging and machines without a C++ compiler) and replays them;
    ``"triton"``, the hand-written Triton kernels of 0.4, left the library: on an H100
    (2026-11-28, 64 x 4096) they took 1.008 ms against ``"inductor"``'s 0.735 ms, so the
    value is refused with that reason.
    Objectives without an analytic ``grad`` are refused (they have no fused body);
    double backward differentiates the reference definition, as :func:`policy_loss` does.

    Shapes: as :func:`policy_loss`. Returns a 0-dim tensor in the compute dtype.

    Example:
        >>> from dapo_ops import ClipHigher
        >>> loss_fn = CompiledPolicyLoss(ClipHigher(), backend="eager")
        >>> logp = torch.rand(4, 16).log().requires_grad_()  # log-probs: <= 0
        >>> mask = torch.rand(4, 16) > 0.3
        >>> loss_fn(logp, logp.detach(), torch.randn(4), mask).backward()
        >>> len(loss_fn.cache)  # one signature compiled
        1
    """

    objective: Objective
    mode: AggregationMode = "token_mean"
    max_len: int | None = None
    kl: KLPenalty | None = None
    backend: Literal["inductor", "eager"] = "inductor"
    cache: dict[Signature, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_objective_value(self.objective, "CompiledPolicyLoss.objective")
        if type(self.objective).grad is Objective.grad:
            raise InputError(
                f"CompiledPolicyLoss needs an objective with an analytic grad(); "
                f"{type(self.objective).__name__} has none (use policy_loss)"
            )
        check_option("CompiledPolicyLoss.mode", self.mode, AGGREGATION_MODES)
        check_max_len(self.max_len)
        if self.kl is not None and not isinstance(self.kl, KLPenalty):
            raise InputError(f"CompiledPolicyLoss.kl must be a KLPenalty or None, got {self.kl!r}")
        if self.backend == "triton":  # type: ignore[comparison-overlap]
            raise InputError(
                "CompiledPolicyLoss.backend='triton' was removed: its kernels were slower than "
                "'inductor' on an H100 (1.008 ms vs 0.735 ms at 64 x 4096); use "
                "backend='inductor' (the default)"
            )
        check_option("CompiledPolicyLoss.backend", self.backend, ("inductor", "eager"))

    @checks_values
    def __call__(
        self,
        logp: Float[Tensor, "batch seq"],
        old_logp: Float[Tensor, "batch seq"],
        advantages: Float[Tensor, " batch"] | Float[Tensor, "batch 1"] | Float[Tensor, "batch seq"],
        mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
        *,
        normalizer: Normalizer = None,
        ref_logp: Float[Tensor, "batch seq"] | None = None,
        is_weights: Float[Tensor, "batch seq"] | None = None,
        kl_weights: Float[Tensor, "batch seq"] | None = None,
    ) -> Float[Tensor, ""]:
        """The loss; see the class docstring."""
        given = check_normalizer(normalizer)  # cheap; the distributed rule included
        args = (logp, old_logp, advantages, mask, ref_logp, is_weights, kl_weights)
        key = _signature(args, given)
        kernel = self.cache.get(key)
        if kernel is None:
            kernel = self._build(args, normalizer, key)
        adv, valid, dtype = policy_tensors(logp, old_logp, advantages, mask)
        spec = LossSpec(self.objective, self.kl, self.mode, self.max_len)
        tensors = LossInputs(logp, old_logp, adv, valid, ref_logp, is_weights, kl_weights)
        den = None if given is None else torch.as_tensor(given, dtype=dtype, device=logp.device)
        return fused_loss(spec, tensors, den, _Body(kernel))

    def _build(
        self, args: tuple[Tensor | None, ...], normalizer: Normalizer, key: Signature
    ) -> Any:
        logp, old_logp, advantages, mask, ref_logp, is_weights, kl_weights = args
        assert logp is not None and old_logp is not None
        assert advantages is not None and mask is not None
        spec, tensors, den = prepare(
            self.objective, logp, old_logp, advantages, mask, mode=self.mode,
            normalizer=normalizer, max_len=self.max_len, ref_logp=ref_logp, kl=self.kl,
            is_weights=is_weights, compiled=False, kl_weights=kl_weights,
        )  # fmt: skip
        if (ref_logp is None) != (self.kl is None):
            raise InputError("ref_logp is needed exactly when CompiledPolicyLoss.kl is set")
        kernel = _compile(spec, tensors, den, self.backend)
        self.cache[key] = kernel
        return kernel


class _Body:
    """The engine's body (:func:`dapo_ops.engine._engine.eager_body`'s signature) over a kernel."""

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel

    def __call__(
        self, spec: LossSpec, tensors: LossInputs, normalizer: Tensor | None, with_grad: bool
    ) -> tuple[Tensor, Tensor | None]:
        inputs = _flat(tensors, normalizer)
        loss, grad = self.kernel(*inputs)
        return loss, (grad if with_grad else None)


def _flat(tensors: LossInputs, normalizer: Tensor | None) -> list[Tensor]:
    """The kernel's positional inputs, the absent optional tensors left out."""
    logp, old, adv, valid, *rest = tensors
    present = [t for t in rest if t is not None]
    tail = [] if normalizer is None else [normalizer]
    return [logp.detach(), old, adv, valid, *present, *tail]


def _signature(args: tuple[Tensor | None, ...], given: object) -> Signature:
    parts: list[Any] = []
    for i, t in enumerate(args):
        if t is None:
            parts.append(None)
        elif isinstance(t, Tensor):  # requires_grad: of the constants (refused), not logp
            parts.append((tuple(t.shape), t.dtype, t.stride(), i > 0 and t.requires_grad))
        else:
            parts.append(type(t))  # refused by the checks on the first call
    first = args[0]
    parts.append(first.device if isinstance(first, Tensor) else None)
    parts.append(given is not None)
    return tuple(parts)


def _compile(spec: LossSpec, tensors: LossInputs, den: Tensor | None, backend: str) -> Kernel:
    """Export the fused body on the example inputs (``torch.export``: traced once, as
    ``torch.compile`` would, with no guards kept) and compile it with inductor; or, for
    ``backend="eager"``, record its operations."""
    example = tuple(_flat(tensors, den))
    body = _FusedBody(spec, tensors)
    if backend == "eager":  # the body's eager operations, recorded (no dynamo, no compiler)
        from torch.fx.experimental.proxy_tensor import make_fx

        return make_fx(body)(*example)  # type: ignore[no-any-return]
    from torch._inductor.compile_fx import compile_fx

    graph = torch.export.export(body, example, strict=True).module()  # constants bound

    return compile_fx(graph, list(example))  # type: ignore[return-value]


class _FusedBody(torch.nn.Module):
    """The loss scale, the objective's term and gradient, IS weights and KL: the body of
    ``compiled=True`` (:mod:`dapo_ops.engine._compiled`) for one layout of the inputs."""

    def __init__(self, spec: LossSpec, tensors: LossInputs) -> None:
        super().__init__()
        self.spec = spec
        self.layout = [t is not None for t in tensors[4:]]
        self.dtype = compute_dtype(tensors.logp, tensors.old_logp, tensors.adv)

    def forward(self, *flat: Tensor) -> tuple[Tensor, Tensor]:
        spec, it = self.spec, iter(flat)
        logp, old, adv, valid = (next(it) for _ in range(4))
        ref, rho, kappa = (next(it) if here else None for here in self.layout)
        normalizer = next(it, None)
        den: Any = "local" if normalizer is None else normalizer
        mode: Any = spec.mode
        scale = loss_scale(valid, mode=mode, normalizer=den, max_len=spec.max_len, dtype=self.dtype)
        rows, grad = generic_terms(spec, logp, old, adv, valid, scale, ref, rho, True, kappa)
        assert grad is not None
        return scaled_sum(rows, scale), grad
