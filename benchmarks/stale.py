"""Rows a record lacks (pending) or holds no longer (stale), for the page and the tooling.

- :func:`pending_rows`: the rows of a suite that a device's record lacks and that
  :mod:`benchmarks.pending` says why, as table rows that say "not measured on a GPU";
- :func:`drop_stale`: ``python -m benchmarks.run --drop-stale DEVICE`` removes from that
  device's records the rows whose code was replaced since they ran (the pending rows the
  record still holds) and the cases and rows the suites no longer have, and notes them in
  each record (``meta["dropped"]``, shown on the page).
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness import Case
from benchmarks.pending import pending, pending_suite, stable


def current_cases(suite_name: str, device: str, quick: bool) -> list[Case]:
    """The cases the suite has now on ``device`` (their rows' names, their constants)."""
    from benchmarks.suites import SUITES

    suite = SUITES.get(suite_name)
    return [] if suite is None else suite.make_cases(quick, device)


def shown_suites(device: str, suites: dict[str, Any]) -> list[str]:
    """The suites a device's part of the page shows: those it has a record of, and those
    pending there (:data:`benchmarks.pending.PENDING_SUITES`), in :data:`SUITES` order."""
    from benchmarks.suites import SUITES

    return [n for n in SUITES if n in suites or pending_suite(device, n)]


def pending_rows(
    suite_name: str, record: dict[str, Any] | None, device: str
) -> list[tuple[tuple[str, str], str]]:
    """``((op, size), table row)`` of each of the suite's rows that ``record`` lacks and
    that :data:`benchmarks.pending.PENDING` (or ``PENDING_SUITES``) says why."""
    quick = record is not None and record["meta"]["quick"]
    measured = (
        set()
        if record is None
        else {(r["op"], r["size"], stable(r["impl"])) for r in record["results"]}
    )
    whole = pending_suite(device, suite_name)
    blanks = " |" * (7 + (device == "cuda"))
    lines = []
    for c in current_cases(suite_name, device, quick):
        for i in c.impls:
            name = stable(i.name)
            why = whole or pending(device, i.name, c.size)
            if why and (c.op, c.size, name) not in measured:
                shown = f"**{name}**" if i.role == "ours" else name
                text = f"not measured on {'a GPU' if device == 'cuda' else device}: {why}"
                text = text.replace("|", chr(92) + "|")
                lines.append(((c.op, c.size), f"| {c.op} {c.size} | {shown} | {text} |{blanks}"))
    return lines


def drop_stale(data: dict[str, Any], device: str) -> list[str]:
    """Drop ``device``'s stale rows and cases from ``data`` (in place); what was dropped."""
    from benchmarks.suites import SUITES

    log = []
    for name, record in data["runs"].get(device, {}).items():
        suite = SUITES.get(name)
        if suite is None:
            continue
        cases = suite.make_cases(record["meta"]["quick"], device)
        rows = {(c.op, c.size, stable(i.name)) for c in cases for i in c.impls}
        sizes = {(c.op, c.size) for c in cases}
        keep, gone = [], []
        for r in record["results"]:
            row = (r["op"], r["size"], stable(r["impl"]))
            if (r["op"], r["size"]) not in sizes:
                gone.append(f"the case {r['op']} {r['size']} (no longer in the suite here)")
            elif pending(device, r["impl"], r["size"]):
                gone.append(f"{row[2]} at {r['op']} {r['size']} (its code replaced)")
            elif row not in rows:
                gone.append(f"{row[2]} at {r['op']} {r['size']} (no longer in the suite)")
            else:
                keep.append(r)
        record["cases"] = [c for c in record["cases"] if (c["op"], c["size"]) in sizes]
        record["results"] = keep
        if gone:
            record["meta"]["dropped"] = sorted(set(record["meta"].get("dropped", [])) | set(gone))
            log += [f"{device} {name}: dropped {g}" for g in dict.fromkeys(gone)]
    return log
