"""The checks and the dispatch of :func:`dapo_ops.linear_distill_loss` (private).

:func:`run` checks every argument (:func:`_prepare`; with ``vocab_group`` inside
:func:`dapo_ops.logprobs._vocab_parallel.split_vocab`, so every rank raises alike), then
runs the chunked path or the two-pass design (``backend``, ``keep_logits``,
``skip_padding``).
"""

from __future__ import annotations

import math
from typing import Any, Literal, TypedDict

import torch
from torch import Tensor

from dapo_ops._core._rules import AGGREGATION_MODES, AggregationMode, Normalizer
from dapo_ops._core._validate import (
    InputError,
    as_bool_mask,
    check_float,
    check_no_grad,
    check_option,
    check_same_device,
    check_tensor,
    shape_str,
)
from dapo_ops.engine.aggregation import check_max_len, check_normalizer
from dapo_ops.kernels.rows import RowMath
from dapo_ops.logprobs._backends import Backend, resolve
from dapo_ops.logprobs._distill_checks import (
    _number,
    check_ids,
    check_is_weights,
    check_support,
    check_tail,
)
from dapo_ops.logprobs._distill_terms import DistillInputs, DistillSpec, LinearDistill, forward_pass
from dapo_ops.logprobs._distill_two_pass import TwoPassDistill
from dapo_ops.logprobs._fused_linear import DEFAULT_FUSED_CHUNK_ELEMENTS
from dapo_ops.logprobs._logprob_checks import auto_chunk, check_options, check_projection
from dapo_ops.logprobs._packing import (
    check_skip_padding,
    packed_hidden,
    packed_map,
    skip_padding_map,
)
from dapo_ops.logprobs._softcap import check_softcap
from dapo_ops.logprobs._two_pass import two_pass_spec
from dapo_ops.logprobs._vocab_parallel import VocabSplit, split_vocab, tp_only_normalizer

DistillKind = Literal["forward_kl", "reverse_kl", "jsd"]
DISTILL_KINDS: tuple[str, ...] = ("forward_kl", "reverse_kl", "jsd")
TopkTail = Literal["none", "bucket", "renormalize"]
TopkSupport = Literal["teacher", "student", "union"]


class DistillOptions(TypedDict, total=False):
    """The keyword options of :func:`linear_distill_loss`."""

    teacher_ids: Tensor | None
    kind: DistillKind
    beta: float | None
    temperature: float
    topk: int | None
    log_prob_min_clamp: float | None
    loss_clamp: float | None
    bias: Tensor | None
    mode: AggregationMode
    normalizer: Normalizer
    max_len: int | None
    chunk_size: int | None
    softcap: float | None
    is_weights: Tensor | None
    topk_tail: TopkTail
    topk_support: TopkSupport
    backend: Backend
    keep_logits: bool | None
    vocab_group: object
    skip_padding: bool | int
    cu_seqlens: Tensor | None


def _prepare(
    hidden: object, weight: object, teacher: object, mask: object, o: DistillOptions,
    vocab_total: int | None = None,
) -> tuple[DistillSpec, Tensor, Tensor, Tensor | None, DistillInputs]:  # fmt: skip
    """Check every argument (metadata only, plus the teacher ids' range); ``vocab_total``
    the whole vocabulary of a split one (ids and ``topk`` against it)."""
    h, w, b = check_projection(hidden, weight, o.get("bias"), "[batch, seq, d]")
    check_float("teacher", teacher)  # type: ignore[arg-type]
    assert isinstance(teacher, Tensor)
    check_tensor("mask", mask)
    assert isinstance(mask, Tensor)
    valid = as_bool_mask("mask", mask, "hidden[..., 0]", h[..., 0])
    for name, t in (("teacher", teacher), ("mask", valid)):
        check_same_device(name, t, "hidden", h)
    check_no_grad("teacher", teacher)
    kind, beta = o.get("kind", "forward_kl"), o.get("beta")
    check_option("kind", kind, DISTILL_KINDS)
    if kind != "jsd" and beta is not None:
        raise InputError(f"beta is the JSD's mixture weight: kind='jsd' only; got beta={beta!r} with kind={kind!r}")  # fmt: skip
    beta = 0.5 if beta is None else beta
    _number("beta", beta, isinstance(beta, (int, float)) and 0 < beta < 1,
            "a number in (0, 1) (TRL's beta=0 is kind='forward_kl', beta=1 kind='reverse_kl')")  # fmt: skip
    temperature, chunk_size = o.get("temperature", 1.0), o.get("chunk_size")
    check_options(temperature, chunk_size)
    mode, max_len = o.get("mode", "token_mean"), o.get("max_len")
    check_option("mode", mode, AGGREGATION_MODES)
    check_max_len(max_len)
    local, lead = w.shape[0], h.shape[:2]
    vocab = local if vocab_total is None else vocab_total
    ids, topk = o.get("teacher_ids"), o.get("topk")
    if topk is not None:
        _number("topk", topk, isinstance(topk, int) and 1 <= topk <= vocab, f"an int in [1, vocab={vocab}] or None")  # fmt: skip
    if teacher.shape[:2] != lead or teacher.ndim != 3:
        want = "[batch, seq, k] (top-k log-probs)" if ids is not None else "[batch, seq, vocab]"
        raise InputError(f"teacher must have shape {want} with [batch, seq] = {list(lead)}, got {shape_str(teacher)}")  # fmt: skip
    if ids is None and teacher.shape[-1] != local:
        raise InputError(
            f"teacher (the teacher's logits) must have vocab = weight's rows = {local} in its "
            f"last dim, got {shape_str(teacher)}; top-k log-probs go with teacher_ids"
        )
    on_topk = ids is not None or topk is not None
    clamp, loss_clamp = o.get("log_prob_min_clamp"), o.get("loss_clamp")
    tail = check_tail(o.get("topk_tail", "none"), on_topk, kind, clamp)
    if ids is not None:
        ids = check_ids(ids, teacher, valid, vocab, tail != "none")
        if topk is not None and topk != teacher.shape[-1]:
            raise InputError(f"topk must be None or teacher's k = {teacher.shape[-1]} with teacher_ids, got {topk}")  # fmt: skip
    support = check_support(o.get("topk_support", "teacher"), tail, ids is not None, topk)
    if clamp is not None:
        _number("log_prob_min_clamp", clamp, isinstance(clamp, (int, float)) and math.isfinite(clamp) and on_topk,
                "a finite number (or None) on the top-k path (teacher_ids or topk)")  # fmt: skip
    if loss_clamp is not None:
        _number("loss_clamp", loss_clamp, isinstance(loss_clamp, (int, float)) and 0 < loss_clamp < math.inf,
                "a finite number > 0 or None")  # fmt: skip
    cap = check_softcap(o.get("softcap"))
    given = check_normalizer(o.get("normalizer"))
    den = None
    if given is not None:
        if isinstance(given, Tensor):
            check_no_grad("normalizer", given)
        cdt = torch.float64 if h.dtype == torch.float64 else torch.float32
        den = torch.as_tensor(given, dtype=cdt, device=h.device)
    chunk = auto_chunk(chunk_size, vocab, h.device, DEFAULT_FUSED_CHUNK_ELEMENTS)
    spec = DistillSpec(
        kind, float(beta), float(temperature), topk,
        None if clamp is None else float(clamp), None if loss_clamp is None else float(loss_clamp),
        mode, max_len, chunk, cap, tail, support,
    )  # fmt: skip
    isw = check_is_weights(o.get("is_weights"), valid, h)
    return spec, h, w, b, DistillInputs(teacher.detach(), ids, valid, den, isw)


def _run(
    spec: DistillSpec, h: Tensor, w: Tensor, b: Tensor | None, t: DistillInputs,
    o: DistillOptions, split: VocabSplit | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    backend, keep, skip = o.get("backend", "auto"), o.get("keep_logits"), o.get("skip_padding", False)  # fmt: skip
    needs = next(
        (name for name, on in (("vocab_group", split is not None), ("cu_seqlens", t.grid is not None),
         ("skip_padding", skip is not False)) if on),
        None,
    )  # fmt: skip
    path = resolve(backend, h.device, o.get("chunk_size"), keep, needs)
    if path != "chunked":
        count = check_skip_padding(skip, t.valid)
        rm = None if count is None else skip_padding_map(t.valid, count, skip is True)
        n = None if rm is None else rm.src.shape[0]
        rows = RowMath(spec.temperature, spec.softcap)
        tp = two_pass_spec(path, rows, None, keep, h, w.shape[0], split, n)
        return TwoPassDistill.apply(h, w, b, spec, t, tp, rm)  # type: ignore[no-any-return,no-untyped-call]
    need = tuple(torch.is_grad_enabled() and x is not None and x.requires_grad for x in (h, w, b))
    if any(need):
        return LinearDistill.apply(h, w, b, spec, t)  # type: ignore[no-any-return,no-untyped-call]
    loss, terms, _ = forward_pass(spec, h, w, b, t, (False, False, False))
    empty = terms.loss.new_zeros(0)
    sm, tm = terms.student_mass, terms.teacher_mass
    return loss, terms.loss, empty if sm is None else sm, empty if tm is None else tm


def _packed(hidden: object, o: DistillOptions) -> Any:
    """The grid of ``cu_seqlens`` (None without it); ``hidden`` must be ``[1, total, d]``."""
    cu = o.get("cu_seqlens")
    if cu is None:
        return None
    h = packed_hidden(hidden)
    return packed_map(cu, h.shape[1], h.device)


def run(
    hidden: object, weight: object, teacher: object, mask: object, o: DistillOptions
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss, per-token loss, student mass, teacher mass)`` of a checked call. With
    ``cu_seqlens`` every input stays packed (``[1, total, ...]``); only the aggregation
    weights are found on the sequences' grid."""
    group, grid = o.get("vocab_group"), _packed(hidden, o)
    if group is None:
        spec, h, w, b, t = _prepare(hidden, weight, teacher, mask, o)
        return _run(spec, h, w, b, t._replace(grid=grid), o, None)
    o = o | {"normalizer": tp_only_normalizer(group, o.get("normalizer"))}  # type: ignore[typeddict-item,assignment]
    keys = ("kind", "beta", "temperature", "topk", "log_prob_min_clamp", "loss_clamp", "mode",
            "max_len", "softcap", "topk_tail", "topk_support", "backend", "keep_logits")  # fmt: skip
    agreed = {"hidden": hidden, "mask": mask} | {k: o.get(k) for k in keys}
    if o.get("teacher_ids") is not None:
        agreed |= {"teacher": teacher, "teacher_ids": o.get("teacher_ids")}
    (spec, h, w, b, t), split = split_vocab(
        group, weight, agreed, lambda v: _prepare(hidden, weight, teacher, mask, o, v)
    )
    return _run(spec, h, w, b, t._replace(grid=grid), o, split)
