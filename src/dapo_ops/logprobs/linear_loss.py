r"""``linear_policy_loss``: from the last hidden states to the policy loss in one call.

What a trainer runs per micro-batch is ``hidden -> lm_head -> log-probs -> loss ->
backward``. Here the loss is part of the call, so the gradient of the logits is formed
from ``[tokens]`` vectors the engine computes between two passes over them: the
two-pass design (:mod:`dapo_ops.logprobs._two_pass`, the logits kept or formed again,
``keep_logits``) or, on CPU and under ``torch.compile``, chunks whose gradients are
formed in the forward pass (:mod:`dapo_ops.logprobs._linear_loss`). The checks and the
dispatch are in :mod:`dapo_ops.logprobs._linear_call`; the derivation and the
memory/time arithmetic in ``docs/linear_loss.md``.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxtyping import Bool, Float, Integer
from torch import Tensor
from typing_extensions import Unpack

from dapo_ops._core._checked import checks_values
from dapo_ops._core._rules import AggregationMode, Normalizer
from dapo_ops.diagnostics.measures import PolicyDiagnostics, objective_diagnostics
from dapo_ops.engine.kl import KLPenalty
from dapo_ops.logprobs._backends import Backend
from dapo_ops.logprobs._linear_call import DAPO_CLIP, LinearOptions, run
from dapo_ops.logprobs._packing import from_grid
from dapo_ops.objectives import Objective

__all__ = [
    "LinearDiagnostics",
    "linear_policy_loss",
    "linear_policy_loss_with_diagnostics",
]


class LinearDiagnostics(NamedTuple):
    """What :func:`linear_policy_loss_with_diagnostics` measured on the way, detached.

    ``policy``: :class:`PolicyDiagnostics` (clip counts and fractions, ratio statistics,
    approximate KL, and the entropy's sum over the valid tokens: ``policy.entropy`` is
    its mean), 0-dim float64 tensors that add across micro-batches and ranks. ``logp``
    and ``entropy``: the per-token log-probs and entropies the loss used, ``[batch,
    seq]`` (``[1, total]`` with ``cu_seqlens``) in float32 (float64 for float64 hidden
    states), for logging or as the next step's ``old_logp`` (at masked positions: those
    of a zero hidden row, unused). No host sync.
    """

    policy: PolicyDiagnostics
    logp: Float[Tensor, "batch seq"]
    entropy: Float[Tensor, "batch seq"]


@checks_values
def linear_policy_loss(
    hidden: Float[Tensor, "batch seq d"],
    weight: Float[Tensor, "vocab d"],
    tokens: Integer[Tensor, "batch seq"],
    old_logp: Float[Tensor, "batch seq"],
    advantages: Float[Tensor, " batch"]
    | Float[Tensor, "batch 1"]
    | Float[Tensor, "batch seq"]
    | Float[Tensor, " seqs"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    objective: Objective = DAPO_CLIP,
    bias: Float[Tensor, " vocab"] | None = None,
    temperature: float = 1.0,
    mode: AggregationMode = "token_mean",
    normalizer: Normalizer = None,
    max_len: int | None = None,
    ref_logp: Float[Tensor, "batch seq"] | None = None,
    kl: KLPenalty | None = None,
    is_weights: Float[Tensor, "batch seq"] | None = None,
    entropy_coef: float | Float[Tensor, ""] = 0.0,
    chunk_size: int | None = None,
    backend: Backend = "auto",
    keep_logits: bool | None = None,
    vocab_group: object = None,
    skip_padding: bool | int = False,
    cu_seqlens: Integer[Tensor, " seqs_plus_1"] | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    softcap: float | None = None,
) -> Float[Tensor, ""]:
    r"""The policy loss straight from the last hidden states, without a float32 logits tensor.

    .. math::

        \log\pi_{i,t} = \log\mathrm{softmax}\big(\mathrm{cap}(h_{i,t} W^\top + b)/T\big)_{y_{i,t}},
        \qquad
        \mathcal{L} = \mathrm{policy\_loss}(\log\pi, \ldots)
            - c\cdot\mathrm{agg}(H, m)

    with :func:`policy_loss`'s composition (``objective``'s term, ``is_weights``, the
    ``kl`` penalty against ``ref_logp``, aggregation ``mode`` with ``normalizer`` and
    ``max_len``) and the entropy bonus ``c = entropy_coef`` times the entropy
    :math:`H_{i,t}` of the same distribution, aggregated the same way (verl's actor:
    ``pg_loss - entropy_coeff * agg_loss(entropy)``; :func:`entropy_bonus`). It equals
    ``h @ W.T`` -> ``log_softmax`` -> ``gather`` -> :func:`policy_loss` (minus the
    bonus), values and gradients, for every objective (sequence-level ones included).
    Two designs compute it (``backend``; derivation and arithmetic in
    ``docs/linear_loss.md``):

    - **two-pass** (``"triton"``, ``"two_pass"``; ``"auto"`` on CUDA): pass 1 forms the
      logits by cuBLAS products and one fused row kernel gives each token's
      :math:`\log\pi`, :math:`H` and log-sum-exp; the engine turns these ``[batch, seq]``
      vectors into the loss, ``a = d loss / d logp`` and ``b = d loss / d H``; backward's
      pass 2 writes :math:`G = (a(\delta_y - p) - b\,p(\log p + H))/T` over the logits
      (one row kernel) and multiplies, ``dh = G W``, ``dW = G^T h``, ``db = G^T 1``.
      Memory (``keep_logits``): kept, the ``[tokens, vocab]`` logits in the input dtype
      live from forward to backward, 3 products (the naive path's count); formed again,
      4 products and one reused buffer of ``BUDGET_ELEMENTS`` (``2**27`` elements on a
      GPU, 256 MiB of bfloat16; ``2**24`` on CPU), pass 2 walking vocabulary slices that
      each write their rows of ``dW`` once, ``dh`` summed in float32. No float32
      ``[vocab, d]`` buffer in either.
    - **chunked** (``"chunked"``; ``"auto"`` on CPU and under ``torch.compile``): a chunk
      of tokens at a time, its logits, log-probs, entropies, the engine's ``a`` and at
      once its ``dh`` and its share of ``dW``, all in the forward pass (backward only
      scales them): 3 products, one ``[chunk, vocab]`` float32 buffer (plus one in the
      input dtype for bfloat16/float16, and a small scratch for the entropy), the weight
      gradient summed over chunks in float32. Token-local objectives are chunked by
      tokens, the others (GSPO, GMPO, VESPO, yours) by whole sequences, a sequence longer
      than a chunk walked twice (4 products for its rows); objectives without ``grad``
      are differentiated by autograd, a chunk at a time.

    Shapes: hidden ``[batch, seq, d]``; weight ``[vocab, d]`` (``lm_head.weight``; with
    ``vocab_group`` this rank's rows); bias ``[vocab]`` or None (one dtype and device
    with hidden); tokens ``[batch, seq]`` integer ids in ``[0, vocab)`` at unmasked
    positions (masked ones may hold anything, e.g. -100); old_logp, mask, ref_logp,
    is_weights ``[batch, seq]``; advantages ``[batch]``, ``[batch, 1]`` or ``[batch,
    seq]``. With ``cu_seqlens`` the packed layout: hidden ``[1, total, d]``, the
    per-token inputs ``[1, total]``, advantages ``[1, total]`` or one per sequence
    ``[seqs]``. Returns a 0-dim float32 loss (float64 if hidden, old_logp or the
    advantages are float64); gradients reach hidden, weight and bias in their dtype
    (bfloat16/float16 products run in it, the softmax and the loss in float32).

    Masked positions reach neither the loss nor any gradient, whatever they hold (NaN
    hidden rows included). With ``normalizer=global_normalizer(masks, mode=...)`` the
    losses and gradients of a step's micro-batches and ranks add up to the whole
    batch's. ``old_logp``, ``advantages``, ``ref_logp``, ``is_weights``, a ``normalizer``
    or ``entropy_coef`` tensor must not require grad. Host syncs (eager only): the
    unmasked ids' range check, one; ``skip_padding=True`` one more (the count);
    ``cu_seqlens`` one (its boundaries read); ``vocab_group`` two small object exchanges
    among its ranks (sizes, shapes and options, then the checks' verdicts).

    Options (defaults: ``ClipHigher()`` with DAPO's ``eps_low=0.2, eps_high=0.28`` and
    ``mode="token_mean"``, DAPO sec. 3.1 and 3.3; the loss options as :func:`policy_loss`):
        objective: any :class:`Objective` value.
        temperature: the sampling temperature ``T > 0``; the logits are divided by it.
        entropy_coef: ``c``, a finite number or a 0-dim tensor (e.g. from
            :func:`adaptive_entropy_coef`); 0 adds no term (the chunked backend then
            computes no entropy).
        backend: ``"auto"`` (default): ``"triton"`` on CUDA (``"two_pass"`` without
            Triton); ``"chunked"`` on CPU and under ``torch.compile``, unless an option
            only the two-pass design has is given (``keep_logits``, ``vocab_group``,
            ``skip_padding``, ``cu_seqlens``: then ``"two_pass"``); ``chunk_size`` picks
            ``"chunked"``. ``"triton"``: the Triton row kernels of :mod:`dapo_ops.kernels`
            (CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``); ``"two_pass"``: the
            same design with ATen row functions, any device, and under
            ``torch.compile`` (``"triton"`` runs eagerly only).
        keep_logits: the two-pass memory setting: ``True`` keeps the logits (3 products),
            ``False`` forms them again (4 products, one buffer); ``None`` (default) keeps
            them when rows x vocab x the input dtype's size is at most
            ``KEEP_LOGITS_BYTES`` = 4 GiB (8192 x 151936 bfloat16 is 2.3 GiB; rows: those
            the passes run, vocab: this rank's).
        chunk_size: the chunked backend's tokens per chunk (giving it picks that
            backend); ``None``: ``max(1, E // vocab)`` with ``E = 2**25`` on CPU, ``2**27``
            on GPUs (:func:`fused_logprobs_entropy`'s).
        vocab_group: a ``torch.distributed`` process group whose ranks split the
            vocabulary (None, default: not split). ``weight`` (and ``bias``) holds this
            rank's contiguous rows, slices in rank order of any sizes; ``tokens`` global
            ids; every rank passes the same hidden states and per-token inputs. The
            loss, log-probs and entropies are the whole vocabulary's on every rank; the
            hidden gradient is this rank's partial sum, which Megatron's column-parallel
            backward all-reduces (outside Megatron, sum it over the group). Bad input
            raises the same ``InputError`` on every rank. Two-pass backends, no
            truncation, no double backward (``docs/tensor_parallel.md``).
        skip_padding: ``False`` (default): every position runs. ``True``: the products
            and row kernels run on the valid tokens only (counted: one host sync); an
            ``int``: the caller's count of them (no sync; below the valid tokens the loss
            is NaN, and checked mode raises). Same results (``docs/padding.md``).
        cu_seqlens: the boundaries ``[seqs + 1]`` (``0, l_0, l_0 + l_1, ..., total``;
            flash-attention's and verl's remove-padding format) of packed inputs (None,
            default: not packed). The engine sees a ``[seqs, max_len]`` grid: sequence
            objectives and the seq-mean modes work; the products run on the packed rows.
        top_k, top_p, min_p: the rollout sampler's truncation (vLLM's rules; None: off,
            bit for bit today's loss): :math:`\log\pi` and :math:`H` of the distribution
            renormalised over the kept set and the chosen token, as in
            :func:`token_logprobs`; gradients exact for the kept set (on the two-pass
            backends its threshold is held as a raw logit: ``docs/linear_loss.md``).
        softcap: the model's final-logit cap ``c > 0`` (Gemma-2's
            ``final_logit_softcapping``, e.g. 30.0; Liger's ``softcap``): the logits are
            :math:`\mathrm{cap}(z) = c\tanh(z/c)` before the temperature, as vLLM samples
            them; gradients through :math:`1 - \tanh^2(z/c)`, on every backend. None
            (default): no cap, bit for bit as without; set, one more ``[chunk, vocab]``
            buffer on the chunked backend.

    Double backward (``create_graph=True``) differentiates the definition (the whole
    logits, the naive path's memory; not with ``vocab_group``, ``skip_padding`` or
    ``cu_seqlens``). Under ``torch.compile(fullgraph=True)`` the chunked backend is
    traced as functional ops (objectives with ``grad``), and ``"two_pass"`` as it runs
    (``skip_padding`` with its count too); ``skip_padding=True``, ``cu_seqlens`` and
    ``vocab_group`` read sizes on the host and are refused there by name.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> hidden = torch.randn(2, 5, 8, generator=g, requires_grad=True)
        >>> weight = torch.randn(32, 8, generator=g, requires_grad=True)
        >>> tokens = torch.randint(0, 32, (2, 5), generator=g)
        >>> mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]).bool()
        >>> from dapo_ops import fused_logprobs_entropy
        >>> with torch.no_grad():
        ...     old = fused_logprobs_entropy(hidden, weight, tokens).logp
        >>> loss = linear_policy_loss(hidden, weight, tokens, old, torch.tensor([1.0, -1.0]), mask)
        >>> loss.backward()
        >>> hidden.grad.shape, weight.grad.shape
        (torch.Size([2, 5, 8]), torch.Size([32, 8]))
    """
    options: LinearOptions = {  # a plain dict: torch.compile traces it
        "objective": objective, "bias": bias, "temperature": temperature, "mode": mode,
        "normalizer": normalizer, "max_len": max_len, "ref_logp": ref_logp, "kl": kl,
        "is_weights": is_weights, "entropy_coef": entropy_coef, "chunk_size": chunk_size,
        "backend": backend, "keep_logits": keep_logits, "vocab_group": vocab_group,
        "skip_padding": skip_padding, "cu_seqlens": cu_seqlens,
        "top_k": top_k, "top_p": top_p, "min_p": min_p, "softcap": softcap,
    }  # fmt: skip
    return run(hidden, weight, tokens, old_logp, advantages, mask, options, False).loss


@checks_values
def linear_policy_loss_with_diagnostics(
    hidden: Float[Tensor, "batch seq d"],
    weight: Float[Tensor, "vocab d"],
    tokens: Integer[Tensor, "batch seq"],
    old_logp: Float[Tensor, "batch seq"],
    advantages: Float[Tensor, " batch"]
    | Float[Tensor, "batch 1"]
    | Float[Tensor, "batch seq"]
    | Float[Tensor, " seqs"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    **options: Unpack[LinearOptions],
) -> tuple[Float[Tensor, ""], LinearDiagnostics]:
    """:func:`linear_policy_loss` (same arguments and keyword options) and what it saw.

    Returns ``(loss, LinearDiagnostics(policy, logp, entropy))``:
    :func:`objective_diagnostics` of the objective on the log-probs the loss used (clip
    fractions, ratio statistics, approximate KL) with the entropy's sum (``.entropy``:
    its mean over the valid tokens), and those log-probs and entropies, all detached
    and on the device (no host sync beyond :func:`linear_policy_loss`'s). With
    ``cu_seqlens`` ``logp`` and ``entropy`` come in the packed ``[1, total]`` layout of
    the arguments. On the chunked backend the entropies cost one more pass over each
    chunk and a small scratch buffer; the two-pass backends have them from pass 1.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> hidden, weight = torch.randn(1, 3, 4, generator=g), torch.randn(10, 4, generator=g)
        >>> tokens, mask = torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.bool)
        >>> loss, d = linear_policy_loss_with_diagnostics(
        ...     hidden, weight, tokens, torch.full((1, 3), -2.0), torch.tensor([1.0]), mask)
        >>> tuple(d.logp.shape), bool(d.policy.entropy > 0)
        ((1, 3), True)
    """
    r = run(hidden, weight, tokens, old_logp, advantages, mask, options, True)
    objective = options.get("objective", DAPO_CLIP)
    policy = objective_diagnostics(objective, r.logp, r.old_logp, r.advantages, r.mask, entropy=r.entropy)  # fmt: skip
    logp, entropy = r.logp.detach(), r.entropy.detach()
    if r.packed is not None:  # back to the packed [1, total] layout of the arguments
        logp, entropy = from_grid(logp, r.packed), from_grid(entropy, r.packed)
    return r.loss, LinearDiagnostics(policy, logp, entropy)
