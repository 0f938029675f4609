"""Argument checks of the log-prob functions: logits, token ids, the output projection.

Shared by :mod:`dapo_ops.logprobs.tokens` and :mod:`dapo_ops.logprobs.linear_loss`. Metadata only, except
the token-id range check (one host sync, skipped under ``torch.compile``): an id outside
``[0, vocab)`` would otherwise crash ``gather`` (a device-side assert on CUDA).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dapo_ops._core._validate import InputError, check_float, check_tensor, is_compiling, shape_str


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 input, float32 for every other floating dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_options(temperature: float, chunk_size: int | None) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise InputError(
            f"temperature must be a float > 0, got {temperature!r} (a {type(temperature).__name__})"
        )
    if not (math.isfinite(temperature) and temperature > 0):
        raise InputError(f"temperature must be a finite number > 0, got {temperature}")
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
            raise InputError(f"chunk_size must be an int >= 1 or None, got {chunk_size!r}")
        if chunk_size < 1:
            raise InputError(f"chunk_size must be >= 1 (or None for the default), got {chunk_size}")


def float_tensor(name: str, t: object) -> Tensor:
    check_float(name, t)  # type: ignore[arg-type]
    assert isinstance(t, Tensor)
    return t


def check_tokens(
    tokens: object, rows_shape: torch.Size, ref: str, vocab: int, valid: Tensor | None = None
) -> Tensor:
    """Dtype and shape of ``tokens``, then the id range (one host sync, eager only).

    With ``valid`` (a bool mask of ``rows_shape``), only the ids at valid positions are
    checked: the caller replaces the others before using them.
    """
    check_tensor("tokens", tokens)
    assert isinstance(tokens, Tensor)
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise InputError(f"tokens must be an integer tensor of token ids, got {tokens.dtype}")
    if tokens.shape != rows_shape:
        want = "[" + ", ".join(str(s) for s in rows_shape) + "]"
        raise InputError(
            f"tokens must have shape {want} ({ref} without its last dim), got {shape_str(tokens)}"
        )
    if valid is not None and tokens.device != valid.device:
        raise InputError(
            f"tokens is on {tokens.device} but mask is on {valid.device}; move them to one device"
        )
    if is_compiling() or tokens.numel() == 0:
        return tokens
    ids = tokens if valid is None else torch.where(valid, tokens, 0)
    lo_hi = torch.stack(torch.aminmax(ids)).tolist()  # value check: one host sync
    if lo_hi[0] < 0 or lo_hi[1] >= vocab:
        where = "" if valid is None else " at unmasked positions"
        raise InputError(
            f"tokens must hold ids in [0, vocab) = [0, {vocab}){where}; got values in "
            f"[{lo_hi[0]}, {lo_hi[1]}] (replace ignore labels such as -100 by any valid id "
            "and mask those positions in the loss)"
        )
    return tokens


def check_logits(logits: object) -> Tensor:
    t = float_tensor("logits", logits)
    if t.ndim not in (2, 3):
        raise InputError(
            f"logits must have shape [tokens, vocab] or [batch, seq, vocab], got {shape_str(t)}"
        )
    if t.shape[-1] < 1:
        raise InputError(f"logits must have a vocab dimension >= 1, got {shape_str(t)}")
    return t


def check_projection(
    hidden: object, weight: object, bias: object, layouts: str
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``hidden [..., d]`` (``layouts`` names the accepted shapes), ``weight [vocab, d]``
    and ``bias [vocab]`` or None: one floating dtype, one device."""
    h = float_tensor("hidden", hidden)
    w = float_tensor("weight", weight)
    if h.ndim not in ((3,) if layouts == "[batch, seq, d]" else (2, 3)):
        raise InputError(f"hidden must have shape {layouts}, got {shape_str(h)}")
    if w.ndim != 2 or w.shape[1] != h.shape[-1] or w.shape[0] < 1:
        raise InputError(
            f"weight must have shape [vocab, d] with d = hidden's last dim "
            f"({h.shape[-1]}) and vocab >= 1, got {shape_str(w)}"
        )
    vocab = w.shape[0]
    tensors = [("weight", w)]
    b = None
    if bias is not None:
        b = float_tensor("bias", bias)
        if b.shape != (vocab,):
            raise InputError(f"bias must have shape [vocab] = [{vocab}], got {shape_str(b)}")
        tensors.append(("bias", b))
    for name, t in tensors:
        if t.dtype != h.dtype:
            raise InputError(f"{name} has dtype {t.dtype} but hidden has {h.dtype}")
        if t.device != h.device:
            raise InputError(f"{name} is on {t.device} but hidden is on {h.device}")
    return h, w, b


def auto_chunk(
    chunk_size: int | None, vocab: int, device: torch.device, elements: dict[str, int]
) -> int:
    """``chunk_size``, or ``max(1, E // vocab)`` rows for the device's ``E`` elements."""
    if chunk_size is not None:
        return chunk_size
    return max(1, elements["cpu" if device.type == "cpu" else "other"] // vocab)


def may_overlap(t: Tensor) -> bool:
    """Whether two elements of ``t`` might share memory (an ``expand``-ed view, stride 0).

    Metadata only: sorted by stride, every dim of size > 1 must step past everything the
    smaller dims span; views made by slicing, transposing or ``unsqueeze`` pass.
    """
    span = 0
    pairs = zip(t.stride(), t.shape, strict=True)
    for stride, size in sorted((st, sz) for st, sz in pairs if sz > 1):
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False
