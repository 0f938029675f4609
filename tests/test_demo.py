"""The CPU demo: a shortened DAPO run learns, and the outputs are written as documented."""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

from dapo_ops import ClipHigher, demo

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

REQUIRED_COLUMNS = {
    "method",
    "step",
    "accuracy",
    "mean_response_length",
    "entropy",
    "clip_frac_low",
    "clip_frac_high",
    "kept_group_fraction",
    "generation_rounds",
}


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_short_demo_learns_and_writes_outputs(tmp_path: Path) -> None:
    cfg = dataclasses.replace(
        demo.DemoConfig(),
        steps=40,
        seed=0,
        out=tmp_path,
        progress=False,
        plot=HAS_MATPLOTLIB,
        budget="steps",  # the default "samples" gives DAPO fewer steps; here count steps
    )
    runs = demo.run(cfg)

    dapo = runs["dapo"]
    assert len(dapo) == 40
    start, end = demo.summarize(dapo, k=5)
    assert start < 0.1  # the untrained policy rarely hits the target
    assert end >= start + 0.4, f"DAPO accuracy {start:.2f} -> {end:.2f}"
    # Dynamic sampling drew extra prompts to fill its batches; GRPO never does.
    assert sum(log.prompts_drawn for log in dapo) > 40 * cfg.prompts_per_step
    assert all(log.prompts_drawn == cfg.prompts_per_step for log in runs["grpo"])
    assert all(log.generation_rounds == 1 for log in runs["grpo"])
    assert max(log.clip_frac_low + log.clip_frac_high for log in dapo) > 0  # the clip acted

    rows = read_csv(tmp_path / "metrics.csv")
    assert set(rows[0]) >= REQUIRED_COLUMNS
    assert [r["method"] for r in rows] == ["dapo"] * 40 + ["grpo"] * 40
    assert [int(r["step"]) for r in rows[:40]] == list(range(1, 41))
    for r in rows:
        assert 0.0 <= float(r["accuracy"]) <= 1.0
        assert 0.0 <= float(r["kept_group_fraction"]) <= 1.0
        assert float(r["entropy"]) >= 0.0
    if HAS_MATPLOTLIB:
        png = tmp_path / "dapo_vs_grpo.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_runs_without_optional_extras(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A None entry in sys.modules makes `import tqdm` / `import matplotlib` raise ImportError.
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    threads = torch.get_num_threads()
    argv = ["--steps", "2", "--group-size", "4", "--out", str(tmp_path), "--budget", "steps"]
    assert demo.main(argv) == 0
    assert torch.get_num_threads() == threads  # the demo restores the thread count
    assert not (tmp_path / "dapo_vs_grpo.png").exists()
    captured = capsys.readouterr()
    assert "\rdapo: 2/2" in captured.err  # the plain-text progress line
    assert "dapo: 2 steps" in captured.out
    rows = read_csv(tmp_path / "metrics.csv")
    assert len(rows) == 4


def test_budget_samples_gives_both_runs_the_same_answers(tmp_path: Path) -> None:
    cfg = dataclasses.replace(
        demo.DemoConfig(),
        steps=3,
        group_size=4,
        budget="samples",
        out=tmp_path,
        progress=False,
        plot=False,
    )
    runs = demo.run(cfg)
    for logs in runs.values():
        assert logs[-1].samples == cfg.sample_budget == 3 * cfg.prompts_per_step * 4


@pytest.mark.parametrize(
    ("flag", "field", "value"),
    [
        ("--no-clip-higher", "objective", ClipHigher(eps_low=0.2, eps_high=0.2)),
        ("--no-dynamic-sampling", "dynamic_sampling", False),
        ("--no-token-level", "mode", "seq_mean_token_mean"),
        ("--no-overlong", "overlong_penalty", False),
        ("--overlong-filter", "overlong_filter", True),
    ],
)
def test_ablation_flags_switch_off_one_component(flag: str, field: str, value: object) -> None:
    dapo = demo.parse_args([flag]).dapo
    assert getattr(dapo, field) == value
    others = {f.name for f in dataclasses.fields(dapo)} - {field, "name"}
    default = demo.dapo_preset()
    assert all(getattr(dapo, f) == getattr(default, f) for f in others)


def test_grpo_baseline_settings() -> None:
    grpo = demo.GRPO_BASELINE
    assert grpo.objective == ClipHigher(eps_low=0.2, eps_high=0.2)
    assert grpo.mode == "seq_mean_token_mean"
    assert grpo.kl is None  # no KL term in either run: no reference model
    assert not (grpo.dynamic_sampling or grpo.overlong_penalty or grpo.overlong_filter)


def test_verifier() -> None:
    task = demo.Task()
    eos = task.eos
    tokens = torch.tensor([[3, 3, eos, eos], [3, 2, eos, eos], [eos, eos, eos, eos], [3, 3, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    finished = torch.tensor([True, True, True, False])
    targets = torch.tensor([6, 6, 0, 6])
    z = torch.zeros(4, 4)
    rollout = demo.Rollout(targets, tokens, mask, z, finished, z)
    # right; wrong sum; no digit at all; right sum but truncated (no EOS within the cap)
    assert task.verify(rollout).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_default_compares_at_the_same_sample_budget() -> None:
    # the comparison: same seed, same number of generated answers
    assert demo.DemoConfig().budget == "samples"
    assert demo.parse_args([]).budget == "samples"


def test_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    from dapo_ops.demo.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    options_part = capsys.readouterr().out.split("\noptions:", 1)[1]
    for option in re.findall(r"^\s+(--[a-z-]+)", options_part, flags=re.M):
        if option == "--help":
            continue
        block = options_part.split(f"  {option}", 1)[1].split("\n  --", 1)[0]
        assert "(default:" in block, (option, block)
