r"""Token log-probs and entropy without the ``[tokens, vocab]`` float32 copies.

The policy loss needs, for every response token, :math:`\log\pi(y_t)` and often the
entropy :math:`H_t` of the next-token distribution. The usual code
(``logits.float().log_softmax(-1).gather(...)``, ``-(p * logp).sum(-1)``) materialises
several ``[tokens, vocab]`` float32 tensors on top of the logits, and autograd keeps them
for the backward pass. The functions here work on blocks of rows:

- :func:`token_logprobs`, :func:`token_entropy`, :func:`token_logprobs_and_entropy` take
  the logits; they save only a reference to them (plus the log-sum-exp and the entropy,
  one float each per row, when the entropy is computed) and recompute the softmax in
  backward, a few rows at a time, inside the gradient buffer itself
  (:mod:`dapo_ops.logprobs._logits_path`). ``inplace_backward=True`` writes the gradient into the
  logits buffer itself.
- :func:`fused_logprobs_entropy` takes the last hidden states and the output projection:
  the two-pass design (:mod:`dapo_ops.logprobs._two_pass`: cuBLAS products and one fused
  row kernel per pass, the logits kept in the input dtype or formed again) or chunks of
  rows (:mod:`dapo_ops.logprobs._fused_linear`), the machinery
  :func:`dapo_ops.linear_policy_loss` shares.

Softmax math runs in float32 per block (float64 for float64 input); outputs are float32
(float64); gradients come back in the input dtype. The derivation and the memory
accounting are in ``docs/logprobs.md``.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxtyping import Float, Integer
from torch import Tensor

from dapo_ops.logprobs._backends import Backend
from dapo_ops.logprobs._fused_call import FusedOptions, fused_run
from dapo_ops.logprobs._logits_path import from_logits

__all__ = [
    "LogpEntropy",
    "fused_logprobs_entropy",
    "token_entropy",
    "token_logprobs",
    "token_logprobs_and_entropy",
]


class LogpEntropy(NamedTuple):
    """Per-token log-prob of the chosen token and entropy of the distribution (nats)."""

    logp: Float[Tensor, " tokens"] | Float[Tensor, "batch seq"]
    entropy: Float[Tensor, " tokens"] | Float[Tensor, "batch seq"]


def token_logprobs(
    logits: Float[Tensor, "tokens vocab"] | Float[Tensor, "batch seq vocab"],
    tokens: Integer[Tensor, " tokens"] | Integer[Tensor, "batch seq"],
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    inplace_backward: bool = False,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
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
        top_k, top_p, min_p: the rollout sampler's truncation, with vLLM's rules and
            off values (``None``, the default, or ``top_k`` 0 / -1, ``top_p`` 1,
            ``min_p`` 0: nothing changes, bit for bit). After the temperature, min-p keeps
            :math:`p_v \ge` ``min_p`` :math:`\max p`, top-k the ``top_k`` largest logits
            and every token tied with the last, top-p the smallest prefix of what is left
            whose mass reaches ``top_p`` (ties with its last token included); the
            log-prob is renormalised over that kept set :math:`K`:
            :math:`z_y/T - \log\sum_{v \in K \cup \{y\}} e^{z_v/T}`. The chosen token
            always counts (a token outside :math:`K` gets its log-prob over
            :math:`K \cup \{y\}`: finite, never ``-inf``). Gradients are exact for the
            kept set (piecewise constant in the logits). Costs a ``topk`` per row, a sort
            per row for ``top_p`` without ``top_k``; ``docs/logprobs.md``.

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
    logp, _ = from_logits(
        logits, tokens, temperature, chunk_size, False, inplace_backward, top_k, top_p, min_p
    )
    return logp


def token_entropy(
    logits: Float[Tensor, "tokens vocab"] | Float[Tensor, "batch seq vocab"],
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
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
    ``temperature``, ``chunk_size`` and ``top_k``, ``top_p``, ``min_p`` (the entropy of
    the distribution renormalised over the kept set) as in :func:`token_logprobs`. When the loss also
    needs log-probs, :func:`token_logprobs_and_entropy` gets both in one pass.

    Example:
        >>> token_entropy(torch.zeros(2, 4))  # uniform over 4: log 4
        tensor([1.3863, 1.3863])
    """
    _, entropy = from_logits(
        logits, None, temperature, chunk_size, True, False, top_k, top_p, min_p
    )
    return entropy


def token_logprobs_and_entropy(
    logits: Float[Tensor, "tokens vocab"] | Float[Tensor, "batch seq vocab"],
    tokens: Integer[Tensor, " tokens"] | Integer[Tensor, "batch seq"],
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    inplace_backward: bool = False,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
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

    Shapes, dtypes, options and the id range check (one host sync, skipped under
    ``torch.compile``) as in :func:`token_logprobs`; with ``top_k``, ``top_p`` or
    ``min_p`` both come from the distribution renormalised over :math:`K \cup \{y\}`. Returns
    ``LogpEntropy(logp, entropy)``, a named tuple of two ``[tokens]`` or ``[batch, seq]``
    float32 tensors.

    Example:
        >>> logits = torch.tensor([[2.0, 0.0, 0.0]])
        >>> token_logprobs_and_entropy(logits, torch.tensor([0]))
        LogpEntropy(logp=tensor([-0.2395]), entropy=tensor([0.6656]))
    """
    logp, entropy = from_logits(
        logits, tokens, temperature, chunk_size, True, inplace_backward, top_k, top_p, min_p
    )
    return LogpEntropy(logp, entropy)


def fused_logprobs_entropy(
    hidden: Float[Tensor, "tokens d"] | Float[Tensor, "batch seq d"],
    weight: Float[Tensor, "vocab d"],
    tokens: Integer[Tensor, " tokens"] | Integer[Tensor, "batch seq"],
    *,
    bias: Float[Tensor, " vocab"] | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    backend: Backend = "auto",
    keep_logits: bool | None = None,
    vocab_group: object = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    softcap: float | None = None,
) -> LogpEntropy:
    r"""Log-probs and entropies straight from hidden states: no float32 logits tensor.

    For ``z = hidden @ weight.T (+ bias)``, in float32 (float64 for float64 input),
    :math:`\ell = \log\mathrm{softmax}(\mathrm{cap}(z)/T)`, :math:`\log\pi(y_t) =
    \ell_{t,y_t}` and :math:`H_t = -\sum_v e^{\ell_{t,v}}\ell_{t,v}`; backward, for the
    incoming gradients :math:`g^{\log p}` and :math:`g^H`,

    .. math::

        G = \frac{1}{T}\big(g^{\log p}(\mathrm{onehot}(y) - p) - g^{H} p (\log p + H)\big),
        \quad \partial_{hidden} = G\,W,\quad \partial_W = G^\top h,
        \quad \partial_b = G^\top \mathbf{1}

    (times :math:`1 - \tanh^2(z/c)` with a cap). Gradients are exact and reach both
    outputs. Two designs (``backend``, as :func:`dapo_ops.linear_policy_loss`'s):

    - **two-pass** (``"triton"``, ``"two_pass"``; ``"auto"`` on CUDA): forward forms the
      logits by cuBLAS products and one fused row kernel keeps per token ``log p_y``,
      ``H`` and the log-sum-exp; backward writes ``G`` over the logits with a second row
      kernel, then ``G W`` and ``G^T h``. ``keep_logits=True`` keeps the ``[tokens,
      vocab]`` logits in the input dtype from forward to backward (3 products in all);
      ``False`` forms them again (4 products, one reused buffer of ``2**27`` elements on
      a GPU, ``2**24`` on CPU; ``dW`` written a vocabulary slice at a time, ``dh`` summed
      in float32); ``None`` (default) keeps them up to 4 GiB (``KEEP_LOGITS_BYTES``).
    - **chunked** (``"chunked"``; ``"auto"`` on CPU and under ``torch.compile``): a
      chunk of ``chunk_size`` rows at a time, one fused ``log_softmax`` over the chunk
      buffer (in place on CPU), only the entropies kept for backward, which forms each
      chunk's logits again: 4 products, one ``[chunk, vocab]`` float32 buffer, the
      weight and bias gradients summed over chunks in float32. When the loss is a policy
      loss, :func:`dapo_ops.linear_policy_loss` needs only 3 on this backend.

    Shapes: hidden ``[tokens, d]`` or ``[batch, seq, d]``; weight ``[vocab, d]`` (the
    ``lm_head.weight``; with ``vocab_group`` this rank's rows); tokens ``[tokens]`` or
    ``[batch, seq]`` with ids in ``[0, vocab)`` (checked with one host sync, eager only,
    as in :func:`token_logprobs`); bias ``[vocab]`` or None. hidden, weight and bias
    share one floating dtype and device. Returns ``LogpEntropy(logp, entropy)``, float32
    (float64 for float64 input), shaped like ``tokens``; gradients come back in the input
    dtype. With ``vocab_group`` the two small object exchanges of
    :func:`dapo_ops.linear_policy_loss` come on top of the host sync.

    Options:
        temperature: logits are divided by ``T > 0`` (default 1).
        backend: ``"auto"`` (default), ``"triton"``, ``"two_pass"`` or ``"chunked"``, as
            in :func:`dapo_ops.linear_policy_loss` (``keep_logits`` and ``vocab_group``
            pick a two-pass one on CPU; under ``torch.compile`` ``"two_pass"`` traces,
            ``"triton"`` and ``vocab_group`` run eagerly only).
        keep_logits: the two-pass memory setting, as above: True, False, or None
            (default: by size, ``tokens x vocab x`` the dtype's size at most 4 GiB).
        chunk_size: the chunked backend's rows per chunk (giving it picks that backend);
            ``None`` picks ``max(1, E // vocab)`` rows with ``E = 2**25`` on CPU (1048 rows
            at vocab 32000, 220 at 152064) and ``2**27`` on GPUs (882 rows at 152064):
            enough rows that adding each chunk's ``G.T @ h`` to the weight gradient (a
            read and write of ``[vocab, d]``) costs little next to its FLOPs.
        vocab_group: a process group whose ranks split the vocabulary (None, default:
            not split), as in :func:`dapo_ops.linear_policy_loss`: ``weight`` this rank's
            contiguous rows, global ids; both outputs are the whole vocabulary's on every
            rank (pass 1's pieces merged by two all-reduces of ``[tokens]`` vectors), the
            hidden gradient this rank's partial sum; no truncation, no double backward
            (``docs/tensor_parallel.md``).
        top_k, top_p, min_p: the sampler's truncation, as in :func:`token_logprobs`
            (log-probs and entropies over :math:`K \cup \{y\}`), exact on full rows; the
            per-row thresholds are saved (as raw logits on the two-pass backends), so
            backward keeps the same set.
        softcap: the final-logit cap ``c > 0`` (None: off, bit for bit as without):
            ``z -> c tanh(z / c)`` before the temperature (Gemma-2's
            ``final_logit_softcapping``), as in :func:`dapo_ops.linear_policy_loss`.

    Double backward (``create_graph=True``) is supported as in :func:`token_logprobs`
    (not with ``vocab_group``): the gradient is then formed from the whole ``hidden @
    weight.T`` with differentiable ops. hidden, weight and bias are saved with
    ``save_for_backward``: modifying one in place before backward raises instead of
    giving a different gradient.

    Example:
        >>> hidden, weight = torch.randn(6, 8), torch.randn(32, 8)
        >>> tokens = torch.randint(0, 32, (6,))
        >>> logp, entropy = fused_logprobs_entropy(hidden, weight, tokens, chunk_size=4)
        >>> ref = torch.log_softmax(hidden @ weight.T, -1).gather(-1, tokens[:, None])
        >>> torch.allclose(logp, ref.squeeze(-1), atol=1e-5)
        True
    """
    opts: FusedOptions = {  # a plain dict: torch.compile traces it
        "bias": bias, "temperature": temperature, "chunk_size": chunk_size, "backend": backend,
        "keep_logits": keep_logits, "vocab_group": vocab_group, "top_k": top_k, "top_p": top_p,
        "min_p": min_p, "softcap": softcap,
    }  # fmt: skip
    logp, entropy = fused_run(hidden, weight, tokens, opts)
    return LogpEntropy(logp, entropy)
