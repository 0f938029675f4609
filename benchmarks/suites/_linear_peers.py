"""The peers' rows of the ``linear`` suite: each peer's own lm-head function, then the
same ``policy_loss`` (``loss(logp, x)``) every row of the suite computes.

- Liger-Kernel 0.8.5 ``LigerFusedLinearGRPOLoss`` (its own GRPO/DAPO loss, chunked torch);
- cut-cross-entropy 25.1.1 ``linear_cross_entropy`` (Triton; log-probs ``-CE``, its
  default gradient filter; CUDA only);
- TRL 1.16 ``ChunkedLogProbFunction``, called as its GRPO trainer's fused head calls it
  (``add_fused_lm_head``: the valid positions only on a Triton device, every position
  elsewhere; tiles of 4096 tokens x 32768 ids; log-probs and entropy);
- verl 0.9.1 ``linear_cross_entropy`` (Triton; ``use_fused_kernels`` with the triton
  backend; CUDA only) and ``FusedLinearForPPO`` (torch, chunks of 512 tokens: the torch
  backend).

A row whose peer is not installed stays, with the reason (``Impl.missing``); wheels for an
offline GPU machine: ``tools/gpu_session.sh``. The peers' modules are imported without
their training stacks (:mod:`benchmarks.suites._peer_modules`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from benchmarks.environment import installed
from benchmarks.harness import Fn, Impl
from benchmarks.suites import _peer_modules as peers

Loss = Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]
Step = Callable[
    [Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor]],
    Callable[[dict[str, Any]], Fn],
]

LIGER = "Liger LigerFusedLinearGRPOLoss"
CCE = "cut-cross-entropy"
TRL_HEAD = "ChunkedLogProbFunction (its GRPO trainer's fused head) + policy_loss"
VERL_TRITON = "linear_cross_entropy (Triton kernels) + policy_loss"
VERL_TORCH = "FusedLinearForPPO + policy_loss"
LIGER_OPTIONS: dict[str, Any] = {
    "loss_type": "dapo",
    "beta": 0.0,
    "epsilon_low": 0.2,
    "epsilon_high": 0.28,
    "temperature": 1.0,
    "use_ref_model": False,
    "chunk_size": 1,
}


def tag(peer: str, package: str) -> str:
    """``"<peer> <version> (installed)"``, or ``"<peer> (not installed)"``."""
    version = installed(package)
    return f"{peer} {version} (installed)" if version else f"{peer} (not installed)"


def _absent(package: str, how: str) -> str | None:
    return None if installed(package) else f"{package} is not installed ({how})"


def _cuda_only(why: str) -> str | None:
    return None if torch.cuda.is_available() else why


def _liger(compiled: bool) -> Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor]:
    def loss_of(h: torch.Tensor, w: torch.Tensor, x: dict[str, Any]) -> torch.Tensor:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss  # type: ignore[import-not-found]

        fn = LigerFusedLinearGRPOLoss(compiled=compiled, **LIGER_OPTIONS)
        loss, _ = fn(h, w, x["tokens"], x["mask"].long(), x["adv"], old_per_token_logps=x["old"])
        return loss  # type: ignore[no-any-return]

    return loss_of


def _cce(loss: Loss) -> Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor]:
    def loss_of(h: torch.Tensor, w: torch.Tensor, x: dict[str, Any]) -> torch.Tensor:
        from cut_cross_entropy import linear_cross_entropy  # type: ignore[import-not-found]

        targets = torch.where(x["mask"], x["tokens"], -100)
        return loss(-linear_cross_entropy(h, w, targets, reduction="none"), x)

    return loss_of


def _trl(loss: Loss) -> Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor]:
    def loss_of(h: torch.Tensor, w: torch.Tensor, x: dict[str, Any]) -> torch.Tensor:
        mod = peers.trl_chunked_logprob()
        mask, tokens = x["mask"], x["tokens"]
        compact = mod._use_triton(h.device)  # as add_fused_lm_head decides
        rows = h[mask] if compact else h.reshape(-1, h.shape[-1])
        ids = tokens[mask] if compact else tokens.reshape(-1)
        out = mod.ChunkedLogProbFunction.apply(
            rows, w, None, ids, 1.0, peers.TRL_CHUNK_SIZE, None, 1.0, ("log_probs", "entropy")
        )
        logp = (
            out[0].new_zeros(mask.shape).masked_scatter(mask, out[0])
            if compact
            else out[0].view(mask.shape)
        )
        return loss(logp, x)

    return loss_of


def _verl_triton(
    loss: Loss,
) -> Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor]:
    def loss_of(h: torch.Tensor, w: torch.Tensor, x: dict[str, Any]) -> torch.Tensor:
        logp, _ = peers.verl_linear_cross_entropy()(h, w, x["tokens"], 1.0, "none")
        return loss(logp.view(x["mask"].shape), x)

    return loss_of


def _verl_torch(loss: Loss) -> Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor]:
    def loss_of(h: torch.Tensor, w: torch.Tensor, x: dict[str, Any]) -> torch.Tensor:
        logp, _ = peers.verl_fused_linear_for_ppo()()(h, w, x["tokens"])
        return loss(logp, x)

    return loss_of


def impls(quick: bool, step: Step, loss: Loss) -> list[Impl]:
    """The peers' rows; ``step`` turns ``loss_of(h, w, x)`` into one fwd+bwd."""
    no_liger = _absent("liger_kernel", "pip install --no-deps liger-kernel==0.8.5")
    no_verl = _absent("verl", "pip install --no-deps verl==0.9.1")
    no_trl = _absent("trl", "pip install --no-deps trl==1.16.0")
    no_cce = _absent("cut_cross_entropy", "pip install --no-deps cut-cross-entropy==25.1.1")
    liger, verl = tag(LIGER, "liger_kernel"), tag("verl", "verl")
    out = [Impl(f"{liger}, eager", "ref", step(_liger(False)), missing=no_liger)]
    if not quick:
        out.append(
            Impl(f"{liger}, compiled", "ref", step(_liger(True)), compiled=True, missing=no_liger)
        )
    out += [
        Impl(
            f"{tag(CCE, 'cut_cross_entropy')} linear_cross_entropy + policy_loss",
            "ref",
            step(_cce(loss)),
            missing=no_cce or _cuda_only("cut-cross-entropy's kernels need CUDA"),
            devices=("cuda",),
        ),
        Impl(f"{tag('TRL', 'trl')} {TRL_HEAD}", "ref", step(_trl(loss)), missing=no_trl),
        Impl(
            f"{verl} {VERL_TRITON}",
            "ref",
            step(_verl_triton(loss)),
            missing=no_verl or _cuda_only("verl's linear_cross_entropy kernels need CUDA"),
            devices=("cuda",),
        ),
        Impl(f"{verl} {VERL_TORCH}", "ref", step(_verl_torch(loss)), missing=no_verl),
    ]
    return out
