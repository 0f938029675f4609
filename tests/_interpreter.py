"""Triton's interpreter as the tests run it (CPU tensors, no GPU).

Triton 3.6's interpreter reads a scalar loop bound with ``int()`` of a 1-element array,
which NumPy 2.4 refuses: :func:`index_fix` makes it read the single element instead
(Triton fixed it in a later release; torch 2.11's CUDA build pins 3.6). NumPy's warning
for ``0 * -inf`` in a branch ``tl.where`` discards is silenced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def index_fix() -> Iterator[None]:
    import numpy as np
    from triton.runtime import interpreter as interp

    original = interp._patch_lang_tensor

    def patch(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda x: int(x.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patch
    try:
        with np.errstate(invalid="ignore"):
            yield
    finally:
        interp._patch_lang_tensor = original
