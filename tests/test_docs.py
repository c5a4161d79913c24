"""Every Python example in the docs runs, and the site builds.

Each page's ```python blocks run in order as one script, in a fresh process and an empty
directory (so files a page writes land there): a page is read top to bottom, and a later
block may use an earlier one's names. A block of ``>>>`` lines is a doctest: its printed
output must match. A block preceded by ``<!-- not run: why -->`` is skipped (it needs
several processes started by torchrun, a GPU, or a model directory the reader has).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shutil
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


#: ``print(...)  # -> what it prints``: a line of a block whose printed output the page shows (``...``
#: stands for any text, whitespace runs are one space), checked when the page runs.
SHOWN = re.compile(r"^(?P<indent>\s*)(?P<call>print\(.*\))\s*#\s*->\s*(?P<shown>.*)$", re.M)

CHECK_SHOWN = """
import contextlib as _contextlib, doctest as _doctest, io as _io
@_contextlib.contextmanager
def _shows(expected, where):
    buffer = _io.StringIO()
    with _contextlib.redirect_stdout(buffer):
        yield
    printed = buffer.getvalue()
    print(printed, end="")
    flags = _doctest.ELLIPSIS | _doctest.NORMALIZE_WHITESPACE
    if not _doctest.OutputChecker().check_output(expected + "\\n", printed, flags):
        raise SystemExit(f"{where} shows {expected!r} but prints {printed!r}")
"""


def _checked(code: str, page: Path, line: int) -> str:
    """``code`` with each shown output checked (:data:`SHOWN`)."""

    def wrap(m: re.Match) -> str:
        at = f"{page}:{line + code.count(chr(10), 0, m.start())}"
        return f"{m['indent']}with _shows({m['shown']!r}, {at!r}): {m['call']}"

    return SHOWN.sub(wrap, code)


def script(page: Path) -> str:
    parts = [CHECK_SHOWN]
    for line, code in blocks(page):
        if code.lstrip().startswith(">>>"):
            parts.append(DOCTEST.format(text=code, name=str(page), line=line))
        else:
            parts.append(f"# {page}:{line}\n" + _checked(code, page, line))
    # A page that starts processes (run_local) guards its start with `if __name__ == "__main__"`:
    # the children import this script again.
    return "import matplotlib\nmatplotlib.use('Agg')\n\n" + "\n".join(parts)


def test_every_page_is_collected():
    assert Path("docs/index.md") in PAGES and Path("docs/getting-started.md") in PAGES
    assert sum(len(blocks(p)) for p in PAGES) >= 30
    assert sum(len(SHOWN.findall(code)) for p in PAGES for _, code in blocks(p)) >= 8  # outputs the pages show


def test_a_shown_output_that_differs_fails_the_page(tmp_path):
    """The check of shown outputs can fail: a page whose print shows another text exits non-zero."""
    page = tmp_path / "page.md"
    page.write_text("```python\nprint(1 + 1)   # -> 3\n```\n", encoding="utf-8")
    code = CHECK_SHOWN + _checked("print(1 + 1)   # -> 3\n", page, 1)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "shows '3' but prints '2" in done.stderr


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
    warned = [line for line in done.stderr.splitlines() if "Warning:" in line]
    assert not warned, f"{page}'s examples print warnings a reader would see: {warned[:3]}"


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


#: An attnkit name the docs refer to in code (`attnkit.kernels.native.build.status()`), not an attribute
#: of another object (`torch.ops.attnkit.native_forward`).
REFERENCE = re.compile(r"`[^`\n]*?(?<![\w.])(attnkit(?:\.[A-Za-z_]\w*)+)")


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


def test_every_attnkit_name_the_docs_refer_to_exists():
    missing = {}
    for page in [*PAGES, Path("CHANGELOG.md")]:
        for name in REFERENCE.findall((ROOT / page).read_text(encoding="utf-8")):
            if not _resolves(name):
                missing.setdefault(name, set()).add(str(page))
    assert not missing, f"the docs name what does not exist: {missing}"


@pytest.mark.skipif(shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None, reason="needs mkdocs")
def test_make_docs_fails_on_a_broken_link_and_a_broken_anchor(tmp_path):
    """make docs' build (mkdocs --strict, with the site's validation settings) fails when a page links
    to a page or an anchor that does not exist: shown on a copy of the site with one of each."""
    for name in ("mkdocs.yml", "CHANGELOG.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    for name in ("src", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    with open(tmp_path / "docs" / "index.md", "a", encoding="utf-8") as f:
        f.write("\n[gone](no-such-page.md) and [no anchor](kernels.md#no-such-section)\n")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    mkdocs = str(Path(sys.executable).parent / "mkdocs")
    done = subprocess.run(
        [mkdocs, "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0
    assert "no-such-page.md" in done.stderr and "no-such-section" in done.stderr


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_benchmark_table_the_docs_name_renders():
    """Each ``<!-- bench: NAME -->`` of the docs names a renderer, and each result file that is there
    renders without error (a missing one renders as "No results yet", never as a crash)."""
    hooks = _hooks()
    named = {m for page in PAGES for m in hooks.PLACEHOLDER.findall((ROOT / page).read_text(encoding="utf-8"))}
    assert named <= set(hooks.TABLES), named - set(hooks.TABLES)
    for name in sorted(named):
        assert hooks.render(name).strip(), name


def test_the_torch_flex_tests_table_shows_every_count_the_runner_wrote(tmp_path, monkeypatch):
    """The table of PyTorch's own Flex tests shows each outcome's count as the runner wrote it (its keys,
    "fails on torch" included), and a total that is their sum."""
    hooks = _hooks()
    counts = {"passed": 7, "failed": 2, "fails on torch": 3, "not applicable": 4, "skipped": 5, "xfailed": 6}
    summary = {"counts": counts, "machine": {}, "files": ["a.py"], "minutes": 1.0}
    (tmp_path / "torch_flex_tests.json").write_text(json.dumps({"summary": summary, "tests": {}}))
    monkeypatch.setattr(hooks, "RESULTS", tmp_path)
    rows = dict(re.findall(r"^\| ([a-z ]+) \| (\d+) \|$", hooks.render("torch_flex_tests"), re.M))
    assert rows == {
        "passed": "7", "failed": "2", "fails on torch itself": "3", "not applicable": "4", "skipped": "5",
        "xfailed": "6", "total": "27",
    }  # fmt: skip
