"""Time the linear kernels' tiles on a GPU, kernel by kernel, for the next ``GPU_TILES``.

python -m benchmarks.tile_sweep                                  # bf16, 2048x896x32000
python -m benchmarks.tile_sweep --shape 8192x4096x151936         # the 7B-scale shape

Each kernel walks one dimension and keeps float32 accumulator rows of the other, read and
written once per tile of the dimension it walks (docs/linear_loss.md): pass 1 the
vocabulary, the hidden gradient the vocabulary (its traffic falls with the vocabulary
tile), the weight gradient the tokens (it falls with the token tile). So the candidates
differ per kernel: :data:`CANDIDATES`, tiles that compile for an H100 without spilling a
register in bfloat16 under every supported Triton (tests/test_triton_compile.py checks
them; .ci/triton runs it under each). Each is timed alone with CUDA events, medians of
``--repeats``, beside one ``h @ W.T`` (cuBLAS) as the unit; the current ``GPU_TILES`` entry
is marked, and the fastest per kernel is printed as the ``KernelTiles`` to set. Nothing is
written. Needs a CUDA device (tools/gpu_session.sh runs it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch

from dapo_ops.logprobs._triton_linear import (
    GPU_TILES,
    Blocks,
    backward_grads,
    forward_stats,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: bfloat16 tiles per kernel that spill nothing under Triton 3.6 to 3.9 (8 warps; with 4
#: most spill or sit at 255 registers): larger vocabulary tiles for the hidden gradient,
#: larger token tiles for the weight gradient, both for pass 1. (32 x 256 for the hidden
#: gradient and 256 x 64 for the weight gradient spill under 3.8 and 3.9 only.)
CANDIDATES: dict[str, tuple[Blocks, ...]] = {
    "fwd": (
        Blocks(64, 64, 32, 8),
        Blocks(64, 128, 32, 8),
        Blocks(128, 64, 32, 8),
        Blocks(64, 256, 32, 8),
        Blocks(128, 128, 32, 8),
    ),
    "hidden": (Blocks(64, 64, 32, 8), Blocks(32, 128, 32, 8), Blocks(32, 128, 64, 8)),
    "weight": (Blocks(64, 64, 32, 8), Blocks(128, 32, 32, 8), Blocks(256, 32, 32, 8)),
}


def _time(fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` CUDA-event timings (after a warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


#: The opt-in gradient filter's threshold timed beside the exact pass 2: bfloat16's
#: resolution over 32, cut-cross-entropy's default for bfloat16.
FILTER_EPS = 2.0**-12


def _runner(
    h: torch.Tensor,
    w: torch.Tensor,
    tok: torch.Tensor,
    kernel: str,
    b: Blocks,
    filter_eps: float | None = None,
) -> Callable[[], object]:
    """One call of ``kernel`` (a :class:`KernelTiles` field) at tiles ``b``: pass 1, or
    pass 2 with only ``dh`` or only ``dW`` asked for (a loss of ``mean logp``), with the
    gradient filter at ``filter_eps`` (None: off)."""
    if kernel == "fwd":
        return lambda: forward_stats(h, w, None, tok, None, 1.0, None, blocks=b)
    n = h.shape[0]
    _, ent, lse = forward_stats(h, w, None, tok, None, 1.0, None)
    stats = (lse, ent, torch.full((n,), 1.0 / n, device=h.device), None)
    need = (kernel == "hidden", kernel == "weight", False)
    return lambda: backward_grads(h, w, None, tok, None, stats, (1.0, None), need, b, filter_eps)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--shape", default="2048x896x32000", help="tokens x d x vocab")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tile_sweep needs a CUDA device")
        return 1
    n, dim, vocab = (int(x) for x in args.shape.split("x"))
    dtype = DTYPES[args.dtype]
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, dim, device="cuda", generator=g).to(dtype)
    w = (torch.randn(vocab, dim, device="cuda", generator=g) / dim**0.5).to(dtype)
    tok = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    unit = _time(lambda: h @ w.T, args.repeats)
    print(f"{args.dtype} {args.shape}: one h @ W.T {unit:.3f} ms (cuBLAS); times in ms")
    current, best = GPU_TILES[dtype], {}
    for kernel, candidates in CANDIDATES.items():
        times = {}
        for b in candidates:
            times[b] = _time(_runner(h, w, tok, kernel, b), args.repeats)
            mark = "  <- GPU_TILES" if b == getattr(current, kernel) else ""
            print(
                f"{kernel} {b} | {times[b]:.3f} | {times[b] / unit:.2f} x h@W.T{mark}", flush=True
            )
        best[kernel] = min(times, key=times.__getitem__)
        if kernel != "fwd":  # the opt-in filter at the current tiles (issue 30: does it pay?)
            b = getattr(current, kernel)
            t = _time(_runner(h, w, tok, kernel, b, FILTER_EPS), args.repeats)
            print(f"{kernel} {b} filter_eps 2^-12 | {t:.3f} | {t / unit:.2f} x h@W.T", flush=True)
    print(f"fastest: KernelTiles({', '.join(f'{k}={b!r}' for k, b in best.items())})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
