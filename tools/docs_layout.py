"""Check the built docs site at a 1280 px window in headless Chromium: no code line is cut.

    python -m tools.docs_layout build/site [--screenshots DIR] [--width 1280]

For every page that holds code, a copy of the page gets a small script that, once the page
has laid out (MathJax included), lists

- each code block (``pre > code``) and API signature whose text is wider than its box
  (a cut line: the reader would have to scroll, or would not see the end), and
- each inline code span inside a table cell that the browser broke across lines
  (a name broken mid-word), and, as a note only, each table wider than the page (the
  theme's wrapper scrolls it sideways: nothing is cut);

Chromium runs the copy headless (``--dump-dom``) and the lists are read back from the
DOM. Exit status 1 when any page has one. ``--screenshots`` also saves a PNG of each page's
first screen. ``.ci/integration`` runs it after the strict docs build.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROBE = """<script>
window.addEventListener("load", () => setTimeout(() => {
  const cut = [];
  document.querySelectorAll("pre > code, .doc-signature code").forEach((el) => {
    if (el.scrollWidth > el.clientWidth + 1) cut.push("cut: " + el.textContent.slice(0, 70));
  });
  document.querySelectorAll("table code").forEach((el) => {
    if (el.getClientRects().length > 1) cut.push("broken: " + el.textContent.slice(0, 70));
  });
  document.querySelectorAll(".md-typeset__scrollwrap").forEach((el) => {
    if (el.scrollWidth > el.clientWidth + 1) {
      const head = el.querySelector("th");
      cut.push("note: table scrolls sideways: " + (head ? head.textContent : "").slice(0, 40));
    }
  });
  document.body.setAttribute("data-layout", JSON.stringify(cut));
}, 300));
</script>"""


def browser() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise SystemExit("no Chromium found (apt-get install chromium)")


def check_page(page: Path, width: int, shots: Path | None, site: Path) -> list[str]:
    html = page.read_text()
    with tempfile.NamedTemporaryFile("w", suffix=".html", dir=page.parent, delete=False) as tmp:
        tmp.write(html.replace("</body>", PROBE + "</body>"))
    probe = Path(tmp.name)
    flags = [
        browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
        f"--window-size={width},1000", "--virtual-time-budget=4000",
    ]  # fmt: skip
    try:
        dom = subprocess.run(
            [*flags, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120
        ).stdout
        if shots is not None:
            name = str(page.relative_to(site)).replace("/", "_").replace(".html", ".png")
            subprocess.run(
                [*flags, f"--screenshot={shots / name}", probe.as_uri()],
                capture_output=True,
                timeout=120,
            )
    finally:
        probe.unlink()
    found = re.search(r'data-layout="([^"]*)"', dom)
    if not found:
        return ["the layout probe did not run (page failed to load?)"]
    return list(json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", type=Path)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--screenshots", type=Path)
    args = parser.parse_args(argv)
    if args.screenshots:
        args.screenshots.mkdir(parents=True, exist_ok=True)
    pages = sorted(
        p for p in args.site.rglob("*.html") if "<code" in p.read_text() and p.name != "404.html"
    )
    bad = notes = 0
    with ThreadPoolExecutor(max_workers=2) as pool:
        found = pool.map(lambda p: check_page(p, args.width, args.screenshots, args.site), pages)
    for page, problems in zip(pages, found, strict=True):
        for problem in problems:
            print(f"{page.relative_to(args.site)}: {problem}")
        bad += any(not p.startswith("note:") for p in problems)
        notes += sum(p.startswith("note:") for p in problems)
    print(
        f"{len(pages)} pages with code at {args.width} px: {bad} with a cut or broken line; "
        f"{notes} tables scroll sideways (Material's table wrapper: nothing is cut, wide "
        "tables scroll; not an error)"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
