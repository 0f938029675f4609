"""Repository-wide pytest set-up.

- Doctests in dapo_ops' docstrings get ``torch`` in their namespace.
- The suite runs every jaxtyping annotation of dapo_ops through beartype (pyproject's
  ``--jaxtyping-packages``). A shape or dtype that contradicts an annotation is then
  reported by jaxtyping before the function's own check runs; its error is made a
  ``ValueError`` as well as a ``TypeError`` here, the contract of
  ``dapo_ops.InputError``, so tests see the same error contract with and without the
  runtime checker.
- Checked mode (``dapo_ops.checked``) is on for the whole suite: ``DAPO_OPS_CHECKED=1`` is
  set here, before dapo_ops is first imported (it reads the variable once, at import), and
  inherited by the subprocesses the suite starts (examples, demo, distributed workers).
  Run ``DAPO_OPS_CHECKED=0 pytest`` to test the default path instead. The tests that need
  the mode off (host-sync counts, the off path itself) say so with ``checked(False)``.
- Every fenced Python block of README.md, README.pypi.md and docs/ is a test item
  (Sybil, ``tools/doc_blocks.py``; pyproject's ``testpaths`` name the pages); a block
  that declares ``<!-- requires: trl -->`` carries the ``integration`` marker.
"""

import os

os.environ.setdefault("DAPO_OPS_CHECKED", "1")

import jaxtyping
import jaxtyping._decorator
import pytest
import torch

from tools.doc_blocks import SYBIL, doc_items, requirements

pytest_collect_file = SYBIL.pytest()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in doc_items(items):
        if requirements(item):
            item.add_marker(pytest.mark.integration)


class _AnnotationError(jaxtyping.TypeCheckError, ValueError):
    """A jaxtyping type-check failure that also satisfies dapo_ops' error contract."""


jaxtyping._decorator.TypeCheckError = _AnnotationError  # type: ignore[misc]


def _unwrap_dataclass_inits() -> None:
    """Give dapo_ops' frozen dataclasses (objectives, KLPenalty, presets) their plain
    methods back.

    The annotation checker wraps a method in a closure holding an ``inspect.Signature``,
    which ``torch.compile`` cannot trace when the dataclass is built inside a compiled
    function (``token_level_loss`` builds a ``ClipHigher``: ``__init__`` then
    ``__post_init__``); without the checker (every user's case) construction traces
    fine. The fields are validated by each class's own ``__post_init__`` either way.
    """
    import dataclasses
    import inspect
    import sys

    import dapo_ops  # noqa: F401  (imports every module that defines a dataclass)
    from dapo_ops._core._checked import checks_values

    modules = [m for n, m in sys.modules.items() if n.startswith("dapo_ops")]
    for module in modules:
        for value in vars(module).values():
            if isinstance(value, type) and dataclasses.is_dataclass(value):
                for name, attr in list(vars(value).items()):
                    if callable(attr) and hasattr(attr, "__wrapped__"):
                        plain = attr.__wrapped__
                        if getattr(attr, "__dapo_checked__", False):  # checked mode's stays
                            plain = checks_values(inspect.unwrap(attr))
                        setattr(value, name, plain)


_unwrap_dataclass_inits()


@pytest.fixture(autouse=True)
def _doctest_torch(doctest_namespace: dict[str, object]) -> None:
    doctest_namespace["torch"] = torch
