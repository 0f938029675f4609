"""What the peers ship, and the dapo_ops value or function that reproduces each.

One row per peer feature: the peer, its name there, the family, and the dapo_ops
equivalent, or why there is none yet. The rows for verl's losses and TRL's loss types
are read from the adapters' own tables (:data:`~dapo_ops.integrations.verl_losses.VERL_LOSS_MODES`,
:data:`~dapo_ops.integrations.trl.TRL_LOSS_TYPES`), so they cannot claim more than the
adapters do. ``python -m tools.feature_table`` writes docs/comparison.md from
:func:`feature_rows`; a test fails when that page is stale.

Example:
    >>> [r.equivalent for r in feature_rows() if r.peer == "verl" and r.name == "sapo"]
    ['SAPO (verl_losses: dapo_ops_sapo)']
"""

from __future__ import annotations

from typing import NamedTuple

from dapo_ops.integrations.trl import TRL_LOSS_TYPES
from dapo_ops.integrations.verl_losses import VERL_LOSS_MODES, verl_objective


class Feature(NamedTuple):
    family: str  # "objective", "KL estimator", "advantage estimator", "rollout correction", ...
    peer: str  # "verl 0.9.1", "TRL 1.16"
    name: str  # the peer's name for it
    equivalent: str  # the dapo_ops value or call, "" when there is none
    note: str = ""  # why not, or what differs


_VERL_LOSSES = [
    "vanilla",
    "dppo_tv",
    "dppo_kl",
    "gspo",
    "sapo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "geo_mean",
    "dro",
    "cispo",
    "bypass_mode",
]
_VERL_LOSS_GAPS = {
    "clip_cov": "batch-level covariance selection with torch.randperm (not reproducible)",
    "kl_cov": "batch-level top-k covariance selection (a host sync)",
    "bypass_mode": "a rollout-correction mode of verl's trainer, not a loss formula",
}
_TRL_LOSSES = ["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
_KL = {
    "k1": 'KLPenalty(estimator="k1")',
    "kl": 'KLPenalty(estimator="k1")',
    "abs": 'KLPenalty(estimator="abs")',
    "k2": 'KLPenalty(estimator="k2")',
    "mse": 'KLPenalty(estimator="k2")',
    "low_var_kl": 'KLPenalty(estimator="k3", clamp=10.0)',
    "k3": 'KLPenalty(estimator="k3", clamp=10.0)',
    "k1+": 'KLPenalty(estimator="k1", straight_through=True)',
    "k3+": 'KLPenalty(estimator="k3", clamp=10.0, straight_through=True)',
    "low_var_kl+": 'KLPenalty(estimator="k3", clamp=10.0, straight_through=True)',
}
_ESTIMATORS = {
    "gae": "gae_advantages",
    "grpo": "group_advantages(singleton='score')",
    "grpo_vectorized": "group_advantages(singleton='score')",
    "grpo_passk": "passk_advantages",
    "reinforce_plus_plus": "reinforce_pp_advantages",
    "reinforce_plus_plus_baseline": "masked_whiten(group_advantages(scale='none', ...))",
    "rloo": "group_advantages(scale='none', baseline='leave_one_out', singleton='score')",
    "rloo_vectorized": "group_advantages(scale='none', baseline='leave_one_out')",
    "opo": "opo_advantages",
    "gpg": "gpg_advantages",
    "remax": "remax_advantages",
    "gdpo": "gdpo_advantages",
    "optimal_token_baseline": "optimal_token_baseline_advantages "
    "(verl: dapo_ops_optimal_token_baseline)",
    "tir_optimal_token_baseline": 'optimal_token_baseline_advantages(align="response_token") '
    "(verl: dapo_ops_tir_optimal_token_baseline)",
}
_OTB_NOTE = (
    "verl's trainer passes sum_pi_squared only to verl's own name: "
    "verl_estimators.register_estimators(replace_verl=True)"
)
_ESTIMATOR_NOTES = {"optimal_token_baseline": _OTB_NOTE, "tir_optimal_token_baseline": _OTB_NOTE}
_ROLLOUT = {
    "rollout_is=token": 'truncated_is_weights(level="token")',
    "rollout_is=sequence": 'truncated_is_weights(level="sequence")',
    "rollout_is_threshold='lower_upper'": "truncated_is_weights(lower=..., cap=...)",
    "rollout_is_batch_normalize": "truncated_is_weights(batch_normalize=True)",
    **{
        f"rollout_rs={opt}": f'rejection_mask(level="{opt.rsplit("_", 1)[0]}", '
        f'statistic="{opt.rsplit("_", 1)[1]}")'
        for opt in [
            "token_k1",
            "token_k2",
            "token_k3",
            "seq_sum_k1",
            "seq_sum_k2",
            "seq_sum_k3",
            "seq_mean_k1",
            "seq_mean_k2",
            "seq_mean_k3",
            "seq_max_k2",
            "seq_max_k3",
        ]
    },
    "compute_offpolicy_metrics": "offpolicy_metrics",
    "rollout_is_eff_sample_size": "offpolicy_metrics(is_weights=...).is_ess",
}
_TRL_OPTIONS = {
    "delta": ("dual_clip / ClipHigher(dual_clip=delta)", ""),
    "top_entropy_quantile": ("high_entropy_mask; DapoGRPOTrainer", ""),
    "off_policy_mask_threshold": ("off_policy_sequence_mask; DapoGRPOTrainer", ""),
    "entropy_coef / use_adaptive_entropy": ("", "entropy bonus not built yet"),
    "importance_sampling_level=sequence": ("GSPO via trl_objective; DapoGRPOTrainer", ""),
}


_BATCH_FILTERS = [
    Feature(
        "batch filter",
        "verl",
        "algorithm.filter_groups (metric, max_num_gen_batches)",
        "verl_sampling.filter_groups",
        "keeps one-sample groups as verl (keep_single_sample_groups=False: as dapo_ops)",
    ),
    Feature(
        "batch filter",
        "TRL",
        "dynamic sampling (TRL only logs frac_reward_zero_std)",
        "DapoGRPOTrainer(dynamic_sampling=True)",
        "TRL 1.16 has none",
    ),
]


def feature_rows() -> list[Feature]:
    """Every peer feature the parity issue lists, with its dapo_ops equivalent."""
    rows = []
    for name in _VERL_LOSSES:
        if name in VERL_LOSS_MODES:
            cls = type(verl_objective(name, {"policy_loss": {"dro_beta": 1.0}})).__name__
            rows.append(Feature("objective", "verl", name, f"{cls} (verl_losses: dapo_ops_{name})"))
        else:
            rows.append(Feature("objective", "verl", name, "", _VERL_LOSS_GAPS[name]))
    for name in _TRL_LOSSES:
        ok = name in TRL_LOSS_TYPES
        eq = f"DapoGRPOTrainer(loss_type={name!r}), trl_objective" if ok else ""
        rows.append(Feature("objective", "TRL", name, eq, "" if ok else "not built yet"))
    rows += [Feature("KL estimator", "verl", k, v) for k, v in _KL.items()]
    for name, eq in _ESTIMATORS.items():
        note = _ESTIMATOR_NOTES.get(name, "") if eq else "not built yet"
        rows.append(Feature("advantage estimator", "verl", name, eq, note))
    rows += [Feature("rollout correction", "verl", k, v) for k, v in _ROLLOUT.items()]
    rows += [Feature("option", "TRL", k, eq, note) for k, (eq, note) in _TRL_OPTIONS.items()]
    rows += _BATCH_FILTERS
    return rows


def markdown_table() -> str:
    """docs/comparison.md's body: one table per family."""
    out = [
        "# dapo_ops against verl 0.9.1 and TRL 1.16",
        "",
        "Generated by `python -m tools.feature_table` from `dapo_ops.integrations.peers`;",
        '`tests/test_docs.py` fails when this page is stale. Every "yes" row is tested',
        "against the real peer function in `tests/integration` (float64, value and",
        "gradient, or the documented difference).",
    ]
    rows = feature_rows()
    for family in dict.fromkeys(r.family for r in rows):
        out += ["", f"## {family[0].upper()}{family[1:]}s", ""]
        out += ["| peer | peer's name | dapo_ops | note |", "|---|---|---|---|"]
        for r in rows:
            if r.family == family:
                have = f"yes: `{r.equivalent}`" if r.equivalent else "no"
                out.append(f"| {r.peer} | `{r.name}` | {have} | {r.note} |")
    done = sum(bool(r.equivalent) for r in rows)
    out += ["", f"{done} of {len(rows)} rows have a dapo_ops equivalent.", ""]
    return "\n".join(out)
