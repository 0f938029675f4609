r"""``linear_distill_loss``: logit distillation straight from the student's hidden states.

No float32 ``[tokens, vocab]`` tensor of the student's logits: the two-pass design
(:mod:`dapo_ops.logprobs._distill_two_pass`; the logits kept in the input dtype or formed
again) or chunks of tokens whose gradients are formed in the forward pass
(:mod:`dapo_ops.logprobs._distill_terms`); checks and dispatch in
:mod:`dapo_ops.logprobs._distill_call`. The divergences are TRL 1.16 GKD's
(``GKDTrainer.generalized_jsd_loss``) against the teacher's logits and verl 0.9.1's
``forward_kl_topk`` against its top-k log-probs; ``docs/distillation.md`` derives them.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxtyping import Bool, Float, Integer
from torch import Tensor
from typing_extensions import Unpack

from dapo_ops._core._checked import checks_values
from dapo_ops._core._rules import AggregationMode, Normalizer
from dapo_ops.logprobs._backends import Backend
from dapo_ops.logprobs._distill_call import (
    DistillKind,
    DistillOptions,
    TopkSupport,
    TopkTail,
    run,
)

__all__ = ["DistillDiagnostics", "linear_distill_loss", "linear_distill_loss_with_diagnostics"]


class DistillDiagnostics(NamedTuple):
    """What :func:`linear_distill_loss_with_diagnostics` measured, detached, ``[batch,
    seq]`` in the compute dtype: ``per_token`` each token's loss after the clamps, not
    weighted by ``is_weights`` (0 at masked positions: TRL's ``reduction="none"`` summed
    over the vocabulary, verl's ``distillation_losses``); on the top-k path
    ``student_mass`` and ``teacher_mass``, the probability either puts on the ids (the
    teacher's top-k, verl's metrics, or the ``topk_support`` chosen; with ``topk_tail``,
    padding slots left out), else None."""

    per_token: Float[Tensor, "batch seq"]
    student_mass: Float[Tensor, "batch seq"] | None
    teacher_mass: Float[Tensor, "batch seq"] | None


@checks_values
def linear_distill_loss(
    hidden: Float[Tensor, "batch seq d"],
    weight: Float[Tensor, "vocab d"],
    teacher: Float[Tensor, "batch seq vocab"] | Float[Tensor, "batch seq k"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    teacher_ids: Integer[Tensor, "batch seq k"] | None = None,
    kind: DistillKind = "forward_kl",
    beta: float | None = None,
    temperature: float = 1.0,
    topk: int | None = None,
    log_prob_min_clamp: float | None = None,
    loss_clamp: float | None = None,
    bias: Float[Tensor, " vocab"] | None = None,
    mode: AggregationMode = "token_mean",
    normalizer: Normalizer = None,
    max_len: int | None = None,
    chunk_size: int | None = None,
    softcap: float | None = None,
    is_weights: Float[Tensor, "batch seq"] | None = None,
    topk_tail: TopkTail = "none",
    topk_support: TopkSupport = "teacher",
    backend: Backend = "auto",
    keep_logits: bool | None = None,
    vocab_group: object = None,
    skip_padding: bool | int = False,
    cu_seqlens: Integer[Tensor, " seqs_plus_1"] | None = None,
) -> Float[Tensor, ""]:
    r"""A distillation loss from the student's last hidden states: no float32 logits tensor.

    With :math:`s = \log\mathrm{softmax}(\mathrm{cap}(hW^\top + b)/T)` the student's
    log-probs and :math:`t` the teacher's, each valid token's loss :math:`l` is, by ``kind``:

    - ``"forward_kl"``: :math:`\sum_v p_t (t - s)`, :math:`KL(\pi_T\|\pi_\theta)`
      (TRL GKD ``beta=0``);
    - ``"reverse_kl"``: :math:`\sum_v p_s (s - t)`, :math:`KL(\pi_\theta\|\pi_T)`
      (TRL GKD ``beta=1``);
    - ``"jsd"``: :math:`\beta\,KL(\pi_T\|M) + (1-\beta)\,KL(\pi_\theta\|M)` with the
      mixture :math:`M = \beta\pi_T + (1-\beta)\pi_\theta`, ``0 < beta < 1`` (TRL GKD's
      generalised JSD, Agarwal et al. 2024 eq. 1; default 0.5, TRL's);

    then clipped to ``+-loss_clamp`` (verl's ``loss_max_clamp``; None: not clipped),
    multiplied by ``is_weights`` :math:`w` (a constant per token, e.g. TRL SDFT/SDPO's
    ``distillation_is_clip`` from :func:`truncated_is_weights`; None: 1) and aggregated as
    :func:`token_level_aggregate` (``mode``, ``normalizer``, ``max_len``): the gradients
    scale by :math:`w` too.

    The teacher: ``teacher`` its logits ``[batch, seq, vocab]`` (divided by ``T`` too, as
    TRL), or with ``teacher_ids`` its top-k log-probs ``[batch, seq, k]`` at those ids
    (taken as given). ``softcap=c`` (None: off, bit for bit as without) caps the student's
    logits, :math:`\mathrm{cap}(z) = c\tanh(z/c)` before ``/ T`` (Gemma-2's
    ``final_logit_softcapping``; gradients through :math:`1 - \tanh^2(z/c)`); the
    teacher's logits are inputs: cap them as the teacher model does before passing them
    (TRL's ``DistillationTrainer`` caps both). On the top-k path (``teacher_ids``, or ``topk=k`` to reduce the
    teacher's logits to its ``k`` most likely tokens) the loss is verl's
    ``forward_kl_topk``: :math:`\max(0, \sum_{j \le k} e^{t_j'} (t_j' - s_j'))` with
    :math:`s_j` the student's log-prob at id :math:`j` (normalised over the whole
    vocabulary), :math:`x' = \max(x, c)` for ``c = log_prob_min_clamp`` (None: no floor;
    verl's config default is -10.0) and the clamp at 0 that verl applies (top-k masses do
    not sum to 1); ``kind="forward_kl"`` only. ``topk_tail`` completes it as TRL 1.16's
    sparse distillation losses do, with :math:`F` that sum (unclamped), :math:`P_t`,
    :math:`P_s` the teacher's and the student's mass on the ids: ``"bucket"`` (TRL's
    ``add_tail=True``) :math:`F + (1-P_t)\log\frac{1-P_t}{1-P_s}`, the KL over the ids
    plus one bucket for the rest; ``"renormalize"`` (``add_tail=False``) :math:`F/P_t -
    \log P_t + \log P_s`, the KL of both renormalised on the ids; neither is clamped at 0
    (both are KLs), ``log_prob_min_clamp`` is refused with them. There a ``-inf`` teacher
    log-prob marks a padding slot (not one of the ids), the real ids must be distinct
    (checked in the same host sync), :math:`1-P_s` is the student's mass off the ids
    (summed there: exact as :math:`P_s \to 1`; its log floored at -1e4, no gradient
    below, where the student puts no mass off the ids) and :math:`0 \log 0 = 0` when
    :math:`P_t \ge 1`. TRL instead floors :math:`1-P` at about 1e-7 for both models.
    With a tail ``kind="reverse_kl"`` and ``"jsd"`` (``beta`` as above; TRL's SDFT/SDPO
    ``distillation_alpha``, async/IW-OPD ``beta``) apply too: the divergence between the
    two distributions over the ids (and the bucket, :math:`\log(1-P_t)` floored at
    -1e4). ``topk_support`` (with ``topk=k`` and the teacher's logits) picks the ids in
    each chunk: ``"teacher"`` its top-k (default), ``"student"`` the student's top-k
    (TRL's ``compute_topk_self_distillation_loss``), ``"union"`` both (the student's
    already among the teacher's as padding; IW-OPD's ``top_k`` JSD); constants, no
    gradient through the choice. Any other support goes as ``teacher_ids``.

    Exact: it equals the naive composition (``h @ W.T``, ``log_softmax``, the formulas
    above) and so TRL's ``generalized_jsd_loss`` (``reduction="batchmean"`` with labels:
    ``mode="token_mean"``; ``"sum"``: ``normalizer=1``; ``"mean"``: ``normalizer=`` valid
    tokens times vocab; ``num_items_in_batch=n``: ``normalizer=n``) and verl's
    ``compute_forward_kl_topk`` on the same inputs, values and gradients. Differences,
    deliberate: float64 inputs are computed in float64 (verl's KL casts to float32); a
    teacher log-prob of ``-inf`` contributes 0 (TRL and verl: NaN).

    Two designs (``backend``; ``docs/linear_loss.md``). The two-pass one (``"triton"``,
    ``"auto"`` on CUDA: the row work in Triton kernels, the top-k gathers in ATen ops;
    ``"two_pass"``: ATen row functions, any device): pass 1 keeps per row what forms
    the gradient of the logits one entry at a time, pass 2 forms it and multiplies;
    ``keep_logits=True`` keeps the ``[tokens, vocab]`` logits in the input dtype (3
    products), ``False`` forms them again (4 products, one buffer of ``2**27`` elements on
    a GPU, ``2**24`` on CPU), ``None`` (default) keeps them up to 4 GiB
    (``KEEP_LOGITS_BYTES``); no float32 ``[vocab, d]`` buffer. ``"chunked"`` (``"auto"`` on
    CPU and under ``torch.compile``; ``chunk_size`` picks it): a chunk of tokens at a
    time, its gradients formed in the forward pass, 3 products, a few ``[chunk, vocab]``
    buffers, the weight gradient summed in float32. ``vocab_group`` (None: not split): a
    process group whose ranks split the vocabulary, ``weight`` and ``bias`` this rank's
    contiguous rows, the teacher's logits split the same way (``[batch, seq, V_r]``),
    ``teacher_ids`` global; the loss is the whole vocabulary's on every rank, the hidden
    gradient this rank's partial sum (``docs/tensor_parallel.md``); two-pass only, no
    double backward. ``skip_padding`` (False: off): the passes on the valid tokens only,
    ``True`` counting them (one host sync), an ``int`` the caller's count (none; below
    the valid tokens the loss is NaN, checked mode raises; ``docs/padding.md``).
    ``cu_seqlens`` (None: off): packed inputs as verl's remove-padding forward makes them
    (``hidden [1, total, d]``, ``teacher [1, total, ...]``, ``mask`` and ``is_weights``
    ``[1, total]``) with the boundaries ``[seqs + 1]``: the seq-mean modes weigh each
    sequence (one host read of the boundaries); two-pass only.

    Shapes and dtypes: hidden ``[batch, seq, d]``, weight ``[vocab, d]``, bias ``[vocab]``
    (one dtype, one device); teacher_ids integer in ``[0, vocab)`` at unmasked positions
    (one host sync, eager only); mask ``[batch, seq]``. Returns a 0-dim float32 loss
    (float64 for float64 hidden); bfloat16/float16 matmuls run in that dtype, the
    softmaxes and the loss in float32. Masked positions reach neither the loss nor any
    gradient, whatever hidden, teacher, teacher_ids and is_weights hold there. The
    teacher must not require grad. ``chunk_size``: tokens per chunk (None: ``max(1, E //
    vocab)``, as :func:`linear_policy_loss`). Under ``torch.compile(fullgraph=True)`` the
    chunks are traced as functional ops, and ``"two_pass"`` as it runs (``skip_padding``
    with its count too; ``skip_padding=True``, ``cu_seqlens`` and ``vocab_group`` are
    refused there by name); double backward differentiates the naive
    composition. Host syncs beyond the ids' check: ``skip_padding=True`` one,
    ``cu_seqlens`` one, and ``vocab_group`` two small object exchanges among its ranks.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> hidden = torch.randn(2, 5, 8, generator=g, requires_grad=True)
        >>> weight = torch.randn(32, 8, generator=g, requires_grad=True)
        >>> teacher = torch.randn(2, 5, 32, generator=g)
        >>> mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]).bool()
        >>> loss = linear_distill_loss(hidden, weight, teacher, mask, kind="jsd", beta=0.5)
        >>> loss.backward()
        >>> bool(loss > 0), weight.grad.shape
        (True, torch.Size([32, 8]))
    """
    options: DistillOptions = {  # a plain dict: torch.compile traces it
        "teacher_ids": teacher_ids, "kind": kind, "beta": beta, "temperature": temperature,
        "topk": topk, "log_prob_min_clamp": log_prob_min_clamp, "loss_clamp": loss_clamp,
        "bias": bias, "mode": mode, "normalizer": normalizer, "max_len": max_len,
        "chunk_size": chunk_size, "softcap": softcap, "is_weights": is_weights,
        "topk_tail": topk_tail, "topk_support": topk_support, "backend": backend,
        "keep_logits": keep_logits, "vocab_group": vocab_group, "skip_padding": skip_padding,
        "cu_seqlens": cu_seqlens,
    }  # fmt: skip
    return run(hidden, weight, teacher, mask, options)[0]


@checks_values
def linear_distill_loss_with_diagnostics(
    hidden: Float[Tensor, "batch seq d"],
    weight: Float[Tensor, "vocab d"],
    teacher: Float[Tensor, "batch seq vocab"] | Float[Tensor, "batch seq k"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    **options: Unpack[DistillOptions],
) -> tuple[Float[Tensor, ""], DistillDiagnostics]:
    """:func:`linear_distill_loss` (same arguments and options) and the per-token losses
    (and, on the top-k path, the top-k masses) it saw: :class:`DistillDiagnostics`,
    detached, no host sync beyond the ids' range check.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> hidden, weight = torch.randn(1, 3, 4, generator=g), torch.randn(10, 4, generator=g)
        >>> ids = torch.tensor([[[1, 2], [3, 4], [5, 6]]])
        >>> logp = torch.full((1, 3, 2), -1.0)
        >>> loss, d = linear_distill_loss_with_diagnostics(
        ...     hidden, weight, logp, torch.ones(1, 3, dtype=torch.bool), teacher_ids=ids)
        >>> tuple(d.per_token.shape), bool((d.teacher_mass - 2 * torch.e**-1).abs().max() < 1e-6)
        ((1, 3), True)
    """
    loss, per_token, smass, tmass = run(hidden, weight, teacher, mask, options)
    topk = options.get("teacher_ids") is not None or options.get("topk") is not None
    return loss, DistillDiagnostics(
        per_token.detach(), smass.detach() if topk else None, tmass.detach() if topk else None
    )
