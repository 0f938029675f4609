"""The README's drop-in example runs, and CI runs the README's test command."""

from __future__ import annotations

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_drop_in_example_runs_and_backpropagates() -> None:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"## Drop-in example\n\n```python\n(.*?)```", text, re.S)
    assert match, "README.md lost its drop-in example"
    namespace: dict[str, object] = {}
    exec(compile(match.group(1), "README.md", "exec"), namespace)
    loss, hidden = namespace["loss"], namespace["hidden"]
    assert isinstance(loss, torch.Tensor) and loss.dtype == torch.float32
    assert isinstance(hidden, torch.Tensor) and hidden.grad is not None
    assert bool(torch.isfinite(hidden.grad).all()) and bool(hidden.grad.abs().sum() > 0)


def test_readme_has_the_two_setup_commands() -> None:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text.split("## Drop-in example")[0], re.S)
    assert len(blocks) == 2
    assert "python -m dapo_ops.demo" in blocks[0]
    assert "pytest" in blocks[1] and "torch==2.13.0" in blocks[1]


def test_objectives_example_runs_and_backpropagates() -> None:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"## Objectives are values\n.*?```python\n(.*?)```", text, re.S)
    assert match, "README.md lost its objectives example"
    namespace: dict[str, object] = {}
    exec(compile(match.group(1), "README.md", "exec"), namespace)
    logp = namespace["logp"]
    assert isinstance(logp, torch.Tensor) and logp.grad is not None
    assert bool(torch.isfinite(logp.grad).all()) and bool(logp.grad.abs().sum() > 0)
