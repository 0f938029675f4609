"""Argument checks shared by the public functions.

Shape, dtype and option checks only read metadata, so they cost no host sync
and trace cleanly under ``torch.compile(fullgraph=True)``. Checks of tensor
*values* (finite rewards, non-negative lengths) synchronise with the device;
they live only in the per-batch functions and are skipped while compiling.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor


class InputError(ValueError, TypeError):
    """Bad input to a dapo_ops function: wrong shape, dtype, option or value.

    A subclass of both ``ValueError`` and ``TypeError``, so a caller's existing handler for
    either catches it. The message names the argument and, for shapes, the shapes involved.
    """

    __module__ = "dapo_ops"  # tracebacks and docs show dapo_ops.InputError, its public name


#: Largest int64: integer options and counts must fit in it.
INT64_MAX = 2**63 - 1

MASK_DTYPES_DOC = "torch.bool or an integer dtype holding 0/1 (uint8, int8, int16, int32, int64)"


def shape_str(t: Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_float(name: str, t: Tensor) -> None:
    check_tensor(name, t)
    if not t.dtype.is_floating_point:
        raise InputError(
            f"{name} must be a floating-point tensor (float16, bfloat16, float32 or float64), "
            f"got {t.dtype}"
        )


def check_ndim(name: str, t: Tensor, ndim: int, layout: str) -> None:
    if t.ndim != ndim:
        raise InputError(f"{name} must have shape {layout}, got {shape_str(t)}")


def check_same_shape(name: str, t: Tensor, ref_name: str, ref: Tensor) -> None:
    if t.shape != ref.shape:
        raise InputError(
            f"{name} has shape {shape_str(t)} but {ref_name} has shape {shape_str(ref)}; "
            "they must match exactly (no broadcasting)"
        )


def as_bool_mask(name: str, mask: Tensor, ref_name: str, ref: Tensor) -> Tensor:
    """Return ``mask`` as a bool tensor after checking its dtype and shape."""
    check_tensor(name, mask)
    check_same_shape(name, mask, ref_name, ref)
    if mask.dtype == torch.bool:
        return mask
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise InputError(
            f"{name} must be {MASK_DTYPES_DOC}, got {mask.dtype}; a float mask is refused "
            "because it could carry weights: convert a 0/1 float mask with `mask.bool()`"
        )
    return mask != 0


def check_option(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise InputError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def check_clip_range(eps_low: float, eps_high: float, dual_clip: float | None) -> None:
    if not 0.0 <= eps_low < 1.0:
        raise InputError(f"eps_low must lie in [0, 1), got {eps_low}")
    if not eps_high >= 0.0:
        raise InputError(f"eps_high must be >= 0, got {eps_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise InputError(f"dual_clip must be > 1 (or None to disable it), got {dual_clip}")


def is_compiling() -> bool:
    return bool(torch.compiler.is_compiling())


def check_finite(name: str, t: Tensor) -> None:
    """Value check (host sync): skipped while tracing under torch.compile."""
    if is_compiling():
        return
    if not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise InputError(f"{name} must be finite; {bad} of {t.numel()} entries are NaN or inf")


def check_tensor(name: str, value: object) -> None:
    """``InputError`` unless ``value`` is a tensor with data (not on the meta device)."""
    if not isinstance(value, Tensor):
        raise InputError(
            f"{name} must be a torch.Tensor, got {type(value).__name__}; "
            "wrap it with torch.tensor(...)"
        )
    if value.device.type == "meta":
        raise InputError(
            f"{name} is on the meta device (a shape without data); pass a tensor on a real "
            "device (cpu or cuda)"
        )


def check_same_device(name: str, t: Tensor, ref_name: str, ref: Tensor) -> None:
    if t.device != ref.device:
        raise InputError(
            f"{name} is on {t.device} but {ref_name} is on {ref.device}; move them to one device"
        )


def check_no_grad(name: str, t: Tensor) -> None:
    """``InputError`` if ``t`` would carry a gradient: a constant of the objective must not."""
    check_tensor(name, t)
    if t.requires_grad and torch.is_grad_enabled():
        raise InputError(
            f"{name} requires grad, but it is a constant of the objective: a gradient through "
            f"it would silently bend the policy gradient; pass {name}.detach()"
        )


def check_scalar(name: str, value: object) -> float | Tensor:
    """A finite real number (as a float), or a 0-dim floating-point tensor that does not
    require grad (a coefficient that may change every step without a host sync)."""
    if isinstance(value, Tensor):
        check_float(name, value)
        if value.ndim != 0:
            raise InputError(
                f"{name} must be a number or a 0-dim tensor, got shape {list(value.shape)}"
            )
        check_no_grad(name, value)
        return value
    return check_real(name, value)


def check_real(name: str, value: object) -> float:
    """A finite real option (a Python or NumPy int or float, not a bool); as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise InputError(f"{name} must be finite, got {value}")
    return float(value)


def check_int(name: str, value: object, *, low: int) -> int:
    """An int option (a Python or NumPy int, not a bool or float) ``>= low`` that fits in
    int64; returned as a Python int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputError(f"{name} must be an int >= {low}, got {type(value).__name__} {value!r}")
    if not low <= int(value) <= INT64_MAX:
        raise InputError(f"{name} must be an int in [{low}, 2**63 - 1], got {value}")
    return int(value)


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def check_count_dtype(name: str, t: Tensor) -> None:
    """Counts (lengths): an integer or floating dtype, not bool or complex."""
    if t.dtype == torch.bool or t.dtype.is_complex:
        raise InputError(
            f"{name} must hold integer or float token counts, got {t.dtype}; convert with .long()"
        )


def check_non_negative(name: str, t: Tensor) -> None:
    """Value check (host sync): finite and >= 0; skipped while tracing under torch.compile."""
    if is_compiling() or t.numel() == 0:
        return
    if t.dtype.is_floating_point:
        check_finite(name, t)
    low = t.min()
    if bool(low < 0):
        raise InputError(f"{name} must be >= 0, got min {low.item()}")
