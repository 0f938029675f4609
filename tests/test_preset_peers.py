"""ObjectivePreset.verl / .trl are derived from the preset's current values; PRESETS names
its keys on a miss.

The objective part of each mapping is checked as a round trip through the adapters' own
readings of those options (``verl_losses.verl_objective``, ``trl.trl_objective``: pure
functions, neither peer needed).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import dapo_ops as d
from dapo_ops import CISPO, GSPO, ClipHigher, KLPenalty, presets
from dapo_ops.integrations.trl import trl_objective
from dapo_ops.integrations.verl_losses import verl_objective

eps = st.floats(1e-4, 0.9, allow_nan=False)
clip_objectives = st.one_of(
    st.builds(ClipHigher, eps_low=eps, eps_high=eps, dual_clip=st.sampled_from([None, 3.0, 5.0])),
    st.builds(GSPO, eps_low=eps, eps_high=eps),
)
modes = st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])


def test_replace_changes_the_peer_mappings() -> None:
    """The issue's example and one change per mapped field."""
    wider = presets.DAPO.replace(objective=ClipHigher(eps_high=0.3))
    assert wider.verl["clip_ratio_high"] == 0.3 and wider.trl["epsilon_high"] == 0.3
    assert presets.DAPO.verl["clip_ratio_high"] == 0.28  # the original is unchanged
    kl = presets.DAPO.replace(kl=KLPenalty(beta=0.1, estimator="k1", straight_through=True))
    assert (kl.verl["use_kl_loss"], kl.verl["kl_loss_coef"], kl.verl["kl_loss_type"]) == (
        True,
        0.1,
        "kl+",
    )
    with pytest.raises(d.InputError, match="kl="):
        kl.trl  # noqa: B018  (TRL's beta term is k3 only)
    seq = presets.DAPO.replace(mode="seq_mean_token_mean", dynamic_sampling=False)
    assert seq.verl["loss_agg_mode"] == "seq-mean-token-mean" and seq.trl["loss_type"] == "grpo"
    assert seq.verl["algorithm.filter_groups.enable"] is False
    unscaled = presets.GRPO.replace(advantage_scale="none", kl=None)
    assert unscaled.verl["algorithm.norm_adv_by_std_in_grpo"] is False
    assert unscaled.verl["use_kl_loss"] is False and unscaled.trl["beta"] == 0.0
    assert unscaled.trl["scale_rewards"] == "none"
    masked = presets.DAPO.replace(overlong_filter=True)
    assert masked.trl["mask_truncated_completions"] is True
    with pytest.raises(d.InputError, match="overlong_filter=True has no verl setting"):
        masked.verl  # noqa: B018


def test_settings_a_peer_cannot_express_are_refused_by_name() -> None:
    batch = presets.DAPO.replace(advantage_scale="batch")
    assert batch.trl["scale_rewards"] == "batch"
    with pytest.raises(d.InputError, match="advantage_scale"):
        batch.verl  # noqa: B018
    loo = presets.DAPO.replace(advantage_baseline="leave_one_out")
    for peer in ("verl", "trl"):
        with pytest.raises(d.InputError, match="advantage_baseline"):
            getattr(loo, peer)
        with pytest.raises(d.InputError, match="objective"):
            getattr(presets.DAPO.replace(objective=d.SAPO()), peer)
    with pytest.raises(d.InputError, match="mode"):
        presets.DAPO.replace(mode="seq_mean_token_sum").trl  # noqa: B018
    with pytest.raises(d.InputError, match="mode"):
        presets.CISPO.replace(mode="seq_mean_token_mean").trl  # noqa: B018
    with pytest.raises(d.InputError, match="objective"):  # TRL's delta must exceed 1 + eps_high
        presets.DAPO.replace(objective=ClipHigher(dual_clip=1.1)).trl  # noqa: B018


@given(objective=clip_objectives, mode=modes)
def test_objective_options_round_trip_through_the_adapters(
    objective: d.Objective, mode: str
) -> None:
    preset = presets.DAPO.replace(objective=objective, mode=mode)
    verl = preset.verl
    mode_name = str(verl["policy_loss.loss_mode"])
    config = {k: v for k, v in verl.items() if not k.startswith(("algorithm.", "reward_model."))}
    back = verl_objective(mode_name, config)
    if isinstance(objective, ClipHigher):  # verl's vanilla always dual-clips, 3.0 unless set
        assert back == objective.replace(dual_clip=objective.dual_clip or 3.0)
    else:
        assert back == GSPO(eps_low=objective.eps_low, eps_high=objective.eps_high, verl_clamp=True)
    assert verl["loss_agg_mode"] == mode.replace("_", "-")
    dual = objective.dual_clip if isinstance(objective, ClipHigher) else None
    if dual is not None and dual <= 1 + objective.eps_high:
        return  # refused for TRL (tested above)
    trl = preset.trl
    # TRL's sequence level keeps the clipped objective, evaluated on the sequence ratio;
    # its delta gives eps_high back as (1 + eps_high) - 1 (rounding)
    back = trl_objective(str(trl["loss_type"]), dict(trl))
    assert isinstance(back, ClipHigher) and back.dual_clip == dual
    assert (back.eps_low, back.eps_high) == pytest.approx((objective.eps_low, objective.eps_high))
    assert ("importance_sampling_level" in trl) == isinstance(objective, GSPO)
    assert trl["loss_type"] == {"token_mean": "dapo", "seq_mean_token_mean": "grpo"}.get(
        mode, "dr_grpo"
    )


@given(eps_high=eps)
def test_cispo_options_round_trip(eps_high: float) -> None:
    preset = presets.CISPO.replace(objective=CISPO(eps_low=1.0, eps_high=eps_high))
    verl = dict(preset.verl)
    assert verl_objective("cispo", verl) == preset.objective
    back = trl_objective("cispo", dict(preset.trl))
    assert isinstance(back, CISPO) and back.eps_high == pytest.approx(eps_high, rel=1e-12)


def test_the_documented_mappings() -> None:
    """docs/presets.md's table, for the presets as shipped."""
    assert presets.GRPO.verl["kl_loss_type"] == "low_var_kl" and presets.GRPO.trl["beta"] == 0.04
    assert presets.DAPO.verl["reward_model.overlong_buffer.enable"] is True
    assert presets.GSPO.trl["importance_sampling_level"] == "sequence"
    assert dict(presets.CISPO.trl) == {
        "loss_type": "cispo",
        "epsilon_high": 1.28,
        "beta": 0.0,
        "scale_rewards": "group",
        "mask_truncated_completions": False,
    }
    with pytest.raises(TypeError):
        presets.DAPO.verl["clip_ratio_high"] = 0.3  # type: ignore[index]


def test_unknown_preset_names_the_valid_ones() -> None:
    with pytest.raises(KeyError) as info:
        presets.PRESETS["dapoo"]
    assert isinstance(info.value, presets.UnknownPresetError)
    assert isinstance(info.value, d.InputError)
    assert str(info.value) == (
        "no preset 'dapoo'; the presets are 'dapo', 'grpo', 'dr_grpo', 'gspo', 'cispo'"
    )
    assert presets.PRESETS.get("dapoo") is None and "dapoo" not in presets.PRESETS
    assert list(presets.PRESETS) == ["dapo", "grpo", "dr_grpo", "gspo", "cispo"]
    assert all(presets.PRESETS[name].name == name for name in presets.PRESETS)
