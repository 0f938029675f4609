"""Log-probabilities and the fused output projection: token log-probs and entropies without float32 [tokens, vocab] copies, and ``linear_policy_loss``.

This package's face: it only re-exports; the code lives in its modules."""

from dapo_ops.logprobs.linear_distill import (
    DistillDiagnostics,
    linear_distill_loss,
    linear_distill_loss_with_diagnostics,
)
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

__all__ = [
    "DistillDiagnostics",
    "LinearDiagnostics",
    "LogpEntropy",
    "fused_logprobs_entropy",
    "linear_distill_loss",
    "linear_distill_loss_with_diagnostics",
    "linear_policy_loss",
    "linear_policy_loss_with_diagnostics",
    "token_entropy",
    "token_logprobs",
    "token_logprobs_and_entropy",
]
