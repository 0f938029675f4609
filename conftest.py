"""Repository-wide pytest set-up.

- Doctests in dapo_ops' docstrings get ``torch`` in their namespace.
- The suite runs every jaxtyping annotation of dapo_ops through beartype (pyproject's
  ``--jaxtyping-packages``). A shape or dtype that contradicts an annotation is then
  reported by jaxtyping before the function's own check runs; its error is made a
  ``ValueError`` as well as a ``TypeError`` here, the contract of
  ``dapo_ops.InputError``, so tests see the same error contract with and without the
  runtime checker.
"""

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
