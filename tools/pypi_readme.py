"""Write README.pypi.md, the package index's description, from README.md.

python -m tools.pypi_readme           # rewrite it
python -m tools.pypi_readme --check   # exit 1 when it is stale

README.md links to the docs relatively (docs/loss.md), which works in the repository and
nowhere else: on the package index page such a link resolves against the index's own
address and is dead. The project has no public docs address to point at, so the index
page gets no relative link at all: each one becomes the path it names, in code, and the
page says where those paths are (the source distribution ships docs/). Absolute links
(https://...) and in-page anchors are kept.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "README.md"
TARGET = ROOT / "README.pypi.md"
NOTE = (
    "*This is README.md as the package index shows it. From the index, install with "
    '`pip install dapo_ops` (extras: `pip install "dapo_ops[demo]"`); the `pip install -e` '
    "commands below run in a clone of the repository. Paths such as `docs/loss.md` name "
    "the documentation pages, which ship in the source distribution and the repository.*"
)
_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+)\)")
_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


def _relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not target.startswith("#")


def render(text: str) -> str:
    """README.md's text with every relative link and image replaced by the path it names."""

    def image(m: re.Match[str]) -> str:
        alt, target = m.group(1), m.group(2)
        return f"*({alt or 'figure'}: `{target}`)*" if _relative(target) else m.group(0)

    def link(m: re.Match[str]) -> str:
        label, target = m.group(1), m.group(2)
        if not _relative(target):
            return m.group(0)
        path = target.split("#", 1)[0]
        return f"`{path}`" if label.strip("`") == path else f"{label} (`{path}`)"

    body = _LINK.sub(link, _IMAGE.sub(image, text))
    title, _, rest = body.partition("\n")
    return f"{title}\n\n{NOTE}\n{rest}"


def main(argv: list[str]) -> int:
    text = render(SOURCE.read_text())
    if "--check" in argv:
        if TARGET.exists() and TARGET.read_text() == text:
            return 0
        print(f"{TARGET.name} is stale: run python -m tools.pypi_readme", file=sys.stderr)
        return 1
    TARGET.write_text(text)
    print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
