"""A preset's settings as verl 0.9.1 and TRL 1.16 option names, derived from its values.

:attr:`ObjectivePreset.verl` and :attr:`ObjectivePreset.trl` call these, so a preset made
with ``replace`` maps its own values, never its parent's. A value the peer cannot express
raises :class:`InputError` naming the field, rather than giving a mapping that selects
something else. The objective's options are the inverse of the adapters' readings
(:func:`dapo_ops.integrations.verl_losses.verl_objective`,
:func:`dapo_ops.integrations.trl.trl_objective`; tested as round trips).
"""

from __future__ import annotations

from dapo_ops._core._validate import InputError
from dapo_ops.objectives import CISPO, GSPO, ClipHigher
from dapo_ops.presets._settings import PresetSettings

#: dapo_ops KL estimator -> verl ``kl_loss_type`` (``+`` appended for ``straight_through``).
VERL_KL_TYPES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl", "abs": "abs"}
#: dapo_ops aggregation -> TRL ``loss_type`` for the clipped objectives.
TRL_LOSS_TYPES = {
    "token_mean": "dapo",
    "seq_mean_token_mean": "grpo",
    "seq_mean_token_sum_norm": "dr_grpo",
}


def _refuse(preset: PresetSettings, peer: str, field: str, why: str) -> InputError:
    value = getattr(preset, field)
    return InputError(f"preset {preset.name!r}: {field}={value!r} has no {peer} setting ({why})")


def verl_options(preset: PresetSettings) -> dict[str, object]:
    """verl's actor / algorithm / reward options that select this preset's settings."""
    obj = preset.objective
    if isinstance(obj, ClipHigher):
        out: dict[str, object] = {"policy_loss.loss_mode": "vanilla"}
    elif isinstance(obj, (GSPO, CISPO)):
        out = {"policy_loss.loss_mode": "gspo" if isinstance(obj, GSPO) else "cispo"}
    else:
        raise _refuse(preset, "verl", "objective", "mapped here: ClipHigher, GSPO, CISPO")
    out["clip_ratio_low"], out["clip_ratio_high"] = obj.eps_low, obj.eps_high
    if isinstance(obj, ClipHigher) and obj.dual_clip is not None:
        out["clip_ratio_c"] = obj.dual_clip  # verl's vanilla dual-clips always (3.0 if unset)
    out["loss_agg_mode"] = preset.mode.replace("_", "-")
    out["use_kl_loss"] = preset.kl is not None
    if preset.kl is not None:
        out["kl_loss_coef"] = preset.kl.beta
        suffix = "+" if preset.kl.straight_through else ""
        out["kl_loss_type"] = VERL_KL_TYPES[preset.kl.estimator] + suffix
    if preset.advantage_scale == "batch":
        raise _refuse(preset, "verl", "advantage_scale", "its GRPO scales by the group std or not")
    if preset.advantage_baseline != "mean":
        raise _refuse(preset, "verl", "advantage_baseline", "its GRPO subtracts the group mean")
    out["algorithm.norm_adv_by_std_in_grpo"] = preset.advantage_scale == "group"
    out["algorithm.filter_groups.enable"] = preset.dynamic_sampling
    out["reward_model.overlong_buffer.enable"] = preset.overlong_penalty
    if preset.overlong_filter:
        raise _refuse(preset, "verl", "overlong_filter", "it masks no truncated response")
    return out


def trl_options(preset: PresetSettings) -> dict[str, object]:
    """TRL ``GRPOConfig`` options that select this preset's settings.

    ``dynamic_sampling`` and ``overlong_penalty`` are not ``GRPOConfig`` options: they are
    ``DapoGRPOTrainer(dynamic_sampling=True)`` and the ``OverlongReward`` reward function.
    """
    obj = preset.objective
    if isinstance(obj, CISPO):
        if preset.mode != "token_mean":
            raise _refuse(preset, "TRL", "mode", "its cispo loss is a token mean")
        if obj.eps_low < 1.0:
            raise _refuse(preset, "TRL", "objective", "its cispo weight has no lower bound")
        out: dict[str, object] = {"loss_type": "cispo", "epsilon_high": 1.0 + obj.eps_high}
    elif isinstance(obj, (ClipHigher, GSPO)):
        if preset.mode not in TRL_LOSS_TYPES:
            raise _refuse(preset, "TRL", "mode", f"its clipped losses: {sorted(TRL_LOSS_TYPES)}")
        out = {"loss_type": TRL_LOSS_TYPES[preset.mode]}
        out["epsilon"], out["epsilon_high"] = obj.eps_low, obj.eps_high
        if isinstance(obj, GSPO):
            out["importance_sampling_level"] = "sequence"
        elif obj.dual_clip is not None:
            if not obj.dual_clip > 1.0 + obj.eps_high:
                raise _refuse(preset, "TRL", "objective", "delta caps above 1 + eps_high only")
            out["delta"] = obj.dual_clip
    else:
        raise _refuse(preset, "TRL", "objective", "mapped here: ClipHigher, GSPO, CISPO")
    kl = preset.kl
    if kl is not None and (kl.estimator != "k3" or kl.straight_through):
        raise _refuse(preset, "TRL", "kl", "its beta term is the plain k3 estimate")
    out["beta"] = 0.0 if kl is None else kl.beta
    if preset.advantage_baseline != "mean":
        raise _refuse(preset, "TRL", "advantage_baseline", "GRPO subtracts the group mean")
    out["scale_rewards"] = preset.advantage_scale
    out["mask_truncated_completions"] = preset.overlong_filter
    return out
