r"""``linear_policy_loss``: from the last hidden states to the policy loss in one pass.

What a trainer runs per micro-batch is ``hidden -> lm_head -> log-probs -> loss ->
backward``. Composed from :func:`dapo_ops.fused_logprobs_entropy` and
:func:`dapo_ops.policy_loss`, the log-probs' backward must form every chunk's logits
again (the loss's gradient is not known in their forward): 4 matmuls over
``[tokens, vocab]``. Here the loss is known, so each chunk's gradient is formed in the
forward pass, while its logits are at hand: 3 matmuls, and no ``[tokens, vocab]`` tensor
ever whole (:mod:`dapo_ops.logprobs._linear_loss`). The derivation and the memory/time trade-off
are in ``docs/linear_loss.md``.
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
    seq]`` in float32 (float64 for float64 hidden states), for logging or as the next
    step's ``old_logp`` (at masked positions: those of a zero hidden row, unused). No
    host sync.
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
    r"""The policy loss straight from the last hidden states: 3 matmuls, no logits tensor.

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
    bonus), and its gradients equal that path's, but the tokens are walked in chunks: a
    chunk's logits, log-probs and entropies, the objective's ``d loss / d logp``
    through the engine, and at once the chunk's ``grad_hidden = G W`` and its share of
    ``grad_weight = G^T h`` (``G`` the gradient w.r.t. the chunk's logits). Backward
    only scales those by the incoming gradient. See ``docs/linear_loss.md``.

    Memory: beyond the inputs, the weight gradient (``[vocab, d]``, summed in float32)
    and one chunk's ``[chunk, vocab]`` float32 buffer, plus a small scratch when the
    entropy is needed (``entropy_coef`` or the diagnostics); never a ``[tokens, vocab]``
    tensor. Time: 3 matmuls of ``[tokens, d] x [d, vocab]``, against 4 for
    :func:`fused_logprobs_entropy` then :func:`policy_loss`.

    Every objective works: chunks of tokens for those whose per-token loss reads only
    its token (Clip-Higher, CISPO, SAPO, DPPO, DRO, REINFORCE, the ratio surrogate),
    whole sequences for the others (GSPO, GMPO, VESPO, your own), a sequence longer than
    a chunk walked twice (its logits formed again: 4 matmuls for those rows). Objectives
    without ``grad`` are differentiated by autograd, one chunk at a time.

    Shapes: hidden ``[batch, seq, d]``; weight ``[vocab, d]`` (``lm_head.weight``); bias
    ``[vocab]`` or None (one dtype and device with hidden); tokens ``[batch, seq]``
    integer ids in ``[0, vocab)`` at unmasked positions (checked with one host sync,
    eager only; masked positions may hold anything, e.g. -100); old_logp, mask, ref_logp,
    is_weights ``[batch, seq]``; advantages ``[batch]``, ``[batch, 1]`` or
    ``[batch, seq]``. Returns a 0-dim float32 loss (float64 if hidden, old_logp or the
    advantages are float64); gradients reach hidden, weight and bias in their dtype
    (bfloat16/float16 matmuls run in it, the softmax and the loss in float32, the
    weight gradient summed over chunks in float32).

    Masked positions reach neither the loss nor any gradient, whatever they hold (NaN
    hidden rows included). With ``normalizer=global_normalizer(masks, mode=...)`` the
    losses and gradients of a step's micro-batches and ranks add up to the whole
    batch's. ``old_logp``, ``advantages``, ``ref_logp``, ``is_weights``, a ``normalizer``
    or ``entropy_coef`` tensor must not require grad.

    Options (defaults: ``ClipHigher()`` with DAPO's ``eps_low=0.2, eps_high=0.28`` and
    ``mode="token_mean"``, DAPO sec. 3.1 and 3.3; the others as :func:`policy_loss`):
        objective: any :class:`Objective` value.
        temperature: the sampling temperature ``T > 0``; the logits are divided by it.
        entropy_coef: ``c``, a finite number or a 0-dim tensor (e.g. from
            :func:`adaptive_entropy_coef`); 0 adds no term and computes no entropy.
        chunk_size: tokens per chunk; ``None`` picks ``max(1, E // vocab)`` with
            ``E = 2**25`` on CPU, ``2**27`` on GPUs (:func:`fused_logprobs_entropy`'s).
        backend: ``"chunked"`` (the chunks above), ``"triton"`` (Triton kernels that keep
            each tile of logits on chip: CUDA tensors, or CPU ones under
            ``TRITON_INTERPRET=1``; eager only, no ``chunk_size``) or ``"auto"``: the
            chunked path for now, the kernels on CUDA once measured there
            (``docs/linear_loss.md``).
        top_k, top_p, min_p: the rollout sampler's truncation (vLLM's rules; None: off,
            bit for bit today's loss): :math:`\log\pi` and :math:`H` of the distribution
            renormalised over the kept set and the chosen token, as in
            :func:`token_logprobs`; exact on each chunk's full rows, gradients exact for
            the kept set.
        softcap: the model's final-logit cap ``c > 0`` (Gemma-2's
            ``final_logit_softcapping``, e.g. 30.0; Liger's ``softcap``): the logits are
            :math:`\mathrm{cap}(z) = c\tanh(z/c)` before the temperature, as vLLM samples
            them; gradients through :math:`1 - \tanh^2(z/c)`, on either backend. None
            (default): no cap, bit for bit as without; set, one more ``[chunk, vocab]``
            buffer on the chunked path.

    Double backward (``create_graph=True``) differentiates the definition (the whole
    logits, the naive path's memory). Under ``torch.compile(fullgraph=True)`` the chunks
    are traced as functional ops (objectives with ``grad``).

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
    and on the device (no host sync beyond :func:`linear_policy_loss`'s one, the token-id
    range check). The entropies cost one more pass over each chunk and a small scratch
    buffer.

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
