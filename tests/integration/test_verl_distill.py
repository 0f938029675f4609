"""On-policy distillation against verl 0.9.1's own (``verl/trainer/distillation/losses.py``), float64.

Unpadded student log-probs and teacher log-probs (verl's layout: one flat tensor, a
jagged one per row) with log-ratios past verl's clamps (+-20 on k3's log-ratio, +-10 on
its value, ``loss_max_clamp``) go to

- verl's ``compute_distillation_loss_reverse_kl_estimator`` and the twin registered as
  ``dapo_ops_<loss_mode>``: per-token loss, gradient, ``distillation/abs_loss``;
- verl's whole ``distillation_ppo_loss`` under ``loss_mode=<name>`` and
  ``loss_mode=dapo_ops_<name>``, over ``use_policy_gradient``, ``use_task_rewards``,
  ``loss_max_clamp``, ``distillation_loss_coef`` and ``loss_agg_mode``: loss, gradient and
  every metric;
- ``dapo_ops.distill_loss``, ``policy_loss(..., distill=)`` and ``distill_advantages``
  (with ``policy_loss``) against the same verl runs: value and gradient.

verl's ``distillation`` package imports Pillow (through ``verl.workers.utils.losses``).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

pytest.importorskip("PIL")
losses = pytest.importorskip("verl.trainer.distillation.losses")

import dapo_ops as d  # noqa: E402
from dapo_ops.integrations import verl_distill  # noqa: E402

pytestmark = pytest.mark.integration

NAMES = list(verl_distill.ESTIMATORS)
TOL = {"rtol": 1e-12, "atol": 1e-13}


@pytest.fixture(scope="module", autouse=True)
def registered() -> None:
    verl_distill.register_distillation()


def batch(seed: int, rows: int = 6, prompt: int = 3, resp: int = 9) -> dict[str, Any]:
    """verl's micro-batch ``TensorDict`` and the flat student log-probs (a leaf)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    g = torch.Generator().manual_seed(seed)
    p_lens = torch.randint(1, prompt + 1, (rows,), generator=g)
    r_lens = torch.randint(0, resp + 1, (rows,), generator=g)
    r_lens[0], r_lens[1] = resp, 0  # a full row, an empty row
    attn = torch.cat(
        [torch.arange(prompt) >= prompt - p_lens[:, None], torch.arange(resp) < r_lens[:, None]], 1
    ).long()
    seq = (p_lens + r_lens).tolist()
    nnz = sum(seq)
    student = -4 * torch.rand(nnz, generator=g, dtype=torch.float64) - 1e-3
    teacher = student + 2.5 * torch.randn(nnz, generator=g, dtype=torch.float64)
    far = torch.randint(0, nnz, (4,), generator=g)  # log-ratios past +-20 and k3 past 10
    teacher[far] = student[far] + torch.tensor([25.0, -25.0, 12.0, -12.0], dtype=torch.float64)
    mask = (torch.arange(resp) < r_lens[:, None]).to(torch.float32)
    data = TensorDict(
        {
            "prompts": torch.ones(rows, prompt, dtype=torch.long),
            "responses": torch.ones(rows, resp, dtype=torch.long),
            "attention_mask": attn,
            "response_mask": mask,
            "old_log_probs": -3 * torch.rand(rows, resp, generator=g, dtype=torch.float64),
            "advantages": torch.randn(rows, resp, generator=g, dtype=torch.float64),
            "teacher_logprobs": torch.nested.nested_tensor(
                list(teacher[:, None].split(seq)), layout=torch.jagged
            ),
        },
        batch_size=[rows],
    )
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    return {"data": data, "student": student, "mask": mask.bool()}


def padded(b: dict[str, Any], flat: torch.Tensor) -> torch.Tensor:
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(flat, b["data"])


def configs(name: str, **loss: Any) -> tuple[Any, Any]:
    from verl.workers.config import ActorConfig, DistillationConfig, DistillationLossConfig

    agg = loss.pop("loss_agg_mode", "token-mean")
    actor = ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, loss_agg_mode=agg
    )
    cfg = DistillationLossConfig(loss_mode=name, **loss)
    return actor, DistillationConfig(enabled=False, distillation_loss=cfg)


def run(fn: Any, name: str, b: dict[str, Any], **loss: Any) -> tuple[Any, Any, dict[str, Any]]:
    """``fn(config, distillation_config, model_output, data)`` -> value, grad, metrics."""
    actor, dist = configs(name, **loss)
    lp = b["student"].clone().requires_grad_(True)
    out, metrics = fn(actor, dist, {"log_probs": lp}, b["data"])
    value = out.sum() if out.ndim == 0 else (out * b["mask"]).sum()
    (grad,) = torch.autograd.grad(value, lp)
    return out.detach(), grad, metrics


def metric_values(metrics: dict[str, Any]) -> dict[str, Any]:
    """Each metric as (aggregation, value): verl's ``Metric`` holds host floats."""
    return {
        k: (getattr(v, "aggregation", None), getattr(v, "values", v)) for k, v in metrics.items()
    }


def assert_same_metrics(got: dict[str, Any], want: dict[str, Any]) -> None:
    got_m, want_m = metric_values(got), metric_values(want)
    assert got_m.keys() == want_m.keys()
    for key, (agg, value) in want_m.items():
        assert got_m[key][0] == agg, key
        want_v = torch.as_tensor(value, dtype=torch.float64)
        torch.testing.assert_close(
            torch.as_tensor(got_m[key][1], dtype=torch.float64), want_v, **TOL
        )


@pytest.mark.parametrize("name", NAMES)
def test_twin_per_token_equals_verl(name: str) -> None:
    verl_fn = losses.get_distillation_loss_fn(name)
    ours_fn = losses.get_distillation_loss_fn("dapo_ops_" + name)
    assert ours_fn is verl_distill.compute_distillation_loss
    pg = {"use_policy_gradient": True}
    for seed in range(3):
        b = batch(seed)
        want, g_want, m_want = run(verl_fn, name, b, **pg)
        got, g_got, m_got = run(ours_fn, "dapo_ops_" + name, b, **pg)
        m = b["mask"]
        torch.testing.assert_close(got[m], want[m], **TOL)
        assert bool((got[~m] == 0).all())
        torch.testing.assert_close(g_got, g_want, **TOL)
        assert_same_metrics(m_got, m_want)


GRID = list(
    itertools.product(
        [True, False],  # use_policy_gradient
        [True, False],  # use_task_rewards
        [None, 10.0, 0.7],  # loss_max_clamp
        ["token-mean", "seq-mean-token-mean"],
    )
)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("pg", "task", "cap", "agg"), GRID)
def test_distillation_ppo_loss_equals_verl(
    name: str, pg: bool, task: bool, cap: float | None, agg: str
) -> None:
    """verl's whole loss (its clamps, aggregation, PPO path, coefficient) with our twin, and
    dapo_ops' own composition of the same term, against verl's."""
    if name in ("k1", "kl") and not pg:
        pytest.skip("verl refuses k1 as a supervised loss (and so does the twin)")
    loss = {
        "use_policy_gradient": pg,
        "use_task_rewards": task,
        "loss_max_clamp": cap,
        "distillation_loss_coef": 0.6,
        "loss_agg_mode": agg,
    }
    b = batch(7)
    want, g_want, m_want = run(losses.distillation_ppo_loss, name, b, **loss)
    got, g_got, m_got = run(losses.distillation_ppo_loss, "dapo_ops_" + name, b, **loss)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(g_got, g_want, **TOL)
    assert_same_metrics(m_got, m_want)
    # dapo_ops' own API, the same numbers
    _, dist = configs(name, **{k: v for k, v in loss.items() if k != "loss_agg_mode"})
    ours = ours_loss(name, b, dist.distillation_loss, agg)
    assert ours is not None
    torch.testing.assert_close(ours[0], want, **TOL)
    torch.testing.assert_close(ours[1], g_want, **TOL)


def ours_loss(name: str, b: dict[str, Any], cfg: Any, agg: str) -> tuple[Any, Any] | None:
    """``distillation_ppo_loss`` written with dapo_ops: ``policy_loss`` (verl's vanilla PPO:
    dual clip 3) for the task, ``distill=`` or ``distill_advantages`` for the teacher."""
    data, mask = b["data"], b["mask"]
    mode = {"token-mean": "token_mean", "seq-mean-token-mean": "seq_mean_token_mean"}[agg]
    lp = b["student"].clone().requires_grad_(True)
    logp = padded(b, lp)
    teacher = padded(b, data["teacher_logprobs"]).squeeze(-1)
    old, adv = data["old_log_probs"], data["advantages"]
    distill = verl_distill.teacher_kl_from_config(cfg)
    ppo = d.ClipHigher(eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    opts: dict[str, Any] = {"mode": mode, "normalizer": "local"}
    if not cfg.use_policy_gradient:
        if cfg.use_task_rewards:
            total = d.policy_loss(
                ppo, logp, old, adv, mask, teacher_logp=teacher, distill=distill, **opts
            )
        else:
            total = d.distill_loss(logp, teacher, mask, distill=distill, **opts)
    else:
        a = d.distill_advantages(logp, teacher, mask, distill=distill)
        total = d.policy_loss(ppo, logp, old, a, mask, **opts)
        if cfg.use_task_rewards:
            total = total + d.policy_loss(ppo, logp, old, adv, mask, **opts)
    (grad,) = torch.autograd.grad(total, lp)
    return total.detach(), grad


def test_k1_as_a_supervised_loss_is_refused() -> None:
    b = batch(0)
    with pytest.raises(d.InputError, match="use_policy_gradient"):
        run(verl_distill.compute_distillation_loss, "dapo_ops_kl", b, use_policy_gradient=False)


def test_registration_is_idempotent() -> None:
    verl_distill.register_distillation()
    for name in verl_distill.DISTILL_NAMES:
        assert losses.get_distillation_loss_fn(name) is verl_distill.compute_distillation_loss
        assert losses.get_distillation_loss_settings(name).use_estimator


def test_verl_external_modules_registers_the_twins() -> None:
    """``VERL_USE_EXTERNAL_MODULES=dapo_ops.integrations.verl_distill``: verl imports the
    module while it initialises, and a config naming ``dapo_ops_k3`` then resolves."""
    import os
    import subprocess
    import sys

    code = (
        "import verl\n"
        "from verl.workers.config import DistillationLossConfig\n"
        "print(DistillationLossConfig(loss_mode='dapo_ops_k3').loss_settings.use_estimator)\n"
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "dapo_ops.integrations.verl_distill"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("True")
