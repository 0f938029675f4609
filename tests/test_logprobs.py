"""Chunked token log-probs / entropy and the fused output projection.

Gradients are checked with float64 ``gradcheck`` (both outputs, temperature != 1, chunk
sizes that do not divide the rows, backward pieces of a few rows); values and gradients
against the naive ``log_softmax`` path in float32, float64 and bfloat16; properties with
hypothesis; the backward's working memory with the profiler's allocator events.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from collections.abc import Callable, Iterator

import pytest
import torch
from _bounds import assert_within, fused_reference, softmax_reference, sum_bound
from _strategies import projection_leaves
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_ops import token_level_loss
from dapo_ops._core._validate import InputError
from dapo_ops.logprobs import _softmax_blocks as softmax_blocks
from dapo_ops.logprobs.tokens import (
    LogpEntropy,
    fused_logprobs_entropy,
    token_entropy,
    token_logprobs,
    token_logprobs_and_entropy,
)

F64 = torch.float64
BF16 = torch.bfloat16
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LIGER = pytest.mark.skipif(
    importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel (a benchmark peer)"
)


def naive(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The path every trainer writes: full log_softmax, gather, -(p * logp).sum."""
    dtype = F64 if logits.dtype == F64 else torch.float32
    logp_all = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def inputs(
    rows: int, vocab: int, seed: int, *, dtype: torch.dtype = F64, scale: float = 3.0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g, dtype=F64) * scale).to(dtype)
    return logits, torch.randint(0, vocab, (rows,), generator=g)


def loss_weights(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(rows, generator=g, dtype=F64), torch.randn(rows, generator=g, dtype=F64)


# --------------------------------------------------------------------------- gradcheck


@pytest.mark.parametrize(("chunk", "temperature"), [(3, 1.0), (3, 0.7), (None, 1.6), (1, 1.0)])
def test_gradcheck_from_logits(chunk: int | None, temperature: float) -> None:
    logits, tokens = inputs(7, 11, 0)
    logits.requires_grad_(True)
    opts = {"temperature": temperature, "chunk_size": chunk}

    def both(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(token_logprobs_and_entropy(x, tokens, **opts))  # type: ignore[arg-type,return-value]

    assert torch.autograd.gradcheck(both, (logits,))
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, tokens, **opts), (logits,))  # type: ignore[arg-type]
    assert torch.autograd.gradcheck(lambda x: token_entropy(x, **opts), (logits,))  # type: ignore[arg-type]
    # only one output of the pair receives a gradient
    assert torch.autograd.gradcheck(lambda x: both(x)[1], (logits,))


def test_gradcheck_3d_and_noncontiguous_view() -> None:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(2, 6, 9, generator=g, dtype=F64, requires_grad=True)
    tokens = torch.randint(0, 9, (2, 5), generator=g)

    def f(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        view = b[:, :-1]  # leading dims do not merge: walked per sequence
        return tuple(token_logprobs_and_entropy(view, tokens, chunk_size=2, temperature=0.9))

    assert torch.autograd.gradcheck(f, (base,))


@pytest.mark.parametrize(
    ("chunk", "temperature", "bias"), [(3, 1.0, False), (4, 0.6, True), (None, 1.3, True)]
)
def test_gradcheck_fused(chunk: int | None, temperature: float, bias: bool) -> None:
    g = torch.Generator().manual_seed(2)
    hidden, weight, b, tokens = projection_leaves(g, (7,), 5, 13)
    args = (hidden, weight, b) if bias else (hidden, weight)

    def f(h: torch.Tensor, w: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = fused_logprobs_entropy(
            h, w, tokens, bias=rest[0] if rest else None, temperature=temperature, chunk_size=chunk
        )
        return tuple(out)

    assert torch.autograd.gradcheck(f, args)
    assert torch.autograd.gradcheck(lambda *a: f(*a)[0], args)
    assert torch.autograd.gradcheck(lambda *a: f(*a)[1], args)


def test_fused_3d_hidden_and_frozen_weight() -> None:
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 3, 4, generator=g, dtype=F64, requires_grad=True)
    weight = torch.randn(10, 4, generator=g, dtype=F64)  # frozen: no weight gradient work
    tokens = torch.randint(0, 10, (2, 3), generator=g)
    out = fused_logprobs_entropy(hidden, weight, tokens, chunk_size=4)
    assert out.logp.shape == out.entropy.shape == (2, 3)
    assert torch.autograd.gradcheck(
        lambda h: tuple(fused_logprobs_entropy(h, weight, tokens, chunk_size=4)), (hidden,)
    )


# --------------------------------------------------------------------------- vs naive
#
# Every float32 (bfloat16, float16) result is checked against the exact values of the
# same inputs, computed in float64, within the rounding-error bound derived in
# tests/_bounds.py. Two float32 paths (ours and the naive one) are never compared with
# each other: they sum over the vocabulary in different orders, so on some CPU, thread
# count or kernel they may sit on opposite sides of the exact value.


def check_from_logits(
    dtype: torch.dtype,
    device: str,
    *,
    rows: int,
    vocab: int,
    seed: int,
    temperature: float,
    chunk: int,
) -> None:
    """Ours and the naive path: log-probs, entropies and the logits gradient (two upstream
    weights per row) against the exact values, within ``softmax_reference``'s bounds
    (float32 math; the gradient rounded once more to ``dtype``)."""
    logits, tokens = inputs(rows, vocab, seed, dtype=dtype)
    w_lp, w_h = (w.float() for w in loss_weights(rows, seed))
    exact = softmax_reference(logits, tokens, temperature=temperature, w_logp=w_lp, w_entropy=w_h)
    dev = torch.device(device)
    tok, a, b = tokens.to(dev), w_lp.to(dev), w_h.to(dev)
    paths: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
        "ours": lambda x: tuple(  # type: ignore[return-value]
            token_logprobs_and_entropy(x, tok, temperature=temperature, chunk_size=chunk)
        ),
        "naive": lambda x: naive(x, tok, temperature),
    }
    for name, path in paths.items():
        x = logits.to(dev, copy=True).requires_grad_(True)
        logp, ent = path(x)
        assert logp.dtype == ent.dtype == torch.float32
        ((logp * a).sum() + (ent * b).sum()).backward()
        assert x.grad is not None and x.grad.dtype == dtype
        assert_within(logp.cpu(), exact.logp, exact.logp_err, f"{name} logp")
        assert_within(ent.cpu(), exact.entropy, exact.entropy_err, f"{name} entropy")
        assert_within(x.grad.cpu(), exact.grad, exact.grad_bound(dtype), f"{name} gradient")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_from_logits_matches_naive(dtype: torch.dtype) -> None:
    check_from_logits(dtype, "cpu", rows=37, vocab=301, seed=4, temperature=0.8, chunk=5)


def fused_inputs(
    rows: int, d: int, vocab: int, seed: int, dtype: torch.dtype, *, bias: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(hidden, weight, bias or None, tokens), drawn in float64 and rounded to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, d, generator=g, dtype=F64).to(dtype)
    weight = (torch.randn(vocab, d, generator=g, dtype=F64) * scale).to(dtype)
    b = torch.randn(vocab, generator=g, dtype=F64).to(dtype) if bias else None
    return hidden, weight, b, torch.randint(0, vocab, (rows,), generator=g)


def check_fused(
    dtype: torch.dtype,
    device: str,
    *,
    shape: tuple[int, int, int],
    seed: int,
    temperature: float,
    chunk: int,
    bias: bool,
    scale: float,
) -> None:
    """Ours (fused) and the naive path (``naive(h @ W.T + b)``): values and the gradients
    w.r.t. hidden, weight and bias against the exact values of the same inputs, within
    ``fused_reference``'s bounds (the logits in ``dtype``, accumulated in float32; the
    softmax in float32; the gradients' matmuls in ``dtype``)."""
    rows, d, vocab = shape
    hidden, weight, b, tokens = fused_inputs(rows, d, vocab, seed, dtype, bias=bias, scale=scale)
    w_lp, w_h = (w.float() for w in loss_weights(rows, seed))
    exact = fused_reference(
        hidden, weight, tokens, bias=b, temperature=temperature, w_logp=w_lp, w_entropy=w_h
    )
    dev = torch.device(device)
    tok, a, bw = tokens.to(dev), w_lp.to(dev), w_h.to(dev)

    def ours(h: torch.Tensor, w: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        bias_ = rest[0] if rest else None
        out = fused_logprobs_entropy(
            h, w, tok, bias=bias_, temperature=temperature, chunk_size=chunk
        )
        return out.logp, out.entropy

    def naive_fused(
        h: torch.Tensor, w: torch.Tensor, *rest: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        logits = h @ w.T + rest[0] if rest else h @ w.T
        return naive(logits, tok, temperature)

    leaves_in = [t for t in (hidden, weight, b) if t is not None]
    names = ["hidden", "weight", "bias"][: len(leaves_in)]
    wants = [exact.grad_hidden, exact.grad_weight, exact.grad_bias]
    bounds = [exact.grad_hidden_err, exact.grad_weight_err, exact.grad_bias_err]
    for name, path in (("ours", ours), ("naive", naive_fused)):
        leaves = [t.to(dev, copy=True).requires_grad_(True) for t in leaves_in]
        logp, ent = path(*leaves)
        assert logp.dtype == ent.dtype == torch.float32
        ((logp * a).sum() + (ent * bw).sum()).backward()
        soft = exact.soft
        assert_within(logp.cpu(), soft.logp, soft.logp_err, f"{name} logp")
        assert_within(ent.cpu(), soft.entropy, soft.entropy_err, f"{name} entropy")
        for leaf, what, want, bound in zip(leaves, names, wants, bounds, strict=False):
            assert leaf.grad is not None and leaf.grad.dtype == dtype
            assert_within(leaf.grad.cpu(), want, bound, f"{name} d_{what}")


def test_fused_matches_naive_float32() -> None:
    check_fused(
        torch.float32,
        "cpu",
        shape=(50, 16, 97),
        seed=5,
        temperature=1.1,
        chunk=7,
        bias=True,
        scale=0.5,
    )


def test_fused_bfloat16_is_as_accurate_as_naive() -> None:
    """bf16 in, float32 out: both paths within the same bound of the exact values of the
    same bfloat16 inputs (bfloat16 logits and gradient matmuls, float32 softmax)."""
    check_fused(
        torch.bfloat16,
        "cpu",
        shape=(64, 32, 200),
        seed=6,
        temperature=1.0,
        chunk=10,
        bias=False,
        scale=0.3,
    )


def test_minus_inf_logits_are_masked_vocab() -> None:
    """``-inf`` logits (a padded vocabulary) get probability 0 and gradient exactly 0: the
    values are those of the smaller vocabulary (float64, within its bound)."""
    logits, tokens = inputs(6, 10, 7)
    masked = logits.clone()
    masked[:, 7:] = -math.inf  # padded vocabulary entries
    tokens = tokens % 7
    x = masked.clone().requires_grad_(True)
    out = token_logprobs_and_entropy(x, tokens, chunk_size=4)
    (out.logp.sum() + out.entropy.sum()).backward()
    ones = torch.ones(6, dtype=F64)
    exact = softmax_reference(logits[:, :7], tokens, w_logp=ones, w_entropy=ones, dtype=F64)
    assert_within(out.logp, exact.logp, exact.logp_err, "logp")
    assert_within(out.entropy, exact.entropy, exact.entropy_err, "entropy")
    assert x.grad is not None
    assert_within(x.grad[:, :7], exact.grad, exact.grad_err, "gradient")
    assert bool((x.grad[:, 7:] == 0).all())


def test_empty_rows() -> None:
    x = torch.randn(0, 5, requires_grad=True)
    out = token_logprobs_and_entropy(x, torch.zeros(0, dtype=torch.long))
    assert out.logp.shape == out.entropy.shape == (0,)
    (out.logp.sum() + out.entropy.sum()).backward()
    assert x.grad is not None and x.grad.shape == (0, 5)


# --------------------------------------------------------------------------- properties


@given(
    rows=st.integers(1, 12),
    vocab=st.integers(1, 40),
    chunk=st.integers(1, 15),
    seed=st.integers(0, 2**16),
    temperature=st.sampled_from([0.3, 1.0, 2.5]),
    scale=st.sampled_from([0.01, 1.0, 30.0]),
)
def test_properties(
    rows: int, vocab: int, chunk: int, seed: int, temperature: float, scale: float
) -> None:
    logits, tokens = inputs(rows, vocab, seed, dtype=torch.float32, scale=scale)
    exact = softmax_reference(logits, tokens, temperature=temperature)
    got = token_logprobs_and_entropy(logits, tokens, temperature=temperature, chunk_size=chunk)
    # The block size is a memory knob only, and the separate functions give the numbers
    # of the pair: each within the float32 bound of the exact values (token_logprobs
    # evaluates a fused log_softmax, the pair lse and a shifted sum: other roundings).
    results = {
        f"pair, blocks of {chunk}": got,
        "pair, one block": token_logprobs_and_entropy(
            logits, tokens, temperature=temperature, chunk_size=rows
        ),
        "separate": (
            token_logprobs(logits, tokens, temperature=temperature),
            token_entropy(logits, temperature=temperature),
        ),
    }
    for name, (logp, entropy) in results.items():
        assert_within(logp, exact.logp, exact.logp_err, f"{name}: logp")
        assert_within(entropy, exact.entropy, exact.entropy_err, f"{name}: entropy")
    # exact in floating point: lse = max z + log(sum e) with sum e >= 1 (the max term is
    # exp(0) = 1), so lse >= z_y; H = log(sum e) - sum(e (z - max)) / sum e, both >= 0
    assert bool((got.logp <= 0).all())
    assert bool((got.entropy >= 0).all())
    assert bool((got.entropy <= math.log(vocab) + exact.entropy_err).all())


@settings(max_examples=20)
@given(
    rows=st.integers(1, 10),
    vocab=st.integers(2, 30),
    chunk=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_fused_independent_of_chunk(rows: int, vocab: int, chunk: int, seed: int) -> None:
    """float64: blocks of ``chunk`` rows and one block, both within the float64 bound of
    the reference (the weight gradient sums over blocks in another order)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, 6, generator=g, dtype=F64, requires_grad=True)
    weight = torch.randn(vocab, 6, generator=g, dtype=F64, requires_grad=True)
    tokens = torch.randint(0, vocab, (rows,), generator=g)
    w_lp, w_h = loss_weights(rows, seed)
    exact = fused_reference(hidden, weight, tokens, w_logp=w_lp, w_entropy=w_h)
    wants = [
        (exact.soft.logp, exact.soft.logp_err),
        (exact.soft.entropy, exact.soft.entropy_err),
        (exact.grad_hidden, exact.grad_hidden_err),
        (exact.grad_weight, exact.grad_weight_err),
    ]
    for c in (chunk, rows):
        out = fused_logprobs_entropy(hidden, weight, tokens, chunk_size=c)
        loss = (out.logp * w_lp).sum() + (out.entropy * w_h).sum()
        got = [out.logp, out.entropy, *torch.autograd.grad(loss, [hidden, weight])]
        for name, t, (want, bound) in zip(["logp", "H", "dh", "dW"], got, wants, strict=True):
            assert_within(t, want, bound, f"chunk {c}: {name}")


# --------------------------------------------------------------------------- inplace


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_inplace_backward_same_gradient(dtype: torch.dtype, temperature: float) -> None:
    logits, tokens = inputs(9, 23, 8, dtype=dtype)
    w_lp, w_h = (w.float() for w in loss_weights(9, 8))
    grads = []
    for inplace in (False, True):
        leaf = logits.clone().requires_grad_(True)
        x = leaf * 1  # a non-leaf, like the output of lm_head
        out = token_logprobs_and_entropy(
            x, tokens, chunk_size=4, temperature=temperature, inplace_backward=inplace
        )
        ((out.logp * w_lp).sum() + (out.entropy * w_h).sum()).backward()
        assert leaf.grad is not None
        grads.append(leaf.grad)
        if inplace:  # the buffer now holds the gradient
            torch.testing.assert_close(x.detach(), leaf.grad, rtol=0, atol=0)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_inplace_backward_logprobs_only_and_3d_view() -> None:
    g = torch.Generator().manual_seed(9)
    base = torch.randn(3, 5, 8, generator=g)
    tokens = torch.randint(0, 8, (3, 4), generator=g)
    grads = []
    for inplace in (False, True):
        leaf = base.clone().requires_grad_(True)
        lp = token_logprobs(leaf[:, :-1], tokens, chunk_size=3, inplace_backward=inplace)
        lp.sum().backward()
        assert leaf.grad is not None
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_inplace_misuse_is_caught_by_autograd() -> None:
    logits, tokens = inputs(4, 6, 10, dtype=torch.float32)
    x = logits.clone().requires_grad_(True) * 1
    ent = token_entropy(x)  # saves x for its backward, which runs last
    lp = token_logprobs(x, tokens, inplace_backward=True)  # overwrites x first
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (lp.sum() + ent.sum()).backward()


# --------------------------------------------------------------------------- backward pieces


@contextlib.contextmanager
def piece_elements(n: int) -> Iterator[None]:
    """Backward pieces of ``max(1, n // vocab)`` rows while the block runs."""
    sizes = softmax_blocks.BACKWARD_PIECE_ELEMENTS
    saved = dict(sizes)
    sizes.update(cpu=n, other=n)
    try:
        yield
    finally:
        sizes.update(saved)


def outputs(
    x: torch.Tensor, tokens: torch.Tensor, want: str, **opts: object
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(logp, entropy) of the call under test; None for an output that gets no gradient."""
    if want == "logp":
        return token_logprobs(x, tokens, **opts), None  # type: ignore[arg-type]
    if want == "entropy":
        opts.pop("inplace_backward", None)
        return None, token_entropy(x, **opts)  # type: ignore[arg-type]
    out = token_logprobs_and_entropy(x, tokens, **opts)  # type: ignore[arg-type]
    return (None if want == "pair_entropy" else out.logp), out.entropy


@pytest.mark.parametrize("want", ["both", "logp", "entropy", "pair_entropy"])
def test_gradcheck_backward_pieces(want: str) -> None:
    """float64, pieces of 2 rows inside blocks of 5 (the last piece and block are short)."""
    logits, tokens = inputs(13, 6, 15)
    logits.requires_grad_(True)

    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        got = outputs(x, tokens, want, temperature=0.6, chunk_size=5)
        return tuple(t for t in got if t is not None)

    with piece_elements(12):
        assert torch.autograd.gradcheck(f, (logits,))


@settings(max_examples=40)
@given(
    rows=st.integers(1, 9),
    vocab=st.integers(2, 40),
    chunk=st.integers(1, 7),
    piece_rows=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, F64, BF16]),
    temperature=st.sampled_from([1.0, 0.7, 1.9]),
    want=st.sampled_from(["both", "logp", "entropy", "pair_entropy"]),
    layout=st.sampled_from(["2d", "3d", "3d_view"]),
    inplace=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_backward_pieces_match_naive(
    rows: int,
    vocab: int,
    chunk: int,
    piece_rows: int,
    dtype: torch.dtype,
    temperature: float,
    want: str,
    layout: str,
    inplace: bool,
    seed: int,
) -> None:
    """Values and gradients of every backward path against the exact float64 values.

    ``layout``: [rows, vocab]; [2, rows, vocab]; or the view ``[2, rows + 1, vocab][:, :-1]``
    whose leading dims do not merge. Blocks of ``chunk`` rows, pieces of ``piece_rows``.
    Bounds: ``softmax_reference`` for float32 math (float64 for float64 logits), the
    gradient rounded once more to bfloat16 for bfloat16 logits.
    """
    g = torch.Generator().manual_seed(seed)
    shape = {"2d": (rows, vocab), "3d": (2, rows, vocab), "3d_view": (2, rows + 1, vocab)}[layout]
    base = (torch.randn(shape, generator=g, dtype=F64) * 3).to(dtype)
    out_shape = (rows,) if layout == "2d" else (2, rows)
    tokens = torch.randint(0, vocab, out_shape, generator=g)
    w_lp = torch.randn(out_shape, generator=g, dtype=F64)
    w_h = torch.randn(out_shape, generator=g, dtype=F64)
    has_logp, has_entropy = want in ("both", "logp"), want != "logp"

    leaf = base.clone().requires_grad_(True)
    x = leaf * 1  # a non-leaf, so that inplace_backward may overwrite it
    x = x[:, :-1] if layout == "3d_view" else x
    with piece_elements(piece_rows * vocab):
        logp, entropy = outputs(
            x, tokens, want, temperature=temperature, chunk_size=chunk, inplace_backward=inplace
        )
        terms = [
            (t.double() * w).sum()
            for t, w in zip((logp, entropy), (w_lp, w_h), strict=True)
            if t is not None
        ]
        (grad,) = torch.autograd.grad(torch.stack(terms).sum(), [leaf])

    cdt = F64 if dtype == F64 else torch.float32
    # the upstream gradient reaching a float32 output is the weight rounded to float32
    exact = softmax_reference(
        base[:, :-1] if layout == "3d_view" else base,
        tokens,
        temperature=temperature,
        w_logp=w_lp.to(cdt) if has_logp else None,
        w_entropy=w_h.to(cdt) if has_entropy else None,
        dtype=cdt,
    )
    assert (logp is not None) == has_logp and (entropy is not None) == has_entropy
    if logp is not None:
        assert_within(logp, exact.logp, exact.logp_err, "logp")
    if entropy is not None:
        assert_within(entropy, exact.entropy, exact.entropy_err, "entropy")
    assert grad.dtype == dtype
    if layout == "3d_view":  # the position outside the view gets exactly 0
        assert bool((grad[:, -1] == 0).all())
        grad = grad[:, :-1]
    assert_within(grad, exact.grad, exact.grad_bound(dtype), "gradient")


def backward_peak(loss: torch.Tensor, x: torch.Tensor) -> int:
    """Peak bytes of live tensors allocated while ``dloss/dx`` is computed (gradient included).

    The CPU analogue of ``torch.cuda.max_memory_allocated``: the profiler's allocation and
    free events replayed in order (as ``benchmarks/bench_logprobs.py`` measures).
    """
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    )
    with prof:
        torch.autograd.grad(loss, [x])
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    cur = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def extra_above_gradient(
    rows: int, vocab: int, dtype: torch.dtype, want: str, temperature: float, inplace: bool
) -> tuple[int, int]:
    """(peak bytes during backward beyond the gradient buffer, logits bytes)."""
    logits, tokens = inputs(rows, vocab, 16, dtype=torch.float32)
    w_lp, w_h = (w.float() for w in loss_weights(rows, 16))
    x = logits.to(dtype).requires_grad_(True) * 1  # non-leaf: the gradient w.r.t. it is returned
    lp, ent = outputs(x, tokens, want, temperature=temperature, inplace_backward=inplace)
    terms = [(t * w).sum() for t, w in zip((lp, ent), (w_lp, w_h), strict=True) if t is not None]
    size = x.numel() * x.element_size()
    peak = backward_peak(torch.stack(terms).sum(), x)
    return peak - (0 if inplace else size), size


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("want", ["both", "logp"])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_backward_working_memory_is_one_piece(dtype: torch.dtype, want: str, inplace: bool) -> None:
    """Beyond the gradient buffer, backward allocates one piece's temporaries, not a block.

    Pieces of one row, temperature 0.7 (``z / T`` is formed in the gradient buffer too):
    float32 logits need a float32 ``p`` with entropy and nothing without it; bfloat16
    logits also upcast the piece. Plus a few floats per row (upstream gradients, per-row
    factors).
    """
    rows, vocab = 1024, 8192
    with piece_elements(vocab):
        extra, size = extra_above_gradient(rows, vocab, dtype, want, 0.7, inplace)
    temporaries = (want == "both") + (dtype != torch.float32)
    assert extra <= temporaries * vocab * 4 + 32 * rows, extra
    assert extra < 0.01 * size, extra / size


@pytest.mark.parametrize("want", ["both", "logp"])
def test_default_backward_extra_peak_below_one_percent(want: str) -> None:
    """The default path (float32, default pieces): the gradient buffer plus < 1 % of the logits."""
    extra, size = extra_above_gradient(2048, 8192, torch.float32, want, 0.7, False)
    assert extra < 0.01 * size, extra / size


# --------------------------------------------------------------------------- peer


@LIGER
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_fused_dapo_loss_matches_liger_grpo(dtype: torch.dtype) -> None:
    """Our fused log-probs + token_level_loss and Liger's chunked GRPO loss, configured as
    DAPO (token mean, clip 0.2 / 0.28, no KL), give the same loss and gradients.

    This is the pairing that ``benchmarks/bench_logprobs.py`` times side by side. Liger
    accumulates in float32 whatever the input dtype, hence float32 tolerances throughout.
    """
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    g = torch.Generator().manual_seed(17)
    batch, seq, d, vocab, temperature = 4, 24, 16, 300, 0.8
    hidden = torch.randn(batch, seq, d, generator=g, dtype=F64).to(dtype)
    weight = (torch.randn(vocab, d, generator=g, dtype=F64) * 0.4).to(dtype)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.rand(batch, seq, generator=g) > 0.2
    advantages = torch.randn(batch, generator=g, dtype=F64).to(dtype)
    with torch.no_grad():  # old log-probs near the current ones: some ratios clip, most not
        logp = fused_logprobs_entropy(hidden, weight, tokens, temperature=temperature).logp
    old_logp = (logp + 0.3 * torch.randn(batch, seq, generator=g, dtype=F64)).to(dtype)

    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = fused_logprobs_entropy(h1, w1, tokens, temperature=temperature, chunk_size=20)
    ours = token_level_loss(out.logp, old_logp, advantages, mask, eps_low=0.2, eps_high=0.28)
    ours.backward()

    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    liger = LigerFusedLinearGRPOLoss(
        beta=0.0,
        use_ref_model=False,
        loss_type="dapo",
        epsilon_low=0.2,
        epsilon_high=0.28,
        temperature=temperature,
        compiled=False,
        chunk_size=1,
    )
    theirs, (clip_frac,) = liger(
        h2, w2, tokens, mask.long(), advantages, old_per_token_logps=old_logp
    )
    theirs.backward()

    assert 0 < clip_frac.item() < 0.5  # the clip is exercised
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-5, atol=1e-6)
    for a, b in ((h1.grad, h2.grad), (w1.grad, w2.grad)):
        assert a is not None and b is not None
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------- errors


_X, _Y = torch.randn(4, 6), torch.tensor([0, 1, 2, 5])
_H, _W = torch.randn(4, 3), torch.randn(6, 3)
ERROR_CASES: list[tuple[str, Callable[[], object], str]] = [
    ("logits int", lambda: token_logprobs(_Y.view(2, 2), _Y[:2]), "logits"),
    ("logits 1-D", lambda: token_entropy(torch.randn(6)), "logits"),
    ("logits 4-D", lambda: token_entropy(torch.randn(1, 2, 3, 4)), "logits"),
    ("tokens shape", lambda: token_logprobs(_X, _Y[:3]), "tokens"),
    ("tokens float", lambda: token_logprobs(_X, _Y.float()), "tokens"),
    ("tokens >= vocab", lambda: token_logprobs(_X, torch.tensor([0, 1, 2, 6])), "tokens"),
    ("tokens -100", lambda: token_logprobs(_X, torch.tensor([0, -100, 2, 3])), "tokens"),
    ("temperature 0", lambda: token_logprobs(_X, _Y, temperature=0.0), "temperature"),
    ("temperature nan", lambda: token_entropy(_X, temperature=math.nan), "temperature"),
    ("temperature <0", lambda: fused_logprobs_entropy(_H, _W, _Y, temperature=-1.0), "temperature"),
    ("chunk 0", lambda: token_entropy(_X, chunk_size=0), "chunk_size"),
    ("fused chunk 0", lambda: fused_logprobs_entropy(_H, _W, _Y, chunk_size=0), "chunk_size"),
    ("weight d", lambda: fused_logprobs_entropy(_H, torch.randn(6, 4), _Y), "weight"),
    ("weight dtype", lambda: fused_logprobs_entropy(_H, _W.double(), _Y), "weight"),
    ("bias shape", lambda: fused_logprobs_entropy(_H, _W, _Y, bias=torch.randn(5)), "bias"),
    ("fused tokens", lambda: fused_logprobs_entropy(_H, _W, torch.tensor([0, 1, 2, 9])), "tokens"),
    ("hidden int", lambda: fused_logprobs_entropy(_Y.view(2, 2), _W, _Y[:2]), "hidden"),
]


@pytest.mark.parametrize(("name", "call", "arg"), ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_bad_input_names_the_argument(
    checker: str, name: str, call: Callable[[], object], arg: str
) -> None:
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    if checker == "checker off":
        assert isinstance(info.value, InputError), type(info.value)
        assert arg in str(info.value)


# --------------------------------------------------------------------------- compile


@pytest.mark.usefixtures("no_runtime_typecheck")
def test_compile_fullgraph_from_logits() -> None:
    """Compiled and eager: the loss and the gradient, each within the float32 bound of the
    exact values (three calls: their bounds add, plus the sums that combine them)."""
    logits, tokens = inputs(10, 17, 11, dtype=torch.float32)
    w_lp, w_h = (w.float() for w in loss_weights(10, 11))

    def step(x: torch.Tensor) -> torch.Tensor:
        out = token_logprobs_and_entropy(x, tokens, temperature=0.9, chunk_size=4)
        single = token_logprobs(x, tokens, chunk_size=5).sum() + token_entropy(x).sum()
        return (out.logp * w_lp).sum() + (out.entropy * w_h).sum() + single

    ones = torch.ones(10)
    pair = softmax_reference(logits, tokens, temperature=0.9, w_logp=w_lp, w_entropy=w_h)
    alone = softmax_reference(logits, tokens, w_logp=ones, w_entropy=ones)
    terms = [pair.logp * w_lp, pair.entropy * w_h, alone.logp, alone.entropy]
    term_errs = [
        pair.logp_err * w_lp.abs(),
        pair.entropy_err * w_h.abs(),
        alone.logp_err,
        alone.entropy_err,
    ]
    loss = sum(t.sum() for t in terms)
    magnitude = sum((t.abs() + e).sum() for t, e in zip(terms, term_errs, strict=True))
    loss_err = sum(e.sum() for e in term_errs) + sum_bound(magnitude, 4 * 10, torch.float32)
    # x.grad: the pair's gradient plus the two single calls' (which alone.grad sums),
    # accumulated by autograd: two more additions
    grad = pair.grad + alone.grad
    grad_err = (
        pair.grad_err
        + alone.grad_err
        + sum_bound(pair.grad.abs() + alone.grad.abs() + pair.grad_err, 3, torch.float32)
    )

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for name, fn in (("eager", step), ("compiled", compiled)):
        x = logits.clone().requires_grad_(True)
        out = fn(x)
        out.backward()
        assert x.grad is not None
        assert_within(out, loss, loss_err, f"{name} loss")
        assert_within(x.grad, grad, grad_err, f"{name} gradient")


@pytest.mark.usefixtures("no_runtime_typecheck")
def test_compile_fullgraph_fused_and_inplace() -> None:
    """Compiled and eager gradients of the fused path, and of ``h @ W.T`` then the in-place
    path, each within ``fused_reference``'s float32 bounds (same structure: logits from a
    float32 matmul, softmax gradient, two matmuls back)."""
    g = torch.Generator().manual_seed(12)
    hidden = torch.randn(9, 4, generator=g)
    weight = torch.randn(15, 4, generator=g)
    tokens = torch.randint(0, 15, (9,), generator=g)

    def fused(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = fused_logprobs_entropy(h, w, tokens, chunk_size=4)
        return out.logp.sum() + 0.1 * out.entropy.sum()

    def inplace(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = token_logprobs_and_entropy(h @ w.T, tokens, chunk_size=4, inplace_backward=True)
        return out.logp.sum() + 0.1 * out.entropy.sum()

    # the entropy's upstream gradient is 0.1 rounded to float32
    exact = fused_reference(
        hidden,
        weight,
        tokens,
        w_logp=torch.ones(9),
        w_entropy=torch.full((9,), 0.1, dtype=torch.float32),
    )
    for fn in (fused, inplace):
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        for name, f in (("eager", fn), ("compiled", compiled)):
            h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
            f(h, w).backward()
            assert h.grad is not None and w.grad is not None
            what = f"{fn.__name__}, {name}"
            assert_within(h.grad, exact.grad_hidden, exact.grad_hidden_err, f"{what}: d_hidden")
            assert_within(w.grad, exact.grad_weight, exact.grad_weight_err, f"{what}: d_weight")


# --------------------------------------------------------------------------- GPU
#
# The CPU tests above with the shapes of a real step, on the GPU: the same helpers and
# bounds (FUNC_ULPS covers CUDA's expf/logf). cuBLAS may reduce bfloat16 products in
# bfloat16 and float32 ones in TF32, outside the float32-accumulation model of the bounds:
# both are switched off for the fused test.


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_naive(dtype: torch.dtype) -> None:
    check_from_logits(dtype, "cuda", rows=300, vocab=5003, seed=13, temperature=1.0, chunk=64)


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_fused(dtype: torch.dtype) -> None:
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_tf32, matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_tf32, matmul.allow_bf16_reduced_precision_reduction = False, False
    try:
        check_fused(
            dtype,
            "cuda",
            shape=(257, 64, 4099),
            seed=14,
            temperature=1.0,
            chunk=100,
            bias=False,
            scale=0.2,
        )
    finally:
        matmul.allow_tf32, matmul.allow_bf16_reduced_precision_reduction = saved


def test_named_tuple() -> None:
    out = token_logprobs_and_entropy(torch.zeros(1, 2), torch.tensor([1]))
    assert isinstance(out, LogpEntropy)
    torch.testing.assert_close(out.logp, torch.tensor([-math.log(2)]))


# --------------------------------------------------------------------------- issue 15, item 1


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("want", ["logp", "entropy", "pair", "pair_view_inplace", "fused"])
def test_double_backward_is_exact(want: str, temperature: float) -> None:
    """create_graph=True gives a gradient with a graph, and its derivative is right
    (gradgradcheck in float64): never a silently constant gradient."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(5, 7, dtype=torch.float64, generator=g, requires_grad=True)
    x3 = torch.randn(2, 4, 7, dtype=torch.float64, generator=g, requires_grad=True)
    tokens = torch.randint(0, 7, (5,), generator=g)
    tokens23 = torch.randint(0, 7, (2, 3), generator=g)
    h = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(7, 3, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, generator=g, requires_grad=True)
    opts = {"temperature": temperature, "chunk_size": 2}
    fn: Callable[..., object]
    if want == "logp":
        fn, args = (lambda x: token_logprobs(x, tokens, **opts)), (x,)  # type: ignore[arg-type]
    elif want == "entropy":
        fn, args = (lambda x: token_entropy(x, **opts)), (x,)  # type: ignore[arg-type]
    elif want == "pair":
        fn, args = (lambda x: tuple(token_logprobs_and_entropy(x, tokens, **opts))), (x,)  # type: ignore[arg-type]
    elif want == "pair_view_inplace":

        def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = token_logprobs_and_entropy(
                x[:, :-1],
                tokens23,
                inplace_backward=True,
                **opts,  # type: ignore[arg-type]
            )
            return tuple(out)

        args = (x3,)
    else:

        def fn(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return tuple(fused_logprobs_entropy(h, w, tokens, bias=b, **opts))  # type: ignore[arg-type]

        args = (h, w, b)
    assert torch.autograd.gradgradcheck(fn, args)  # type: ignore[arg-type]
    out = fn(*args)
    first = out[0] if isinstance(out, tuple) else out
    grad = torch.autograd.grad(first.sum(), args[0], create_graph=True)[0]  # type: ignore[union-attr]
    assert grad.requires_grad and grad.grad_fn is not None


def test_double_backward_first_order_matches_block_path() -> None:
    logits, tokens = inputs(9, 23, 8, dtype=torch.float32)
    # two float32 evaluations of one formula, in other orders: each within the float32
    # bound of the exact gradient (the entropy's upstream gradient is 0.3 in float32)
    exact = softmax_reference(logits, tokens, w_logp=torch.ones(9), w_entropy=torch.full((9,), 0.3))
    for create_graph in (False, True):
        x = logits.clone().requires_grad_(True)
        out = token_logprobs_and_entropy(x, tokens, chunk_size=4)
        loss = out.logp.sum() + 0.3 * out.entropy.sum()
        grad = torch.autograd.grad(loss, x, create_graph=create_graph)[0]
        assert_within(grad, exact.grad, exact.grad_err, f"create_graph={create_graph}")


@pytest.mark.parametrize("fn", ["logprobs", "pair"])
def test_inplace_backward_refuses_overlapping_views(fn: str) -> None:
    """An expand()-ed view cannot hold its own gradient: refused at call time, not a raw
    error inside backward. Slices and transposes still work."""
    call = token_logprobs if fn == "logprobs" else token_logprobs_and_entropy
    base = torch.randn(1, 6, requires_grad=True)
    with pytest.raises(InputError, match="inplace_backward"):
        call(base.expand(4, 6), torch.zeros(4, dtype=torch.long), inplace_backward=True)
    base3 = torch.randn(2, 1, 6, requires_grad=True)
    with pytest.raises(InputError, match="inplace_backward"):
        call(base3.expand(2, 3, 6), torch.zeros(2, 3, dtype=torch.long), inplace_backward=True)
    # without inplace_backward the expanded view is fine
    call(base.expand(4, 6), torch.zeros(4, dtype=torch.long))
    g = torch.Generator().manual_seed(23)
    views: list[tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]] = [
        (torch.randn(6, 4, generator=g), lambda y: y.T),
        (torch.randn(2, 4, 6, generator=g), lambda y: y[:, :-1]),
    ]
    for base_values, view in views:
        # a transposed block's row sums run in another order than a contiguous buffer's:
        # each gradient within the float32 bound of the exact one (mapped back to the leaf
        # by the same view, 0 outside it)
        x_values = view(base_values)
        tokens = torch.zeros(x_values.shape[:-1], dtype=torch.long)
        exact = softmax_reference(x_values, tokens, w_logp=torch.ones(x_values.shape[:-1]))
        want = torch.zeros_like(base_values, dtype=F64)
        bound = torch.zeros_like(want)
        view(want).copy_(exact.grad)
        view(bound).copy_(exact.grad_err)
        for inplace in (False, True):
            leaf = base_values.clone().requires_grad_(True)
            x = view(leaf * 1)  # a strided non-leaf view, like lm_head's output sliced
            out = call(x, tokens, inplace_backward=inplace)
            (out if isinstance(out, torch.Tensor) else out.logp).sum().backward()
            assert leaf.grad is not None
            assert_within(leaf.grad, want, bound, f"inplace_backward={inplace}")


@pytest.mark.parametrize("what", ["logits", "tokens", "hidden", "weight", "bias"])
def test_modifying_a_saved_input_before_backward_raises(what: str) -> None:
    """Like any torch op: never a gradient computed from the modified values."""
    g = torch.Generator().manual_seed(22)
    tokens = torch.randint(0, 6, (4,), generator=g)
    if what in ("logits", "tokens"):
        x = torch.randn(4, 6, generator=g, requires_grad=True) * 1
        out = token_logprobs_and_entropy(x, tokens)
        target = x if what == "logits" else tokens
    else:
        h = torch.randn(4, 3, generator=g, requires_grad=True) * 1
        w = torch.randn(6, 3, generator=g, requires_grad=True) * 1
        b = torch.randn(6, generator=g, requires_grad=True) * 1
        out = fused_logprobs_entropy(h, w, tokens, bias=b)
        target = {"hidden": h, "weight": w, "bias": b}[what]
    with torch.no_grad():
        target.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.logp.sum() + out.entropy.sum()).backward()
