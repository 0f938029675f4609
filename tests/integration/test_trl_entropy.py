"""DapoGRPOTrainer's entropy bonus, adaptive controller and MoE router loss against TRL 1.16.

- A tiny Mixtral (router loss on, as TRL enables it for MoE configs): on every micro-batch
  a probe runs our ``compute_loss`` and TRL's on the same inputs and controller state, with
  a static and an adaptive entropy bonus, and compares losses, gradients, TRL's metrics
  (``aux_loss``, ``policy_loss``, ``entropy_coef``) and the controller state afterwards.
- Three optimiser steps of each trainer from the same seed with ``use_adaptive_entropy``:
  the same coefficients step after step, saved in TRL's checkpoint file and read back.
- Two gloo processes (``python test_trl_entropy.py OUT STORE`` per rank): the controller
  measures the entropy over both ranks, as TRL's does, and both ranks agree.

The per-batch comparison of every loss type with an entropy bonus is in test_trl.py.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("trl")

from test_trl import WORDS, digit_reward, grpo_config, prompts, tiny_model, tiny_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::FutureWarning")]

STATE = ("entropy_coef", "_last_world_entropy", "_entropy_window_stats")


def tiny_moe() -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=len(WORDS),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.05,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return MixtralForCausalLM(config)


def _close(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, torch.Tensor):
        return bool(torch.allclose(a.double(), b.double(), rtol=1e-6, atol=1e-7))
    return bool(a == pytest.approx(b, rel=1e-6, abs=1e-7))


def test_moe_router_loss_and_entropy_bonus_match_trl(tmp_path: Path) -> None:
    from trl import GRPOTrainer

    from dapo_ops.integrations.trl import DapoGRPOTrainer

    records: list[dict[str, Any]] = []
    variants = [
        ("static", {"entropy_coef": 0.05, "use_adaptive_entropy": False}, {}),
        (
            "adaptive-on",
            {"entropy_coef": 0.05, "use_adaptive_entropy": True, "_last_world_entropy": 0.0},
            {"entropy_target": 10.0},
        ),
        (
            "adaptive-off",
            {"entropy_coef": 0.05, "use_adaptive_entropy": True, "_last_world_entropy": 50.0},
            {"entropy_target": 0.5},
        ),
    ]

    class Probe(DapoGRPOTrainer):  # type: ignore[misc, valid-type]
        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            params = [p for p in model.parameters() if p.requires_grad]
            for name, attrs, arg_attrs in variants:
                saved = {k: getattr(self, k) for k in {*attrs, *STATE, "_entropy_bonus_enabled"}}
                saved_args = {k: getattr(self.args, k) for k in arg_attrs}
                for k, v in {**attrs, "_entropy_bonus_enabled": True}.items():
                    setattr(self, k, v)
                for k, v in arg_attrs.items():
                    setattr(self.args, k, v)
                start = {k: getattr(self, k) for k in STATE}
                try:
                    ours = DapoGRPOTrainer.compute_loss(self, model, inputs)
                    keys = ["aux_loss", "policy_loss", "entropy"]
                    if self.accelerator.sync_gradients:
                        keys.append("entropy_coef")
                    m_ours = {k: self._metrics["train"][k][-1] for k in keys}
                    s_ours = {k: getattr(self, k) for k in STATE}
                    for k, v in start.items():
                        setattr(self, k, v)
                    theirs = GRPOTrainer.compute_loss(self, model, inputs)
                    m_trl = {k: self._metrics["train"][k][-1] for k in keys}
                    s_trl = {k: getattr(self, k) for k in STATE}
                    g_ours = torch.autograd.grad(ours, params, allow_unused=True)
                    g_trl = torch.autograd.grad(theirs, params, allow_unused=True)
                finally:
                    for k, v in {**saved}.items():
                        setattr(self, k, v)
                    for k, v in saved_args.items():
                        setattr(self.args, k, v)
                pairs = [(a, b) for a, b in zip(g_ours, g_trl, strict=True) if b is not None]
                records.append({
                    "variant": name, "ours": float(ours.detach()), "theirs": float(theirs.detach()),
                    "grad_diff": max(float((a - b).abs().max()) for a, b in pairs),
                    "grad_scale": max(float(b.abs().max()) for _, b in pairs),
                    "metrics": (m_ours, m_trl), "state": (s_ours, s_trl),
                    "synced": bool(self.accelerator.sync_gradients),
                })  # fmt: skip
            return loss

    torch.manual_seed(0)
    trainer = Probe(
        model=tiny_moe(),
        reward_funcs=digit_reward,
        args=grpo_config(tmp_path, max_steps=1),
        train_dataset=prompts(),
        processing_class=tiny_tokenizer(),
    )
    assert trainer.aux_loss_enabled, "TRL did not enable the router loss: vacuous"
    trainer.train()
    assert len(records) == 2 * len(variants)
    for r in records:
        assert abs(r["ours"] - r["theirs"]) <= 1e-6 * max(1.0, abs(r["theirs"])), r
        assert r["grad_diff"] <= 1e-5 * max(1.0, r["grad_scale"]), r
        for k, v in r["metrics"][0].items():
            assert _close(v, r["metrics"][1][k]), (r["variant"], k, r["metrics"])
        for k, v in r["state"][0].items():
            assert _close(v, r["state"][1][k]), (r["variant"], k, r["state"])
    synced = {r["variant"]: r["state"][0]["entropy_coef"] for r in records if r["synced"]}
    assert synced["adaptive-on"] > 0.05 > synced["adaptive-off"], synced


def _controller_run(cls: Any, out: Path) -> Any:
    torch.manual_seed(0)
    args = grpo_config(
        out, max_steps=3, use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=10.0,
        entropy_coef_delta=0.02, entropy_coef_max=0.045, save_strategy="steps", save_steps=3,
    )  # fmt: skip
    trainer = cls(
        model=tiny_model(),
        reward_funcs=digit_reward,
        args=args,
        train_dataset=prompts(),
        processing_class=tiny_tokenizer(),
    )
    trainer.train()
    return trainer


def test_adaptive_controller_follows_trl_over_steps(tmp_path: Path) -> None:
    """The coefficient rises by delta each step until coef_max (entropy below the target),
    as in TRL's run, and TRL's checkpoint file holds our state and loads back."""
    from trl import GRPOTrainer

    from dapo_ops.integrations.trl import DapoGRPOTrainer

    ours = _controller_run(DapoGRPOTrainer, tmp_path / "ours")
    theirs = _controller_run(GRPOTrainer, tmp_path / "trl")
    log_ours = [h["entropy_coef"] for h in ours.state.log_history if "entropy_coef" in h]
    log_trl = [h["entropy_coef"] for h in theirs.state.log_history if "entropy_coef" in h]
    assert log_ours == pytest.approx(log_trl) and log_ours == pytest.approx([0.03, 0.045, 0.045])
    assert ours._last_world_entropy == pytest.approx(theirs._last_world_entropy, rel=1e-4)
    saved = json.loads(
        (tmp_path / "ours" / "out" / "checkpoint-3" / "entropy_ctrl_state.json").read_text()
    )
    assert saved == {
        "entropy_coef": ours.entropy_coef,
        "last_world_entropy": ours._last_world_entropy,
    }
    ours.entropy_coef, ours._last_world_entropy = 0.0, float("inf")
    ours._load_optimizer_and_scheduler(str(tmp_path / "ours" / "out" / "checkpoint-3"))
    assert (ours.entropy_coef, ours._last_world_entropy) == tuple(saved.values())


# --------------------------------------------------------------------------- two processes


def worker(out: str, store: str) -> None:
    import torch.distributed as dist
    import torch.distributed.nn  # noqa: F401  (before any group exists: see tests/_dist.py)

    rank = int(os.environ["RANK"])
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=int(os.environ["WORLD_SIZE"])
    )
    Path(out).write_text(json.dumps(_record(rank, Path(out).parent)))
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _record(rank: int, root: Path) -> dict[str, Any]:
    from trl import GRPOTrainer

    from dapo_ops.integrations.trl import DapoGRPOTrainer

    calls: list[dict[str, Any]] = []

    class Probe(DapoGRPOTrainer):  # type: ignore[misc, valid-type]
        """Our step, then TRL's from the same controller state: both all-reduce the window."""

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            start = {k: getattr(self, k) for k in STATE}
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            ours = {k: getattr(self, k) for k in STATE}
            for k, v in start.items():
                setattr(self, k, v)
            GRPOTrainer.compute_loss(self, model, inputs)
            theirs = {k: getattr(self, k) for k in STATE}
            for k, v in ours.items():
                setattr(self, k, v)
            window = ours["_entropy_window_stats"]
            calls.append({
                "synced": bool(self.accelerator.sync_gradients),
                "window": None if window is None else [float(x) for x in window],
                "ours": [ours["entropy_coef"], ours["_last_world_entropy"]],
                "trl": [theirs["entropy_coef"], theirs["_last_world_entropy"]],
            })  # fmt: skip
            return loss

    torch.manual_seed(rank)  # different models' samples on the two ranks: different entropies
    trainer = Probe(
        model=tiny_model(),
        reward_funcs=digit_reward,
        args=grpo_config(root / f"rank{rank}", max_steps=2, use_adaptive_entropy=True,
                         entropy_coef=0.01, entropy_target=10.0, per_device_train_batch_size=2),
        train_dataset=prompts(),
        processing_class=tiny_tokenizer(),
    )  # fmt: skip
    trainer.train()
    return {"world": trainer.accelerator.num_processes, "calls": calls}


@pytest.mark.distributed
def test_two_processes_measure_the_entropy_over_both(tmp_path: Path) -> None:
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}  # fmt: skip
        out, store = tmp_path / f"rank{rank}.json", tmp_path / "store"
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, str(out), str(store)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["world"] == r1["world"] == 2
    for a, b in zip(r0["calls"], r1["calls"], strict=True):
        for call in (a, b):
            assert call["ours"][0] == pytest.approx(call["trl"][0])
            assert call["ours"][1] == pytest.approx(call["trl"][1], rel=1e-5)
        # the measured entropy is the two ranks' global mean: the same on both
        assert a["ours"] == pytest.approx(b["ours"], rel=1e-12)
    assert sum(c["synced"] for c in r0["calls"]) == 2  # two optimiser steps were measured
    # not vacuous: the ranks' own windows differ, so a local measurement would differ
    local = [(a["window"], b["window"]) for a, b in zip(r0["calls"], r1["calls"], strict=True)]
    assert any(w0 is not None and w0 != pytest.approx(w1) for w0, w1 in local), local


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
