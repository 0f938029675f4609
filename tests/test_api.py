"""The public surface: exports, signatures, docstrings, the runtime checker in force."""

from __future__ import annotations

import inspect

import pytest
import torch

import dapo_ops

ISSUE_NAMES = [
    "token_level_loss",
    "clip_higher_surrogate",
    "token_level_aggregate",
    "group_advantages",
    "overlong_reward",
    "dynamic_sample_mask",
]


def test_issue_names_import() -> None:
    from dapo_ops import (  # noqa: F401
        clip_higher_surrogate,
        dynamic_sample_mask,
        group_advantages,
        overlong_reward,
        token_level_aggregate,
        token_level_loss,
    )

    assert set(ISSUE_NAMES) <= set(dapo_ops.__all__)


@pytest.mark.parametrize(
    "name", [n for n in dapo_ops.__all__ if inspect.isfunction(getattr(dapo_ops, n))]
)
def test_functions_are_documented_and_keyword_only(name: str) -> None:
    fn = inspect.unwrap(getattr(dapo_ops, name))
    doc = inspect.getdoc(fn) or ""
    assert "Example" in doc and ">>>" in doc, f"{name} needs a doctest example"
    params = list(inspect.signature(fn).parameters.values())
    for p in params:
        is_tensor_like = "Tensor" in str(p.annotation) or p.name in (
            "masks",
            "group_ids",
            "truncated",
        )
        # the objective value leads the tensors of the objective-generic functions
        is_objective = p.name == "objective" and p is params[0]
        # **options typed as Unpack[PolicyOptions]: policy_loss's keyword options
        passed_on = p.kind is inspect.Parameter.VAR_KEYWORD and "Unpack" in str(p.annotation)
        if not (is_tensor_like or is_objective or passed_on) and name != "prompts_to_generate":
            assert p.kind is inspect.Parameter.KEYWORD_ONLY, (
                f"{name}({p.name}) must be keyword-only"
            )


def test_runtime_checker_is_active_in_this_suite() -> None:
    # pyproject's --jaxtyping-packages wraps every dapo_ops function; a [batch] tensor
    # declared [batch, seq] must be caught by the annotation checker itself.
    assert hasattr(dapo_ops.token_level_loss, "__wrapped__")
    with pytest.raises(TypeError, match="Type-check error"):
        dapo_ops.token_level_aggregate(torch.ones(3), torch.ones(3, dtype=torch.bool))


def test_signatures_follow_the_issue() -> None:
    sig = inspect.signature(inspect.unwrap(dapo_ops.token_level_loss))
    defaults = {k: v.default for k, v in sig.parameters.items()}
    assert defaults["eps_low"] == 0.2 and defaults["eps_high"] == 0.28
    assert defaults["mode"] == "token_mean" and defaults["normalizer"] is None
    sig = inspect.signature(inspect.unwrap(dapo_ops.overlong_reward))
    assert sig.parameters["factor"].default == 1.0
    assert sig.parameters["max_len"].kind is inspect.Parameter.KEYWORD_ONLY


def test_version_has_one_source() -> None:
    """``dapo_ops.__version__`` is the source (pyproject reads it); the installed metadata
    and CITATION.cff agree with it, and the changelog has its section."""
    import importlib.metadata
    import re
    from pathlib import Path

    import dapo_ops

    root = Path(__file__).resolve().parents[1]
    assert importlib.metadata.version("dapo_ops") == dapo_ops.__version__
    cff = re.search(r"^version: (\S+)$", (root / "CITATION.cff").read_text(), flags=re.M)
    assert cff and cff.group(1) == dapo_ops.__version__
    assert f"## [{dapo_ops.__version__}]" in (root / "CHANGELOG.md").read_text()
