"""Time the linear kernels' tiles on a GPU, for the next choice of ``GPU_BLOCKS``.

python -m benchmarks.tile_sweep                                  # bf16, 2048x896x32000
python -m benchmarks.tile_sweep --dtype fp32 --shape 1024x896x151936

For each candidate tile (tokens x vocabulary x hidden, warps) that compiles for the
device without spilling registers (``tools.sm90_tiles``: the cubin's stack frame), pass 1
(``forward_stats``) and pass 2 (``backward_grads``: ``dh`` and ``dW``) are timed with CUDA
events, medians of ``--repeats``, beside one ``h @ W.T`` in the same dtype (cuBLAS) as the
unit; the library's current choice is marked. Prints a table; nothing is written. Needs a
CUDA device (tools/gpu_session.sh runs it); on an H100 the candidates' compile takes
about a second each.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from collections.abc import Callable

import torch

from dapo_ops.logprobs._triton_linear import GPU_BLOCKS, Blocks, backward_grads, forward_stats

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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


def _spills(dtype: torch.dtype, b: Blocks) -> int:
    from tools.sm90_tiles import linear_kernels, usage

    tiles = (b.tokens, b.vocab, b.dim)
    return max(usage(k)["STACK"] for k in linear_kernels(dtype, tiles, b.warps, cap=False).values())


def _pass_times(
    h: torch.Tensor, w: torch.Tensor, tok: torch.Tensor, b: Blocks, repeats: int
) -> tuple[float, float]:
    """Median ms of pass 1 and of pass 2 (``dh`` and ``dW``, a loss of ``mean logp``)."""
    n = h.shape[0]
    _, ent, lse = forward_stats(h, w, None, tok, None, 1.0, None, blocks=b)
    a = torch.full((n,), 1.0 / n, device=h.device)
    t1 = _time(lambda: forward_stats(h, w, None, tok, None, 1.0, None, blocks=b), repeats)
    stats = (lse, ent, a, None)
    need = (True, True, False)
    t2 = _time(lambda: backward_grads(h, w, None, tok, None, stats, (1.0, None), need, b), repeats)
    return t1, t2


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
    print("tokens vocab hidden warps | spilled B | pass 1 | pass 2 | total | x h@W.T")
    current = GPU_BLOCKS[dtype]
    for bt, bv, bd, warps in itertools.product((32, 64, 128), (64, 128), (32, 64), (4, 8)):
        b = Blocks(bt, bv, bd, warps)
        spilled = _spills(dtype, b)
        if spilled:
            continue
        t1, t2 = _pass_times(h, w, tok, b, args.repeats)
        mark = "  <- GPU_BLOCKS" if b == current else ""
        print(f"{bt} {bv} {bd} {warps} | 0 | {t1:.3f} | {t2:.3f} | {t1 + t2:.3f} | "
              f"{(t1 + t2) / unit:.2f}{mark}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
