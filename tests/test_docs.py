"""The documentation site: API coverage, navigation, and a strict mkdocs build."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import dapo_ops

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def documented_names() -> set[str]:
    """Every ``::: dapo_ops.NAME`` directive in docs/*.md."""
    names: set[str] = set()
    for page in DOCS.glob("*.md"):
        names.update(re.findall(r"^::: dapo_ops\.(\w+)\s*$", page.read_text(), re.M))
    return names


def nav_pages() -> list[str]:
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text.split("\nnav:", 1)[1]
    return re.findall(r"^\s*-\s*[^:\n]+:\s*(\S+\.md)\s*$", nav, re.M)


def test_every_public_name_is_in_the_api_docs() -> None:
    missing = sorted(set(dapo_ops.__all__) - documented_names())
    assert not missing, f"add '::: dapo_ops.NAME' to docs/api.md for: {missing}"


def test_nav_lists_every_page_and_only_existing_pages() -> None:
    nav = nav_pages()
    assert "index.md" in nav and "api.md" in nav and "integrations.md" in nav
    missing_files = [p for p in nav if not (DOCS / p).is_file()]
    assert not missing_files, f"mkdocs.yml nav names pages that do not exist: {missing_files}"
    not_in_nav = sorted(p.name for p in DOCS.glob("*.md") if p.name not in nav)
    assert not not_in_nav, f"add these pages to the nav of mkdocs.yml: {not_in_nav}"


#: The docs navigation's groups in order, each with the package folders (stages) whose
#: pages it holds: the nav, the package layout and docs/architecture.md tell one story.
NAV_STAGES = {
    "Getting started": ("demo",),
    "Rewards, advantages and sampling": ("rewards", "advantages"),
    "Log-probs": ("kernels", "logprobs"),
    "Objectives and the loss": ("objectives", "engine", "presets"),
    "Normalisation and distributed training": (),
    "Rollout correction": ("correction",),
    "Integrations": ("integrations",),
    "Performance": (),
    "Reference": ("diagnostics", "testing", "_core"),
}


def test_nav_groups_follow_the_package_layout() -> None:
    """Every stage folder of src/dapo_ops has its nav group, the groups come in the order
    of the pipeline (rewards before the loss, the loss before rollout correction), and
    docs/architecture.md names every folder."""
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text.split("\nnav:\n", 1)[1]
    groups = re.findall(r"^  - ([^:]+):\s*$", nav, re.M)
    assert groups == list(NAV_STAGES), groups
    package = Path(dapo_ops.__file__).parent
    folders = {p.name for p in package.iterdir() if p.is_dir() and p.name != "__pycache__"}
    mapped = {stage for stages in NAV_STAGES.values() for stage in stages}
    assert folders == mapped, f"folders without a nav group: {sorted(folders - mapped)}"
    architecture = (DOCS / "architecture.md").read_text()
    assert all(f"`{folder}/`" in architecture for folder in folders)


def test_griffe_extension_rewrites_rest_constructs() -> None:
    pytest.importorskip("griffe")
    spec = importlib.util.spec_from_file_location("griffe_rst", ROOT / "tools" / "griffe_rst.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    doc = (
        "Sum, see :func:`token_level_loss` and :math:`|S|`.\n\n"
        ".. math::\n\n    a = \\frac{1}{2}\n\n"
        "====  =====\nmode  count\n====  =====\n``a``   :math:`|S|`\n====  =====\n\n"
        "Example:\n    >>> 1 + 1\n    2"
    )
    out = module.rst_to_markdown(doc)
    assert "`token_level_loss`" in out and "$|S|$" in out
    assert "$$\na = \\frac{1}{2}\n$$" in out
    assert "| mode | count |" in out and "| ``a`` | $\\vert{}S\\vert{}$ |" in out
    assert "Examples:\n    >>> 1 + 1" in out
    assert ".. math::" not in out and ":func:" not in out and ":math:" not in out


DOCS_TOOLS = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")


def test_docs_extra_brings_a_signature_formatter() -> None:
    """mkdocstrings formats the API page's separate signatures with Black or Ruff and
    silently leaves them unformatted without one: the docs extra asks for Ruff."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    docs = project["optional-dependencies"]["docs"]
    assert any(r.startswith(("ruff", "black")) for r in docs), docs


@pytest.mark.skipif(
    any(importlib.util.find_spec(m.split(".")[0]) is None for m in DOCS_TOOLS),
    reason="the docs extra (mkdocs-material, mkdocstrings[python]) is not installed",
)
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    api = (site / "api" / "index.html").read_text()
    for name in dapo_ops.__all__:
        assert f'id="dapo_ops.{name}"' in api, f"{name} was not rendered"
    for leftover in (".. math::", ":func:`", ":math:`"):
        assert leftover not in api, f"unconverted reST {leftover!r} in the API page"
    assert 'class="arithmatex"' in api
    assert remote_loads(site) == {}, "the built site must render offline"


def remote_loads(site: Path) -> dict[str, list[str]]:
    """Page -> the http(s) URLs its ``<script src>`` / ``<link href>`` load."""
    found = {}
    for page in site.rglob("*.html"):
        text = page.read_text(errors="ignore")
        remote = re.findall(r'<(?:script[^>]*src|link[^>]*href)="(https?://[^"]+)"', text)
        if remote:
            found[str(page.relative_to(site))] = remote
    return found


def test_site_loads_nothing_from_another_host() -> None:
    """Docs render offline: no script or stylesheet of mkdocs.yml, and no <script src> or
    <link href> of a page template, points at http(s)."""
    config = (ROOT / "mkdocs.yml").read_text()
    assets = re.findall(r"^extra_(?:javascript|css):\n((?:\s+-\s.*\n)+)", config, re.M)
    urls = [u for block in assets for u in re.findall(r"-\s*(\S+)", block)]
    assert urls and not [u for u in urls if "://" in u], urls
    for url in urls:
        assert (DOCS / url).is_file(), f"{url} is listed in mkdocs.yml but not vendored"
    site = ROOT / "build" / "site"
    if site.is_dir():  # after `mkdocs build` (test_mkdocs_build_strict checks its own build)
        assert remote_loads(site) == {}


def test_comparison_page_is_generated_from_the_registry() -> None:
    """docs/comparison.md is what `python -m tools.feature_table` writes today."""
    from dapo_ops.integrations.peers import markdown_table

    page = DOCS / "comparison.md"
    assert page.read_text() == markdown_table(), "stale: run python -m tools.feature_table"


def test_package_index_description_is_readme_without_relative_links() -> None:
    """README.pypi.md (the package's long description, pyproject.toml) is README.md as
    `python -m tools.pypi_readme` renders it, and holds no relative link or image: on the
    package index page one would be dead. The sdist ships the docs it names by path."""
    spec = importlib.util.spec_from_file_location("pypi_readme", ROOT / "tools" / "pypi_readme.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    text = (ROOT / "README.pypi.md").read_text()
    assert text == tool.render((ROOT / "README.md").read_text()), (
        "stale: run python -m tools.pypi_readme"
    )
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and t[0] != "#"]
    assert not relative, f"relative links on the package index page: {relative}"
    manifest = (ROOT / "MANIFEST.in").read_text()
    assert "graft docs" in manifest and "README.pypi.md" in manifest


@pytest.mark.usefixtures("no_runtime_typecheck")  # check_objective compiles policy_loss
def test_objectives_page_example_runs_and_passes_the_conformance_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/objectives.md: the complete example (a user objective, a loss with the global
    normaliser, backward, ``check_objective``) and the checking snippet run as written."""
    text = (DOCS / "objectives.md").read_text()
    example = re.search(r"## A complete example\n.*?```python\n(.*?)```", text, re.S)
    checking = re.search(r"## Checking it.*?```python\n(.*?)```", text, re.S)
    assert example and checking, "docs/objectives.md lost its example or its checking snippet"
    # a module of its own, as user code is: torch.compile resolves the globals of the
    # objective's methods through sys.modules
    module = types.ModuleType("dapo_ops_docs_objectives_example")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(example.group(1), "docs/objectives.md", "exec"), module.__dict__)
    logp = module.__dict__["logp"]
    assert isinstance(logp, torch.Tensor) and logp.grad is not None
    assert bool(torch.isfinite(logp.grad).all()) and bool(logp.grad.abs().sum() > 0)
    objective = module.__dict__["TanhClip"]()
    assert isinstance(objective, dapo_ops.Objective)
    assert type(objective).grad is not dapo_ops.Objective.grad  # the fused path
    exec(compile(checking.group(1), "docs/objectives.md", "exec"), module.__dict__)


_ARXIV = re.compile(r"arXiv:(\d{4}\.\d{4,5})")


def _cited_units() -> list[tuple[str, object]]:
    """Every objective (``OBJECTIVES``) and every advantage estimator (the
    ``*_advantages`` functions of :mod:`dapo_ops.advantages`)."""
    import dapo_ops.advantages
    import dapo_ops.objectives

    objectives = [(c.__name__, c) for c in dapo_ops.objectives.OBJECTIVES]
    estimators = [
        (name, getattr(dapo_ops.advantages, name))
        for name in dapo_ops.advantages.__all__
        if name.endswith("_advantages")
    ]
    return objectives + estimators


@pytest.mark.parametrize(
    ("name", "unit"), _cited_units(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_objective_and_estimator_cites_its_paper(name: str, unit: object) -> None:
    """Its docstring names the paper (first author, year, arXiv id), and docs/references.md
    lists it beside the same arXiv id."""
    doc = " ".join((unit.__doc__ or "").split())
    ids = _ARXIV.findall(doc)
    assert ids, f"{name}'s docstring cites no arXiv id"
    assert re.search(r"[A-Z][\w-]+(?: et al\.| and [A-Z]\w+| Team)? (?:19|20)\d\d", doc), name
    rows = [r for r in (DOCS / "references.md").read_text().splitlines() if f"`{name}" in r]
    assert rows, f"docs/references.md has no row for {name}"
    assert any(i in r for r in rows for i in ids), (name, ids, rows)
