"""Griffe extension for the docs site: render dapo_ops' reST-flavoured docstrings as Markdown.

The library's docstrings are written for ``help()`` and Sphinx habits: ``.. math::``
blocks, ``:math:`...``` and ``:func:`...``` roles, a reST simple table, and an
``Example:`` header over doctest lines. mkdocstrings renders Markdown, so this extension
(loaded by ``mkdocs.yml``) rewrites each docstring when griffe loads it, without touching
the source:

- ``.. math::`` + indented block  ->  a ``$$ ... $$`` block (MathJax via arithmatex);
- ``:math:`x```  ->  ``$x$``;  ``:func:`f``` / ``:class:`` / ``:meth:`` ...  ->  ```f```;
- a reST simple table (``====  ====`` borders)  ->  a Markdown table;
- ``Example:``  ->  ``Examples:``, the Google-style section whose doctest lines render as
  code.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import griffe

ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|obj|exc|ref):`~?([^`]+)`")
MATH_ROLE = re.compile(r":math:`([^`]+)`")
BORDER = re.compile(r"^\s*=+(\s+=+)+\s*$")


def inline(text: str, *, in_table: bool = False) -> str:
    """Roles to Markdown; inside a table, ``|`` in math becomes ``\\vert``."""

    def math(match: re.Match[str]) -> str:
        body = match.group(1)
        return "$" + (body.replace("|", r"\vert{}") if in_table else body) + "$"

    return ROLE.sub(r"`\1`", MATH_ROLE.sub(math, text))


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _table(lines: list[str], start: int) -> tuple[list[str], int] | None:
    """A reST simple table starting at ``lines[start]`` as Markdown rows, and where it ends."""
    border = lines[start]
    borders = [i for i in range(start, len(lines)) if lines[i].strip() and BORDER.match(lines[i])]
    if len(borders) < 3 or borders[0] != start:
        return None
    end = borders[2]
    starts = [m.start() for m in re.finditer(r"=+", border)]

    def cells(line: str) -> list[str]:
        bounds = [*starts[1:], None]
        return [
            inline(line[a:b].strip(), in_table=True) for a, b in zip(starts, bounds, strict=True)
        ]

    prefix = " " * _indent(border)
    header = [cells(lines[i]) for i in range(start + 1, borders[1]) if lines[i].strip()]
    body = [cells(lines[i]) for i in range(borders[1] + 1, end) if lines[i].strip()]
    rows = [
        *(prefix + "| " + " | ".join(row) + " |" for row in header),
        prefix + "|" + "---|" * len(starts),
        *(prefix + "| " + " | ".join(row) + " |" for row in body),
    ]
    return rows, end + 1


def rst_to_markdown(text: str) -> str:
    """The docstring ``text`` with the reST constructs above rewritten as Markdown."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped == ".. math::":
            indent = _indent(line)
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > indent):
                j += 1
            body = textwrap.dedent("\n".join(lines[i + 1 : j])).strip("\n")
            pad = " " * indent
            out += [pad + "$$", *(pad + b for b in body.splitlines()), pad + "$$", ""]
            i = j
            continue
        if BORDER.match(line):
            table = _table(lines, i)
            if table is not None:
                rows, i = table
                out += rows
                continue
        if stripped == "Example:":
            line = line.replace("Example:", "Examples:")
        out.append(inline(line))
        i += 1
    return "\n".join(out)


class RstToMarkdown(griffe.Extension):
    """Rewrites every docstring griffe loads (see the module docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)


def _literal(module: str, name: str) -> str | None:
    """The repr of ``module.name`` when it is a plain literal (number, string, bool, None)."""
    import importlib

    try:
        value = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return None


class DefaultsAsValues(griffe.Extension):
    """Shows a default that names a module constant as its value on the API page:
    ``log_ratio_clamp = 20.0``, not ``= LOG_RATIO_CLAMP`` (the reader should not have to
    look the constant up). Only plain literals are substituted; other defaults (an
    objective value, say) keep their source text."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        stack: list[griffe.Object | griffe.Alias] = [pkg]
        seen: set[str] = set()
        while stack:
            obj = stack.pop()
            if obj.is_alias or obj.path in seen:
                continue
            seen.add(obj.path)
            module = obj.module.path
            if isinstance(obj, griffe.Function):
                for param in obj.parameters:
                    self._fix(param, "default", module)
            elif isinstance(obj, griffe.Attribute):
                self._fix(obj, "value", module)
            stack.extend(obj.members.values())

    on_package_loaded = on_package  # the hook's name before griffe 1.x's rename

    @staticmethod
    def _fix(holder: Any, field: str, module: str) -> None:
        text = str(getattr(holder, field) or "")
        if re.fullmatch(r"[A-Z][A-Z0-9_]+", text):
            value = _literal(module, text)
            if value is not None:
                setattr(holder, field, value)
