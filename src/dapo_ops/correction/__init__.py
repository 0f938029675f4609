"""Rollout correction: importance weights, rejection and off-policy masks, M2PO's second-moment mask, Clip-Cov and KL-Cov selections, off-policy metrics.

This package's face: it only re-exports; the code lives in its modules."""

from dapo_ops.correction.cov_masks import clip_cov_mask, kl_cov_mask
from dapo_ops.correction.importance import rejection_mask, truncated_is_weights
from dapo_ops.correction.m2po import m2po_mask
from dapo_ops.correction.masks import high_entropy_mask, off_policy_sequence_mask
from dapo_ops.correction.offpolicy import OffPolicyMetrics, offpolicy_metrics

__all__ = [
    "OffPolicyMetrics",
    "clip_cov_mask",
    "high_entropy_mask",
    "kl_cov_mask",
    "m2po_mask",
    "off_policy_sequence_mask",
    "offpolicy_metrics",
    "rejection_mask",
    "truncated_is_weights",
]
