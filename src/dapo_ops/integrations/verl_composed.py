"""The steps of verl's losses that compose a token selection with an objective.

Each is the ``step`` of its row in :data:`dapo_ops.integrations.verl_losses.TWINS`
(registered as ``dapo_ops_<loss_mode>``); it reads verl 0.9.1's ``policy_loss`` options
as verl's own function does:

- ``clip_cov``: :func:`dapo_ops.clip_cov_candidates`, the subset drawn exactly as verl
  draws it (``torch.randperm`` over the candidates in row-major order, from the global
  RNG, so a seeded run selects the same tokens), then ``policy_loss(ClipHigher(
  clip_ratio_low, clip_ratio_high), ..., is_weights=keep * rho)``;
- ``kl_cov``: the covariance top-k selected as verl selects it (:func:`verl_top_cov`:
  the same ``torch.topk`` on the same values, so ties go where verl's go), then
  ``policy_loss(RatioSurrogate(), ..., is_weights=rho, kl=KLPenalty(ppo_kl_coef, "abs"),
  ref_logp=old_log_prob, kl_weights=selection * rho)``. (:func:`dapo_ops.kl_cov_mask`,
  the library's own selection, gives ties to the first token in row-major order.)

One difference from verl, as in every adapter: the token log-ratio is clamped to
``+-20`` before ``exp`` (verl's ``clip_cov``/``kl_cov`` do not clamp), so results agree
for ``|log r| <= 20``. Tested in ``tests/integration/test_verl_cov_losses.py`` and
``test_verl_differential.py``.

Example:
    >>> sorted(KL_COV_METRICS)
    ['actor/ppo_kl']
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch
from torch import Tensor

from dapo_ops._core._rules import magnitude
from dapo_ops._core._validate import InputError
from dapo_ops.correction.cov_masks import clip_cov_candidates, first_k
from dapo_ops.engine.kl import KLPenalty
from dapo_ops.integrations._verl_common import (
    Call,
    Metric,
    clip_range,
    kl_raw,
    policy_loss_option,
)
from dapo_ops.objectives.base import Objective, TokenInputs


def _fraction(call: Call, name: str) -> float:
    """``policy_loss.<name>`` (verl's default 0.0002), which verl requires to be > 0."""
    fraction = float(policy_loss_option(call.config, name, 0.0002))
    if not fraction > 0:
        raise InputError(f"policy_loss.{name} must be > 0, got {fraction}")
    return fraction


def verl_draw(candidates: Tensor, k: Tensor) -> Tensor:
    """verl's random subset: ``k`` of the candidates, the first ``k`` of
    ``torch.randperm(#candidates)`` over them in row-major order (global RNG, on the CPU
    as verl; a host sync, as verl). Draws nothing when there is no candidate."""
    flat = candidates.reshape(-1)
    where = flat.nonzero().squeeze(1)
    keys = torch.full(flat.shape, torch.inf, dtype=torch.float64, device=flat.device)
    if where.numel() > 0:
        perm = torch.randperm(where.numel())
        place = torch.empty_like(perm).scatter_(0, perm, torch.arange(where.numel()))
        keys[where] = place.to(device=flat.device, dtype=torch.float64)
    return first_k(candidates, keys.view(candidates.shape), k)


def verl_top_cov(log_prob: Tensor, advantages: Tensor, mask: Tensor, fraction: float) -> Tensor:
    """verl's ``kl_cov`` selection: the ``max(1, int(n * fraction))`` valid tokens with the
    largest ``(A - mean A)(logp - mean logp)``, computed on the CPU from the valid tokens in
    row-major order and picked by ``torch.topk`` as verl does (a host sync, as verl), so
    tied covariances select the same tokens; none when no token is valid."""
    valid = mask.reshape(-1)
    where = valid.nonzero().squeeze(1)
    adv = advantages.expand_as(log_prob).reshape(-1)[valid].detach().cpu()
    logp = log_prob.reshape(-1)[valid].detach().cpu()
    chosen = torch.zeros_like(valid)
    if where.numel() > 0:
        cov = (adv - adv.mean()) * (logp - logp.mean())
        k = min(max(1, int(len(cov) * fraction)), len(cov))
        top = torch.topk(cov, k, largest=True).indices
        chosen[where[top.to(where.device)]] = True
    return chosen.view(mask.shape)


def clip_cov_step(call: Call) -> Call:
    """``clip_cov``: draw the tokens to drop as verl does; weight the kept ones by rho."""
    low, high = clip_range(call.config)
    candidates, k = clip_cov_candidates(
        call.log_prob, call.old_log_prob, call.advantages, call.mask, eps_low=low,
        eps_high=high, cov_low=float(policy_loss_option(call.config, "clip_cov_lb", 1.0)),
        cov_high=float(policy_loss_option(call.config, "clip_cov_ub", 5.0)),
        fraction=min(_fraction(call, "clip_cov_ratio"), 1.0), log_ratio_clamp=20.0,
    )  # fmt: skip
    selection = verl_draw(candidates, k)
    keep = (~selection).to(call.log_prob.dtype)
    weights = keep if call.is_weights is None else keep * call.is_weights
    return call._replace(is_weights=weights, selection=selection)


def kl_cov_step(call: Call) -> Call:
    """``kl_cov``: verl's top-k tokens get ``ppo_kl_coef * |log r|`` (times rho)."""
    fraction = _fraction(call, "kl_cov_ratio")
    coef = float(policy_loss_option(call.config, "ppo_kl_coef", 1.0))
    selection = verl_top_cov(call.log_prob, call.advantages, call.mask, fraction)
    if coef == 0:
        return call._replace(selection=selection)
    kappa = selection.to(call.log_prob.dtype)
    if call.is_weights is not None:
        kappa = kappa * call.is_weights
    penalty = {
        "kl": KLPenalty(beta=coef, estimator="abs"),
        "ref_logp": call.old_log_prob.detach(),
        "kl_weights": kappa,
    }
    return call._replace(selection=selection, options=penalty)


def _selected(objective: Objective, x: TokenInputs, call: Call) -> Tensor:
    assert call.selection is not None
    return call.selection


def _abs_log_ratio(objective: Objective, x: TokenInputs, call: Call) -> Tensor:
    return magnitude(x.log_ratio)  # gradient sign(log r), 0 at 0 (as verl's abs)


#: verl's ``clip_cov`` metrics: the dropped fraction and the (unclamped) k1.
CLIP_COV_METRICS: Mapping[str, Metric] = MappingProxyType(
    {"actor/pg_clipfrac": _selected, "actor/ppo_kl": kl_raw}
)
#: verl's ``kl_cov`` metric: its ``actor/ppo_kl`` is the mean ``|log r|``.
KL_COV_METRICS: Mapping[str, Metric] = MappingProxyType({"actor/ppo_kl": _abs_log_ratio})
