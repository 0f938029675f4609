r"""The ``backend=`` and ``keep_logits=`` switches of the lm-head functions.

Private. :func:`resolve` turns the two options of :func:`dapo_ops.linear_policy_loss`,
:func:`dapo_ops.fused_logprobs_entropy` and :func:`dapo_ops.linear_distill_loss` into the
path that runs (refusing what cannot run, naming the option):

- ``"chunked"``: chunks of tokens, each chunk's gradients formed in the forward pass
  (:mod:`dapo_ops.logprobs._fused_linear`); ATen ops only. The CPU's path, and the one
  ``torch.compile`` traces. Its memory knob is ``chunk_size``.
- ``"two_pass"`` and ``"triton"``: the two-pass design (:mod:`dapo_ops.logprobs._two_pass`):
  products by cuBLAS (ATen on CPU), the row work in one fused kernel per pass, the Triton
  kernels of :mod:`dapo_ops.kernels` (``"triton"``: CUDA tensors, or CPU tensors under
  ``TRITON_INTERPRET=1``) or the same formulas as ATen ops (``"two_pass"``: any device).
  Their memory knob is ``keep_logits``.
- ``"auto"``: ``"triton"`` on CUDA (``"two_pass"`` if Triton is missing), ``"chunked"``
  elsewhere and under ``torch.compile``; ``chunk_size`` picks ``"chunked"``,
  ``keep_logits`` (or ``skip_padding``) a two-pass backend.

Under ``torch.compile(fullgraph=True)`` the ATen two-pass backend traces too (its row
work then fuses into the kernels inductor generates); the Triton rows, ``vocab_group``
(its shape exchange between ranks) and ``cu_seqlens`` (the grid's size read from the
boundaries) run eagerly only, and ``skip_padding`` needs its count given
(:func:`dapo_ops.logprobs._packing.check_skip_padding`).
"""

from __future__ import annotations

from typing import Literal

import torch

from dapo_ops._core._triton import interpreting
from dapo_ops._core._validate import InputError, check_option, is_compiling

Backend = Literal["auto", "chunked", "two_pass", "triton"]
BACKENDS = ("auto", "chunked", "two_pass", "triton")
Path = Literal["chunked", "two_pass", "triton"]


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_runs(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def resolve(
    backend: object, device: torch.device, chunk_size: int | None, keep_logits: object,
    needs: str | None = None,
) -> Path:  # fmt: skip
    """The path a call runs; ``InputError`` naming the option for what cannot run.
    ``needs``: the option given that only the two-pass backends have (``vocab_group``,
    ``skip_padding``, ``cu_seqlens``), or None."""
    check_option("backend", backend, BACKENDS)  # type: ignore[arg-type]
    split = needs is not None
    if split and (backend == "chunked" or chunk_size is not None):
        raise InputError(
            f"{needs} runs on the two-pass design (backend 'auto', 'two_pass' or 'triton'); "
            "the chunked backend (backend='chunked', or chunk_size given) does not have it"
        )
    if keep_logits is not None and not isinstance(keep_logits, bool):
        raise InputError(
            f"keep_logits must be True, False or None (auto), got {type(keep_logits).__name__} "
            f"{keep_logits!r}"
        )
    two_pass_asked = backend in ("two_pass", "triton") or keep_logits is not None or split
    if backend == "chunked" or (backend == "auto" and chunk_size is not None):
        if keep_logits is not None:
            raise InputError(
                f"keep_logits={keep_logits} sets the two-pass backends' memory; the chunked "
                "backend (backend='chunked', or chunk_size given) keeps no logits: pass one "
                "of chunk_size and keep_logits"
            )
        return "chunked"
    if two_pass_asked and chunk_size is not None:
        raise InputError(
            f"chunk_size={chunk_size} sets the chunked backend's chunks; backend="
            f"{backend!r} sizes its blocks itself (keep_logits chooses its memory)"
        )
    if is_compiling():
        return _compiled_path(backend, needs, two_pass_asked)
    if backend == "auto":
        if device.type == "cuda":
            return "triton" if _has_triton() else "two_pass"
        if not two_pass_asked:
            return "chunked"
        return "triton" if interpreting() and _has_triton() else "two_pass"
    if backend == "triton":
        if not _triton_runs(device):
            raise InputError(
                f"backend='triton' needs CUDA tensors (or CPU tensors under Triton's "
                f"interpreter, TRITON_INTERPRET=1); got tensors on {device}: "
                "backend='two_pass' runs the same design with ATen ops anywhere"
            )
        if not _has_triton():
            raise InputError(
                "backend='triton' needs the triton package (it ships with CUDA builds of "
                "torch); backend='two_pass' runs the same design without it"
            )
    return backend  # type: ignore[return-value]


EAGER_ONLY = {
    "vocab_group": "its ranks exchange their shapes on the host before the passes",
    "cu_seqlens": "the grid's size is read from the boundaries on the host",
}


def refuse_compiled(option: str) -> None:
    """``InputError`` naming ``option`` (a key of :data:`EAGER_ONLY`) under torch.compile."""
    if is_compiling():
        raise InputError(
            f"{option} runs eagerly only ({EAGER_ONLY[option]}): call the function outside "
            "torch.compile, or leave it out of the compiled region"
        )


def _compiled_path(backend: object, needs: str | None, two_pass_asked: bool) -> Path:
    """The path under ``torch.compile``: ``"two_pass"`` (ATen rows) when a two-pass
    option asks for it, ``"chunked"`` otherwise; what cannot trace is refused by name."""
    if needs in EAGER_ONLY:
        refuse_compiled(needs)
    if backend == "triton":
        raise InputError(
            "backend='triton' runs eagerly only (its kernels are launched outside the traced "
            "graph); under torch.compile use backend='two_pass' (the same design on ATen ops, "
            "fused by the compiler) or 'chunked'"
        )
    return "two_pass" if two_pass_asked else "chunked"
