"""The settings a preset holds, validated: the fields of :class:`ObjectivePreset`.

:class:`dapo_ops.presets.ObjectivePreset` adds to them what a preset does (its loss, its
advantages, its ``replace``) and its verl and TRL options; those options are derived in
:mod:`dapo_ops.presets._peers` from these fields, so that module reads the true type
without importing the recipes that call it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from dapo_ops._core._rules import AGGREGATION_MODES, AggregationMode
from dapo_ops._core._validate import InputError, check_option
from dapo_ops.engine.kl import KLPenalty
from dapo_ops.objectives import Objective
from dapo_ops.objectives.base import check_objective_value


@dataclasses.dataclass(frozen=True)
class PresetSettings:
    """The fields of :class:`dapo_ops.presets.ObjectivePreset` (documented there), each
    validated at construction."""

    name: str
    paper: str
    objective: Objective
    mode: AggregationMode
    advantage_scale: Literal["group", "batch", "none"]
    advantage_baseline: Literal["mean", "leave_one_out"] = "mean"
    advantage_eps: float = 0.0
    kl: KLPenalty | None = None
    overlong_penalty: bool = False
    overlong_filter: bool = False
    dynamic_sampling: bool = False

    def __post_init__(self) -> None:
        check_objective_value(self.objective, "ObjectivePreset.objective")
        check_option("ObjectivePreset.mode", self.mode, AGGREGATION_MODES)
        check_option(
            "ObjectivePreset.advantage_scale", self.advantage_scale, ("group", "batch", "none")
        )
        check_option(
            "ObjectivePreset.advantage_baseline", self.advantage_baseline, ("mean", "leave_one_out")
        )
        eps = self.advantage_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
            raise InputError(f"ObjectivePreset.advantage_eps must be finite and >= 0, got {eps!r}")
        if self.kl is not None and not isinstance(self.kl, KLPenalty):
            raise InputError(f"ObjectivePreset.kl must be a KLPenalty or None, got {self.kl!r}")
        for flag in ("overlong_penalty", "overlong_filter", "dynamic_sampling"):
            if not isinstance(getattr(self, flag), bool):
                raise InputError(
                    f"ObjectivePreset.{flag} must be a bool, got {getattr(self, flag)!r}"
                )
