"""The rows of :mod:`dapo_ops.integrations.peers`: what each peer calls a feature, and ours."""

from __future__ import annotations

import importlib
import re
from typing import NamedTuple


class Row(NamedTuple):
    family: str
    feature: str
    dapo_ops: str  # "; "-separated calls whose leading names must exist; "" not applicable
    trl: tuple[str, ...] = ()
    verl: tuple[str, ...] = ()
    openrlhf: tuple[str, ...] = ()
    note: str = ""
    verl_kind: str = "loss"  # "loss", "estimator" (checked against the adapter) or "option"


#: Where a dapo_ops name may live (the trainer class is built on first access: not imported).
_MODULES = ("dapo_ops", *(f"dapo_ops.integrations.{m}" for m in (
    "trl", "trl_sampling", "openrlhf", "verl", "verl_losses", "verl_composed", "verl_sampling",
    "verl_estimators", "verl_advantages", "verl_distill", "verl_value")))  # fmt: skip
_LAZY = {"DapoGRPOTrainer"}


def _exists(name: str) -> bool:
    if name in _LAZY:
        return True
    head, _, attr = name.rpartition(".")
    if head:  # a module of dapo_ops.integrations, then the name in it
        return hasattr(importlib.import_module(f"dapo_ops.integrations.{head}"), attr)
    return any(name in vars(importlib.import_module(m)) for m in _MODULES)


def resolve(text: str) -> str:
    """``text`` unchanged, after checking that each item's leading name exists."""
    for item in filter(None, (s.strip() for s in text.split(";"))):
        match = re.match(r"[A-Za-z_][\w.]*", item)
        if match is None or not _exists(match.group(0)):
            raise LookupError(f"the comparison names {item!r}, which dapo_ops does not have")
    return text


_OBJ, _AGG, _KL, _ADV = "objective", "aggregation", "KL estimator", "advantage estimator"
_DIST = "distillation term"
_VS_VERL = ("compared with verl's compute_distillation_loss_reverse_kl_estimator and "
            "distillation_ppo_loss (float64, value and gradient)")  # fmt: skip
_TD = "tests/integration/test_trl_distill_trainers.py"
_TS = "tests/integration/test_trl_self_distill.py"
_TA = "tests/integration/test_trl_async_distill.py"
_RC, _SEL, _REG, _OPT, _FILTER = (
    "rollout correction", "token selection", "regulariser", "option", "batch filter")  # fmt: skip
_CLIPPED = tuple(f"loss_type={t}" for t in ("dapo", "bnpo", "grpo", "dr_grpo", "luspo"))
_IS_TRL = "vllm_importance_sampling_correction"

# fmt: off
ROWS: list[Row] = [
    Row(_OBJ, "PPO clipped surrogate, Clip-Higher (DAPO)", "ClipHigher", _CLIPPED, ("vanilla",),
        ('policy_loss_type="ppo"',), "the TRL loss types differ by their aggregation (below)"),
    Row(_OBJ, "dual clip (Ye et al. 2020)", "ClipHigher(dual_clip=c)", ("delta",), ("clip_ratio_c",),
        ("dual_clip",), "TRL's delta <= 1 + epsilon_high is ClipHigher(eps_high=delta - 1, "
        "dual_clip=1 + epsilon_high)", verl_kind="option"),
    Row(_OBJ, "GSPO: the sequence ratio (Zheng et al. 2025)", "GSPO; trl_policy_loss; "
        "openrlhf_policy_loss", ('importance_sampling_level="sequence"',), ("gspo",),
        ('policy_loss_type="gspo"',), "TRL and OpenRLHF: any objective on the sequence ratio; "
        "verl's clamp (at 10, from above only): GSPO(verl_clamp=True)"),
    Row(_OBJ, "CISPO (MiniMax-M1 2025)", "CISPO", ("loss_type=cispo",), ("cispo",), (),
        "TRL's cap below 1 (its default epsilon_high = 0.2): PolicyGradient with the capped "
        "ratio as weight"),
    Row(_OBJ, "SAPO: soft gates", "SAPO", ("loss_type=sapo",), ("sapo",)),
    Row(_OBJ, "VESPO: gamma-shaped sequence weight", "VESPO", ("loss_type=vespo",), (), (),
        "vLLM's ratio folded into the weight as TRL (at the valid tokens: TRL's is 1 at padding)"),
    Row(_OBJ, "DPPO, total-variation trust region", 'DPPO(divergence="tv")', (), ("dppo_tv",)),
    Row(_OBJ, "DPPO, KL trust region", 'DPPO(divergence="kl")', (), ("dppo_kl",)),
    Row(_OBJ, "GMPO: geometric-mean ratio", "GMPO", (), ("geo_mean",),
        note="per-token advantages: the clip side by each token's sign, the row mean as weight; "
        "verl's per-sequence geometric-mean IS weight in the twin"),
    Row(_OBJ, "DRO", "DRO", (), ("dro",)),
    Row(_OBJ, "policy gradient (GPG)", "PolicyGradient", (), ("gpg",)),
    Row(_OBJ, "TOPR: Tapered Off-Policy REINFORCE (Le Roux et al. 2025)", "TOPR", (), (), (),
        "ROLL's loss (postive_loss_coef, use_topr_neg_loss_coef); ROLL is not installable here: "
        "compared with a float64 reference of its formula (tests/test_peer_formulas.py)"),
    Row(_OBJ, "PPO clipped value (critic) loss", "value_loss; verl_value.compute_value_loss", (),
        ("compute_value_loss", "critic.cliprange_value"), (), "every loss_agg_mode, float64 value "
        "and gradient against verl's (tests/integration/test_verl_value.py)", verl_kind="option"),
    Row(_OBJ, "Clip-Cov (Cui et al. 2025)", "clip_cov_mask; RatioSurrogate", (), ("clip_cov",)),
    Row(_OBJ, "KL-Cov (Cui et al. 2025)", "kl_cov_mask; policy_loss(kl_weights=...)", (),
        ("kl_cov",)),
    Row(_AGG, "token mean over the step's tokens (DAPO)",
        'token_level_aggregate(mode="token_mean", normalizer=global_normalizer(...))',
        ("loss_type=dapo", "loss_type=cispo", "loss_type=vespo"), ('loss_agg_mode="token-mean"',),
        ("token_level_loss=True",), verl_kind="option"),
    Row(_AGG, "token mean over the micro-batch, times the accumulation steps",
        'token_level_aggregate(mode="token_mean", normalizer=n * steps)', ("loss_type=bnpo",)),
    Row(_AGG, "token sum", 'token_level_aggregate(mode="token_mean", normalizer=1 / dp_size)', (),
        ('loss_agg_mode="token-sum"',), verl_kind="option"),
    Row(_AGG, "mean over sequences of their token means (GRPO)",
        'token_level_aggregate(mode="seq_mean_token_mean")', ("loss_type=grpo", "loss_type=sapo"),
        ('loss_agg_mode="seq-mean-token-mean"',), ("token_level_loss=False",),
        "verl and OpenRLHF divide a row by n + 1e-8 (a relative 1e-8 / n); TRL counts empty rows",
        verl_kind="option"),
    Row(_AGG, "mean over sequences of their token sums", 'token_level_aggregate(mode='
        '"seq_mean_token_sum")', ("loss_type=luspo",), ('loss_agg_mode="seq-mean-token-sum"',),
        verl_kind="option"),
    Row(_AGG, "Dr. GRPO: token sums over a constant", 'token_level_aggregate(mode='
        '"seq_mean_token_sum_norm", max_len=L)', ("loss_type=dr_grpo",),
        ('loss_agg_mode="seq-mean-token-sum-norm"',), verl_kind="option"),
    Row(_AGG, "mean over prompts of their token means (SkyRL prompt_mean)",
        "prompt_mean_aggregate; prompt_mean_weights", note="SkyRL's loss_reduction="
        '"prompt_mean" (SkyRL main; no release on the index has it): tested against its '
        "definition and its own test's example"),
    Row(_KL, "k1: log-ratio", 'KLPenalty(estimator="k1"); openrlhf_kl', (), ("kl", "k1"),
        ('kl_estimator="k1"',), "OpenRLHF clamps every estimate to +-10", verl_kind="option"),
    Row(_KL, "k2: half squared log-ratio", 'KLPenalty(estimator="k2"); openrlhf_kl', (),
        ("mse", "k2"), ('kl_estimator="k2"',), verl_kind="option"),
    Row(_KL, "k3: low-variance unbiased (GRPO)", 'KLPenalty(estimator="k3", clamp=10.0); '
        "openrlhf_kl", ("beta",), ("low_var_kl", "k3"), ('kl_estimator="k3"',),
        "TRL does not clamp: KLPenalty(estimator=\"k3\")", verl_kind="option"),
    Row(_KL, "absolute log-ratio", 'KLPenalty(estimator="abs")', (), ("abs",), verl_kind="option"),
    Row(_KL, "straight-through: the estimate's value, k2's gradient",
        "KLPenalty(straight_through=True); openrlhf_kl", (), ("k1+", "k3+", "low_var_kl+"),
        ("unbiased_gradient=True",), "OpenRLHF weights the gradient by min(ratio to the old "
        "policy, 10)", verl_kind="option"),
    Row(_KL, "KL in the reward, fixed or adaptive coefficient (Ziegler et al. 2019)",
        "kl_reward; adaptive_kl_coef; verl_value.apply_kl_penalty", (),
        ("apply_kl_penalty", "AdaptiveKLController", "FixedKLController"), (),
        "algorithm.use_kl_in_reward; float64 against verl's, every kl_penalty",
        verl_kind="option"),
    Row(_KL, "KL term times the (token or sequence) ratio", "trl_policy_loss", (
        "use_bias_correction_kl",)),
    Row(_DIST, "reverse KL to a teacher, k1 (log-ratio): as the advantage",
        'TeacherKL(estimator="k1"); distill_advantages', (), ("kl", "k1"),
        note=f"{_VS_VERL}; as a loss term refused (its gradient ignores the teacher), as verl",
        verl_kind="distill"),
    Row(_DIST, "reverse KL to a teacher, k2 (half squared log-ratio)", 'TeacherKL(estimator="k2")',
        (), ("mse", "k2"), note=_VS_VERL, verl_kind="distill"),
    Row(_DIST, "reverse KL to a teacher, k3 (low variance)", 'TeacherKL(estimator="k3")', (),
        ("low_var_kl", "k3"), note=f"{_VS_VERL}; verl's k3 value clamp +-10 is the default "
        "clamp=10.0", verl_kind="distill"),
    Row(_DIST, "reverse KL to a teacher, absolute log-ratio", 'TeacherKL(estimator="abs")', (),
        ("abs",), note=_VS_VERL, verl_kind="distill"),
    Row(_DIST, "forward KL over the teacher's top-k tokens", "linear_distill_loss(..., "
        "teacher_ids=ids); verl_distill.compute_forward_kl_topk", (), ("forward_kl_topk",),
        note="from the hidden states, no logits tensor; compared with verl's logits processor "
        "(float64 value and gradient; verl's KL runs in float32) and its registered function "
        "(loss, gradient, metrics)", verl_kind="distill"),
    Row(_DIST, "generalised JSD / forward / reverse KL to the teacher's logits (GKD)",
        'linear_distill_loss(..., kind="jsd")', ("GKDTrainer.generalized_jsd_loss",
        "GOLDTrainer.generalized_jsd_loss", "IWOPDTrainer.generalized_jsd_loss"),
        note="from the hidden states, no logits tensor; compared with TRL's for every beta, "
        "temperature and reduction (float64, value and gradient; GKD in "
        "tests/integration/test_linear_distill_peers.py, GOLD (logits_are_probs too) and "
        f"IW-OPD (top_k=0) in {_TD})"),
    Row(_DIST, "the same from both models' hidden states, chunked (DistillationTrainer)",
        'linear_distill_loss(..., kind="jsd")', ("distillation_trainer._chunked_divergence_loss",),
        note=f"compared in {_TD}: every beta, temperature, num_items_in_batch, lm_head bias, "
        "logit_scale (folded into the weight and bias), the entropy metric; float32 (TRL's "
        "kernel computes in float32 whatever the input); the teacher's logits are passed "
        "whole; final_logit_softcapping (c tanh(z / c), Gemma): softcap=c on the student's "
        "logits, the teacher's capped by the caller (compared for c = None, 30, 2)"),
    Row(_DIST, "top-k forward KL with a tail bucket or renormalised (IW-OPD top_k, beta=0)",
        'linear_distill_loss(..., topk=k, topk_tail="bucket" or "renormalize")',
        ("IWOPDTrainer.generalized_jsd_loss",), note=f"compared in {_TD}: add_tail True and "
        "False, three reductions, float64 value and gradient at every token"),
    Row(_DIST, "top-k support chosen by the student or both, sparse top-1 (IW-OPD beta > 0)",
        'linear_distill_loss(..., topk=k, topk_support="student" or "union", kind="jsd", '
        'topk_tail=...)', ("IWOPDTrainer.generalized_jsd_loss",
        "_compute_local_sparse_top_1_divergence_loss"), note=f"compared in {_TD}: every beta, "
        "both tails, float64 value and gradient; sparse top-1: topk=1 (argmax mode) or "
        "{teacher's argmax, sampled token} as teacher_ids; where TRL floors 1 - P at 1e-7 "
        "dapo_ops keeps the exact tail (those positions left out)"),
    Row(_DIST, "IW-OPD: sampled-token teacher advantage, prefix-weighted", "distill_advantages; "
        'TeacherKL(estimator="k1", clamp=None, log_ratio_clamp=None); PolicyGradient; '
        "iw_opd_weights; policy_loss(..., is_weights=w)", ("IWOPDTrainer._compute_iw_opd_loss",),
        note=f"compared in {_TD} (float64, value, gradient, metrics); iw_opd_weights are TRL's "
        "w_t = 1 + gamma (1 - S_t / max(S, eps)), S_t the sum of abs(A_u) over u < t"),
    Row(_DIST, "self-distillation, full vocabulary (SDFT, SDPO full_logits)",
        'linear_distill_loss(..., kind="jsd", mode="seq_mean_token_mean")',
        ("compute_full_logit_self_distillation_loss", "compute_divergence"), note=f"in {_TS} "
        "via _compute_self_distillation_loss: alpha is beta, every alpha and temperature, "
        "normalizer = rows, fully masked rows; float64 value, gradient, metric"),
    Row(_DIST, "self-distillation, sampled token (SDFT, SDPO sampled_token)",
        'distill_advantages; TeacherKL(estimator="k1", clamp=None, log_ratio_clamp=None); '
        "PolicyGradient; truncated_is_weights; policy_loss(..., is_weights=w)",
        ("compute_sampled_token_self_distillation_loss", "apply_importance_sampling_clipping"),
        note=f"in {_TS}: A = log pi_T - log pi; distillation_is_clip C is truncated_is_weights"
        "(logp, old_logp, mask, cap=C); float64 value, gradient, metric"),
    Row(_DIST, "clipped ratio weighting a logit divergence (SDFT, SDPO distillation_is_clip)",
        "truncated_is_weights; linear_distill_loss(..., is_weights=w)",
        ("apply_importance_sampling_clipping",), note="l_t min(exp(clip(log pi(y_t) - log "
        f"pi_old(y_t), -20, 20)), C): compared in {_TS}, float64 value and gradient"),
    Row(_DIST, "SDPO: policy loss and self-distillation blended", "trl_policy_loss; "
        "linear_distill_loss", ("SDPOTrainer.compute_loss", "SDPOTrainer._compute_policy_loss"),
        note=f"(1 - w) policy + w distillation in {_TS}: every loss_type (SDPO's dapo is "
        "trl_policy_loss's bnpo), token and sequence level; float64 value and gradient"),
    Row(_DIST, "top-k forward KL, tail or renormalised (SDFT/SDPO topk_logits alpha=0, "
        "server and async distillation beta=0)", 'linear_distill_loss(..., teacher_ids=ids, '
        'topk_tail="bucket" or "renormalize")', ("compute_topk_self_distillation_loss",
        "SDFTTrainer._compute_server_distillation_loss", "_compute_server_forward_kl_loss",
        "_chunked_jsd_loss"), note="ids the student's or the teacher's top-k "
        f"(padding: a -inf log-prob); compared in {_TS}, {_TA} (async: float32)"),
    Row(_DIST, "reverse KL or JSD over a top-k support (SDFT/SDPO alpha > 0, async beta > 0)",
        'linear_distill_loss(..., kind="jsd" or "reverse_kl", topk_tail=..., '
        'topk=k, topk_support="student" or teacher_ids=ids)', ("compute_topk_self_distillation_loss",
        "_narrow_top1_actual_support", "_chunked_jsd_loss"), note="alpha (beta) is beta, 1 is "
        f"reverse_kl; compared in {_TS} (float64) and {_TA} ({{teacher's argmax, sampled "
        "token} as teacher_ids, float32), value and gradient"),
    Row(_DIST, "ULD: L1 between sorted probabilities across tokenizers (GOLD use_uld_loss)", "",
        ("ULDLoss",), note="cross-tokenizer alignment and a sorted-probability L1: no dapo_ops "
        "loss has it"),
    Row(_DIST, "teacher term as a supervised loss beside the policy loss",
        "distill_loss; policy_loss(..., teacher_logp=t, distill=TeacherKL())", (),
        ("use_policy_gradient=False",), note=f"{_VS_VERL}; exact across micro-batches with "
        "global_normalizer", verl_kind="option"),
    Row(_DIST, "teacher term as the advantage (policy gradient)", "distill_advantages", (),
        ("use_policy_gradient=True",), note=_VS_VERL, verl_kind="option"),
    Row(_DIST, "task rewards beside distillation, weighted", "TeacherKL(beta=c); "
        "distill_advantages(..., task_advantages=A)", (), ("use_task_rewards",
        "distillation_loss_coef"), note=f"{_VS_VERL}: verl's form, compared, is "
        "policy_loss(A) + policy_loss(distill_advantages(...)); task_advantages=A sums the "
        "advantages instead (equal while the ratio is 1)", verl_kind="option"),
    Row(_DIST, "clamp of the per-token distillation loss", "TeacherKL(clamp=c)", (),
        ("loss_max_clamp",), note=_VS_VERL, verl_kind="option"),
    Row(_DIST, "floor on student and teacher log-probs", "TeacherKL(logp_min=m)", note="verl's "
        "log_prob_min_clamp acts on its top-k loss only: linear_distill_loss(..., "
        "log_prob_min_clamp=m) there, compared with it"),
    Row(_DIST, "several teachers, weighted", "TeacherKL(weights=w)", note="verl routes each "
        "sample to one teacher (teacher_key): pass the routed log-probs as one [batch, seq]"),
    Row(_ADV, "GAE", "gae_advantages", (), ("gae",), verl_kind="estimator"),
    Row(_ADV, "GRPO group-normalised outcome", 'group_advantages(singleton="score"); '
        "trl_advantages", ('scale_rewards="group"', '"batch"', '"none"',
        "multi_objective_aggregation"), ("grpo", "grpo_vectorized"), verl_kind="estimator"),
    Row(_ADV, "GDPO: per-component group normalisation", "gdpo_advantages", (), ("gdpo",),
        verl_kind="estimator"),
    Row(_ADV, "pass@k advantage", "passk_advantages", (), ("grpo_passk",), verl_kind="estimator"),
    Row(_ADV, "REINFORCE++ (discounted returns, whitened)", "reinforce_pp_advantages", (),
        ("reinforce_plus_plus",), verl_kind="estimator"),
    Row(_ADV, "REINFORCE++ with group baseline", "masked_whiten; group_advantages", (),
        ("reinforce_plus_plus_baseline",), verl_kind="estimator"),
    Row(_ADV, "RLOO: leave-one-out baseline", 'group_advantages(baseline="leave_one_out")', (),
        ("rloo", "rloo_vectorized"), verl_kind="estimator"),
    Row(_ADV, "OPO: length-weighted baseline", "opo_advantages", (), ("opo",),
        verl_kind="estimator"),
    Row(_ADV, "ReMax: greedy-rollout baseline", "remax_advantages", (), ("remax",),
        verl_kind="estimator"),
    Row(_ADV, "GPG: group baseline, rescaled", "gpg_advantages", (), ("gpg",),
        verl_kind="estimator"),
    Row(_ADV, "MaxRL: group baseline over the group mean (Tajwar et al. 2026)",
        "maxrl_advantages", (), (), (), "SkyRL's and prime-rl's maxrl; not installable here: "
        "compared with a float64 reference of SkyRL's compute_maxrl_advantage "
        "(tests/test_peer_formulas.py)"),
    Row(_ADV, "optimal token baseline", "optimal_token_baseline_advantages", (),
        ("optimal_token_baseline",), (), "verl's trainer passes sum_pi_squared to its own name "
        "only: verl_estimators.register_estimators(replace_verl=True)", verl_kind="estimator"),
    Row(_ADV, "optimal token baseline, per response token",
        'optimal_token_baseline_advantages(align="response_token")', (),
        ("tir_optimal_token_baseline",), verl_kind="estimator"),
    Row(_RC, "truncated IS weight, per token", 'truncated_is_weights(level="token")', (),
        ('rollout_is="token"',), verl_kind="option"),
    Row(_RC, "truncated IS weight, per sequence", 'truncated_is_weights(level="sequence")', (),
        ('rollout_is="sequence"',), verl_kind="option"),
    Row(_RC, "two-sided IS band (IcePop)", "truncated_is_weights(lower=..., cap=...)", (),
        ('rollout_is_threshold="lower_upper"',), verl_kind="option"),
    Row(_RC, "batch-normalised IS weights", "truncated_is_weights(batch_normalize=True)", (),
        ("rollout_is_batch_normalize",), verl_kind="option"),
    *[
        Row(_RC, f"rejection: {level} {stat}", f'rejection_mask(level="{level}", statistic="{stat}")',
            (), (f"rollout_rs={level.replace('sequence', 'seq')}_{stat}",), verl_kind="option")
        for level, stat in [("token", "k1"), ("token", "k2"), ("token", "k3"),
                            ("seq_sum", "k1"), ("seq_sum", "k2"), ("seq_sum", "k3"),
                            ("seq_mean", "k1"), ("seq_mean", "k2"), ("seq_mean", "k3"),
                            ("seq_max", "k2"), ("seq_max", "k3")]
    ],
    Row(_RC, "off-policy metrics (KL, PPL, chi2)", "offpolicy_metrics", (),
        ("compute_offpolicy_metrics",), verl_kind="option"),
    Row(_RC, "effective sample size of the IS weights", "offpolicy_metrics(is_weights=...)", (),
        ("rollout_is_eff_sample_size",), verl_kind="option"),
    Row(_RC, "rollout log-probs as the old policy", "verl_bypass.bypass_step", (),
        ("bypass_mode",)),
    Row(_RC, "vLLM importance-sampling ratio (computed by TRL)", "policy_loss(is_weights=...)",
        (_IS_TRL, 'vllm_importance_sampling_mode="token_truncate"', '"token_mask"',
         '"sequence_truncate"', '"sequence_mask"'), note="DapoGRPOTrainer takes TRL's ratio"),
    Row(_RC, "mismatch gate on the ratio: drop, keep the token ratio",
        "openrlhf.correction_weights", (), (), ('is_correction_level="token"', '"seq"',
        'is_correction_mode="mask"', 'is_correction_gating="ratio"')),
    Row(_RC, "mismatch gate on the ratio: clamp to the band", "openrlhf.correction_weights", (),
        (), ('is_correction_mode="clip"',)),
    Row(_RC, "mismatch gate on a divergence (binary KL, TV)", "openrlhf.correction_weights", (),
        (), ('is_correction_gating="binary_kl"', '"tv"')),
    Row(_SEL, "highest-entropy tokens (80/20)", "high_entropy_mask", ("top_entropy_quantile",)),
    Row(_SEL, "M2PO: drop the largest squared log-ratios until their mean is below a bound "
        "(Zheng et al. 2025)", "m2po_mask", (), (), (), "AReaL's m2_threshold "
        "(_apply_m2po_masking); AReaL is not installable here: compared with the formula, a "
        "float64 reference of its selection (tests/test_peer_filters.py)"),
    Row(_SEL, "off-policy negative sequences (DeepSeek-V3.2)", "off_policy_sequence_mask",
        ("off_policy_mask_threshold",)),
    Row(_REG, "entropy bonus", "entropy_bonus", ("entropy_coef",), ("entropy_coeff",),
        ("entropy_coef",), "each peer aggregates the entropy its own way: docs/entropy.md",
        verl_kind="option"),
    Row(_REG, "adaptive entropy coefficient (Skywork-OR1)", "adaptive_entropy_coef",
        ("use_adaptive_entropy", "entropy_target", "entropy_coef_delta", "entropy_coef_min",
         "entropy_coef_max"), note="DapoGRPOTrainer keeps TRL's state and checkpoint file"),
    Row(_REG, "MoE router (load-balancing) loss", "DapoGRPOTrainer", ("router_aux_loss_coef",),
        note="the model's own loss, added as TRL adds it"),
    Row(_REG, "soft overlong punishment (DAPO)", "overlong_reward; OverlongReward",
        ("get_soft_overlong_punishment",)),
    Row(_REG, "truncated-response penalty: scale or replace the reward (ProRL)",
        "truncation_penalty", (), (), ("stop_properly_penalty_coef",), "bitwise against "
        "OpenRLHF's apply_stop_properly_penalty (tests/integration/test_openrlhf_truncation.py); "
        "NeMo-RL's stop_properly_penalty_coef (apply_reward_shaping): compared with the formula"),
    Row(_OPT, "delta with cispo, sapo or vespo", "", ("delta",), note="TRL ignores delta for "
        "these loss types; DapoGRPOTrainer refuses an option that would be ignored"),
    Row(_OPT, "delta <= 1", "", ("delta",), note="caps every ratio at or below 1: no token "
        "with a positive advantage may gain probability; refused as a mis-set option"),
    Row(_OPT, "cispo with epsilon_high <= 0", "", ("epsilon_high",), note="a cap <= 0 zeroes "
        "every weight, hence every gradient; refused"),
    Row(_FILTER, "PF-PPO: resample towards extreme rewards (Shen et al. 2024)",
        "pf_ppo_weights; pf_ppo_resample; verl_value.compute_pf_ppo_reweight_data", (),
        ("compute_pf_ppo_reweight_data", "algorithm.use_pf_ppo"), (), "the same indices as "
        "verl's under the same seed, every reweight_method", verl_kind="option"),
    Row(_FILTER, "drop groups with a constant metric, generate more (DAPO)",
        "verl_sampling.filter_groups; DapoGRPOTrainer(dynamic_sampling=True)", (),
        ("algorithm.filter_groups",), (), "TRL 1.16 has none: DapoGRPOTrainer adds it; verl "
        "keeps one-sample groups (keep_single_sample_groups=False: as dapo_ops)",
        verl_kind="option"),
    Row(_FILTER, "drop groups whose mean metric lies outside a band (difficulty filter)",
        "difficulty_band_mask", (), (), (), "ROLL's difficulty_mask (difficulty_low_threshold, "
        "difficulty_high_threshold); ROLL is not installable here: compared with the formula "
        "(tests/test_peer_filters.py)"),
]
# fmt: on
