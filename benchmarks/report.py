"""The results file (docs/benchmarks.json) and the page rendered from it (docs/benchmarks.md).

The JSON holds one *record* per (device, suite): the run's environment (``meta``), the
cases' constants (floors, memory basis, the reference and unit of each case) and the raw
results. A run of some suites replaces only their records, so one suite can be re-run
without redoing the others; the page is always rendered from the whole file, so it never
depends on the environment that renders it (``tests/test_benchmarks_docs.py``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks import collectives, glance
from benchmarks.harness import Case, Result, Target
from benchmarks.pending import PENDING, PENDING_SUITES, pending_suite
from benchmarks.stale import current_cases, pending_rows, shown_suites

FORMAT = 2
CASE_FIELDS = (
    "op",
    "size",
    "floor_bytes",
    "basis_bytes",
    "basis_name",
    "main_ref",
    "unit",
    "back_to_back",
    "limit_bytes",
)


def load(path: Path) -> dict[str, Any]:
    """The results file; an absent file or one of the old single-run format starts empty."""
    if path.exists():
        data = json.loads(path.read_text())
        if data.get("format") == FORMAT:
            return dict(data)
    return {"format": FORMAT, "notes": [], "runs": {}}


def save(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


def make_record(meta: dict[str, Any], cases: list[Case], results: list[Result]) -> dict[str, Any]:
    return {
        "meta": meta,
        "cases": [{k: getattr(c, k) for k in CASE_FIELDS} for c in cases],
        "results": [asdict(r) for r in results],
    }


def record_cases(record: dict[str, Any]) -> list[Case]:
    return [Case(make_inputs=lambda: None, impls=[], **c) for c in record["cases"]]


def record_results(record: dict[str, Any]) -> list[Result]:
    return [Result(**r) for r in record["results"]]


def _ms(t: float) -> str:
    if math.isnan(t):
        return "n/a"
    if t >= 1.0:
        return f"{t:.2f} s"
    return f"{t * 1e3:.2f} ms" if t >= 1e-3 else f"{t * 1e6:.0f} µs"


def _x(v: float) -> str:
    return (
        "n/a"
        if math.isnan(v) or math.isinf(v)
        else (f"{v:.2f}x" if v < 10 else f"{v:.1f}x" if v < 100 else f"{v:.0f}x")
    )


def _mib(b: int | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:.1f}"


def suite_targets(
    suite_name: str, record: dict[str, Any] | None, device: str = "cpu"
) -> list[Target]:
    """The suite's targets on ``device`` from its record, over the record's cases and the
    suite's cases it lacks (pending: not measured); ``record=None``: a pending suite."""
    from benchmarks.suites import SUITES

    suite = SUITES.get(suite_name)
    if suite is None:
        return []
    if record is None:
        why = pending_suite(device, suite_name) or "not in this run"
        out = suite.targets([], current_cases(suite_name, device, False), math.nan, device)
        for t in out:
            if t.met is None and not t.recorded:
                t.reason = why
        return out
    cases = record_cases(record)
    known = {(c.op, c.size) for c in cases}
    quick = record["meta"]["quick"]
    cases += [c for c in current_cases(suite_name, device, quick) if (c.op, c.size) not in known]
    bandwidth = record["meta"].get("bandwidth") or math.nan
    return suite.targets(record_results(record), cases, bandwidth, device)


def _meta_lines(meta: dict[str, Any]) -> list[str]:
    bw = meta.get("bandwidth")
    peers = ", ".join(f"{k} {v}" for k, v in meta.get("peers", {}).items()) or "none"
    return [
        f"- Measured {meta['date']} by `{meta['command']}`"
        + (" (quick mode: fewer shapes and repeats)" if meta["quick"] else "")
        + f", {meta['wall'] / 60:.1f} min.",
        f"- {meta['machine']}; Python {meta['python']}, torch {meta['torch']}, dapo_ops "
        f"{meta['dapo_ops']}; peers installed: {peers}.",
        f"- Load average (1/5/15 min) at start {meta['loads'][0]}, at end {meta['loads'][1]}."
        + (f" Copy bandwidth in this run: **{bw / 1e9:.1f} GB/s**." if bw else ""),
        *(
            ["- Agreement checked before timing: " + "; ".join(meta["agreement"]) + "."]
            if meta.get("agreement")
            else []
        ),
        *(
            [
                f"- Rows of this run not shown, the code they timed since replaced or gone "
                f"(`python -m benchmarks.run --drop-stale`): {'; '.join(meta['dropped'])}."
            ]
            if meta.get("dropped")
            else []
        ),
    ]


def _table_head(cuda: bool) -> list[str]:
    header = "| case | implementation | median | IQR | min | n | x ref (med / min) | x floor or unit (med / min) | extra peak MiB (tensors / RSS) | x basis |"
    return [header + (" kernels |" if cuda else ""), "|---" * (10 + cuda) + "|"]


def render_record(
    name: str, title: str, notes: list[str], record: dict[str, Any], cuda: bool
) -> list[str]:
    cases = {(c.op, c.size): c for c in record_cases(record)}
    results = record_results(record)
    lines = ["", f"## {title}", "", *_meta_lines(record["meta"]), *[f"- {n}" for n in notes], ""]
    lines += _table_head(cuda)
    for r in results:
        c = cases[(r.op, r.size)]
        head = f"| {r.op} {r.size} | {'**' + r.impl + '**' if r.role == 'ours' else r.impl} |"
        if not r.times:
            blanks = " |" * (7 + cuda)
            error = (r.error or "no result").replace("|", "\\|")
            lines.append(f"{head} {error} |{blanks}")
            continue
        q1, q3 = r.q1q3
        main = next(
            (m for m in results if (m.op, m.size, m.impl) == (r.op, r.size, c.main_ref)), None
        )
        unit = next((m for m in results if (m.op, m.size, m.impl) == (r.op, r.size, c.unit)), None)
        x_ref = (
            "—"
            if main is None or not main.times or main is r or r.role == "unit"
            else f"{_x(main.median / r.median)} / {_x(main.minimum / r.minimum)}"
        )
        bw = record["meta"].get("bandwidth")
        if unit is not None and unit.times:
            x_fl = (
                "unit"
                if unit is r
                else f"{_x(r.median / unit.median)} / {_x(r.minimum / unit.minimum)} unit"
            )
        elif c.floor_bytes and bw:
            floor = c.floor_bytes / bw
            x_fl = f"{_x(r.median / floor)} / {_x(r.minimum / floor)}"
        else:
            x_fl = "—"
        basis = (
            f"{r.mem / c.basis_bytes:.2f} {c.basis_name}"
            if r.mem is not None and c.basis_bytes
            else "n/a"
        )
        row = (
            f"{head} {_ms(r.median)} | {_ms(q1)}-{_ms(q3)} | {_ms(r.minimum)} | {len(r.times)} | "
            f"{x_ref} | {x_fl} | {_mib(r.mem_tensors)} / {_mib(r.mem_rss)} | {basis} |"
        )
        lines.append(row + (f" {r.kernels if r.kernels is not None else 'n/a'} |" if cuda else ""))
    for case, line in pending_rows(name, record, "cuda" if cuda else "cpu"):
        at = max(
            (i for i, x in enumerate(lines) if x.startswith(f"| {case[0]} {case[1]} |")),
            default=len(lines) - 1,
        )
        lines.insert(at + 1, line)
    lines += collectives.table(results)
    compiled = [r for r in results if r.compile_s is not None and r.suite != "compile"]
    if compiled:
        lines += [
            "",
            "Compile time (first call minus the steady-state median):",
            "",
            "| case | implementation | compile time |",
            "|---|---|---|",
        ]
        lines += [f"| {r.op} {r.size} | {r.impl} | {r.compile_s:.1f} s |" for r in compiled]
    return lines


HEADER = """---
hide:
  - toc
---

# Benchmarks

Generated by `python -m benchmarks.run` from `docs/benchmarks.json`; do not edit by hand.

```bash
python -m benchmarks.run                      # every suite (CPU), ~{minutes} min on 2 cores
python -m benchmarks.run linear logprobs      # only these suites: their sections are replaced
python -m benchmarks.run --device cuda        # the GPU sections (CUDA events, kernels per call)
python -m benchmarks.run --from-json docs/benchmarks.json   # re-render this page only
```

Protocol (`benchmarks/harness.py`, `benchmarks/memory.py`): the implementations of one
case run on the same inputs, interleaved round-robin, so background load hits them
alike (back-to-back cases: each implementation's repeats in one block, caches warm).
Median, inter-quartile range and minimum over `n` repeats; on a shared machine the
minima are the least disturbed samples. `x ref` = the case's main reference time /
this row's (above 1: faster than it). `x floor` = time / (bytes the op must read and
write / the copy bandwidth measured in the same run); `unit` rows divide by a yardstick
measured in the same run instead (one `h @ W.T`). Extra peak = memory above the inputs
during one call, in a fresh process: bytes of live tensors (profiler allocator events;
CUDA: `max_memory_allocated`) and resident set growth (`VmHWM - VmRSS`); `x basis`
divides the first (or RSS where only it exists) by the inputs' or the logits' size.
Rows that cannot run here state why (a missing peer, the exact error). The peers' own
functions are timed where they import: run in the integration environment
(`.ci/integration`: TRL, `pip install --no-deps verl==0.9.1`) with
`pip install --no-deps liger-kernel` and `pip install triton` (verl's
`FusedLinearForPPO` imports Liger's Triton ops; triton installs and imports on CPU). TRL's
and verl's fused lm heads load from their wheels without the trainers' stacks
(`benchmarks/suites/_peer_modules.py`), as on the GPU machine (`tools/gpu_session.sh`)."""


def render(data: dict[str, Any]) -> str:
    from benchmarks.suites import SUITES

    runs: dict[str, dict[str, Any]] = data["runs"]
    minutes = (
        sum(r["meta"]["wall"] for r in runs.get("cpu", {}).values() if not r["meta"]["quick"]) / 60
    )
    lines = [
        HEADER.replace("{minutes}", f"{minutes:.0f}" if minutes else "?"),
        *glance.glance(runs),
        "",
        "## Targets",
        "",
    ]
    lines += [
        "Each row is computed from the numbers below (`benchmarks/suites/*.py: targets`).",
        "",
    ]
    lines += [
        "| device | suite | target | measured | limit | verdict |",
        "|---|---|---|---|---|---|",
    ]
    reasons: list[str] = []  # a miss's reason, as a numbered note below the table
    for device, suites in runs.items():
        for name in shown_suites(device, suites):
            for t in suite_targets(name, suites.get(name), device):
                verdict = t.verdict
                head, sep, reason = verdict.partition(" (")
                if sep and reason.endswith(")") and head.startswith("**not met**"):
                    reasons.append(reason[:-1])
                    verdict = f"{head} [{len(reasons)}]"
                lines.append(
                    f"| {device} | {name} | {t.name} | {t.measured} | {t.limit} | "
                    f"{verdict.replace('|', chr(92) + '|')} |"
                )
    if reasons:
        lines += ["", "Why a target was missed:", ""]
        lines += [f"{i}. {r}" for i, r in enumerate(reasons, 1)]
    missing = [f"`{n}`" for n in SUITES if n not in runs.get("cpu", {})]
    if missing:
        lines += [
            "",
            f"Not measured yet on CPU: {', '.join(missing)} (`python -m benchmarks.run {' '.join(m.strip('`') for m in missing)}`).",
        ]
    for device, rows in PENDING.items():
        if device in runs:
            lines += ["", f"Not measured yet on {device}:", ""]
            lines += [f"- rows named, or cases sized, `{text}`: {why}." for text, why in rows]
            lines += [f"- suite `{n}`: {why}." for n, why in PENDING_SUITES.get(device, ())]
    if "cuda" not in runs:
        lines += [
            "",
            "No GPU section yet: `python -m benchmarks.run --device cuda` on a CUDA machine adds it.",
        ]
    if data.get("notes"):
        lines += ["", "## Notes", "", *[f"- {n}" for n in data["notes"]]]
    for device, suites in runs.items():
        for name in shown_suites(device, suites):
            suite, cuda = SUITES[name], device == "cuda"
            title = f"{suite.title} (`{name}`, {device})"
            if name in suites:
                lines += render_record(name, title, list(suite.notes), suites[name], cuda)
            else:  # a pending suite: its rows, each not measured, with why
                lines += ["", f"## {title}", "", f"- Not measured: {pending_suite(device, name)}."]
                lines += [*[f"- {n}" for n in suite.notes], "", *_table_head(cuda)]
                lines += [line for _, line in pending_rows(name, None, device)]
    lines += ["", "## Reference implementations", "", REFERENCES]
    return "\n".join(lines) + "\n"


REFERENCES = """`benchmarks/references.py` holds our own re-implementations of the peers' code paths,
op for op (written from the peers' algorithms; nothing imported or copied); rows marked
`(installed)` time the peers' own functions. verl 0.9.1 (`verl/trainer/ppo/core_algos.py`):
`compute_policy_loss_vanilla` (dual clip `clip_ratio_c=3`; rollout IS weights multiply the
per-token loss) + `agg_loss` + `masked_sum`/`masked_mean`, the `.item()` of its metrics;
`kl_penalty('low_var_kl')`; `compute_grpo_outcome_advantage` (the uid loop) and the
vectorised estimator; the DAPO recipe's `filter_groups` loop; the DAPO reward manager's
overlong penalty. TRL (`grpo_trainer.py`): `_compute_loss` with `loss_type='dapo'` and its
clip-ratio metrics' `.item()`; the dense `view(-1, G)` group advantage; the soft overlong
punishment. Liger-Kernel: `LigerFusedLinearGRPOLoss` itself."""
