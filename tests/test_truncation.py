"""Log-probs under the sampler's truncation (issue 29, item 4): ``top_k``, ``top_p``, ``min_p``.

The reference below is written from the rules (sort, mass strictly ahead, renormalise),
in float64, one row at a time; the library finds one threshold per row. They agree
exactly except within rounding of a top-p or min-p boundary, which the property tests
exclude with ``assume`` (a margin of 1e-9). ``vllm_kept`` restates vLLM's PyTorch
sampler (sort ascending, cumulative sum ``<= 1 - p`` dropped) to hold the rules to it.
"""

from __future__ import annotations

import math

import pytest
import torch
from _strategies import projection_leaves
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import dapo_ops as d
from dapo_ops._core._validate import InputError
from dapo_ops.logprobs import _truncation
from dapo_ops.logprobs._truncation import Truncation, thresholds

F64 = torch.float64
MARGIN = 1e-9


# --------------------------------------------------------------------------- references


def kept_reference(
    z: torch.Tensor, trunc: dict[str, float | int | None]
) -> tuple[torch.Tensor, float]:
    """Kept set of one row of scaled logits by the rules, and the smallest distance of a
    min-p ratio or a top-p mass to its bound (to exclude rounding ties)."""
    k, p, m = trunc.get("top_k"), trunc.get("top_p"), trunc.get("min_p")
    keep = torch.ones_like(z, dtype=torch.bool)
    margin = math.inf
    if m is not None and m > 0:
        ratio = torch.exp(z - z.max())
        margin = min(margin, (ratio - m).abs().min().item())
        keep &= ratio >= m
    if k is not None and 0 < k < z.numel():
        kept = z[keep].sort(descending=True).values
        if kept.numel() >= k:
            keep &= z >= kept[k - 1]
    if p is not None and p < 1:
        q = torch.where(keep, torch.exp(z - z.max()), 0.0)
        q = q / q.sum()
        ahead = torch.stack([q[z > z[v]].sum() for v in range(z.numel())])
        margin = min(margin, (ahead[keep] - p).abs().min().item())
        keep &= ahead < p
    return keep, margin


def reference(
    logits: torch.Tensor, tokens: torch.Tensor | None, temperature: float, trunc: dict
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(log-probs, entropies, margin) over ``K`` (``K u {y}`` with tokens), float64."""
    z = logits.to(F64).reshape(-1, logits.shape[-1]) / temperature
    logps, ents, margin = [], [], math.inf
    for r in range(z.shape[0]):
        keep, m = kept_reference(z[r], trunc)
        margin = min(margin, m)
        if tokens is not None:
            keep[tokens.reshape(-1)[r]] = True
        lp = torch.log_softmax(torch.where(keep, z[r], -math.inf), 0)
        logps.append(lp[tokens.reshape(-1)[r]] if tokens is not None else lp[0])
        ents.append(-(lp.exp() * lp.clamp(min=-1e4)).sum())
    shape = logits.shape[:-1]
    return torch.stack(logps).view(shape), torch.stack(ents).view(shape), margin


def vllm_kept(z: torch.Tensor, k: int | None, p: float | None, m: float | None) -> torch.Tensor:
    """vLLM's order and comparisons (min-p on the probabilities; top-k by the k-th value
    of an ascending sort; top-p by the ascending cumulative sum ``<= 1 - p``, the largest
    always kept), restated for ``[rows, vocab]`` scaled logits; the kept mask."""
    z = z.clone()
    if m is not None:
        probs = torch.softmax(z, -1)
        z[probs < m * probs.amax(-1, keepdim=True)] = -math.inf
    asc, idx = z.sort(-1)
    if k is not None:
        kth = asc.gather(1, torch.full((z.shape[0], 1), z.shape[1] - k))
        asc = asc.masked_fill(asc < kth, -math.inf)
    if p is not None:
        cum = asc.softmax(-1).cumsum(-1)
        drop = cum <= 1 - p
        drop[:, -1] = False
        asc = asc.masked_fill(drop, -math.inf)
    return torch.empty_like(z).scatter(1, idx, asc) > -math.inf


# --------------------------------------------------------------------------- strategies


@st.composite
def truncations(draw: st.DrawFn, vocab: int) -> dict[str, float | int | None]:
    top_k = draw(st.one_of(st.none(), st.sampled_from([0, -1]), st.integers(1, vocab + 2)))
    top_p = draw(st.one_of(st.none(), st.floats(0.05, 1.0)))
    min_p = draw(st.one_of(st.none(), st.floats(0.0, 1.0)))
    return {"top_k": top_k, "top_p": top_p, "min_p": min_p}


@st.composite
def logits_rows(draw: st.DrawFn) -> torch.Tensor:
    """[rows, vocab] float64 logits; half the draws on a grid of halves (many ties)."""
    rows, vocab = draw(st.integers(1, 5)), draw(st.integers(1, 12))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if draw(st.booleans()):
        return torch.randint(-4, 5, (rows, vocab), generator=g).to(F64) / 2
    return torch.randn(rows, vocab, generator=g, dtype=F64) * draw(st.sampled_from([0.3, 1.0, 4.0]))


# --------------------------------------------------------------------------- the rules


@settings(max_examples=60)
@given(data=st.data())
def test_logits_path_equals_reference(data: st.DataObject) -> None:
    logits = data.draw(logits_rows())
    rows, vocab = logits.shape
    trunc = data.draw(truncations(vocab))
    temperature = data.draw(st.sampled_from([1.0, 0.7, 1.3]))
    chunk = data.draw(st.sampled_from([None, 1, 2]))
    tokens = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(rows))
    logp_ref, ent_ref, margin = reference(logits, tokens, temperature, trunc)
    _, h_alone, _ = reference(logits, None, temperature, trunc)
    assume(margin > MARGIN)
    opts = {"temperature": temperature, "chunk_size": chunk, **trunc}
    pair = d.token_logprobs_and_entropy(logits, tokens, **opts)
    torch.testing.assert_close(pair.logp, logp_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pair.entropy, ent_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        d.token_logprobs(logits, tokens, **opts), logp_ref, rtol=1e-12, atol=1e-12
    )
    torch.testing.assert_close(
        d.token_entropy(logits, **{k: v for k, v in opts.items()}), h_alone, rtol=1e-12, atol=1e-12
    )
    assert torch.isfinite(pair.logp).all()  # the chosen token always counts: never -inf


@settings(max_examples=40)
@given(data=st.data())
def test_kept_set_is_vllms(data: st.DataObject) -> None:
    """On continuous logits (no ties), the kept set is the one vLLM's sampler keeps."""
    rows, vocab = data.draw(st.integers(1, 6)), data.draw(st.integers(2, 40))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    z = torch.randn(rows, vocab, generator=g, dtype=F64) * data.draw(
        st.sampled_from([0.5, 2.0, 6.0])
    )
    k = data.draw(st.one_of(st.none(), st.integers(1, vocab)))
    p = data.draw(st.one_of(st.none(), st.floats(0.05, 0.999)))
    m = data.draw(st.one_of(st.none(), st.floats(0.001, 1.0)))
    assume(k is not None or p is not None or m is not None)
    trunc = {"top_k": k, "top_p": p, "min_p": m}
    assume(min(kept_reference(row, trunc)[1] for row in z) > MARGIN)
    ours = z >= thresholds(z, Truncation(k, p, m)).unsqueeze(1)
    assert torch.equal(ours, vllm_kept(z, k, p, m))
    assert torch.equal(ours, torch.stack([kept_reference(row, trunc)[0] for row in z]))


def test_rules_by_example() -> None:
    z = torch.tensor([[3.0, 2.0, 2.0, 2.0, 0.0, -1.0]], dtype=F64)
    kept = lambda **kw: (z >= thresholds(z, Truncation(**kw)).unsqueeze(1))[0].tolist()  # noqa: E731
    # top-k: every token tied with the k-th is kept
    assert kept(top_k=2) == [True, True, True, True, False, False]
    # top-p: the token whose mass crosses p is kept, and its ties
    p0 = torch.softmax(z[0], 0)[0].item()
    assert kept(top_p=p0 * 0.999) == [True, False, False, False, False, False]
    assert kept(top_p=p0 * 1.001) == [True, True, True, True, False, False]
    # min-p relative to the largest probability, after the temperature
    assert kept(min_p=1.0) == [True, False, False, False, False, False]
    assert kept(min_p=math.exp(-1.5)) == [True, True, True, True, False, False]
    # min-p first, then top-k on what is left: fewer than k left keeps them all
    assert kept(min_p=math.exp(-1.5), top_k=5) == [True, True, True, True, False, False]
    # top-p on the distribution renormalised after top-k (ties of the k-th included)
    q = torch.softmax(z[0, :4], 0)[0].item()
    assert kept(top_k=2, top_p=q * 1.001) == [True, True, True, True, False, False]
    assert kept(top_k=2, top_p=q * 0.999) == [True, False, False, False, False, False]


def test_token_outside_the_kept_set_counts() -> None:
    """A chosen token outside K: its log-prob over K u {y}, finite, with a finite gradient
    that reaches only K u {y}."""
    logits = torch.tensor([[4.0, 3.0, 0.0, -2.0]], dtype=F64, requires_grad=True)
    logp = d.token_logprobs(logits, torch.tensor([3]), top_k=2)
    expected = -2.0 - torch.logsumexp(torch.tensor([4.0, 3.0, -2.0], dtype=F64), 0)
    torch.testing.assert_close(logp[0], expected)
    logp.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert logits.grad[0, 2] == 0.0  # outside K u {y}: no gradient


def test_off_values_change_nothing_bitwise() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 9, generator=g, requires_grad=True)
    tokens = torch.randint(0, 9, (5,), generator=g)
    hidden, weight = torch.randn(2, 3, 4, generator=g), torch.randn(9, 4, generator=g)
    tok = torch.randint(0, 9, (2, 3), generator=g)
    mask = torch.ones(2, 3, dtype=torch.bool)
    old, adv = torch.full((2, 3), -2.0), torch.tensor([1.0, -0.5])
    for off in (
        {},
        {"top_k": None, "top_p": None, "min_p": None},
        {"top_k": 0, "top_p": 1.0, "min_p": 0.0},
        {"top_k": -1},
    ):
        base = d.token_logprobs_and_entropy(logits, tokens, temperature=0.8)
        got = d.token_logprobs_and_entropy(logits, tokens, temperature=0.8, **off)
        assert torch.equal(base.logp, got.logp) and torch.equal(base.entropy, got.entropy)
        f0 = d.fused_logprobs_entropy(hidden, weight, tok)
        f1 = d.fused_logprobs_entropy(hidden, weight, tok, **off)
        assert torch.equal(f0.logp, f1.logp) and torch.equal(f0.entropy, f1.entropy)
        l0 = d.linear_policy_loss(hidden, weight, tok, old, adv, mask, entropy_coef=0.01)
        l1 = d.linear_policy_loss(hidden, weight, tok, old, adv, mask, entropy_coef=0.01, **off)
        assert torch.equal(l0, l1)


def test_threshold_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """The threshold search by pieces of rows gives the whole block's thresholds."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(13, 30, generator=g, dtype=F64)
    trunc = Truncation(top_k=7, top_p=0.8, min_p=0.01)
    whole = thresholds(z, trunc)
    monkeypatch.setitem(_truncation.THRESHOLD_PIECE_ELEMENTS, "cpu", 64)
    assert torch.equal(thresholds(z, trunc), whole)


# --------------------------------------------------------------------------- fused paths


@settings(max_examples=25)
@given(data=st.data())
def test_fused_and_linear_equal_the_logits_path(data: st.DataObject) -> None:
    batch, seq, dim, vocab = (
        data.draw(st.integers(1, 3)),
        data.draw(st.integers(1, 5)),
        3,
        data.draw(st.integers(2, 11)),
    )
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    hidden = torch.randn(batch, seq, dim, generator=g, dtype=F64)
    weight = torch.randn(vocab, dim, generator=g, dtype=F64)
    if data.draw(st.booleans()):  # ties: logits on a grid
        hidden, weight = hidden.round(), weight.round()
    bias = torch.randn(vocab, generator=g, dtype=F64).round()
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.rand(batch, seq, generator=g) > 0.3
    trunc = data.draw(truncations(vocab))
    temperature = data.draw(st.sampled_from([1.0, 0.7]))
    chunk = data.draw(st.sampled_from([None, 1, 2, 4]))
    logits = hidden @ weight.T + bias
    logp_ref, ent_ref, margin = reference(logits, tokens, temperature, trunc)
    assume(margin > MARGIN)
    opts = {"temperature": temperature, "chunk_size": chunk, **trunc}
    fused = d.fused_logprobs_entropy(hidden, weight, tokens, bias=bias, **opts)
    torch.testing.assert_close(fused.logp, logp_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fused.entropy, ent_ref, rtol=1e-10, atol=1e-10)
    # linear_policy_loss: -100 ids and NaN hidden rows at masked positions change nothing
    objective = data.draw(st.sampled_from([d.ClipHigher(), d.GSPO()]))
    old, adv = torch.full((batch, seq), -1.5, dtype=F64), torch.randn(batch, generator=g, dtype=F64)
    h = hidden.clone().masked_fill(~mask[..., None], math.nan).requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    ids = torch.where(mask, tokens, -100)
    loss = d.linear_policy_loss(
        h, w, ids, old, adv, mask, objective=objective, bias=bias, entropy_coef=0.01, **opts
    )
    loss.backward()
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    pair = d.token_logprobs_and_entropy(h2 @ w2.T + bias, tokens, **opts)
    ref = d.policy_loss(objective, pair.logp, old, adv, mask) + d.entropy_bonus(
        pair.entropy, mask, coef=0.01
    )
    ref.backward()
    assert h.grad is not None and w.grad is not None and h2.grad is not None and w2.grad is not None
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------- gradients

TRUNCS = [{"top_k": 3}, {"top_p": 0.7}, {"min_p": 0.1}, {"top_k": 4, "top_p": 0.8, "min_p": 0.05}]


@pytest.mark.parametrize("trunc", TRUNCS)
def test_gradcheck(trunc: dict) -> None:
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(6, 10, generator=g, dtype=F64) * 2).requires_grad_(True)
    tokens = torch.randint(0, 10, (6,), generator=g)

    def both(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(
            d.token_logprobs_and_entropy(x, tokens, temperature=0.7, chunk_size=4, **trunc)
        )

    assert torch.autograd.gradcheck(both, (logits,))
    assert torch.autograd.gradgradcheck(both, (logits,), fast_mode=True)
    hidden, weight, bias, tok = projection_leaves(g, (2, 3), 4, 10)

    def fused(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(d.fused_logprobs_entropy(h, w, tok, bias=b, chunk_size=4, **trunc))

    assert torch.autograd.gradcheck(fused, (hidden, weight, bias))
    mask = torch.tensor([[True, True, False], [True, False, False]])
    old, adv = torch.full((2, 3), -2.0, dtype=F64), torch.tensor([1.0, -1.0], dtype=F64)

    def linear(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return d.linear_policy_loss(
            h, w, tok, old, adv, mask, entropy_coef=0.02, chunk_size=2, **trunc
        )

    assert torch.autograd.gradcheck(linear, (hidden, weight))
    assert torch.autograd.gradgradcheck(linear, (hidden, weight), fast_mode=True)


def test_inplace_backward_same_gradient() -> None:
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(7, 12, generator=g)
    tokens = torch.randint(0, 12, (7,), generator=g)
    grads = []
    for inplace in (False, True):
        x = logits.clone().requires_grad_(True)
        y = x * 1.0  # a non-leaf buffer the in-place backward may overwrite
        y.retain_grad()
        out = d.token_logprobs_and_entropy(y, tokens, inplace_backward=inplace, top_k=5, top_p=0.9)
        (out.logp.sum() + 0.1 * out.entropy.sum()).backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


# --------------------------------------------------------------------------- compile, errors


@pytest.mark.usefixtures("no_runtime_typecheck")
def test_compile_fullgraph() -> None:
    g = torch.Generator().manual_seed(9)
    hidden, weight = torch.randn(6, 4, generator=g), torch.randn(15, 4, generator=g)
    tokens = torch.randint(0, 15, (6,), generator=g)
    opts = {"top_k": 6, "top_p": 0.8, "min_p": 0.02, "chunk_size": 4}

    mask, old, adv = torch.ones(2, 3, dtype=torch.bool), torch.full((2, 3), -2.0), torch.ones(2)

    def step(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        fused = d.fused_logprobs_entropy(h, w, tokens, **opts)
        pair = d.token_logprobs_and_entropy(h @ w.T, tokens, **opts)
        loss = d.linear_policy_loss(h.view(2, 3, 4), w, tokens.view(2, 3), old, adv, mask, **opts)
        return fused.logp.sum() + 0.1 * fused.entropy.sum() + pair.logp.sum() + loss

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (step, compiled):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = fn(h, w)
        out.backward()
        results.append((out, h.grad, w.grad))
    for eager, comp in zip(*results, strict=True):
        torch.testing.assert_close(comp, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "value"),
    [("top_k", -2), ("top_k", 2.5), ("top_k", True), ("top_k", "3"), ("top_p", 0.0), ("top_p", 1.5),
     ("top_p", math.nan), ("top_p", "0.9"), ("min_p", -0.1), ("min_p", 1.5), ("min_p", math.inf), ("min_p", True)],
)  # fmt: skip
@pytest.mark.usefixtures("no_runtime_typecheck")  # the library's own checks, as for users
def test_bad_options_name_the_option(name: str, value: object) -> None:
    logits, tokens = torch.zeros(2, 5), torch.zeros(2, dtype=torch.long)
    calls = [
        lambda kw: d.token_logprobs(logits, tokens, **kw),
        lambda kw: d.token_entropy(logits, **kw),
        lambda kw: d.fused_logprobs_entropy(torch.zeros(2, 3), torch.zeros(5, 3), tokens, **kw),
        lambda kw: d.linear_policy_loss(
            torch.zeros(1, 2, 3), torch.zeros(5, 3), tokens[None], torch.zeros(1, 2),
            torch.zeros(1), torch.ones(1, 2, dtype=torch.bool), **kw,
        ),
    ]  # fmt: skip
    for call in calls:
        with pytest.raises(InputError, match=name):
            call({name: value})


@pytest.mark.parametrize("backend", ["two_pass", pytest.param("triton", marks=pytest.mark.triton)])
def test_two_pass_truncation_equals_the_chunked_path(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """The two-pass backends truncate too (the thresholds as raw logits, decided once over
    kept logits): log-probs, entropies and gradients equal the chunked path's in float64,
    with a cap and a temperature, every rule alone and combined."""
    if backend == "triton":
        pytest.importorskip("triton")
        request.getfixturevalue("triton_interpreter")
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 3, 8, generator=g, dtype=F64)
    weight, bias = (
        torch.randn(11, 8, generator=g, dtype=F64),
        torch.randn(11, generator=g, dtype=F64),
    )
    tokens = torch.randint(0, 11, (2, 3), generator=g)
    for option in TRUNCS:
        got, want = (
            _fused_grads(hidden, weight, bias, tokens, option, b) for b in (backend, "chunked")
        )
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


def _fused_grads(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                 tokens: torch.Tensor, option: dict, backend: str) -> list[torch.Tensor]:  # fmt: skip
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = d.fused_logprobs_entropy(
        h, w, tokens, bias=bias, temperature=0.8, softcap=4.0, backend=backend, **option
    )
    (out.logp.sum() + 0.3 * out.entropy.sum()).backward()
    assert h.grad is not None and w.grad is not None
    return [out.logp.detach(), out.entropy.detach(), h.grad, w.grad]
