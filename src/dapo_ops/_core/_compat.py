"""The module paths of 0.1.0, before the stage folders: importable for one release.

``import dapo_ops.kl`` (or ``from dapo_ops.kl import KLPenalty``) still works and gives
the *same* module object as its new path, ``dapo_ops.engine.kl``, with a
``DeprecationWarning`` naming the new path. Installed once by ``dapo_ops/__init__.py``
(a finder at the end of :data:`sys.meta_path`); the public names of ``dapo_ops`` itself
never moved. To be removed in the next release (see CHANGELOG.md).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: old module path -> new module path.
OLD_PATHS: dict[str, str] = {
    f"dapo_ops.{old}": f"dapo_ops.{new}"
    for old, new in {
        "_rules": "_core._rules",
        "_validate": "_core._validate",
        "_groups": "_core._groups",
        "sampling": "rewards.sampling",
        "estimators": "advantages.estimators",
        "returns": "advantages.returns",
        "optimal_baseline": "advantages.optimal_baseline",
        "policy": "engine.policy",
        "loss": "engine.loss",
        "_engine": "engine._engine",
        "_compiled": "engine._compiled",
        "compiled_loss": "engine.compiled_loss",
        "kl": "engine.kl",
        "_kl_cpu": "engine._kl_cpu",
        "entropy": "engine.entropy",
        "aggregation": "engine.aggregation",
        "distributed": "engine.distributed",
        "surrogate": "engine.surrogate",
        "gspo": "engine.surrogate_gspo",
        "cispo": "engine.surrogate_cispo",
        "importance": "correction.importance",
        "offpolicy": "correction.offpolicy",
        "cov_masks": "correction.cov_masks",
        "masks": "correction.masks",
        "_logits_path": "logprobs._logits_path",
        "_logprob_checks": "logprobs._logprob_checks",
        "_softmax_blocks": "logprobs._softmax_blocks",
        "_fused_linear": "logprobs._fused_linear",
        "linear_loss": "logprobs.linear_loss",
        "_linear_loss": "logprobs._linear_loss",
    }.items()
}


def moved(old: str) -> ModuleType:
    """The module that ``old`` (an old path) names now, with a ``DeprecationWarning``."""
    new = OLD_PATHS[old]
    warnings.warn(
        f"{old} moved to {new} (dapo_ops' stage folders); the old path is deprecated "
        "and will be removed in the next release",
        DeprecationWarning,
        stacklevel=3,
    )
    return importlib.import_module(new)


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the new module itself (no copy)."""

    def find_spec(
        self, fullname: str, path: object, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in OLD_PATHS:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = moved(spec.name)
        spec.loader_state = module.__spec__  # the import system sets __spec__ to this spec
        return module

    def exec_module(self, module: ModuleType) -> None:
        alias = module.__spec__
        if alias is not None:  # the module's own spec again
            module.__spec__ = alias.loader_state


def install() -> None:
    """Add the finder once (importing dapo_ops twice, or reloading it, adds no second)."""
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.append(_OldPaths())
