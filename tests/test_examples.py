"""examples/ run as scripts: a smoke run with small settings, and the default run learns."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "plain_loop.py"


def run_example(*args: str) -> str:
    """Run the example with every warning an error: a user copying it sees none."""
    done = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLE), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_plain_loop_smoke_with_small_settings() -> None:
    out = run_example("--steps", "3", "--prompts", "4", "--group-size", "4", "--micro-batches", "3")
    assert re.search(r"accuracy \d\.\d\d -> \d\.\d\d in 3 steps", out), out


def test_plain_loop_default_run_learns() -> None:
    out = run_example()  # exits 1 unless the final accuracy beats the initial one
    match = re.search(r"accuracy (\d\.\d\d) -> (\d\.\d\d) in 40 steps", out)
    assert match, out
    assert float(match.group(2)) >= 0.8 > float(match.group(1)), out


def test_help_shows_every_default() -> None:
    out = run_example("--help")
    options_part = out.split("\noptions:", 1)[1]
    options = re.findall(r"^\s+(--[a-z-]+) [A-Z_]+", options_part, flags=re.M)
    assert options, out
    for option in options:
        block = options_part.split(f"  {option}", 1)[1].split("\n  --", 1)[0]
        assert "(default:" in block, (option, block)
