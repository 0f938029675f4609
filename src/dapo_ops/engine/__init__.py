"""The engine: ``policy_loss`` and its fused and compiled paths, the KL penalty (in the loss and in the reward), the value loss, the entropy bonus, the aggregation modes and the distributed normaliser.

This package's face: it only re-exports; the code lives in its modules."""

from dapo_ops.engine.aggregation import PartialLoss, aggregate_partial, token_level_aggregate
from dapo_ops.engine.compiled_loss import CompiledPolicyLoss
from dapo_ops.engine.distill import TeacherKL, distill_advantages, distill_loss
from dapo_ops.engine.distributed import global_normalizer
from dapo_ops.engine.entropy import EntropyCoef, adaptive_entropy_coef, entropy_bonus
from dapo_ops.engine.iw_opd import iw_opd_weights
from dapo_ops.engine.kl import KLPenalty, kl_penalty
from dapo_ops.engine.kl_reward import KLReward, adaptive_kl_coef, kl_reward
from dapo_ops.engine.loss import token_level_loss
from dapo_ops.engine.policy import policy_loss, policy_loss_with_diagnostics
from dapo_ops.engine.prompt_mean import prompt_mean_aggregate, prompt_mean_weights
from dapo_ops.engine.surrogate import clip_higher_surrogate, per_token_loss
from dapo_ops.engine.surrogate_cispo import cispo_surrogate
from dapo_ops.engine.surrogate_gspo import gspo_sequence_ratio, gspo_surrogate
from dapo_ops.engine.value import ValueLoss, value_loss

__all__ = [
    "CompiledPolicyLoss",
    "EntropyCoef",
    "KLPenalty",
    "KLReward",
    "PartialLoss",
    "TeacherKL",
    "ValueLoss",
    "adaptive_entropy_coef",
    "adaptive_kl_coef",
    "aggregate_partial",
    "cispo_surrogate",
    "clip_higher_surrogate",
    "distill_advantages",
    "distill_loss",
    "entropy_bonus",
    "global_normalizer",
    "gspo_sequence_ratio",
    "gspo_surrogate",
    "iw_opd_weights",
    "kl_penalty",
    "kl_reward",
    "per_token_loss",
    "policy_loss",
    "policy_loss_with_diagnostics",
    "prompt_mean_aggregate",
    "prompt_mean_weights",
    "token_level_aggregate",
    "token_level_loss",
    "value_loss",
]
