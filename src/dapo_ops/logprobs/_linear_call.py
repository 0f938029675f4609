"""The checks and the dispatch of :func:`dapo_ops.linear_policy_loss` (private).

:func:`run` checks every argument (:func:`_prepare`; with ``vocab_group`` inside
:func:`dapo_ops.logprobs._vocab_parallel.split_vocab`, so every rank raises alike), then
runs the chunked path or the two-pass design (``backend``, ``keep_logits``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from dapo_ops._core._rules import compute_dtype
from dapo_ops._core._validate import (
    InputError,
    check_float,
    check_same_device,
    check_scalar,
    shape_str,
)
from dapo_ops.engine._engine import LossSpec
from dapo_ops.engine.checks import (
    check_constants,
    check_loss_options,
    normalizer_tensor,
    objective_inputs,
)
from dapo_ops.engine.policy import LossOptions
from dapo_ops.kernels.rows import RowMath
from dapo_ops.logprobs._backends import Backend, resolve
from dapo_ops.logprobs._fused_linear import DEFAULT_FUSED_CHUNK_ELEMENTS
from dapo_ops.logprobs._linear_loss import LinearInputs, LinearPolicyLoss, LinearSpec, forward_pass
from dapo_ops.logprobs._linear_packed import unpack
from dapo_ops.logprobs._logprob_checks import (
    auto_chunk,
    check_options,
    check_projection,
    check_tokens,
)
from dapo_ops.logprobs._packing import Packed, RowMap, check_skip_padding, skip_padding_map
from dapo_ops.logprobs._softcap import check_softcap
from dapo_ops.logprobs._truncation import truncation
from dapo_ops.logprobs._two_pass import two_pass_spec
from dapo_ops.logprobs._two_pass_loss import TwoPassPolicyLoss
from dapo_ops.logprobs._vocab_parallel import VocabSplit, split_vocab, tp_only_normalizer
from dapo_ops.objectives import ClipHigher, Objective

#: The default objective: DAPO's Clip-Higher (eps_low 0.2, eps_high 0.28).
DAPO_CLIP = ClipHigher()


class LinearOptions(LossOptions, total=False):
    """The keyword options of :func:`linear_policy_loss`."""

    objective: Objective
    bias: Tensor | None
    temperature: float
    entropy_coef: float | Tensor
    chunk_size: int | None
    backend: Backend
    keep_logits: bool | None
    top_k: int | None
    top_p: float | None
    min_p: float | None
    softcap: float | None
    vocab_group: object
    skip_padding: bool | int
    cu_seqlens: Tensor | None


def _prepare(
    hidden: object,
    weight: object,
    tokens: object,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    options: LinearOptions,
    entropy: bool,
    vocab_total: int | None = None,
) -> tuple[LinearSpec, Tensor, Tensor, Tensor | None, LinearInputs]:
    """Check every argument (metadata only, plus the valid token ids' range)."""
    o = options
    h, w, b = check_projection(hidden, weight, o.get("bias"), "[batch, seq, d]")
    objective = o.get("objective", DAPO_CLIP)
    mode, max_len, kl = o.get("mode", "token_mean"), o.get("max_len"), o.get("kl")
    ref_logp, is_weights = o.get("ref_logp"), o.get("is_weights")
    check_loss_options(objective, mode=mode, max_len=max_len, kl=kl, ref_logp=ref_logp)
    temperature, chunk_size = o.get("temperature", 1.0), o.get("chunk_size")
    check_options(temperature, chunk_size)
    trunc = truncation(o.get("top_k"), o.get("top_p"), o.get("min_p"))
    cap = check_softcap(o.get("softcap"))
    check_float("old_logp", old_logp)
    if old_logp.shape != h.shape[:2]:
        raise InputError(
            f"old_logp must have shape [batch, seq] = hidden's leading dims "
            f"{list(h.shape[:2])}, got {shape_str(old_logp)}"
        )
    adv, valid, _ = objective_inputs(
        objective, old_logp, old_logp, advantages, mask, device_of=("hidden", h),
        names=("old_logp", "old_logp"),
    )  # fmt: skip
    check_constants(
        (("ref_logp", ref_logp), ("is_weights", is_weights)),
        shape_of=("old_logp", old_logp),
        device_of=("hidden", h),
    )
    den = normalizer_tensor(o.get("normalizer"), compute_dtype(h, old_logp, adv), h.device)
    coef = check_scalar("entropy_coef", o.get("entropy_coef", 0.0))
    if isinstance(coef, Tensor):
        check_same_device("entropy_coef", coef, "hidden", h)
    vocab = w.shape[0] if vocab_total is None else vocab_total
    tok = check_tokens(tokens, h.shape[:2], f"hidden {shape_str(h)}", vocab, valid)
    check_same_device("tokens", tok, "hidden", h)
    chunk = auto_chunk(chunk_size, vocab, h.device, DEFAULT_FUSED_CHUNK_ELEMENTS)
    wants_entropy = entropy or isinstance(coef, Tensor) or coef != 0.0
    spec = LinearSpec(
        LossSpec(objective, kl, mode, max_len), float(temperature), chunk, wants_entropy, trunc, cap
    )
    ids = torch.where(valid, tok, 0).to(torch.int64)
    inputs = LinearInputs(ids, old_logp, adv, valid, ref_logp, is_weights, den, coef)
    return spec, h, w, b, inputs


def _row_map(t: LinearInputs, o: LinearOptions, packed: Packed | None) -> RowMap | None:
    """The rows the passes run on: with ``skip_padding`` the valid ones, with
    ``cu_seqlens`` the packed ones (the valid ones among them with both)."""
    skip = o.get("skip_padding", False)
    if packed is None:
        count = check_skip_padding(skip, t.valid)
        return None if count is None else skip_padding_map(t.valid, count, skip is True)
    valid = t.valid.reshape(-1)[packed.dst]
    count = check_skip_padding(skip, valid)
    if count is None:
        return RowMap(torch.arange(valid.shape[0], device=valid.device), packed.dst, None)
    rows = skip_padding_map(valid, count, skip is True)
    return rows._replace(dst=packed.dst[rows.src])


def _run(
    spec: LinearSpec, h: Tensor, w: Tensor, b: Tensor | None, t: LinearInputs, o: LinearOptions,
    split: VocabSplit | None, packed: Packed | None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    keep = o.get("keep_logits")
    needs = next(
        (name for name, on in (("vocab_group", split is not None), ("cu_seqlens", packed is not None),
         ("skip_padding", o.get("skip_padding", False) is not False)) if on),
        None,
    )  # fmt: skip
    path = resolve(o.get("backend", "auto"), h.device, o.get("chunk_size"), keep, needs)
    if split is not None and spec.trunc is not None:
        raise InputError(
            "top_k, top_p and min_p need whole rows; with vocab_group the rows are split across "
            "ranks: truncate on one rank's full logits (token_logprobs), or leave them off"
        )
    if path != "chunked":
        rows = RowMath(spec.temperature, spec.softcap)
        rm = _row_map(t, o, packed)
        n = None if rm is None else rm.src.shape[0]
        tp = two_pass_spec(path, rows, spec.trunc, keep, h, w.shape[0], split, n)
        return TwoPassPolicyLoss.apply(h, w, b, spec, t, tp, rm)  # type: ignore[no-any-return,no-untyped-call]
    need = tuple(torch.is_grad_enabled() and x is not None and x.requires_grad for x in (h, w, b))
    if any(need):
        return LinearPolicyLoss.apply(h, w, b, spec, t)  # type: ignore[no-any-return,no-untyped-call]
    loss, logp, ent, _ = forward_pass(spec, h, w, b, t, (False, False, False))
    return loss, logp, logp.new_zeros(0) if ent is None else ent


def agreed(hidden: object, tokens: object, mask: object, o: LinearOptions) -> dict[str, object]:
    """What every rank of a ``vocab_group`` must pass alike."""
    keys = (
        "objective",
        "temperature",
        "mode",
        "max_len",
        "kl",
        "backend",
        "keep_logits",
        "softcap",
    )
    out: dict[str, object] = {"hidden": hidden, "tokens": tokens, "mask": mask}
    if isinstance(hidden, Tensor):
        out["device type"] = hidden.device.type
    return out | {k: o.get(k) for k in keys}


class Ran(NamedTuple):
    """A call's results and the per-token inputs in the layout they share (the grid with
    ``cu_seqlens``), for the diagnostics; ``packed`` maps them back, or None."""

    loss: Tensor
    logp: Tensor
    entropy: Tensor
    old_logp: Tensor
    advantages: Tensor
    mask: Tensor
    packed: Packed | None


def run(
    hidden: object, weight: object, tokens: object, old_logp: Tensor, advantages: Tensor,
    mask: Tensor, o: LinearOptions, entropy: bool,
) -> Ran:  # fmt: skip
    """The loss, ``logp`` and ``entropy`` of a checked call (``entropy`` asked or not)."""
    group, cu = o.get("vocab_group"), o.get("cu_seqlens")
    if group is not None:
        o = o | {"normalizer": tp_only_normalizer(group, o.get("normalizer"))}  # type: ignore[typeddict-item,assignment]
    packed, given = None, hidden
    if cu is not None:
        packed, hidden, grid, o = unpack(hidden, tokens, old_logp, advantages, mask, o, cu)
        tokens, old_logp, advantages, mask = grid
    args = (hidden, weight, tokens, old_logp, advantages, mask, o, entropy)
    split = None
    if group is None:
        spec, h, w, b, t = _prepare(*args)
    else:
        (spec, h, w, b, t), split = split_vocab(
            group, weight, agreed(hidden, tokens, mask, o), lambda v: _prepare(*args, vocab_total=v)
        )
    if packed is not None:
        assert isinstance(given, Tensor)
        h = given  # the packed rows (the grid stand-in took the checks)
    loss, logp, ent = _run(spec, h, w, b, t, o, split, packed)
    return Ran(loss, logp, ent, old_logp, advantages, mask, packed)
