"""Run benchmark suites and regenerate docs/benchmarks.md (and docs/benchmarks.json).

    python -m benchmarks.run                  # every suite (benchmarks/suites/__init__.py)
    python -m benchmarks.run linear logprobs  # only these: their records and sections are replaced
    python -m benchmarks.run --quick          # smoke run of every suite (small shapes, few repeats)
    python -m benchmarks.run --device cuda    # the CUDA sections: CUDA-event timing,
                                              # max_memory_allocated, kernels per call
    python -m benchmarks.run --from-json docs/benchmarks.json   # re-render the page only
    python -m benchmarks.run --drop-stale cuda   # drop the rows whose code was replaced

The suites live in ``benchmarks/suites/``, the protocol in ``benchmarks/harness.py`` and
``benchmarks/memory.py``, the page in ``benchmarks/report.py``; ``python -m
benchmarks.summary`` renders README.md's figures from the JSON.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import platform
import sys
import time
from pathlib import Path

import torch

import dapo_ops as d
from benchmarks import report, stale
from benchmarks.environment import loadavg, machine_description, peers
from benchmarks.harness import Protocol, copy_bandwidth, warm_allocator
from benchmarks.runner import run_case
from benchmarks.suites import SUITES

ROOT = Path(__file__).resolve().parent.parent


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("suites", nargs="*", help=f"any of {', '.join(SUITES)} (default: every suite)")
    p.add_argument("--quick", action="store_true", help="smoke run (small shapes, few repeats)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--json", default=str(ROOT / "docs" / "benchmarks.json"))
    p.add_argument("--out-md", default=str(ROOT / "docs" / "benchmarks.md"))
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    p.add_argument(
        "--only",
        default=None,
        help="only cases whose 'op size' contains this (prints, writes nothing)",
    )
    p.add_argument("--target-s", type=float, default=None, help="timing budget per implementation")
    p.add_argument("--min-repeats", type=int, default=None)
    p.add_argument("--max-repeats", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--from-json", default=None, help="re-render the page from this JSON")
    p.add_argument(
        "--drop-stale",
        default=None,
        metavar="DEVICE",
        help="drop from DEVICE's records (in --json) the rows pending there again (their code "
        "replaced since they ran) and the rows and cases the suites no longer have; re-render",
    )
    p.add_argument(
        "--note", action="append", default=None, help="notes for the page (replace the stored ones)"
    )
    args = p.parse_args(argv)
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        p.error(f"unknown suite(s) {', '.join(unknown)}; choose from {', '.join(SUITES)}")
    return args


def command(args: argparse.Namespace, suite: str) -> str:
    cmd = f"python -m benchmarks.run {suite}" + (" --quick" if args.quick else "")
    cmd += " --device cuda" if args.device == "cuda" else ""
    return cmd + (f" --threads {args.threads}" if args.threads else "")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    json_path, md_path = Path(args.json), Path(args.out_md)
    if args.drop_stale is not None:
        data = report.load(json_path)
        for line in stale.drop_stale(data, args.drop_stale):
            print(line)
        report.save(json_path, data)
        md_path.write_text(report.render(data))
        print(f"{json_path} and {md_path} written")
        return 0
    if args.from_json is not None:
        data = report.load(Path(args.from_json))
        if args.note is not None:
            data["notes"] = args.note
            report.save(Path(args.from_json), data)
        md_path.write_text(report.render(data))
        print(f"{md_path} re-rendered from {args.from_json}")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available here; nothing measured.", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    warm_allocator(args.device)
    proto = Protocol(
        device=args.device,
        quick=args.quick,
        target_s=args.target_s or (0.15 if args.quick else 1.0),
        min_repeats=args.min_repeats or (3 if args.quick else 5),
        max_repeats=args.max_repeats or (15 if args.quick else 50),
        memory=not args.no_memory,
        threads=torch.get_num_threads(),
    )
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    data = report.load(json_path)
    log(f"torch {torch.__version__}, device {args.device}, threads {proto.threads}")
    for name in args.suites or list(SUITES):
        suite, t0, load0 = SUITES[name], time.perf_counter(), loadavg()
        log(f"suite {name}")
        agreement = suite.agreement(args.device)
        bandwidth = copy_bandwidth(args.device, args.quick) if suite.bandwidth else None
        if bandwidth:
            log(f"  copy bandwidth {bandwidth / 1e9:.1f} GB/s")
        cases = suite.make_cases(args.quick, args.device)
        if args.only:
            cases = [c for c in cases if args.only in f"{c.op} {c.size}"]
        if suite.run is not None:
            results = suite.run(proto, log)
        else:
            results = []
            for case in cases:
                log(f"  {case.op} {case.size}")
                results += run_case(name, case, proto, log)
        meta = {
            "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
            "command": command(args, name),
            "quick": args.quick,
            "wall": time.perf_counter() - t0,
            "machine": machine_description(args.device),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "dapo_ops": d.__version__,
            "peers": peers(),
            "threads": proto.threads,
            "loads": [load0, loadavg()],
            "bandwidth": bandwidth,
            "agreement": agreement,
        }
        data["runs"].setdefault(args.device, {})[name] = report.make_record(meta, cases, results)
    if args.only:
        log("--only: nothing written")
        return 0
    report.save(json_path, data)
    md_path.write_text(report.render(data))
    log(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
