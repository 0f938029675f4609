"""dapo_ops against TRL 1.16's async and server distillation losses (the teacher's top-k).

- ``trl.experimental.async_distillation``'s ``_chunked_jsd_loss`` (by chunks of
  ``_jsd_loss_chunk``), ``beta=0`` (the teacher's top-k candidates as given, some padded
  with id -1), tail bucket or renormalised, two temperatures, ``lm_head`` bias and
  ``logit_scale`` (folded into the weight and bias): ``linear_distill_loss(...,
  teacher_ids=ids, topk_tail=...)`` at every position: value, gradient, the summed
  divergence and the student-entropy metric. The kernel casts the logits to float32 whatever the input dtype
  (its sums are float64 here): compared to float32 rounding.
- ``ServerDistillationTrainer._compute_server_forward_kl_loss`` (``beta=0``, padded
  candidates as ``-inf``, ``batchmean`` over the labelled tokens): the same, float64.

- ``beta > 0`` (``_chunked_jsd_loss`` over the support {the teacher's argmax, the sampled
  token} of ``_narrow_top1_actual_support``, the token alone at ``beta=1``):
  ``linear_distill_loss(..., teacher_ids=ids, kind="jsd" | "reverse_kl", topk_tail=...)``
  with the repeats and missing candidates as ``-inf`` padding: value and gradient, float32
  rounding.
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
    sel = x.mask
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
    got = topk_ours(x, ids, t_k, valid, sel, temperature, add_tail,
                    weight=scale * x.weight, bias=b_ours, normalizer=1.0)  # fmt: skip
    same(got, want, (x.hidden, x.weight, *((bias,) if with_bias else ())), F32)
    torch.testing.assert_close(jsd_sum.double(), got.detach(), **F32)
    entropy = d.token_entropy(logits.detach(), temperature=temperature)
    torch.testing.assert_close(entropy[sel].sum(), entropy_sum.double(), **F32)


@pytest.mark.parametrize(("k", "temperature", "add_tail"), TOPK)
@pytest.mark.parametrize("beta", [0.3, 0.5, 1.0])
def test_async_narrow_support(k: int, temperature: float, add_tail: bool, beta: float) -> None:
    """``beta > 0``: the support {the teacher's argmax, the sampled token} (the token alone at
    ``beta=1``; a repeat or a token outside the candidates is padding) built by
    ``_narrow_top1_actual_support``, passed as ``teacher_ids`` with ``-inf`` padding."""
    x = batch(70 + k + 2 * add_tail + int(10 * beta))
    logits = x.hidden @ x.weight.T
    x.teacher = 1.5 * logits.detach() + 2 * torch.randn(logits.shape, generator=x.g, dtype=torch.float64)  # fmt: skip
    ids, t_k, valid = teacher_topk(x, k, temperature, pad=True)
    t_all = torch.log_softmax(x.teacher / temperature, -1)
    tok = torch.where(torch.rand(x.tokens.shape, generator=x.g) < 0.3, ids[..., 0], x.tokens)
    wide = (torch.cat([ids, tok[..., None]], -1), torch.cat([t_k, t_all.gather(-1, tok[..., None])], -1),
            torch.cat([valid, torch.rand(tok.shape, generator=x.g)[..., None] < 0.8], -1))  # fmt: skip
    n_ids, n_logp, n_valid = ad._narrow_top1_actual_support(*wide[:2], tok, wide[2], beta)
    sel = x.mask
    want = ad._chunked_jsd_loss(
        x.hidden[sel], x.weight, None, 1.0, None, torch.where(n_valid, n_ids, -1)[sel],
        n_logp[sel], n_valid[sel], beta, temperature, add_tail, None, 1, 4,
    )[0]  # fmt: skip
    kind = {"kind": "reverse_kl"} if beta == 1.0 else {"kind": "jsd", "beta": beta}
    got = topk_ours(x, n_ids, n_logp, n_valid, sel, temperature, add_tail, normalizer=1.0, **kind)
    same(got, want, (x.hidden, x.weight), F32)


@pytest.mark.parametrize(("k", "temperature", "add_tail"), TOPK)
def test_server_forward_kl_loss(k: int, temperature: float, add_tail: bool) -> None:
    x = batch(60 + k + add_tail)
    ids, t_k, valid = teacher_topk(x, k, temperature, pad=True)
    sel = x.mask
    cls = sd.ServerDistillationTrainer
    owner = SimpleNamespace(loss_add_tail=add_tail)
    owner._reduce_divergence_loss = cls._reduce_divergence_loss  # a staticmethod
    server = {"topk_logprobs": torch.where(valid, t_k, -torch.inf), "topk_token_ids": ids}
    s_all = torch.log_softmax(x.hidden @ x.weight.T / temperature, -1)
    want = cls._compute_server_forward_kl_loss(owner, server, s_all, torch.where(sel, 1, -100))
    ours = topk_ours(x, ids, t_k, valid, sel, temperature, add_tail)  # token mean
    same(ours, want, (x.hidden, x.weight))
