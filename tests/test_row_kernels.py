"""The row kernels of the two-pass path, one at a time, against float64 references.

``dapo_ops.kernels.rows.stats`` (pass 1's pieces ``(m, s0, s1, x_y)``, merged over column
splits by ``merge`` and finished by ``finish``) and ``grad_`` (pass 2's ``G``), in both
implementations: the Triton kernels (under the interpreter on CPU, marked ``triton``;
on CUDA too when a GPU is present) and the ATen functions. Rows of every kind the lm-head
meets: a temperature, a cap, a truncation threshold (a raw logit: the chosen column
always kept), ``-inf`` columns (a bias's), a chosen id outside the block, a row all
``-inf`` but its chosen column, widths off every block size, float64 / float32 /
bfloat16 / float16 logits, a block split into column slices (``col0``) and merged. The
float64 results are held to ``F64_RTOL`` of the exact values; the others to the float32
bound of one exp/log per entry (``func_rel``) plus a sum over the row.
"""

from __future__ import annotations

import math

import pytest
import torch
from _bounds import assert_within, func_rel, unit_roundoff
from torch import Tensor

from dapo_ops import testing
from dapo_ops.kernels import rows as R

F64 = torch.float64
DTYPES = [F64, torch.float32, torch.bfloat16, torch.float16]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=["torch", pytest.param("triton", marks=pytest.mark.triton)])
def impl(request: pytest.FixtureRequest) -> str:
    if request.param == "triton":
        pytest.importorskip("triton")
        if not torch.cuda.is_available():
            request.getfixturevalue("triton_interpreter")
    return str(request.param)


def block(dtype: torch.dtype, device: str, n: int = 7, v: int = 45) -> tuple[Tensor, Tensor]:
    """Logits with a -inf column (a bias), a huge one, ties; and chosen ids, one outside."""
    g = torch.Generator().manual_seed(4)
    z = torch.randn(n, v, generator=g, dtype=F64) * 4
    z[:, 3] = -math.inf
    z[1, 10] = 60.0
    z[2, 5:9] = 1.5
    tok = torch.randint(0, v, (n,), generator=g)
    tok[0] = v + 3  # not among the columns (another slice's, another rank's)
    tok[4] = 3  # the -inf column itself
    return z.to(dtype).to(device), tok.to(device)


def exact(z: Tensor, tok: Tensor, tau: Tensor | None, rm: R.RowMath, col0: int = 0) -> dict[str, Tensor]:  # fmt: skip
    """float64 log p_y, H, lse of the rows (the kept set with a threshold)."""
    x = z.double()
    if rm.softcap is not None:
        x = rm.softcap * torch.tanh(x / rm.softcap)
    x = x / rm.temperature
    cols = torch.arange(col0, col0 + z.shape[1], device=z.device)
    if tau is not None:
        keep = (z.double() >= tau.double().unsqueeze(1)) | (cols == tok.unsqueeze(1))
        x = torch.where(keep, x, -math.inf)
    lse = torch.logsumexp(x, dim=1)
    lp = x - lse.unsqueeze(1)
    p = lp.exp()
    ent = -torch.where(p > 0, p * lp, 0.0).sum(dim=1)
    here = (tok >= col0) & (tok < col0 + z.shape[1])
    xy = x.gather(1, torch.where(here, tok - col0, 0).unsqueeze(1)).squeeze(1)
    return {"lse": lse, "ent": ent, "logp": torch.where(here, xy - lse, -math.inf), "x": x}


def tolerance(z: Tensor, want: Tensor) -> Tensor:
    """The bound of ``want`` (rows of ``z``): float64 ``F64_RTOL``; else float32's error of
    one exp/log per entry and a sum over the row, relative to the row's largest finite
    logit (the shift every term carries)."""
    if z.dtype == F64:
        return testing.F64_RTOL * (want.abs() + want.abs().max() + 1)
    u = unit_roundoff(torch.float32)
    big = torch.where(torch.isfinite(z), z.double().abs(), 0.0).amax(dim=1)
    scale = big if want.ndim == 1 else big.unsqueeze(1)
    return (func_rel(torch.float32) + z.shape[1] * u) * (want.abs() + scale + 1)


CASES = {
    "plain": (R.RowMath(), False),
    "temperature": (R.RowMath(0.7), False),
    "cap": (R.RowMath(1.3, 5.0), False),
    "threshold": (R.RowMath(0.9), True),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stats_merge_and_finish(impl: str, dtype: torch.dtype, case: str, device: str) -> None:
    rm, thresholded = CASES[case]
    z, tok = block(dtype, device)
    tau = z.to(R.compute_dtype(dtype)).topk(6, dim=1).values[:, -1] if thresholded else None
    if tau is not None:
        tau[3] = math.inf  # a row whose kept set is the chosen column alone
    want = exact(z, tok, tau, rm)
    got = R.finish(R.stats(z, tok, tau, rm, impl))
    split = R.finish(R.merge(torch.stack([
        R.stats(z[:, :17], tok, tau, rm, impl), R.stats(z[:, 17:], tok - 17, tau, rm, impl)
    ])))  # fmt: skip
    here = tok < z.shape[1]
    for pieces in (got, split):
        logp, ent, lse = pieces
        assert lse.dtype == R.compute_dtype(dtype)
        assert_within(lse, want["lse"], tolerance(z, want["lse"]), f"{case} lse")
        assert_within(ent, want["ent"], tolerance(z, want["ent"]), f"{case} entropy")
        wl = want["logp"][here]
        assert_within(logp[here], wl, tolerance(z[here], wl), f"{case} logp")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grad_in_place_and_in_slices(impl: str, dtype: torch.dtype, case: str, device: str) -> None:
    rm, thresholded = CASES[case]
    z, tok = block(dtype, device)
    cdt = R.compute_dtype(dtype)
    tau = z.to(cdt).topk(6, dim=1).values[:, -1] if thresholded else None
    ref = exact(z, tok, tau, rm)
    g = torch.Generator().manual_seed(5)
    a, b = (torch.randn(z.shape[0], generator=g, dtype=F64).to(device) for _ in range(2))
    p = (ref["x"] - ref["lse"].unsqueeze(1)).exp()
    lp = ref["x"] - ref["lse"].unsqueeze(1)
    onehot = torch.arange(z.shape[1], device=device) == tok.unsqueeze(1)
    want = a.unsqueeze(1) * (onehot.double() - p) - b.unsqueeze(1) * torch.where(p > 0, p * (lp + ref["ent"].unsqueeze(1)), 0.0)  # fmt: skip
    want = want / rm.temperature
    if rm.softcap is not None:
        want = want * (1 - torch.tanh(z.double() / rm.softcap) ** 2)
    up = (ref["lse"].to(cdt), ref["ent"].to(cdt), a.to(cdt), b.to(cdt))
    whole = R.grad_(z, torch.empty_like(z), tok, tau, rm, up, impl)
    sliced = torch.empty_like(z)
    for c0, c1 in ((0, 13), (13, 40), (40, z.shape[1])):  # widths off every block size
        R.grad_(z[:, c0:c1].contiguous(), sliced[:, c0:c1], tok, tau, rm, up, impl, c0)
    inplace = z.clone()
    R.grad_(inplace, inplace, tok, tau, rm, up, impl)
    bound = tolerance(z, want) * (a.abs() + b.abs() + 1).unsqueeze(1)
    if dtype in (torch.bfloat16, torch.float16):  # G rounded once into the logits' dtype
        bound = bound + unit_roundoff(dtype) * want.abs()
    for got in (whole, sliced, inplace):
        assert got.dtype == dtype
        assert torch.isfinite(got).all()
        assert_within(got.double(), want, bound, f"{case} G")
