"""``linear_distill_loss`` against TRL 1.16's GKD loss and verl 0.9.1's top-k forward KL, float64.

- TRL: ``GKDTrainer.generalized_jsd_loss`` on the student's logits ``hidden @ W.T`` and the
  teacher's, every ``beta`` (0: ``kind="forward_kl"``, 1: ``"reverse_kl"``, else
  ``"jsd"``), two temperatures, every reduction and ``num_items_in_batch``: value and
  gradient w.r.t. hidden and weight, to float64 rounding.
- verl: ``verl.trainer.distillation.fsdp.losses.compute_forward_kl_topk`` (the logits
  processor, both its paths) on the same logits and teacher top-k: per-token loss (after
  the registered function's clamp at 0) and gradient to float32 rounding (verl's KL casts
  to float32: a documented difference), the top-k masses to float64 rounding (float32 on
  verl's chunked path).
- the twin ``dapo_ops_forward_kl_topk`` in verl's registry against ``forward_kl_topk``:
  per-token loss, gradient and every metric, alone and inside verl's
  ``distillation_ppo_loss`` (supervised, ``loss_max_clamp`` on and off).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("PIL")
gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
losses = pytest.importorskip("verl.trainer.distillation.losses")
fsdp_losses = pytest.importorskip("verl.trainer.distillation.fsdp.losses")

import dapo_ops as d  # noqa: E402
from dapo_ops.integrations import verl_distill  # noqa: E402

pytestmark = pytest.mark.integration

TOL = {"rtol": 1e-12, "atol": 1e-13}
F32 = {"rtol": 2e-6, "atol": 1e-7}  # verl's KL runs in float32


def _leaves(seed: int, b: int, s: int, dim: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, dim, generator=g, dtype=torch.float64)
    weight = torch.randn(v, dim, generator=g, dtype=torch.float64)
    return hidden.requires_grad_(True), weight.requires_grad_(True)


# ------------------------------------------------------------------------------ TRL GKD

REDUCTIONS = ["batchmean", "sum", "mean", "none", "num_items"]


@pytest.mark.parametrize(
    ("beta", "temperature"), list(itertools.product([0.0, 0.25, 0.5, 1.0], [1.0, 0.7]))
)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_generalized_jsd_loss(beta: float, temperature: float, reduction: str) -> None:
    b, s, v = 3, 6, 29
    hidden, weight = _leaves(int(beta * 8) + len(reduction), b, s, 7, v)
    g = torch.Generator().manual_seed(5)
    teacher = 3 * torch.randn(b, s, v, generator=g, dtype=torch.float64)
    mask = torch.rand(b, s, generator=g) < 0.7
    mask[0], mask[-1] = True, False
    labels = torch.where(mask, 1, -100)
    trl_red = "batchmean" if reduction == "num_items" else reduction
    items = 17 if reduction == "num_items" else None
    want = gkd.GKDTrainer.generalized_jsd_loss(
        hidden @ weight.T, teacher, labels=labels, beta=beta, temperature=temperature,
        reduction=trl_red, num_items_in_batch=items,
    )  # fmt: skip
    kind = {0.0: "forward_kl", 1.0: "reverse_kl"}.get(beta, "jsd")
    kw: dict[str, Any] = {"kind": kind, "temperature": temperature, "chunk_size": 5}
    if kind == "jsd":
        kw["beta"] = beta
    normalizer = {"sum": 1.0, "none": 1.0, "mean": float(mask.sum() * v), "num_items": 17.0}
    if reduction in normalizer:
        kw["normalizer"] = normalizer[reduction]
    got, diag = d.linear_distill_loss_with_diagnostics(hidden, weight, teacher, mask, **kw)
    if reduction == "none":  # TRL's [valid tokens, vocab]: ours summed over the vocabulary
        torch.testing.assert_close(diag.per_token[mask], want.detach().sum(-1), **TOL)
        want = want.sum()
    torch.testing.assert_close(got, want, **TOL)
    g_want = torch.autograd.grad(want, (hidden, weight))
    g_got = torch.autograd.grad(got, (hidden, weight))
    for x, y in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(x, y, **TOL)


# ------------------------------------------------------------------------ verl top-k KL


def topk_batch(
    seed: int, k: int = 6, rows: int = 4, prompt: int = 3, resp: int = 6
) -> dict[str, Any]:
    """verl's micro-batch (jagged teacher top-k) and the flat student (hidden, weight)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    g = torch.Generator().manual_seed(seed)
    p_lens = torch.randint(1, prompt + 1, (rows,), generator=g)
    r_lens = torch.randint(1, resp + 1, (rows,), generator=g)
    r_lens[0] = resp
    attn = torch.cat(
        [torch.arange(prompt) >= prompt - p_lens[:, None], torch.arange(resp) < r_lens[:, None]], 1
    ).long()
    seq = (p_lens + r_lens).tolist()
    nnz, v = sum(seq), 31
    hidden, weight = _leaves(seed, 1, nnz, 5, v)
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(nnz)])
    t_all = torch.log_softmax(4 * torch.randn(nnz, v, generator=g, dtype=torch.float64), -1)
    logp = t_all.gather(1, ids)  # log-probs past -10: the clamp acts
    data = TensorDict(
        {
            "prompts": torch.ones(rows, prompt, dtype=torch.long),
            "responses": torch.ones(rows, resp, dtype=torch.long),
            "attention_mask": attn,
            "response_mask": (torch.arange(resp) < r_lens[:, None]).to(torch.float32),
            "teacher_logprobs": torch.nested.nested_tensor(
                list(logp.split(seq)), layout=torch.jagged
            ),
            "teacher_ids": torch.nested.nested_tensor(list(ids.split(seq)), layout=torch.jagged),
        },
        batch_size=[rows],
    )
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    return {"data": data, "hidden": hidden, "weight": weight, "ids": ids, "logp": logp, "k": k}


def verl_processor(
    b: dict[str, Any], clamp: float | None, chunked: bool
) -> dict[str, torch.Tensor]:
    cfg = SimpleNamespace(
        distillation_loss=SimpleNamespace(log_prob_min_clamp=clamp, use_chunked_topk=chunked)
    )
    logits = b["hidden"] @ b["weight"].T
    return fsdp_losses.compute_forward_kl_topk(  # type: ignore[no-any-return]
        student_logits=logits, teacher_topk_log_probs=b["data"]["teacher_logprobs"],
        teacher_topk_ids=b["data"]["teacher_ids"], config=cfg, data_format="thd",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("clamp", "chunked"), list(itertools.product([None, -10.0, -3.0], [False, True]))
)
def test_forward_kl_topk_equals_verls_processor(clamp: float | None, chunked: bool) -> None:
    b = topk_batch(1)
    out = verl_processor(b, clamp, chunked)
    want = out["distillation_losses"].clamp_min(0.0)  # the registered function's clamp
    nnz = want.shape[1]
    mask = torch.ones(1, nnz, dtype=torch.bool)
    got, diag = d.linear_distill_loss_with_diagnostics(
        b["hidden"], b["weight"], b["logp"][None], mask, teacher_ids=b["ids"][None],
        log_prob_min_clamp=clamp, chunk_size=7,
    )  # fmt: skip
    torch.testing.assert_close(diag.per_token, want.detach().to(torch.float64), **F32)
    assert diag.student_mass is not None and diag.teacher_mass is not None
    # verl's chunked path takes the student's log-probs in float32 too
    torch.testing.assert_close(
        diag.student_mass, out["student_mass"].detach().double(), **(F32 if chunked else TOL)
    )
    torch.testing.assert_close(diag.teacher_mass, out["teacher_mass"], **TOL)
    leaves = (b["hidden"], b["weight"])
    g_want = torch.autograd.grad(want.mean(), leaves)  # token-mean over the tokens
    g_got = torch.autograd.grad(got, leaves)
    torch.testing.assert_close(got, want.mean().detach().to(torch.float64), **F32)
    for x, y in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(x, y.to(torch.float64), rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module", autouse=True)
def registered() -> None:
    verl_distill.register_distillation()


def _model_output(b: dict[str, Any]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        out = verl_processor(b, -10.0, False)
    flat = {k: v[0] for k, v in out.items()}
    flat["distillation_losses"] = flat["distillation_losses"].double().requires_grad_(True)
    return flat


def _configs(name: str, k: int, agg: str = "token-mean", **loss: Any) -> tuple[Any, Any]:
    from verl.workers.config import ActorConfig, DistillationConfig, DistillationLossConfig

    actor = ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, loss_agg_mode=agg
    )
    cfg = DistillationLossConfig(loss_mode=name, topk=k, use_policy_gradient=False, use_task_rewards=False, **loss)  # fmt: skip
    return actor, DistillationConfig(enabled=False, distillation_loss=cfg)


def _metrics(m: dict[str, Any]) -> dict[str, Any]:
    return {k: (getattr(v, "aggregation", None), getattr(v, "values", v)) for k, v in m.items()}


def _same(got: Any, want: Any, g_got: Any, g_want: Any, m_got: Any, m_want: Any) -> None:
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(g_got, g_want, **TOL)
    a, b = _metrics(m_got), _metrics(m_want)
    assert a.keys() == b.keys()
    for key, (agg, value) in b.items():
        assert a[key][0] == agg, key
        torch.testing.assert_close(
            torch.as_tensor(a[key][1], dtype=torch.float64),
            torch.as_tensor(value, dtype=torch.float64), **TOL,
        )  # fmt: skip


def test_twin_is_registered_with_verls_settings() -> None:
    ours = losses.get_distillation_loss_settings("dapo_ops_forward_kl_topk")
    theirs = losses.get_distillation_loss_settings("forward_kl_topk")
    assert (ours.use_topk, ours.use_estimator) == (theirs.use_topk, theirs.use_estimator)
    assert (
        losses.get_distillation_loss_fn("dapo_ops_forward_kl_topk")
        is verl_distill.compute_forward_kl_topk
    )


@pytest.mark.parametrize("seed", [2, 3])
def test_twin_equals_forward_kl_topk(seed: int) -> None:
    b = topk_batch(seed)
    runs = []
    for name in ("forward_kl_topk", "dapo_ops_forward_kl_topk"):
        actor, dist = _configs(name, b["k"])
        mo = _model_output(b)
        out, metrics = losses.get_distillation_loss_fn(name)(actor, dist, mo, b["data"])
        (grad,) = torch.autograd.grad((out * torch.arange(out.numel()).view_as(out)).sum(), mo["distillation_losses"])  # fmt: skip
        runs.append((out.detach(), grad, metrics))
    (want, g_want, m_want), (got, g_got, m_got) = runs
    _same(got, want, g_got, g_want, m_got, m_want)


@pytest.mark.parametrize(
    ("cap", "agg"),
    list(itertools.product([None, 10.0, 0.05], ["token-mean", "seq-mean-token-mean"])),
)
def test_distillation_ppo_loss_with_the_twin(cap: float | None, agg: str) -> None:
    b = topk_batch(4)
    runs = []
    for name in ("forward_kl_topk", "dapo_ops_forward_kl_topk"):
        actor, dist = _configs(name, b["k"], agg, loss_max_clamp=cap)
        mo = _model_output(b)
        loss, metrics = losses.distillation_ppo_loss(actor, dist, mo, b["data"])
        (grad,) = torch.autograd.grad(loss, mo["distillation_losses"])
        runs.append((loss.detach(), grad, metrics))
    (want, g_want, m_want), (got, g_got, m_got) = runs
    _same(got, want, g_got, g_want, m_got, m_want)
