"""The checks and the dispatch of :func:`dapo_ops.fused_logprobs_entropy` (private)."""

from __future__ import annotations

from typing import TypedDict

import torch
from torch import Tensor

from dapo_ops._core._validate import InputError, shape_str
from dapo_ops.kernels.rows import RowMath
from dapo_ops.logprobs._backends import resolve
from dapo_ops.logprobs._fused_linear import DEFAULT_FUSED_CHUNK_ELEMENTS
from dapo_ops.logprobs._fused_logp_entropy import FusedLinearLogpEntropy
from dapo_ops.logprobs._logprob_checks import (
    auto_chunk,
    check_options,
    check_projection,
    check_tokens,
)
from dapo_ops.logprobs._softcap import check_softcap
from dapo_ops.logprobs._truncation import Truncation, truncation
from dapo_ops.logprobs._two_pass import two_pass_spec
from dapo_ops.logprobs._two_pass_loss import TwoPassLogpEntropy
from dapo_ops.logprobs._vocab_parallel import VocabSplit, split_vocab


class FusedOptions(TypedDict):
    """The keyword options of :func:`dapo_ops.fused_logprobs_entropy` (a plain dict:
    ``torch.compile`` traces it)."""

    bias: Tensor | None
    temperature: float
    chunk_size: int | None
    backend: object
    keep_logits: object
    vocab_group: object
    top_k: int | None
    top_p: float | None
    min_p: float | None
    softcap: float | None


Checked = tuple[Tensor, Tensor, "Tensor | None", Tensor, "Truncation | None", "float | None"]


def _prepare(hidden: object, weight: object, tokens: object, o: FusedOptions, vocab_total: int | None) -> Checked:  # fmt: skip
    h, w, b = check_projection(hidden, weight, o["bias"], "[tokens, d] or [batch, seq, d]")
    vocab = w.shape[0] if vocab_total is None else vocab_total
    check_options(o["temperature"], o["chunk_size"])
    trunc, cap = truncation(o["top_k"], o["top_p"], o["min_p"]), check_softcap(o["softcap"])
    tok = check_tokens(tokens, h.shape[:-1], f"hidden {shape_str(h)}", vocab)
    if tok.device != h.device:
        raise InputError(f"tokens is on {tok.device} but hidden is on {h.device}")
    return h, w, b, tok, trunc, cap


def fused_run(hidden: object, weight: object, tokens: object, o: FusedOptions) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(logp, entropy)`` shaped like ``tokens``."""
    split: VocabSplit | None = None
    group = o["vocab_group"]
    if group is None:
        h, w, b, tok, trunc, cap = _prepare(hidden, weight, tokens, o, None)
    else:
        keys = ("temperature", "backend", "keep_logits", "softcap")
        agreed = {"hidden": hidden, "tokens": tokens} | {k: o[k] for k in keys}  # type: ignore[literal-required]
        (h, w, b, tok, trunc, cap), split = split_vocab(group, weight, agreed, lambda v: _prepare(hidden, weight, tokens, o, v))  # fmt: skip
    rows_shape, vocab = h.shape[:-1], w.shape[0]
    flat, ids = h.reshape(-1, h.shape[-1]), tok.reshape(-1).to(torch.int64)
    keep = o["keep_logits"]
    path = resolve(
        o["backend"], h.device, o["chunk_size"], keep, None if split is None else "vocab_group"
    )
    if split is not None and trunc is not None:
        raise InputError(
            "top_k, top_p and min_p need whole rows; with vocab_group the rows are split across "
            "ranks: leave them off"
        )
    if path != "chunked":
        rm = RowMath(float(o["temperature"]), cap)
        tp = two_pass_spec(path, rm, trunc, keep, flat, vocab, split)  # type: ignore[arg-type]
        logp, entropy = TwoPassLogpEntropy.apply(flat, w, b, ids, tp)  # type: ignore[no-untyped-call]
        return logp.view(rows_shape), entropy.view(rows_shape)
    chunk = auto_chunk(o["chunk_size"], vocab, h.device, DEFAULT_FUSED_CHUNK_ELEMENTS)
    logp, entropy = FusedLinearLogpEntropy.apply(  # type: ignore[no-untyped-call]
        flat, w, b, ids, float(o["temperature"]), chunk, trunc, cap
    )
    return logp.view(rows_shape), entropy.view(rows_shape)
