"""Overlong reward shaping (DAPO change 4): soft punishment and the overlong filter."""

from __future__ import annotations

import torch
from einops import rearrange
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._checked import checks_values
from dapo_ops._core._validate import (
    InputError,
    as_bool_mask,
    check_count_dtype,
    check_int,
    check_ndim,
    check_non_negative,
    check_real,
    check_same_device,
    check_tensor,
    shape_str,
)


def overlong_reward(
    lengths: Integer[Tensor, " batch"] | Float[Tensor, " batch"],
    *,
    max_len: int,
    cache_len: int,
    factor: float = 1.0,
) -> Float[Tensor, " batch"]:
    r"""DAPO's soft overlong punishment, added to the correctness reward.

    .. math::

        R_{length}(y) = \text{factor} \cdot \begin{cases}
            0 & |y| \le L_{max} - L_{cache} \\
            \dfrac{(L_{max} - L_{cache}) - |y|}{L_{cache}} & L_{max} - L_{cache} < |y| \le L_{max} \\
            -1 & |y| > L_{max}
        \end{cases}

    Continuous and non-increasing in ``|y|``; exactly 0 at ``max_len - cache_len``,
    ``-factor`` at ``max_len`` and ``-factor`` for every longer length. Peers disagree past
    ``max_len``: verl's ``overlong_buffer`` keeps extrapolating the line (below
    ``-factor``), TRL returns -1; ours is capped at ``-factor``, like the paper's formula.

    ``lengths`` are token counts of the generated response, **EOS included** (it is a
    generated token and counts towards the generation cap; so does verl's
    ``response_length`` and TRL's completion mask). Prompt tokens are not counted.

    Shapes: ``lengths [batch]`` (integers or floats, finite and >= 0, else
    ``InputError``: checked with one host sync, skipped under ``torch.compile``); returns
    ``[batch]`` float32 (float64 for float64 lengths). Exact for any length: integer
    lengths are compared with the budget in int64 (no rounding through float32 above
    ``2**24``), float lengths in float64, and the result is rounded once.
    ``max_len`` and ``cache_len`` are ints (``0 < cache_len <= max_len < 2**63``).

    Defaults: the paper uses ``max_len=20480``, ``cache_len=4096`` (expected length
    16384); ``factor=1.0`` is the paper's (verl's ``penalty_factor``).

    Example:
        >>> overlong_reward(torch.tensor([10, 16, 18, 20, 25]), max_len=20, cache_len=4)
        tensor([ 0.0000,  0.0000, -0.5000, -1.0000, -1.0000])
    """
    max_len = check_int("max_len", max_len, low=1)
    cache_len = check_int("cache_len", cache_len, low=1)
    if not cache_len <= max_len:
        raise InputError(
            f"cache_len must satisfy 0 < cache_len <= max_len={max_len}, got {cache_len}"
        )
    factor = check_real("factor", factor)
    if not factor >= 0:
        raise InputError(f"factor must be finite and >= 0, got {factor}")
    check_tensor("lengths", lengths)
    check_ndim("lengths", lengths, 1, "[batch]")
    check_count_dtype("lengths", lengths)
    check_non_negative("lengths", lengths)
    out_dtype = torch.float64 if lengths.dtype == torch.float64 else torch.float32
    expected = max_len - cache_len
    # (expected - |y|) clamped to [-cache_len, 0]: exact in int64 for integer lengths (no
    # float32 rounding above 2**24), in float64 for float lengths; then one division.
    if lengths.dtype.is_floating_point:
        under = expected - lengths.to(torch.float64)
    else:
        under = expected - lengths.to(torch.int64)
    under = under.clamp(min=-cache_len, max=0)
    return (under.to(torch.float64) / cache_len * factor).to(out_dtype)


@checks_values
def overlong_filter(
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    truncated: Bool[Tensor, " batch"],
) -> Bool[Tensor, "batch seq"]:
    r"""Overlong filtering: a loss mask that drops every token of truncated samples.

    ``out[i, t] = mask[i, t] and not truncated[i]``. A truncated answer usually gets the
    "wrong" reward although its reasoning may be sound; DAPO (sec. 3.4) masks its loss
    instead of punishing it. ``truncated`` is the host's own flag: generation stopped at
    the cap without EOS (vLLM's ``finish_reason == "length"``). ``lengths >= max_len``
    over-approximates it by the answers whose EOS was exactly the last allowed token.
    TRL calls this ``mask_truncated_completions``.

    Feed the result to :func:`token_level_loss`. Filtered samples count neither in the
    numerator nor in the denominator (tokens or sequences), and should be left out of
    :func:`global_normalizer` the same way: pass it the filtered masks.

    Shapes: mask ``[batch, seq]`` (bool or 0/1 integers), truncated ``[batch]`` bool;
    returns ``[batch, seq]`` bool.

    Example:
        >>> mask = torch.ones(2, 3, dtype=torch.bool)
        >>> overlong_filter(mask, torch.tensor([False, True]))
        tensor([[ True,  True,  True],
                [False, False, False]])
    """
    check_tensor("mask", mask)
    check_ndim("mask", mask, 2, "[batch, seq]")
    valid = as_bool_mask("mask", mask, "mask", mask)
    check_tensor("truncated", truncated)
    if truncated.dtype != torch.bool:
        raise InputError(
            f"truncated must be a bool tensor [batch], got {truncated.dtype}; "
            "pass a 0/1 flag as flag.bool()"
        )
    if truncated.shape != mask.shape[:1]:
        raise InputError(
            f"truncated must have shape [batch]=[{mask.shape[0]}] to match mask "
            f"{shape_str(mask)}, got {shape_str(truncated)}"
        )
    check_same_device("truncated", truncated, "mask", mask)
    return valid & ~rearrange(truncated, "batch -> batch 1")


def truncation_penalty(
    rewards: Float[Tensor, " batch"],
    truncated: Bool[Tensor, " batch"],
    *,
    coef: float,
) -> Float[Tensor, " batch"]:
    r"""The "stop properly" penalty (ProRL): scale the reward of every truncated response.

    .. math::

        R'_i = \begin{cases}
            R_i & \text{not truncated}_i \\
            \text{coef} \cdot R_i & \text{truncated}_i,\ 0 \le \text{coef} \le 1 \\
            \text{coef} & \text{truncated}_i,\ \text{coef} < 0
        \end{cases}

    A response that hit the generation cap without EOS (``truncated``: vLLM's
    ``finish_reason == "length"``, as for :func:`overlong_filter`) keeps the share
    ``coef`` of its reward: ``coef=0`` zeroes it (ProRL's setting), ``coef=1`` changes
    nothing. A negative ``coef`` replaces a truncated response's reward by ``coef`` itself
    (a fixed punishment, e.g. ``-0.5``): OpenRLHF's extension; NeMo-RL accepts
    ``[0, 1]`` only. Unlike :func:`overlong_reward`, it looks at how the response ended,
    not at its length, and multiplies instead of adding: a wrong (0-reward) truncated
    answer is not punished for ``coef >= 0``.

    Peers: NeMo-RL ``stop_properly_penalty_coef`` (``nemo_rl/algorithms/reward_functions.py``:
    ``apply_reward_shaping``), OpenRLHF 0.11.2 ``--stop_properly_penalty_coef``
    (``openrlhf/trainer/ppo_utils/length_penalty.py``: ``apply_stop_properly_penalty``),
    both from NVIDIA's ProRL v2 recipe. No default for ``coef`` (both peers leave it off).

    Shapes: ``rewards [batch]`` (floating point), ``truncated [batch]`` bool; returns
    ``[batch]`` float32 (float64 for float64 rewards), computed with ``torch.where``: a
    NaN reward stays NaN unless a negative ``coef`` replaces it. No host sync.

    Example:
        >>> rewards = torch.tensor([1.0, 1.0, 0.0])
        >>> truncation_penalty(rewards, torch.tensor([False, True, True]), coef=0.5)
        tensor([1.0000, 0.5000, 0.0000])
    """
    coef = check_real("coef", coef)
    if coef > 1.0:
        raise InputError(f"coef must be <= 1 (a scale in [0, 1], or a negative reward), got {coef}")
    check_tensor("rewards", rewards)
    if not rewards.dtype.is_floating_point:
        raise InputError(
            f"rewards must be a floating-point tensor [batch], got {rewards.dtype}; "
            "convert with .float()"
        )
    check_ndim("rewards", rewards, 1, "[batch]")
    check_tensor("truncated", truncated)
    if truncated.dtype != torch.bool:
        raise InputError(
            f"truncated must be a bool tensor [batch], got {truncated.dtype}; "
            "pass a 0/1 flag as flag.bool()"
        )
    if truncated.shape != rewards.shape:
        raise InputError(
            f"truncated must have shape [batch]=[{rewards.shape[0]}] to match rewards "
            f"{shape_str(rewards)}, got {shape_str(truncated)}"
        )
    check_same_device("truncated", truncated, "rewards", rewards)
    out_dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    r = rewards.to(out_dtype)
    penalised = r.new_full((), coef) if coef < 0 else r * coef
    return torch.where(truncated, penalised, r)
