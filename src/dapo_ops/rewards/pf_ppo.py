"""PF-PPO: resample the batch towards the responses whose reward is most reliable."""

from __future__ import annotations

from typing import Literal

import torch
from jaxtyping import Float, Integer
from torch import Tensor

from dapo_ops._core._validate import (
    InputError,
    check_float,
    check_ndim,
    check_option,
    check_real,
)

__all__ = ["PF_PPO_METHODS", "PFMethod", "pf_ppo_resample", "pf_ppo_weights"]

PFMethod = Literal["pow", "max_min", "max_random"]
PF_PPO_METHODS: tuple[str, ...] = ("pow", "max_min", "max_random")

#: verl's floor, so that a batch whose weights are all 0 still samples (uniformly).
WEIGHT_FLOOR = 1e-8


def pf_ppo_weights(
    scores: Float[Tensor, " batch"],
    *,
    method: PFMethod = "pow",
    weight_pow: float = 2.0,
) -> Float[Tensor, " batch"]:
    r"""PF-PPO's sampling weight of each response, from its sequence score.

    ============  =====================================================================
    method        weight :math:`w_i`
    ============  =====================================================================
    ``pow``       :math:`|s_i|^{p}` (``p = weight_pow``): extreme rewards, which a reward
                  model gets right most often, are drawn most
    ``max_min``   1 for the batch's highest and lowest scores, 0 otherwise
    ``max_random`` 0.4 for the highest score, 0.1 otherwise
    ============  =====================================================================

    Shen et al. 2024, "Policy Filtration in RLHF to Fine-Tune LLM for Code Generation"
    (PF-PPO, arXiv:2409.06957). Defaults: verl 0.9.1's ``algorithm.pf_ppo``
    (``reweight_method="pow"``, ``weight_pow=2.0``). The scores are one per response
    (verl sums ``token_level_scores`` over the response); a NaN score gives a NaN weight
    (``pow``) or makes every weight NaN (``max_*``), and :func:`pf_ppo_resample` refuses it.

    Example:
        >>> pf_ppo_weights(torch.tensor([1.0, -2.0, 0.5]))
        tensor([1.0000, 4.0000, 0.2500])
    """
    check_float("scores", scores)
    check_ndim("scores", scores, 1, "[batch]")
    check_option("method", method, PF_PPO_METHODS)
    p = check_real("weight_pow", weight_pow)
    if method == "pow":
        return scores.abs().pow(p)
    if scores.numel() == 0:
        return scores.clone()
    best = scores.amax()  # NaN when any score is NaN: then every weight is NaN
    if method == "max_min":
        w = torch.where((scores == best) | (scores == scores.amin()), 1.0, 0.0)
    else:
        w = torch.where(scores == best, 0.4, 0.1)
    return torch.where(torch.isnan(best), torch.nan, w).to(scores.dtype)


def pf_ppo_resample(
    scores: Float[Tensor, " batch"],
    *,
    method: PFMethod = "pow",
    weight_pow: float = 2.0,
    generator: torch.Generator | None = None,
) -> Integer[Tensor, " batch"]:
    r"""Indices of a PF-PPO resampled batch: ``batch`` draws with replacement, each row
    drawn with probability proportional to ``pf_ppo_weights(scores) + 1e-8``.

    Index every per-response tensor with the result (``batch[idx]``) before the policy
    update; responses with extreme scores appear several times, the others may vanish.
    The ``1e-8`` floor is verl's (an all-zero batch is drawn uniformly). Seeded by
    ``generator``, else by torch's global generator: the same seed and the same weights
    give verl's indices. The weights are checked on the host (one host sync): a NaN or inf
    weight raises ``InputError``. An empty batch gives an empty result.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> pf_ppo_resample(torch.tensor([0.0, 0.0, 3.0]), generator=g)
        tensor([2, 2, 2])
    """
    if generator is not None and not isinstance(generator, torch.Generator):
        raise InputError(f"generator must be a torch.Generator or None, got {generator!r}")
    weights = pf_ppo_weights(scores, method=method, weight_pow=weight_pow)
    n = scores.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.long, device=scores.device)
    w = torch.clamp(weights + WEIGHT_FLOOR, min=WEIGHT_FLOOR)
    if not bool(torch.isfinite(w).all()):
        raise InputError("scores give a NaN or infinite PF-PPO weight; check the rewards")
    return torch.multinomial(w, n, replacement=True, generator=generator)
