"""Compile the Triton kernels for an H100 (``sm_90``; an A100, ``sm_80``, with ``--sm80``)
without a GPU, and read what the compiler made of them: registers, bytes spilled to
local memory, shared memory.

python -m tools.sm90_tiles            # the tile search of the linear kernels, bf16 and fp32
python -m tools.sm90_tiles --chosen   # the tiles the library runs (GPU_TILES)
python -m tools.sm90_tiles --chosen --sm80   # either, for an A100

Triton's own toolchain does the work (its bundled ``ptxas`` and ``cuobjdump``), so this
runs on any machine with the ``triton`` wheel. A tile that spills registers reads and
writes local memory in its inner loop; the library's GPU tiles are the largest that do
not (tests/test_triton_compile.py holds them to it). Whether they are the fastest is for
a GPU to measure (issue 30).
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dapo_ops._core._triton import launch_options, load_kernels
from dapo_ops.logprobs._triton_linear import GPU_TILES, Blocks, KernelTiles

H100 = GPUTarget("cuda", 90, 32)
#: An A100 (``sm_80``: ``mma.sync`` tensor cores, no ``wgmma``), the other GPU of RL
#: fine-tuning; the kernels run there at the same tiles.
A100 = GPUTarget("cuda", 80, 32)
#: Shared memory one program may use (bytes, the opt-in maximum per block): 227 KiB on
#: an H100, 163 KiB on an A100 (CUDA C++ Programming Guide, compute capabilities table).
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}
NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float64: "fp64",
}
#: (label, kernel, its flags, the KernelTiles field of its tiles): pass 1 whole and split
#: over the vocabulary (with the splits' merge), and both pass-2 kernels.
LINEAR = (
    ("fwd", "fwd", {"PARTIAL": False}, "fwd"),
    ("fwd_split", "fwd", {"PARTIAL": True}, "fwd"),
    ("fwd_combine", "fwd_combine", {}, "fwd"),
    ("bwd_hidden", "bwd_hidden", {"HAS_B": True}, "hidden"),
    ("bwd_weight", "bwd_weight", {"HAS_B": True, "NEED_W": True, "NEED_BIAS": True}, "weight"),
)


def compile_h100(
    kernel: Any,
    types: dict[str, str],
    constants: dict[str, Any],
    warps: int = 4,
    target: GPUTarget = H100,
) -> Any:
    """``kernel`` compiled for an H100 (or ``target``): every argument typed by ``types``
    (pointers by name, ``i32`` otherwise) or bound by ``constants`` (those it takes)."""
    constants = {k: v for k, v in constants.items() if k in kernel.arg_names}
    signature = {
        n: "constexpr" if n in constants else types.get(n, "i32") for n in kernel.arg_names
    }
    src = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    return triton.compile(src, target=target, options=launch_options(warps))


def usage(compiled: Any) -> dict[str, int]:
    """``REG`` (registers per thread), ``STACK`` (bytes spilled to local memory per
    thread) and ``SHARED`` of the cubin's kernel (``cuobjdump -res-usage``)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        out = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True)
    line = next(x for x in out.stdout.splitlines() if "STACK:" in x)
    fields = dict(part.split(":") for part in line.split() if ":" in part)
    return {k: int(fields[k]) for k in ("REG", "STACK")} | {"SHARED": compiled.metadata.shared}


def linear_types(dtype: torch.dtype) -> dict[str, str]:
    """Argument types of the linear kernels for inputs of ``dtype``."""
    name = NAMES[dtype]
    acc = "fp64" if dtype == torch.float64 else "fp32"
    types = {f"{n}_ptr": f"*{name}" for n in ("h", "w", "b")}
    accs = ("logp", "ent", "lse", "part", "a", "bb", "gh", "gb", "scr")
    types |= {f"{n}_ptr": f"*{acc}" for n in accs}
    types["gw_ptr"] = f"*{name}"  # the weight gradient in the weight's dtype
    return types | {
        "tok_ptr": "*i64",
        "valid_ptr": "*i8",
        "temp": "fp32",
        "cap": "fp32",
        "eps": "fp32",
    }


def linear_kernels(
    dtype: torch.dtype,
    tiles: KernelTiles,
    cap: bool,
    only: str | None = None,
    filtered: bool = False,
    target: GPUTarget = H100,
) -> dict[str, Any]:
    """The kernels of :data:`LINEAR` (those of the ``only`` tiles field, if given) compiled
    for ``dtype`` inputs with bias, mask and entropy gradient, each at its ``tiles``, for
    ``target``; ``filtered``: pass 2 with the opt-in gradient filter."""
    ks = load_kernels("dapo_ops.logprobs._triton_kernels", False)
    flags: dict[str, Any] = {"HAS_BIAS": True, "HAS_VALID": True, "HAS_CAP": cap}
    flags["FILTER"] = filtered
    flags |= {"UPCAST": False, "ACC": tl.float64 if dtype == torch.float64 else tl.float32}
    types = linear_types(dtype)
    # a low-precision weight accumulates its gradient in float32 rows of its own
    flags["SCRATCH"] = dtype in (torch.bfloat16, torch.float16)
    out = {}
    for label, kernel, extra, field in LINEAR:
        if only is not None and field != only:
            continue
        b: Blocks = getattr(tiles, field)
        sizes = {"BT": b.tokens, "BV": b.vocab, "BD": b.dim}
        kernel_fn = getattr(ks, kernel)
        out[label] = compile_h100(kernel_fn, types, flags | sizes | extra, b.warps, target)
    return out


def _row(dtype: torch.dtype, tiles: KernelTiles, target: GPUTarget = H100) -> str:
    cells = []
    for cap in (False, True):
        for name, compiled in linear_kernels(dtype, tiles, cap, target=target).items():
            u = usage(compiled)
            cells.append(f"{name}{'+cap' if cap else ''} {u['REG']}r/{u['STACK']}B")
    return f"{NAMES[dtype]} {tiles}: " + ", ".join(cells)


def main(argv: list[str]) -> int:
    target = A100 if "--sm80" in argv else H100
    if "--chosen" in argv:
        for dtype, tiles in GPU_TILES.items():
            print(_row(dtype, tiles, target), flush=True)
        return 0
    for dtype in (torch.bfloat16, torch.float32):
        for *sizes, warps in itertools.product((32, 64, 128), (64, 128), (32, 64), (4, 8)):
            print(_row(dtype, KernelTiles.same(Blocks(*sizes, warps)), target), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
