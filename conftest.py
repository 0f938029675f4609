"""Doctest namespace for the examples in dapo_ops' docstrings."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _doctest_torch(doctest_namespace: dict[str, object]) -> None:
    doctest_namespace["torch"] = torch
