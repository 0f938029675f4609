"""Poisoned ties: torch's subgradient of clamp, min, max and abs at a tie made 1/4.

``torch.clamp``'s gradient on a bound is 1 up to torch 2.13 and 0 (number bounds) or
1/2 (tensor bounds) from torch 2.14; ``torch.minimum``/``maximum`` split a tie 1/2 and
1/2; ``abs`` gives 0 at 0. Under :class:`PoisonedTies` every one of them gives 1/4 at a
tie (a value no torch uses) and its usual gradient elsewhere, with unchanged values. A
path whose gradient at a kink still follows the library's convention (docs/kinks.md)
does not lean on any torch op's subgradient at a tie, on any torch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_T = torch.Tensor
#: Bounds by keyword, per clamp flavour (the positional ones come first).
_CLAMPS: dict[Any, tuple[str, ...]] = {
    torch.clamp: ("min", "max"),
    _T.clamp: ("min", "max"),
    torch.clip: ("min", "max"),
    _T.clip: ("min", "max"),
    torch.clamp_min: ("min",),
    _T.clamp_min: ("min",),
    torch.clamp_max: ("max",),
    _T.clamp_max: ("max",),
}
_ABS = {torch.abs, _T.abs, _T.__abs__}
_PAIRS = {torch.minimum, _T.minimum, torch.maximum, _T.maximum, torch.fmin, torch.fmax}

#: The gradient every poisoned op passes at a tie.
TIE_SLOPE = 0.25


def _live(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled()


def _nudge(t: torch.Tensor) -> torch.Tensor:
    """0 (exactly, for finite ``t``) with the gradient ``TIE_SLOPE``."""
    return (t - t.detach()) * TIE_SLOPE


class PoisonedTies(TorchFunctionMode):
    """Inside it, clamp/clip, min/max of two tensors and abs pass ``TIE_SLOPE`` at a tie."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _CLAMPS and _live(args[0]):
            x = args[0]
            names = _CLAMPS[func]
            bounds = [*args[1:], *(kwargs.get(n) for n in names[len(args) - 1 :])]
            tie = torch.zeros_like(x, dtype=torch.bool)
            for b in bounds:
                if b is not None:
                    tie = tie | (x == b)
            return torch.where(tie, out.detach() + _nudge(x), out)
        if func in _ABS and _live(args[0]):
            return torch.where(args[0] == 0, out.detach() + _nudge(args[0]), out)
        if func in _PAIRS and len(args) >= 2 and (_live(args[0]) or _live(args[1])):
            a, b = args[0], args[1]
            extra = sum((_nudge(t) for t in (a, b) if _live(t)), out.detach())
            return torch.where(a == b, extra, out)
        return out
