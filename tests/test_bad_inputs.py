"""Generated bad-input suite (issue 15): no silent wrong answer from any public function.

Every public function of ``dapo_ops.__all__`` has one entry in :data:`REGISTRY`, a
:class:`Spec` naming its tensor arguments by role (:class:`Arg`: dtype kind, symbolic
shape, the mask whose False entries it is ignored at, whether it is a constant that must
not require grad, what a NaN/inf at a valid position must give), the valid non-tensor
arguments, and bad values for each option. Generic tests then feed every function

- NaN/inf at masked positions (the result must not change, bit for bit),
- NaN/inf at valid positions (``InputError``, or a non-finite result where the docstring
  says non-finite inputs propagate, or any value where it documents a finite one),
- a wrong dtype, the meta device, a shape that would broadcast, a Python list, and
  ``requires_grad`` on a constant (``InputError`` naming the argument),
- an empty batch (a finite result, no crash), non-contiguous views (the same result),
- each option out of range (``InputError`` naming the option).

Adding a public function: add one ``spec(...)`` line to :data:`REGISTRY`;
:func:`test_every_public_function_has_an_entry` fails until it is there.

Known gaps are listed in :data:`KNOWN`, each an ``xfail(strict=True)`` with the reason
(none today). The runtime annotation checker is off
here: these tests exercise the library's own checks, which run for every user.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import dapo_ops as d

pytestmark = pytest.mark.usefixtures("no_runtime_typecheck")

NAN, INF = math.nan, math.inf

#: Examples per hypothesis test: a fraction of the active profile's (ci: 5), because the
#: tests below are parametrized over every (function, argument) pair; no shrinking (the
#: failing example is reported as found), which keeps the known gaps below cheap.
EXAMPLES = max(4, settings().max_examples // 8)
FEW = settings(max_examples=EXAMPLES, phases=[Phase.explicit, Phase.reuse, Phase.generate])

# What a NaN or inf at a *valid* position must give.
RAISE = "raise"  # InputError
NONFINITE = "nonfinite"  # InputError, or a non-finite entry in the result (it propagates)
ANY = "any"  # a documented finite value: anything but a raw error

# --------------------------------------------------------------------------- the spec


@dataclasses.dataclass(frozen=True)
class Arg:
    """One tensor argument.

    kind: ``float``; ``mask`` (bool or 0/1 ints, [batch, seq]); ``ids`` (integer ids, e.g.
    tokens or group ids, in ``[0, high)``); ``count`` (non-negative lengths, integer or
    float); ``bool`` (a bool flag tensor). shape: symbols sized by :data:`SIZES` (``B``
    batch, ``S`` seq, ...). masked_by: the mask whose False entries this argument is
    ignored at (for a ``("B",)`` argument: the rows with no valid token). const: a
    constant of the objective, which must not require grad. nan/posinf/neginf: what a
    NaN, +inf or -inf at a valid position must give (RAISE, NONFINITE or ANY). lo/hi: the range of valid values; high: the id bound symbol.
    """

    kind: str
    shape: tuple[str, ...]
    masked_by: str | None = None
    const: bool = False
    nan: str = NONFINITE
    posinf: str = NONFINITE
    neginf: str = NONFINITE
    lo: float = -2.0
    hi: float = 2.0
    high: str = "V"
    float_dtype: torch.dtype = torch.float32
    bad_dtypes: tuple[torch.dtype, ...] | None = None  # None: BAD_DTYPES[kind]


@dataclasses.dataclass(frozen=True)
class Spec:
    """One public function: its tensor arguments, fixed valid arguments, bad options."""

    name: str
    args: Mapping[str, Arg]
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    options: Mapping[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)
    min_seq: int = 0  # the seq (samples per group) its valid arguments need at least
    empty: str = "finite"  # an empty batch gives finite results ("any": documented +-inf)

    @property
    def fn(self) -> Callable[..., Any]:
        return getattr(d, self.name)  # type: ignore[no-any-return]


def spec(
    name: str,
    options: Mapping[str, tuple[Any, ...]] | None = None,
    *,
    min_seq: int = 0,
    empty: str = "finite",
    **kw: Any,
) -> Spec:
    """``spec("fn", {option: bad values}, tensor_arg=Arg(...), other_arg=valid value)``."""
    args = {k: v for k, v in kw.items() if isinstance(v, Arg)}
    fixed = {k: v for k, v in kw.items() if not isinstance(v, Arg)}
    return Spec(name, args, fixed, options or {}, min_seq, empty)


@dataclasses.dataclass(frozen=True)
class Fresh:
    """A fixed argument made anew for every call (a seeded ``torch.Generator``: each call
    draws the same numbers, so two calls can be compared bit for bit)."""

    make: Callable[[], Any]


#: Extra dimension sizes (batch and seq are drawn; groups = batch, samples = seq).
SIZES = {"V": 7, "D": 3, "C": 2, "G": 3}

# Roles shared by many functions. A log-prob of +-inf at a valid position gives a finite
# value in the loss path, as documented: the log-ratio is clamped to +-log_ratio_clamp.
MASK = Arg("mask", ("B", "S"))
LOGP = Arg("float", ("B", "S"), masked_by="mask", lo=-3.0, hi=-0.05, posinf=ANY, neginf=ANY)
OLD = dataclasses.replace(LOGP, const=True)
ADV = Arg("float", ("B",), masked_by="mask", const=True)
TOKEN = Arg("float", ("B", "S"), masked_by="mask")  # a per-token value (loss, reward)
IS_W = Arg("float", ("B", "S"), masked_by="mask", const=True, lo=0.5, hi=1.5)
# Masks and metrics of log-probs: no gradient flows out, so none is refused; their
# comparisons of +-inf are the documented formula's (a +-inf mean is above/below any bound).
LOGP_M = dataclasses.replace(LOGP, const=False)
ADV_M = Arg("float", ("B",), masked_by="mask", posinf=ANY, neginf=ANY)
# Diagnostics count clip activity by the sign of A: +-inf advantages have a sign.
ADV_DIAG = Arg("float", ("B",), masked_by="mask", posinf=ANY, neginf=ANY)
ENTROPY = Arg("float", ("B", "S"), masked_by="mask", lo=0.0, hi=2.0)
# -inf logits are masked vocabulary entries (documented: they contribute 0)
LOGITS = Arg("float", ("B", "S", "V"), neginf=ANY)
TOKENS = Arg("ids", ("B", "S"), high="V")
# An inf in hidden or weight gives +-inf logits, by the signs of the other factor: all
# -inf (masked vocabulary entries, a finite result) is as documented as a NaN result.
HIDDEN = Arg("float", ("B", "S", "D"), posinf=ANY, neginf=ANY)
WEIGHT = Arg("float", ("V", "D"), posinf=ANY, neginf=ANY)
# linear_policy_loss ignores the hidden rows at masked positions (a NaN there changes
# nothing), so a NaN drawn anywhere in hidden need not reach the loss.
HIDDEN_LOSS = dataclasses.replace(HIDDEN, nan=ANY)

GROUP_IDS = Arg("ids", ("B",), high="G")
METRIC = Arg("float", ("B", "S"), nan=RAISE, posinf=RAISE, neginf=RAISE)  # [groups, samples]
SCORES = Arg("float", ("B", "S"))  # [groups, samples]; NaN propagates
LENGTHS = Arg("count", ("B",), nan=RAISE, posinf=RAISE, neginf=RAISE)

# The optimal token baseline's variance weights: a value enters only the baselines of its
# group at and after its slot, so where the baseline is 0 (a one-sample group, the zero
# tail) a non-finite one enters nothing (the documented formula).
OTB_LOGP = Arg(
    "float", ("B", "S"), masked_by="mask", lo=-3.0, hi=-0.05, nan=ANY, posinf=ANY, neginf=ANY
)

BAD_PROB = (-0.1, 1.0, NAN, INF, "0.2")  # an open-upper fraction such as eps_low
BAD_POS = (0.0, -1.0, NAN, INF, "1")  # a finite number > 0
BAD_NONNEG = (-1e-3, NAN, INF, "0")  # a finite number >= 0
BAD_INT1 = (0, -1, 2.5, NAN, True, "3")  # an int >= 1
BAD_BOOL = (1, "yes", None)
BAD_SOFTCAP = (0.0, -1.0, NAN, INF, True, "30")  # the final-logit cap: None or finite > 0
BAD_MODE = ("mean", "", None)
BAD_NORM = (0.0, -1.0, NAN, INF)  # normalizer: a count > 0
# the sampler's truncation: top_k an int >= 1 (None, 0, -1: off), top_p in (0, 1], min_p in [0, 1]
TRUNC_OPTS = {
    "top_k": (-2, 2.5, True, "3"),
    "top_p": (0.0, 1.5, NAN, INF, "0.9"),
    "min_p": (-0.1, 1.5, NAN, True),
}
# The covariance selections: nothing is differentiated (no constant to guard), and a
# non-finite input makes the covariance non-finite (no candidate, or a documented draw).
COV_LOGP = dataclasses.replace(LOGP_M, nan=ANY)
COV_ADV = dataclasses.replace(ADV_M, nan=ANY)
OBJ = d.ClipHigher()
KL = d.KLPenalty()
TEACHER = OLD  # a teacher's log-probs: a constant; +-inf gives a finite (clamped) loss
DISTILL = d.TeacherKL()
LINEAR_OPTS = {
    "mode": BAD_MODE,
    "normalizer": BAD_NORM,
    "max_len": BAD_INT1,
    "temperature": BAD_POS,
    "chunk_size": BAD_INT1,
    "entropy_coef": (NAN, INF, "0.1", None),
    "objective": (None, "clip"),
    "backend": ("cuda", "", None),
    "softcap": BAD_SOFTCAP,
    **TRUNC_OPTS,
}

# linear_distill_loss: the teacher's logits (a -inf logit: a masked vocabulary entry, 0),
# or its top-k log-probs at teacher_ids (a -inf log-prob contributes 0), constants.
TEACHER_LOGITS = Arg("float", ("B", "S", "V"), masked_by="mask", const=True, neginf=ANY)
TEACHER_TOPK = Arg(
    "float", ("B", "S", "C"), masked_by="mask", const=True, lo=-3.0, hi=-0.05, neginf=ANY
)
DISTILL_OPTS = {
    "mode": BAD_MODE,
    "normalizer": BAD_NORM,
    "max_len": BAD_INT1,
    "temperature": BAD_POS,
    "chunk_size": BAD_INT1,
    "kind": ("kl", "", None),
    "beta": (0.0, 1.0, NAN, "0.5"),
    "topk": (0, -1, 2.5, True, "3"),
    "log_prob_min_clamp": (NAN, INF, "1"),
    "loss_clamp": (0.0, -1.0, NAN, INF, "1"),
    "softcap": BAD_SOFTCAP,
    "topk_tail": ("tail", "", None, True),
    "topk_support": ("both", "", None, True),
}

REGISTRY: list[Spec] = [
    # ------------------------------------------------------------ loss path
    spec("aggregate_partial", {"mode": BAD_MODE, "max_len": BAD_INT1}, per_token_loss=TOKEN, mask=MASK),
    spec("clip_cov_mask", {"objective": (None, "clip", d.CISPO()), "fraction": (0.0, 1.5, NAN, "0.1"), "cov_low": (NAN, "1"), "cov_high": (NAN, None), "generator": ("seed", 0)}, logp=COV_LOGP, old_logp=COV_LOGP, advantages=COV_ADV, mask=MASK, generator=Fresh(lambda: torch.Generator().manual_seed(0))),
    spec("cispo_surrogate", {"cap": (0.5, NAN, INF), "floor": (-0.1, 1.5, NAN), "log_ratio_clamp": BAD_POS}, logp=LOGP, old_logp=OLD, advantages=ADV, mask=MASK),
    spec("clip_higher_surrogate", {"eps_low": BAD_PROB, "eps_high": (-0.1, NAN, INF), "dual_clip": (1.0, 0.5, NAN, INF), "log_ratio_clamp": BAD_POS}, logp=LOGP, old_logp=OLD, advantages=ADV, mask=MASK),
    spec("distill_advantages", {"distill": (None, KL)}, logp=LOGP_M, teacher_logp=TEACHER, mask=MASK, task_advantages=ADV, distill=DISTILL),
    spec("distill_loss", {"distill": (None, KL), "mode": BAD_MODE, "normalizer": BAD_NORM, "max_len": BAD_INT1}, logp=LOGP, teacher_logp=TEACHER, mask=MASK, distill=DISTILL),
    spec("entropy_bonus", {"coef": (NAN, INF, "0.1", None), "mode": BAD_MODE, "normalizer": BAD_NORM, "max_len": BAD_INT1}, entropy=ENTROPY, mask=MASK, coef=0.01),
    spec("gspo_sequence_ratio", logp=LOGP, old_logp=OLD, mask=MASK),
    spec("gspo_surrogate", {"eps_low": BAD_PROB, "eps_high": (-0.1, NAN, INF)}, logp=LOGP, old_logp=OLD, advantages=ADV, mask=MASK),
    spec("kl_cov_mask", {"fraction": (0.0, 1.5, NAN, "0.1")}, logp=COV_LOGP, advantages=COV_ADV, mask=MASK),
    spec("kl_penalty", {"estimator": ("k9", None), "log_ratio_clamp": BAD_POS, "clamp": BAD_POS, "straight_through": BAD_BOOL}, logp=LOGP, ref_logp=OLD, mask=MASK),
    spec("linear_distill_loss", DISTILL_OPTS, hidden=HIDDEN_LOSS, weight=WEIGHT, teacher=TEACHER_LOGITS, mask=MASK, bias=Arg("float", ("V",), neginf=ANY), is_weights=IS_W, kind="jsd"),
    spec("linear_distill_loss_with_diagnostics", DISTILL_OPTS, hidden=HIDDEN_LOSS, weight=WEIGHT, teacher=TEACHER_TOPK, mask=MASK, teacher_ids=Arg("ids", ("B", "S", "C"), high="V"), is_weights=IS_W, log_prob_min_clamp=-2.0, empty="any"),
    spec("linear_policy_loss", LINEAR_OPTS, hidden=HIDDEN_LOSS, weight=WEIGHT, tokens=TOKENS, old_logp=OLD, advantages=ADV, mask=MASK, bias=Arg("float", ("V",), neginf=ANY), ref_logp=OLD, is_weights=IS_W, kl=KL, entropy_coef=0.01),
    spec("linear_policy_loss_with_diagnostics", LINEAR_OPTS, hidden=HIDDEN_LOSS, weight=WEIGHT, tokens=TOKENS, old_logp=OLD, advantages=ADV, mask=MASK, bias=Arg("float", ("V",), neginf=ANY), ref_logp=OLD, is_weights=IS_W, kl=KL, entropy_coef=0.01, empty="any"),
    spec("objective_diagnostics", objective=OBJ, logp=LOGP_M, old_logp=LOGP_M, advantages=ADV_DIAG, mask=MASK, entropy=ENTROPY, empty="any"),
    spec("per_token_loss", objective=OBJ, logp=LOGP, old_logp=OLD, advantages=ADV, mask=MASK),
    spec("policy_diagnostics", {"objective": (None, "clip")}, logp=LOGP_M, old_logp=LOGP_M, advantages=ADV_DIAG, mask=MASK, empty="any"),
    spec("policy_loss", {"mode": BAD_MODE, "normalizer": BAD_NORM, "max_len": BAD_INT1, "compiled": BAD_BOOL, "distill": ("k3", KL)}, objective=OBJ, logp=LOGP, old_logp=OLD, advantages=ADV, mask=MASK, ref_logp=OLD, is_weights=IS_W, kl=KL, kl_weights=IS_W, teacher_logp=TEACHER, distill=DISTILL),
    spec("policy_loss_with_diagnostics", {"mode": BAD_MODE, "normalizer": BAD_NORM, "max_len": BAD_INT1, "distill": ("k3", KL)}, objective=OBJ, logp=LOGP, old_logp=OLD, advantages=ADV, mask=MASK, ref_logp=OLD, is_weights=IS_W, kl=KL, teacher_logp=TEACHER, distill=DISTILL, empty="any"),
    spec("iw_opd_weights", {"gamma": (-0.5, NAN, INF, "0.5", True), "eps": (0.0, -1.0, NAN, INF)}, advantages=TOKEN, mask=MASK),
    spec("prompt_mean_aggregate", {"num_prompts": BAD_NORM}, per_token_loss=TOKEN, mask=MASK, group_ids=GROUP_IDS),
    spec("prompt_mean_weights", {"num_prompts": BAD_NORM, "dtype": (torch.float16, torch.int64, "float32")}, mask=MASK, group_ids=GROUP_IDS),
    spec("token_level_aggregate", {"mode": BAD_MODE, "normalizer": BAD_NORM, "max_len": BAD_INT1}, per_token_loss=TOKEN, mask=MASK),
    spec("token_level_loss", {"eps_low": BAD_PROB, "eps_high": (-0.1, NAN, INF), "mode": BAD_MODE, "normalizer": BAD_NORM, "dual_clip": (1.0, NAN), "max_len": BAD_INT1, "log_ratio_clamp": BAD_POS, "kl_beta": BAD_NONNEG, "kl_estimator": ("k9",), "compiled": BAD_BOOL, "return_diagnostics": BAD_BOOL}, logp=LOGP, old_logp=OLD, advantages=ADV, mask=MASK, ref_logp=OLD, is_weights=IS_W, kl_beta=0.1),
    spec("value_loss", {"clip": BAD_POS, "mode": BAD_MODE, "normalizer": BAD_NORM, "max_len": BAD_INT1}, values=TOKEN, old_values=dataclasses.replace(TOKEN, const=True), returns=dataclasses.replace(TOKEN, const=True), mask=MASK),
    spec("truncated_is_weights", {"level": ("seq", None), "cap": BAD_POS, "lower": (-0.1, NAN, INF), "batch_normalize": BAD_BOOL}, old_logp=OLD, rollout_logp=OLD, mask=MASK),
    # ------------------------------------------------------------ log-probs
    spec("fused_logprobs_entropy", {"temperature": BAD_POS, "chunk_size": BAD_INT1, **TRUNC_OPTS, "backend": ("cuda", "", None), "softcap": BAD_SOFTCAP}, hidden=HIDDEN, weight=WEIGHT, tokens=TOKENS, bias=Arg("float", ("V",), neginf=ANY)),
    spec("token_entropy", {"temperature": BAD_POS, "chunk_size": BAD_INT1, **TRUNC_OPTS}, logits=LOGITS),
    spec("token_logprobs", {"temperature": BAD_POS, "chunk_size": BAD_INT1, "inplace_backward": BAD_BOOL, **TRUNC_OPTS}, logits=LOGITS, tokens=TOKENS),
    spec("token_logprobs_and_entropy", {"temperature": BAD_POS, "chunk_size": BAD_INT1, "inplace_backward": BAD_BOOL, **TRUNC_OPTS}, logits=LOGITS, tokens=TOKENS),
    # ------------------------------------------------------------ per batch
    spec("adaptive_entropy_coef", {"coef": (NAN, INF, "0.1"), "entropy": (NAN, "0.3", None), "target": (NAN, INF, "0.2"), "delta": (-0.1, NAN, INF), "coef_min": (NAN, 2.0), "coef_max": (NAN, -1.0)}, coef=0.1, entropy=0.3),
    spec("adaptive_kl_coef", {"coef": (NAN, INF, "0.1"), "current_kl": (NAN, "0.3", None), "target": (0.0, -1.0, NAN, INF, "0.1"), "n_steps": (-1, 2.5, True, "3"), "horizon": (0, -1, 2.5, True)}, coef=0.1, current_kl=0.3, n_steps=16),
    spec("batch_diagnostics", {"max_len": (*BAD_INT1, 2**63)}, lengths=LENGTHS, keep=Arg("bool", ("B",)), group_ids=GROUP_IDS, max_len=6),
    spec("difficulty_band_mask", {"low": (NAN, INF, "0.1", None), "high": (NAN, INF, 0.05, "0.9")}, metric=dataclasses.replace(METRIC, bad_dtypes=(torch.complex64,))),
    spec("dynamic_sample_mask", {"atol": BAD_NONNEG}, metric=dataclasses.replace(METRIC, bad_dtypes=(torch.complex64,))),
    spec("group_advantages", {"scale": ("std", None), "baseline": ("median",), "eps": BAD_NONNEG, "unbiased": BAD_BOOL, "singleton": ("nan",)}, rewards=METRIC),
    spec("kl_reward", {"coef": (NAN, INF, "0.1", None), "estimator": ("k9", None), "clamp": BAD_POS}, token_scores=TOKEN, logp=OLD, ref_logp=OLD, mask=MASK, coef=0.1),
    spec("kept_group_fraction", keep=Arg("bool", ("B",)), group_ids=GROUP_IDS),
    spec("overlong_filter", mask=MASK, truncated=Arg("bool", ("B",))),
    spec("overlong_reward", {"max_len": BAD_INT1, "cache_len": (0, -1, 7, 2.5, True), "factor": BAD_NONNEG}, lengths=LENGTHS, max_len=6, cache_len=3),
    spec("pf_ppo_resample", {"method": ("power", None), "weight_pow": (NAN, INF, "2"), "generator": ("seed", 0)}, scores=Arg("float", ("B",), nan=RAISE, posinf=RAISE, neginf=RAISE), generator=Fresh(lambda: torch.Generator().manual_seed(0))),
    spec("pf_ppo_weights", {"method": ("power", None), "weight_pow": (NAN, INF, "2")}, scores=Arg("float", ("B",))),
    spec("truncation_penalty", {"coef": (1.5, NAN, INF, "0.5", None)}, rewards=Arg("float", ("B",)), truncated=Arg("bool", ("B",)), coef=0.5),
    spec("prompts_to_generate", {"groups_needed": (-1, 2.5, NAN, INF, True), "kept_fraction": (-0.1, 1.5, NAN, INF, "0.5"), "min_fraction": (0.0, 1.5, NAN, INF), "max_prompts": BAD_INT1}, groups_needed=96, kept_fraction=0.4, max_prompts=512),
    # ------------------------------------------------------------ estimators, masks, metrics
    spec("gae_advantages", {"gamma": (-0.1, 1.5, NAN, INF), "lam": (-0.1, 1.5, NAN, INF), "whiten": BAD_BOOL}, rewards=TOKEN, values=TOKEN, mask=MASK),
    spec("gdpo_advantages", {"eps": BAD_NONNEG, "scale": BAD_BOOL}, components=Arg("float", ("B", "C"), nan=RAISE, posinf=RAISE, neginf=RAISE), group_ids=GROUP_IDS, mask=MASK, weights=Arg("float", ("C",), lo=0.5, hi=1.5)),
    spec("global_normalizer", {"mode": BAD_MODE, "grads_averaged_over_ranks": BAD_BOOL}, masks=MASK),
    spec("gpg_advantages", {"f_norm": BAD_POS}, scores=SCORES),
    spec("high_entropy_mask", {"top_quantile": (0.0, -0.5, 1.5, NAN, INF)}, entropies=dataclasses.replace(ENTROPY, nan=ANY, posinf=ANY, neginf=ANY), mask=MASK, top_quantile=0.2),
    spec("m2po_mask", {"threshold": (0.0, -1.0, NAN, INF, "0.04", True)}, old_logp=dataclasses.replace(LOGP_M, nan=ANY), rollout_logp=dataclasses.replace(LOGP_M, nan=ANY), mask=MASK, threshold=0.04),
    spec("masked_whiten", values=TOKEN, mask=MASK),
    spec("maxrl_advantages", {"eps": BAD_NONNEG}, scores=SCORES),
    spec("off_policy_sequence_mask", {"threshold": (NAN, "0.5")}, advantages=dataclasses.replace(ADV_M, nan=ANY), logp=dataclasses.replace(LOGP_M, nan=ANY), sampling_logp=dataclasses.replace(LOGP_M, nan=ANY), mask=MASK, threshold=0.5),
    spec("offpolicy_metrics", old_logp=LOGP_M, rollout_logp=LOGP_M, mask=MASK, is_weights=dataclasses.replace(IS_W, const=False)),
    spec("opo_advantages", scores=SCORES, lengths=Arg("count", ("B", "S"), float_dtype=torch.int64)),
    spec("optimal_token_baseline_advantages", {"align": ("turn", None), "zero_tail": BAD_BOOL, "eps": BAD_NONNEG}, rewards=TOKEN, old_logp=OTB_LOGP, sum_pi_squared=dataclasses.replace(OTB_LOGP, lo=0.2, hi=1.0), mask=MASK, group_ids=GROUP_IDS, is_weights=dataclasses.replace(OTB_LOGP, lo=0.5, hi=1.5)),
    spec("passk_advantages", {"eps": BAD_NONNEG, "scale": BAD_BOOL}, scores=SCORES, min_seq=2),
    spec("reinforce_pp_advantages", {"gamma": (-0.1, 1.5, NAN, INF)}, rewards=TOKEN, mask=MASK),
    spec("rejection_mask", {"statistic": ("k9",), "level": ("seq",), "upper": BAD_POS, "lower": (-0.1, NAN, INF)}, old_logp=dataclasses.replace(LOGP_M, nan=ANY), rollout_logp=dataclasses.replace(LOGP_M, nan=ANY), mask=MASK, upper=2.0),
    spec("remax_advantages", rewards=TOKEN, baselines=Arg("float", ("B",), masked_by="mask"), mask=MASK),
]  # fmt: skip

SPECS = {s.name: s for s in REGISTRY}

# --------------------------------------------------------------------------- known gaps

#: (test, function, argument or option) -> reason; "*" matches any argument. Each becomes
#: ``xfail(strict=True)``: a gap that gets fixed fails until it is removed from this table.
#: Empty: every function meets its spec line.
KNOWN: dict[tuple[str, str, str], str] = {}


def _known(test: str, name: str, arg: str) -> str | None:
    for key in ((test, name, arg), (test, name, "*"), ("*", name, arg), ("*", name, "*")):
        if key in KNOWN:
            return KNOWN[key]
    return None


def _cases(test: str, items: Iterator[tuple[Any, ...]]) -> list[Any]:
    """pytest params ``(spec name[, arg, ...])`` with their KNOWN xfail marks."""
    out = []
    for item in items:
        reason = _known(test, item[0], item[1] if len(item) > 1 else "*")
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(*item, id="-".join(map(str, item)), marks=marks))
    return out


# --------------------------------------------------------------------------- building calls


def _sizes(batch: int, seq: int) -> dict[str, int]:
    return {"B": batch, "S": seq, **SIZES}


def _mask(batch: int, seq: int, g: torch.Generator) -> torch.Tensor:
    """Random prefix masks with, when there are two rows or more, one full row and one
    empty row (so that both valid and masked entries, and a masked row, exist)."""
    lengths = torch.randint(0, seq + 1, (batch,), generator=g)
    if batch >= 2:
        lengths[0], lengths[-1] = seq, 0
    return torch.arange(seq) < lengths[:, None]


def _make(a: Arg, sizes: Mapping[str, int], g: torch.Generator) -> torch.Tensor:
    shape = tuple(sizes[s] for s in a.shape)
    if a.kind == "float":
        u = torch.rand(shape, generator=g, dtype=torch.float64)
        return (a.lo + (a.hi - a.lo) * u).to(a.float_dtype)
    if a.kind == "mask":
        return _mask(sizes["B"], sizes["S"], g)
    if a.kind == "ids":
        return torch.randint(0, sizes[a.high], shape, generator=g)
    if a.kind == "count":
        return torch.randint(0, sizes["S"] + 4, shape, generator=g).to(a.float_dtype)
    if a.kind == "bool":
        return torch.rand(shape, generator=g) < 0.5
    raise AssertionError(a.kind)


def build(s: Spec, batch: int = 3, seq: int = 5, seed: int = 0) -> dict[str, Any]:
    """Valid arguments of ``s`` for this batch and seq (tensors made from ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    sizes = _sizes(batch, max(seq, s.min_seq))
    kwargs: dict[str, Any] = dict(s.fixed)
    for name, a in s.args.items():
        kwargs[name] = _make(a, sizes, g)
    if {"keep", "group_ids"} <= s.args.keys():  # flat verdicts: one per group (checked mode)
        kwargs["keep"] = (torch.rand(sizes["G"], generator=g) < 0.5)[kwargs["group_ids"]]
    return kwargs


def call(s: Spec, kwargs: Mapping[str, Any]) -> Any:
    return s.fn(**{k: v.make() if isinstance(v, Fresh) else v for k, v in kwargs.items()})


def outputs(result: Any) -> list[torch.Tensor]:
    """The tensors of a result (a tensor, a tuple or NamedTuple of tensors, or a number)."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for r in result for t in outputs(r)]
    if isinstance(result, (int, float)):
        return [torch.tensor(result)]
    raise AssertionError(f"unexpected result type {type(result).__name__}")


def masked_positions(s: Spec, name: str, kwargs: Mapping[str, Any]) -> torch.Tensor:
    """Bool tensor shaped like argument ``name``: where it is ignored."""
    a = s.args[name]
    assert a.masked_by is not None
    valid = kwargs[a.masked_by].bool()
    if a.shape == ("B", "S"):
        return ~valid
    if a.shape == ("B",):
        return ~valid.any(dim=1)
    if a.shape[:2] == ("B", "S"):  # [batch, seq, k]: a whole row of a masked token
        return (~valid).unsqueeze(-1).expand(kwargs[name].shape)
    raise AssertionError(a.shape)


def _same(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want), what
    for i, (x, y) in enumerate(zip(got, want, strict=True)):
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what}: output {i}"
        assert torch.equal(x, y) or (
            x.dtype.is_floating_point and torch.equal(x.isnan(), y.isnan())
            and torch.equal(torch.where(x.isnan(), 0, x), torch.where(y.isnan(), 0, y))
        ), f"{what}: output {i} differs:\n{x}\n{y}"  # fmt: skip


def _raises_naming(s: Spec, kwargs: Mapping[str, Any], *names: str) -> None:
    """InputError whose message names (one of) ``names``."""
    with pytest.raises(d.InputError) as info:
        call(s, kwargs)
    assert any(n in str(info.value) for n in names), f"not naming {names}: {info.value}"


# --------------------------------------------------------------------------- the tests


def test_every_public_function_has_an_entry() -> None:
    public = {
        n
        for n in d.__all__
        if inspect.isfunction(getattr(d, n)) and not isinstance(getattr(d, n), type)
    }
    missing = sorted(public - SPECS.keys())
    assert not missing, f"add a spec(...) line to REGISTRY for: {missing}"
    assert not sorted(SPECS.keys() - public), "REGISTRY names a function that is not public"
    assert len(SPECS) == len(REGISTRY), "two REGISTRY entries for one function"
    for s in REGISTRY:  # the spec names real parameters
        params = inspect.signature(s.fn).parameters
        var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
        for name in [*s.args, *s.fixed, *s.options]:
            assert name in params or var_kw, f"{s.name} has no parameter {name!r}"


@pytest.mark.parametrize("name", [s.name for s in REGISTRY])
def test_valid_arguments_give_a_finite_result(name: str) -> None:
    """The registry's own arguments are valid: the baseline every other test changes."""
    s = SPECS[name]
    for out in outputs(call(s, build(s))):
        if out.dtype.is_floating_point:
            assert bool(torch.isfinite(out).all()), f"{name}: {out}"


def _masked_cases() -> Iterator[tuple[str, str]]:
    for s in REGISTRY:
        for name, a in s.args.items():
            if a.masked_by is not None and a.kind == "float":
                yield s.name, name


@pytest.mark.parametrize(("fn", "arg"), _cases("masked", _masked_cases()))
@FEW
@given(
    batch=st.integers(2, 4),
    seq=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    value=st.sampled_from([NAN, INF, -INF]),
    data=st.data(),
)
def test_nonfinite_at_masked_positions_changes_nothing(
    fn: str, arg: str, batch: int, seq: int, seed: int, value: float, data: st.DataObject
) -> None:
    """NaN/inf where the mask is False: the result is bitwise the clean one."""
    s = SPECS[fn]
    kwargs = build(s, batch, seq, seed)
    want = outputs(call(s, kwargs))
    where = masked_positions(s, arg, kwargs)
    assert bool(where.any())  # _mask leaves the last row empty
    flat = where.flatten().nonzero().flatten().tolist()
    chosen = data.draw(st.lists(st.sampled_from(flat), min_size=1, unique=True), label="where")
    dirty = kwargs[arg].clone()
    dirty.view(-1)[chosen] = value
    got = outputs(call(s, {**kwargs, arg: dirty}))
    _same(got, want, f"{fn}: {value} in {arg} at masked positions {chosen}")


def _valid_cases() -> Iterator[tuple[str, str]]:
    for s in REGISTRY:
        for name, a in s.args.items():
            if a.kind == "float" or (a.kind == "count" and a.float_dtype.is_floating_point):
                yield s.name, name


@pytest.mark.parametrize(("fn", "arg"), _cases("valid", _valid_cases()))
@FEW
@given(
    batch=st.integers(2, 4),
    seq=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    value=st.sampled_from([NAN, INF, -INF]),
    data=st.data(),
)
def test_nonfinite_at_valid_positions_is_never_silent(
    fn: str, arg: str, batch: int, seq: int, seed: int, value: float, data: st.DataObject
) -> None:
    """NaN/inf at a valid position: ``InputError``, or (where documented) a non-finite
    result, or a documented finite value; never a raw error."""
    s = SPECS[fn]
    a = s.args[arg]
    kwargs = build(s, batch, seq, seed)
    if a.masked_by is not None:
        where = ~masked_positions(s, arg, kwargs)
    else:
        where = torch.ones(kwargs[arg].shape, dtype=torch.bool)
    flat = where.flatten().nonzero().flatten().tolist()
    index = data.draw(st.sampled_from(flat), label="where")
    dirty = kwargs[arg].clone()
    dirty.view(-1)[index] = value
    rule = a.nan if math.isnan(value) else a.posinf if value > 0 else a.neginf
    try:
        result = call(s, {**kwargs, arg: dirty})
    except d.InputError as e:
        assert arg in str(e), f"the message does not name {arg!r}: {e}"
        return
    assert rule != RAISE, f"{fn}: {value} in {arg} did not raise InputError"
    if rule == NONFINITE:
        floats = [t for t in outputs(result) if t.dtype.is_floating_point]
        assert any(not bool(torch.isfinite(t).all()) for t in floats), (
            f"{fn}: {value} in {arg} at a valid position gave a finite result silently: {result}"
        )


BAD_DTYPES = {
    "float": (torch.int64, torch.bool),
    "mask": (torch.float32,),
    "ids": (torch.float32, torch.bool),
    "count": (torch.bool, torch.complex64),
    "bool": (torch.float32, torch.int64),
}


def _dtype_cases() -> Iterator[tuple[str, str, str]]:
    for s in REGISTRY:
        for name, a in s.args.items():
            for dt in BAD_DTYPES[a.kind] if a.bad_dtypes is None else a.bad_dtypes:
                yield s.name, name, str(dt).removeprefix("torch.")


@pytest.mark.parametrize(("fn", "arg", "dtype"), _cases("dtype", _dtype_cases()))
def test_wrong_dtype_raises(fn: str, arg: str, dtype: str) -> None:
    s = SPECS[fn]
    kwargs = build(s)
    kwargs[arg] = kwargs[arg].to(getattr(torch, dtype))
    _raises_naming(s, kwargs, arg)


def _tensor_cases() -> Iterator[tuple[str, str]]:
    for s in REGISTRY:
        for name in s.args:
            yield s.name, name


@pytest.mark.parametrize(("fn", "arg"), _cases("meta", _tensor_cases()))
def test_meta_device_raises(fn: str, arg: str) -> None:
    """A meta tensor (no data) among cpu tensors: InputError naming it, no raw error."""
    s = SPECS[fn]
    kwargs = build(s)
    kwargs[arg] = kwargs[arg].to("meta")
    _raises_naming(s, kwargs, arg)


@pytest.mark.parametrize(("fn", "arg"), _cases("list", _tensor_cases()))
def test_python_list_raises(fn: str, arg: str) -> None:
    s = SPECS[fn]
    kwargs = build(s)
    kwargs[arg] = kwargs[arg].tolist()
    _raises_naming(s, kwargs, arg)


def _broadcast_cases() -> Iterator[tuple[str, str, int]]:
    """Each dim of an argument that another tensor argument shares (so it is not free)."""
    for s in REGISTRY:
        for name, a in s.args.items():
            others = {sym for n, b in s.args.items() if n != name for sym in b.shape}
            for i, sym in enumerate(a.shape):
                if sym in others:
                    yield s.name, name, i


@pytest.mark.parametrize(("fn", "arg", "dim"), _cases("broadcast", _broadcast_cases()))
def test_shape_that_would_broadcast_raises(fn: str, arg: str, dim: int) -> None:
    """Size 1 where another argument has size > 1: refused, never broadcast (the message
    names it, or the argument whose size it contradicts)."""
    s = SPECS[fn]
    kwargs = build(s, batch=3, seq=5)
    kwargs[arg] = kwargs[arg].narrow(dim, 0, 1)
    sym = s.args[arg].shape[dim]  # a mismatch may be reported by its partner's name
    partners = [n for n, b in s.args.items() if n != arg and sym in b.shape]
    _raises_naming(s, kwargs, arg, *partners)


def _const_cases() -> Iterator[tuple[str, str]]:
    for s in REGISTRY:
        for name, a in s.args.items():
            if a.const:
                yield s.name, name


@pytest.mark.parametrize(("fn", "arg"), _cases("requires_grad", _const_cases()))
def test_requires_grad_on_a_constant_raises(fn: str, arg: str) -> None:
    """old_logp, advantages, ref_logp, IS weights are constants of the objective."""
    s = SPECS[fn]
    kwargs = build(s)
    kwargs[arg] = kwargs[arg].requires_grad_(True)
    _raises_naming(s, kwargs, arg)
    with torch.no_grad():  # under no_grad nothing can flow through it: accepted
        call(s, kwargs)


def _option_cases() -> Iterator[tuple[str, str, int]]:
    for s in REGISTRY:
        for name, bad in s.options.items():
            for i in range(len(bad)):
                yield s.name, name, i


@pytest.mark.parametrize(("fn", "option", "i"), _cases("option", _option_cases()))
def test_option_out_of_range_raises(fn: str, option: str, i: int) -> None:
    s = SPECS[fn]
    kwargs = build(s)
    bad = s.options[option][i]
    kwargs[option] = bad
    _raises_naming(s, kwargs, option)
    # and it shows the value given (a NaN as "nan"), not only what was expected
    with pytest.raises(d.InputError) as info:
        call(s, kwargs)
    shown = "nan" if isinstance(bad, float) and math.isnan(bad) else str(bad)
    assert shown in str(info.value).lower() or repr(bad) in str(info.value), str(info.value)


def _empty_cases() -> Iterator[tuple[str, str, int, int]]:
    for s in REGISTRY:
        if s.args:
            for batch, seq in ((0, 3), (0, 0), (2, 0)):
                yield s.name, "seq0" if seq == 0 else "batch0", batch, seq


@pytest.mark.parametrize(("fn", "case", "batch", "seq"), _cases("empty", _empty_cases()))
def test_empty_batch_gives_a_finite_result(fn: str, case: str, batch: int, seq: int) -> None:
    """No sample (batch 0), or no token (seq 0): a finite, documented result, no crash."""
    s = SPECS[fn]
    if seq < s.min_seq:
        pytest.skip(f"{fn} needs {s.min_seq} samples per group")
    result = call(s, build(s, batch=batch, seq=seq))
    if s.empty == "finite":
        for out in outputs(result):
            if out.dtype.is_floating_point:
                assert bool(torch.isfinite(out).all()), f"{fn}: {out}"


def _non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values in a strided view (every stride doubled)."""
    wide = torch.stack([t, torch.zeros_like(t)], dim=-1)
    out = wide[..., 0]
    assert torch.equal(out, t) and (out.numel() <= 1 or not out.is_contiguous())
    return out


#: The arguments a projection ``hidden @ weight.T + bias`` reads (the linear functions).
PROJECTION = {"hidden", "weight", "bias"}
#: Their grid: multiples of 1/16 in [-2, 2] (5 significant bits at most).
GRID = 16.0


def _on_grid(t: torch.Tensor) -> torch.Tensor:
    return torch.round(t * GRID) / GRID


@pytest.mark.parametrize("fn", _cases("noncontiguous", ((s.name,) for s in REGISTRY if s.args)))
@FEW
@given(batch=st.integers(1, 4), seq=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_non_contiguous_views_give_the_same_result(
    fn: str, batch: int, seq: int, seed: int
) -> None:
    """Every tensor argument as a strided view: bit for bit the result of the contiguous
    call.

    A strided view changes one thing: the order in which a matrix product adds its ``D``
    products (BLAS picks its loop by the strides; every other reduction here walks the
    same elements in the same order). A hand-picked tolerance for that was missed
    (linear_policy_loss: 1.6 times 8 ulps). Derived instead: the projection's inputs are
    put on a grid of 1/16 in [-2, 2], so every product ``h W`` is a multiple of 1/256 of
    magnitude at most 4, and every logit (``D`` products and a bias, ``D = 3``) a
    multiple of 1/256 of magnitude at most 14: 12 significant bits, exact in float32 (24)
    whatever the order of the additions. The rest of the computation is then the same
    sequence of operations on the same values: the results are identical (NaN where NaN).
    """
    s = SPECS[fn]
    assert SIZES["D"] * 4 + 2 <= 16  # the logits' magnitude above: 12 bits with 1/256
    kwargs = build(s, batch, seq, seed)
    for name in PROJECTION & s.args.keys():
        kwargs[name] = _on_grid(kwargs[name])
    want = outputs(call(s, kwargs))
    strided = {k: _non_contiguous(v) if k in s.args else v for k, v in kwargs.items()}
    got = outputs(call(s, strided))
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
