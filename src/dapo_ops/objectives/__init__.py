"""Policy objectives as frozen values, composed by :func:`dapo_ops.policy_loss`.

Each objective is one small frozen dataclass (one file) with validated fields and one
definition of its per-token math (:class:`Objective`). ``OBJECTIVES`` lists the ones
the library ships; the conformance tests run over every entry.
"""

from dapo_ops.objectives.base import Clipped, Objective, TokenInputs
from dapo_ops.objectives.cispo import CISPO
from dapo_ops.objectives.clip_higher import ClipHigher
from dapo_ops.objectives.dppo import DPPO
from dapo_ops.objectives.dro import DRO
from dapo_ops.objectives.gmpo import GMPO
from dapo_ops.objectives.gspo import GSPO
from dapo_ops.objectives.policy_gradient import PolicyGradient
from dapo_ops.objectives.ratio import RatioSurrogate
from dapo_ops.objectives.sapo import SAPO
from dapo_ops.objectives.topr import TOPR
from dapo_ops.objectives.vespo import VESPO

#: Every objective class the library exports (the conformance suite's list).
OBJECTIVES: tuple[type[Objective], ...] = (
    ClipHigher,
    GSPO,
    CISPO,
    SAPO,
    DPPO,
    GMPO,
    DRO,
    PolicyGradient,
    VESPO,
    RatioSurrogate,
    TOPR,
)

__all__ = [
    "CISPO",
    "DPPO",
    "DRO",
    "GMPO",
    "GSPO",
    "OBJECTIVES",
    "SAPO",
    "TOPR",
    "VESPO",
    "ClipHigher",
    "Clipped",
    "Objective",
    "PolicyGradient",
    "RatioSurrogate",
    "TokenInputs",
]
