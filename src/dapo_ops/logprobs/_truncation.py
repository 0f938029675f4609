r"""The sampler's truncation: top-k, top-p and min-p kept sets, as one per-row threshold.

Private; :func:`dapo_ops.token_logprobs`, :func:`dapo_ops.fused_logprobs_entropy` and
:func:`dapo_ops.linear_policy_loss` take ``top_k``, ``top_p`` and ``min_p`` and pass them
here as one :class:`Truncation` value. The rules are those of vLLM's v1 sampler
(``vllm/v1/sample/sampler.py``, ``Sampler.sample``: temperature, then the min-p logits
processor ``MinPLogitsProcessor.apply``, then ``apply_top_k_top_p_pytorch`` in
``vllm/v1/sample/ops/topk_topp_sampler.py``), on the scaled logits :math:`z = x/T`:

1. min-p keeps :math:`p_v \ge \text{min\_p}\cdot\max_u p_u`, i.e.
   :math:`z_v \ge \max_u z_u + \log\text{min\_p}`;
2. top-k keeps the values :math:`\ge` the k-th largest (every token tied with it);
3. top-p, on the distribution renormalised over what is left, keeps :math:`v` when the
   mass strictly ahead of it is :math:`< p` (the token that crosses ``p`` is kept).

Each step keeps an upper set of the logits, so the kept set is :math:`K = \{v : z_v \ge
\tau\}` for one threshold :math:`\tau` per row (:func:`thresholds`). The log-probs are
then the softmax's over :math:`K \cup \{y\}` (:func:`truncate` sets the other logits to
``-inf``): the chosen token always counts, so a token outside the sampler's set (the
trainer's policy drifted, or the numerics differ) gets a finite log-prob, never ``-inf``.
The derivation is in ``docs/logprobs.md``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch
from torch import Tensor

from dapo_ops._core._validate import InputError, is_compiling

#: Rows per piece of the threshold search: ``max(1, E // vocab)`` rows, so that its
#: temporaries (a top-p sort's values and int64 indices, a few ``exp`` rows) stay a few
#: times ``E`` elements whatever the block. 2**20 on CPU, 2**23 on GPUs.
THRESHOLD_PIECE_ELEMENTS = {"cpu": 2**20, "other": 2**23}


@dataclasses.dataclass(frozen=True)
class Truncation:
    """The sampler's truncation (each field None when off): made by :func:`truncation`."""

    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None


def truncation(top_k: object, top_p: object, min_p: object) -> Truncation | None:
    """Check the three options (``InputError`` naming the option) and return them as one
    value, or None when none truncates anything (vLLM's off values: ``top_k`` None, 0 or
    -1, ``top_p`` None or 1, ``min_p`` None or 0)."""
    k = None
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
            raise InputError(
                f"top_k must be an int >= 1, or None, 0 or -1 for no top-k (vLLM's off "
                f"values); got {type(top_k).__name__} {top_k!r}"
            )
        if int(top_k) < -1:
            raise InputError(f"top_k must be >= 1, or None, 0 or -1 for no top-k; got {top_k}")
        k = int(top_k) if int(top_k) >= 1 else None
    p = _fraction("top_p", top_p, "(0, 1]", lambda x: 0.0 < x <= 1.0)
    m = _fraction("min_p", min_p, "[0, 1]", lambda x: 0.0 <= x <= 1.0)
    p = None if p == 1.0 else p
    m = None if m == 0.0 else m
    if k is None and p is None and m is None:
        return None
    return Truncation(k, p, m)


def _fraction(name: str, value: object, interval: str, ok: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputError(
            f"{name} must be a number in {interval} or None, got {type(value).__name__} {value!r}"
        )
    assert callable(ok)
    if not (math.isfinite(value) and ok(float(value))):
        raise InputError(f"{name} must be a number in {interval} or None, got {value}")
    return float(value)


def _piece_rows(z: Tensor) -> int:
    if is_compiling():
        return max(1, z.shape[0])
    per = THRESHOLD_PIECE_ELEMENTS["cpu" if z.device.type == "cpu" else "other"]
    return max(1, per // max(1, z.shape[1]))


def thresholds(z: Tensor, trunc: Truncation) -> Tensor:
    r"""The per-row threshold :math:`\tau` (``[rows]``, ``z``'s dtype) of the kept set
    :math:`\{v : z_v \ge \tau\}` of the scaled logits ``z`` (``[rows, vocab]``, the
    compute dtype; not modified), a piece of rows at a time."""
    step = _piece_rows(z)
    if step >= z.shape[0]:
        return _thresholds(z, trunc)
    return torch.cat([_thresholds(z[s : s + step], trunc) for s in range(0, z.shape[0], step)])


def _thresholds(z: Tensor, t: Truncation) -> Tensor:
    vocab = z.shape[1]
    top = z.amax(dim=1, keepdim=True)
    tau = torch.full_like(top, -math.inf)
    if t.min_p is not None:  # p_v >= min_p * max p  <=>  z_v >= max z + log(min_p)
        tau = top + math.log(t.min_p)
    k = t.top_k if t.top_k is not None and t.top_k < vocab else None
    cand = None
    if k is not None:  # the k-th largest value; all tokens tied with it are kept
        cand = torch.topk(z, k, dim=1).values  # sorted, largest first
        tau = torch.maximum(tau, cand[:, -1:])
    if t.top_p is not None:
        if cand is None:
            cand = torch.sort(z, dim=1, descending=True).values
        # mass over the set kept so far (min-p, top-k), relative to exp(max z)
        total = torch.where(z >= tau, torch.exp(z - top), 0.0).sum(dim=1, keepdim=True)
        inside = cand >= tau
        e = torch.where(inside, torch.exp(cand - top), 0.0)
        ahead = torch.cumsum(e, dim=1) - e  # mass before each sorted position
        # positions whose mass ahead is < p form a prefix; the last one's value is the
        # threshold (its ties come along: the mass strictly above them is no larger)
        count = ((ahead < t.top_p * total) & inside).sum(dim=1, keepdim=True).clamp_(min=1)
        tau = torch.maximum(tau, cand.gather(1, count - 1))
    return tau.squeeze(1)


def truncate(z: Tensor, tau: Tensor, tok: Tensor | None, owned: bool) -> Tensor:
    r"""``z`` with the logits outside :math:`\{z_v \ge \tau\} \cup \{y\}` set to ``-inf``
    (``tau`` ``[rows]``; ``tok`` the chosen ids ``[rows, 1]`` or None); in place when
    ``owned``."""
    drop = z < tau.unsqueeze(1)
    if tok is not None:
        drop = drop.scatter(1, tok, False)
    return z.masked_fill_(drop, -math.inf) if owned else z.masked_fill(drop, -math.inf)


def truncated(
    z: Tensor, trunc: Truncation, tok: Tensor | None, tau: Tensor | None, owned: bool
) -> tuple[Tensor, Tensor]:
    """``(truncate(z, ...), tau)``, the threshold found from ``z`` when ``tau`` is None
    (forward) or the saved one (backward: the same kept set, bit for bit)."""
    if tau is None:
        tau = thresholds(z, trunc)
    return truncate(z, tau, tok, owned), tau
