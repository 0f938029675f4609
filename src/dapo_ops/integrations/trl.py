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

from collections.abc import Sequence
from typing import Any

import torch
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
from dapo_ops.integrations.trl_sampling import DynamicSampling, SamplingReport
from dapo_ops.rewards.overlong import overlong_reward


class OverlongReward:
    """DAPO's soft overlong punishment as a TRL reward function (``reward_funcs=[...]``).

    Calls :func:`dapo_ops.overlong_reward` on ``len(ids)`` of each completion (TRL's
    completion ids end with the EOS token when there is one, so the EOS counts, as in
    dapo_ops). Equal to ``trl.rewards.get_soft_overlong_punishment(max_len, cache_len)``
    for ``factor=1``; ``factor`` scales the penalty (verl's ``penalty_factor``). A plain
    class, so it pickles for TRL's async reward workers.
    """

    __name__ = "overlong_reward"

    def __init__(self, max_len: int, cache_len: int, factor: float = 1.0) -> None:
        # Validate the options now rather than at the first reward call.
        overlong_reward(torch.zeros(0), max_len=max_len, cache_len=cache_len, factor=factor)
        self.max_len = max_len
        self.cache_len = cache_len
        self.factor = factor

    def __call__(self, completion_ids: Sequence[Sequence[int]], **kwargs: Any) -> list[float]:
        lengths = torch.tensor([len(ids) for ids in completion_ids], dtype=torch.long)
        penalty = overlong_reward(
            lengths, max_len=self.max_len, cache_len=self.cache_len, factor=self.factor
        )
        return [float(x) for x in penalty.tolist()]

    def __repr__(self) -> str:
        return (
            f"OverlongReward(max_len={self.max_len}, cache_len={self.cache_len}, "
            f"factor={self.factor})"
        )


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
          TRL's ``accuracy_reward``).

        Either option given with ``dynamic_sampling=False`` raises ``InputError``.
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
            **kwargs: Any,
        ) -> None:
            sampling = DynamicSampling.from_options(
                dynamic_sampling, max_generation_batches, sampling_metric
            )
            super().__init__(*args, **kwargs)
            check_supported(self)
            self._dapo_sampling = None if sampling is None else sampling.bind(self)
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
