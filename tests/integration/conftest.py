"""Peer-parity tests run with checked mode off.

Their batches follow the peers' own test data: random "log-probs" of either sign and
log-ratios up to e^+-25, which the peers accept and which only the ratio matters for.
Checked mode (``dapo_ops.checked``, on for the default suite by the root conftest.py)
would refuse the positive ones; the comparison is of the default path, so it is off here.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import dapo_ops


@pytest.fixture(autouse=True)
def _default_path() -> Iterator[None]:
    with dapo_ops.checked(False):
        yield
