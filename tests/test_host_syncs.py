"""No host sync where the docs promise none, on every device present.

A sync makes the host wait for the GPU: an ``.item()``, a ``nonzero``, a blocking copy.
On ``cuda`` these tests run under ``torch.cuda.set_sync_debug_mode("error")``; on the CPU,
always, under its twin (``tests/_syncs.py``: CPU tensors standing for CUDA ones, so the
library takes its GPU branches, and every operation that would sync a CUDA host logged
with its line of dapo_ops). ``test_the_twin_and_the_gpu_see_the_same_syncs`` holds the two to one
table on a GPU. Checked mode reads values on the host by design: it is off here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _syncs import generator, watch
from test_bad_inputs import REGISTRY, Fresh, build, call, outputs
from test_devices import DEVICES, extras, on
from torch import Tensor
from torch.autograd import backward

import dapo_ops as d
from dapo_ops.objectives import OBJECTIVES
from dapo_ops.testing import Batch, make_batch

# The runtime annotation checker wraps the library in this suite only; what users run is
# the library's own code (and the twin's bookkeeping of each checker call costs time).
pytestmark = pytest.mark.usefixtures("no_runtime_typecheck")

#: What the twin must see as a sync (True) or not: each row is ``fn(x, mask, index)``
#: on a float ``[6]``, its ``> 0`` mask and an int64 ``[2]`` index, all on the device.
TABLE: dict[str, tuple[Callable[[Tensor, Tensor, Tensor], object], bool]] = {
    ".item()": (lambda x, m, i: x[0].item(), True),
    "bool()": (lambda x, m, i: bool(x[0] > 0), True),
    "float()": (lambda x, m, i: float(x.sum()), True),
    ".tolist()": (lambda x, m, i: x.tolist(), True),
    ".cpu()": (lambda x, m, i: x.cpu(), True),
    "nonzero": (lambda x, m, i: x.nonzero(), True),
    "x[mask]": (lambda x, m, i: x[m], True),
    "x[mask] = 1": (lambda x, m, i: x.clone().__setitem__(m, 1.0), True),
    "masked_select": (lambda x, m, i: torch.masked_select(x, m), True),
    "unique": (lambda x, m, i: torch.unique(x), True),
    "equal": (lambda x, m, i: torch.equal(x, x), True),
    "repeat_interleave": (lambda x, m, i: torch.repeat_interleave(i), True),
    "bincount": (lambda x, m, i: torch.bincount(i), True),
    "as_tensor(0.5, device)": (lambda x, m, i: torch.as_tensor(0.5, device=x.device), True),
    "tensor([1.0], device)": (lambda x, m, i: torch.tensor([1.0], device=x.device), True),
    "host.to(device)": (lambda x, m, i: torch.ones(3).to(x.device), True),
    "sum": (lambda x, m, i: x.sum(), False),
    "any": (lambda x, m, i: x.any(), False),
    "where": (lambda x, m, i: torch.where(m, x, 0.0), False),
    "full(device)": (lambda x, m, i: torch.full((), 0.5, device=x.device), False),
    "arange(device)": (lambda x, m, i: torch.arange(6, device=x.device) + x, False),
    "x * 0-dim host": (lambda x, m, i: x * torch.tensor(2.0), False),
    "sort, topk": (lambda x, m, i: (x.sort(), x.topk(2)), False),
    "x[index]": (lambda x, m, i: x[i], False),
    "repeat_interleave(output_size)": (
        lambda x, m, i: i.repeat_interleave(i, output_size=4),
        False,
    ),
    "cumsum, index_add_": (lambda x, m, i: x.cumsum(0).index_add_(0, i, x[:2]), False),
    "backward": (lambda x, m, i: backward((x.clone().requires_grad_(True) * 2).sum()), False),
}


@pytest.mark.parametrize("row", TABLE)
@pytest.mark.parametrize("device", DEVICES)
def test_the_twin_and_the_gpu_see_the_same_syncs(device: str, row: str) -> None:
    """Each row of :data:`TABLE` syncs, or not, as the table says: on CUDA (the
    sync-debug mode) and under the CPU twin alike."""
    fn, syncs_expected = TABLE[row]
    x = torch.linspace(-1.0, 1.5, 6, device=device)
    mask, index = x > 0, torch.tensor([1, 3], device=device)
    with watch(device) as syncs:
        fn(x, mask, index)
    assert bool(syncs) == syncs_expected, f"{row}: {syncs.seen or 'no sync'}"


def test_the_twin_refuses_host_tensors_meeting_device_ones() -> None:
    """A host tensor of one dimension or more in an operation with device tensors (an
    error on CUDA, or a blocking copy), named with its shape; a 0-dim one is a scalar."""
    x = torch.ones(3)
    with watch("cpu") as syncs:
        x * torch.tensor(2.0)  # a host scalar: read from host memory
    assert not syncs
    with watch("cpu") as syncs:
        x + torch.ones(3)
    assert syncs.seen and "host tensor [3] meets device tensors" in syncs.seen[0]


def _no_sync_calls(b: Batch) -> dict[str, Callable[[], object]]:
    logp = b.logp.detach().requires_grad_(True)
    opts = extras(b, True)
    ent = torch.rand_like(b.logp) * 3
    count = d.global_normalizer([b.mask[:3], b.mask[3:]])

    def fwd_bwd(objective: d.Objective, **kw: Any) -> Callable[[], object]:
        return lambda: backward(d.policy_loss(objective, logp, *b[1:], **kw))

    calls = {
        f"policy_loss({c.__name__}(), KL, IS) fwd+bwd": fwd_bwd(c(), **opts) for c in OBJECTIVES
    }
    calls |= {
        "token_level_loss fwd+bwd": lambda: backward(d.token_level_loss(logp, *b[1:])),
        "policy_loss(normalizer=tensor) fwd+bwd": fwd_bwd(d.ClipHigher(), normalizer=count),
        "policy_loss_with_diagnostics": lambda: d.policy_loss_with_diagnostics(
            d.ClipHigher(), logp, *b[1:]
        ),
        "global_normalizer": lambda: d.global_normalizer([b.mask[:3], b.mask[3:]]),
        "truncated_is_weights (sequence)": lambda: d.truncated_is_weights(
            b.old_logp, b.logp.detach(), b.mask, level="sequence", batch_normalize=True
        ),
        "rejection_mask (seq_mean)": lambda: d.rejection_mask(
            b.old_logp, b.logp.detach(), b.mask, level="seq_mean", upper=2.0
        ),
        "offpolicy_metrics": lambda: d.offpolicy_metrics(b.old_logp, b.logp.detach(), b.mask),
        "high_entropy_mask": lambda: d.high_entropy_mask(ent, b.mask, top_quantile=0.2),
        "kl_cov_mask": lambda: d.kl_cov_mask(b.logp.detach(), b.advantages, b.mask),
        "entropy_bonus": lambda: d.entropy_bonus(ent, b.mask, coef=0.01),
        "m2po_mask": lambda: d.m2po_mask(b.old_logp, b.logp.detach(), b.mask, threshold=0.04),
        "truncation_penalty": lambda: d.truncation_penalty(b.advantages, b.mask[:, 0], coef=0.5),
        "kl_reward": lambda: d.kl_reward(ent, b.old_logp, opts["ref_logp"], b.mask, coef=0.1),
        "kl_reward(coef=device tensor)": lambda: d.kl_reward(
            ent, b.old_logp, opts["ref_logp"], b.mask, coef=torch.full((), 0.1, device=ent.device)
        ),
        "kl_reward(coef=host 0-dim tensor)": lambda: d.kl_reward(
            ent, b.old_logp, opts["ref_logp"], b.mask, coef=torch.tensor(0.1)
        ),
    }
    return calls


@pytest.mark.parametrize("device", DEVICES)
@d.checked(False)  # checked mode reads values on the host by design
def test_no_host_sync_where_none_is_promised(device: str) -> None:
    """The loss path and the diagnostics, each call on its own: no ``.item()``, no
    ``nonzero``, no blocking copy."""
    b = on(device, make_batch(d.ClipHigher(), 6, 33, seed=8, dtype=torch.float32))
    calls = _no_sync_calls(b)
    for fn in calls.values():  # warm up: lazy CUDA init and the caching allocator
        fn()
    failed = []
    for name, fn in calls.items():
        with watch(device) as syncs:
            fn()
        failed += [f"{name}: {s}" for s in syncs.seen]
    assert not failed, "host syncs:\n" + "\n".join(failed)


@pytest.mark.parametrize("device", DEVICES)
@d.checked(False)
def test_no_host_sync_with_a_number_as_normalizer(device: str) -> None:
    """``normalizer=`` a Python number (a step's token count known on the host)."""
    b = on(device, make_batch(d.ClipHigher(), 6, 33, seed=8, dtype=torch.float32))
    logp = b.logp.detach().requires_grad_(True)
    backward(d.policy_loss(d.ClipHigher(), logp, *b[1:], normalizer=40.0))  # warm-up
    with watch(device) as syncs:
        backward(d.policy_loss(d.ClipHigher(), logp, *b[1:], normalizer=40.0))
    assert not syncs, syncs.seen


#: The public functions that read a value on the host by design, with the registry's
#: valid arguments (measured by the test below, on a GPU and under the CPU twin), each a
#: value check that raises ``InputError`` and is skipped under ``torch.compile``; each
#: docstring says so (checked below).
DOCUMENTED_SYNCS: dict[str, str] = {
    "batch_diagnostics": "lengths finite and >= 0",
    "difficulty_band_mask": "a NaN or inf metric",
    "dynamic_sample_mask": "a NaN or inf metric",
    "fused_logprobs_entropy": "token ids in [0, vocab)",
    "gdpo_advantages": "components finite",
    "group_advantages": "rewards finite",
    "linear_distill_loss_with_diagnostics": "teacher ids in [0, vocab)",
    "linear_policy_loss": "token ids in [0, vocab)",
    "linear_policy_loss_with_diagnostics": "token ids in [0, vocab)",
    "opo_advantages": "lengths finite and >= 0",
    "overlong_reward": "lengths finite and >= 0",
    "passk_advantages": "two samples in every group",
    "pf_ppo_resample": "weights finite",
    "token_logprobs": "token ids in [0, vocab)",
    "token_logprobs_and_entropy": "token ids in [0, vocab)",
}


def test_documented_syncs_are_in_the_docstrings() -> None:
    """Each function of DOCUMENTED_SYNCS says "host sync" in its docstring."""
    for name in DOCUMENTED_SYNCS:
        doc = " ".join((getattr(d, name).__doc__ or "").split())
        assert "host sync" in doc, f"{name}: its docstring does not mention its host sync"


def _on(device: str, value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, Fresh) and isinstance(value.make(), torch.Generator):
        return Fresh(lambda: generator(device))  # a seeded generator of the device
    if isinstance(value, list):
        return [_on(device, v) for v in value]
    return value


@pytest.mark.parametrize("device", DEVICES)
@d.checked(False)  # checked mode reads values on the host by design
def test_every_public_function_runs_on_the_device(device: str) -> None:
    """Every function of the bad-input registry (so every public function) with valid
    arguments on the device: its tensors come back there, shaped and typed as the plain
    CPU call's and finite where they are, and no host sync but the documented ones."""
    errors, synced = [], {}
    for s in REGISTRY:
        cpu_args = build(s, batch=4, seq=6)
        args = {k: _on(device, v) for k, v in cpu_args.items()}
        try:
            want = outputs(call(s, cpu_args))
            got = outputs(call(s, args)) if device == "cuda" else []  # CUDA's warm-up
            places = {x.device.type for x in got if x.ndim}
            with watch(device) as syncs:
                got = outputs(call(s, args))  # the twin: the device's branches
                places = {x.device.type for x in got if x.ndim}
        except Exception as e:
            errors.append(f"{s.name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        if syncs:
            synced[s.name] = syncs.seen[0]
        if places - {"cuda"}:
            errors.append(f"{s.name}: an output on {places - {'cuda'}}")
        for w, x in zip(want, got, strict=True):
            if x.dtype != w.dtype or x.shape != w.shape:
                errors.append(f"{s.name}: {x.dtype}{tuple(x.shape)} != {w.dtype}{tuple(w.shape)}")
            elif w.is_floating_point() and not torch.equal(w.isfinite(), x.cpu().isfinite()):
                errors.append(f"{s.name}: finite entries differ from the CPU's")
    unexpected = {k: v for k, v in synced.items() if k not in DOCUMENTED_SYNCS}
    report = "\n".join(errors + [f"{k}: host sync: {v}" for k, v in sorted(unexpected.items())])
    report += "\nno longer syncing: " + ", ".join(sorted(set(DOCUMENTED_SYNCS) - set(synced)))
    assert not errors and not unexpected and set(synced) == set(DOCUMENTED_SYNCS), report
