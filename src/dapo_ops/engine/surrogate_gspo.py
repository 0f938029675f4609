"""GSPO's sequence ratio and per-token loss as plain autograd functions (:class:`GSPO`)."""

from __future__ import annotations

from einops import rearrange
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._checked import checks_values
from dapo_ops._core._inputs import policy_tensors
from dapo_ops._core._validate import check_no_grad
from dapo_ops.engine.surrogate import per_token_loss
from dapo_ops.objectives import GSPO
from dapo_ops.objectives.base import token_inputs

#: GSPO's sequence ratio is a geometric mean, so its log is clamped tighter than a token
#: ratio's (verl clamps it at 10 as well, from above only): exp(10) = 2.2e4 bounds it.
SEQUENCE_LOG_RATIO_CLAMP = 10.0


@checks_values
def gspo_sequence_ratio(
    logp: Float[Tensor, "batch seq"],
    old_logp: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
) -> Float[Tensor, " batch"]:
    r"""GSPO's sequence importance ratio: the geometric mean of the token ratios.

    .. math::

        s_i = \Big(\frac{\pi_\theta(y_i|x)}{\pi_{old}(y_i|x)}\Big)^{1/|y_i|}
            = \exp\Big(\frac{1}{|y_i|}\sum_{t} m_{i,t}\,(\log\pi_\theta - \log\pi_{old})\Big)

    over valid tokens (token log-ratios clamped to +-20 first); 1 for a sequence with no
    valid token. The mean log-ratio is clamped to +-10 before ``exp``. Differentiable in
    ``logp`` (the gradient is ``s_i / |y_i|`` per valid token): :meth:`GSPO.mean_log_ratio`,
    exponentiated. ``old_logp`` is a constant: one that requires grad raises ``InputError``.

    Shapes: ``[batch, seq]`` inputs; returns ``[batch]`` float32 (float64 for float64).

    Example:
        >>> lp = torch.log(torch.tensor([[0.5, 0.2]]))
        >>> old = lp - torch.log(torch.tensor([[4.0, 1.0]]))  # token ratios 4 and 1
        >>> gspo_sequence_ratio(lp, old, torch.ones(1, 2, dtype=torch.bool))
        tensor([2.])
    """
    check_no_grad("old_logp", old_logp)
    objective = GSPO(seq_log_ratio_clamp=SEQUENCE_LOG_RATIO_CLAMP)
    _, valid, dtype = policy_tensors(logp, old_logp, None, mask)
    zero_adv = logp.new_zeros(logp.shape[0], 1)
    x = token_inputs(objective, logp, old_logp, zero_adv, valid, dtype, reference=True)
    return rearrange(objective.mean_log_ratio(x).exp(), "batch 1 -> batch")


@checks_values
def gspo_surrogate(
    logp: Float[Tensor, "batch seq"],
    old_logp: Float[Tensor, "batch seq"],
    advantages: Float[Tensor, " batch"] | Float[Tensor, "batch 1"] | Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> Float[Tensor, "batch seq"]:
    r"""GSPO loss per token (GSPO-token form): ``per_token_loss(GSPO(eps_low, eps_high))``.

    Every valid token of sequence ``i`` carries the value of the sequence loss
    :math:`-\min(s_iA_i, \mathrm{clip}(s_i)A_i)` and gradient :math:`-s_i A_i` (0 when
    the sequence is clipped), so ``token_level_aggregate(..., mode="seq_mean_token_mean")``
    gives exactly GSPO's objective and gradient. See :class:`GSPO` (and its
    ``verl_clamp`` option for verl's clamp).

    Shapes: logp, old_logp, mask ``[batch, seq]``; advantages ``[batch]`` or ``[batch, 1]``
    (one per sequence), or ``[batch, seq]`` (each token's own, as GAE or per-token shaping
    gives: token ``t`` carries ``-A_t s_i``, clipped by the sign of ``A_t``, as verl's
    ``gspo``). Returns ``[batch, seq]``, 0 at masked positions.

    Defaults: ``eps_low=3e-4, eps_high=4e-4`` from the GSPO paper. verl:
    ``policy_loss.loss_mode="gspo"``.

    Example:
        >>> lp = torch.zeros(1, 3)
        >>> gspo_surrogate(lp, lp, torch.tensor([2.0]), torch.tensor([[1, 1, 0]]))
        tensor([[-2., -2.,  0.]])
    """
    return per_token_loss(
        GSPO(eps_low=eps_low, eps_high=eps_high), logp, old_logp, advantages, mask
    )
