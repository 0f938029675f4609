"""Suite ``linear``: the whole step from hidden states to the policy loss, fwd+bwd.

Every row computes DAPO's token-mean Clip-Higher loss (0.2 / 0.28, no KL) from
``hidden [batch, 1024, d]``, ``W [vocab, d]`` and the sampled tokens, and the gradients of
``hidden`` and ``W``: ``naive`` (``h @ W.T``, ``log_softmax`` in float32, ``gather``, then
``policy_loss``), ``composed`` (``fused_logprobs_entropy`` + ``policy_loss``),
``linear_policy_loss`` (one chunked pass, gradients computed in the forward), Liger-Kernel's
``LigerFusedLinearGRPOLoss`` (eager, and compiled in full runs) and verl 0.9.1's
``FusedLinearForPPO`` (torch backend) + ``policy_loss``. Times are in units of one
forward ``h @ W.T`` measured in the same run; extra peak memory (fresh process, live
tensors) as a multiple of the float32 logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import dapo_ops as d
from benchmarks.environment import installed
from benchmarks.harness import Case, Fn, Impl, Result, Suite, Target
from benchmarks.suites._linear_gpu import CCE, TRITON, cce_loss, cce_name, no_cce, triton_targets
from benchmarks.targets import at_most, because, compare
from dapo_ops.logprobs._fused_linear import WEIGHT_BLOCK_ROWS

UNIT = "one h @ W.T (forward matmul; the time unit)"
NAIVE = "naive: h @ W.T, log_softmax, gather, policy_loss"
COMPOSED = "composed: fused_logprobs_entropy + policy_loss"
LINEAR = "dapo_ops linear_policy_loss"
LINEAR_FN = "linear_policy_loss"  # being written; the row says so until it lands
LIGER = "Liger LigerFusedLinearGRPOLoss"
#: logits elements per chunk of linear_policy_loss's default (chunk_size=None), if the
#: library's own figure (dapo_ops.logprobs._fused_linear) cannot be read
CHUNK_ELEMENTS = {"cpu": 2**25, "other": 2**27}
SCRATCH = 8 * 2**20  # the entropies' scratch buffer (docs/linear_loss.md)
LIGER_OPTIONS: dict[str, Any] = {
    "loss_type": "dapo",
    "beta": 0.0,
    "epsilon_low": 0.2,
    "epsilon_high": 0.28,
    "temperature": 1.0,
    "use_ref_model": False,
    "chunk_size": 1,
}


def linear_inputs(
    tokens: int, dim: int, vocab: int, dtype: torch.dtype, device: str = "cpu"
) -> dict[str, Any]:
    """Tokens as ``[tokens / 1024, 1024]``; old log-probs = current + N(0, 0.3^2) (some ratios
    clip, most do not); advantages N(0, 1) per sequence; 10 % of positions masked."""
    g = torch.Generator().manual_seed(tokens + dim + vocab)
    seq = min(tokens, 1024)
    shape = (tokens // seq, seq)
    h = torch.empty(*shape, dim).normal_(generator=g)
    w = torch.empty(vocab, dim).normal_(0.0, 2.0 / dim**0.5, generator=g)
    tok = torch.randint(0, vocab, shape, generator=g)
    with torch.no_grad():
        logp = d.fused_logprobs_entropy(h, w, tok).logp
    out = {
        "hidden": h.to(dtype),
        "weight": w.to(dtype),
        "tokens": tok,
        "old": logp + 0.3 * torch.randn(shape, generator=g),
        "adv": torch.randn(shape[0], generator=g),
        "mask": torch.rand(shape, generator=g) > 0.1,
    }
    return {k: v.to(device) for k, v in out.items()}


def _step(
    loss_of: Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor],
) -> Callable[[dict[str, Any]], Fn]:
    def build(x: dict[str, Any]) -> Fn:
        h, w = x["hidden"].detach().requires_grad_(True), x["weight"].detach().requires_grad_(True)

        def run() -> object:
            loss_of(h, w, x).backward()  # type: ignore[no-untyped-call]
            h.grad = w.grad = None
            return None

        return run

    return build


def _loss(logp: torch.Tensor, x: dict[str, Any]) -> torch.Tensor:
    return d.policy_loss(d.ClipHigher(), logp, x["old"], x["adv"], x["mask"])


def _naive(h: torch.Tensor, w: torch.Tensor, x: dict[str, Any]) -> torch.Tensor:
    logp_all = torch.log_softmax((h @ w.T).float(), dim=-1)
    return _loss(logp_all.gather(-1, x["tokens"].unsqueeze(-1)).squeeze(-1), x)


def _liger(compiled: bool) -> Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor]:
    def loss_of(h: torch.Tensor, w: torch.Tensor, x: dict[str, Any]) -> torch.Tensor:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss  # type: ignore[import-not-found]

        fn = LigerFusedLinearGRPOLoss(compiled=compiled, **LIGER_OPTIONS)
        loss, _ = fn(h, w, x["tokens"], x["mask"].long(), x["adv"], old_per_token_logps=x["old"])
        return loss  # type: ignore[no-any-return]

    return loss_of


def _verl(h: torch.Tensor, w: torch.Tensor, x: dict[str, Any]) -> torch.Tensor:
    from verl.utils.experimental.torch_functional import FusedLinearForPPO  # type: ignore[import-not-found]

    logp, _ = FusedLinearForPPO()(h, w, x["tokens"])
    return _loss(logp, x)


def no_triton() -> str | None:
    """Why the Triton kernels' row cannot run here (they need a CUDA device), or None."""
    if not installed("triton"):
        return "triton is not installed (it ships with CUDA builds of torch)"
    return None if torch.cuda.is_available() else "backend='triton' runs on CUDA devices only"


def for_device(impls: list[Impl], device: str) -> list[Impl]:
    """The implementations that belong to a device's suite: the Triton kernels' and
    cut-cross-entropy's rows only on CUDA (on a CPU they would say they cannot run)."""
    return [i for i in impls if device == "cuda" or not (TRITON in i.name or CCE in i.name)]


def impls(quick: bool) -> list[Impl]:
    liger, verl = installed("liger_kernel"), installed("verl")
    no_liger = (
        None if liger else "liger_kernel is not installed (pip install --no-deps liger-kernel)"
    )
    no_verl = None if verl else "verl is not installed (pip install --no-deps verl==0.9.1)"
    no_linear = (
        None
        if hasattr(d, "linear_policy_loss")
        else "dapo_ops.linear_policy_loss is not in this dapo_ops"
    )
    tag_liger = f"{LIGER} {liger} (installed)" if liger else f"{LIGER} (not installed)"
    out = [
        Impl(UNIT, "unit", lambda x: lambda: x["hidden"] @ x["weight"].T),
        Impl(NAIVE, "ref", _step(_naive)),
        Impl(
            COMPOSED,
            "ours",
            _step(lambda h, w, x: _loss(d.fused_logprobs_entropy(h, w, x["tokens"]).logp, x)),
        ),
        Impl(
            LINEAR,
            "ours",
            _step(
                lambda h, w, x: getattr(d, LINEAR_FN)(
                    h, w, x["tokens"], x["old"], x["adv"], x["mask"]
                )
            ),
            missing=no_linear,
        ),
        Impl(
            f"{LINEAR}, {TRITON}",
            "ours",
            _step(
                lambda h, w, x: d.linear_policy_loss(
                    h, w, x["tokens"], x["old"], x["adv"], x["mask"], backend="triton"
                )
            ),
            missing=no_triton(),
        ),
        Impl(f"{tag_liger}, eager", "ref", _step(_liger(False)), missing=no_liger),
        Impl(cce_name(), "ref", _step(cce_loss(_loss)), missing=no_cce()),
    ]
    if not quick:
        out.append(
            Impl(
                f"{tag_liger}, compiled",
                "ref",
                _step(_liger(True)),
                compiled=True,
                missing=no_liger,
            )
        )
    tag_verl = f"verl {verl} (installed)" if verl else "verl (not installed)"
    out.append(
        Impl(f"{tag_verl} FusedLinearForPPO + policy_loss", "ref", _step(_verl), missing=no_verl)
    )
    return out


#: Why linear_policy_loss misses the time targets on a GPU, read off torch.profiler's
#: kernel tables of both paths on an H100 (``python -m benchmarks.profile_linear``).
GPU_REASON = (
    "H100 kernel tables, python -m benchmarks.profile_linear: the three matmuls take what "
    "the naive path's take; the rest is G formed in two elementwise passes (exp_, mul_) "
    "where the naive backward's softmax backward is one fused kernel, and the chunks' "
    "float32/bf16 copies; eager PyTorch cannot fuse these (a Triton epilogue would: not "
    "written)"
)
GPU_REASON_BF16 = (
    f"; in bf16 the weight gradient is also formed {WEIGHT_BLOCK_ROWS} vocabulary rows at "
    "a time (WEIGHT_BLOCK_ROWS: small matmuls, upcasts and adds per chunk; 32768-row blocks were "
    "tried on the H100 and were no faster)"
)

SIZES = [(2048, 896, 32000), (1024, 896, 151936)]
#: On a GPU also issue 30's 7B-scale shape, in bfloat16 only.
GPU_SIZES = [(8192, 4096, 151936)]
QUICK_SIZES = [(512, 128, 8192)]


def memory_budget(n: int, dim: int, v: int, dtype: torch.dtype, device: str) -> int:
    """The memory target: the gradients every method returns (dW and dh, summed in float32,
    plus their bfloat16 copies for bfloat16 inputs) + one default chunk's temporaries (its
    float32 logits and their gradient, a bfloat16 copy for bfloat16 inputs) + the scratch."""
    try:
        from dapo_ops.logprobs._fused_linear import DEFAULT_FUSED_CHUNK_ELEMENTS as elements
    except ImportError:
        elements = CHUNK_ELEMENTS
    per = 4 + (2 if dtype == torch.bfloat16 else 0)
    rows = min(n, max(1, elements["cpu" if device == "cpu" else "other"] // v))
    return (v * dim + n * dim) * per + rows * v * (4 + per) + SCRATCH


def make_cases(quick: bool, device: str) -> list[Case]:
    cases = []
    both, bf16 = (torch.float32, torch.bfloat16), (torch.bfloat16,)
    sizes = [(s, both) for s in (QUICK_SIZES if quick else SIZES)]
    sizes += [(s, bf16) for s in GPU_SIZES if device == "cuda" and not quick]
    for (n, dim, v), dtypes in sizes:
        for dtype in dtypes:
            name = "fp32" if dtype == torch.float32 else "bf16"
            cases.append(
                Case(
                    f"linear loss fwd+bwd, {name}",
                    f"{n}x{dim}x{v}",
                    lambda n=n, dim=dim, v=v, dtype=dtype: linear_inputs(n, dim, v, dtype, device),  # type: ignore[misc]
                    for_device(impls(quick), device),
                    basis_bytes=n * v * 4,
                    basis_name="logits",
                    main_ref=NAIVE,
                    unit=UNIT,
                    memory="all",
                    memory_quick=True,
                    warm_inputs=lambda dtype=dtype: linear_inputs(64, 32, 512, dtype),  # type: ignore[misc]
                    repeats=None if quick or device != "cpu" else 3,
                    budget_gib=16.0,
                    limit_bytes=memory_budget(n, dim, v, dtype, device),
                    elems=n,
                )
            )
    return cases


def targets(
    results: list[Result], cases: list[Case], bandwidth: float, device: str = "cpu"
) -> list[Target]:
    out = []
    for c in cases:
        rs = {r.impl: r for r in results if (r.op, r.size) == (c.op, c.size)}
        ours = rs.get(LINEAR)
        liger = next(
            (r for k, r in rs.items() if k.startswith(LIGER) and k.endswith("eager")), None
        )
        where = f"{c.op}, {c.size}"
        out += [
            compare(
                f"linear_policy_loss, {where}: time / naive", ours, rs.get(NAIVE), 1.0, faster=False
            ),
            compare(
                f"linear_policy_loss, {where}: time / Liger (eager)", ours, liger, 1.0, faster=False
            ),
            compare(
                f"linear_policy_loss, {where}: time in one h @ W.T",
                ours,
                rs.get(UNIT),
                3.3,
                faster=False,
            ),
        ]
        limit = c.limit_bytes / 2**20
        mem = ours.mem / 2**20 if ours is not None and ours.mem is not None else None
        why = (ours.error if ours is not None else None) or ""
        out.append(
            at_most(
                f"linear_policy_loss, {where}: extra peak (live tensors)", mem, limit, " MiB", why
            )
        )
    out = [_reason(t, results, device) for t in out]
    if device == "cuda":
        for c in cases:
            liger = next(
                (i.name for i in c.impls if i.name.startswith(LIGER) and "eager" in i.name), ""
            )
            out += triton_targets(results, c, NAIVE, liger, f"{LINEAR}, {TRITON}")
    return out


def _reason(t: Target, results: list[Result], device: str) -> Target:
    if device == "cpu":  # only the bf16 unit target is missed there
        reason = "in bf16 one h @ W.T is fast next to the float32 softmax passes"
    else:
        reason = GPU_REASON + (GPU_REASON_BF16 if "bf16" in t.name else "")
    if "h @ W.T" in t.name and "bf16" in t.name:
        size = t.name.split(", ")[-1].split(":")[0]
        rs = {r.impl: r for r in results if r.size == size and "bf16" in r.op and r.times}
        if NAIVE in rs and UNIT in rs:
            naive = rs[NAIVE].median / rs[UNIT].median
            reason += f"; a bf16 matmul is so fast that the naive path takes {naive:.1f} units"
    return because(t, reason)


SUITE = Suite(
    name="linear",
    title="Hidden states to policy loss (the lm-head step)",
    make_cases=make_cases,
    targets=targets,
    notes=(
        "`x unit` = median / the median of one forward `h @ W.T` in the same dtype, same "
        "run (3 matmuls plus the softmax is the ideal fwd+bwd, about 3.3 units).",
        "Memory target (`memory_budget`): extra peak <= the gradients every method returns "
        "(dW and dh summed in float32, plus their bfloat16 copies for bfloat16 inputs) + one "
        "chunk of `linear_policy_loss`'s default size (`chunk_size=None`: 2^25 logits "
        "elements on CPU, 2^27 on GPUs; its float32 logits and their gradient, a bfloat16 "
        "copy for bfloat16 inputs) + its 8 MiB scratch.",
        "Liger: `LigerFusedLinearGRPOLoss(loss_type='dapo', beta=0, epsilon_low=0.2, "
        "epsilon_high=0.28, use_ref_model=False, chunk_size=1)` (plain PyTorch chunking; "
        "its Triton kernels are not used by this loss); it computes no entropy. verl: "
        "`FusedLinearForPPO()` (torch backend, chunk 512) returns log-probs and entropy, "
        "then the same `policy_loss`. A row that cannot run here shows its exact error.",
        "bf16 rows: hidden and W in bfloat16 (the matmuls in bf16, the softmax and loss in "
        "float32 in every method).",
    ),
    bandwidth=False,
)
