"""``compiled=True``: the loss scale, the objective's terms and the gradient, one graph.

Private. :func:`compiled_body` is a drop-in for :func:`dapo_ops.engine._engine.eager_body`:
the same computation (:func:`dapo_ops.engine._engine.generic_terms` after
:func:`dapo_ops.engine.aggregation.loss_scale`) traced by ``torch.compile(fullgraph=True)``,
which inductor turns into one kernel (on CPU: a count loop over the mask and one loop
that reads the inputs once and writes the gradient and the row sums). It is the same
code as the eager path, so every objective with an analytic ``grad`` gets it.

The mask enters as the bool tensor it is (with torch 2.13's inductor a bool input is
faster than a uint8 view compared in the graph: 64x4096, one thread, 0.54 vs 0.76 ms for
the kernel); the objective and the options are graph constants (fixed for a run), while
a numeric normaliser is a 0-dim tensor (it changes every step: one graph serves every
value). Each loss configuration (objective value, KL penalty, aggregation: one
``LossSpec``) gets a function of its own, a copy of :func:`_graph` with its own code
object, so dynamo keeps a separate cache for it: ``torch._dynamo.config.recompile_limit``
then bounds the recompiles of one configuration (dtypes, which optional tensors are given,
normaliser kind, a dynamic shape), not the number of objectives a process uses (with one
shared function, a process that compared nine objectives ran the later ones eagerly, and
slower than eager). Past the limit the call warns and runs eagerly. Compiled lazily on
first use and cached per process (``_COMPILED``: compiled code, no data).
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from dapo_ops.engine._engine import LossInputs, LossSpec, eager_body

#: torch.compile'd graphs, built on first use, keyed by (backend, LossSpec): compiled code,
#: no data.
_COMPILED: dict[tuple[str, Any], Callable[..., Any]] = {}
#: Configurations with a compiled function of their own, per backend; the others share one.
MAX_CONFIGURATIONS = 64


def _graph(
    spec: LossSpec, tensors: LossInputs, normalizer: Tensor | None, with_grad: bool
) -> tuple[Tensor, Tensor | None]:
    return eager_body(spec, tensors, normalizer, with_grad)


def compiled_body(backend: str) -> Callable[..., tuple[Tensor, Tensor | None]]:
    """A body for :func:`dapo_ops.engine._engine.fused_loss` that runs the compiled graph."""

    def body(
        spec: LossSpec, tensors: LossInputs, normalizer: Tensor | None, with_grad: bool
    ) -> tuple[Tensor, Tensor | None]:
        # imported here: torch._dynamo costs ~1 s to import, only compiled=True needs it
        from torch._dynamo.exc import FailOnRecompileLimitHit, Unsupported

        try:
            graph = _graph_for(backend, spec)
            return graph(spec, tensors, normalizer, with_grad)  # type: ignore[no-any-return]
        except (FailOnRecompileLimitHit, Unsupported) as err:
            warnings.warn(
                f"dapo_ops: compiled=True ran eagerly ({type(err).__name__}: too many "
                "distinct loss configurations for torch._dynamo.config.recompile_limit)",
                RuntimeWarning,
                stacklevel=2,
            )
            return eager_body(spec, tensors, normalizer, with_grad)

    return body


def _graph_for(backend: str, spec: LossSpec) -> Callable[..., Any]:
    """The compiled graph of one configuration: ``torch.compile`` of a copy of
    :func:`_graph` whose code object is its own (dynamo's cache lives on the code object).
    An objective that is not hashable, and every configuration past the first
    :data:`MAX_CONFIGURATIONS` of a backend (a process that makes a new objective value
    every step, say), share one copy: there dynamo's ``recompile_limit`` applies, and past
    it the call warns and runs eagerly, instead of compiling anew each step."""
    try:
        key: tuple[str, Any] = (backend, spec)
        hash(key)
    except TypeError:
        key = (backend, None)
    if key not in _COMPILED and sum(k[0] == backend for k in _COMPILED) >= MAX_CONFIGURATIONS:
        key = (backend, None)
    graph = _COMPILED.get(key)
    if graph is None:
        f = _graph  # (a type-checking import hook may have wrapped it: closure kept)
        own = types.FunctionType(
            f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__
        )
        # dynamic=None: specialised on the first shape, one dynamic-shape recompile after
        graph = torch.compile(own, fullgraph=True, backend=backend)
        _COMPILED[key] = graph
    return graph
