"""The demo's figure, drawn from ``curves.csv`` alone (matplotlib is optional)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from dapo_ops.demo.report import Table

#: (curve, panel title); clip fractions share one panel (high solid, low dashed).
PANELS = (
    ("accuracy", "accuracy (evaluation, every target)"),
    ("entropy", "policy entropy (nats / token)"),
    ("response_length", "mean response length (tokens)"),
    ("truncated_fraction", "truncated answers"),
    ("clip_frac_high", "clip fraction: high (solid), low (dashed)"),
    ("kept_group_fraction", "drawn groups with reward spread"),
)
FIXED_COLORS = {"grpo": "black", "dapo": "tab:red"}
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:cyan")
#: PNG text key holding the SHA-256 of the CSV files the figure was drawn from.
SOURCE_KEY = "dapo_ops.demo source sha256"


def source_digest(paths: Sequence[Path]) -> str:
    """SHA-256 of the files' bytes, in order: what the PNG records it was drawn from."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def png_text(path: Path) -> dict[str, str]:
    """The ``tEXt`` chunks of a PNG file (no imaging library needed)."""
    data, pos, out = path.read_bytes(), 8, {}
    while pos + 8 <= len(data):
        length = int.from_bytes(data[pos : pos + 4], "big")
        kind = data[pos + 4 : pos + 8]
        if kind == b"tEXt":
            key, _, value = data[pos + 8 : pos + 8 + length].partition(b"\0")
            out[key.decode("latin-1")] = value.decode("latin-1")
        pos += 12 + length
    return out


def plot(
    path: Path,
    curves: Table,
    groups: Sequence[Sequence[tuple[str, str]]],
    title: str,
    source: str,
) -> bool:
    """One figure row per group of ``(label, row name)``; mean over seeds, ±std shaded.

    Returns False (and writes nothing) without matplotlib. ``source`` (the CSV digest)
    is stored in the PNG so that a test can tell a stale figure.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(
        len(groups), len(PANELS), figsize=(3.4 * len(PANELS), 2.9 * len(groups) + 0.6),
        sharex=True, squeeze=False,
    )  # fmt: skip
    for axes_row, group in zip(axes, groups, strict=True):
        for i, (label, name) in enumerate(group):
            rows = [r for r in curves if r["row"] == name]
            x = [int(r["samples"]) / 1000 for r in rows]
            color = FIXED_COLORS.get(name, COLORS[i % len(COLORS)])
            for ax, (key, _) in zip(axes_row, PANELS, strict=True):
                keys = [key, "clip_frac_low"] if key == "clip_frac_high" else [key]
                for k, style in zip(keys, ("-", "--"), strict=False):
                    pairs = [
                        (xi, float(r[f"{k}_mean"]), float(r[f"{k}_std"]))
                        for xi, r in zip(x, rows, strict=True)
                        if r[f"{k}_mean"] != ""
                    ]
                    xs = [p[0] for p in pairs]
                    mean = [p[1] for p in pairs]
                    lo = [p[1] - p[2] for p in pairs]
                    hi = [p[1] + p[2] for p in pairs]
                    ax.plot(
                        xs, mean, color=color, ls=style, lw=1.3, label=label if k == key else None
                    )
                    ax.fill_between(xs, lo, hi, color=color, alpha=0.12, lw=0)
        for ax, (_, panel_title) in zip(axes_row, PANELS, strict=True):
            ax.set_title(panel_title, fontsize=9)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=8)
        axes_row[0].legend(fontsize=7, loc="lower right")
    for ax in axes[-1]:
        ax.set_xlabel("generated answers (thousands)", fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={SOURCE_KEY: source, "Software": "dapo_ops.demo"})
    plt.close(fig)
    return True
