"""Recipes: DAPO and the methods users run it against, as frozen values.

A preset is a whole recipe: an objective value (:class:`ClipHigher`, :class:`GSPO`,
:class:`CISPO`), how advantages are computed, how the loss is aggregated, the optional KL
penalty, and which batch-level techniques (overlong shaping or filtering, dynamic
sampling) the host loop runs. Switch recipe by switching preset, derive one with
:meth:`ObjectivePreset.replace` (validated again), look one up by name in
:data:`PRESETS`. The objective is a value, so a typo cannot select another objective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from types import MappingProxyType

from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._rules import Normalizer
from dapo_ops._core._validate import InputError
from dapo_ops.advantages.group import group_advantages
from dapo_ops.engine.kl import KLPenalty
from dapo_ops.engine.policy import policy_loss
from dapo_ops.objectives import CISPO as CISPOObjective
from dapo_ops.objectives import GSPO as GSPOObjective
from dapo_ops.objectives import ClipHigher
from dapo_ops.presets._peers import trl_options, verl_options
from dapo_ops.presets._settings import PresetSettings

__all__ = [
    "CISPO",
    "DAPO",
    "DR_GRPO",
    "GRPO",
    "GSPO",
    "PRESETS",
    "ObjectivePreset",
    "UnknownPresetError",
]


@dataclasses.dataclass(frozen=True)
class ObjectivePreset(PresetSettings):
    """Every choice that differs between DAPO, GRPO, Dr. GRPO, GSPO and CISPO.

    ``objective``: the loss (an :class:`~dapo_ops.objectives.Objective` value);
    ``mode``: the aggregation; ``advantage_*``: :func:`group_advantages`' options;
    ``kl``: a :class:`KLPenalty` or None. ``overlong_penalty``, ``overlong_filter`` and
    ``dynamic_sampling`` tell the host loop which of :func:`overlong_reward`,
    :func:`overlong_filter` and :func:`dynamic_sample_mask` to run. The properties
    :attr:`verl` and :attr:`trl` give the matching options of those trainers, derived from
    the current fields (so from a :meth:`replace` copy's own values). Every field is
    validated at construction and by :meth:`replace` (the fields and their checks are
    defined in ``presets/_settings.py``, which ``presets/_peers.py`` reads).
    """

    @property
    def verl(self) -> Mapping[str, object]:
        """verl 0.9.1's options for this preset (read-only), from its current fields.

        Raises :class:`InputError` naming the field verl cannot express (e.g.
        ``overlong_filter=True``, ``advantage_scale="batch"``, an objective other than
        ClipHigher, GSPO, CISPO).
        """
        return MappingProxyType(verl_options(self))

    @property
    def trl(self) -> Mapping[str, object]:
        """TRL 1.16 ``GRPOConfig`` options for this preset (read-only), from its current
        fields; :class:`InputError` for a field TRL cannot express."""
        return MappingProxyType(trl_options(self))

    def replace(self, **changes: object) -> ObjectivePreset:
        """A validated copy with some fields changed, e.g.
        ``DAPO.replace(objective=ClipHigher(dual_clip=3.0))``."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def advantages(
        self,
        rewards: Float[Tensor, "groups samples"] | Float[Tensor, " batch"],
        group_ids: Integer[Tensor, " batch"] | None = None,
    ) -> Float[Tensor, "groups samples"] | Float[Tensor, " batch"]:
        """:func:`group_advantages` with this preset's scaling, baseline and epsilon."""
        return group_advantages(
            rewards,
            group_ids,
            scale=self.advantage_scale,
            baseline=self.advantage_baseline,
            eps=self.advantage_eps,
        )

    def loss(
        self,
        logp: Float[Tensor, "batch seq"],
        old_logp: Float[Tensor, "batch seq"],
        advantages: Float[Tensor, " batch"] | Float[Tensor, "batch 1"] | Float[Tensor, "batch seq"],
        mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
        *,
        ref_logp: Float[Tensor, "batch seq"] | None = None,
        normalizer: Normalizer = None,
        max_len: int | None = None,
    ) -> Float[Tensor, ""]:
        """:func:`policy_loss` with this preset's objective, KL penalty and mode.

        ``ref_logp`` is needed exactly when the preset has a KL penalty.
        """
        if self.kl is not None and ref_logp is None:
            raise InputError(f"preset {self.name!r} has a KL penalty ({self.kl}): pass ref_logp")
        return policy_loss(
            self.objective,
            logp,
            old_logp,
            advantages,
            mask,
            mode=self.mode,
            normalizer=normalizer,
            max_len=max_len,
            ref_logp=ref_logp,
            kl=self.kl,
        )


DAPO = ObjectivePreset(
    name="dapo",
    paper="Yu et al. 2025, DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
    objective=ClipHigher(eps_low=0.2, eps_high=0.28),
    mode="token_mean",
    advantage_scale="group",
    overlong_penalty=True,
    dynamic_sampling=True,
)

GRPO = ObjectivePreset(
    name="grpo",
    paper="Shao et al. 2024, DeepSeekMath (GRPO)",
    objective=ClipHigher(eps_low=0.2, eps_high=0.2),
    mode="seq_mean_token_mean",
    advantage_scale="group",
    kl=KLPenalty(beta=0.04, estimator="k3"),
)

DR_GRPO = ObjectivePreset(
    name="dr_grpo",
    paper="Liu et al. 2025, Understanding R1-Zero-Like Training (Dr. GRPO)",
    objective=ClipHigher(eps_low=0.2, eps_high=0.2),
    mode="seq_mean_token_sum_norm",
    advantage_scale="none",
)

GSPO = ObjectivePreset(
    name="gspo",
    paper="Zheng et al. 2025, Group Sequence Policy Optimization",
    objective=GSPOObjective(eps_low=3e-4, eps_high=4e-4),
    mode="seq_mean_token_mean",
    advantage_scale="group",
)

CISPO = ObjectivePreset(
    name="cispo",
    paper="MiniMax 2025, MiniMax-M1 (CISPO)",
    objective=CISPOObjective(eps_low=1.0, eps_high=0.28),
    mode="token_mean",
    advantage_scale="group",
)


class UnknownPresetError(KeyError, InputError):
    """``PRESETS[name]`` with a name that is not a preset; the message lists the valid names.

    A ``KeyError`` (so ``PRESETS.get`` and ``in`` work as for any mapping) and an
    :class:`InputError`."""

    def __str__(self) -> str:  # KeyError's would show the message quoted, as a key
        return str(self.args[0])


class _Presets(Mapping[str, ObjectivePreset]):
    """Read-only name -> preset mapping whose missing key names the valid ones."""

    def __init__(self, *presets: ObjectivePreset) -> None:
        self._by_name = {p.name: p for p in presets}

    def __getitem__(self, name: str) -> ObjectivePreset:
        try:
            return self._by_name[name]
        except (KeyError, TypeError):
            raise UnknownPresetError(
                f"no preset {name!r}; the presets are {', '.join(map(repr, self._by_name))}"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def __repr__(self) -> str:
        return f"PRESETS({', '.join(self._by_name)})"


#: The presets by name (read-only); an unknown name raises :class:`UnknownPresetError`.
PRESETS: Mapping[str, ObjectivePreset] = _Presets(DAPO, GRPO, DR_GRPO, GSPO, CISPO)
