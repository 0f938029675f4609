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
"""

import os

os.environ.setdefault("DAPO_OPS_CHECKED", "1")

import jaxtyping
import jaxtyping._decorator
import pytest
import torch


class _AnnotationError(jaxtyping.TypeCheckError, ValueError):
    """A jaxtyping type-check failure that also satisfies dapo_ops' error contract."""


jaxtyping._decorator.TypeCheckError = _AnnotationError  # type: ignore[misc]


@pytest.fixture(autouse=True)
def _doctest_torch(doctest_namespace: dict[str, object]) -> None:
    doctest_namespace["torch"] = torch
