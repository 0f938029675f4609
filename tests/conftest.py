"""Shared test set-up: hypothesis profiles and the torch.compile helper.

Every annotation of dapo_ops is checked at run time in this suite: pyproject's pytest
``addopts`` passes ``--jaxtyping-packages=dapo_ops,beartype.beartype(...)`` (beartype with the PEP 484
numeric tower, so an int is accepted where a float is annotated).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import jaxtyping
import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=40,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

torch.set_num_threads(min(2, torch.get_num_threads()))


def _inductor_cache_per_cpu_capability() -> None:
    """Under ``ATEN_CPU_CAPABILITY``, keep inductor's on-disk cache apart for that capability.

    The capability picks the vector ISA of the C++ that inductor generates (AVX-512, AVX2,
    or none for ``default``), but inductor's cache keys (torch 2.13) do not include it: a
    graph compiled and cached by a native run is reused by an ``ATEN_CPU_CAPABILITY=default``
    run, whose headers then lack ``at::vec`` (a C++ compile error), and an AVX-512 kernel
    reused under ``avx2`` fails when it is called. So a run under an explicit capability
    gets a subdirectory of its own, below ``TORCHINDUCTOR_CACHE_DIR`` or inductor's default
    directory; a native run (no ``ATEN_CPU_CAPABILITY``) is left as it is. Set before
    anything is compiled (inductor reads the variable when it first needs the cache).
    """
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if not capability:
        return
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # a torch without that (private) helper: its documented default

        def default_cache_dir() -> str:
            import getpass
            import tempfile

            return os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")

    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"aten_cpu_capability_{capability}")


_inductor_cache_per_cpu_capability()


@pytest.fixture
def no_runtime_typecheck() -> Iterator[None]:
    """Turn the jaxtyping/beartype wrappers into plain calls (for torch.compile tracing).

    Dynamo cannot trace beartype's checking code, so compiled-graph tests switch the
    runtime checker off while they run; the eager tests keep it on.
    """
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


@pytest.fixture(params=["checker on", "checker off"])
def checker(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run an error test with jaxtyping's runtime checker on, then off: the same
    ``InputError`` (argument named) must come either way."""
    if request.param == "checker off":
        jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield str(request.param)
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


@pytest.fixture
def triton_interpreter(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """``TRITON_INTERPRET=1`` for one test only (kernel modules are loaded once per mode by
    ``dapo_ops._core._triton.load_kernels``; Triton itself may have been imported in
    either), with Triton 3.6's interpreter fixed for NumPy 2.4 (``_interpreter.py``)."""
    from _interpreter import index_fix

    # .ci/triton re-runs `-m triton` under each supported Triton: a kernel test carries it
    assert request.node.get_closest_marker("triton"), "mark the test pytest.mark.triton"

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with index_fix():
        yield
