"""verl finds the dapo_ops twins whatever the import order, and with no dapo_ops import at all.

verl 0.9.1 loads the ``verl.plugins`` entry points in every process that imports it; the
package declares :mod:`dapo_ops.integrations.verl_plugin` there (pyproject.toml). Every
public module of ``dapo_ops.integrations`` is imported before and after verl, each order in
a fresh process (``_verl_import_orders.py``). Where the installed metadata of dapo_ops
predates the entry point (an editable install not reinstalled since), the worker runs with
a distribution that declares exactly pyproject's entry point, so the test checks this tree's
declaration either way.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl.trainer.ppo.core_algos")
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

import dapo_ops  # noqa: E402

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
PYPROJECT = HERE.parents[1] / "pyproject.toml"


def declared() -> dict[str, str]:
    with PYPROJECT.open("rb") as f:
        entry_points: dict[str, dict[str, str]] = tomllib.load(f)["project"]["entry-points"]
    return entry_points["verl.plugins"]


def test_pyproject_declares_the_plugin_module() -> None:
    assert declared() == {"dapo_ops": "dapo_ops.integrations.verl_plugin"}


def worker_env(tmp_path: Path) -> dict[str, str]:
    """This tree's dapo_ops first on the path, and pyproject's entry point visible to verl."""
    paths = [str(Path(dapo_ops.__file__).resolve().parents[1])]
    installed = {(e.name, e.value) for e in importlib.metadata.entry_points(group="verl.plugins")}
    if not set(declared().items()) <= installed:
        dist = tmp_path / "dapo_ops_plugin_check-0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: dapo_ops_plugin_check\nVersion: 0\n"
        )
        lines = [f"{name} = {value}" for name, value in declared().items()]
        (dist / "entry_points.txt").write_text("[verl.plugins]\n" + "\n".join(lines) + "\n")
        paths.append(str(tmp_path))
    old = os.environ.get("PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}
    return {**env, "PYTHONPATH": os.pathsep.join([*paths, *([old] if old else [])])}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the worker forks one process per case")
def test_every_import_order_registers_in_a_fresh_process(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(HERE / "_verl_import_orders.py")],
        env={**worker_env(tmp_path), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    results: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    failed = {case: text for case, text in results.items() if text != "ok"}
    assert not failed, "\n".join(f"--- {case}\n{text}" for case, text in failed.items())
    # public modules x 3 orders, plus the entry point, the env fallback and the control
    assert len(results) >= 3 * 11 + 3 and "verl only (entry point)" in results
