r"""Block math of the from-logits path: softmax statistics and gradients, a few rows at a time.

Private; :mod:`dapo_ops.logprobs._logits_path` walks a logits tensor with these. Softmax math runs
in float32 per block (float64 for float64 input); the backward keeps its working memory in
the gradient buffer (see :func:`block_grad`). The derivation is in ``docs/logprobs.md``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from dapo_ops._core._validate import is_compiling
from dapo_ops.logprobs._logprob_checks import auto_chunk
from dapo_ops.logprobs._truncation import Truncation, truncate, truncated

#: Default block sizes, in logits *elements* per block (``chunk_size=None`` means
#: ``max(1, elements // vocab)`` rows). On CPU, 2**22 elements (16 MiB of float32; 27 rows
#: at vocab 152064): small enough to stay in cache between the passes over a block, large
#: enough that the per-op thread synchronisation stays negligible; on GPUs, 2**24 elements
#: keep kernel launches from dominating.
DEFAULT_CHUNK_ELEMENTS = {"cpu": 2**22, "other": 2**24}

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


# --------------------------------------------------------------------------- blocks


def flattens(x: Tensor) -> bool:
    """Whether ``x`` ([rows, vocab] or [batch, seq, vocab]) views as [rows, vocab] without a copy."""
    if x.ndim == 2:
        return True
    batch, seq, _ = x.shape
    return batch == 1 or seq == 1 or x.stride(0) == seq * x.stride(1)


def blocks(x: Tensor, chunk: int) -> list[tuple[int, int, Tensor]]:
    """``(start, stop, view)`` for consecutive blocks of at most ``chunk`` rows, no copy.

    Rows are numbered in row-major order over the leading dims. A [batch, seq, vocab]
    tensor whose leading dims cannot be merged into one view (e.g. ``logits[:, :-1]``) is
    split per sequence, so that each block is still a view.
    """
    vocab = x.shape[-1]
    if flattens(x):
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


def scaled(z: Tensor, owned: bool, temperature: float, cdt: torch.dtype) -> tuple[Tensor, bool]:
    """``z / temperature`` in ``cdt``; ``owned`` says whether the result may be overwritten."""
    if z.dtype != cdt:
        z, owned = z.to(cdt), True
    if temperature != 1.0:
        z = z.div_(temperature) if owned else z / temperature
        owned = True
    return z, owned


def block_forward(
    z: Tensor,
    owned: bool,
    tok: Tensor | None,
    temperature: float,
    cdt: torch.dtype,
    want_entropy: bool,
    trunc: Truncation | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """``(lse, logp, entropy, tau)`` of one [rows, vocab] block; lse/entropy only with
    entropy, ``tau`` (the kept set's per-row threshold) only with ``trunc``."""
    zf, owned = scaled(z, owned, temperature, cdt)
    del z  # a low-precision block is freed once upcast
    tau = None
    if trunc is not None:  # the logits outside the kept set (and the chosen token) -> -inf
        col = None if tok is None else tok.unsqueeze(1)
        zf, tau = truncated(zf, trunc, col, None, owned)
        owned = True
    if not want_entropy:  # log-probs only: one fused log_softmax pass, no lse needed later
        assert tok is not None
        logp = torch.log_softmax(zf, dim=1).gather(1, tok.unsqueeze(1)).squeeze(1)
        return None, logp, None, tau
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
    return lse, (None if picked is None else picked - lse), entropy, tau


class RowCoefs(NamedTuple):
    r"""Per-row factors of one row's gradient, as ``[rows, 1]`` columns.

    With :math:`a = g^{\log p}/T` and :math:`b = g^{H}/T`,
    :math:`\partial L/\partial x_v = p_v\,(\beta \log p_v + c) + a\,\delta_{v,y}` where
    :math:`\beta = -b` and :math:`c = -(b H + a)`. ``a`` is None without a log-prob
    gradient, ``neg_b`` None without an entropy gradient (then :math:`c = -a`).
    """

    a: Tensor | None
    neg_b: Tensor | None
    c: Tensor


def coef_rows(coefs: RowCoefs, start: int, stop: int) -> RowCoefs:
    """The factors of rows ``start:stop``."""
    a = None if coefs.a is None else coefs.a[start:stop]
    neg_b = None if coefs.neg_b is None else coefs.neg_b[start:stop]
    return RowCoefs(a, neg_b, coefs.c[start:stop])


def row_coefs(
    grad_logp: Tensor | None,
    grad_entropy: Tensor | None,
    entropy: Tensor,
    temperature: float,
    cdt: torch.dtype,
) -> RowCoefs:
    """:class:`RowCoefs` from the upstream gradients (at least one is not None)."""
    a = None if grad_logp is None else (grad_logp.reshape(-1, 1).to(cdt) / temperature)
    if grad_entropy is None:
        assert a is not None
        return RowCoefs(a, None, -a)
    neg_b = grad_entropy.reshape(-1, 1).to(cdt) / -temperature
    c = neg_b * entropy.unsqueeze(1)
    return RowCoefs(a, neg_b, c if a is None else c.sub_(a))


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
    coefs: RowCoefs,
    temperature: float,
    tau: Tensor | None = None,
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
    With ``tau`` (the saved thresholds, ``[rows]``), :math:`z` is first truncated to the
    same kept set as in forward (``-inf`` elsewhere: :math:`p = 0` there).
    """
    if temperature != 1.0:
        src = _div_into(dst, src, temperature)
    if tau is not None:
        if src is not dst:
            src = dst.copy_(src)
        truncate(dst, tau, tok, True)
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
    return auto_chunk(None, z.shape[1], z.device, BACKWARD_PIECE_ELEMENTS)


def block_grad(
    z: Tensor,
    out: Tensor,
    tok: Tensor | None,
    lse: Tensor | None,
    coefs: RowCoefs,
    temperature: float,
    cdt: torch.dtype,
    tau: Tensor | None = None,
) -> None:
    """Write the gradient w.r.t. the raw logits ``z`` of one block into ``out``.

    ``out`` (the block's slice of the gradient buffer, or ``z`` itself to overwrite the
    logits) is the working memory: when it has the compute dtype every piece is computed
    in it directly and the only temporary is one piece's ``p``. Otherwise (bfloat16/float16
    gradients, or under ``torch.compile``, which gets no ``out=`` into views) each piece
    is upcast into a float32 temporary, computed there and copied into ``out``.
    ``tok``, ``lse`` and ``coefs`` are the block's rows, as ``[rows, 1]`` columns;
    ``tau`` the block's truncation thresholds ``[rows]`` (None: no truncation).
    """
    rows = z.shape[0]
    direct = out.dtype == cdt and (out is z or not is_compiling())
    step = _piece_rows(z)
    for s in range(0, rows, step):
        if step >= rows:  # one piece: the tensors themselves, no slicing (the compiled form)
            zp, op, tp, lp, cp, kp = z, out, tok, lse, coefs, tau
        else:
            zp, op, cp = z[s : s + step], out[s : s + step], coef_rows(coefs, s, s + step)
            tp = None if tok is None else tok[s : s + step]
            lp = None if lse is None else lse[s : s + step]
            kp = None if tau is None else tau[s : s + step]
        if direct:
            _piece_grad(op, zp, tp, lp, cp, temperature, kp)
        else:
            buf = zp.to(cdt, copy=True)
            _piece_grad(buf, buf, tp, lp, cp, temperature, kp)
            op.copy_(buf)
            del buf  # before the next piece's is allocated


# --------------------------------------------------------------------------- double backward


def grad_with_graph(
    z: Tensor,
    tok: Tensor | None,
    grad_logp: Tensor | None,
    grad_entropy: Tensor | None,
    temperature: float,
    cdt: torch.dtype,
    tau: Tensor | None = None,
) -> Tensor:
    r"""``dL/dz`` of ``[rows, vocab]`` logits ``z``, built from differentiable ops.

    The formula of :class:`RowCoefs`,
    :math:`\frac1T\big(g^{\log p}(\mathrm{onehot}(y) - p) - g^{H} p (\log p + H)\big)`,
    on the whole ``[rows, vocab]`` at once: used only under ``create_graph=True``, where
    autograd must record how the gradient depends on ``z`` (and on the upstream
    gradients) for a second differentiation. Returns the compute dtype ``cdt``. With
    ``tau`` (the saved thresholds), :math:`p` is the truncated softmax of the forward.
    """
    zs = z.to(cdt) / temperature
    if tau is not None:
        zs = truncate(zs, tau, None if tok is None else tok.unsqueeze(1), False)
    logp_all = torch.log_softmax(zs, dim=-1)
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
