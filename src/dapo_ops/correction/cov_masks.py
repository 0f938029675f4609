"""Token selections by the covariance of advantage and log-prob: Clip-Cov and KL-Cov.

Cui et al. 2025 ("The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models") find that the policy's entropy falls with the covariance of a token's advantage and
its log-prob, and control it on the few tokens where that covariance is largest: Clip-Cov
stops their gradient (:func:`clip_cov_mask`), KL-Cov penalises their :math:`|\\log r|`
(:func:`kl_cov_mask`); verl 0.9.1's ``loss_mode="clip_cov"`` and ``"kl_cov"``. Each
returns a bool ``[batch, seq]`` selection that the loss composes through
:func:`dapo_ops.policy_loss` (``is_weights=`` / ``kl_weights=``). No host sync.

Both depend on the batch they see (the means over its valid tokens, its token count, a
random draw): unlike every other dapo_ops objective, a loss built on them is not invariant
to how a mini-batch is split into micro-batches.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._checked import checks_values
from dapo_ops._core._inputs import policy_tensors
from dapo_ops._core._rules import masked
from dapo_ops._core._validate import InputError, check_real, check_same_device
from dapo_ops.objectives.clip_higher import ClipHigher

#: verl's clip for ``loss_mode="clip_cov"``: ``clip_ratio`` 0.2 on both sides.
VERL_CLIP = ClipHigher(eps_low=0.2, eps_high=0.2)


def _fraction(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{name} must be a number in (0, 1], got {value!r}")
    if not 0.0 < value <= 1.0:
        raise InputError(f"{name} must lie in (0, 1], got {value}")
    return float(value)


def _selection_size(valid: Tensor, fraction: float) -> Tensor:
    """``max(1, floor(fraction * n))`` for the ``n`` valid tokens, as verl (a tensor)."""
    n = valid.sum().to(torch.float64)
    return torch.floor(n * fraction).clamp(min=1).to(torch.int64)


def _token_cov(logp: Tensor, adv: Tensor, valid: Tensor, dtype: torch.dtype) -> Tensor:
    """``(A - mean A) (logp - mean logp)`` with the means over the valid tokens; masked
    entries are whatever the arithmetic gives (the callers mask them)."""
    a = adv.to(dtype).expand(valid.shape)
    lp = logp.detach().to(dtype)
    n = valid.sum().to(dtype)
    n = torch.where(n > 0, n, 1.0)
    return (a - masked(valid, a).sum() / n) * (lp - masked(valid, lp).sum() / n)


def _rank(keys: Tensor, *, descending: bool) -> Tensor:
    """Each entry's place in the stable sort of the flattened ``keys`` (ties: the first
    in row-major order first), shaped as ``keys``."""
    flat = keys.reshape(-1)
    order = torch.sort(flat, descending=descending, stable=True).indices
    places = torch.arange(flat.numel(), device=flat.device)
    return torch.empty_like(places).scatter_(0, order, places).view(keys.shape)


def clip_cov_candidates(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float,
    eps_high: float,
    cov_low: float,
    cov_high: float,
    fraction: float,
    log_ratio_clamp: float,
) -> tuple[Tensor, Tensor]:
    """The tokens :func:`clip_cov_mask` draws from and how many it draws (a tensor)."""
    adv, valid, dtype = policy_tensors(logp, old_logp, advantages, mask)
    for name, t in (("old_logp", old_logp), ("advantages", advantages), ("mask", mask)):
        check_same_device(name, t, "logp", logp)
    eps_low, eps_high = check_real("eps_low", eps_low), check_real("eps_high", eps_high)
    if not 0.0 <= eps_low < 1.0:
        raise InputError(f"eps_low must lie in [0, 1), got {eps_low}")
    if eps_high < 0.0:
        raise InputError(f"eps_high must be >= 0, got {eps_high}")
    fraction = _fraction("fraction", fraction)
    for name, bound in (("cov_low", cov_low), ("cov_high", cov_high)):
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or math.isnan(bound):
            raise InputError(f"{name} must be a number (not NaN), got {bound!r}")
    if not (isinstance(log_ratio_clamp, (int, float)) and 0 < log_ratio_clamp < math.inf):
        raise InputError(f"log_ratio_clamp must be finite and > 0, got {log_ratio_clamp!r}")
    a = adv.to(dtype)
    log_ratio = (logp.detach().to(dtype) - old_logp.to(dtype)).clamp(
        -log_ratio_clamp, log_ratio_clamp
    )
    ratio = log_ratio.exp()
    clipped = -a * ratio.clamp(1.0 - eps_low, 1.0 + eps_high) > -a * ratio
    cov = _token_cov(logp, adv, valid, dtype)
    candidates = valid & ~clipped & (cov > cov_low) & (cov < cov_high)
    return candidates, _selection_size(valid, fraction)


@checks_values
def clip_cov_mask(
    logp: Float[Tensor, "batch seq"],
    old_logp: Float[Tensor, "batch seq"],
    advantages: Float[Tensor, " batch"] | Float[Tensor, "batch 1"] | Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    objective: ClipHigher = VERL_CLIP,
    fraction: float = 2e-4,
    cov_low: float = 1.0,
    cov_high: float = 5.0,
    generator: torch.Generator | None = None,
) -> Bool[Tensor, "batch seq"]:
    r"""Clip-Cov: a random few of the tokens whose advantage and log-prob covary strongly.

    Candidates are the valid tokens that PPO's clip leaves alone
    (:math:`-A\,\mathrm{clip}(r, 1-\varepsilon_{low}, 1+\varepsilon_{high}) \le -A r`)
    and whose centred covariance lies strictly inside ``(cov_low, cov_high)``:

    .. math::

        c_{i,t} = (A_{i,t} - \bar A)\,(\log\pi_\theta(y_{i,t}) - \overline{\log\pi_\theta})

    (the means over the valid tokens of *this call*, ``logp`` detached). Of the candidates,
    :math:`k = \max(1, \lfloor \text{fraction} \cdot n \rfloor)` (``n`` valid tokens) are
    drawn uniformly at random without replacement (all of them when there are fewer).
    Cui et al. 2025 ("The Entropy Mechanism of RL for Reasoning LMs") show the entropy of
    the policy falls with this covariance and stop the gradient of these tokens:
    ``policy_loss(objective, ..., is_weights=(~selection).to(dtype) * rho)`` (their loss is 0, they still count in the normaliser), verl's
    ``loss_mode="clip_cov"``.

    The selection depends on the batch it sees (the means, ``n``, the random draw): unlike
    every other dapo_ops objective, a loss built on it is **not** invariant to how a
    mini-batch is split into micro-batches (verl draws per micro-batch too).

    ``generator`` draws the subset (one ``torch.rand`` of ``[batch, seq]`` keys; the
    global RNG when None), so a seeded generator reproduces it; it must live on
    ``logp``'s device. Under ``torch.compile`` pass ``generator=None`` (dynamo cannot trace
    a Generator object). No host sync. ``objective`` is the loss the selection goes with:
    its ``eps_low``, ``eps_high`` define the clip and its ``log_ratio_clamp`` bounds the
    log-ratio before ``exp`` (the clip decision is the same as on the unclamped ratio).
    With a non-finite log-prob or advantage at a valid token the covariance is not
    finite and no candidate survives the bounds, or the draw is among inf covariances.

    Shapes: ``[batch, seq]``; advantages ``[batch]``, ``[batch, 1]`` or ``[batch, seq]``.
    Returns bool ``[batch, seq]``, False at masked positions.

    Defaults are verl's (``clip_ratio`` 0.2: ``ClipHigher(eps_low=0.2, eps_high=0.2)``,
    ``policy_loss.clip_cov_ratio`` 2e-4,
    ``clip_cov_lb`` 1.0, ``clip_cov_ub`` 5.0).

    Example:
        >>> logp = torch.tensor([[-1.0, -3.0, -0.5, -2.0]])
        >>> adv = torch.tensor([[2.0, -1.0, 2.0, 0.0]])
        >>> clip_cov_mask(logp, logp, adv, torch.ones(1, 4, dtype=torch.bool), cov_low=0.5,
        ...               generator=torch.Generator().manual_seed(0))
        tensor([[False, False,  True, False]])
    """
    if not isinstance(objective, ClipHigher):
        raise InputError(
            "objective must be a ClipHigher (its eps_low, eps_high and log_ratio_clamp define "
            f"the clip), got {objective!r}"
        )
    candidates, k = clip_cov_candidates(
        logp, old_logp, advantages, mask, eps_low=objective.eps_low,
        eps_high=objective.eps_high, cov_low=cov_low, cov_high=cov_high, fraction=fraction,
        log_ratio_clamp=objective.log_ratio_clamp,
    )  # fmt: skip
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise InputError(f"generator must be a torch.Generator or None, got {generator!r}")
        if not _same_device(generator.device, logp.device):
            raise InputError(
                f"generator is on {generator.device} but logp is on {logp.device}; pass a "
                "torch.Generator of logp's device"
            )
    keys = torch.rand(
        candidates.shape, generator=generator, device=logp.device, dtype=torch.float64
    )
    return first_k(candidates, keys, k)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """The same device, where ``cuda`` without an index is the current one
    (``torch.Generator(device="cuda")`` has none; a tensor made there has one)."""

    def index(d: torch.device) -> int | None:
        if d.index is None and d.type == "cuda":
            return torch.cuda.current_device()
        return d.index

    return a.type == b.type and index(a) == index(b)


def first_k(candidates: Tensor, keys: Tensor, k: Tensor) -> Tensor:
    """The ``k`` candidates with the smallest ``keys`` (all of them when fewer)."""
    rank = _rank(torch.where(candidates, keys, torch.inf), descending=False)
    return candidates & (rank < k)


@checks_values
def kl_cov_mask(
    logp: Float[Tensor, "batch seq"],
    advantages: Float[Tensor, " batch"] | Float[Tensor, "batch 1"] | Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    fraction: float = 2e-4,
) -> Bool[Tensor, "batch seq"]:
    r"""KL-Cov: the valid tokens with the largest covariance of advantage and log-prob.

    Selects the :math:`k = \max(1, \lfloor \text{fraction} \cdot n \rfloor)` valid tokens
    (``n`` of them) with the largest

    .. math::

        c_{i,t} = (A_{i,t} - \bar A)\,(\log\pi_\theta(y_{i,t}) - \overline{\log\pi_\theta})

    (the means over the valid tokens of *this call*, ``logp`` detached; ties go to the
    first in row-major order, NaN covariances last). Cui et al. 2025 ("The Entropy
    Mechanism of RL for Reasoning LMs") penalise these tokens' :math:`|\log r|`; verl's
    ``loss_mode="kl_cov"`` is ``policy_loss(RatioSurrogate(), logp, old_logp, A, mask,
    is_weights=rho, ref_logp=old_logp, kl=KLPenalty(beta=coef, estimator="abs"),
    kl_weights=selection.to(dtype) * rho)``.

    The selection depends on the batch it sees (the means, ``n``): unlike every other
    dapo_ops objective, a loss built on it is **not** invariant to how a mini-batch is
    split into micro-batches (verl selects per micro-batch too). No host sync.

    Shapes: ``[batch, seq]``; advantages ``[batch]``, ``[batch, 1]`` or ``[batch, seq]``.
    Returns bool ``[batch, seq]``, False at masked positions.

    Defaults: ``fraction=2e-4`` is verl's ``policy_loss.kl_cov_ratio``.

    Example:
        >>> logp = torch.tensor([[-1.0, -3.0, -0.5, -2.0]])
        >>> adv = torch.tensor([[2.0, -1.0, 2.0, 0.0]])
        >>> kl_cov_mask(logp, adv, torch.ones(1, 4, dtype=torch.bool), fraction=0.5)
        tensor([[False,  True,  True, False]])
    """
    adv, valid, dtype = policy_tensors(logp, logp, advantages, mask, names=("logp", "logp"))
    check_same_device("advantages", advantages, "logp", logp)
    check_same_device("mask", mask, "logp", logp)
    k = _selection_size(valid, _fraction("fraction", fraction))
    cov = _token_cov(logp, adv, valid, dtype)
    keys = torch.where(valid & ~torch.isnan(cov), cov, -torch.inf)
    return valid & (_rank(keys, descending=True) < k)
