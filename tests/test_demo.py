"""The CPU demo: runs learn, the ablation rows differ by one technique each, the outputs
are deterministic whatever the worker count, and the published results are the committed
CSV files rendered (nothing here runs the full ablation)."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dapo_ops import ClipHigher, ObjectivePreset, demo
from dapo_ops.demo import docs, effects, plots, progress, report
from dapo_ops.presets import DAPO, GRPO

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "docs" / "demo"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
#: A config small enough for the default suite (tiny base model, a few steps).
TINY = demo.DemoConfig(sample_budget=512, hidden=16, base_steps=20, group_size=8)


def preset_fields(preset: ObjectivePreset) -> dict[str, object]:
    skip = {"name", "paper", "verl", "trl"}
    return {
        f.name: getattr(preset, f.name) for f in dataclasses.fields(preset) if f.name not in skip
    }


def changed(a: ObjectivePreset, b: ObjectivePreset) -> set[str]:
    fa, fb = preset_fields(a), preset_fields(b)
    return {k for k in fa if fa[k] != fb[k]}


# ------------------------------------------------------------------------------- the rows
def test_grpo_and_dapo_rows_are_the_library_presets() -> None:
    assert preset_fields(demo.GRPO_ROW.preset) == preset_fields(GRPO.replace(kl=None))
    assert preset_fields(demo.DAPO_ROW.preset) == preset_fields(DAPO.replace(overlong_filter=True))
    assert demo.GRPO_ROW.preset.objective == ClipHigher(eps_low=0.2, eps_high=0.2)


def test_cumulative_rows_add_one_technique_each_in_the_papers_order() -> None:
    rows = demo.cumulative_rows()
    assert rows[0] == demo.GRPO_ROW and rows[-1].techniques == demo.DAPO_ROW.techniques
    assert [r.name for r in rows][-1] == "dapo"
    added = [next(iter(b.techniques - a.techniques)) for a, b in itertools.pairwise(rows)]
    assert added == list(demo.TECHNIQUES)  # overlong filtering, Clip-Higher, ... as Table 1
    for a, b in itertools.pairwise(rows):
        assert len(changed(a.preset, b.preset)) == 1, (a.name, b.name)


def test_leave_one_out_rows_remove_one_technique_each() -> None:
    for row in demo.leave_one_out_rows():
        assert len(demo.DAPO_ROW.techniques - row.techniques) == 1
        assert len(changed(row.preset, demo.DAPO_ROW.preset)) == 1, row.name
    names = [r.name for r in demo.ablation_rows()]
    assert len(names) == len(set(names)) == 10  # DAPO - dynamic sampling = + token-level


@pytest.mark.parametrize("key", list(demo.TECHNIQUES))
def test_each_flag_switches_exactly_one_technique_off(key: str) -> None:
    cmd = demo.parse_args(["--no-" + key.replace("_", "-")])
    dapo, grpo = cmd.rows
    assert dapo.techniques == demo.DAPO_ROW.techniques - {key} and grpo == demo.GRPO_ROW
    assert len(changed(dapo.preset, demo.DAPO_ROW.preset)) == 1


def test_default_command_is_dapo_vs_grpo_on_one_seed() -> None:
    cmd = demo.parse_args([])
    assert cmd.rows == (demo.DAPO_ROW, demo.GRPO_ROW) and cmd.seeds == (0,)
    ablation = demo.parse_args(["--ablation", "--seeds", "5"])
    assert ablation.rows == tuple(demo.ablation_rows()) and ablation.seeds == (0, 1, 2, 3, 4)
    assert ablation.config == cmd.config  # same runs, more rows and seeds


# ------------------------------------------------------------------------------- the task
def test_verifier_and_noisy_score() -> None:
    task = demo.Task()
    eos = task.eos
    tokens = torch.tensor([[3, 3, eos, eos], [3, 2, eos, eos], [eos, eos, eos, eos], [3, 3, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    finished = torch.tensor([True, True, True, False])
    z = torch.zeros(4, 4)
    rollout = demo.Rollout(torch.tensor([6, 6, 0, 6]), tokens, mask, z, finished, z)
    # right; wrong sum; no digit at all; right sum but truncated (no EOS within the cap)
    assert task.verify(rollout).tolist() == [1.0, 0.0, 0.0, 0.0]
    big = rollout[torch.tensor([3] * 4000)]  # the truncated answer, 4000 times
    score = task.score(big, torch.Generator().manual_seed(0))
    assert set(score.tolist()) == {0.0, 1.0}  # a coin flip, whatever the answer holds
    assert abs(float(score.mean()) - task.truncated_pass_rate) < 0.03
    finished_rows = rollout[torch.tensor([0, 1, 2])]
    assert torch.equal(task.score(finished_rows, torch.Generator()), task.verify(finished_rows))


def test_every_target_fits_before_the_overlong_penalty() -> None:
    task = demo.Task()
    shortest = -(-task.max_target // task.max_digit) + 1
    assert shortest <= task.max_len - task.cache_len
    with pytest.raises(ValueError, match="fit"):
        demo.Task(max_target=task.max_target + 3)


# ------------------------------------------------------------------------------- training
def test_runs_respect_the_budget_and_dynamic_sampling_draws_more() -> None:
    cmd = demo.Command(config=TINY, workers=1, progress=False)
    dapo, grpo = demo.train_all(cmd)
    for result in (dapo, grpo):
        assert TINY.sample_budget - TINY.group_size < result.logs[-1].samples
        assert result.logs[-1].samples <= TINY.sample_budget
    assert all(log.prompts_drawn == TINY.prompts_per_step for log in grpo.logs)
    assert all(log.generation_rounds == 1 for log in grpo.logs)
    assert len(dapo.logs) < len(grpo.logs)  # the same answers, fewer (fuller) steps
    assert sum(log.prompts_drawn for log in dapo.logs) > len(dapo.logs) * TINY.prompts_per_step


@pytest.mark.slow
def test_a_short_dapo_run_learns() -> None:
    cfg = dataclasses.replace(demo.DemoConfig(), sample_budget=3072)
    result = demo.ablation.run_job(demo.Job(demo.DAPO_ROW, cfg))
    start = result.logs[0].accuracy
    assert start < 0.6  # the base model fails the large targets
    assert result.final.accuracy > start + 0.2, (start, result.final.accuracy)
    assert max(log.clip_frac_high for log in result.logs) > 0  # the clip acted


@pytest.mark.slow
def test_results_do_not_depend_on_the_number_of_workers(tmp_path: Path) -> None:
    # two spawned worker processes, one run each, against both runs in this process
    base = demo.Command(config=TINY, progress=False, plot=False)
    texts = []
    for workers in (1, 2):
        cmd = dataclasses.replace(base, workers=workers, out=tmp_path / str(workers))
        demo.write_outputs(cmd, demo.train_all(cmd))
        texts.append([(cmd.out / n).read_text() for n in ("runs.csv", "curves.csv", "steps.csv")])
    assert texts[0] == texts[1]


def test_main_runs_without_optional_extras(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A None entry in sys.modules makes `import tqdm` / `import matplotlib` raise ImportError.
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(demo.cli, "DemoConfig", lambda: TINY)
    threads = torch.get_num_threads()
    assert demo.main(["--workers", "1", "--budget", "256", "--out", str(tmp_path)]) == 0
    assert torch.get_num_threads() == threads  # the runs restore the thread count
    assert not (tmp_path / "curves.png").exists()
    captured = capsys.readouterr()
    assert "512/512 answers, 2/2 runs" in captured.err  # the plain-text progress line
    assert "| DAPO (all five) |" in captured.out
    runs = report.read_table(tmp_path / "runs.csv")
    assert [r["row"] for r in runs] == ["dapo", "grpo"]
    assert (tmp_path / "table.md").read_text() == docs.full_report(runs)


def test_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        demo.parse_args(["--help"])
    options_part = capsys.readouterr().out.split("\noptions:", 1)[1]
    for option in re.findall(r"^\s+(--[a-z-]+)", options_part, flags=re.M):
        if option == "--help":
            continue
        block = options_part.split(f"  {option}", 1)[1].split("\n  --", 1)[0]
        assert "(default:" in block, (option, block)


# ------------------------------------------------------------------ the published results
def test_published_csv_covers_every_row_and_seed() -> None:
    runs = report.read_table(PUBLISHED / "runs.csv")
    assert tuple(runs[0]) == report.RUN_COLUMNS
    rows = {(r["row"], int(r["seed"])) for r in runs}
    assert rows == {(row.name, s) for row in demo.ablation_rows() for s in range(5)}
    assert {int(r["budget"]) for r in runs} == {demo.DemoConfig().sample_budget}


def test_published_tables_are_the_committed_csv_rendered() -> None:
    """README.md, docs/demo.md and docs/demo/table.md hold the table that the demo's own
    report code renders from docs/demo/runs.csv (re-render: ``docs.COMMAND``)."""
    runs = report.read_table(PUBLISHED / "runs.csv")
    assert (PUBLISHED / "table.md").read_text() == docs.full_report(runs), "stale: " + docs.COMMAND
    for path, expected in docs.doc_blocks(PUBLISHED).items():
        assert docs.current_block(path.read_text()) == expected, f"{path} stale: {docs.COMMAND}"


def test_published_figure_was_drawn_from_the_committed_csv() -> None:
    png = PUBLISHED / "curves.png"
    digest = plots.source_digest([PUBLISHED / "runs.csv", PUBLISHED / "curves.csv"])
    assert plots.png_text(png).get(plots.SOURCE_KEY) == digest, "stale: " + docs.COMMAND


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="the figure needs matplotlib (extra 'demo')")
def test_figure_records_its_source(tmp_path: Path) -> None:
    for name in ("runs.csv", "curves.csv"):
        (tmp_path / name).write_bytes((PUBLISHED / name).read_bytes())
    written = docs.render_outputs(tmp_path)
    assert tmp_path / "curves.png" in written
    text = plots.png_text(tmp_path / "curves.png")
    assert text[plots.SOURCE_KEY] == plots.png_text(PUBLISHED / "curves.png")[plots.SOURCE_KEY]


def test_the_docs_reading_holds_on_the_committed_csv() -> None:
    """What README.md and docs/demo.md say in words about the committed results."""
    runs = report.read_table(PUBLISHED / "runs.csv")

    def per_seed(row: str, key: str) -> dict[str, float]:
        return {r["seed"]: float(r[key]) for r in runs if r["row"] == row and r[key] != ""}

    dapo, grpo = per_seed("dapo", "final_accuracy"), per_seed("grpo", "final_accuracy")
    assert all(dapo[s] >= grpo[s] for s in grpo), (dapo, grpo)  # DAPO >= GRPO, every seed

    def diffs(technique: str, key: str) -> list[list[float]]:
        pairs = effects.comparisons(technique).values()
        return [effects.paired(runs, without, with_, key) for without, with_ in pairs]

    def spread(technique: str, key: str) -> float:  # the largest seed std of the rows compared
        names = {n for pair in effects.comparisons(technique).values() for n in pair}
        return max(statistics.stdev(per_seed(n, key).values()) for n in names)

    # overlong filtering: accuracy up on every seed when added to GRPO
    assert all(d > 0 for d in diffs("overlong_filter", "final_accuracy")[0])
    # soft punishment: shorter answers on every seed, both comparisons
    assert all(d < 0 for ds in diffs("overlong_penalty", "final_length") for d in ds)
    # Clip-Higher: final entropy up on most seeds, by about the seed spread (weak)
    for ds in diffs("clip_higher", "final_entropy"):
        assert sum(d > 0 for d in ds) >= 3
        assert statistics.fmean(ds) < 1.5 * spread("clip_higher", "final_entropy")
    # token-level loss: nothing beyond the seed spread, length nor entropy
    for key in ("final_length", "final_entropy"):
        for ds in diffs("token_level", key):
            assert abs(statistics.fmean(ds)) < spread("token_level", key)
    # dynamic sampling: more answers to the target on every seed
    assert all(d > 0 for ds in diffs("dynamic_sampling", "samples_to_target") for d in ds)


# ------------------------------------------------------------ what the command tells a user
def test_cli_quotes_the_published_seed0_results() -> None:
    """``dapo_ops/demo/expected.py`` is the committed CSV's seed-0 DAPO and GRPO accuracy."""
    from dapo_ops.demo.expected import SEED0_FINAL_ACCURACY

    runs = report.read_table(PUBLISHED / "runs.csv")
    assert docs.seed0_accuracy(runs) == SEED0_FINAL_ACCURACY, "stale: " + docs.COMMAND
    expected = Path(demo.__file__).with_name("expected.py").read_text()
    assert expected == docs.expected_module(runs), "stale: " + docs.COMMAND


def test_default_command_announces_itself_and_its_expectation() -> None:
    default = demo.parse_args([])
    text = demo.cli.announce(default)
    assert "2 run(s) (DAPO (all five), GRPO; seed 0)" in text and "first step" in text
    assert "Expected time: about 17 s on an idle 2-core machine" in text
    note = demo.cli.expectation(default)
    assert note is not None and "DAPO above GRPO" in note
    # another budget, seed or row set is not the published run: no expectation quoted
    for argv in (["--seed", "1"], ["--budget", "256"], ["--no-clip-higher"], ["--ablation"]):
        assert demo.cli.expectation(demo.parse_args(argv)) is None, argv


def test_expected_times_are_the_measured_ones_of_the_demo_page() -> None:
    """The times the CLI quotes come from the two runs docs/demo.md reports; the default
    command and the 5-seed ablation are quoted as measured, other commands in between."""
    page = " ".join((ROOT / "docs" / "demo.md").read_text().split())
    (_, default_s), (_, ablation_s) = progress.MEASURED_ROUNDS_SECONDS
    stated = f"the default comparison in {progress.duration(default_s)} and the 5-seed "
    stated += f"ablation (50 runs) in {progress.duration(ablation_s)}"
    assert stated in page, stated
    assert demo.cli.announce(demo.parse_args(["--ablation", "--seeds", "5"])).count("2 min 46 s")
    budget = progress.MEASURED_BUDGET
    assert progress.expected_seconds(2, 2, budget) == pytest.approx(default_s)
    assert progress.expected_seconds(50, 2, budget) == pytest.approx(ablation_s)
    assert default_s < progress.expected_seconds(10, 2, budget) < ablation_s


def test_the_first_lines_wait_for_no_plotting_library() -> None:
    """The CLI prints what it does and the expected time right after ``import torch``
    (about 1 s here, `python -X importtime -c "import dapo_ops.demo.cli"`): importing it
    loads no plotting library (matplotlib alone takes longer than torch)."""
    code = "import sys, dapo_ops.demo.cli; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_progress_bar_clock_starts_at_the_first_step() -> None:
    """The set-up before the first step (imports, the base model's fit) is not counted as
    sampling time: the bar is made at the first reported step, from its count."""
    pytest.importorskip("tqdm")
    bar = progress.Progress(runs=2, budget=100)
    assert bar.bar is None  # nothing shown, no clock running, before the first step
    bar(0, 40)
    assert bar.bar is not None and bar.bar.n == 40 and bar.bar.initial == 40
    bar(1, 30)
    assert bar.bar.n == 70
    bar.close()


def test_footnotes_only_explain_what_the_table_shows() -> None:
    def runs(acc_to_target: str, seeds: int) -> list[dict[str, str]]:
        row = {k: "0.5" for k in report.RUN_COLUMNS}
        return [
            {**row, "row": "dapo", "label": "DAPO", "seed": str(s), "target": "0.9",
             "samples_to_target": acc_to_target if s == 0 else ""}
            for s in range(seeds)
        ]  # fmt: skip

    reached = docs.table(runs("1000", 1))
    assert "never" not in reached and reached.rstrip().endswith("Seed 0.")
    assert "*never*" in docs.table(runs("", 1))
    assert "(k/2)" in docs.table(runs("1000", 2))  # one of two seeds reached it
    assert "(k/2)" not in docs.table([{**r, "samples_to_target": "9"} for r in runs("9", 2)])
