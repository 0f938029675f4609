"""The docs' claims of the form "X raises" and "X equals Y", each a test naming its page.

Each test first finds its claim on the page (whitespace-insensitive), so a page that
rewords or drops a claim fails here until its test is revisited. Claims about the peers
(TRL, verl, OpenRLHF) are tested against them in tests/integration/, named on the pages;
the code blocks of the pages run as tests of their own (tools/doc_blocks.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import dapo_ops
from dapo_ops import InputError, presets

DOCS = Path(__file__).resolve().parents[1] / "docs"

# what a user sees: the library's own errors, without the suite's annotation checker
pytestmark = pytest.mark.usefixtures("no_runtime_typecheck")


def claim(page: str, text: str) -> None:
    """The page still says ``text`` (runs of whitespace count as one space)."""
    words = " ".join((DOCS / page).read_text().split())
    assert " ".join(text.split()) in words, f"docs/{page} no longer says: {text!r}"


def batch(rows: int = 3, seq: int = 5) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(rows * 100 + seq)
    logp = -torch.rand(rows, seq, generator=g, dtype=torch.float64) * 2
    old = logp - 0.05
    adv = torch.randn(rows, generator=g, dtype=torch.float64)
    mask = torch.rand(rows, seq, generator=g) > 0.2
    return logp, old, adv, mask


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_advantages_nonfinite_rewards_raise(bad: float) -> None:
    claim("advantages.md", "NaN or inf raises `InputError`")
    rewards = torch.tensor([[1.0, 0.0, bad, 1.0]])
    with pytest.raises(InputError, match="rewards"):
        dapo_ops.group_advantages(rewards)


def test_advantages_list_and_meta_rewards_raise() -> None:
    claim("advantages.md", "a Python list, a meta tensor or mixed devices raise `InputError`")
    with pytest.raises(InputError, match="rewards"):
        dapo_ops.group_advantages([[1.0, 0.0]])  # type: ignore[arg-type]
    with pytest.raises(InputError, match="rewards"):
        dapo_ops.group_advantages(torch.zeros(2, 4, device="meta"))


def test_aggregation_float_mask_is_refused() -> None:
    claim("aggregation.md", "float masks are refused because they could be weights")
    with pytest.raises(InputError, match="mask"):
        dapo_ops.token_level_aggregate(torch.rand(2, 3), torch.ones(2, 3))


def test_distillation_k1_loss_is_refused_unless_straight_through() -> None:
    claim("distillation.md", "`distill_loss` and `policy_loss(distill=)` therefore refuse `k1`")
    logp, old, adv, mask = batch()
    teacher = logp - 0.3
    k1 = dapo_ops.TeacherKL(estimator="k1")
    with pytest.raises(InputError, match="k1"):
        dapo_ops.distill_loss(logp, teacher, mask, distill=k1)
    with pytest.raises(InputError, match="k1"):
        dapo_ops.policy_loss(
            dapo_ops.ClipHigher(), logp, old, adv, mask, teacher_logp=teacher, distill=k1
        )
    through = dapo_ops.TeacherKL(estimator="k1", straight_through=True)
    assert torch.isfinite(dapo_ops.distill_loss(logp, teacher, mask, distill=through))


def test_distillation_k3_without_log_ratio_clamp_is_refused() -> None:
    claim("distillation.md", "`None` for no clamp, refused for k3")
    with pytest.raises(InputError, match="log_ratio_clamp"):
        dapo_ops.TeacherKL(estimator="k3", log_ratio_clamp=None)
    dapo_ops.TeacherKL(estimator="k2", log_ratio_clamp=None)  # the others take None


def test_distillation_advantage_form_equals_verls_two_losses_at_ratio_one() -> None:
    """verl sums ppo(A_task) + ppo(-coef D); one loss on the summed advantages equals it
    while the ratio is 1 (the PPO loss is linear in A there)."""
    claim(
        "distillation.md",
        "`task_advantages=` (one loss, summed advantages) equals it while the ratio is 1",
    )
    logp, _, adv, mask = batch(4, 6)
    teacher = logp - 0.3
    ppo = dapo_ops.ClipHigher(eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    k1 = dapo_ops.TeacherKL(beta=0.5, estimator="k1")
    old = logp.detach()  # the first, on-policy update
    a_distill = dapo_ops.distill_advantages(logp, teacher, mask, distill=k1)
    two = dapo_ops.policy_loss(ppo, logp, old, adv, mask) + dapo_ops.policy_loss(
        ppo, logp, old, a_distill, mask
    )
    summed = dapo_ops.distill_advantages(logp, teacher, mask, distill=k1, task_advantages=adv)
    one = dapo_ops.policy_loss(ppo, logp, old, summed, mask)
    assert torch.allclose(one, two, rtol=1e-12, atol=1e-15)


def test_entropy_nan_entropy_is_refused_or_gives_nan() -> None:
    claim("entropy.md", "A NaN entropy is refused (a number) or makes both results NaN (a tensor)")
    with pytest.raises(InputError):
        dapo_ops.adaptive_entropy_coef(0.01, math.nan)
    out = dapo_ops.adaptive_entropy_coef(torch.tensor(0.01), torch.tensor(math.nan))
    assert bool(out.coef.isnan()) and bool(out.applied.isnan())


def test_normalization_zero_number_is_refused_and_all_masked_step_gives_zero() -> None:
    claim("normalization.md", "A Python number `normalizer=0` is refused as a user error")
    claim("normalization.md", "the losses are then 0 with a zero gradient, never NaN")
    logp, old, adv, _ = batch()
    mask = torch.zeros(3, 5, dtype=torch.bool)
    with pytest.raises(InputError, match="normalizer"):
        dapo_ops.token_level_loss(logp, old, adv, mask, normalizer=0)
    norm = dapo_ops.global_normalizer([mask[:1], mask[1:]])
    assert norm.item() == 0
    leaf = logp.clone().requires_grad_()
    loss = dapo_ops.token_level_loss(leaf, old, adv, mask, normalizer=norm)
    loss.backward()
    assert loss.item() == 0 and leaf.grad is not None and not leaf.grad.any()


@pytest.mark.parametrize("constant", ["old_logp", "advantages"])
def test_objectives_constants_requiring_grad_are_refused(constant: str) -> None:
    claim("objectives.md", "constants refused when they require grad (`InputError`, naming the argument)")  # fmt: skip
    logp, old, adv, mask = batch()
    args = {"old_logp": old, "advantages": adv}
    args[constant] = args[constant].clone().requires_grad_()
    with pytest.raises(InputError, match=constant):
        dapo_ops.policy_loss(
            dapo_ops.ClipHigher(), logp, args["old_logp"], args["advantages"], mask
        )


@pytest.mark.parametrize("objective", [dapo_ops.GSPO(), dapo_ops.GMPO()])
def test_variants_sequence_objectives_take_token_advantages(objective: dapo_ops.Objective) -> None:
    """GSPO-token and GMPO read a [batch, seq] advantage per token; with the same
    advantage on every token of a row they equal the per-sequence call."""
    claim("variants.md", "or per token (`[batch, seq]`, the GSPO-token form)")
    logp, old, adv, mask = batch()
    per_token = adv[:, None].expand(-1, 5).contiguous()
    a = dapo_ops.policy_loss(objective, logp, old, per_token, mask, mode="seq_mean_token_mean")
    b = dapo_ops.policy_loss(objective, logp, old, adv, mask, mode="seq_mean_token_mean")
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-15)


def test_presets_unknown_name_raises_a_key_error_listing_the_names() -> None:
    claim("presets.md", "`presets.PRESETS[name]` with an unknown name raises `presets.UnknownPresetError`")  # fmt: skip
    with pytest.raises(presets.UnknownPresetError) as caught:
        presets.PRESETS["dapoo"]
    assert isinstance(caught.value, KeyError) and isinstance(caught.value, InputError)
    assert "no preset 'dapoo'; the presets are 'dapo', 'grpo', 'dr_grpo', 'gspo', 'cispo'" in str(
        caught.value
    )


def test_presets_settings_a_trainer_lacks_raise() -> None:
    claim("presets.md", "A field the trainer has no setting for raises `InputError` naming it")
    with pytest.raises(InputError, match="overlong_filter"):
        _ = presets.DAPO.replace(overlong_filter=True).verl
    with pytest.raises(InputError, match="mode"):
        _ = presets.DAPO.replace(mode="seq_mean_token_sum").trl


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_sampling_nonfinite_metric_raises(bad: float) -> None:
    claim("sampling.md", "`metric` may be bool, integer or float; NaN or inf raises `InputError`")
    with pytest.raises(InputError, match="metric"):
        dapo_ops.dynamic_sample_mask(torch.tensor([[1.0, bad, 0.0]]))


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_variants_dual_clip_at_most_one_raises(c: float) -> None:
    claim("variants.md", "`c > 1` is required (`c <= 1` raises)")
    with pytest.raises(InputError, match="dual_clip"):
        dapo_ops.ClipHigher(dual_clip=c)


def test_variants_kl_beta_without_ref_logp_raises() -> None:
    claim("variants.md", "raises if `kl_beta > 0` comes without it")
    logp, old, adv, mask = batch()
    with pytest.raises(InputError, match="ref_logp"):
        dapo_ops.token_level_loss(logp, old, adv, mask, kl_beta=0.1)


def _markdown_rows(text: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("|") and not line.startswith("|---")
    ]


def test_choosing_page_quotes_the_demo_ablation_table() -> None:
    """docs/choosing.md's "What the demo measured" rows are cells of docs/demo/table.md,
    the table the demo command writes: the page cannot drift from the measured runs."""
    rows = _markdown_rows((DOCS / "demo" / "table.md").read_text())
    header, body = rows[0], rows[1:]
    cells = {
        (row[0], column): value for row in body for column, value in zip(header, row, strict=False)
    }
    page = (DOCS / "choosing.md").read_text()
    section = page.split("## What the demo measured", 1)[1].split("\n## ", 1)[0]
    quoted = _markdown_rows(section)
    assert quoted[0] == ["row", "column", "value"] and len(quoted) > 5
    for row, column, value in quoted[1:]:
        assert cells.get((row, column)) == value, (row, column, value, cells.get((row, column)))
