r"""``CompiledPolicyLoss(backend="triton")``: the loss from log-probs in one Triton kernel
forward and one backward.

Private. On a GPU this loss is launch-bound (issue 30: 5 kernels and 0.48 ms at
``512 x 8192`` where moving the bytes takes 18 us), so the step is cut to the fewest
launches that keep the result exact and deterministic:

- **forward** (:func:`loss_forward`, one kernel): program ``(row, chunk)`` reads
  ``BLOCK`` tokens' ``logp``, ``old_logp``, advantage, mask (and ``ref_logp``, IS and KL
  weights), computes the objective's term and ``u = d term / d logp`` (times ``rho``,
  plus ``beta kappa`` times the KL estimate and its slope: the formulas of
  :meth:`~dapo_ops.objectives.Objective.term` / :meth:`~dapo_ops.objectives.Objective.grad`
  and :class:`~dapo_ops.KLPenalty`), writes ``u`` (0 at masked positions) and the chunk's
  loss sum and token count. The last program to finish, found by a ticket counter,
  reduces the chunk sums *in a fixed order* (the same bits every run, no float atomics),
  forms :func:`~dapo_ops.loss_scale`'s weights ``w`` (the local count, an integer or a
  tensor normaliser) and writes the loss ``sum_i w_i S_i`` and ``w``; then it resets the
  counter for the next call.
- **backward** (:func:`loss_backward`, one kernel): ``d loss / d logp = u w g`` for the
  incoming gradient ``g``, in ``logp``'s dtype.

With autograd's seed of the incoming gradient (``loss.backward()``), a fwd+bwd step is
three launches. The weights wait for the backward (``u`` is stored before the count is
known), which is why the backward is a kernel of its own rather than a view of a buffer.
``create_graph=True`` differentiates the definition, as the other backends do.

The counter is one ``int32`` per device and stream, allocated (zeroed) once and kept by the
:class:`~dapo_ops.CompiledPolicyLoss` object; calls on one stream are ordered, so they never
share it at once. Inputs need a unit stride along ``seq`` (others are copied first).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from dapo_ops._core._rules import AGGREGATION_MODES, compute_dtype
from dapo_ops._core._triton import interpreting, launch_options, load_kernels
from dapo_ops._core._validate import InputError, is_compiling
from dapo_ops.engine._engine import LossInputs, LossSpec, definition_grad, fused_loss
from dapo_ops.engine.kl import KL_ESTIMATORS, KLPenalty
from dapo_ops.objectives import (
    CISPO,
    DPPO,
    DRO,
    SAPO,
    TOPR,
    ClipHigher,
    Objective,
    PolicyGradient,
    RatioSurrogate,
)

#: The objectives with a Triton term: kernel number and parameters (``p0..p3``) per type.
#: Exact types only: a subclass may change ``term``.
OBJECTIVES: dict[type[Objective], Callable[[Any], tuple[int, tuple[float, ...]]]] = {
    ClipHigher: lambda o: (
        0,
        (1.0 - o.eps_low, o.dual_clip or math.inf, 1.0 + o.eps_high, -math.inf),
    ),
    PolicyGradient: lambda o: (1, ()),
    RatioSurrogate: lambda o: (2, ()),
    CISPO: lambda o: (3, (1.0 - o.eps_low, 1.0 + o.eps_high)),
    TOPR: lambda o: (4, (o.pos_coef, o.neg_coef)),
    DRO: lambda o: (5, (o.beta,)),
    SAPO: lambda o: (6, (o.tau_pos, o.tau_neg)),
    DPPO: lambda o: (7 if o.divergence == "tv" else 8, (o.delta_low, o.delta_high, o.is_cap, 1e-8)),
}


def check_triton_objective(objective: Objective) -> None:
    """Refuse an objective the kernels have no term for, naming the ones they have."""
    if type(objective) not in OBJECTIVES:
        names = ", ".join(t.__name__ for t in OBJECTIVES)
        raise InputError(
            f"CompiledPolicyLoss(backend='triton') has a Triton term for the token-local "
            f"objectives {names}; {type(objective).__name__} has none (use backend='inductor')"
        )


def _blocks(dtype: torch.dtype) -> tuple[int, int, int]:
    """(tokens per program, rows per block of the final reduction, warps): small under
    the interpreter, so that tests cross chunk and row-block edges; on a GPU the largest
    token blocks whose kernels compile for ``sm_90`` without spilling registers
    (tests/test_triton_compile.py): 1024 tokens on 8 warps, 512 on 4 in float64."""
    if interpreting():
        return 8, 4, 4
    return (512, 1024, 4) if dtype == torch.float64 else (1024, 1024, 8)


def _row_unit(t: Tensor | None) -> Tensor | None:
    return t if t is None or t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


class TritonLoss:
    """The kernels of one :class:`~dapo_ops.engine._engine.LossSpec` and input layout:
    parameters on the device in the compute dtype, made once, and the ticket counters."""

    def __init__(self, spec: LossSpec, tensors: LossInputs) -> None:
        check_triton_objective(spec.objective)
        logp, old, adv = tensors.logp, tensors.old_logp, tensors.adv
        self.dtype = compute_dtype(logp, old, adv)
        obj, params = OBJECTIVES[type(spec.objective)](spec.objective)
        kl: KLPenalty | None = spec.kl
        prm = [*params, *(0.0,) * (4 - len(params))]
        prm += [kl.beta, kl.log_ratio_clamp, kl.clamp or 0.0] if kl else [0.0] * 3
        seq = logp.shape[-1]
        prm += [
            spec.objective.log_ratio_clamp,
            max(seq, 1) if spec.max_len is None else spec.max_len,
        ]
        self.params = torch.tensor(prm, dtype=self.dtype, device=logp.device)
        self.meta: dict[str, Any] = {
            "OBJ": obj,
            "KL": 0 if kl is None else 1 + KL_ESTIMATORS.index(kl.estimator),
            "KL_ST": bool(kl and kl.straight_through),
            "KL_CAP": bool(kl and kl.clamp is not None),
            "HAS_RHO": tensors.is_weights is not None,
            "HAS_KAPPA": tensors.kl_weights is not None,
            "MODE": AGGREGATION_MODES.index(spec.mode),
        }
        self.counters: dict[int, Tensor] = {}
        self.kernels = load_kernels("dapo_ops.engine._triton_loss_kernels", interpreting())

    def _counter(self, device: torch.device) -> Tensor:
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        counter = self.counters.get(stream)
        if counter is None:
            counter = self.counters[stream] = torch.zeros(1, dtype=torch.int32, device=device)
        return counter

    def forward(
        self, tensors: LossInputs, normalizer: object, with_grad: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(loss, u, w)``: the 0-dim loss, ``u [batch, seq]`` and the weights ``w``
        (``[batch]`` for ``seq_mean_token_mean``, else ``[1]``)."""
        logp, old, adv, valid, ref, rho, kappa = (_row_unit(t) for t in tensors)
        assert logp is not None and old is not None and adv is not None and valid is not None
        batch, seq = logp.shape
        block, rows, warps = _blocks(self.dtype)
        chunks = max(-(-seq // block), 1)
        n = batch * chunks
        dev, dt = logp.device, self.dtype
        u = torch.empty((batch, seq) if with_grad else (0,), dtype=dt, device=dev)
        part = torch.empty(n, dtype=dt, device=dev)
        count = torch.empty(n, dtype=torch.int32, device=dev)
        loss = torch.empty((), dtype=dt, device=dev)
        per_row = self.meta["MODE"] == 1
        w = torch.empty(batch if per_row else 1, dtype=dt, device=dev)
        den, den_int, den_kind = _normalizer(normalizer, dt, dev)
        tl = self.kernels.tl
        ks = self.kernels
        ks.loss_forward[(n,)](
            logp, old, adv, valid.view(torch.uint8), ref if ref is not None else logp,
            rho if rho is not None else logp, kappa if kappa is not None else logp,
            self.params, den if den is not None else self.params,
            u, part, count, self._counter(dev), loss, w,
            seq, chunks, n, logp.stride(0), old.stride(0), adv.stride(0),
            0 if adv.shape[-1] == 1 else adv.stride(-1), valid.stride(0),
            0 if ref is None else ref.stride(0), 0 if rho is None else rho.stride(0),
            0 if kappa is None else kappa.stride(0), den_int,
            **self.meta, DEN=den_kind, WITH_GRAD=with_grad,
            COMPUTE=tl.float64 if dt == torch.float64 else tl.float32, BLOCK=block, RB=rows,
            **launch_options(warps),
        )  # fmt: skip
        return loss, u, w

    def backward(self, u: Tensor, w: Tensor, grad_out: Tensor, dtype: torch.dtype) -> Tensor:
        """``d loss / d logp`` in ``dtype``: ``u * w * grad_out``, one kernel."""
        batch, seq = u.shape
        block, _, warps = _blocks(u.dtype)
        chunks = max(-(-seq // block), 1)
        # Triton's interpreter (3.6 to 3.9) rounds float32 -> bfloat16 toward zero: torch casts
        wide = interpreting() and dtype == torch.bfloat16
        out = torch.empty((batch, seq), dtype=u.dtype if wide else dtype, device=u.device)
        tl = self.kernels.tl
        self.kernels.loss_backward[(batch * chunks,)](
            u, w, grad_out, out, seq, chunks, out.stride(0), PER_ROW=int(self.meta["MODE"] == 1),
            COMPUTE=tl.float64 if u.dtype == torch.float64 else tl.float32, BLOCK=block,
            **launch_options(warps),
        )  # fmt: skip
        return out.to(dtype) if wide else out


def _normalizer(
    given: object, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor | None, int, int]:
    """``(tensor, integer, kind)`` for the kernel: kind 0 the local count, 1 a whole number
    passed as an integer argument (no copy to the device), 2 a 0-dim tensor."""
    if given is None:
        return None, 0, 0
    if isinstance(given, Tensor):
        return given, 0, 2
    value = float(given)  # type: ignore[arg-type]
    if value.is_integer() and value < 2**31:
        return None, int(value), 1
    return torch.as_tensor(given, dtype=dtype, device=device), 0, 2


class _TritonLossFn(torch.autograd.Function):
    """The loss with ``u`` and ``w`` saved for the backward kernel."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logp: Tensor, spec: LossSpec, rest: tuple[Tensor | None, ...],
        normalizer: object, kernel: TritonLoss,
    ) -> Tensor:  # fmt: skip
        loss, u, w = kernel.forward(LossInputs._make((logp, *rest)), normalizer, True)
        ctx.spec, ctx.kernel = spec, kernel
        ctx.number = None if isinstance(normalizer, Tensor) else normalizer
        given = (*rest, normalizer if isinstance(normalizer, Tensor) else None)
        ctx.layout = [t is not None for t in given]
        # the inputs are saved too (no memory): torch then refuses an in-place change of
        # any of them between forward and backward, as for the other backends
        ctx.save_for_backward(logp, u, w, *(t for t in given if t is not None))
        return loss

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        logp, u, w, *present = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: differentiate the definition
            it = iter(present)
            *rest, den = (next(it) if here else None for here in ctx.layout)
            if ctx.number is not None:
                den = torch.as_tensor(ctx.number, dtype=u.dtype, device=u.device)
            g = definition_grad(ctx.spec, LossInputs._make((logp, *rest)), den, grad_out)
            return g, None, None, None, None
        return ctx.kernel.backward(u, w, grad_out, logp.dtype), None, None, None, None


def triton_loss(
    spec: LossSpec, tensors: LossInputs, normalizer: object, kernel: TritonLoss
) -> Tensor:
    """The 0-dim loss of checked inputs on the kernels (``normalizer``: as
    :func:`~dapo_ops.engine.aggregation.check_normalizer` returns it)."""
    logp = tensors.logp
    if is_compiling():
        raise InputError(
            "CompiledPolicyLoss(backend='triton') runs eagerly only; under torch.compile "
            "use backend='inductor' or policy_loss"
        )
    device = logp.device
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        raise InputError(
            "CompiledPolicyLoss(backend='triton') needs CUDA tensors (or CPU tensors under "
            f"Triton's interpreter, TRITON_INTERPRET=1); got tensors on {device}"
        )
    if logp.shape[0] == 0:  # no program would run: the engine's eager path
        den = None
        if normalizer is not None:
            den = torch.as_tensor(normalizer, dtype=kernel.dtype, device=device)
        return fused_loss(spec, tensors, den)
    if not (torch.is_grad_enabled() and logp.requires_grad):
        return kernel.forward(tensors, normalizer, False)[0]
    return _TritonLossFn.apply(logp, spec, tensors[1:], normalizer, kernel)  # type: ignore[no-any-return,no-untyped-call]
