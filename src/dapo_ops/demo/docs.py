"""Published results: the table and figure rendered from the CSV files, and the doc blocks.

``python -m dapo_ops.demo --ablation --seeds 5 --out docs/demo --update-docs`` writes
``docs/demo/{runs,curves}.csv``, renders ``table.md`` and ``curves.png`` from them and
rewrites the blocks between the markers below in README.md and docs/demo.md.
``tests/test_demo_docs.py`` re-renders everything from the committed CSV files and fails
when a published number or the figure is stale.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dapo_ops.demo.ablation import cumulative_rows, leave_one_out_rows
from dapo_ops.demo.effects import render_effects
from dapo_ops.demo.plots import plot, source_digest
from dapo_ops.demo.report import METRICS, Metric, Table, read_table, render_table

ROOT = Path(__file__).resolve().parents[3]
COMMAND = "python -m dapo_ops.demo --ablation --seeds 5 --out docs/demo --update-docs"
START = f"<!-- demo:start ({COMMAND} writes this block) -->"
END = "<!-- demo:end -->"
#: The README's short table: the columns each technique targets.
README_METRICS = ("final_accuracy", "samples_to_target", "final_entropy", "final_length")


def layout(runs: Table) -> list[tuple[str, str]]:
    """``(label, row name)`` lines of the table: the paper's layout for a full ablation."""
    present = dict.fromkeys(r["row"] for r in runs)
    cumulative, loo = cumulative_rows(), leave_one_out_rows()
    if not all(row.name in present for row in cumulative):
        return [(_label(runs, name), name) for name in present]
    by_techniques = {row.techniques: row.name for row in cumulative}
    lines = [("cumulative, as in the paper's table", "--")]
    lines += [(row.label, row.name) for row in cumulative]
    lines.append(("DAPO minus one technique", "--"))
    lines += [(row.label, by_techniques.get(row.techniques, row.name)) for row in loo]
    return lines


def _label(runs: Table, name: str) -> str:
    return next(r["label"] for r in runs if r["row"] == name)


def table(runs: Table, metrics: Sequence[Metric] = METRICS) -> str:
    target = float(runs[0]["target"])
    return render_table(runs, layout(runs), target, metrics)


def full_report(runs: Table) -> str:
    """``table.md``: the table and, for a full ablation, each technique's paired effect."""
    text = table(runs)
    if layout(runs)[0][1] == "--":  # every row of the ablation is there
        text += "\n" + render_effects(runs)
    return text


def render_outputs(out: Path, plot_figure: bool = True) -> list[Path]:
    """``table.md`` and ``curves.png`` from ``runs.csv`` and ``curves.csv`` in ``out``."""
    runs_csv, curves_csv = out / "runs.csv", out / "curves.csv"
    runs = read_table(runs_csv)
    written = [out / "table.md"]
    written[0].write_text(full_report(runs))
    if plot_figure:
        budget = int(runs[0]["budget"])
        seeds = len({r["seed"] for r in runs})
        lines = layout(runs)
        groups = _figure_groups(lines)
        what = "The DAPO ablation" if lines[0][1] == "--" else "DAPO vs GRPO"
        over = f"mean over {seeds} seeds, ±std shaded" if seeds > 1 else f"seed {runs[0]['seed']}"
        title = f"{what} on the digit-sum task: {over}, {budget:,} generated answers per run"
        source = source_digest([runs_csv, curves_csv])
        png = out / "curves.png"
        if plot(png, read_table(curves_csv), groups, title, source):
            written.append(png)
    return written


def _figure_groups(lines: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """One figure row per section of the table; DAPO drawn in every row for reference."""
    groups: list[list[tuple[str, str]]] = []
    for label, name in lines:
        if name == "--" or not groups:
            groups.append([])
        if name != "--":
            groups[-1].append((label, name))
    dapo = [(label, name) for label, name in lines if name == "dapo"]
    return [g if any(n == "dapo" for _, n in g) else dapo + g for g in groups if g]


def seed0_accuracy(runs: Table) -> dict[str, float]:
    """Final accuracy of the default command's rows (DAPO, GRPO) with seed 0."""
    return {
        r["row"]: round(float(r["final_accuracy"]), 2)
        for r in runs
        if r["row"] in ("dapo", "grpo") and int(r["seed"]) == 0
    }


def default_run_sentence(runs: Table) -> str:
    """What the default command prints, in words: the seed-0 rows of the published runs."""
    acc = seed0_accuracy(runs)
    return (
        "The default command (`python -m dapo_ops.demo`) trains only DAPO and GRPO, with "
        f"seed 0: it ends at final accuracy {acc['dapo']:.2f} for DAPO and "
        f"{acc['grpo']:.2f} for GRPO, the seed-0 runs of this table (one seed, so the gap "
        f"is not the mean gap above), and prints {len(README_METRICS)} of the {len(METRICS)} "
        "metric columns of the `table.md` it writes.\n"
    )


def expected_module(runs: Table) -> str:
    """``dapo_ops/demo/expected.py``: what the CLI tells a user to expect."""
    acc = seed0_accuracy(runs)
    return (
        f'"""Written by ``{COMMAND}``\n'
        "from docs/demo/runs.csv (tests/test_demo.py checks it): the final accuracy of the\n"
        'default command\'s rows with seed 0 and the default budget, quoted by the CLI."""\n\n'
        f'SEED0_FINAL_ACCURACY = {{"dapo": {acc["dapo"]}, "grpo": {acc["grpo"]}}}\n'
    )


def doc_blocks(out: Path) -> dict[Path, str]:
    """What each published file's demo block must be, rendered from ``out/runs.csv``."""
    runs = read_table(out / "runs.csv")
    short = [m for m in METRICS if m.key in README_METRICS]
    readme = f"{table(runs, short)}\n{default_run_sentence(runs)}"
    return {
        ROOT / "README.md": f"{START}\n\n{readme}\n{END}",
        ROOT / "docs" / "demo.md": f"{START}\n\n{full_report(runs)}\n{END}",
    }


def current_block(text: str) -> str:
    """The demo block of a file's text ("" when it has none)."""
    start = text.find(START)
    end = text.find(END, start)
    return text[start : end + len(END)] if start >= 0 and end >= 0 else ""


def update_docs(out: Path) -> list[Path]:
    """Rewrite the demo block of README.md and docs/demo.md from ``out/runs.csv``."""
    written = []
    for path, new in doc_blocks(out).items():
        text = path.read_text()
        old = current_block(text)
        if not old:
            raise SystemExit(f"{path} has no {START!r} ... {END!r} block to rewrite")
        path.write_text(text.replace(old, new))
        written.append(path)
    expected = Path(__file__).with_name("expected.py")
    expected.write_text(expected_module(read_table(out / "runs.csv")))
    return [*written, expected]


def summary(out: Path) -> str:
    """A few lines for the terminal: each row's final accuracy, entropy and length."""
    runs = read_table(out / "runs.csv")
    short = [m for m in METRICS if m.key in README_METRICS]
    return (
        table(runs, short)
        + f"({len(short)} of the {len(METRICS)} metric columns; {out / 'table.md'} has them all.)"
    )
