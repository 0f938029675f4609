"""The Triton kernels compile for an H100 (``sm_90``) and an A100 (``sm_80``) on a
machine without a GPU, and their tiles fit in registers.

Triton's interpreter (tests/test_triton_linear.py, tests/test_triton_loss.py) runs the
kernels' arithmetic in numpy; it does not apply the compiled language's rules: what
``tl.dot`` accepts for each dtype, layouts, scalar atomics. Here Triton's own toolchain
(its bundled ``ptxas``) lowers every kernel, for each input dtype, to a cubin for
``sm_90`` (and ``sm_80``), and the PTX is checked for what the design relies on: bfloat16
and float16 tiles on the tensor cores (``wgmma``; ``mma.sync`` on ``sm_80``) with
``input_precision="ieee"``, within the GPU's shared memory per program, their narrowing
casts rounding to nearest even (``cvt.rn``, as the interpreter tests assume); float64
without a ``tl.dot`` (Triton 3.6 to 3.8 cannot lower an accumulating float64 dot for
``sm_90``); the policy loss's forward with no atomics but the integer ticket and its
reset, none on floats (its sums are reduced in a fixed order); and the cubins' resource
usage shows no register spilled to local memory at the tiles a GPU runs (``GPU_TILES``),
with the opt-in gradient filter, and at the tile sweep's candidates. Compiled with the
library's own launch options (no warning from Triton 3.9 about FP fusion left unset).
Skipped where Triton has no CUDA backend; ``.ci/triton`` runs it under each supported
Triton.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import torch

# Triton 3.9 warns when FP fusion is left to its default (launch_options states it)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.triton,
    pytest.mark.filterwarnings("error:TRITON_DEFAULT_FP_FUSION"),
]
triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

import triton.language as tl  # noqa: E402

from dapo_ops import DPPO  # noqa: E402
from dapo_ops._core._triton import load_kernels  # noqa: E402
from dapo_ops.engine import _triton_loss as triton_loss  # noqa: E402
from dapo_ops.engine._triton_loss import OBJECTIVES  # noqa: E402
from dapo_ops.logprobs._triton_linear import GPU_TILES, KernelTiles  # noqa: E402

sm90 = pytest.importorskip("tools.sm90_tiles", reason="run from the repository root")
compile_h100, linear_kernels, usage = sm90.compile_h100, sm90.linear_kernels, sm90.usage
A100, SHARED_LIMIT = sm90.A100, sm90.SHARED_LIMIT


@pytest.fixture(autouse=True)
def compiled_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def assert_narrowing_rounds_to_nearest(name: str, code: str, half: str) -> None:
    """Pass 2's float32 -> ``half`` casts (``G`` before its products, the weight gradient's
    rows) round to nearest even (``cvt.rn``), the rounding the interpreter tests emulate."""
    casts = re.findall(rf"cvt[.\w]*\.{half}(?:x2)?\.f32\b", code)
    if name.startswith("bwd"):
        assert casts and all(c.startswith("cvt.rn.") for c in casts), (name, sorted(set(casts)))


def spilled_bytes(compiled: Any) -> int:
    """Bytes per thread spilled to local memory (the cubin's stack frame)."""
    return int(usage(compiled)["STACK"])


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16", "fp64"])
def test_linear_kernels_compile_for_sm90(dtype: str) -> None:
    """Pass 1 (whole and split over the vocabulary, and the splits' merge) and both pass-2
    kernels, with bias, mask, entropy gradient and soft cap, at the tiles a GPU runs,
    without a spilled register."""
    torch_dtype = {v: k for k, v in sm90.NAMES.items()}[dtype]
    tiles = GPU_TILES[torch_dtype]
    for name, compiled in linear_kernels(torch_dtype, tiles, cap=True).items():
        code = compiled.asm["ptx"]
        assert spilled_bytes(compiled) == 0, f"{name}: {tiles} spills registers"
        assert compiled.metadata.shared <= SHARED_LIMIT[90], name
        if name == "fwd_combine":  # the splits' merge: no tile
            continue
        if dtype in ("bf16", "fp16"):  # tensor cores, products accumulated in float32
            half = dtype.replace("fp", "f")
            assert "wgmma.mma_async.sync.aligned" in code and f".f32.{half}.{half}" in code, name
            assert_narrowing_rounds_to_nearest(name, code, half)
        else:  # float32 "ieee" and float64: on the CUDA cores
            assert "mma" not in code and "fma.rn.f" in code, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_linear_kernels_compile_for_sm80(dtype: torch.dtype) -> None:
    """The same kernels at the same tiles for an A100 (``sm_80``), pass 2 also with the
    gradient filter: half-precision tiles on its tensor cores (``mma.sync``; ``wgmma`` is
    ``sm_90``'s), no spilled register, and the shared memory within an A100's 163 KiB a
    program (a launch past it would fail)."""
    tiles = GPU_TILES[dtype]
    kernels = linear_kernels(dtype, tiles, True, target=A100)
    for field in ("hidden", "weight"):
        filtered = linear_kernels(dtype, tiles, True, field, filtered=True, target=A100)
        kernels |= {f"{name}+filter": compiled for name, compiled in filtered.items()}
    half = {torch.bfloat16: "bf16", torch.float16: "f16"}.get(dtype)
    for name, compiled in kernels.items():
        code = compiled.asm["ptx"]
        assert ".target sm_80" in code, name
        assert spilled_bytes(compiled) == 0, f"{name}: {tiles} spills registers on sm_80"
        assert compiled.metadata.shared <= SHARED_LIMIT[80], (name, compiled.metadata.shared)
        if half and name != "fwd_combine":
            assert "wgmma" not in code and "mma.sync.aligned" in code, name
            assert f".f32.{half}.{half}.f32" in code, name
            assert_narrowing_rounds_to_nearest(name, code, half)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gradient_filter_compiles_without_spills(dtype: torch.dtype) -> None:
    """Pass 2 with the opt-in gradient filter (a runtime branch around each tile's
    products) at the GPU tiles, with the soft cap: no spilled register."""
    kernels = {}
    for field in ("hidden", "weight"):
        kernels |= linear_kernels(dtype, GPU_TILES[dtype], True, field, filtered=True)
    assert set(kernels) == {"bwd_hidden", "bwd_weight"}
    for name, compiled in kernels.items():
        assert spilled_bytes(compiled) == 0, name


def test_tile_sweep_candidates_compile_without_spills() -> None:
    """Every tile benchmarks/tile_sweep.py times on a GPU compiles for its kernel, in
    bfloat16 with the soft cap, without a spilled register (the sweep times only those)."""
    sweep = pytest.importorskip("benchmarks.tile_sweep", reason="run from the repository root")
    for kernel, candidates in sweep.CANDIDATES.items():
        for b in candidates:
            tiles = KernelTiles(b, b, b)
            for name, compiled in linear_kernels(torch.bfloat16, tiles, True, kernel).items():
                assert spilled_bytes(compiled) == 0, f"{name} at {b} spills registers"


def _loss_cases() -> list[tuple[int, int, int, int]]:
    """(objective number, KL estimator number, mode, normaliser kind): every objective's
    number (DPPO has two: tv and kl), the options rotating over them."""
    values = [t() for t in OBJECTIVES] + [DPPO(divergence="kl")]
    numbers = sorted({OBJECTIVES[type(o)](o)[0] for o in values})
    return [(obj, obj % 5, obj % 4, obj % 3) for obj in numbers]


@pytest.mark.parametrize(("dtype", "arch"), [("fp32", 90), ("fp64", 90), ("fp32", 80)])
def test_policy_loss_kernels_compile(dtype: str, arch: int) -> None:
    """Every objective's term (with a KL estimator, IS and KL weights, each mode and
    normaliser kind in turn) and the backward for each gradient dtype; the forward's only
    atomics are the integer ticket and its reset. For an A100 (``sm_80``) too: float32,
    every third case."""
    target = A100 if arch == 80 else sm90.H100
    ks = load_kernels("dapo_ops.engine._triton_loss_kernels", False)
    names = ("lp", "old", "adv", "ref", "rho", "kappa", "prm", "den", "u", "part", "loss", "scale")
    types = {f"{n}_ptr": f"*{dtype}" for n in names}
    types |= {"valid_ptr": "*u8", "cnt_ptr": "*i32", "sem_ptr": "*i32"}
    compute = tl.float64 if dtype == "fp64" else tl.float32
    with pytest.MonkeyPatch.context() as mp:  # the GPU's blocks, not the interpreter's
        mp.setattr(triton_loss, "interpreting", lambda: False)
        block, rows, warps = triton_loss._blocks(
            torch.float64 if dtype == "fp64" else torch.float32
        )
    cases = (
        _loss_cases()
        if (dtype, arch) == ("fp32", 90)
        else _loss_cases()[:: 4 if dtype == "fp64" else 3]
    )
    for obj, kl, mode, den in cases:
        flags = {"OBJ": obj, "KL": kl, "KL_ST": kl == 2, "KL_CAP": kl == 3, "HAS_RHO": True}
        flags |= {"HAS_KAPPA": kl > 0, "MODE": mode, "DEN": den, "WITH_GRAD": True}
        flags |= {"COMPUTE": compute, "BLOCK": block, "RB": rows}
        compiled = compile_h100(ks.loss_forward, types, flags, warps, target)
        code = compiled.asm["ptx"]
        assert spilled_bytes(compiled) == 0, flags
        atomics = [line for line in code.splitlines() if "atom." in line]
        assert len(atomics) == 2, atomics  # the ticket and the reset
        assert all(".f32" not in a and ".f64" not in a for a in atomics), atomics
    for out in ("bf16", "fp16", dtype):
        back = {"u_ptr": f"*{dtype}", "scale_ptr": f"*{dtype}", "go_ptr": "*fp32"}
        compiled = compile_h100(ks.loss_backward, back | {"out_ptr": f"*{out}"},
                                {"PER_ROW": 1, "COMPUTE": compute, "BLOCK": block}, warps,
                                target)  # fmt: skip
        assert spilled_bytes(compiled) == 0, out


def test_interpreter_switch_is_per_module() -> None:
    """The kernels' modules read ``TRITON_INTERPRET`` when loaded: compiled here."""
    assert os.environ.get("TRITON_INTERPRET") is None
    for module in ("dapo_ops.logprobs._triton_kernels", "dapo_ops.engine._triton_loss_kernels"):
        assert not bool(load_kernels(module, False).INTERPRETED)
