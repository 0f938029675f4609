r"""The fused output projection: log-probs, entropies and their gradients, chunk by chunk.

Private; shared by :func:`dapo_ops.fused_logprobs_entropy` (its autograd function in
:mod:`dapo_ops.logprobs._fused_logp_entropy`) and :func:`dapo_ops.linear_policy_loss`. For a chunk of
rows :math:`h` (``[n, d]``) of the hidden states, :class:`Chunks` forms

- :meth:`Chunks.log_softmax`: :math:`\ell = \log\mathrm{softmax}((hW^\top + b)/T)` in
  float32 (float64), ``[n, vocab]``, in one reusable chunk buffer (the matmul writes into
  it; on CPU the log-softmax overwrites it in place); with ``softcap=c`` the logits are
  capped first, :math:`c\tanh(z/c)`, and :math:`\tanh(z/c)` kept in a second buffer
  (:mod:`dapo_ops.logprobs._softcap`);
- :meth:`Chunks.entropy`: :math:`H = -\sum_v e^{\ell_v}\ell_v` per row;
- :meth:`Chunks.grad_`: for :math:`L = \sum_t a_t \ell_{t,y_t} + b_t H_t`,
  :math:`G = \partial L/\partial x = (a(\delta_y - p) - b\,p(\ell + H))/T` written over
  :math:`\ell`;
- :meth:`Grads.add`: :math:`\partial h = GW`, :math:`\partial W \mathrel{+}= G^\top h`,
  :math:`\partial b \mathrel{+}= G^\top\mathbf 1`, summed over chunks in float32.

Each step is one ATen op over the whole chunk (the log-softmax kernel walks a row at a
time, in cache), except the two that need :math:`p` and :math:`\ell` together, which run
on pieces of about ``PIECE_ELEMENTS`` through one small scratch buffer. Under
``torch.compile`` the same steps are written functionally (no ``out=``, no pieces).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from dapo_ops._core._validate import is_compiling
from dapo_ops.logprobs._logprob_checks import compute_dtype
from dapo_ops.logprobs._softcap import cap_, capped, through_cap
from dapo_ops.logprobs._softmax_blocks import LOGP_FLOOR
from dapo_ops.logprobs._truncation import Truncation, truncated

#: Rows per chunk when ``chunk_size`` is None: ``max(1, E // vocab)``. The weight gradient
#: is a sum of one ``G.T @ h`` per chunk, each reading and writing all of ``[vocab, d]``:
#: a chunk needs a few hundred rows for that to cost little next to its FLOPs. On CPU
#: ``E = 2**25`` (128 MiB of float32; 1048 rows at vocab 32000, 220 at 152064), on GPUs
#: ``2**27`` (882 rows at vocab 152064).
DEFAULT_FUSED_CHUNK_ELEMENTS = {"cpu": 2**25, "other": 2**27}

#: Elements per piece for the steps that need the probabilities and the log-probs at
#: once (the entropy, its gradient): one scratch buffer of this size. 2**21 (8 MiB) on
#: CPU: few ops per chunk, still small next to a chunk; 2**24 on GPUs.
PIECE_ELEMENTS = {"cpu": 2**21, "other": 2**24}

#: Narrow (bfloat16, float16) weight gradients: each chunk's ``G.T @ h`` is formed in the
#: input dtype (tensor cores, AMX) for this many vocabulary rows at a time and added to the
#: float32 sum, so the temporary is small.
WEIGHT_BLOCK_ROWS = 8192


def linear(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return h @ weight.T if bias is None else torch.addmm(bias, h, weight.T)


def _device_key(t: Tensor) -> str:
    return "cpu" if t.device.type == "cpu" else "other"


@dataclasses.dataclass
class Chunks:
    """One pass over the rows of ``hidden [rows, d]``, a chunk of ``chunk`` rows at a time,
    with its buffers (allocated once, reused by every chunk; none under compile). Made by
    :func:`chunks_for`."""

    weight: Tensor
    bias: Tensor | None
    temperature: float
    rows: int
    vocab: int
    cdt: torch.dtype
    narrow: bool  # bfloat16/float16 input: the matmuls run in it, the softmax in float32
    functional: bool  # traced by torch.compile: no out=, no pieces
    chunk: int
    piece: int
    in_place: bool  # log_softmax over its own input (the CPU kernel reads a row first)
    buf: Tensor  # [chunk, vocab], compute dtype
    nbuf: Tensor  # [chunk, vocab], input dtype (narrow only)
    scratch: Tensor | None = None
    trunc: Truncation | None = None  # the sampler's truncation (top-k, top-p, min-p)
    softcap: float | None = None  # the final-logit cap c (None: off)
    tanh: Tensor | None = None  # with softcap: tanh(z/c) of the last chunk formed
    tbuf: Tensor | None = None  # and its buffer (eager)

    def release(self) -> None:
        """Drop the buffers (before the gradients are rounded to the input dtype, so the
        two never coexist)."""
        self.buf = self.nbuf = self.buf.new_empty(0, 0)
        self.scratch = self.tanh = self.tbuf = None

    def spans(self) -> list[tuple[int, int]]:
        return [(s, min(s + self.chunk, self.rows)) for s in range(0, self.rows, self.chunk)]

    def _pieces(self, n: int) -> list[tuple[int, int]]:
        return [(s, min(s + self.piece, n)) for s in range(0, n, self.piece)]

    def _scratch(self, k: int) -> Tensor:
        if self.scratch is None:
            self.scratch = self.buf.new_empty(self.piece, self.vocab)
        return self.scratch[:k]

    def log_softmax(self, h: Tensor) -> Tensor:
        """``log softmax((h @ W.T + b) / T)`` of one chunk, ``[n, vocab]`` in the compute
        dtype; the matmul in the input dtype. Overwritten by the next chunk. (Without
        truncation; :meth:`kept_log_softmax` for the general case.)"""
        return self.kept_log_softmax(h, None, None)[0]

    def kept_log_softmax(
        self, h: Tensor, tok: Tensor | None, tau: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """:meth:`log_softmax` over the kept set when truncating (``tok`` the chosen ids
        ``[n, 1]``, always kept; ``tau`` the saved thresholds, or None to find them), and
        the thresholds used (None without truncation)."""
        n, weight, bias, temp = h.shape[0], self.weight, self.bias, self.temperature
        if self.functional:
            z = linear(h, weight, bias).to(self.cdt)
            if self.softcap is not None:
                z, self.tanh = capped(z, self.softcap)
            z = z if temp == 1.0 else z / temp
            if self.trunc is not None:
                z, tau = truncated(z, self.trunc, tok, tau, False)
            return torch.log_softmax(z, dim=1), tau
        z = self.buf[:n]
        mm = self.nbuf[:n] if self.narrow else z
        if bias is None:
            torch.mm(h, weight.T, out=mm)
        else:
            torch.addmm(bias, h, weight.T, out=mm)
        if self.narrow:
            z.copy_(mm)
        if self.softcap is not None:
            if self.tbuf is None:
                self.tbuf = torch.empty_like(self.buf)
            self.tanh = cap_(z, self.softcap, self.tbuf[:n])
        if temp != 1.0:
            z.div_(temp)
        if self.trunc is not None:
            z, tau = truncated(z, self.trunc, tok, tau, True)
        if self.in_place:  # the CPU kernel reads each row before it writes it
            return torch._log_softmax(z, 1, False, out=z), tau
        return torch.log_softmax(z, dim=1), tau

    def floor_(self, lp: Tensor) -> Tensor:
        """``lp`` floored at ``LOGP_FLOOR`` where a ``-inf`` logit can occur (a bias or a
        truncation), so that ``p log p`` is ``0 * finite``; no value of ``p`` changes."""
        if self.bias is None and self.trunc is None:
            return lp
        return lp.clamp(min=LOGP_FLOOR) if self.functional else lp.clamp_(min=LOGP_FLOOR)

    def entropy(self, lp: Tensor) -> Tensor:
        """``-sum_v exp(lp) lp`` per row of a (floored) chunk; ``lp`` is left as it is."""
        if self.functional:
            return -(lp.exp() * lp).sum(dim=1)
        out = lp.new_empty(lp.shape[0])
        for s, e in self._pieces(lp.shape[0]):
            piece = lp[s:e]
            t = torch.exp(piece, out=self._scratch(e - s))
            torch.sum(t.mul_(piece), dim=1, out=out[s:e])
        return out.neg_()

    def grad_(
        self, lp: Tensor, tok: Tensor, a: Tensor | None, b: Tensor | None, entropy: Tensor | None
    ) -> Tensor:
        r"""The gradient of ``sum_t a_t lp[t, y_t] + b_t H_t`` w.r.t. the raw logits:
        ``p (alpha + beta lp) + (a / T) delta_y`` with ``alpha = -(a + b H) / T``,
        ``beta = -b / T`` (``a``, ``b``: ``[n]``, None for 0; ``lp`` floored when ``b`` is
        given; ``tok``: ``[n, 1]``). Formed over ``lp``, taken through the cap
        (:meth:`uncap`), then for bfloat16/float16 inputs rounded once into the narrow
        buffer: the dtype of the matmuls that follow."""
        temp = self.temperature
        alpha = lp.new_zeros(()) if a is None else a.neg()
        if b is not None:
            assert entropy is not None
            alpha = alpha - b * entropy
        alpha = (alpha / temp).unsqueeze(1)
        beta = None if b is None else (b / -temp).unsqueeze(1)
        hit = None if a is None else (a / temp).unsqueeze(1)
        if self.functional:
            g = lp.exp() * (alpha if beta is None else lp * beta + alpha)
            g = self.uncap(g if hit is None else g.scatter_add(1, tok, hit))
            return g.to(self.nbuf.dtype) if self.narrow else g
        if beta is None:
            g = lp.exp_().mul_(alpha)
        else:
            for s, e in self._pieces(lp.shape[0]):
                piece = lp[s:e]
                prob = torch.exp(piece, out=self._scratch(e - s))
                piece.mul_(beta[s:e]).add_(alpha[s:e]).mul_(prob)
            g = lp
        if hit is not None:
            g.scatter_add_(1, tok, hit)
        g = self.uncap(g)
        return self.nbuf[: g.shape[0]].copy_(g) if self.narrow else g

    def uncap(self, g: Tensor) -> Tensor:
        """A gradient w.r.t. the capped logits of the last chunk formed, taken back to
        the raw ones (``g`` itself without softcap; in place when eager)."""
        if self.tanh is None:
            return g
        t, self.tanh = self.tanh, None
        return through_cap(g, t, not self.functional)


def chunks_for(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    chunk: int,
    temperature: float,
    trunc: Truncation | None = None,
    softcap: float | None = None,
) -> Chunks:
    rows, vocab = hidden.shape[0], weight.shape[0]
    cdt = compute_dtype(hidden.dtype)
    narrow, functional = hidden.dtype != cdt, is_compiling()
    chunk = max(1, min(chunk, rows))
    piece = max(1, min(chunk, PIECE_ELEMENTS[_device_key(hidden)] // vocab))
    shape = (chunk, vocab) if rows and not functional else (0, 0)
    buf = hidden.new_empty(shape, dtype=cdt)
    nbuf = hidden.new_empty(shape if narrow else (0, 0))
    in_place = hidden.device.type == "cpu"
    return Chunks(
        weight, bias, temperature, rows, vocab, cdt, narrow, functional, chunk, piece, in_place,
        buf, nbuf, None, trunc, softcap,
    )  # fmt: skip


@dataclasses.dataclass
class Grads:
    """The gradients w.r.t. ``hidden``, ``weight`` and ``bias``, summed chunk by chunk
    (the first chunk writes, the others add: no zero fill). Made by :func:`grads_for`."""

    chunks: Chunks
    dtype: torch.dtype
    need: tuple[bool, bool, bool]
    h: Tensor | None  # eager: written chunk by chunk
    w: Tensor | None  # float32 (float64) sums
    b: Tensor | None
    parts: list[Tensor]  # compiled: the chunks' hidden gradients, concatenated at the end
    started: bool = False
    wbuf: Tensor | None = None  # narrow weight gradients: one block's product
    wbuf32: Tensor | None = None  # and the same upcast

    def add(self, g: Tensor, h: Tensor, start: int, stop: int) -> None:
        """Add one chunk's share: ``g`` its gradient w.r.t. the logits in the dtype of
        the matmuls (:meth:`Chunks.grad_`), ``h`` the chunk's hidden rows."""
        chunks, first, functional = self.chunks, not self.started, self.chunks.functional
        self.started = True
        need_h, need_w, need_b = self.need
        if need_b:
            col = g.sum(dim=0, dtype=chunks.cdt)
            if first:
                self.b = col
            else:
                assert self.b is not None
                self.b = self.b + col if functional else self.b.add_(col)
        if need_h:
            if self.h is None:
                self.parts.append(g @ chunks.weight)
            else:
                torch.mm(g, chunks.weight, out=self.h[start:stop])
        if not need_w:
            return
        if functional:
            prod = (g.T @ h).to(chunks.cdt)
            self.w = prod if first or self.w is None else self.w + prod
        elif not chunks.narrow:
            assert self.w is not None
            if first:
                torch.mm(g.T, h, out=self.w)
            else:
                self.w.addmm_(g.T, h)
        else:  # G.T @ h in the input dtype, a block of vocabulary rows at a time
            self._add_narrow_weight(g, h, first)

    def _add_narrow_weight(self, g: Tensor, h: Tensor, first: bool) -> None:
        """``w += G.T @ h`` for bfloat16/float16 ``G``, ``h``: the product of each block of
        vocabulary rows formed in the input dtype into one reused buffer, upcast into
        another (mixed-dtype ``add_`` would allocate a temporary per call) and added."""
        assert self.w is not None
        rows = min(WEIGHT_BLOCK_ROWS, self.w.shape[0])
        if self.wbuf is None:
            self.wbuf = h.new_empty(rows, h.shape[1])
            self.wbuf32 = self.w.new_empty(rows, h.shape[1])
        assert self.wbuf32 is not None
        for s in range(0, self.w.shape[0], rows):
            block = self.w[s : s + rows]
            n = block.shape[0]
            prod = torch.mm(g[:, s : s + n].T, h, out=self.wbuf[:n])
            if first:
                block.copy_(prod)
            else:
                block.add_(self.wbuf32[:n].copy_(prod))

    def result(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """The three gradients in the input dtype (None where not needed)."""
        gh = self.h if not self.parts else torch.cat(self.parts)
        gw, gb = self.w, self.b
        if not self.started:  # no rows: nothing was written
            gw = None if gw is None else gw.zero_()
            gb = None if gb is None else gb.zero_()
        return (
            gh,
            None if gw is None else gw.to(self.dtype),
            None if gb is None else gb.to(self.dtype),
        )


def grads_for(chunks: Chunks, hidden: Tensor, need: tuple[bool, bool, bool]) -> Grads:
    gh = torch.empty_like(hidden) if need[0] and not chunks.functional else None
    gw = hidden.new_empty(chunks.weight.shape, dtype=chunks.cdt) if need[1] else None
    gb = hidden.new_empty(chunks.vocab, dtype=chunks.cdt) if need[2] else None
    return Grads(chunks, hidden.dtype, need, gh, gw, gb, [])
