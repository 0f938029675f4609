"""``token_level_loss`` (and ``linear_policy_loss``) fwd+bwd against an older checkout,
in one process, side by side.

    python -m benchmarks.bench_vs_checkout 4ffa07f            # the code before the engine
    python -m benchmarks.bench_vs_checkout 4ffa07f --shapes 64x4096 512x8192 --repeats 60
    python -m benchmarks.bench_vs_checkout 37572c3 --linear 2048x896x32000 --repeats 10

The older package is exported with ``git archive`` into a temporary directory and
imported as ``dapo_ops_base`` (its ``dapo_ops`` imports renamed), so both run in the
same process on the same inputs (``benchmarks/suites/_inputs.py``: padding
zeros, per-row advantages, dual clip off), interleaved call by call. Reports the median
and the minimum of each (eager, ``compiled=True``) and the ratio new / base; the
regression gate of the engine issue is "within 10 %" on the medians.
"""

from __future__ import annotations

import argparse
import importlib
import io
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

import dapo_ops
from benchmarks.suites._inputs import loss_inputs


def import_checkout(rev: str, into: Path) -> ModuleType:
    """``src/dapo_ops`` at ``rev``, importable as ``dapo_ops_base``."""
    root = Path(__file__).resolve().parent.parent
    tar = subprocess.run(
        ["git", "archive", rev, "src/dapo_ops"], cwd=root, check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    pkg = into / "src" / "dapo_ops"
    for path in pkg.rglob("*.py"):
        text = path.read_text()
        text = text.replace("from dapo_ops", "from dapo_ops_base").replace(
            "import dapo_ops", "import dapo_ops_base"
        )
        path.write_text(text)
    pkg.rename(into / "src" / "dapo_ops_base")
    sys.path.insert(0, str(into / "src"))
    return importlib.import_module("dapo_ops_base")


def step(
    lib: ModuleType, compiled: bool, shape: tuple[int, int], kl_is: bool
) -> Callable[[], None]:
    inp = loss_inputs(*shape, "cpu")
    lp = inp.logp.detach().clone().requires_grad_(True)
    g = torch.Generator().manual_seed(1)
    extra = (
        {
            "ref_logp": inp.old - 0.1,
            "kl_beta": 0.04,
            "is_weights": torch.rand(shape, generator=g) * 2,
        }
        if kl_is
        else {}
    )

    def run() -> None:
        out = lib.token_level_loss(lp, inp.old, inp.adv, inp.mask, compiled=compiled, **extra)
        out.backward()
        lp.grad = None

    return run


def linear_step(lib: ModuleType, tokens: int, d: int, vocab: int) -> Callable[[], None]:
    """``linear_policy_loss`` fwd+bwd (float32, the default objective) on fixed inputs:
    ``tokens`` as rows of 512, every position valid."""
    g = torch.Generator().manual_seed(0)
    batch = max(tokens // 512, 1)
    hidden = torch.randn(batch, tokens // batch, d, generator=g).requires_grad_(True)
    weight = (torch.randn(vocab, d, generator=g) / d**0.5).requires_grad_(True)
    ids = torch.randint(0, vocab, (batch, tokens // batch), generator=g)
    old = torch.full(ids.shape, -9.0)
    adv, mask = torch.randn(batch, generator=g), torch.ones(ids.shape, dtype=torch.bool)

    def run() -> None:
        lib.linear_policy_loss(hidden, weight, ids, old, adv, mask).backward()
        hidden.grad = weight.grad = None

    return run


def interleave(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Three warm-up calls each (compiles included), then ``repeats`` rounds, one call of
    each per round: seconds per call."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def row(label: str, path: str, times: dict[str, list[float]]) -> str:
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    low = {k: min(v) * 1e3 for k, v in times.items()}
    return (
        f"| {label} | {path} | {med['base']:.3f} ms | {med['new']:.3f} ms | "
        f"{med['new'] / med['base']:.2f} | {low['base']:.3f} ms | {low['new']:.3f} ms |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("rev", help="the git revision to compare with (e.g. the commit before a change)")
    p.add_argument("--shapes", nargs="+", default=["64x4096"], help="BATCHxSEQ (default 64x4096)")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--threads", type=int, default=min(2, torch.get_num_threads()))
    p.add_argument(
        "--kl-is",
        action="store_true",
        help="with a k3 KL penalty (kl_beta=0.04) and IS weights (GRPO with rollout correction)",
    )
    p.add_argument(
        "--linear",
        nargs="*",
        default=[],
        metavar="TOKENSxDxVOCAB",
        help="also linear_policy_loss fwd+bwd at these shapes (e.g. 2048x896x32000)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        base = import_checkout(args.rev, Path(tmp))
        print(f"torch {torch.__version__}, {args.threads} threads, fp32, fwd+bwd, "
              f"{args.repeats} interleaved repeats; base = {args.rev}"
              + ("; with KL and IS weights" if args.kl_is else ""))  # fmt: skip
        print("| shape | path | base median | new median | new / base | base min | new min |")
        print("|---|---|---|---|---|---|---|")
        for text in args.shapes:
            shape = tuple(int(x) for x in text.split("x"))
            assert len(shape) == 2
            for compiled in (False, True):
                fns = {
                    "base": step(base, compiled and not args.kl_is, shape, args.kl_is),
                    "new": step(dapo_ops, compiled, shape, args.kl_is),
                }
                path = "compiled=True" if compiled else "eager"
                if compiled and args.kl_is:
                    path += " (base: eager, it had no compiled KL path)"
                print(row(text, path, interleave(fns, args.repeats)))
        for text in args.linear:
            tokens, d, vocab = (int(x) for x in text.split("x"))
            fns = {
                "base": linear_step(base, tokens, d, vocab),
                "new": linear_step(dapo_ops, tokens, d, vocab),
            }
            print(row(text, "linear_policy_loss", interleave(fns, args.repeats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
