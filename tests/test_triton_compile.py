"""The row kernels compile for an H100 (``sm_90``) and an A100 (``sm_80``) on a machine
without a GPU.

Triton's interpreter (tests/test_two_pass.py, tests/test_row_kernels.py) runs the
kernels' arithmetic in numpy; it does not apply the compiled language's rules. Here
Triton's own toolchain (its bundled ``ptxas``) lowers both kernels, for each logits dtype,
with and without the cap, the truncation and the entropy term, at the blocks a GPU runs
(``GPU_BLOCKS``), and the PTX and the cubin are checked for what the design relies on:
no register spilled to local memory; pass 2's narrowing casts rounding to nearest even
(``cvt.rn``, as the interpreter tests emulate); float64 logits computed in float64 only
(no float32 arithmetic, no conversion to float32: the 2026-11-28 H100 run found a
float64 path off by 3.5e-8, a temperature passed as a Python float, which Triton narrows
to float32); and no atomic anywhere (every row's sums in a fixed order: the same bits on
every run). Skipped where Triton has no CUDA backend; ``.ci/triton`` runs it under each
supported Triton.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.triton,
    pytest.mark.filterwarnings("error:TRITON_DEFAULT_FP_FUSION"),
]
triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dapo_ops._core._triton import launch_options, load_kernels  # noqa: E402
from dapo_ops.kernels.rows import GPU_BLOCKS  # noqa: E402

H100, A100 = GPUTarget("cuda", 90, 32), GPUTarget("cuda", 80, 32)
DTYPES = {"fp32": "fp32", "bf16": "fp32", "fp16": "fp32", "fp64": "fp64"}  # logits -> ACC


@pytest.fixture(autouse=True)
def compiled_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def compile_for(kernel: Any, types: dict[str, str], constants: dict[str, Any], warps: int,
                target: GPUTarget) -> Any:  # fmt: skip
    """``kernel`` compiled for ``target``: pointers typed by name, ``i32`` otherwise."""
    signature = {
        n: "constexpr" if n in constants else types.get(n, "i32") for n in kernel.arg_names
    }
    src = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    return triton.compile(src, target=target, options=launch_options(warps))


def spilled(compiled: Any) -> int:
    """Bytes a thread spills to local memory (``cuobjdump -res-usage``'s STACK)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        out = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True)
    line = next(x for x in out.stdout.splitlines() if "STACK:" in x)
    return int(dict(p.split(":") for p in line.split() if ":" in p)["STACK"])


def kernels(dtype: str, target: GPUTarget) -> dict[str, Any]:
    """Both kernels for ``dtype`` logits, every flag combination, at the GPU blocks."""
    ks = load_kernels("dapo_ops.kernels._triton_rows", False)
    acc = DTYPES[dtype]
    tl_acc = ks.tl.float64 if acc == "fp64" else ks.tl.float32
    types = {"z_ptr": f"*{dtype}", "g_ptr": f"*{dtype}", "tok_ptr": "*i64"}
    types |= {f"{n}_ptr": f"*{acc}" for n in ("tau", "par", "out", "lse", "ent", "a", "b")}
    types |= {"z_stride": "i64", "g_stride": "i64", "y_stride": "i64", "lse_t_ptr": f"*{acc}"}
    out = {}
    for kind, cap in itertools.product((0, 1, 2), (False, True)):
        block, warps = GPU_BLOCKS["distill_sums"]
        flags = {"KIND": kind, "HAS_CAP": cap, "ACC": tl_acc, "BLOCK": block}
        dtypes = types | {"y_ptr": f"*{acc}"}  # the teacher's block: compute dtype in pass 1
        out[f"distill_sums kind={kind} cap={cap}"] = compile_for(ks.distill_sums, dtypes, flags, warps, target)  # fmt: skip
        block, warps = GPU_BLOCKS["distill"]
        flags["BLOCK"] = block
        dtypes = types | {"y_ptr": f"*{dtype}", "row_ptr": f"*{acc}", "coef_ptr": f"*{acc}",
                          "lse_t_ptr": f"*{acc}", "valid_ptr": "*i8"}  # fmt: skip
        out[f"distill_grad kind={kind} cap={cap}"] = compile_for(ks.distill_grad, dtypes, flags, warps, target)  # fmt: skip
    for cap in (False, True):
        block, warps = GPU_BLOCKS["distill"]
        flags = {"HAS_CAP": cap, "ACC": tl_acc, "BLOCK": block}
        dtypes = types | {"coef_ptr": f"*{acc}"}
        out[f"scaled_probs cap={cap}"] = compile_for(ks.scaled_probs, dtypes, flags, warps, target)
    for tau, cap in itertools.product((False, True), repeat=2):
        block, warps = GPU_BLOCKS["stats"]
        flags = {"HAS_TAU": tau, "HAS_CAP": cap, "ACC": tl_acc, "BLOCK": block}
        out[f"stats tau={tau} cap={cap}"] = compile_for(ks.stats, types, flags, warps, target)
        block, warps = GPU_BLOCKS["grad"]
        for ent in (False, True):
            flags = {"HAS_TAU": tau, "HAS_CAP": cap, "HAS_B": ent, "ACC": tl_acc, "BLOCK": block}
            name = f"grad tau={tau} cap={cap} b={ent}"
            out[name] = compile_for(ks.grad, types, flags, warps, target)
    return out


@pytest.mark.parametrize("target", [H100, A100], ids=["sm90", "sm80"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_row_kernels_compile(dtype: str, target: GPUTarget) -> None:
    for name, compiled in kernels(dtype, target).items():
        code = compiled.asm["ptx"]
        assert f".target sm_{target.arch}" in code, name
        assert spilled(compiled) == 0, f"{name} ({dtype}) spills registers"
        atomics = re.findall(r"^\s*(?:@!?%p\d+\s+)?((?:atom|red)\.[.\w]*)", code, re.M)
        assert not atomics, f"{name}: atomics {set(atomics)}"
        if dtype in ("bf16", "fp16") and not name.startswith(("stats", "distill_sums")):
            half = dtype.replace("fp", "f")
            casts = re.findall(rf"cvt[.\w]*\.{half}(?:x2)?\.f32\b", code)
            assert casts and all(c.startswith("cvt.rn.") for c in casts), (name, set(casts))
        if dtype == "fp64":  # float64 through and through
            f32 = re.findall(
                r"\b(?:cvt[.\w]*\.f32\.f64|(?:add|mul|fma|div|sub)[.\w]*\.f32)\b", code
            )
            assert not f32, f"{name}: float32 arithmetic in the float64 kernel: {set(f32)}"
