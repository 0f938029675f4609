"""Is a shown output what a block printed? Words exactly, numbers to their shown digits.

Runs of spaces count as one (tensor printing aligns columns). A number shown with ``d``
decimals is the rounding of a value that another summation order (another ATen CPU
kernel, another thread count) may move by an ulp, which can move the shown rounding by
one unit of its last digit, never more: so a number may differ by that one unit.
Integers are shown exactly.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def _tokens(text: str) -> list[str]:
    return _NUMBER.split(" ".join(text.split()))


def same_output(shown: str, printed: str) -> bool:
    """``printed`` is what ``shown`` says: same words, numbers within one shown unit."""
    if " ".join(shown.split()) == " ".join(printed.split()):
        return True
    shown_words, printed_words = _tokens(shown), _tokens(printed)
    shown_numbers, printed_numbers = _NUMBER.findall(shown), _NUMBER.findall(printed)
    if shown_words != printed_words or len(shown_numbers) != len(printed_numbers):
        return False
    return all(
        _within_last_digit(a, b) for a, b in zip(shown_numbers, printed_numbers, strict=True)
    )


def _within_last_digit(shown: str, printed: str) -> bool:
    if shown == printed:
        return True
    mantissa = re.split(r"[eE]", shown)[0]
    if "." not in mantissa:
        return False  # an integer is shown exactly
    exponent = int(shown.split("e")[1]) if "e" in shown.lower() else 0
    unit = 10.0 ** (exponent - len(mantissa.split(".")[1]))
    return abs(float(shown) - float(printed)) <= unit * (1 + 1e-9)
