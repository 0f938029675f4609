"""dapo_ops: exact, fast, shape-typed PyTorch functions for DAPO-style RL fine-tuning.

The math is derived in docs/; every public function documents its formula, shapes and
defaults. Import what you need::

    from dapo_ops import token_level_loss, group_advantages, global_normalizer
    from dapo_ops import policy_loss, ClipHigher, GSPO, CISPO, presets

Objectives (the loss) are values at the top level; recipes (objective + advantages +
aggregation + sampling) live in :mod:`dapo_ops.presets` (``presets.DAPO``, ...).
"""

from dapo_ops import (
    advantages,
    correction,
    diagnostics,
    engine,
    logprobs,
    presets,
    rewards,
)
from dapo_ops._core import _compat
from dapo_ops._core._validate import InputError
from dapo_ops.advantages import *  # noqa: F403
from dapo_ops.correction import *  # noqa: F403
from dapo_ops.diagnostics import *  # noqa: F403
from dapo_ops.engine import *  # noqa: F403
from dapo_ops.logprobs import *  # noqa: F403
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
from dapo_ops.rewards import *  # noqa: F403

__version__ = "0.1.0"

_compat.install()  # the 0.1.0 module paths (dapo_ops.kl, ...): deprecated aliases


def __getattr__(name: str) -> object:
    """``dapo_ops.kl`` and the other 0.1.0 module paths, as attributes (deprecated)."""
    if f"dapo_ops.{name}" in _compat.OLD_PATHS:
        return _compat.moved(f"dapo_ops.{name}")
    raise AttributeError(f"module 'dapo_ops' has no attribute {name!r}")


# Each stage's public names are its face's ``__all__``; the objectives' face also holds
# the kit for writing one (TokenInputs, Clipped, OBJECTIVES), so the values are named here.
__all__ = [
    "CISPO",
    "DPPO",
    "DRO",
    "GMPO",
    "GSPO",
    "SAPO",
    "TOPR",
    "VESPO",
    "ClipHigher",
    "InputError",
    "Objective",
    "ObjectivePreset",
    "PolicyGradient",
    "RatioSurrogate",
    "presets",
]
__all__ += rewards.__all__
__all__ += advantages.__all__
__all__ += diagnostics.__all__
__all__ += engine.__all__
__all__ += correction.__all__
__all__ += logprobs.__all__
