"""dapo_ops against TRL 1.16's async and server distillation losses (the teacher's top-k).

- ``trl.experimental.async_distillation``'s ``_chunked_jsd_loss`` (by chunks of
  ``_jsd_loss_chunk``), ``beta=0`` (the teacher's top-k candidates as given, some padded
  with id -1), tail bucket or renormalised, two temperatures, ``lm_head`` bias and
  ``logit_scale`` (folded into the weight and bias): ``linear_distill_loss(...,
  teacher_ids=ids)`` plus TRL's term, value, gradient, the summed divergence and the
  student-entropy metric. The kernel casts the logits to float32 whatever the input dtype
  (its sums are float64 here): compared to float32 rounding.
- ``ServerDistillationTrainer._compute_server_forward_kl_loss`` (``beta=0``, padded
  candidates as ``-inf``, ``batchmean`` over the labelled tokens): the same, float64.

``beta > 0`` narrows the support to {the teacher's argmax, the sampled token}
(``_narrow_top1_actual_support``): dapo_ops has no loss over such a support.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("PIL")
ad = pytest.importorskip("trl.experimental.async_distillation.async_distillation_trainer")
sd = pytest.importorskip("trl.experimental.server_distillation.server_distillation_trainer")

from _self_distill_common import (  # noqa: E402
    F32,
    TOPK,
    batch,
    same,
    teacher_topk,
    topk_ours,
    unclamped,
)

import dapo_ops as d  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("k", "temperature", "add_tail"), TOPK)
@pytest.mark.parametrize(("with_bias", "scale"), [(False, 1.0), (True, 0.5)])
def test_async_chunked_jsd_loss(
    k: int, temperature: float, add_tail: bool, with_bias: bool, scale: float
) -> None:
    x = batch(50 + k + 2 * add_tail + with_bias)
    bias = torch.randn(x.v, generator=x.g, dtype=torch.float64).requires_grad_(with_bias)
    b_ours = scale * bias if with_bias else None
    logits = scale * (x.hidden @ x.weight.T + (bias if with_bias else 0))
    noise = torch.randn(logits.shape, generator=x.g, dtype=torch.float64)
    x.teacher = 1.5 * logits.detach() + 2 * noise
    ids, t_k, valid = teacher_topk(x, k, temperature, pad=True)
    sel = unclamped(x, ids, t_k, valid, temperature, add_tail, scale * x.weight, b_ours)
    # the valid positions packed, one teacher, chunks of 4
    want, jsd_sum, entropy_sum, _, _ = ad._chunked_jsd_loss(
        x.hidden[sel],
        x.weight,
        bias if with_bias else None,
        scale,
        None,
        torch.where(valid, ids, -1)[sel],
        t_k[sel],
        valid[sel],
        0.0,
        temperature,
        add_tail,
        None,
        1,
        4,
    )  # fmt: skip
    ours, term = topk_ours(x, ids, t_k, valid, sel, temperature, add_tail,
                           weight=scale * x.weight, bias=b_ours, normalizer=1.0)  # fmt: skip
    got = ours + term[sel].sum()
    same(got, want, (x.hidden, x.weight, *((bias,) if with_bias else ())), F32)
    torch.testing.assert_close(jsd_sum.double(), got.detach(), **F32)
    entropy = d.token_entropy(logits.detach(), temperature=temperature)
    torch.testing.assert_close(entropy[sel].sum(), entropy_sum.double(), **F32)


@pytest.mark.parametrize(("k", "temperature", "add_tail"), TOPK)
def test_server_forward_kl_loss(k: int, temperature: float, add_tail: bool) -> None:
    x = batch(60 + k + add_tail)
    ids, t_k, valid = teacher_topk(x, k, temperature, pad=True)
    sel = unclamped(x, ids, t_k, valid, temperature, add_tail)
    cls = sd.ServerDistillationTrainer
    owner = SimpleNamespace(loss_add_tail=add_tail)
    owner._reduce_divergence_loss = cls._reduce_divergence_loss  # a staticmethod
    server = {"topk_logprobs": torch.where(valid, t_k, -torch.inf), "topk_token_ids": ids}
    s_all = torch.log_softmax(x.hidden @ x.weight.T / temperature, -1)
    want = cls._compute_server_forward_kl_loss(owner, server, s_all, torch.where(sel, 1, -100))
    ours, term = topk_ours(x, ids, t_k, valid, sel, temperature, add_tail)  # token mean
    same(ours + d.token_level_aggregate(term, sel), want, (x.hidden, x.weight))
