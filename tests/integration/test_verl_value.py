"""verl 0.9.1's value loss, KL-in-reward (with its controllers) and PF-PPO resampling
against :mod:`dapo_ops.integrations.verl_value` and the dapo_ops functions, in float64.

``ray_trainer.apply_kl_penalty`` lives in a module that needs verl's data-loading stack
(``torchdata``) to import: its function is read from the installed file with ``ast`` and
executed as verl ships it, with the names it uses from ``core_algos`` and
``torch_functional``.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
verl = pytest.importorskip("verl")

import dapo_ops as d  # noqa: E402
from dapo_ops.integrations import verl_value as twin  # noqa: E402

pytestmark = pytest.mark.integration

MODES = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
         "seq-mean-token-sum-norm"]  # fmt: skip
RTOL, ATOL = 1e-7, 1e-10  # verl's +1e-8 in seq-mean-token-mean's and masked_mean's divisions


def batch(seed: int, rows: int = 12, seq: int = 9) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, seq + 1, (rows,), generator=g)
    lengths[1] = 0  # an empty row
    mask = torch.arange(seq) < lengths[:, None]

    def rnd(scale: float = 1.0) -> Tensor:
        return torch.randn(rows, seq, generator=g, dtype=torch.float64) * scale

    return {"mask": mask, "values": rnd(), "returns": rnd(), "vpreds": rnd(),
            "logp": rnd(0.5) - 1.0, "ref": rnd(0.5) - 1.0, "scores": rnd()}  # fmt: skip


Tensor = torch.Tensor


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "info", [{}, {"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 20}]
)
@pytest.mark.parametrize("clip", [0.5, 0.1])
def test_value_loss(mode: str, info: dict[str, int], clip: float) -> None:
    if mode == "token-sum" and info:
        info = {"dp_size": 2}
    for seed in range(3):
        b = batch(seed)
        got_v = b["vpreds"].clone().requires_grad_(True)
        want_v = b["vpreds"].clone().requires_grad_(True)
        kw = {"loss_agg_mode": mode, **info}
        want, want_frac = core_algos.compute_value_loss(
            want_v, b["returns"], b["values"], b["mask"], cliprange_value=clip, **kw
        )
        got, got_frac = twin.compute_value_loss(
            got_v, b["returns"], b["values"], b["mask"], cliprange_value=clip, **kw
        )
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(got_frac, want_frac, rtol=RTOL, atol=ATOL)
        (g_got,) = torch.autograd.grad(got, got_v)
        (g_want,) = torch.autograd.grad(want, want_v)
        torch.testing.assert_close(g_got, g_want, rtol=RTOL, atol=ATOL)


def test_value_loss_loss_scale_factor() -> None:
    b = batch(7)
    kw: dict[str, Any] = {"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 64}
    want, _ = core_algos.compute_value_loss(
        b["vpreds"], b["returns"], b["values"], b["mask"], 0.2, **kw
    )
    got, _ = twin.compute_value_loss(b["vpreds"], b["returns"], b["values"], b["mask"], 0.2, **kw)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def verl_apply_kl_penalty() -> Any:
    """``ray_trainer.apply_kl_penalty`` as verl 0.9.1 ships it (see the module docstring)."""
    from verl.utils.torch_functional import masked_mean

    path = Path(verl.__file__).parent / "trainer" / "ppo" / "ray_trainer.py"
    tree = ast.parse(path.read_text())
    (fn,) = [
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "apply_kl_penalty"
    ]
    namespace: dict[str, Any] = {"core_algos": core_algos, "masked_mean": masked_mean,
                                 "torch": torch, "DataProto": object}  # fmt: skip
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), namespace)
    return namespace["apply_kl_penalty"]


def data_proto(b: dict[str, Tensor]) -> Any:
    from verl.protocol import DataProto

    return DataProto.from_dict(
        tensors={
            "response_mask": b["mask"].to(torch.float64),
            "token_level_scores": b["scores"],
            "old_log_probs": b["logp"],
            "ref_log_prob": b["ref"],
        }
    )


@pytest.mark.parametrize("name", ["kl", "abs", "mse", "low_var_kl", "k3+"])
@pytest.mark.parametrize("ctrl", ["fixed", "adaptive"])
def test_apply_kl_penalty(name: str, ctrl: str) -> None:
    verl_fn = verl_apply_kl_penalty()
    if ctrl == "fixed":
        want_ctrl, got_ctrl = core_algos.FixedKLController(0.05), twin.FixedKLController(0.05)
    else:
        want_ctrl = core_algos.AdaptiveKLController(0.05, target_kl=0.02, horizon=100)
        got_ctrl = twin.AdaptiveKLController(0.05, target_kl=0.02, horizon=100)
    for seed in range(4):  # four steps: the adaptive coefficient moves each time
        b = batch(seed)
        want_data, want_m = verl_fn(data_proto(b), want_ctrl, kl_penalty=name)
        got_data, got_m = twin.apply_kl_penalty(data_proto(b), got_ctrl, kl_penalty=name)
        torch.testing.assert_close(
            got_data.batch["token_level_rewards"], want_data.batch["token_level_rewards"],
            rtol=RTOL, atol=ATOL,  # the adaptive coefficient carries verl's 1e-8 in its KL mean
        )  # fmt: skip
        assert got_m["actor/reward_kl_penalty"] == pytest.approx(
            want_m["actor/reward_kl_penalty"], rel=RTOL, abs=ATOL
        )
        assert got_m["actor/reward_kl_penalty_coeff"] == pytest.approx(
            want_m["actor/reward_kl_penalty_coeff"], rel=RTOL
        )
        assert got_ctrl.value == pytest.approx(want_ctrl.value, rel=RTOL)


def test_adaptive_kl_coef_is_verls_update() -> None:
    for kl in (0.0, 0.05, 0.1, 0.11, 0.3, 5.0):
        want = core_algos.AdaptiveKLController(0.2, target_kl=0.1, horizon=500)
        want.update(current_kl=kl, n_steps=64)
        assert d.adaptive_kl_coef(0.2, kl, n_steps=64, target=0.1, horizon=500) == pytest.approx(
            want.value, rel=1e-15
        )
        t = d.adaptive_kl_coef(
            torch.tensor(0.2, dtype=torch.float64), kl, n_steps=64, target=0.1, horizon=500
        )
        assert float(t) == pytest.approx(want.value, rel=1e-15)


@pytest.mark.parametrize("method", ["pow", "max_min", "max_random"])
def test_pf_ppo_reweight(method: str) -> None:
    import numpy as np
    from verl.protocol import DataProto

    for seed in range(3):
        b = batch(seed)
        b["scores"] = torch.round(b["scores"])  # ties at the max and min
        uids = np.array([f"u{i % 4}" for i in range(b["mask"].shape[0])], dtype=object)
        data = DataProto.from_dict(
            tensors={"token_level_scores": b["scores"], "values": b["values"]},
            non_tensors={"uid": uids},
            meta_info={"per_row": list(range(b["mask"].shape[0])), "step": 3},
        )
        torch.manual_seed(100 + seed)
        want = core_algos.compute_pf_ppo_reweight_data(data, method, 2.0)
        torch.manual_seed(100 + seed)
        got = twin.compute_pf_ppo_reweight_data(data, method, 2.0)
        torch.testing.assert_close(got.batch["values"], want.batch["values"], rtol=0, atol=0)
        assert list(got.non_tensor_batch["uid"]) == list(want.non_tensor_batch["uid"])
        assert got.meta_info == want.meta_info


def test_get_kl_controller() -> None:
    from verl.trainer.config.algorithm import KLControlConfig

    for kind in ("fixed", "adaptive"):
        cfg = KLControlConfig(type=kind, kl_coef=0.01, horizon=100, target_kl=0.05)
        want, got = core_algos.get_kl_controller(cfg), twin.get_kl_controller(cfg)
        for kl in (0.2, 0.01):
            want.update(current_kl=kl, n_steps=32)
            got.update(current_kl=kl, n_steps=32)
            assert got.value == pytest.approx(want.value, rel=1e-15)


def test_install_puts_ours_where_verl_looks() -> None:
    import verl.workers.utils.losses as losses

    saved = {k: getattr(core_algos, k) for k in ("compute_value_loss", "compute_pf_ppo_reweight_data",
                                                  "get_kl_controller", "FixedKLController",
                                                  "AdaptiveKLController")}  # fmt: skip
    saved_losses = losses.compute_value_loss
    try:
        twin.install()
        assert core_algos.compute_value_loss is twin.compute_value_loss
        assert losses.compute_value_loss is twin.compute_value_loss
        assert core_algos.compute_pf_ppo_reweight_data is twin.compute_pf_ppo_reweight_data
        assert core_algos.get_kl_controller is twin.get_kl_controller
    finally:
        for k, v in saved.items():
            setattr(core_algos, k, v)
        losses.compute_value_loss = saved_losses
