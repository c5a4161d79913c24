"""Every Python example in the docs runs, and the site builds.

Each page's ```python blocks run in order as one script, in a fresh process and an empty
directory (so files a page writes land there): a page is read top to bottom, and a later
block may use an earlier one's names. A block of ``>>>`` lines is a doctest: its printed
output must match. A block preceded by ``<!-- not run: why -->`` is skipped (it needs
several processes started by torchrun, a GPU, or a model directory the reader has).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p.relative_to(ROOT) for p in DOCS.rglob("*.md")) + [Path("README.md")]
BLOCK = re.compile(r"(<!-- not run: [^>]*-->\s*\n)?```python\n(.*?)```", re.S)

DOCTEST = """
import doctest as _doctest
_test = _doctest.DocTestParser().get_doctest({text!r}, globals(), {name!r}, {name!r}, {line})
_runner = _doctest.DocTestRunner(optionflags=_doctest.NORMALIZE_WHITESPACE | _doctest.ELLIPSIS)
_runner.run(_test, clear_globs=False)
if _runner.failures:
    raise SystemExit("the >>> example of {name} at line {line} printed something else")
"""


def blocks(page: Path) -> list[tuple[int, str]]:
    """The (line, code) of the page's python blocks that run, in order."""
    text = (ROOT / page).read_text(encoding="utf-8")
    found = []
    for m in BLOCK.finditer(text):
        if m.group(1):
            continue
        found.append((text.count("\n", 0, m.start(2)) + 1, m.group(2)))
    return found


def script(page: Path) -> str:
    parts = []
    for line, code in blocks(page):
        if code.lstrip().startswith(">>>"):
            parts.append(DOCTEST.format(text=code, name=str(page), line=line))
        else:
            parts.append(f"# {page}:{line}\n" + code)
    # A page that starts processes (run_local) guards its start with `if __name__ == "__main__"`:
    # the children import this script again.
    return "import matplotlib\nmatplotlib.use('Agg')\n\n" + "\n".join(parts)


def test_every_page_is_collected():
    assert Path("docs/index.md") in PAGES and Path("docs/getting-started.md") in PAGES
    assert sum(len(blocks(p)) for p in PAGES) >= 30


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)], ids=str)
def test_page_examples_run(page, tmp_path):
    path = tmp_path / "page.py"
    path.write_text(script(page), encoding="utf-8")
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONHASHSEED="0")
    done = subprocess.run(
        [sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (
        f"{page}'s examples failed:\n{textwrap.indent(done.stdout[-3000:], '  ')}\n{done.stderr[-6000:]}"
    )


def test_skipped_blocks_say_why():
    for page in PAGES:
        text = (ROOT / page).read_text(encoding="utf-8")
        for reason in re.findall(r"<!-- not run: ([^>]*)-->", text):
            assert len(reason.strip()) > 10, f"{page}: say why a block is not run"


def test_the_contributing_guides_kernel_example_is_a_doctest():
    """docs/contributing.md's "Adding a kernel" example is a >>> block: test_page_examples_run runs
    it as a doctest, so its registration, explain line and answer must stay true."""
    found = [code for _, code in blocks(Path("docs/contributing.md")) if code.lstrip().startswith(">>>")]
    assert any("register_kernel(" in code and "attnkit.explain(" in code for code in found)
