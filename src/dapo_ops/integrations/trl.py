"""TRL integration: dapo_ops' loss inside ``trl.GRPOTrainer``, the overlong penalty as a reward.

- :class:`DapoGRPOTrainer` (built on first access, so importing this module does not import
  TRL) is a ``trl.GRPOTrainer`` whose ``compute_loss`` computes every term with dapo_ops,
  from the trainer's own settings: every ``loss_type`` of TRL 1.16 (:data:`TRL_LOSS_TYPES`)
  with ``epsilon`` / ``epsilon_high``, ``delta``, ``importance_sampling_level``, ``beta``
  (k3, ``use_bias_correction_kl``), ``top_entropy_quantile``, ``off_policy_mask_threshold``,
  vLLM's importance-sampling correction, the entropy bonus (``entropy_coef``,
  ``use_adaptive_entropy``: :func:`dapo_ops.entropy_bonus`,
  :func:`dapo_ops.adaptive_entropy_coef`) and the MoE router loss. Everything else
  (generation, rewards, advantages, logging, checkpoints) is TRL's. With
  ``dynamic_sampling=True`` it also drops the groups whose metric is constant and
  generates more until the batch is full (:mod:`dapo_ops.integrations.trl_sampling`).
- :class:`OverlongReward` is :func:`dapo_ops.overlong_reward` with the signature TRL expects
  of a reward function.
- :func:`trl_policy_loss` is the mapping itself, as a pure function of tensors
  (:mod:`dapo_ops.integrations._trl_loss`; the trainer's step: ``_trl_compute``).

Tested against TRL 1.16 (``tests/integration/test_trl.py``, ``test_trl_entropy.py``): the
loss, its gradient and TRL's metrics equal ``GRPOTrainer``'s own on the same batch.

Example:
    >>> reward = OverlongReward(max_len=20, cache_len=4)
    >>> reward(completion_ids=[[7] * 10, [7] * 18, [7] * 20, [7] * 25])
    [0.0, -0.5, -1.0, -1.0]
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from dapo_ops.integrations._trl_compute import check_supported, dapo_compute_loss
from dapo_ops.integrations._trl_loss import (
    TRL_LOSS_TYPES,
    trl_normalizer,
    trl_objective,
    trl_options,
    unsupported_settings,
)
from dapo_ops.integrations._trl_policy import trl_policy_loss
from dapo_ops.integrations._trl_rewards import OverlongReward
from dapo_ops.integrations.trl_sampling import DynamicSampling, SamplingReport


def _build_trainer_class() -> type:
    from trl import GRPOTrainer  # type: ignore[attr-defined]

    class DapoGRPOTrainer(GRPOTrainer):  # type: ignore[misc, valid-type]
        """``trl.GRPOTrainer`` whose loss is computed by dapo_ops (:func:`dapo_ops.policy_loss`).

        Same constructor and config as ``GRPOTrainer``. Every TRL 1.16 ``loss_type``
        (``"dapo"``, the default, ``"bnpo"``, ``"grpo"``, ``"dr_grpo"``, ``"cispo"``,
        ``"sapo"``, ``"luspo"``, ``"vespo"``) with its options: ``epsilon`` /
        ``epsilon_high``, ``delta`` (> 1), ``importance_sampling_level``, ``beta`` (k3 KL,
        ``use_bias_correction_kl``), ``top_entropy_quantile``, ``off_policy_mask_threshold``,
        ``entropy_coef`` / ``use_adaptive_entropy`` (TRL's controller state, saved in TRL's
        checkpoints), ``mask_truncated_completions``, vLLM importance-sampling correction and
        the MoE router loss. Settings it does not reproduce (``delta`` with a loss type TRL
        ignores it for, ``delta <= 1``, ``epsilon_high <= 0`` with ``"cispo"``) raise
        ``ValueError`` at construction.

        Dynamic sampling (DAPO's fourth technique, which TRL lacks), keyword-only options
        after TRL's (details: :mod:`dapo_ops.integrations.trl_sampling`):

        - ``dynamic_sampling`` (default ``False``): drop every group whose metric is
          constant and generate more prompts until the batch is full or the cap is reached;
          advantages are then computed on the kept groups only. Training only.
        - ``max_generation_batches`` (int >= 1, default 10 with ``dynamic_sampling=True``):
          generation batches per step, the first included. At the cap the step trains on
          what was kept (the rest masked out, ``dynamic_sampling/partial_batch`` logged).
        - ``sampling_metric`` (default ``"accuracy"``): the reward function whose raw
          output decides, by its name in ``reward_func_names`` (``"accuracy"`` also finds
          TRL's ``accuracy_reward``). Naming the overlong reward warns.
        - ``empty_batch`` (``"skip"``, the default, or ``"raise"``): when no group is kept,
          skip the optimiser steps without a loss token (no weight, optimiser or
          learning-rate change; a warning) or raise ``ValueError``.

        Any of these options given with ``dynamic_sampling=False`` raises ``InputError``.
        ``last_dynamic_sampling`` holds the :class:`~dapo_ops.integrations.trl_sampling.SamplingReport`
        of the last generation.

        Example (``model``, ``config``, ``dataset`` and an ``accuracy`` reward function
        defined as for ``GRPOTrainer``)::

            trainer = DapoGRPOTrainer(
                model=model,
                reward_funcs=[accuracy, OverlongReward(max_len=4096, cache_len=512)],
                args=config,
                train_dataset=dataset,
                dynamic_sampling=True,
                max_generation_batches=5,
                sampling_metric="accuracy",
            )
        """

        def __init__(
            self,
            *args: Any,
            dynamic_sampling: bool = False,
            max_generation_batches: int | None = None,
            sampling_metric: str | None = None,
            empty_batch: str | None = None,
            **kwargs: Any,
        ) -> None:
            sampling = DynamicSampling.from_options(
                dynamic_sampling, max_generation_batches, sampling_metric, empty_batch
            )
            super().__init__(*args, **kwargs)
            check_supported(self)
            self._dapo_sampling = None if sampling is None else sampling.bind(self)
            if sampling is not None and sampling.empty_batch == "skip":
                self.add_callback(sampling.guard.callback())
            self._dapo_rewards: Tensor | None = None
            self.last_dynamic_sampling: SamplingReport | None = None

        def _calculate_rewards(self, *args: Any, **kwargs: Any) -> Tensor:
            rewards = super()._calculate_rewards(*args, **kwargs)
            self._dapo_rewards = rewards  # [rows of all processes, reward functions]
            return rewards  # type: ignore[no-any-return]

        def _generate_and_score_completions(self, inputs: list[Any]) -> dict[str, Any]:
            if getattr(self, "_dapo_sampling", None) is None or not self.model.training:
                return super()._generate_and_score_completions(inputs)  # type: ignore[no-any-return]
            score = super()._generate_and_score_completions
            return self._dapo_sampling.generate(self, inputs, score)  # type: ignore[union-attr]

        def _prepare_inputs(self, generation_batch: Any) -> Any:
            inputs = super()._prepare_inputs(generation_batch)
            if self._skips_empty_steps() and self.model.training:
                self._dapo_sampling.guard.count(inputs)  # type: ignore[union-attr]
            return inputs

        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Tensor:
            if not self._skips_empty_steps():
                return super().training_step(model, inputs, num_items_in_batch)  # type: ignore[no-any-return]
            guard = self._dapo_sampling.guard  # type: ignore[union-attr]
            guard.begin(self)
            loss = super().training_step(model, inputs, num_items_in_batch)
            guard.end(self, self.last_dynamic_sampling)
            return loss  # type: ignore[no-any-return]

        def _skips_empty_steps(self) -> bool:
            sampling = getattr(self, "_dapo_sampling", None)
            return sampling is not None and sampling.empty_batch == "skip"

        def compute_loss(
            self,
            model: Any,
            inputs: dict[str, Any],
            return_outputs: bool = False,
            num_items_in_batch: Any = None,
        ) -> Tensor:
            if return_outputs:
                raise ValueError("The GRPOTrainer does not support returning outputs")
            return dapo_compute_loss(self, model, inputs)

    # Importable (and picklable) as dapo_ops.integrations.trl.DapoGRPOTrainer.
    DapoGRPOTrainer.__module__ = __name__
    DapoGRPOTrainer.__qualname__ = "DapoGRPOTrainer"
    return DapoGRPOTrainer


def __getattr__(name: str) -> Any:
    """Builds :class:`DapoGRPOTrainer` (importing TRL) on first access."""
    if name == "DapoGRPOTrainer":
        cls = _build_trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# DapoGRPOTrainer is public too, but built on first access (it needs TRL), so it is not
# in __all__: ``from dapo_ops.integrations.trl import *`` must work without TRL.
__all__ = [
    "TRL_LOSS_TYPES",
    "OverlongReward",
    "trl_normalizer",
    "trl_objective",
    "trl_options",
    "trl_policy_loss",
    "unsupported_settings",
]
