"""The ``<!-- signature -->`` blocks of the docs: call signatures checked against the code.

A block of ``name(a, b, *, c=1) -> result`` lines (one signature may span lines; a
``# comment`` or ``-> ...`` after it is ignored) is parsed as ``def name(a, b, *, c=1)``
and compared with ``inspect.signature(dapo_ops.name)``: the parameters in order, whether
each is keyword-only, and each default (its source against the default's ``repr``).
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Iterator
from typing import Any

from sybil import Example

Shown = list[tuple[str, str, str | None]]


def _signatures(text: str) -> Iterator[tuple[str, ast.arguments]]:
    """``name(params)`` of each signature in a block, parsed as ``def name(params)``."""
    text = re.sub(r"#[^\n]*", "", text)
    while match := re.search(r"(\w+)\(", text):
        depth, end = 0, match.end() - 1
        for end in range(match.end() - 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        params = text[match.end() : end]
        tree = ast.parse(f"def {match.group(1)}({params}): pass")
        function = tree.body[0]
        assert isinstance(function, ast.FunctionDef)
        yield match.group(1), function.args
        text = text[end + 1 :].split("\n", 1)[1] if "\n" in text[end + 1 :] else ""


def _shown(args: ast.arguments) -> Shown:
    """(name, kind, default source) of each parameter a signature shows."""
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    shown = [
        (a.name if hasattr(a, "name") else a.arg, "positional", _source(d))
        for a, d in zip(positional, defaults, strict=True)
    ]
    shown += [
        (a.arg, "keyword", _source(d))
        for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    ]
    return shown


def _source(node: ast.expr | None) -> str | None:
    return None if node is None else ast.unparse(node)


def _actual(function: Any) -> Shown:
    kinds = {
        inspect.Parameter.KEYWORD_ONLY: "keyword",
        inspect.Parameter.POSITIONAL_ONLY: "positional",
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
    }
    return [
        (p.name, kinds[p.kind], None if p.default is p.empty else repr(p.default))
        for p in inspect.signature(function).parameters.values()
        if p.kind in kinds
    ]


def evaluate_signatures(example: Example) -> str | None:
    import dapo_ops

    wrong = []
    for name, args in _signatures(example.parsed):
        actual = _actual(getattr(dapo_ops, name))
        if _shown(args) != actual:
            shown = ", ".join(f"{n}={d}" if d else n for n, _, d in _shown(args))
            real = ", ".join(f"{n}={d}" if d else n for n, _, d in actual)
            wrong.append(f"{name}: the page shows ({shown}), dapo_ops has ({real})")
    return "\n".join(wrong) or None
