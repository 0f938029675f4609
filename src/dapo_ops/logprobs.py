r"""Token log-probs and entropy without the ``[tokens, vocab]`` float32 copies.

The policy loss needs, for every response token, :math:`\log\pi(y_t)` and often the
entropy :math:`H_t` of the next-token distribution. The usual code
(``logits.float().log_softmax(-1).gather(...)``, ``-(p * logp).sum(-1)``) materialises
several ``[tokens, vocab]`` float32 tensors on top of the logits, and autograd keeps them
for the backward pass. The functions here work on blocks of at most ``chunk_size`` rows:

- :func:`token_logprobs`, :func:`token_entropy`, :func:`token_logprobs_and_entropy` take
  the logits; they save only a reference to them (plus the log-sum-exp and the entropy,
  one float each per row, when the entropy is computed) and recompute the softmax in
  backward, a few rows at a time, inside the gradient buffer itself: beyond the gradient,
  backward needs one small piece of scratch, not a block.
  ``inplace_backward=True`` writes the gradient into the logits buffer itself.
- :func:`fused_logprobs_entropy` takes the last hidden states and the output projection:
  the logits exist one block at a time, in forward and in backward.

Softmax math runs in float32 per block (float64 for float64 input); outputs are float32
(float64); gradients come back in the input dtype. The derivation and the memory
accounting are in ``docs/logprobs.md``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from jaxtyping import Float, Integer
from torch import Tensor
from torch.autograd.function import FunctionCtx

from dapo_ops._validate import InputError, check_float, check_tensor, is_compiling, shape_str

#: Default block sizes, in logits *elements* per block (``chunk_size=None`` means
#: ``max(1, elements // vocab)`` rows). On CPU, 2**22 elements (16 MiB of float32; 27 rows
#: at vocab 152064): small enough to stay in cache between the passes over a block, large
#: enough that the per-op thread synchronisation stays negligible; on GPUs, 2**24 elements
#: keep kernel launches from dominating.
DEFAULT_CHUNK_ELEMENTS = {"cpu": 2**22, "other": 2**24}

#: Same for :func:`fused_logprobs_entropy`, larger so that each block's matmuls stay
#: efficient and the weight gradient is accumulated over few blocks: 2**25 elements
#: (220 rows at vocab 152064) on CPU, 2**27 (882 rows) on GPUs.
DEFAULT_FUSED_CHUNK_ELEMENTS = {"cpu": 2**25, "other": 2**27}

#: ``log p`` is floored here before ``p * log p`` is formed. ``exp`` of anything below it
#: is exactly 0 in float32 and float64, so no result changes; it only turns the
#: ``0 * (-inf)`` of a ``-inf`` logit (a masked vocabulary entry) into ``0 * finite``.
LOGP_FLOOR = -1.0e4

#: Backward works on *pieces* of ``max(1, elements // vocab)`` rows inside each block and
#: keeps its working memory in the gradient buffer: the only temporary is one piece's
#: probabilities (with entropy) plus, for bfloat16/float16 logits, the piece upcast to
#: float32. On CPU, 2**16 elements (256 KiB of float32; one row when a row is longer):
#: small next to any logits worth chunking, still large enough for each op to run on two
#: threads (ATen splits elementwise ops into grains of 2**15 elements). On GPUs, 2**22
#: (16 MiB), so that kernel launches do not dominate.
BACKWARD_PIECE_ELEMENTS = {"cpu": 2**16, "other": 2**22}


class LogpEntropy(NamedTuple):
    """Per-token log-prob of the chosen token and entropy of the distribution (nats)."""

    logp: Float[Tensor, " tokens"] | Float[Tensor, "batch seq"]
    entropy: Float[Tensor, " tokens"] | Float[Tensor, "batch seq"]


# --------------------------------------------------------------------------- checks


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_options(temperature: float, chunk_size: int | None) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise InputError(f"temperature must be a float > 0, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise InputError(f"temperature must be a finite number > 0, got {temperature}")
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
            raise InputError(f"chunk_size must be an int >= 1 or None, got {chunk_size!r}")
        if chunk_size < 1:
            raise InputError(f"chunk_size must be >= 1 (or None for the default), got {chunk_size}")


def _check_float_tensor(name: str, t: object) -> Tensor:
    check_float(name, t)  # type: ignore[arg-type]
    assert isinstance(t, Tensor)
    return t


def _check_tokens(tokens: object, rows_shape: torch.Size, ref: str, vocab: int) -> Tensor:
    """Dtype and shape of ``tokens``, then the id range (one host sync, eager only)."""
    check_tensor("tokens", tokens)
    assert isinstance(tokens, Tensor)
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise InputError(f"tokens must be an integer tensor of token ids, got {tokens.dtype}")
    if tokens.shape != rows_shape:
        want = "[" + ", ".join(str(s) for s in rows_shape) + "]"
        raise InputError(
            f"tokens must have shape {want} ({ref} without its last dim), got {shape_str(tokens)}"
        )
    if is_compiling() or tokens.numel() == 0:
        return tokens
    lo_hi = torch.stack(torch.aminmax(tokens)).tolist()  # value check: one host sync
    if lo_hi[0] < 0 or lo_hi[1] >= vocab:
        raise InputError(
            f"tokens must hold ids in [0, vocab) = [0, {vocab}); got values in "
            f"[{lo_hi[0]}, {lo_hi[1]}] (replace ignore labels such as -100 by any valid id "
            "and mask those positions in the loss)"
        )
    return tokens


def _check_logits(logits: object) -> Tensor:
    t = _check_float_tensor("logits", logits)
    if t.ndim not in (2, 3):
        raise InputError(
            f"logits must have shape [tokens, vocab] or [batch, seq, vocab], got {shape_str(t)}"
        )
    if t.shape[-1] < 1:
        raise InputError(f"logits must have a vocab dimension >= 1, got {shape_str(t)}")
    return t


def _auto_chunk(
    chunk_size: int | None, vocab: int, device: torch.device, elements: dict[str, int]
) -> int:
    if chunk_size is not None:
        return chunk_size
    return max(1, elements["cpu" if device.type == "cpu" else "other"] // vocab)


# --------------------------------------------------------------------------- blocks


def _flattens(x: Tensor) -> bool:
    """Whether ``x`` ([rows, vocab] or [batch, seq, vocab]) views as [rows, vocab] without a copy."""
    if x.ndim == 2:
        return True
    batch, seq, _ = x.shape
    return batch == 1 or seq == 1 or x.stride(0) == seq * x.stride(1)


def _blocks(x: Tensor, chunk: int) -> list[tuple[int, int, Tensor]]:
    """``(start, stop, view)`` for consecutive blocks of at most ``chunk`` rows, no copy.

    Rows are numbered in row-major order over the leading dims. A [batch, seq, vocab]
    tensor whose leading dims cannot be merged into one view (e.g. ``logits[:, :-1]``) is
    split per sequence, so that each block is still a view.
    """
    vocab = x.shape[-1]
    if _flattens(x):
        flat = x.view(-1, vocab)
        rows = flat.shape[0]
        return [(s, min(s + chunk, rows), flat[s : s + chunk]) for s in range(0, rows, chunk)]
    batch, seq, _ = x.shape
    out = []
    for b in range(batch):
        for s in range(0, seq, chunk):
            stop = min(s + chunk, seq)
            out.append((b * seq + s, b * seq + stop, x[b, s:stop]))
    return out


# --------------------------------------------------------------------------- block math


def _scaled(z: Tensor, owned: bool, temperature: float, cdt: torch.dtype) -> tuple[Tensor, bool]:
    """``z / temperature`` in ``cdt``; ``owned`` says whether the result may be overwritten."""
    if z.dtype != cdt:
        z, owned = z.to(cdt), True
    if temperature != 1.0:
        z = z.div_(temperature) if owned else z / temperature
        owned = True
    return z, owned


def _block_forward(
    z: Tensor,
    owned: bool,
    tok: Tensor | None,
    temperature: float,
    cdt: torch.dtype,
    want_entropy: bool,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(lse, logp, entropy)`` of one [rows, vocab] block; lse/entropy only with entropy."""
    zf, owned = _scaled(z, owned, temperature, cdt)
    del z  # a low-precision block is freed once upcast
    if not want_entropy:  # log-probs only: one fused log_softmax pass, no lse needed later
        assert tok is not None
        return None, torch.log_softmax(zf, dim=1).gather(1, tok.unsqueeze(1)).squeeze(1), None
    picked = zf.gather(1, tok.unsqueeze(1)).squeeze(1) if tok is not None else None
    top = zf.amax(dim=1, keepdim=True)
    shifted = zf.sub_(top) if owned else zf - top  # z - max <= 0
    shifted.clamp_(min=LOGP_FLOOR)
    e = torch.exp(shifted)
    sum_e = e.sum(dim=1)
    dot = e.mul_(shifted).sum(dim=1)  # sum_v e_v (z_v - max)
    log_sum = torch.log(sum_e)
    lse = top.squeeze(1) + log_sum
    entropy = log_sum - dot / sum_e  # H = lse - sum p z, shifted by max
    return lse, (None if picked is None else picked - lse), entropy


class _RowCoefs(NamedTuple):
    r"""Per-row factors of one row's gradient, as ``[rows, 1]`` columns.

    With :math:`a = g^{\log p}/T` and :math:`b = g^{H}/T`,
    :math:`\partial L/\partial x_v = p_v\,(\beta \log p_v + c) + a\,\delta_{v,y}` where
    :math:`\beta = -b` and :math:`c = -(b H + a)`. ``a`` is None without a log-prob
    gradient, ``neg_b`` None without an entropy gradient (then :math:`c = -a`).
    """

    a: Tensor | None
    neg_b: Tensor | None
    c: Tensor


def _coef_rows(coefs: _RowCoefs, start: int, stop: int) -> _RowCoefs:
    """The factors of rows ``start:stop``."""
    a = None if coefs.a is None else coefs.a[start:stop]
    neg_b = None if coefs.neg_b is None else coefs.neg_b[start:stop]
    return _RowCoefs(a, neg_b, coefs.c[start:stop])


def _row_coefs(
    grad_logp: Tensor | None,
    grad_entropy: Tensor | None,
    entropy: Tensor,
    temperature: float,
    cdt: torch.dtype,
) -> _RowCoefs:
    """:class:`_RowCoefs` from the upstream gradients (at least one is not None)."""
    a = None if grad_logp is None else (grad_logp.reshape(-1, 1).to(cdt) / temperature)
    if grad_entropy is None:
        assert a is not None
        return _RowCoefs(a, None, -a)
    neg_b = grad_entropy.reshape(-1, 1).to(cdt) / -temperature
    c = neg_b * entropy.unsqueeze(1)
    return _RowCoefs(a, neg_b, c if a is None else c.sub_(a))


def _sub_into(dst: Tensor, src: Tensor, x: Tensor) -> Tensor:
    """``src - x`` written into ``dst``; in place when ``src is dst`` (the only form compiled)."""
    return dst.sub_(x) if src is dst else torch.sub(src, x, out=dst)


def _div_into(dst: Tensor, src: Tensor, x: float) -> Tensor:
    """``src / x`` written into ``dst``; in place when ``src is dst``."""
    return dst.div_(x) if src is dst else torch.div(src, x, out=dst)


def _piece_grad(
    dst: Tensor,
    src: Tensor,
    tok: Tensor | None,
    lse: Tensor | None,
    coefs: _RowCoefs,
    temperature: float,
) -> None:
    r"""Gradient w.r.t. the raw logits ``src`` of a few rows, written into ``dst``.

    ``dst`` has the compute dtype and may be ``src`` itself (every step is elementwise or
    a row reduction that is read before the row is overwritten). With :math:`z = x/T`:

    - log-probs only: :math:`p = e^{z - m} / \sum_v e^{z_v - m}` formed in ``dst``
      (:math:`m` the row max), then :math:`p \cdot c`;
    - with entropy: :math:`\log p = \max(z - \ell, -10^4)` formed in ``dst``,
      :math:`p = e^{\log p}` in the one temporary, then
      :math:`p\,(\beta \log p + c)` in ``dst``;

    then :math:`a` is added at the chosen token. No temporary but ``p``, of ``dst``'s size.
    """
    if temperature != 1.0:
        src = _div_into(dst, src, temperature)
    if coefs.neg_b is None:  # softmax in place: no log-sum-exp needed
        _sub_into(dst, src, src.amax(dim=1, keepdim=True)).exp_()
        dst.mul_(coefs.c / dst.sum(dim=1, keepdim=True))
    else:
        assert lse is not None
        _sub_into(dst, src, lse).clamp_(min=LOGP_FLOOR)  # log p
        prob = torch.exp(dst)
        dst.mul_(coefs.neg_b).add_(coefs.c).mul_(prob)
    if coefs.a is not None:
        assert tok is not None
        dst.scatter_add_(1, tok, coefs.a)


def _piece_rows(z: Tensor) -> int:
    """Rows per backward piece of block ``z``; the whole block under ``torch.compile``."""
    if is_compiling():  # one piece per block: fewer graph nodes
        return z.shape[0]
    return _auto_chunk(None, z.shape[1], z.device, BACKWARD_PIECE_ELEMENTS)


def _block_grad(
    z: Tensor,
    out: Tensor,
    tok: Tensor | None,
    lse: Tensor | None,
    coefs: _RowCoefs,
    temperature: float,
    cdt: torch.dtype,
) -> None:
    """Write the gradient w.r.t. the raw logits ``z`` of one block into ``out``.

    ``out`` (the block's slice of the gradient buffer, or ``z`` itself to overwrite the
    logits) is the working memory: when it has the compute dtype every piece is computed
    in it directly and the only temporary is one piece's ``p``. Otherwise (bfloat16/float16
    gradients, or under ``torch.compile``, which gets no ``out=`` into views) each piece
    is upcast into a float32 temporary, computed there and copied into ``out``.
    ``tok``, ``lse`` and ``coefs`` are the block's rows, as ``[rows, 1]`` columns.
    """
    rows = z.shape[0]
    direct = out.dtype == cdt and (out is z or not is_compiling())
    step = _piece_rows(z)
    for s in range(0, rows, step):
        if step >= rows:  # one piece: the tensors themselves, no slicing (the compiled form)
            zp, op, tp, lp, cp = z, out, tok, lse, coefs
        else:
            zp, op, cp = z[s : s + step], out[s : s + step], _coef_rows(coefs, s, s + step)
            tp = None if tok is None else tok[s : s + step]
            lp = None if lse is None else lse[s : s + step]
        if direct:
            _piece_grad(op, zp, tp, lp, cp, temperature)
        else:
            buf = zp.to(cdt, copy=True)
            _piece_grad(buf, buf, tp, lp, cp, temperature)
            op.copy_(buf)
            del buf  # before the next piece's is allocated


# --------------------------------------------------------------------------- double backward


def _grad_with_graph(
    z: Tensor,
    tok: Tensor | None,
    grad_logp: Tensor | None,
    grad_entropy: Tensor | None,
    temperature: float,
    cdt: torch.dtype,
) -> Tensor:
    r"""``dL/dz`` of ``[rows, vocab]`` logits ``z``, built from differentiable ops.

    The formula of :class:`_RowCoefs`,
    :math:`\frac1T\big(g^{\log p}(\mathrm{onehot}(y) - p) - g^{H} p (\log p + H)\big)`,
    on the whole ``[rows, vocab]`` at once: used only under ``create_graph=True``, where
    autograd must record how the gradient depends on ``z`` (and on the upstream
    gradients) for a second differentiation. Returns the compute dtype ``cdt``.
    """
    logp_all = torch.log_softmax(z.to(cdt) / temperature, dim=-1)
    prob = logp_all.exp()
    grad = torch.zeros_like(prob)
    if grad_logp is not None:
        assert tok is not None
        onehot = torch.zeros_like(prob).scatter(1, tok.unsqueeze(1), 1.0)
        grad = grad + grad_logp.reshape(-1, 1).to(cdt) * (onehot - prob)
    if grad_entropy is not None:
        log_p = logp_all.clamp(min=LOGP_FLOOR)  # a -inf logit: 0 * finite, as in forward
        entropy = -(prob * log_p).sum(dim=-1, keepdim=True)
        grad = grad - grad_entropy.reshape(-1, 1).to(cdt) * prob * (log_p + entropy)
    return grad / temperature


def _may_overlap(t: Tensor) -> bool:
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


# --------------------------------------------------------------------------- from logits


class _LogitsLogpEntropy(torch.autograd.Function):
    """(logp, entropy) from logits, one block of rows at a time; see token_logprobs."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        logits: Tensor,
        tokens: Tensor | None,
        temperature: float,
        chunk: int,
        want_entropy: bool,
        inplace: bool,
    ) -> tuple[Tensor, Tensor]:
        cdt = _compute_dtype(logits.dtype)
        rows = logits.numel() // logits.shape[-1]
        # lse and entropy feed the entropy gradient only; log-probs alone need neither
        lse = logits.new_empty(rows if want_entropy else 0, dtype=cdt)
        logp = logits.new_empty(rows if tokens is not None else 0, dtype=cdt)
        entropy = logits.new_empty(rows if want_entropy else 0, dtype=cdt)
        for start, stop, block in _blocks(logits, chunk):
            tok = None if tokens is None else tokens[start:stop]
            b_lse, b_logp, b_ent = _block_forward(block, False, tok, temperature, cdt, want_entropy)
            if b_lse is not None:
                lse[start:stop] = b_lse
            if b_logp is not None:
                logp[start:stop] = b_logp
            if b_ent is not None:
                entropy[start:stop] = b_ent
        ctx.save_for_backward(logits, tokens, lse, entropy)  # type: ignore[arg-type]
        ctx.temperature = temperature  # type: ignore[attr-defined]
        ctx.chunk = chunk  # type: ignore[attr-defined]
        ctx.inplace = inplace  # type: ignore[attr-defined]
        ctx.want_entropy = want_entropy  # type: ignore[attr-defined]
        ctx.set_materialize_grads(False)
        if tokens is None:
            ctx.mark_non_differentiable(logp)
        if not want_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logp: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        logits, tokens, lse, entropy = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return (None,) * 6
        if tokens is None:
            grad_logp = None
        if not ctx.want_entropy:
            grad_entropy = None
        if grad_logp is None and grad_entropy is None:
            return (None,) * 6
        if torch.is_grad_enabled():  # create_graph=True: a gradient autograd can differentiate
            vocab = logits.shape[-1]
            grad = _grad_with_graph(
                logits.reshape(-1, vocab),
                tokens,
                grad_logp,
                grad_entropy,
                ctx.temperature,
                lse.dtype,
            )
            return grad.to(logits.dtype).reshape(logits.shape), None, None, None, None, None
        with torch.no_grad():
            return _LogitsLogpEntropy._chunked_backward(
                ctx, logits, tokens, lse, entropy, grad_logp, grad_entropy
            )

    @staticmethod
    def _chunked_backward(
        ctx: Any,
        logits: Tensor,
        tokens: Tensor | None,
        lse: Tensor,
        entropy: Tensor,
        grad_logp: Tensor | None,
        grad_entropy: Tensor | None,
    ) -> tuple[Tensor | None, ...]:
        coefs = _row_coefs(grad_logp, grad_entropy, entropy, ctx.temperature, lse.dtype)
        tok_col = None if tokens is None else tokens.unsqueeze(1)
        lse_col = lse.unsqueeze(1) if coefs.neg_b is not None else None
        # In place: each piece is read (recomputed) before its gradient overwrites it, and
        # pieces do not overlap, so the buffer can hold the gradient.
        if ctx.inplace:
            grad = logits
        else:
            grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
            flat_grad = grad.view(-1, logits.shape[-1])
        for start, stop, block in _blocks(logits, ctx.chunk):
            _block_grad(
                block,
                block if ctx.inplace else flat_grad[start:stop],
                None if tok_col is None else tok_col[start:stop],
                None if lse_col is None else lse_col[start:stop],
                _coef_rows(coefs, start, stop),
                ctx.temperature,
                lse.dtype,
            )
        return grad, None, None, None, None, None


def _from_logits(
    logits: Tensor,
    tokens: Tensor | None,
    temperature: float,
    chunk_size: int | None,
    want_entropy: bool,
    inplace_backward: bool,
) -> tuple[Tensor, Tensor]:
    logits = _check_logits(logits)
    _check_options(temperature, chunk_size)
    if not isinstance(inplace_backward, bool):
        raise InputError(f"inplace_backward must be a bool, got {inplace_backward!r}")
    if inplace_backward and _may_overlap(logits):
        raise InputError(
            f"inplace_backward=True needs logits whose elements each have their own memory, "
            f"got a view with strides {tuple(logits.stride())} for shape {shape_str(logits)} "
            "(an expand()-ed tensor): its gradient cannot be written into it. Pass "
            "inplace_backward=False, or logits.contiguous()"
        )
    vocab = logits.shape[-1]
    rows_shape = logits.shape[:-1]
    flat_tokens = None
    if tokens is not None:
        tokens = _check_tokens(tokens, rows_shape, f"logits {shape_str(logits)}", vocab)
        if tokens.device != logits.device:
            raise InputError(
                f"tokens is on {tokens.device} but logits is on {logits.device}; "
                "they must be on the same device"
            )
        flat_tokens = tokens.reshape(-1).to(torch.int64)
    chunk = _auto_chunk(chunk_size, vocab, logits.device, DEFAULT_CHUNK_ELEMENTS)
    logp, entropy = _LogitsLogpEntropy.apply(  # type: ignore[no-untyped-call]
        logits, flat_tokens, float(temperature), chunk, want_entropy, inplace_backward
    )
    return logp.view(rows_shape) if tokens is not None else logp, (
        entropy.view(rows_shape) if want_entropy else entropy
    )


def token_logprobs(
    logits: Float[Tensor, "tokens vocab"] | Float[Tensor, "batch seq vocab"],
    tokens: Integer[Tensor, " tokens"] | Integer[Tensor, "batch seq"],
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    inplace_backward: bool = False,
) -> Float[Tensor, " tokens"] | Float[Tensor, "batch seq"]:
    r"""Log-probability of each chosen token, computed block by block over rows.

    .. math::

        \log\pi(y_t) = \frac{z_{t,y_t}}{T} - \log\sum_v \exp\frac{z_{t,v}}{T}

    Same values as ``torch.log_softmax(logits.float() / T, -1).gather(-1, tokens[..., None])``
    without the full float32 copy or the full log-softmax: each block of ``chunk_size``
    rows is upcast, passed through one fused ``log_softmax``, gathered and dropped.
    Autograd keeps only a reference to ``logits``; backward recomputes each block's
    softmax and writes
    ``dlogp/dz = (onehot(y) - softmax(z/T)) / T`` into a gradient buffer in the logits'
    dtype (exact, no approximation).

    Shapes: logits ``[tokens, vocab]`` or ``[batch, seq, vocab]`` (views such as
    ``logits[:, :-1]`` are fine: a 3-D view whose leading dims do not merge is walked per
    sequence, never copied); tokens ``[tokens]`` or ``[batch, seq]``, any integer dtype,
    ids in ``[0, vocab)``. Returns ``[tokens]`` or ``[batch, seq]``, float32 (float64 for
    float64 logits), on the logits' device. Feed ``[batch, seq]`` log-probs straight into
    :func:`token_level_loss`.

    Options:
        temperature: the sampling temperature ``T > 0``; the logits are divided by it
            (as the rollout engine did), default 1.
        chunk_size: rows per block; ``None`` (default) picks ``max(1, E // vocab)``
            rows with ``E = 2**22`` logits elements on CPU (16 MiB float32 blocks, 27
            rows at vocab 152064) and ``2**24`` on GPUs (fewer, larger kernels).
        inplace_backward: opt in to writing the gradient *into the logits buffer*
            instead of a new one, saving one logits-sized allocation. The logits tensor
            is overwritten by its gradient during ``backward()``: do not read or reuse
            it afterwards, and do not pass it to another differentiable op whose backward
            runs later (autograd then raises "modified by an inplace operation"). To get
            both log-probs and entropy this way use :func:`token_logprobs_and_entropy`.
            Logits whose elements share memory (an ``expand()``-ed view) are refused at
            call time (``InputError``): they cannot hold their own gradient.

    Double backward: under ``create_graph=True`` the gradient is formed with ordinary
    differentiable ops over all rows at once (the naive path's memory), so it can be
    differentiated again, exactly; ``inplace_backward`` is then not applied. Modifying
    ``logits`` or ``tokens`` in place between forward and backward raises autograd's
    "modified by an inplace operation" error (they are saved with ``save_for_backward``).

    Token ids are range-checked with one host sync (skipped under ``torch.compile``),
    because an out-of-range id would otherwise crash ``gather`` (a device-side assert on
    CUDA). Replace ignore labels such as ``-100`` by any valid id and mask them in the loss.

    Example:
        >>> logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
        >>> token_logprobs(logits, torch.tensor([0, 2]))
        tensor([-0.2395, -1.0986])
    """
    logp, _ = _from_logits(logits, tokens, temperature, chunk_size, False, inplace_backward)
    return logp


def token_entropy(
    logits: Float[Tensor, "tokens vocab"] | Float[Tensor, "batch seq vocab"],
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> Float[Tensor, " tokens"] | Float[Tensor, "batch seq"]:
    r"""Entropy (nats) of each row's softmax distribution, computed block by block over rows.

    .. math::

        H_t = -\sum_v p_{t,v}\log p_{t,v} = \mathrm{lse}_t - \sum_v p_{t,v}\,z_{t,v}/T,
        \qquad p_t = \mathrm{softmax}(z_t / T)

    Same values as ``-(p * log_softmax(logits.float() / T)).sum(-1)``, in float32 per
    block. ``-inf`` logits (masked vocabulary entries) contribute 0. The gradient
    ``dH/dz = -p (log p + H) / T`` is recomputed per block in backward from the saved
    per-row log-sum-exp and entropy.

    Shapes: logits ``[tokens, vocab]`` or ``[batch, seq, vocab]``. Returns ``[tokens]`` or
    ``[batch, seq]``, float32 (float64 for float64 logits); ``0 <= H <= log(vocab)``.
    ``temperature`` and ``chunk_size`` as in :func:`token_logprobs`. When the loss also
    needs log-probs, :func:`token_logprobs_and_entropy` gets both in one pass.

    Example:
        >>> token_entropy(torch.zeros(2, 4))  # uniform over 4: log 4
        tensor([1.3863, 1.3863])
    """
    _, entropy = _from_logits(logits, None, temperature, chunk_size, True, False)
    return entropy


def token_logprobs_and_entropy(
    logits: Float[Tensor, "tokens vocab"] | Float[Tensor, "batch seq vocab"],
    tokens: Integer[Tensor, " tokens"] | Integer[Tensor, "batch seq"],
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    inplace_backward: bool = False,
) -> LogpEntropy:
    r"""Chosen-token log-probs and entropies in one pass over the logits.

    ``(token_logprobs(...), token_entropy(...))`` but each block is read once in forward
    and once in backward, and gradients from both outputs are summed per block:

    .. math::

        \frac{\partial L}{\partial z_{t,v}} = \frac{1}{T}\Big(
            g^{\log p}_t\,(\delta_{v,y_t} - p_{t,v})
            - g^{H}_t\,p_{t,v}\,(\log p_{t,v} + H_t)\Big)

    This is the call for an RL loss that uses both (e.g. an entropy bonus, or entropy
    logged for clip diagnostics), and the only safe one with ``inplace_backward=True``:
    two separate calls on the same logits would each want to own the buffer.

    Shapes, dtypes and options as in :func:`token_logprobs`. Returns
    ``LogpEntropy(logp, entropy)``, a named tuple of two ``[tokens]`` or ``[batch, seq]``
    float32 tensors.

    Example:
        >>> logits = torch.tensor([[2.0, 0.0, 0.0]])
        >>> token_logprobs_and_entropy(logits, torch.tensor([0]))
        LogpEntropy(logp=tensor([-0.2395]), entropy=tensor([0.6656]))
    """
    logp, entropy = _from_logits(logits, tokens, temperature, chunk_size, True, inplace_backward)
    return LogpEntropy(logp, entropy)


# --------------------------------------------------------------------------- fused


def _linear(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return h @ weight.T if bias is None else torch.addmm(bias, h, weight.T)


class _FusedLinearLogpEntropy(torch.autograd.Function):
    """(logp, entropy) from hidden states and the output projection, block by block."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        tokens: Tensor,
        temperature: float,
        chunk: int,
    ) -> tuple[Tensor, Tensor]:
        cdt = _compute_dtype(hidden.dtype)
        rows = hidden.shape[0]
        lse = hidden.new_empty(rows, dtype=cdt)
        logp = hidden.new_empty(rows, dtype=cdt)
        entropy = hidden.new_empty(rows, dtype=cdt)
        for start in range(0, rows, chunk):
            stop = min(start + chunk, rows)
            b_lse, b_logp, b_ent = _block_forward(
                _linear(hidden[start:stop], weight, bias),  # no other reference: freed early
                True,
                tokens[start:stop],
                temperature,
                cdt,
                True,
            )
            assert b_lse is not None and b_logp is not None and b_ent is not None
            lse[start:stop] = b_lse
            logp[start:stop] = b_logp
            entropy[start:stop] = b_ent
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, entropy)  # type: ignore[arg-type]
        ctx.temperature = temperature  # type: ignore[attr-defined]
        ctx.chunk = chunk  # type: ignore[attr-defined]
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logp: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, tokens, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if not (need_h or need_w or need_b) or (grad_logp is None and grad_entropy is None):
            return (None,) * 6
        cdt = lse.dtype
        if torch.is_grad_enabled():  # create_graph=True: a gradient autograd can differentiate
            g = _grad_with_graph(
                _linear(hidden, weight, bias), tokens, grad_logp, grad_entropy, ctx.temperature, cdt
            )
            dtype = hidden.dtype
            return (
                (g.to(dtype) @ weight) if need_h else None,
                (g.T @ hidden.to(cdt)).to(dtype) if need_w else None,
                g.sum(dim=0).to(dtype) if need_b else None,
                None,
                None,
                None,
            )
        with torch.no_grad():
            return _FusedLinearLogpEntropy._chunked_backward(
                ctx, hidden, weight, bias, tokens, lse, entropy, grad_logp, grad_entropy
            )

    @staticmethod
    def _chunked_backward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        tokens: Tensor,
        lse: Tensor,
        entropy: Tensor,
        grad_logp: Tensor | None,
        grad_entropy: Tensor | None,
    ) -> tuple[Tensor | None, ...]:
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        cdt = lse.dtype
        coefs = _row_coefs(grad_logp, grad_entropy, entropy, ctx.temperature, cdt)
        tok_col, lse_col = tokens.unsqueeze(1), lse.unsqueeze(1)
        dtype = hidden.dtype
        grad_h = torch.empty_like(hidden) if need_h else None
        # Weight and bias gradients sum over blocks: accumulate in float32 (float64).
        grad_w = torch.zeros(weight.shape, dtype=cdt, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=cdt, device=weight.device) if need_b else None
        rows = hidden.shape[0]
        for start in range(0, rows, ctx.chunk):
            stop = min(start + ctx.chunk, rows)
            h = hidden[start:stop]
            g = _linear(h, weight, bias)  # no other reference: overwritten by its gradient
            if g.dtype != cdt:
                g = g.to(cdt)
            _block_grad(
                g,
                g,
                tok_col[start:stop],
                lse_col[start:stop] if coefs.neg_b is not None else None,
                _coef_rows(coefs, start, stop),
                ctx.temperature,
                cdt,
            )
            if grad_b is not None:
                grad_b += g.sum(dim=0)
            g = g.to(dtype)  # the block's dL/dlogits, rounded once to the input dtype
            if grad_h is not None:
                grad_h[start:stop] = g @ weight
            if grad_w is not None:
                if dtype == cdt:
                    grad_w.addmm_(g.T, h)
                else:  # matmul in the input dtype (tensor cores), summed over blocks in fp32
                    grad_w += g.T @ h
            del g  # before the next block is allocated
        return (
            grad_h,
            None if grad_w is None else grad_w.to(dtype),
            None if grad_b is None else grad_b.to(dtype),
            None,
            None,
            None,
        )


def fused_logprobs_entropy(
    hidden: Float[Tensor, "tokens d"] | Float[Tensor, "batch seq d"],
    weight: Float[Tensor, "vocab d"],
    tokens: Integer[Tensor, " tokens"] | Integer[Tensor, "batch seq"],
    *,
    bias: Float[Tensor, " vocab"] | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> LogpEntropy:
    r"""Log-probs and entropies straight from hidden states: the logits never exist whole.

    For each block of ``chunk_size`` rows: ``z = hidden @ weight.T (+ bias)`` in the input
    dtype, then in float32 :math:`\log\pi(y_t) = z_{t,y_t}/T - \mathrm{lse}_t` and
    :math:`H_t = \mathrm{lse}_t - \sum_v p_{t,v} z_{t,v}/T`. Only the per-row
    log-sum-exp and entropy are kept for backward, which recomputes each block's logits
    and forms

    .. math::

        G = \frac{1}{T}\big(g^{\log p}(\mathrm{onehot}(y) - p) - g^{H} p (\log p + H)\big),
        \quad \partial_{hidden} = G\,W,\quad \partial_W = \sum_{blocks} G^\top h,
        \quad \partial_b = \sum_{blocks} G^\top \mathbf{1}

    so peak memory is one block's ``[chunk, vocab]`` temporaries instead of several
    ``[tokens, vocab]`` float32 tensors, at the price of one extra ``hidden @ weight.T``
    in backward (4 matmuls instead of 3). Gradients are exact and reach both outputs.

    Shapes: hidden ``[tokens, d]`` or ``[batch, seq, d]``; weight ``[vocab, d]`` (the
    ``lm_head.weight``); tokens ``[tokens]`` or ``[batch, seq]`` with ids in
    ``[0, vocab)`` (checked with one host sync, as in :func:`token_logprobs`); bias
    ``[vocab]`` or None. hidden, weight and bias share one floating dtype and device.
    Returns ``LogpEntropy(logp, entropy)``, float32 (float64 for float64 input), shaped
    like ``tokens``; gradients come back in the input dtype, the weight and bias ones
    accumulated over blocks in float32 first.

    Options:
        temperature: logits are divided by ``T > 0`` (default 1).
        chunk_size: rows per block; ``None`` picks ``max(1, E // vocab)`` rows with
            ``E = 2**25`` on CPU (220 rows at vocab 152064) and ``2**27`` on GPUs (882
            rows): large enough for efficient matmuls and few weight-gradient
            accumulations. Smaller blocks lower peak memory and cost matmul efficiency.

    Double backward (``create_graph=True``) is supported as in :func:`token_logprobs`:
    the gradient is then formed from the whole ``hidden @ weight.T`` with differentiable
    ops. hidden, weight and bias are saved with ``save_for_backward``: modifying one in
    place before backward raises instead of giving a different gradient.

    Example:
        >>> hidden, weight = torch.randn(6, 8), torch.randn(32, 8)
        >>> tokens = torch.randint(0, 32, (6,))
        >>> logp, entropy = fused_logprobs_entropy(hidden, weight, tokens, chunk_size=4)
        >>> ref = torch.log_softmax(hidden @ weight.T, -1).gather(-1, tokens[:, None])
        >>> torch.allclose(logp, ref.squeeze(-1), atol=1e-5)
        True
    """
    hidden = _check_float_tensor("hidden", hidden)
    weight = _check_float_tensor("weight", weight)
    if hidden.ndim not in (2, 3):
        raise InputError(
            f"hidden must have shape [tokens, d] or [batch, seq, d], got {shape_str(hidden)}"
        )
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] < 1:
        raise InputError(
            f"weight must have shape [vocab, d] with d = hidden's last dim "
            f"({hidden.shape[-1]}) and vocab >= 1, got {shape_str(weight)}"
        )
    vocab = weight.shape[0]
    tensors = [("weight", weight)]
    if bias is not None:
        bias = _check_float_tensor("bias", bias)
        if bias.shape != (vocab,):
            raise InputError(f"bias must have shape [vocab] = [{vocab}], got {shape_str(bias)}")
        tensors.append(("bias", bias))
    for name, t in tensors:
        if t.dtype != hidden.dtype:
            raise InputError(f"{name} has dtype {t.dtype} but hidden has {hidden.dtype}")
        if t.device != hidden.device:
            raise InputError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    _check_options(temperature, chunk_size)
    rows_shape = hidden.shape[:-1]
    tokens = _check_tokens(tokens, rows_shape, f"hidden {shape_str(hidden)}", vocab)
    if tokens.device != hidden.device:
        raise InputError(f"tokens is on {tokens.device} but hidden is on {hidden.device}")
    chunk = _auto_chunk(chunk_size, vocab, hidden.device, DEFAULT_FUSED_CHUNK_ELEMENTS)
    logp, entropy = _FusedLinearLogpEntropy.apply(  # type: ignore[no-untyped-call]
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        tokens.reshape(-1).to(torch.int64),
        float(temperature),
        chunk,
    )
    return LogpEntropy(logp.view(rows_shape), entropy.view(rows_shape))
