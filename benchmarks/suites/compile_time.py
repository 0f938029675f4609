"""Suite ``compile``: what a compiled path costs before its first step, cold and warm.

Each sample is one fresh process (``python -m benchmarks.suites.compile_time SPEC``) that
builds the inputs and times the first call (tracing, inductor, the C++ build) and the
steady-state call after it; compile time = first - steady. *cold*: a new, empty
inductor cache directory (``TORCHINDUCTOR_CACHE_DIR``) per process, as a fresh machine
or CI; *warm*: a directory that an earlier process filled, as every later run on one
machine. The times columns of this suite are compile times, not step times.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import dapo_ops as d
from benchmarks.harness import Case, Fn, Impl, Protocol, Result, Suite
from benchmarks.suites._inputs import LossInputs, fwd_bwd, loss_inputs

ROOT = Path(__file__).resolve().parents[2]


def _loss(compiled: bool, kl: bool = False) -> Callable[[LossInputs], Fn]:
    preset = d.presets.GRPO if kl else d.presets.DAPO

    def build(x: LossInputs) -> Fn:
        extra: dict[str, Any] = {"kl": preset.kl, "ref_logp": x.ref} if kl else {}
        return fwd_bwd(
            lambda lp: d.policy_loss(
                preset.objective,
                lp,
                x.old,
                x.adv,
                x.mask,
                mode=preset.mode,
                compiled=compiled,
                **extra,
            ),
            x.logp,
        )

    return build


def _user_compiled(x: LossInputs) -> Fn:
    fn = torch.compile(d.token_level_loss, fullgraph=True)
    return fwd_bwd(lambda lp: fn(lp, x.old, x.adv, x.mask), x.logp)


BUILDERS: dict[str, Callable[[LossInputs], Fn]] = {
    "DAPO policy_loss(compiled=True)": _loss(True),
    "GRPO preset policy_loss(compiled=True) (k3 KL)": _loss(True, kl=True),
    "torch.compile(token_level_loss, fullgraph=True)": _user_compiled,
}


def make_cases(quick: bool, device: str) -> list[Case]:
    return [
        Case(
            f"compile time, {cache} inductor cache",
            "64x4096",
            lambda: None,
            [Impl(name, "ours", lambda _: lambda: None, compiled=True) for name in BUILDERS],
            memory="none",
        )
        for cache in ("cold", "warm")
    ]


def child(spec: dict[str, Any]) -> dict[str, float]:
    torch.set_num_threads(spec["threads"])
    fn = BUILDERS[spec["impl"]](loss_inputs(64, 4096, spec["device"]))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"first": times[0], "steady": min(times[1:])}


def _sample(impl: str, cache_dir: str, proto: Protocol) -> float:
    spec = {"impl": impl, "threads": proto.threads, "device": proto.device}
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.suites.compile_time", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=ROOT,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return max(float(got["first"]) - float(got["steady"]), 0.0)


def run(proto: Protocol, log: Callable[[str], None]) -> list[Result]:
    repeats = 1 if proto.quick else 2
    results = []
    for case in make_cases(proto.quick, proto.device):
        cold = case.op.startswith("compile time, cold")
        for impl in case.impls:
            res = Result("compile", case.op, case.size, impl.name, impl.role)
            try:
                with tempfile.TemporaryDirectory() as warm_dir:
                    if not cold:
                        _sample(impl.name, warm_dir, proto)  # fills the cache
                    for _ in range(repeats):
                        if cold:
                            with tempfile.TemporaryDirectory() as fresh:
                                res.times.append(_sample(impl.name, fresh, proto))
                        else:
                            res.times.append(_sample(impl.name, warm_dir, proto))
            except Exception as e:
                detail = str(getattr(e, "stderr", "") or e).strip().splitlines()
                res.error = f"{type(e).__name__}: {(detail or [''])[-1][:200]}"
            res.compile_s = res.median if res.times else None
            log(f"    {case.op}: {impl.name}: {res.times or res.error}")
            results.append(res)
    return results


SUITE = Suite(
    name="compile",
    title="Compile time",
    make_cases=make_cases,
    notes=(
        "Times in this suite are compile times (first call - steady call, fwd+bwd at "
        "64x4096, float32), one fresh process per sample.",
    ),
    bandwidth=False,
    run=run,
)

if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))))
