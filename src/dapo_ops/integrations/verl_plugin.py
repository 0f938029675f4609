"""verl plug-in: registers every ``dapo_ops_*`` twin in verl's registries, in every process.

``pip install dapo_ops`` declares this module under verl's ``verl.plugins`` entry-point
group, which verl 0.9.1 loads while ``import verl`` runs, in every process that imports
verl (the driver and each Ray worker): a verl run needs no line of ours. The registries
live in ``verl.trainer.ppo.core_algos``, which verl's own ``__init__`` does not import;
so this module registers at once when ``core_algos`` is already loaded, and otherwise
waits for it: a one-shot import hook (a finder first in ``sys.meta_path``) runs
:func:`dapo_ops.integrations.verl.register` right after ``core_algos`` is first executed,
then removes itself. Importing this module does not import verl, and repeated calls
install one hook at most; registering again replaces the entries, so the result does not
depend on the order in which dapo_ops and verl are imported.

Without the entry point (verl started with ``VERL_USE_EXTERNAL_PLUGINS=none``, or a
package whose metadata was not reinstalled), ``VERL_USE_EXTERNAL_MODULES=dapo_ops.integrations.verl``
does the same: verl imports that module in every process, and importing it calls
:func:`register_when_ready`.

Example:
    >>> import sys
    >>> register_when_ready() is ("verl.trainer.ppo.core_algos" in sys.modules)
    True
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

#: The verl module that holds the policy-loss and advantage-estimator registries.
CORE_ALGOS = "verl.trainer.ppo.core_algos"
#: The verl module that holds the distillation-loss registry (imported later, if at all).
DISTILL_LOSSES = "verl.trainer.distillation.losses"
_DISTILL_ADAPTER = "dapo_ops.integrations.verl_distill"
_ADAPTER = "dapo_ops.integrations.verl"
_REGISTRY_NAMES = (
    "POLICY_LOSS_REGISTRY",
    "register_policy_loss",
    "ADV_ESTIMATOR_REGISTRY",
    "register_adv_est",
)


def _register_all() -> None:
    """Import the verl adapter (its last line registers) or, when imported, call register()."""
    adapter = sys.modules.get(_ADAPTER)
    if adapter is None or not hasattr(adapter, "register"):
        importlib.import_module(_ADAPTER)
    else:
        adapter.register()


def _register_distillation() -> None:
    importlib.import_module(_DISTILL_ADAPTER).register_distillation()


def _loaded() -> bool:
    """True when ``core_algos`` is imported and its registries and register functions exist."""
    module = sys.modules.get(CORE_ALGOS)
    return all(hasattr(module, name) for name in _REGISTRY_NAMES)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds module ``target`` with the other finders and runs ``callback`` after its
    loader ran (the module complete), then leaves ``sys.meta_path``."""

    def __init__(self, target: str, callback: Callable[[], None]) -> None:
        self.target, self.callback = target, callback

    def find_spec(
        self,
        fullname: str,
        path: Any,  # a list, None, or a namespace package's _NamespacePath (not a Sequence)
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.target:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_register(module: ModuleType) -> None:
            exec_module(module)  # raises: the hook stays for the next import attempt
            del loader.__dict__["exec_module"]  # this loader instance is verl's own again
            _remove(self)
            try:
                self.callback()
            except Exception as error:  # verl must still import; say why dapo_ops is missing
                warnings.warn(
                    f"dapo_ops could not register its verl twins: {error!r}",
                    RuntimeWarning,
                    stacklevel=2,
                )

        try:  # on this loader instance only: the module's __loader__ stays verl's own
            loader.__dict__["exec_module"] = exec_then_register
        except (AttributeError, TypeError):
            warnings.warn(
                f"dapo_ops cannot hook {self.target}'s loader {loader!r}: call "
                "dapo_ops.integrations.verl.register() after importing it",
                RuntimeWarning,
                stacklevel=2,
            )
        return spec


_HOOK = _AfterImport(CORE_ALGOS, _register_all)


def _remove(hook: _AfterImport) -> None:
    while hook in sys.meta_path:
        sys.meta_path.remove(hook)


def after_import(module: str, callback: Callable[[], None]) -> bool:
    """Run ``callback`` now if ``module`` is imported and complete (True), else once right
    after its first import completes (False; one pending hook per module). For a registry
    that lives in a module verl imports later than ``core_algos`` (its distillation losses).
    """
    loaded = sys.modules.get(module)
    spec = getattr(loaded, "__spec__", None)
    if loaded is not None and not getattr(spec, "_initializing", False):
        callback()
        return True
    if not any(isinstance(h, _AfterImport) and h.target == module for h in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(module, callback))
    return False


def register_when_ready(register: Callable[[], None] | None = None) -> bool:
    """Register dapo_ops' verl twins now if ``core_algos`` is loaded, else as soon as it is.

    ``register`` (default: import :mod:`dapo_ops.integrations.verl` and call its
    ``register``) runs now when ``verl.trainer.ppo.core_algos`` is loaded, and the result
    is True; otherwise the one-shot hook is installed (once, however often this is
    called) and the result is False.
    """
    # Hooked now, before anything imports it: verl's distillation losses import core_algos
    # from their first lines, so core_algos' hook would find them half-initialised.
    after_import(DISTILL_LOSSES, _register_distillation)
    if _loaded():
        (register or _register_all)()
        return True
    if _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)
    return False


register_when_ready()

__all__ = ["CORE_ALGOS", "DISTILL_LOSSES", "after_import", "register_when_ready"]
