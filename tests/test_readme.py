"""The README's drop-in example runs, and CI runs the README's test command."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
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
    assert "pytest" in blocks[1]
    # True on any machine: no pin that would downgrade a user's newer torch, or pull a
    # CUDA build where none is wanted; how to get the CPU build is said in words.
    assert "torch==" not in blocks[0] + blocks[1]
    assert "--index-url https://download.pytorch.org/whl/cpu" in " ".join(text.split())


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    text = (ROOT / "README.md").read_text()
    command = re.findall(r"```bash\n(.*?)\n```", text.split("## Drop-in example")[0], re.S)[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'eval "$test_cmd"' in ci and "Install and run the tests:" in ci
    extracted = re.search(r"^Install and run the tests:\n\n```bash\n(.*)$", text, re.M)
    assert extracted and extracted.group(1) == command
    # .ci/run greps README's suite time from one line to say when it is stale
    assert re.search(r"^.*whole suite takes about \d+ minutes", text, re.M)
    assert "whole suite takes about [0-9]* minutes" in ci


def _pyproject() -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())  # type: ignore[no-any-return]


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def test_supported_versions_are_stated_once_and_agree_with_pyproject() -> None:
    project = _pyproject()["project"]
    torch_range = next(d for d in project["dependencies"] if d.startswith("torch"))
    text = " ".join((ROOT / "README.md").read_text().split())
    stated = re.search(
        r"\*\*Supported versions\*\*: torch >= ([\d.]+), < ([\d.]+) .*? Python >= ([\d.]+) ",
        text,
    )
    assert stated, "README.md lost its supported-versions line"
    low, ceiling, python = stated.groups()
    assert torch_range == f"torch>={low},<{ceiling}"
    assert project["requires-python"] == f">={python}"
    # CI runs README's test command on the lowest and the newest torch of the range, each
    # in its own venv (.ci/run's TORCHES line: "torch:triton" pairs), and README names them
    ci = (ROOT / ".ci" / "run").read_text()
    pairs = re.search(r'^TORCHES="([\d.: ]+)"$', ci, re.M)
    assert pairs, ".ci/run lost its TORCHES line"
    tested = [p.split(":")[0] for p in pairs.group(1).split()]
    assert _minor(tested[0]) == _minor(low), "CI must test the floor"
    assert _minor(tested[-1]) == (_minor(ceiling)[0], _minor(ceiling)[1] - 1), "and the newest"
    assert all(v in text for v in tested)
    assert "for pair in $TORCHES" in ci and ci.count('eval "$test_cmd"') >= 2
    # each Python version classifier is at or above the floor
    floor = tuple(int(x) for x in python.split("."))
    versions = [
        tuple(int(x) for x in c.rsplit(":: ", 1)[1].split("."))
        for c in project["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    ]
    assert versions and min(versions) == floor


def test_triton_range_agrees_with_pyproject_and_ci() -> None:
    """README's Triton range is the test extra's, and CI runs the kernels' tests under one
    release of every minor version in it (.ci/run installs one, .ci/triton the others)."""
    text = " ".join((ROOT / "README.md").read_text().split())
    stated = re.search(r"Triton (\d+)\.(\d+) to (\d+)\.(\d+) ", text)
    assert stated, "README.md lost its Triton range"
    major, low, major_hi, high = (int(x) for x in stated.groups())
    assert major == major_hi
    extra = next(r for r in _pyproject()["project"]["optional-dependencies"]["test"]
                 if r.startswith("triton"))  # fmt: skip
    assert extra.split(";")[0] == f"triton>={major}.{low},<{major}.{high + 1}"
    ci = (ROOT / ".ci" / "triton").read_text()
    versions = re.search(r'^VERSIONS="([\d. ]+)"$', ci, re.M)
    assert versions, ".ci/triton lost its VERSIONS line"
    minors = sorted(tuple(int(x) for x in v.split(".")[:2]) for v in versions.group(1).split())
    assert minors == [(major, m) for m in range(low, high + 1)]
    pinned = re.search(
        r"pip install -q torch==[\d.]+ triton==([\d.]+)", (ROOT / ".ci" / "run").read_text()
    )
    assert pinned and pinned.group(1) in versions.group(1).split()


def test_package_index_metadata() -> None:
    project = _pyproject()["project"]
    assert project["authors"] and project["keywords"]
    classifiers = set(project["classifiers"])
    assert "Typing :: Typed" in classifiers
    assert any(c.startswith("Topic :: ") for c in classifiers)
    # The licence is the SPDX expression (PEP 639): setuptools refuses a licence classifier
    # beside it, and the index shows the expression.
    assert project["license"] == "Apache-2.0"
    assert not any(c.startswith("License ::") for c in classifiers)


def test_objectives_example_runs_and_backpropagates() -> None:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"## Objectives are values\n.*?```python\n(.*?)```", text, re.S)
    assert match, "README.md lost its objectives example"
    namespace: dict[str, object] = {}
    exec(compile(match.group(1), "README.md", "exec"), namespace)
    logp = namespace["logp"]
    assert isinstance(logp, torch.Tensor) and logp.grad is not None
    assert bool(torch.isfinite(logp.grad).all()) and bool(logp.grad.abs().sum() > 0)
