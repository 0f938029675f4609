"""Write docs/comparison.md from ``dapo_ops.integrations.peers``.

python -m tools.feature_table           # rewrite the page
python -m tools.feature_table --check   # exit 1 when the page is stale
"""

from __future__ import annotations

import sys
from pathlib import Path

from dapo_ops.integrations.peers import markdown_table

PAGE = Path(__file__).resolve().parents[1] / "docs" / "comparison.md"


def main(argv: list[str]) -> int:
    text = markdown_table()
    if "--check" in argv:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != text:
            print(f"{PAGE} is stale: run python -m tools.feature_table", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
