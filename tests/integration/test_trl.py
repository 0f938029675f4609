"""DapoGRPOTrainer against the real ``trl.GRPOTrainer`` (TRL 1.16), on a tiny local model.

Nothing is downloaded: the tokenizer is a word-level ``tokenizers`` model built here and
the policy a 2-layer Llama with hidden size 16, randomly initialised from a config. The
trainer runs two real optimiser steps (two micro-batches each, two PPO iterations per
generation so that ``old_per_token_logps`` differ from the current ones); on every
micro-batch a probe calls both our ``compute_loss`` and TRL's own on the same inputs, for
every supported ``loss_type`` and option, and compares the losses and their gradients.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("datasets")

pytestmark = [
    pytest.mark.integration,
    # transformers 5 deprecation notices raised inside TRL's own calls, not ours.
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

WORDS = ["<pad>", "<bos>", "<eos>", "<unk>", *[str(i) for i in range(10)], "+", "=", "a", "b"]
MAX_COMPLETION = 8
CLIP_METRICS = (
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
)
#: TRL's adaptive-entropy controller state, compared after both losses ran from the same one
ENTROPY_STATE = ("entropy_coef", "_last_world_entropy", "_entropy_window_stats")
#: the metric TRL logs instead of the clip ratios for these loss types
OWN_METRICS = {"cispo": ("cispo_clip_ratio",), "vespo": ("vespo/phi_seq_mean",), "sapo": ()}


def tiny_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
    )


def tiny_model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config)


def digit_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """A deterministic reward with spread inside every group (so advantages are non-zero)."""
    return [float(sum(ids) % 5) for ids in completion_ids]


def grpo_config(tmp_path: Any, **overrides: Any) -> Any:
    from trl import GRPOConfig

    options: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        max_completion_length=MAX_COMPLETION,
        max_steps=2,
        num_iterations=2,
        learning_rate=0.05,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.0,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
    )
    options.update(overrides)
    return GRPOConfig(**options)


def prompts() -> Any:
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ["1 + 2 =", "3 + 4 =", "a b", "5 + 5 ="]})


# Each variant: (name, loss_type, trainer attributes, args attributes, input transform).
def _with_ref(inputs: dict[str, Any], logps: torch.Tensor) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    ref = logps - 0.3 * torch.rand(logps.shape, generator=gen)
    return {**_with_old(inputs, logps), "ref_per_token_logps": ref}


def _with_old(inputs: dict[str, Any], logps: torch.Tensor) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(2)
    return {**inputs, "old_per_token_logps": logps + 0.5 * torch.randn(logps.shape, generator=gen)}


def _with_is(shape_last: int) -> Any:
    def transform(inputs: dict[str, Any], logps: torch.Tensor) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(3)
        size = (logps.shape[0], logps.shape[1] if shape_last < 0 else shape_last)
        ratio = 0.5 + torch.rand(size, generator=gen)
        if shape_last < 0:  # TRL's token ratio is exp(0) = 1 at padding (VESPO sums every slot)
            ratio = torch.where(inputs["completion_mask"] != 0, ratio, 1.0)
        return {**_with_old(inputs, logps), "importance_sampling_ratio": ratio}

    return transform


def _same(inputs: dict[str, Any], logps: torch.Tensor) -> dict[str, Any]:
    return inputs


VARIANTS: list[tuple[str, str, dict[str, Any], dict[str, Any], Any]] = [
    ("dapo", "dapo", {}, {}, _same),
    ("bnpo", "bnpo", {}, {}, _same),
    ("grpo", "grpo", {}, {}, _same),
    ("dr_grpo", "dr_grpo", {}, {}, _same),
    *[(f"{lt}+clipping", lt, {}, {}, _with_old) for lt in ("dapo", "bnpo", "grpo", "dr_grpo")],
    ("dapo+steps_per_generation=4", "dapo", {}, {"steps_per_generation": 4}, _with_old),
    ("grpo+beta", "grpo", {"beta": 0.04}, {}, _with_ref),
    ("dapo+beta+symmetric-eps", "dapo", {"beta": 0.04, "epsilon_high": 0.2}, {}, _with_ref),
    (
        "bnpo+beta-no-bias-correction",
        "bnpo",
        {"beta": 0.1},
        {"use_bias_correction_kl": False},
        _with_ref,
    ),
    ("dapo+delta", "dapo", {}, {"delta": 1.5}, _with_old),
    (
        "dapo+vllm-is-token",
        "dapo",
        {"use_vllm": True, "vllm_importance_sampling_correction": True},
        {},
        _with_is(-1),
    ),
    (
        "bnpo+vllm-is-sequence",
        "bnpo",
        {"use_vllm": True, "vllm_importance_sampling_correction": True},
        {},
        _with_is(1),
    ),
    ("cispo", "cispo", {"epsilon_high": 5.0}, {}, _with_old),
    ("cispo+cap-1.5+beta", "cispo", {"epsilon_high": 1.5, "beta": 0.04}, {}, _with_ref),
    ("sapo", "sapo", {}, {}, _with_old),
    (
        "sapo+temperatures",
        "sapo",
        {},
        {"sapo_temperature_pos": 2.0, "sapo_temperature_neg": 0.5},
        _with_old,
    ),
    ("dapo+top-entropy-20%", "dapo", {"top_entropy_quantile": 0.2}, {}, _with_old),
    ("grpo+off-policy-mask", "grpo", {"off_policy_mask_threshold": 0.05}, {}, _with_old),
    (
        "bnpo+both-selections+vllm-is",
        "bnpo",
        {
            "top_entropy_quantile": 0.5,
            "off_policy_mask_threshold": 0.05,
            "use_vllm": True,
            "vllm_importance_sampling_correction": True,
        },
        {},
        _with_is(-1),
    ),
    ("vespo", "vespo", {}, {}, _with_old),
    (
        "vespo+shape",
        "vespo",
        {},
        {"vespo_k_pos": 1.5, "vespo_lambda_pos": 1.0, "vespo_k_neg": 2.0, "vespo_lambda_neg": 4.0},
        _with_old,
    ),
    ("luspo", "luspo", {"importance_sampling_level": "sequence"}, {}, _with_old),
    ("grpo+sequence-level", "grpo", {"importance_sampling_level": "sequence"}, {}, _with_old),
    (
        "dapo+sequence-level+beta",
        "dapo",
        {"importance_sampling_level": "sequence", "beta": 0.04},
        {},
        _with_ref,
    ),
    # delta at or below 1 + epsilon_high: TRL's cap is then the upper clip
    ("dapo+delta-below-1+eps_high", "dapo", {}, {"delta": 1.1}, _with_old),
    ("grpo+delta-at-1+eps_high", "grpo", {}, {"delta": 1.28}, _with_old),
    (
        "grpo+sequence-level+delta",
        "grpo",
        {"importance_sampling_level": "sequence"},
        {"delta": 1.5},
        _with_old,
    ),
    ("luspo+token-level", "luspo", {}, {}, _with_old),  # TRL warns, and runs token ratios
    ("cispo+default-cap-0.2", "cispo", {"epsilon_high": 0.2}, {}, _with_old),
    (
        "cispo+sequence-level",
        "cispo",
        {"epsilon_high": 5.0, "importance_sampling_level": "sequence"},
        {},
        _with_old,
    ),
    ("sapo+sequence-level", "sapo", {"importance_sampling_level": "sequence"}, {}, _with_old),
    (
        "bnpo+sequence-level+vllm-is",
        "bnpo",
        {
            "importance_sampling_level": "sequence",
            "use_vllm": True,
            "vllm_importance_sampling_correction": True,
        },
        {},
        _with_is(1),
    ),
    (
        "vespo+vllm-is-token",
        "vespo",
        {"use_vllm": True, "vllm_importance_sampling_correction": True},
        {},
        _with_is(-1),
    ),
    (
        "vespo+sequence-level+beta",
        "vespo",
        {"importance_sampling_level": "sequence", "beta": 0.04},
        {},
        _with_ref,
    ),
    # the entropy bonus, static and adaptive (both branches of the controller)
    (
        "dapo+entropy_coef",
        "dapo",
        {"entropy_coef": 0.05, "_entropy_bonus_enabled": True},
        {},
        _with_old,
    ),
    (
        "grpo+entropy_coef+top-entropy",
        "grpo",
        {"entropy_coef": 0.05, "_entropy_bonus_enabled": True, "top_entropy_quantile": 0.3},
        {},
        _with_old,
    ),
    (
        "bnpo+adaptive-entropy-applied",
        "bnpo",
        {
            "entropy_coef": 0.02,
            "use_adaptive_entropy": True,
            "_entropy_bonus_enabled": True,
            "_last_world_entropy": 0.0,
        },
        {"entropy_target": 10.0},
        _with_old,
    ),
    (
        "dr_grpo+adaptive-entropy-off",
        "dr_grpo",
        {
            "entropy_coef": 0.02,
            "use_adaptive_entropy": True,
            "_entropy_bonus_enabled": True,
            "_last_world_entropy": float("inf"),
        },
        {"entropy_target": 0.1, "entropy_coef_delta": 0.01},
        _with_old,
    ),
    (
        "cispo+adaptive-entropy+beta",
        "cispo",
        {
            "epsilon_high": 5.0,
            "beta": 0.04,
            "entropy_coef": 0.3,
            "use_adaptive_entropy": True,
            "_entropy_bonus_enabled": True,
            "_last_world_entropy": 0.05,
        },
        {"entropy_target": 0.1, "entropy_coef_max": 0.31},
        _with_ref,
    ),
]


def _metric_keys(loss_type: str, attrs: dict[str, Any]) -> tuple[str, ...]:
    keys = ("entropy", *OWN_METRICS.get(loss_type, CLIP_METRICS))
    if attrs.get("beta"):
        keys += ("kl",)
    if attrs.get("_entropy_bonus_enabled"):
        keys += ("policy_loss",)
    return keys


def _same_value(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return bool(torch.allclose(a.double(), b.double(), rtol=1e-6, atol=1e-6))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == pytest.approx(b, rel=1e-6, abs=1e-6))


def test_dapo_grpo_trainer_trains_and_matches_trl(tmp_path: Any) -> None:
    from trl import GRPOTrainer

    from dapo_ops import global_normalizer
    from dapo_ops.integrations.trl import DapoGRPOTrainer, OverlongReward

    records: list[dict[str, Any]] = []

    class Probe(DapoGRPOTrainer):  # type: ignore[misc, valid-type]
        """Runs both losses on every micro-batch before returning ours to the trainer."""

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            # TRL's "dapo" normaliser is dapo_ops' global normaliser of the step (one
            # process, steps_per_generation == gradient_accumulation_steps).
            step_masks = [b["completion_mask"] for b in self._buffered_inputs]
            records.append(
                {
                    "num_items_in_batch": float(inputs["num_items_in_batch"]),
                    "global_normalizer": float(global_normalizer(step_masks)),
                }
            )
            compare(self, model, inputs)
            return loss

    def compare(trainer: Any, model: Any, inputs: dict[str, Any]) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                model,
                torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
                torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
                inputs["completion_ids"].size(1),
            )
        for name, loss_type, attrs, arg_attrs, transform in VARIANTS:
            saved = {k: getattr(trainer, k) for k in ["loss_type", *attrs, *ENTROPY_STATE]}
            saved_args = {k: getattr(trainer.args, k) for k in arg_attrs}
            trainer.loss_type = loss_type
            for k, v in attrs.items():
                setattr(trainer, k, v)
            for k, v in arg_attrs.items():
                setattr(trainer.args, k, v)
            start = {k: getattr(trainer, k) for k in ENTROPY_STATE}
            try:
                batch = transform(inputs, logps)
                ours = DapoGRPOTrainer.compute_loss(trainer, model, batch)
                keys = _metric_keys(loss_type, attrs)
                metrics = {k: trainer._metrics["train"][k][-1] for k in keys}
                state_ours = {k: getattr(trainer, k) for k in ENTROPY_STATE}
                for k, v in start.items():
                    setattr(trainer, k, v)
                theirs = GRPOTrainer.compute_loss(trainer, model, batch)
                metrics_trl = {k: trainer._metrics["train"][k][-1] for k in metrics}
                state_trl = {k: getattr(trainer, k) for k in ENTROPY_STATE}
                g_ours = torch.autograd.grad(ours, params)
                g_theirs = torch.autograd.grad(theirs, params)
            finally:
                for k, v in saved.items():
                    setattr(trainer, k, v)
                for k, v in saved_args.items():
                    setattr(trainer.args, k, v)
            records.append(
                {
                    "variant": name,
                    "ours": float(ours.detach()),
                    "theirs": float(theirs.detach()),
                    "loss_diff": abs(float(ours.detach()) - float(theirs.detach())),
                    "grad_diff": max(
                        float((a - b).abs().max()) for a, b in zip(g_ours, g_theirs, strict=True)
                    ),
                    "grad_scale": max(float(b.abs().max()) for b in g_theirs),
                    "metrics": metrics,
                    "metrics_trl": metrics_trl,
                    "state": state_ours,
                    "state_trl": state_trl,
                    "synced": bool(trainer.accelerator.sync_gradients),
                }
            )

    torch.manual_seed(0)
    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Probe(
        model=model,
        reward_funcs=[digit_reward, OverlongReward(max_len=MAX_COMPLETION, cache_len=4)],
        args=grpo_config(tmp_path),
        train_dataset=prompts(),
        processing_class=tiny_tokenizer(),
    )
    trainer.train()

    # Two real optimiser steps happened, with finite losses, and moved the weights.
    assert trainer.state.global_step == 2
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all(math.isfinite(v) for v in logged)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert any("rewards/overlong_reward/mean" in h for h in trainer.state.log_history), (
        "the overlong reward function was not logged under its name"
    )

    normalisers = [r for r in records if "num_items_in_batch" in r]
    assert len(normalisers) == 4  # 2 steps x 2 micro-batches
    for r in normalisers:
        assert r["num_items_in_batch"] == r["global_normalizer"]

    compared = [r for r in records if "variant" in r]
    assert len(compared) == 4 * len(VARIANTS)
    clipped = 0.0
    for r in compared:
        assert r["loss_diff"] <= 1e-6 * max(1.0, abs(r["theirs"])), r
        assert r["grad_diff"] <= 1e-5 * max(1.0, r["grad_scale"]), r
        for key, value in r["metrics"].items():
            assert _same_value(value, r["metrics_trl"][key]), (r["variant"], key, r["metrics"])
        for key, value in r["state"].items():
            assert _same_value(value, r["state_trl"][key]), (r["variant"], key, r["state"])
        clipped += sum(v for k, v in r["metrics"].items() if k.startswith(("clip", "cispo")))
    assert clipped > 0, "no variant exercised the clip: the comparison would be vacuous"
    moved = {
        (r["variant"], r["state"]["entropy_coef"] > 0.02)
        for r in compared
        if "adaptive" in r["variant"] and r["synced"]
    }
    assert ("bnpo+adaptive-entropy-applied", True) in moved, moved  # raised: entropy < 10
    assert ("dr_grpo+adaptive-entropy-off", False) in moved, moved  # lowered: entropy > 0.1
    worst_loss = max(r["loss_diff"] for r in compared)
    worst_grad = max(r["grad_diff"] for r in compared)
    smallest_grad = min(r["grad_scale"] for r in compared)
    assert smallest_grad > 1e-4, (
        "a variant had (almost) no gradient: the comparison would be vacuous"
    )
    print(
        f"\nTRL equality over {len(compared)} comparisons: max |loss diff| {worst_loss:.3g}, "
        f"max |grad diff| {worst_grad:.3g} (smallest max |grad| {smallest_grad:.3g})"
    )


def test_overlong_reward_equals_trl_soft_overlong_punishment() -> None:
    from trl.rewards import get_soft_overlong_punishment

    from dapo_ops.integrations.trl import OverlongReward

    completion_ids = [[5] * n for n in range(0, 40)]
    for max_len, cache in [(20, 4), (32, 16), (16, 16), (10, 1)]:
        ours = OverlongReward(max_len=max_len, cache_len=cache)(completion_ids=completion_ids)
        theirs = get_soft_overlong_punishment(max_len, cache)(completion_ids)
        assert ours == pytest.approx(theirs, abs=1e-6)


def test_unsupported_settings_are_refused(tmp_path: Any) -> None:
    from dapo_ops.integrations.trl import DapoGRPOTrainer

    for overrides in [
        {"loss_type": "sapo", "delta": 3.0},  # TRL ignores delta for sapo, cispo and vespo
        {"loss_type": "vespo", "delta": 2.0},
        {"delta": 1.0},  # a cap at 1 stops every positive-advantage token
    ]:
        with pytest.raises(ValueError, match="does not reproduce"):
            DapoGRPOTrainer(
                model=tiny_model(),
                reward_funcs=digit_reward,
                args=grpo_config(tmp_path, **overrides),
                train_dataset=prompts(),
                processing_class=tiny_tokenizer(),
            )
