"""Every fenced Python block of README.md, README.pypi.md and docs/ runs as a test (Sybil).

The root ``conftest.py`` hands :data:`SYBIL` to pytest, so README's test command collects
each block as one test item, in page order, all blocks of a page in one namespace (a page
reads top to bottom, as a user pastes it). A page marks what a block needs with HTML
comments right above the block, invisible on the rendered page:

``<!-- requires: trl verl -->``
    The block needs these modules (the ``integration`` extra): its item carries the
    ``integration`` marker, and it is skipped, naming the extra, where one is missing.

``<!-- runs up to: trainer.train() -- the reason -->``
    The block runs up to the first line that contains ``trainer.train()``, which it must
    hold; the reason (a model download, a GPU, a Ray cluster) says why the rest cannot
    run here. Imports and set-up above that line still run.

``<!-- signature -->``
    The block shows call signatures, ``name(a, b, *, c=1) -> result``, not code to run:
    each is checked against ``dapo_ops.name`` (the parameters in order, their kinds and
    their defaults; ``tools/doc_signatures.py``).

A ``text`` block right below a Python block (blank lines only between) is what that block
prints, and is checked against it: the words exactly, every number within one unit of its
last shown digit (``tools/doc_outputs.py`` says why). ``python -m tools.doc_blocks
docs/PAGE.md ...`` rewrites the output blocks of those pages that no longer match.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import sys
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sybil import Document, Example, Region, Sybil
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

from tools.doc_outputs import same_output
from tools.doc_signatures import evaluate_signatures

ROOT = Path(__file__).resolve().parents[1]
#: namespace key under which a page keeps the output of its last Python block
_STDOUT = "__doc_block_stdout__"
_MODULE = "__doc_block_module__"

_FENCE_INFO = re.compile(r"(?P<language>[\w+-]*)[^\n]*$\n", re.M)
_REQUIRES = re.compile(r"^\s*requires:\s*(?P<modules>[\w. ]+?)\s*$")
_RUNS_UP_TO = re.compile(r"^\s*runs up to:\s*(?P<marker>.+?)\s+--\s+(?P<reason>.+?)\s*$", re.S)


@dataclass(frozen=True)
class PythonBlock:
    """One Python block and what the comments above it say."""

    source: str
    line: int  # of the block's first source line in its page
    requires: tuple[str, ...] = ()
    stop_marker: str | None = None
    stop_reason: str | None = None


@dataclass(frozen=True)
class OutputBlock:
    """A ``text`` block that shows what the Python block above it prints."""

    text: str
    python_line: int


@dataclass
class _Fence:
    language: str
    source: str
    start: int
    end: int
    source_offset: int


def _fences(document: Document) -> list[_Fence]:
    lexer = RawFencedCodeBlockLexer(info_pattern=_FENCE_INFO, mapping=None)
    found = []
    for region in lexer(document):
        source = region.lexemes["source"]
        found.append(
            _Fence(
                region.lexemes["language"],
                str(source),
                region.start,
                region.end,
                region.start + source.offset,
            )
        )
    return sorted(found, key=lambda f: f.start)


def _comments_above(text: str, start: int) -> list[str]:
    """The HTML comments directly above position ``start`` (blank lines between allowed)."""
    head = text[:start].rstrip()
    comments: list[str] = []
    while head.endswith("-->"):
        opening = head.rfind("<!--")
        if opening < 0:
            break
        comments.insert(0, head[opening + 4 : -3])
        head = head[:opening].rstrip()
    return comments


def _python_block(fence: _Fence, document: Document) -> PythonBlock:
    requires: tuple[str, ...] = ()
    marker = reason = None
    for comment in _comments_above(document.text, fence.start):
        if match := _REQUIRES.match(comment):
            requires = tuple(match.group("modules").split())
        elif match := _RUNS_UP_TO.match(comment):
            marker, reason = match.group("marker"), " ".join(match.group("reason").split())
            if marker not in fence.source:
                raise ValueError(
                    f"{document.path}: 'runs up to: {marker}' above the block at line "
                    f"{document.text.count(chr(10), 0, fence.start) + 1}, which lacks it"
                )
    line = document.text.count("\n", 0, fence.source_offset)
    return PythonBlock(fence.source, line, requires, marker, reason)


def parse_blocks(document: Document) -> Iterable[Region]:
    """The Sybil parser: Python blocks, and the text blocks that show their output."""
    fences = _fences(document)
    for previous, fence in zip([None, *fences], fences, strict=False):
        comments = _comments_above(document.text, fence.start)
        if fence.language == "python" and any(c.strip() == "signature" for c in comments):
            yield Region(fence.start, fence.end, fence.source, evaluate_signatures)
        elif fence.language == "python":
            if fence.source.lstrip().startswith(">>>"):
                raise ValueError(f"{document.path}: write the block as code, not as >>> lines")
            block = _python_block(fence, document)
            yield Region(fence.start, fence.end, block, evaluate_python)
        elif (
            fence.language == "text"
            and previous is not None
            and previous.language == "python"
            and not document.text[previous.end : fence.start].strip()
        ):
            line = document.text.count("\n", 0, previous.source_offset)
            yield Region(fence.start, fence.end, OutputBlock(fence.source, line), evaluate_output)


def _module(namespace: dict[str, Any], path: str) -> types.ModuleType:
    """The page's namespace as a real module: ``@dataclass`` and ``torch.compile`` resolve
    a class's globals through ``sys.modules``, as they do for user code."""
    module = namespace.get(_MODULE)
    if module is None:
        name = "doc_block_" + re.sub(r"\W", "_", str(Path(path).relative_to(ROOT)))
        module = types.ModuleType(name)
        module.__file__ = path
        sys.modules[name] = module
        namespace[_MODULE] = module
    return module


def _missing(modules: Iterable[str]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m.split(".")[0]) is None]


@contextlib.contextmanager
def _as_a_user_runs_it() -> Iterator[None]:
    """Without the suite's run-time annotation checker (pyproject's
    ``--jaxtyping-packages``): a user's process has none, and ``torch.compile`` cannot
    trace it. Checked mode (the root conftest.py) stays on: its errors are the library's."""
    import jaxtyping

    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


def evaluate_python(example: Example) -> str | None:
    block: PythonBlock = example.parsed
    example.namespace[_STDOUT] = None
    if missing := _missing(block.requires):
        import pytest

        page = Path(example.path).relative_to(ROOT)
        pytest.skip(
            f"{page}:{example.line} needs {', '.join(missing)}: pip install -e "
            "'.[integration]' (docs/install.md)"
        )
    source = block.source
    if block.stop_marker is not None:
        lines = source.splitlines(keepends=True)
        cut = next(i for i, line in enumerate(lines) if block.stop_marker in line)
        source = "".join(lines[:cut])
    module = _module(example.namespace, example.path)
    code = compile("\n" * block.line + source, example.path, "exec", dont_inherit=True)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), _as_a_user_runs_it():
        exec(code, module.__dict__)
    example.namespace[_STDOUT] = out.getvalue()
    return None


def evaluate_output(example: Example) -> str | None:
    block: OutputBlock = example.parsed
    printed = example.namespace.get(_STDOUT)
    if printed is None:
        import pytest

        pytest.skip(f"the Python block at line {block.python_line} did not run")
    if same_output(block.text, printed):
        return None
    return (
        f"the block shows:\n{block.text}\nbut the Python block at line {block.python_line} "
        f"printed:\n{printed}"
    )


_STATE = "__doc_block_state__"


def _setup(namespace: dict[str, Any]) -> None:
    """Keep what a page may change globally (print options, the default RNG) to give it
    back after the page: neither the next page nor the rest of the suite sees it."""
    import torch

    namespace[_STATE] = (torch._tensor_str.get_printoptions(), torch.get_rng_state())


def _teardown(namespace: dict[str, Any]) -> None:
    import torch

    module = namespace.pop(_MODULE, None)
    if module is not None:
        sys.modules.pop(module.__name__, None)
    if _STATE in namespace:
        options, rng = namespace.pop(_STATE)
        torch.set_printoptions(**options)
        torch.set_rng_state(rng)


def requirements(item: Any) -> tuple[str, ...]:
    """The modules a collected Sybil item's block declares it needs (empty for others)."""
    parsed = getattr(getattr(item, "example", None), "parsed", None)
    return parsed.requires if isinstance(parsed, PythonBlock) else ()


def doc_items(items: list[Any]) -> Iterator[Any]:
    return (i for i in items if isinstance(getattr(i, "example", None), Example))


SYBIL = Sybil(
    parsers=[parse_blocks],
    path=str(ROOT),
    patterns=["README.md", "README.pypi.md", "docs/*.md", "docs/*/*.md"],
    setup=_setup,
    teardown=_teardown,
    name="docs",
)


def update(paths: list[str]) -> None:
    """Rewrite each page's output blocks that no longer match with what their Python
    block prints now (``python -m tools.doc_blocks docs/loss.md ...``); review the diff."""
    import os

    import pytest

    os.environ.setdefault("DAPO_OPS_CHECKED", "1")  # as the suite runs the pages
    for name in paths:
        path = Path(name).resolve()
        document = SYBIL.parse(path)
        _setup(document.namespace)
        replacements = []
        for example in document.examples():
            if isinstance(example.parsed, OutputBlock):
                printed = example.namespace.get(_STDOUT)
                if printed is not None and not same_output(example.parsed.text, printed):
                    replacements.append((example.start, example.end, f"```text\n{printed}```"))
            else:
                try:
                    example.evaluate()
                except (Exception, pytest.skip.Exception) as error:
                    print(f"{name}:{example.line}: {type(error).__name__}: {error}")
        text = document.text
        for start, end, new in reversed(replacements):
            text = text[:start] + new + text[end:]
        path.write_text(text)
        _teardown(document.namespace)
        print(f"{name}: {len(replacements)} output block(s) rewritten")


if __name__ == "__main__":
    update(sys.argv[1:])
