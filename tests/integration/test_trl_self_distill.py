"""dapo_ops against the losses of TRL 1.16's self-distillation trainers (SDFT, SDPO).

``trl.experimental.sdft`` and ``trl.experimental.sdpo`` share one ``loss_utils`` (the same
code in both modules, both compared):

- ``_compute_self_distillation_loss`` (each row's token mean, then the mean over rows:
  ``mode="seq_mean_token_mean", normalizer=`` the batch size), every ``alpha``, two
  temperatures (TRL divides both models' logits by it), a fully masked row and batch,
  value, gradient and the logged metric, float64:

  - ``full_logits`` (``compute_full_logit_self_distillation_loss``,
    ``compute_divergence``): ``linear_distill_loss``;
  - ``sampled_token`` (``compute_sampled_token_self_distillation_loss``, ``alpha=1``):
    ``policy_loss(PolicyGradient())`` with ``distill_advantages`` (``k1``);
  - ``distillation_is_clip`` (``apply_importance_sampling_clipping``):
    ``truncated_is_weights`` as ``is_weights`` (of ``policy_loss`` or of
    ``linear_distill_loss``).
- ``SDPOTrainer.compute_loss``: ``(1 - w) * policy + w * distillation``,
  ``_compute_policy_loss`` as ``trl_policy_loss`` for every ``loss_type``, token and
  sequence level, ``distillation_weight`` 0, 0.3 and 1: value and gradient, float64.
- The top-k loss on the student's top-k (``compute_topk_self_distillation_loss``), every
  ``alpha``, tail bucket or renormalised: ``linear_distill_loss(..., topk=k,
  topk_support="student", topk_tail="bucket" | "renormalize")`` (at ``alpha=0`` also the
  ids as ``teacher_ids``), value and gradient, float64, the positions where TRL floors
  ``1 - P`` at about 1e-7 left out; on the teacher's top-k with ``alpha=0``
  (``SDFTTrainer._compute_server_distillation_loss``, ``num_loss_tokens_to_skip``):
  ``teacher_ids=ids``, value and gradient everywhere, float64.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("PIL")
LOSS_UTILS = {m: pytest.importorskip(f"trl.experimental.{m}.loss_utils") for m in ("sdft", "sdpo")}
TRAINERS = {m: pytest.importorskip(f"trl.experimental.{m}.{m}_trainer") for m in ("sdft", "sdpo")}

from _self_distill_common import (  # noqa: E402
    TOL,
    TOPK,
    batch,
    same,
    teacher_topk,
    topk_ours,
    trl_floor_binds,
)

import dapo_ops as d  # noqa: E402
from dapo_ops.integrations.trl import trl_policy_loss  # noqa: E402

pytestmark = pytest.mark.integration

ALPHAS = [0.0, 0.25, 0.5, 1.0]
MODES = [("full_logits", a) for a in ALPHAS] + [("sampled_token", 1.0)]
K1 = d.TeacherKL(estimator="k1", clamp=None, log_ratio_clamp=None)
TRAINING = SimpleNamespace(training=True)


def _cls(trainer: str) -> Any:
    return getattr(TRAINERS[trainer], f"{trainer.upper()}Trainer")


def _kind(alpha: float) -> dict[str, Any]:
    kind = {0.0: "forward_kl", 1.0: "reverse_kl"}.get(alpha, "jsd")
    return {"kind": kind, **({"beta": alpha} if kind == "jsd" else {})}


def _owner(logged: list[float], **args: Any) -> SimpleNamespace:
    """What the trainer methods read of ``self``: options, metrics, an identity gather."""
    return SimpleNamespace(
        args=SimpleNamespace(**args), accelerator=SimpleNamespace(gather=lambda t: t),
        _log_self_distillation_metric=lambda mode, value: logged.append(value),
        _metrics=defaultdict(lambda: defaultdict(list)), model=TRAINING,
    )  # fmt: skip


def _logits(trainer: str, x: SimpleNamespace, mask: torch.Tensor, s: Any, t: Any) -> Any:
    """The trainer's DistillationLogits (SDPO's carries the completion mask too)."""
    extra = {"completion_mask": mask.long()} if trainer == "sdpo" else {}
    return TRAINERS[trainer].DistillationLogits(
        completion_ids=x.tokens, loss_mask=mask.long(), student_logits=s, teacher_logits=t, **extra
    )


def _logp(x: SimpleNamespace, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's (under autograd) and the teacher's log-probs of the sampled tokens."""
    logp = d.token_logprobs(x.hidden @ x.weight.T, x.tokens, temperature=temperature)
    t_all = torch.log_softmax(x.teacher / temperature, -1)
    return logp, t_all.gather(-1, x.tokens[..., None])[..., 0]


@pytest.mark.parametrize("trainer", ["sdft", "sdpo"])
@pytest.mark.parametrize(("mode", "alpha"), MODES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("clip", [None, 1.5])
def test_self_distillation_loss(
    trainer: str, mode: str, alpha: float, temperature: float, clip: float | None
) -> None:
    x = batch(int(alpha * 8) + int(temperature * 10) + (clip is not None))
    logged: list[float] = []
    owner = _owner(logged, distillation_mode=mode, distillation_alpha=alpha,
                   distillation_is_clip=clip, distillation_topk=None)  # fmt: skip
    logp, t_logp = _logp(x, temperature)
    old = logp.detach() + x.noise  # the student at rollout time
    dl = _logits(trainer, x, x.mask, x.hidden @ x.weight.T / temperature, x.teacher / temperature)
    inputs = {} if clip is None else {"old_per_token_logps": old}
    want = _cls(trainer)._compute_self_distillation_loss(owner, TRAINING, inputs, dl)
    agg: dict[str, Any] = {"mode": "seq_mean_token_mean", "normalizer": float(x.b)}
    w = None if clip is None else d.truncated_is_weights(logp.detach(), old, x.mask, cap=clip)
    if mode == "sampled_token":
        adv = d.distill_advantages(logp.detach(), t_logp, x.mask, distill=K1)  # log pi_T - log pi
        pg = partial(d.policy_loss, d.PolicyGradient(), logp, logp.detach(), adv, x.mask)
        same(pg(is_weights=w, **agg), want, (x.hidden, x.weight))
        metric = pg(is_weights=w)
    else:
        got, diag = d.linear_distill_loss_with_diagnostics(
            x.hidden, x.weight, x.teacher, x.mask, temperature=temperature, chunk_size=5,
            is_weights=w, **_kind(alpha), **agg,
        )  # fmt: skip
        per_token = diag.per_token if w is None else diag.per_token * w  # l, unweighted
        metric = d.token_level_aggregate(per_token, x.mask)
        same(got, want, (x.hidden, x.weight))
    assert logged == pytest.approx([float(metric.detach())], rel=1e-12, abs=1e-13)


@pytest.mark.parametrize("trainer", ["sdft", "sdpo"])
@pytest.mark.parametrize(("mode", "alpha"), MODES)
def test_self_distillation_fully_masked_batch(trainer: str, mode: str, alpha: float) -> None:
    x = batch(5)
    none = torch.zeros_like(x.mask)
    owner = _owner([], distillation_mode=mode, distillation_alpha=alpha, distillation_is_clip=None)
    dl = _logits(trainer, x, none, x.hidden @ x.weight.T, x.teacher)
    want = _cls(trainer)._compute_self_distillation_loss(owner, TRAINING, {}, dl)
    if mode == "sampled_token":
        logp, t_logp = _logp(x, 1.0)
        adv = d.distill_advantages(logp.detach(), t_logp, none, distill=K1)
        got = d.policy_loss(d.PolicyGradient(), logp, logp.detach(), adv, none, normalizer=3.0)
    else:
        got = d.linear_distill_loss(x.hidden, x.weight, x.teacher, none, **_kind(alpha))
    assert float(want.detach()) == 0.0 and float(got.detach()) == 0.0
    leaves = (x.hidden, x.weight)
    grads = zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, leaves), strict=True)
    for a, b in grads:
        assert not a.any() and not b.any()


LOSS_TYPES = {"grpo": "grpo", "bnpo": "bnpo", "dr_grpo": "dr_grpo", "dapo": "bnpo"}  # SDPO's
# "dapo" divides by the local token count (GRPOTrainer's "bnpo"), not num_items_in_batch


@pytest.mark.parametrize("loss_type", list(LOSS_TYPES))
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("weight", [0.0, 0.3, 1.0])
def test_sdpo_compute_loss(loss_type: str, level: str, weight: float) -> None:
    x = batch(len(loss_type) + int(weight * 10) + len(level))
    logp, _ = _logp(x, 1.0)
    old, adv = logp.detach() + 0.5 * x.noise, torch.randn(x.b, generator=x.g, dtype=torch.float64)
    logits, cls, cap = x.hidden @ x.weight.T, _cls("sdpo"), x.mask.shape[1] + 2
    owner = _owner([], distillation_weight=weight, distillation_mode="full_logits",
                   distillation_alpha=0.5, distillation_is_clip=None)  # fmt: skip
    owner.__dict__.update(
        use_teacher_server=False, teacher_model=None, current_gradient_accumulation_steps=1,
        _compute_teacher_student_logits=lambda *a: _logits("sdpo", x, x.mask, logits, x.teacher),
        _forward_logits=lambda **kw: logits,
        _compute_policy_loss=partial(cls._compute_policy_loss, owner),
        _compute_self_distillation_loss=partial(cls._compute_self_distillation_loss, owner),
        importance_sampling_level=level, epsilon_low=0.2, epsilon_high=0.28,
        loss_type=loss_type, max_completion_length=cap,
    )  # fmt: skip
    inputs = {"prompt_ids": x.tokens[:, :2], "prompt_mask": torch.ones_like(x.tokens[:, :2]),
              "completion_ids": x.tokens, "completion_mask": x.mask.long(), "advantages": adv,
              "old_per_token_logps": old}  # fmt: skip
    want = cls.compute_loss(owner, TRAINING, inputs)
    policy, _ = trl_policy_loss(
        logp, old, adv, x.mask, loss_type=LOSS_TYPES[loss_type], epsilon_low=0.2,
        epsilon_high=0.28, max_completion_length=cap, importance_sampling_level=level,
    )  # fmt: skip
    distill = d.linear_distill_loss(x.hidden, x.weight, x.teacher, x.mask, kind="jsd", beta=0.5,
                                    mode="seq_mean_token_mean", normalizer=float(x.b))  # fmt: skip
    blend = {0.0: policy, 1.0: distill}.get(weight)  # TRL skips the other term
    same((1 - weight) * policy + weight * distill if blend is None else blend, want,
         (x.hidden, x.weight))  # fmt: skip


@pytest.mark.parametrize(("k", "temperature", "add_tail"), TOPK)
@pytest.mark.parametrize("trainer", ["sdft", "sdpo"])
@pytest.mark.parametrize("alpha", ALPHAS)
def test_topk_on_the_students_support(
    k: int, temperature: float, add_tail: bool, trainer: str, alpha: float
) -> None:
    """``topk_support="student"`` (and, at ``alpha=0``, the student's ids passed as
    ``teacher_ids``); with the bucket, where TRL's floor of ``1 - P`` binds is left out."""
    x = batch(30 + k + int(8 * alpha))
    logits = x.hidden @ x.weight.T
    noise = torch.randn(logits.shape, generator=x.g, dtype=torch.float64)
    x.teacher = 2 * logits.detach() + noise  # sharper on the student's likely tokens
    ids = torch.topk(logits.detach(), k, dim=-1).indices  # the student's top-k
    t_all = torch.log_softmax(x.teacher / temperature, -1)
    t_k = t_all.gather(-1, ids)
    if add_tail:
        s_all = torch.log_softmax(logits / temperature, -1)
        x.mask = x.mask & ~trl_floor_binds(s_all, t_all, ids)
        assert x.mask.sum() >= 5
    valid = torch.ones_like(ids, dtype=torch.bool)

    def want() -> torch.Tensor:
        per_token = LOSS_UTILS[trainer].compute_topk_self_distillation_loss(
            x.hidden @ x.weight.T / temperature, x.teacher / temperature, distillation_topk=k,
            distillation_alpha=alpha, distillation_add_tail=add_tail,
        )  # fmt: skip
        return per_token[x.mask].sum()

    if alpha == 0.0:
        ours = topk_ours(x, ids, t_k, valid, x.mask, temperature, add_tail, normalizer=1.0)
        same(ours, want(), (x.hidden, x.weight))
    got = d.linear_distill_loss(
        x.hidden, x.weight, x.teacher, x.mask, topk=k, topk_support="student",
        topk_tail="bucket" if add_tail else "renormalize", temperature=temperature,
        normalizer=1.0, chunk_size=4, **_kind(alpha),
    )  # fmt: skip
    # alpha > 0 weighs the student's bucket log(1 - P_s): TRL forms 1 - P_s as 1 - sum,
    # which cancels to about 1e-16 / (1 - P_s) relative; dapo_ops sums the mass off the ids
    tol = {"rtol": 1e-9, "atol": 1e-10} if add_tail and alpha > 0 else TOL
    same(got, want(), (x.hidden, x.weight), tol)


@pytest.mark.parametrize(("k", "temperature", "add_tail"), TOPK)
def test_sdft_server_topk(k: int, temperature: float, add_tail: bool) -> None:
    """SDFT with a teacher server: the teacher's top-k, first ``skip`` tokens left out."""
    x, skip = batch(40 + k + add_tail), 1
    ids, t_k, valid = teacher_topk(x, k, temperature, pad=False)
    owner = _owner([], distillation_mode="topk_logits", distillation_alpha=0.0,
                   distillation_add_tail=add_tail, distillation_is_clip=None)  # fmt: skip
    actual = torch.zeros(x.mask.shape, dtype=torch.float64)  # read by sampled_token only
    server = {"actual_logprobs": actual, "topk_logprobs": t_k, "topk_token_ids": ids}
    owner.__dict__.update(
        state=SimpleNamespace(global_step=0), _last_loaded_step=0, num_loss_tokens_to_skip=skip,
        _forward_logits=lambda **kw: x.hidden @ x.weight.T / temperature,
        _get_teacher_token_logprobs_from_server=lambda inputs, n: server,
    )  # fmt: skip
    completion = x.mask.clone()
    completion[:, :skip] = True  # dropped by num_loss_tokens_to_skip
    inputs = {"prompt_ids": x.tokens[:, :2], "prompt_mask": torch.ones_like(x.tokens[:, :2]),
              "completion_ids": x.tokens, "completion_mask": completion.long()}  # fmt: skip
    want = _cls("sdft")._compute_server_distillation_loss(owner, TRAINING, inputs)
    sel = x.mask & (torch.arange(x.mask.shape[1]) >= skip)
    agg: dict[str, Any] = {"mode": "seq_mean_token_mean", "normalizer": float(x.b)}
    ours = topk_ours(x, ids, t_k, valid, sel, temperature, add_tail, **agg)
    same(ours, want, (x.hidden, x.weight))
