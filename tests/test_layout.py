"""The house (issue 26): one folder per stage of the pipeline, no import circles.

- ``src/dapo_ops`` holds at most 13 entries besides ``__init__.py`` and ``py.typed`` (issue
  26's twelve stages, and issue 37's ``kernels/``: what runs on the device in one folder);
- no import circle among the modules of ``src/dapo_ops`` or of ``benchmarks/`` (imports
  read with ``ast``, function-level and ``TYPE_CHECKING`` ones included);
- a stage imports only itself and the stages below it (:data:`STAGES`, lowest first);
- no file of ``src/`` or ``benchmarks/`` over 350 lines;
- the 0.1.0 module paths still import, as the same module object, with a warning.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

from dapo_ops._core._compat import OLD_PATHS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "dapo_ops"

#: The stages, lowest first: a module of a stage imports only its own stage and those
#: before it. ``dapo_ops`` (the package's face) sits between ``presets`` and ``testing``.
STAGES = [
    "_core",  # shared rules: dtypes, masking, argument checks, groups
    "rewards",  # overlong shaping, dynamic sampling
    "advantages",  # group-relative, verl's estimators, returns, optimal baseline
    "objectives",  # the per-token loss of each objective, and its CPU kernel
    "diagnostics",  # what an objective did to the tokens; per-batch sums
    "engine",  # policy_loss, fused/compiled paths, KL, entropy, aggregation, normaliser
    "correction",  # IS weights, rejection and off-policy masks, Clip-Cov / KL-Cov
    "kernels",  # what runs on the device: the lm-head path's row kernels and their dispatch
    "logprobs",  # log-probs, the fused output projection, linear_policy_loss
    "presets",  # recipes as values
    "dapo_ops",  # the top-level face
    "testing",  # conformance checks
    "integrations",  # TRL, verl, OpenRLHF
    "demo",  # the end-to-end demo
]
MAX_ENTRIES = 13
MAX_LINES = 350


def modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` below ``root/package``."""
    out = {}
    for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same tree it imports (anywhere in its body)."""
    mods = modules(root, package)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_package = path.name == "__init__.py"
        base = mod if is_package else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                full = node.module or ""
                if node.level:
                    parts = base.split(".")[: len(base.split(".")) - node.level + 1]
                    full = ".".join([*parts, *([node.module] if node.module else [])])
                # `from pkg import submodule` imports the submodule, else the module itself
                targets = [
                    f"{full}.{a.name}" if f"{full}.{a.name}" in mods else full for a in node.names
                ]
            for target in targets:
                found = resolve(target)
                if found is not None and found != mod:
                    graph[mod].add(found)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        state[node] = 2
        path.pop()
        return None

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def stage(module: str) -> str:
    parts = module.split(".")
    return "dapo_ops" if len(parts) == 1 else parts[1]


def test_entries() -> None:
    entries = sorted(
        p.name
        for p in PACKAGE.iterdir()
        if p.name not in {"__init__.py", "py.typed", "__pycache__"}
    )
    assert len(entries) <= MAX_ENTRIES, f"src/dapo_ops holds {len(entries)} entries: {entries}"
    names = {Path(e).stem for e in entries}
    assert names <= set(STAGES), f"entries that are not stages: {sorted(names - set(STAGES))}"


@pytest.mark.parametrize(("root", "package"), [(ROOT / "src", "dapo_ops"), (ROOT, "benchmarks")])
def test_no_import_circle(root: Path, package: str) -> None:
    cycle = find_cycle(import_graph(root, package))
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_a_stage_imports_only_stages_below() -> None:
    rank = {name: i for i, name in enumerate(STAGES)}
    wrong = [
        f"{mod} ({stage(mod)}) imports {dep} ({stage(dep)})"
        for mod, deps in import_graph(ROOT / "src", "dapo_ops").items()
        for dep in deps
        if rank[stage(dep)] > rank[stage(mod)]
    ]
    assert not wrong, "\n".join(wrong)


def test_cycle_finder_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_long_file() -> None:
    long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for folder in ("src", "benchmarks")
        for p in sorted((ROOT / folder).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, "\n".join(long)


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_old_module_paths(old: str) -> None:
    new = importlib.import_module(OLD_PATHS[old])
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=OLD_PATHS[old].replace(".", r"\.")):
        module = importlib.import_module(old)
    assert module is new
    assert module.__name__ == OLD_PATHS[old] and module.__spec__.name == OLD_PATHS[old]


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_old_module_paths_as_attributes(old: str) -> None:
    import dapo_ops

    leaf = old.rpartition(".")[2]
    vars(dapo_ops).pop(leaf, None)  # set by an earlier import of the old path
    with pytest.warns(DeprecationWarning, match=OLD_PATHS[old].replace(".", r"\.")):
        assert getattr(dapo_ops, leaf) is importlib.import_module(OLD_PATHS[old])
    with pytest.raises(AttributeError, match="no_such_module"):
        dapo_ops.no_such_module  # noqa: B018
