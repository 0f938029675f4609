"""Recipes: DAPO and the methods users run it against, as frozen values.

``recipes.py`` holds the presets (:class:`ObjectivePreset`, ``DAPO``, ``GRPO``,
``DR_GRPO``, ``GSPO``, ``CISPO``, ``PRESETS``); ``_peers.py`` derives each preset's verl and
TRL options from its current values. ``dapo_ops.presets.DAPO`` and ``from dapo_ops.presets
import ...`` are the documented paths.
"""

from dapo_ops.presets import recipes
from dapo_ops.presets.recipes import *  # noqa: F403

__all__ = list(recipes.__all__)
