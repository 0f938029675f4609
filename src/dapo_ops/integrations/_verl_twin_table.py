"""One generic body for verl's advantage-estimator twins: a table row in, verl's function out.

A :class:`Row` says which verl parameters the estimator takes (names and defaults, in
verl's order), how ours computes from them (``compute``: a function of the bound
:class:`Args`) and how the result is laid over the response (``spread``). :func:`twin`
turns a row into a function with verl's signature; :func:`register` puts the functions in
verl's registry. The verl rules the rows share are here, each once: the uid array as group
ids, the group statistics of verl's loops (:func:`group_stats`) and verl's
``masked_whiten`` (:func:`verl_whiten`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, Literal

import torch
from torch import Tensor

from dapo_ops._core._groups import segment_count, segment_sum, segments
from dapo_ops._core._rules import compute_dtype, masked
from dapo_ops._core._validate import InputError
from dapo_ops.integrations._verl_common import _config_value

#: verl's float32 ``torch.tensor(1.0)``, the std its loops give a one-sample group.
_ONE_F32 = torch.tensor(1.0, dtype=torch.float32)
#: A parameter without a default (verl's positional tensors).
REQUIRED: Any = inspect.Parameter.empty
#: The parameters verl's outcome estimators open with (``index`` optional here, so that its
#: absence is an ``InputError`` naming it).
OUTCOME: tuple[tuple[str, Any], ...] = (
    ("token_level_rewards", REQUIRED),
    ("response_mask", REQUIRED),
    ("index", None),
    ("epsilon", 1e-6),
)


def group_ids(index: Iterable[Hashable], rows: int, device: torch.device) -> Tensor:
    """verl's ``uid`` array (any hashable values) as integer group ids, in first-seen order."""
    lookup: dict[Hashable, int] = {}
    ids = [lookup.setdefault(uid, len(lookup)) for uid in index]
    if len(ids) != rows:
        raise InputError(f"index has {len(ids)} entries for {rows} responses")
    return torch.tensor(ids, dtype=torch.long, device=device)


class Args:
    """The bound arguments of one call, with what the rows read from them."""

    def __init__(self, name: str, arguments: Mapping[str, Any]) -> None:
        self.name, self.arguments = name, arguments

    def __getitem__(self, key: str) -> Any:
        return self.arguments[key]

    def config(self, field: str, default: Any, *, required: bool = False) -> Any:
        """``config.<field>`` (``default`` when absent); ``required``: no config is an error."""
        if required and self["config"] is None:
            raise InputError(f"dapo_ops_{self.name} needs verl's algorithm config (config=...)")
        return _config_value(self["config"], field, default)

    @property
    def valid(self) -> Tensor:
        mask: Tensor = self["response_mask"]
        return mask if mask.dtype == torch.bool else mask != 0

    @property
    def scores(self) -> Tensor:
        """One score per response: the sum of its ``token_level_rewards`` (all positions, as verl)."""
        return self["token_level_rewards"].sum(dim=-1)  # type: ignore[no-any-return]

    @property
    def ids(self) -> Tensor:
        if self["index"] is None:
            raise InputError(
                f"dapo_ops_{self.name} needs index (verl's uid array: the prompt groups)"
            )
        rewards: Tensor = self["token_level_rewards"]
        return group_ids(self["index"], rewards.shape[0], rewards.device)


def group_stats(scores: Tensor, ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """verl's per-uid loop statistics, per sample: the group mean (0 for a one-sample group),
    the unbiased std and the group size; in the scores' compute dtype."""
    seg = segments("scores", scores, ids)
    x = seg.values.to(compute_dtype(scores))
    count = segment_count(seg, x.dtype)
    mean = torch.where(count > 1, segment_sum(seg, x) / count.clamp(min=1), 0.0)
    centred = x - mean[seg.segment]
    var = segment_sum(seg, centred.square()) / (count - 1).clamp(min=1)
    return mean[seg.segment], var.sqrt()[seg.segment], count[seg.segment]


def grpo(scores: Tensor, ids: Tensor, *, eps: float, scale: bool) -> Tensor:
    """verl's ``grpo``: ``(s - mean) / (std + eps)``, or ``s - mean`` unscaled; a one-sample
    group has mean 0 and std ``float32(1)``, so ``s / float32(1 + eps)`` (``s`` unscaled)."""
    mean, std, count = group_stats(scores, ids)
    centred = scores.to(mean.dtype) - mean
    if not scale:
        return centred
    lone = float(_ONE_F32 + eps)  # float32 arithmetic, as verl's tensor(1.0) + epsilon
    return torch.where(count > 1, centred / (std + eps), centred / lone)


def verl_whiten(values: Tensor, valid: Tensor) -> Tensor:
    """verl's ``masked_whiten`` times the mask: means over ``count + 1e-8``, the variance
    scaled by ``n / (n - 1)``, ``rsqrt(var + 1e-8)``; fewer than two valid entries leave the
    values centred (verl raises)."""
    x = masked(valid, values)
    n = valid.sum().to(x.dtype)
    mean = x.sum() / (n + 1e-8)
    centred = masked(valid, x - mean)
    var = centred.square().sum() / (n + 1e-8) * (n / torch.where(n > 1, n - 1, 1.0))
    return centred * torch.where(n > 1, torch.rsqrt(var + 1e-8), 1.0)


@dataclasses.dataclass(frozen=True)
class Row:
    """One verl estimator: its parameters ``(name, default)`` in verl's order (``config``
    and ``**kwargs`` follow), ``compute`` and ``spread``: ``"sample"`` (one advantage per
    response, laid over its valid tokens: ``(adv, adv)``), ``"whiten"`` (the same, then
    :func:`verl_whiten`) or ``"tokens"`` (``compute`` gives ``(advantages, returns)``)."""

    params: tuple[tuple[str, Any], ...]
    compute: Callable[[Args], Any]
    spread: Literal["sample", "whiten", "tokens"] = "sample"
    doc: str = ""
    config: bool = True  # whether verl's function takes ``config``


def twin(name: str, row: Row) -> Callable[..., tuple[Tensor, Tensor]]:
    """The function with verl's signature for ``row``: binds the arguments, computes
    without autograd, returns ``(advantages, returns)`` in the rewards' dtype."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter(n, kind, default=d) for n, d in row.params]
    if row.config:
        params.append(inspect.Parameter("config", kind, default=None))
    params.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD))
    signature = inspect.Signature(params)

    def estimator(*args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = Args(name, bound.arguments)
        with torch.no_grad():
            out = row.compute(a)
            if row.spread != "tokens":
                out = masked(a.valid, out[:, None].expand(a.valid.shape))
                if row.spread == "whiten":
                    out = verl_whiten(out, a.valid)
                out = (out, out)
        dtype = bound.arguments["token_level_rewards"].dtype
        return out[0].to(dtype), out[1].to(dtype)

    estimator.__name__ = estimator.__qualname__ = f"dapo_ops_{name}"
    estimator.__doc__ = f"verl's ``{name}`` estimator, computed by dapo_ops: {row.doc}"
    estimator.__signature__ = signature  # type: ignore[attr-defined]
    return estimator


def register(functions: Mapping[str, Callable[..., Any]]) -> None:
    """Put each function in verl's registry under its name, replacing what is there."""
    from verl.trainer.ppo import core_algos

    for target, fn in functions.items():
        core_algos.ADV_ESTIMATOR_REGISTRY.pop(target, None)  # register_adv_est refuses a second
        core_algos.register_adv_est(target)(fn)
