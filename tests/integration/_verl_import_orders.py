"""Worker of ``test_verl_registration.py``: every import order in a process of its own.

``python _verl_import_orders.py`` prints one JSON object: case -> "ok" or the child's
traceback. The parent imports only third-party packages (torch, transformers, ray, ...:
the slow part of ``import verl``), never verl or dapo_ops; each case runs in a child
forked from it, so each starts with neither verl nor dapo_ops imported. Cases, for every
public module ``M`` of ``dapo_ops.integrations``: ``M`` then verl's ``core_algos``;
``core_algos`` then ``M``; ``import verl`` then ``M`` then ``core_algos``. And with no
dapo_ops import at all: ``core_algos`` alone (the ``verl.plugins`` entry point), the same
with entry points off and ``VERL_USE_EXTERNAL_MODULES`` set, and, as the control, with
entry points off and nothing set (must find nothing registered).
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

CORE_ALGOS = "verl.trainer.ppo.core_algos"
DISTILL_LOSSES = "verl.trainer.distillation.losses"
THIRD_PARTY = (
    "numpy", "torch", "torch._dynamo", "transformers.modeling_utils", "tensordict", "ray",
    "omegaconf", "jaxtyping", "einops", "beartype",
)  # fmt: skip


def public_modules() -> list[str]:
    """Every public module of dapo_ops.integrations, found without importing dapo_ops."""
    spec = importlib.util.find_spec("dapo_ops")
    assert spec is not None and spec.origin is not None
    folder = Path(spec.origin).parent / "integrations"
    names = [m.name for m in pkgutil.iter_modules([str(folder)]) if not m.name.startswith("_")]
    return [f"dapo_ops.integrations.{name}" for name in sorted(names)]


def check_registered() -> None:
    """Every dapo_ops twin is in verl's registries, and the import hook is gone.

    The registries are read before this check imports any dapo_ops module (importing the
    adapter registers, which would hide a missing registration)."""
    core = importlib.import_module(CORE_ALGOS)
    losses, estimators = dict(core.POLICY_LOSS_REGISTRY), dict(core.ADV_ESTIMATOR_REGISTRY)
    # verl imports its distillation losses later (a distillation config): they register then
    distill = dict(importlib.import_module(DISTILL_LOSSES).DISTILLATION_LOSS_REGISTRY)
    from dapo_ops.integrations import (
        verl,
        verl_advantages,
        verl_distill,
        verl_estimators,
        verl_losses,
    )

    assert losses.get("dapo_ops") is verl.compute_policy_loss, sorted(losses)
    assert estimators.get("dapo_ops_grpo") is verl.compute_grpo_outcome_advantage
    for mode in verl_losses.VERL_LOSS_MODES:
        assert f"dapo_ops_{mode}" in losses, mode
    for name, fn in verl_advantages.ESTIMATORS.items():
        assert estimators.get(f"dapo_ops_{name}") is fn, name
    for name, fn in verl_estimators.ESTIMATORS.items():
        assert estimators.get(verl_estimators.ESTIMATOR_NAMES[name]) is fn, name
    for name in verl_distill.DISTILL_NAMES:
        assert distill.get(name) is verl_distill.compute_distillation_loss, name
    assert distill.get("dapo_ops_forward_kl_topk") is verl_distill.compute_forward_kl_topk
    # the one-shot registration hooks are gone (dapo_ops._core._compat's alias finder stays)
    assert not any(type(f).__module__.startswith("dapo_ops.integrations") for f in sys.meta_path)


def check_absent() -> None:
    core = importlib.import_module(CORE_ALGOS)
    assert "dapo_ops" not in core.POLICY_LOSS_REGISTRY, "registered without being asked"
    assert not any(m.startswith("dapo_ops") for m in sys.modules), "dapo_ops was imported"


def cases() -> dict[str, Callable[[], None]]:
    def in_order(
        *names: str, env: dict[str, str] | None = None, absent: bool = False
    ) -> Callable[[], None]:
        def run() -> None:
            os.environ.update(env or {})
            for name in names:
                importlib.import_module(name)
            (check_absent if absent else check_registered)()

        return run

    out = {}
    for m in public_modules():
        short = m.rsplit(".", 1)[1]
        out[f"{short}: dapo_ops first"] = in_order(m, CORE_ALGOS)
        out[f"{short}: verl first"] = in_order(CORE_ALGOS, m)
        out[f"{short}: import verl, then it, then core_algos"] = in_order("verl", m, CORE_ALGOS)
    off = {"VERL_USE_EXTERNAL_PLUGINS": "none"}
    out["verl only (entry point)"] = in_order(CORE_ALGOS)
    out["verl only, entry points off, VERL_USE_EXTERNAL_MODULES"] = in_order(
        CORE_ALGOS, env={**off, "VERL_USE_EXTERNAL_MODULES": "dapo_ops.integrations.verl"}
    )
    out["control: verl only, entry points off"] = in_order(CORE_ALGOS, env=off, absent=True)
    return out


def run_forked(case: Callable[[], None]) -> str:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into the parent's code
        os.close(read)
        try:
            case()
            message = "ok"
        except BaseException:
            message = traceback.format_exc()
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    return message if os.waitstatus_to_exitcode(status) == 0 else f"exit status {status}"


def main() -> None:
    for name in THIRD_PARTY:
        importlib.import_module(name)
    assert not any(m == "verl" or m.startswith(("verl.", "dapo_ops")) for m in sys.modules)
    print(json.dumps({name: run_forked(case) for name, case in cases().items()}))


if __name__ == "__main__":
    main()
