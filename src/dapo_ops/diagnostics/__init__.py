"""Diagnostics: what an objective did to the tokens, and per-batch sums; no host sync.

This package's face: it only re-exports; the code lives in its modules. ``__all__`` is the
stage's public API (the ``dapo_ops`` face exports it); ``DAPO_CLIP``, ``extreme`` and
``masked_sum`` were names of the 0.1.0 module ``dapo_ops.diagnostics`` and stay importable
from it."""

from dapo_ops.diagnostics.measures import DAPO_CLIP as DAPO_CLIP  # 0.1.0 module names
from dapo_ops.diagnostics.measures import (
    BatchDiagnostics,
    PolicyDiagnostics,
    batch_diagnostics,
    objective_diagnostics,
    policy_diagnostics,
)
from dapo_ops.diagnostics.measures import extreme as extreme
from dapo_ops.diagnostics.measures import masked_sum as masked_sum

__all__ = [
    "BatchDiagnostics",
    "PolicyDiagnostics",
    "batch_diagnostics",
    "objective_diagnostics",
    "policy_diagnostics",
]
