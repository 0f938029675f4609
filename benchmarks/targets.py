"""The issue's targets as rows computed from measured numbers (never written by hand)."""

from __future__ import annotations

from benchmarks.harness import Result, Target


def compare(
    name: str, ours: Result | None, other: Result | None, limit: float, *, faster: bool
) -> Target:
    """``faster``: other / ours >= limit (x faster than it); else ours / other <= limit
    (x its time). Read on the medians; the minima are shown, and when only they meet the
    limit the reason says so (background load on a shared machine)."""
    bound = f">= {limit:g}x" if faster else f"<= {limit:g}x"
    if ours is None or other is None or not ours.times or not other.times:
        why = next((r.error for r in (ours, other) if r is not None and r.error), None)
        return Target(name, "n/a", bound, None, why or "not in this run")
    if faster:
        x, xm = other.median / ours.median, other.minimum / ours.minimum
        met, met_min = x >= limit, xm >= limit
    else:
        x, xm = ours.median / other.median, ours.minimum / other.minimum
        met, met_min = x <= limit, xm <= limit
    reason = "met on the minima: background load" if met_min and not met else ""
    return Target(name, f"{x:.3g}x (minima {xm:.3g}x)", bound, met, reason)


def because(target: Target, reason: str) -> Target:
    """``target`` with ``reason`` given for a miss (a target met or not measured keeps
    its own)."""
    if target.met is False and not target.reason:
        target.reason = reason
    return target


def at_most(name: str, value: float | None, limit: float, unit: str, why: str = "") -> Target:
    """A measured quantity against an upper limit; ``unit`` is appended as written
    (``"x the inputs"``, ``" MiB"``)."""
    if value is None:
        return Target(name, "n/a", f"<= {limit:.3g}{unit}", None, why or "not measured")
    return Target(name, f"{value:.3g}{unit}", f"<= {limit:.3g}{unit}", value <= limit)


def at_least(name: str, value: float | None, limit: float, unit: str, why: str = "") -> Target:
    """A measured quantity against a lower limit (``unit`` appended as written)."""
    if value is None:
        return Target(name, "n/a", f">= {limit:.3g}{unit}", None, why or "not measured")
    return Target(name, f"{value:.3g}{unit}", f">= {limit:.3g}{unit}", value >= limit)
