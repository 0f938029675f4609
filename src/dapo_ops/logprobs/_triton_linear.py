r"""Triton kernels from hidden states to log-probs, entropies and their gradients.

Private; :mod:`dapo_ops.logprobs._triton_dispatch` selects them (``backend="triton"``). Triton is
imported on the first call only (never at ``import dapo_ops``), and the kernels are
defined then, once per mode (compiled, or Triton's interpreter under
``TRITON_INTERPRET=1``, which runs them on CPU tensors). Three kernels (and the merge
of pass 1's splits), each over tiles of the logits ``z = (h W^T + b) / T``
(``c tanh((h W^T + b) / c) / T`` with a final-logit cap ``c``) formed on chip
(``tl.dot`` over ``BLOCK_D`` slices of the hidden dimension, products accumulated in
float32; float64 inputs sum their products on the CUDA cores: Triton 3.6 to 3.8 cannot
lower an accumulating float64 ``tl.dot`` for ``sm_90``):

- :func:`forward_stats` (pass 1): per block of ``BLOCK_T`` tokens, a loop over the
  vocabulary tiles keeping the online max ``m``, ``s0 = sum e^{z-m}``,
  ``s1 = sum e^{z-m} (z - m)`` and the chosen token's logit; it writes per token only
  ``logp = z_y - lse``, ``H = log s0 - s1 / s0`` and ``lse = m + log s0``. Split over
  the vocabulary where the token blocks are fewer than the multiprocessors
  (:func:`_splits`): each split writes its four numbers and ``fwd_combine`` merges them.
- :func:`backward_grads` (pass 2): two kernels that form the same tiles again and, on
  chip, ``G = (a (delta_y - p) - b p (log p + H)) / T`` (``a``, ``b``: the upstream
  gradients of ``logp`` and ``H`` per token; times ``1 - tanh^2`` with a cap); one per
  token block (and vocabulary split: float32 partial sums added after) accumulates
  ``dh = G W`` over the vocabulary tiles (a float32 buffer, rounded to the input dtype
  after); a persistent one, a program per multiprocessor taking every ``P``-th
  vocabulary block, accumulates ``dW = G^T h`` and ``db = G^T 1`` over the token tiles,
  in the weight gradient itself (float32/float64 weights) or in float32 rows of its own
  written out, rounded once, when the block is done (bfloat16/float16: no float32
  ``vocab x d`` buffer). Each program owns its rows of the result (read and written in
  turn, ordered by a barrier): no atomics, the same bits on every run.

``G`` is rounded to the input dtype before its two matmuls (bfloat16 tensor cores), as
the chunked path does. Token rows with ``valid`` false are read as zeros and get a zero
gradient row. The derivation: ``docs/linear_loss.md``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import Tensor

from dapo_ops._core._triton import interpreting, launch_options, load_kernels


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tile sizes (powers of two, >= 16 for ``tl.dot``): tokens, vocabulary, hidden; and
    the warps per program."""

    tokens: int = 64
    vocab: int = 128
    dim: int = 32
    warps: int = 8

    def __str__(self) -> str:
        return f"{self.tokens}x{self.vocab}x{self.dim}/{self.warps}w"


@dataclasses.dataclass(frozen=True)
class KernelTiles:
    """The tiles of each kernel: pass 1 (and its merge), the hidden gradient, the weight
    gradient. Each kernel's accumulator traffic falls with the tile of the dimension it
    walks (docs/linear_loss.md), so they may differ."""

    fwd: Blocks
    hidden: Blocks
    weight: Blocks

    @classmethod
    def same(cls, b: Blocks) -> KernelTiles:
        return cls(b, b, b)

    def __str__(self) -> str:
        return f"fwd {self.fwd}, hidden {self.hidden}, weight {self.weight}"


#: On a GPU, per input dtype: tiles whose kernels compile for an H100 (``sm_90``) and an
#: A100 (``sm_80``), under Triton 3.6 to 3.9, without spilling registers to local memory,
#: read from the cubins' resource usage (tests/test_triton_compile.py checks it; ``python
#: -m tools.sm90_tiles`` prints the search). Not yet timed on a GPU (issue 30): ``python
#: -m benchmarks.tile_sweep`` times other spill-free tiles per kernel beside these.
#: float32 (CUDA-core products, ``"ieee"``): pass 2 at 64 x 64 x 32 spills 8 to 72 bytes
#: on sm_80 under Triton 3.8 and 3.9, so its hidden gradient takes 16-wide slices of the
#: hidden dimension and its weight gradient 32 vocabulary rows. float64 sums its products
#: on the CUDA cores (no accumulating float64 ``tl.dot`` on sm_90 before Triton 3.9):
#: small tiles.
GPU_TILES: dict[torch.dtype, KernelTiles] = {
    torch.bfloat16: KernelTiles.same(Blocks(64, 64, 32, 8)),
    torch.float16: KernelTiles.same(Blocks(64, 64, 32, 8)),
    torch.float32: KernelTiles(Blocks(64, 64, 32, 8), Blocks(64, 64, 16, 8), Blocks(64, 32, 32, 8)),
    torch.float64: KernelTiles.same(Blocks(16, 32, 16, 8)),
}
#: Under the interpreter: the smallest legal tiles (it runs each program in numpy).
INTERPRET_BLOCKS = Blocks(16, 32, 16, 4)


def kernels(interpret: bool) -> Any:
    """This path's kernel module (:func:`dapo_ops._core._triton.load_kernels`)."""
    return load_kernels("dapo_ops.logprobs._triton_kernels", interpret)


def _common(h: Tensor, blocks: Blocks | None, kernel: str) -> tuple[Any, dict[str, Any], Blocks]:
    """The kernel module, the launch's tiles and flags for ``kernel`` (a field of
    :class:`KernelTiles`): ``blocks`` if given, else the mode's and dtype's tiles."""
    interpret = interpreting()
    ks = kernels(interpret)
    tl = ks.tl
    b = blocks or (INTERPRET_BLOCKS if interpret else getattr(GPU_TILES[h.dtype], kernel))
    meta = {
        "UPCAST": interpret and h.dtype == torch.bfloat16,
        "ACC": tl.float64 if h.dtype == torch.float64 else tl.float32,
        "BT": b.tokens,
        "BV": b.vocab,
        "BD": b.dim,
    } | launch_options(b.warps)
    return ks, meta, b


def _grid(n: int, block: int) -> tuple[int]:
    return ((n + block - 1) // block,)


def forward_stats(
    h: Tensor,
    w: Tensor,
    bias: Tensor | None,
    tok: Tensor,
    valid: Tensor | None,
    temperature: float,
    softcap: float | None = None,
    blocks: Blocks | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(logp, entropy, lse)`` per row of contiguous ``h [N, D]``, in the compute dtype.
    ``tok`` int64 ids in ``[0, V)``; ``valid`` int8 or None (every row); ``softcap`` the
    final-logit cap (None: off)."""
    n, vocab, dim = h.shape[0], w.shape[0], w.shape[1]
    cdt = torch.float64 if h.dtype == torch.float64 else torch.float32
    logp, ent, lse = (h.new_empty(n, dtype=cdt) for _ in range(3))
    if n == 0:
        return logp, ent, lse
    ks, meta, b = _common(h, blocks, "fwd")
    splits = _splits(h.device, n, vocab, b, None)
    part = h.new_empty((4, splits, n) if splits > 1 else (0,), dtype=cdt)
    ks.fwd[(_grid(n, b.tokens)[0], splits)](
        h, w, h if bias is None else bias, tok, tok if valid is None else valid,
        logp, ent, lse, part, n, vocab, dim, splits, float(temperature), float(softcap or 1.0),
        HAS_BIAS=bias is not None, HAS_VALID=valid is not None, HAS_CAP=softcap is not None,
        PARTIAL=splits > 1, **meta,
    )  # fmt: skip
    if splits > 1:
        ks.fwd_combine[_grid(n, b.tokens)](part, logp, ent, lse, n, splits, ACC=meta["ACC"],
                                           BT=b.tokens, **launch_options(b.warps))  # fmt: skip
    return logp, ent, lse


def backward_grads(
    h: Tensor,
    w: Tensor,
    bias: Tensor | None,
    tok: Tensor,
    valid: Tensor | None,
    stats: tuple[Tensor, Tensor, Tensor, Tensor | None],
    scale: tuple[float, float | None],
    need: tuple[bool, bool, bool],
    blocks: Blocks | None = None,
    filter_eps: float | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dh, dW, db)`` in the inputs' dtype (None where not in ``need``), of
    ``sum_t a_t logp_t + b_t H_t``; ``stats = (lse, H, a, b or None)``, compute dtype;
    ``scale = (temperature, softcap or None)``; ``blocks`` the tiles of both kernels (None:
    each kernel's own). ``filter_eps`` (None: off, the exact result): skip the products of
    a tile of ``G`` whose every entry is at most ``filter_eps (|a_t| + |b_t|) / T``
    (private until a GPU shows that it pays; the bound: docs/linear_loss.md)."""
    n, vocab, dim = h.shape[0], w.shape[0], w.shape[1]
    cdt = torch.float64 if h.dtype == torch.float64 else torch.float32
    if not n:  # no token: zero gradients (no kernel runs)
        return tuple(x.new_zeros(shape) if want else None  # type: ignore[return-value]
                     for x, shape, want in ((h, h.shape, need[0]), (w, w.shape, need[1]),
                                            (w, (vocab,), need[2])))  # fmt: skip
    gh = None
    filtered = filter_eps is not None
    new = torch.zeros if filtered else torch.empty  # skipped tiles add nothing to zeros
    gw = new((vocab, dim), dtype=w.dtype, device=w.device) if need[1] else None
    gb = w.new_empty(vocab, dtype=cdt) if need[2] else None
    if any(need):
        lse, ent, a, b_vec = stats
        args = (h, w, h if bias is None else bias, tok, tok if valid is None else valid,
                lse, ent, a, a if b_vec is None else b_vec)  # fmt: skip
        has = {"HAS_BIAS": bias is not None, "HAS_VALID": valid is not None,
               "HAS_B": b_vec is not None, "HAS_CAP": scale[1] is not None}  # fmt: skip
        temp, cap, eps = float(scale[0]), float(scale[1] or 1.0), float(filter_eps or 0.0)
        if need[0]:  # dh in float32 (or float64) sums, one per vocabulary split
            ks, meta, b = _common(h, blocks, "hidden")
            flags = has | meta
            splits = _splits(h.device, n, vocab, b, n * dim * cdt.itemsize)
            parts = new((splits, n, dim), dtype=cdt, device=h.device)
            ks.bwd_hidden[(_grid(n, b.tokens)[0], splits)](
                *args, parts, n, vocab, dim, splits, temp, cap, eps, FILTER=filtered, **flags
            )
            gh = parts[0] if splits == 1 else parts.sum(0)  # in split order: same bits each run
            del parts
        if gw is not None or gb is not None:
            ks, meta, b = _common(h, blocks, "weight")
            flags = has | meta
            programs = min(_grid(vocab, b.vocab)[0], _programs(h.device))
            scratch = gw is not None and gw.dtype != cdt
            scr = new((programs, b.vocab, dim) if scratch else (0,), dtype=cdt, device=h.device)
            ks.bwd_weight[(programs,)](
                *args, h if gw is None else gw, h if gb is None else gb, scr, n, vocab, dim,
                programs, temp, cap, eps, NEED_W=gw is not None, NEED_BIAS=gb is not None,
                SCRATCH=scratch, FILTER=filtered, **flags,
            )  # fmt: skip
    return (
        None if gh is None else gh.to(h.dtype),
        gw,
        None if gb is None else gb.to(w.dtype),
    )


#: Extra memory the hidden gradient's vocabulary splits may take (their float32 partial
#: sums, ``splits x N x D``).
SPLIT_BYTES = 32 * 2**20
#: Multiprocessors assumed under the interpreter, for the splits only: so that the tests'
#: two or three token blocks get several splits where the vocabulary has the blocks.
INTERPRET_SMS = 8


def _splits(device: torch.device, n: int, vocab: int, b: Blocks, row_bytes: int | None) -> int:
    """Vocabulary splits of pass 1 and of the hidden gradient: about one program per
    multiprocessor in all (``round(SMs / token blocks)``; one program fills one at these
    tiles), at least one vocabulary block each, and for the hidden gradient (``row_bytes``
    = its bytes per split) within :data:`SPLIT_BYTES`. Without them a pass over 1024
    tokens ran 16 programs on an H100's 132 multiprocessors."""
    sms = INTERPRET_SMS if device.type != "cuda" else _programs(device)
    splits = max(1, min(round(sms / _grid(n, b.tokens)[0]), _grid(vocab, b.vocab)[0]))
    if row_bytes is not None:
        splits = max(1, min(splits, SPLIT_BYTES // max(row_bytes, 1)))
    return splits


def _programs(device: torch.device) -> int:
    """Programs of the persistent weight-gradient kernel: one per streaming multiprocessor
    (one program fills one at these tiles); 2 under the interpreter, so that tests give a
    program several vocabulary blocks."""
    if device.type != "cuda":
        return 2
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)
