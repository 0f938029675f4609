"""dapo_ops: exact, fast, shape-typed PyTorch functions for DAPO-style RL fine-tuning.

The math is derived in docs/; every public function documents its formula, shapes and
defaults. Import what you need::

    from dapo_ops import token_level_loss, group_advantages, global_normalizer
    from dapo_ops import policy_loss, ClipHigher, GSPO, CISPO, presets

Objectives (the loss) are values at the top level; recipes (objective + advantages +
aggregation + sampling) live in :mod:`dapo_ops.presets` (``presets.DAPO``, ...).
"""

from dapo_ops import presets
from dapo_ops._core import _compat
from dapo_ops._core._validate import InputError
from dapo_ops.advantages.estimators import (
    gdpo_advantages,
    gpg_advantages,
    maxrl_advantages,
    opo_advantages,
    passk_advantages,
)
from dapo_ops.advantages.group import group_advantages
from dapo_ops.advantages.optimal_baseline import optimal_token_baseline_advantages
from dapo_ops.advantages.returns import (
    gae_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    remax_advantages,
)
from dapo_ops.correction.cov_masks import clip_cov_mask, kl_cov_mask
from dapo_ops.correction.importance import rejection_mask, truncated_is_weights
from dapo_ops.correction.m2po import m2po_mask
from dapo_ops.correction.masks import high_entropy_mask, off_policy_sequence_mask
from dapo_ops.correction.offpolicy import OffPolicyMetrics, offpolicy_metrics
from dapo_ops.diagnostics.measures import (
    BatchDiagnostics,
    PolicyDiagnostics,
    batch_diagnostics,
    objective_diagnostics,
    policy_diagnostics,
)
from dapo_ops.engine.aggregation import PartialLoss, aggregate_partial, token_level_aggregate
from dapo_ops.engine.compiled_loss import CompiledPolicyLoss
from dapo_ops.engine.distill import TeacherKL, distill_advantages, distill_loss
from dapo_ops.engine.distributed import global_normalizer
from dapo_ops.engine.entropy import EntropyCoef, adaptive_entropy_coef, entropy_bonus
from dapo_ops.engine.kl import KLPenalty, kl_penalty
from dapo_ops.engine.kl_reward import KLReward, adaptive_kl_coef, kl_reward
from dapo_ops.engine.loss import token_level_loss
from dapo_ops.engine.policy import policy_loss, policy_loss_with_diagnostics
from dapo_ops.engine.surrogate import clip_higher_surrogate, per_token_loss
from dapo_ops.engine.surrogate_cispo import cispo_surrogate
from dapo_ops.engine.surrogate_gspo import gspo_sequence_ratio, gspo_surrogate
from dapo_ops.engine.value import ValueLoss, value_loss
from dapo_ops.logprobs.linear_loss import (
    LinearDiagnostics,
    linear_policy_loss,
    linear_policy_loss_with_diagnostics,
)
from dapo_ops.logprobs.tokens import (
    LogpEntropy,
    fused_logprobs_entropy,
    token_entropy,
    token_logprobs,
    token_logprobs_and_entropy,
)
from dapo_ops.objectives import (
    CISPO,
    DPPO,
    DRO,
    GMPO,
    GSPO,
    SAPO,
    TOPR,
    VESPO,
    ClipHigher,
    Objective,
    PolicyGradient,
    RatioSurrogate,
)
from dapo_ops.presets import ObjectivePreset
from dapo_ops.rewards.overlong import overlong_filter, overlong_reward, truncation_penalty
from dapo_ops.rewards.pf_ppo import pf_ppo_resample, pf_ppo_weights
from dapo_ops.rewards.sampling import (
    difficulty_band_mask,
    dynamic_sample_mask,
    kept_group_fraction,
    prompts_to_generate,
)

__version__ = "0.1.0"

_compat.install()  # the 0.1.0 module paths (dapo_ops.kl, ...): deprecated aliases


def __getattr__(name: str) -> object:
    """``dapo_ops.kl`` and the other 0.1.0 module paths, as attributes (deprecated)."""
    if f"dapo_ops.{name}" in _compat.OLD_PATHS:
        return _compat.moved(f"dapo_ops.{name}")
    raise AttributeError(f"module 'dapo_ops' has no attribute {name!r}")


__all__ = [
    "CISPO",
    "DPPO",
    "DRO",
    "GMPO",
    "GSPO",
    "SAPO",
    "TOPR",
    "VESPO",
    "BatchDiagnostics",
    "ClipHigher",
    "CompiledPolicyLoss",
    "EntropyCoef",
    "InputError",
    "KLPenalty",
    "KLReward",
    "LinearDiagnostics",
    "LogpEntropy",
    "Objective",
    "ObjectivePreset",
    "OffPolicyMetrics",
    "PartialLoss",
    "PolicyDiagnostics",
    "PolicyGradient",
    "RatioSurrogate",
    "TeacherKL",
    "ValueLoss",
    "adaptive_entropy_coef",
    "adaptive_kl_coef",
    "aggregate_partial",
    "batch_diagnostics",
    "cispo_surrogate",
    "clip_cov_mask",
    "clip_higher_surrogate",
    "difficulty_band_mask",
    "distill_advantages",
    "distill_loss",
    "dynamic_sample_mask",
    "entropy_bonus",
    "fused_logprobs_entropy",
    "gae_advantages",
    "gdpo_advantages",
    "global_normalizer",
    "gpg_advantages",
    "group_advantages",
    "gspo_sequence_ratio",
    "gspo_surrogate",
    "high_entropy_mask",
    "kept_group_fraction",
    "kl_cov_mask",
    "kl_penalty",
    "kl_reward",
    "linear_policy_loss",
    "linear_policy_loss_with_diagnostics",
    "m2po_mask",
    "masked_whiten",
    "maxrl_advantages",
    "objective_diagnostics",
    "off_policy_sequence_mask",
    "offpolicy_metrics",
    "opo_advantages",
    "optimal_token_baseline_advantages",
    "overlong_filter",
    "overlong_reward",
    "passk_advantages",
    "per_token_loss",
    "pf_ppo_resample",
    "pf_ppo_weights",
    "policy_diagnostics",
    "policy_loss",
    "policy_loss_with_diagnostics",
    "presets",
    "prompts_to_generate",
    "reinforce_pp_advantages",
    "rejection_mask",
    "remax_advantages",
    "token_entropy",
    "token_level_aggregate",
    "token_level_loss",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "truncated_is_weights",
    "truncation_penalty",
    "value_loss",
]
