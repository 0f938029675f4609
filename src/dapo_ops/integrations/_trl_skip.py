"""``empty_batch="skip"`` of :mod:`dapo_ops.integrations.trl_sampling`: an optimiser step
with no loss token is not taken.

An optimiser step whose micro-batches hold no loss token on any process (no group kept
in its generation, or only masked fillers in its share of a partial one) has a zero
gradient, but ``transformers.Trainer`` would still call ``optimizer.step()`` (Adam moves
the weights by its momentum, AdamW decays them, the step count advances) and
``lr_scheduler.step()``. :class:`EmptyStepGuard` counts each micro-batch's loss tokens
(``_prepare_inputs``), all-reduces the count at the step's last micro-batch
(``accelerator.sync_gradients``) and, when it is 0, replaces the trainer's ``optimizer``
and ``lr_scheduler`` until the end of that step by stand-ins whose ``step()`` does
nothing (every other attribute is the real one's); TRL's adaptive entropy controller,
which the step's last micro-batch updated, is put back too. The step is still counted
(``global_step``, ``max_steps``, logging), as a mixed-precision overflow step is.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger("dapo_ops.integrations.trl_sampling")

_CONTROLLER = ("entropy_coef", "_last_world_entropy", "_entropy_window_stats")


class _SkipStep:
    """The trainer's ``optimizer`` or ``lr_scheduler`` for one step: ``step()`` does nothing
    and puts the real one back; any other attribute is the real one's."""

    def __init__(self, trainer: Any, attribute: str) -> None:
        self._trainer, self._attribute = trainer, attribute
        self._real = getattr(trainer, attribute)

    def step(self, *args: Any, **kwargs: Any) -> None:
        self.restore()

    def restore(self) -> None:
        if getattr(self._trainer, self._attribute) is self:
            setattr(self._trainer, self._attribute, self._real)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class EmptyStepGuard:
    """Per optimiser step: the loss tokens seen, and the controller state at its start."""

    def __init__(self) -> None:
        self._tokens: Tensor | None = None
        self._controller: dict[str, Any] | None = None
        self._stand_ins: list[_SkipStep] = []
        self.skipped_steps = 0

    def count(self, inputs: dict[str, Any]) -> None:
        """A training micro-batch, as ``_prepare_inputs`` returns it."""
        mask = inputs["completion_mask"]
        if inputs.get("tool_mask") is not None:
            mask = mask * inputs["tool_mask"]
        tokens = mask.sum().to(torch.float64)
        self._tokens = tokens if self._tokens is None else self._tokens + tokens

    def begin(self, trainer: Any) -> None:
        """Before a training micro-batch."""
        self.restore()
        if self._controller is None:  # the step's first micro-batch
            self._controller = {k: getattr(trainer, k, None) for k in _CONTROLLER}

    def end(self, trainer: Any, report: Any) -> None:
        """After a training micro-batch: at the step's last one, skip it if it has no token."""
        acc = trainer.accelerator
        if not acc.sync_gradients:
            return
        tokens = self._tokens if self._tokens is not None else torch.zeros((), dtype=torch.float64)
        total = acc.reduce(tokens.to(acc.device), reduction="sum")
        controller, self._tokens, self._controller = self._controller, None, None
        empty = bool(total == 0)
        trainer._metrics["train"]["dynamic_sampling/skipped_step"].append(float(empty))
        if not empty:
            return
        for key, value in (controller or {}).items():
            if hasattr(trainer, key):
                setattr(trainer, key, value)
        self._stand_ins = [_SkipStep(trainer, "optimizer")]
        if not _stepped_at_evaluation(trainer.lr_scheduler):
            self._stand_ins.append(_SkipStep(trainer, "lr_scheduler"))
        for stand_in in self._stand_ins:
            setattr(trainer, stand_in._attribute, stand_in)
        self.skipped_steps += 1
        if acc.is_main_process:
            kept = sum(sum(v) for v in report.verdicts) if report is not None else 0
            groups = sum(len(v) for v in report.verdicts) if report is not None else 0
            logger.warning(
                "dynamic sampling: optimiser step %d skipped (empty_batch='skip'; no weight, "
                "optimiser or learning-rate change): its micro-batches hold no kept sample; "
                "the last generation kept %d of %d groups (kept fraction %.3g)",
                trainer.state.global_step + 1,
                kept,
                groups,
                kept / groups if groups else 0.0,
            )

    def restore(self) -> None:
        """Put the real optimizer and scheduler back (also done by their ``step()``)."""
        for stand_in in self._stand_ins:
            stand_in.restore()
        self._stand_ins = []

    def callback(self) -> Any:
        """A ``TrainerCallback`` that puts them back at the step's end, before a checkpoint."""
        from transformers import TrainerCallback

        guard = self

        class RestoreOptimizer(TrainerCallback):  # type: ignore[misc]
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
                guard.restore()
                return control

        return RestoreOptimizer()


def _stepped_at_evaluation(scheduler: Any) -> bool:
    """Whether ``Trainer``'s loop leaves ``scheduler`` alone at an optimiser step (it steps
    these on evaluation metrics instead), as its own ``isinstance`` test decides."""
    from transformers import optimization

    kinds: tuple[type, ...] = (torch.optim.lr_scheduler.ReduceLROnPlateau,)
    greedy = getattr(optimization, "GreedyLR", None)
    if isinstance(greedy, type):
        kinds += (greedy,)
    return isinstance(scheduler, kinds)
