"""Bad input: a clear error naming the argument, with and without the runtime checker.

Each case runs twice: with the jaxtyping/beartype runtime checker the suite installs
(its error reaches the caller first where an annotation is contradicted), and with the
checker off, where the library's own checks must catch the same input and raise
``InputError`` (a ValueError and a TypeError) with a message naming the argument.
"""

from __future__ import annotations

from collections.abc import Callable

import jaxtyping
import pytest
import torch

import dapo_ops as d

B, S = 3, 5


def _t(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def _m(*shape: int) -> torch.Tensor:
    return torch.ones(*shape, dtype=torch.bool)


CASES: list[tuple[str, Callable[[], object], str]] = [
    ("adv [seq]", lambda: d.token_level_loss(_t(B, S), _t(B, S), _t(S), _m(B, S)), "advantages"),
    (
        "adv [seq, 1]",
        lambda: d.token_level_loss(_t(B, S), _t(B, S), _t(S, 1), _m(B, S)),
        "advantages",
    ),
    ("old_logp shape", lambda: d.token_level_loss(_t(B, S), _t(B, 4), _t(B), _m(B, S)), "old_logp"),
    ("mask shape", lambda: d.token_level_loss(_t(B, S), _t(B, S), _t(B), _m(B, 1)), "mask"),
    ("mask dtype", lambda: d.token_level_loss(_t(B, S), _t(B, S), _t(B), _t(B, S)), "mask"),
    ("logp int", lambda: d.clip_higher_surrogate(_m(B, S).long(), _t(B, S), _t(B)), "logp"),
    ("logp 1-D", lambda: d.clip_higher_surrogate(_t(S), _t(S), _t(1)), "logp"),
    (
        "eps_low 1",
        lambda: d.token_level_loss(_t(B, S), _t(B, S), _t(B), _m(B, S), eps_low=1.0),
        "eps_low",
    ),
    (
        "eps_low <0",
        lambda: d.token_level_loss(_t(B, S), _t(B, S), _t(B), _m(B, S), eps_low=-0.1),
        "eps_low",
    ),
    (
        "eps_high <0",
        lambda: d.token_level_loss(_t(B, S), _t(B, S), _t(B), _m(B, S), eps_high=-1.0),
        "eps_high",
    ),
    (
        "dual <=1",
        lambda: d.token_level_loss(_t(B, S), _t(B, S), _t(B), _m(B, S), dual_clip=0.5),
        "dual_clip",
    ),
    ("mode", lambda: d.token_level_loss(_t(B, S), _t(B, S), _t(B), _m(B, S), mode="mean"), "mode"),  # type: ignore[call-overload]
    ("cache 0", lambda: d.overlong_reward(torch.arange(4), max_len=10, cache_len=0), "cache_len"),
    (
        "cache big",
        lambda: d.overlong_reward(torch.arange(4), max_len=10, cache_len=11),
        "cache_len",
    ),
    (
        "lengths <0",
        lambda: d.overlong_reward(torch.tensor([-1, 2]), max_len=10, cache_len=2),
        "lengths",
    ),
    (
        "lengths 2-D",
        lambda: d.overlong_reward(torch.ones(2, 2), max_len=10, cache_len=2),
        "lengths",
    ),
    ("rewards nan", lambda: d.group_advantages(torch.tensor([[1.0, float("nan")]])), "rewards"),
    (
        "rewards inf",
        lambda: d.group_advantages(torch.tensor([1.0, float("inf")]), torch.tensor([0, 0])),
        "rewards",
    ),
    ("rewards 1-D no ids", lambda: d.group_advantages(torch.tensor([1.0, 0.0])), "rewards"),
    ("group_ids shape", lambda: d.group_advantages(_t(4), torch.tensor([0, 0, 1])), "group_ids"),
    ("group_ids float", lambda: d.group_advantages(_t(2), torch.tensor([0.0, 1.0])), "group_ids"),
    ("scale", lambda: d.group_advantages(_t(2, 2), scale="std"), "scale"),  # type: ignore[arg-type]
    ("eps <0", lambda: d.group_advantages(_t(2, 2), eps=-1e-6), "eps"),
    ("metric nan", lambda: d.dynamic_sample_mask(torch.tensor([[1.0, float("nan")]])), "metric"),
    ("atol <0", lambda: d.dynamic_sample_mask(_t(2, 2), atol=-1.0), "atol"),
    ("truncated dtype", lambda: d.overlong_filter(_m(B, S), torch.zeros(B)), "truncated"),
    (
        "normalizer 0",
        lambda: d.token_level_loss(_t(B, S), _t(B, S), _t(B), _m(B, S), normalizer=0),
        "normalizer",
    ),
    ("global masks float", lambda: d.global_normalizer([_m(2, 2), _t(2, 2)]), "masks"),
    (
        "clamp inf",
        lambda: d.clip_higher_surrogate(_t(B, S), _t(B, S), _t(B), log_ratio_clamp=float("inf")),
        "log_ratio_clamp",
    ),
    (
        "kl_beta nan",
        lambda: d.token_level_loss(_t(B, S), _t(B, S), _t(B), _m(B, S), kl_beta=float("nan")),
        "kl_beta",
    ),
    (
        "max_len float",
        lambda: d.token_level_aggregate(
            _t(B, S), _m(B, S), mode="seq_mean_token_sum_norm", max_len=2.5
        ),
        "max_len",
    ),  # type: ignore[arg-type]
    (
        "gspo adv of another width",
        lambda: d.gspo_surrogate(_t(B, S), _t(B, S), _t(B, S + 1), _m(B, S)),
        "advantages",
    ),
    ("cispo cap <1", lambda: d.cispo_surrogate(_t(B, S), _t(B, S), _t(B), cap=0.5), "cap"),
    ("kl estimator", lambda: d.kl_penalty(_t(B, S), _t(B, S), estimator="k4"), "estimator"),  # type: ignore[arg-type]
    (
        "tis level",
        lambda: d.truncated_is_weights(_t(B, S), _t(B, S), _m(B, S), level="row"),
        "level",
    ),  # type: ignore[arg-type]
    ("tis cap", lambda: d.truncated_is_weights(_t(B, S), _t(B, S), _m(B, S), cap=0.0), "cap"),
    (
        "is_weights shape",
        lambda: d.token_level_loss(_t(B, S), _t(B, S), _t(B), _m(B, S), is_weights=_t(B)),
        "is_weights",
    ),
]


@pytest.mark.parametrize(("name", "call", "arg"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_names_the_argument(
    checker: str, name: str, call: Callable[[], object], arg: str
) -> None:
    with pytest.raises(ValueError) as info:
        call()
    assert isinstance(info.value, TypeError)
    assert arg in str(info.value)
    if checker == "checker off":
        assert isinstance(info.value, d.InputError), type(info.value)


def test_shape_message_shows_the_shapes() -> None:
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        with pytest.raises(d.InputError, match=r"\[5\]") as info:
            d.token_level_loss(_t(B, S), _t(B, S), _t(S), _m(B, S))
        assert "[3, 5]" in str(info.value)
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


@pytest.mark.parametrize(
    "mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
)
def test_empty_shapes_give_zero_not_nan(mode: str) -> None:
    logp = torch.zeros(2, 0, requires_grad=True)
    loss = d.token_level_loss(
        logp, logp.detach(), torch.ones(2), torch.zeros(2, 0, dtype=torch.bool), mode=mode
    )  # type: ignore[call-overload]
    assert loss.item() == 0.0
    assert d.group_advantages(torch.zeros(3, 0)).shape == (3, 0)
    diag = d.policy_diagnostics(
        torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, 4, dtype=torch.bool)
    )
    assert diag.valid_tokens.item() == 0 and diag.ratio_mean.item() == 0.0


def test_input_error_has_its_public_name() -> None:
    """Tracebacks show ``dapo_ops.InputError`` (the name users catch), and it pickles."""
    import pickle

    assert f"{d.InputError.__module__}.{d.InputError.__qualname__}" == "dapo_ops.InputError"
    err = pickle.loads(pickle.dumps(d.InputError("x must be finite")))
    assert isinstance(err, d.InputError) and str(err) == "x must be finite"


@pytest.mark.usefixtures("no_runtime_typecheck")  # the library's own check, as users see it
@pytest.mark.parametrize("fn", [d.token_level_loss, d.clip_higher_surrogate])
def test_logits_given_as_logp_get_a_hint(fn: Callable[..., object]) -> None:
    logits = torch.randn(2, 3, 5)
    with pytest.raises(d.InputError, match=r"looks like logits.*token_logprobs"):
        fn(logits, logits, torch.randn(2), torch.ones(2, 3, dtype=torch.bool))
