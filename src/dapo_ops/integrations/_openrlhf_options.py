"""OpenRLHF's ``PolicyLoss`` constructor options as a frozen value (same names, defaults, checks).

Its own module so that both :mod:`dapo_ops.integrations.openrlhf` (the loss) and
``_openrlhf_terms`` (the correction weights and the KL term it reads them for) import it
without importing each other.

Example:
    >>> PolicyLossOptions(policy_loss_type="gspo").sequence_mean
    True
"""

from __future__ import annotations

import dataclasses

from dapo_ops._core._validate import InputError, check_option
from dapo_ops.objectives import ClipHigher

#: OpenRLHF's string options -> the values its ``PolicyLoss`` accepts (the first: default).
CHOICES: dict[str, tuple[str, ...]] = {
    "policy_loss_type": ("ppo", "gspo"),
    "is_correction_level": ("off", "token", "seq"),
    "is_correction_mode": ("mask", "clip"),
    "is_correction_gating": ("ratio", "binary_kl", "tv"),
}


@dataclasses.dataclass(frozen=True)
class PolicyLossOptions:
    """``openrlhf.models.loss.PolicyLoss``'s constructor options, with its defaults and checks."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip: float | None = None
    token_level_loss: bool = True
    policy_loss_type: str = CHOICES["policy_loss_type"][0]
    is_correction_level: str = CHOICES["is_correction_level"][0]
    is_correction_mode: str = CHOICES["is_correction_mode"][0]
    is_correction_gating: str = CHOICES["is_correction_gating"][0]
    is_correction_threshold: tuple[float, float] = (0.5, 5.0)

    def __post_init__(self) -> None:
        for field, allowed in CHOICES.items():
            check_option(field, getattr(self, field), allowed)
        low, high = self.is_correction_threshold
        object.__setattr__(self, "is_correction_threshold", (float(low), float(high)))
        if self.is_correction_mode == "clip" and (
            self.is_correction_level == "seq" or self.is_correction_gating != "ratio"
        ):
            raise InputError(
                "is_correction_mode='clip' needs is_correction_level='token' and "
                "is_correction_gating='ratio' (only a token ratio is a weight to clamp)"
            )
        if self.is_correction_gating != "ratio" and self.is_correction_level != "off" and low > 0:
            raise InputError(
                f"is_correction_gating={self.is_correction_gating!r} bounds the divergence from "
                f"above only: is_correction_threshold[0] must be <= 0, got {low}"
            )
        self.objective()  # validates the clip options (dual_clip > 1, eps ranges)

    @property
    def sequence_mean(self) -> bool:
        """Whether the loss is the per-sequence mean (``gspo`` forces it, as OpenRLHF)."""
        return self.policy_loss_type == "gspo" or not self.token_level_loss

    def objective(self) -> ClipHigher:
        """:class:`~dapo_ops.ClipHigher` with these clip options (``dual_clip`` included)."""
        return ClipHigher(
            eps_low=self.clip_eps_low, eps_high=self.clip_eps_high, dual_clip=self.dual_clip
        )
