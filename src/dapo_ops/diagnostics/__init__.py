"""Diagnostics: what an objective did to the tokens, and per-batch sums; no host sync.

This package's face: it only re-exports; the code lives in its modules."""

from dapo_ops.diagnostics.measures import (
    DAPO_CLIP,
    BatchDiagnostics,
    PolicyDiagnostics,
    batch_diagnostics,
    extreme,
    masked_sum,
    objective_diagnostics,
    policy_diagnostics,
)

__all__ = [
    "DAPO_CLIP",
    "BatchDiagnostics",
    "PolicyDiagnostics",
    "batch_diagnostics",
    "extreme",
    "masked_sum",
    "objective_diagnostics",
    "policy_diagnostics",
]
