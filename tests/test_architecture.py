"""The code's shape as docs/architecture.md describes it, checked on the source: one place chooses a
kernel, only prepare.py writes a PreparedMask, no module uses another's private names, the import
graph has no circle, files hold one idea each (none over ~600 lines but the C++ engine), the CLI
holds no model logic, and no test module imports conftest."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

import attnkit
from attnkit import masks

SRC = Path(attnkit.__file__).parent
TESTS = Path(__file__).parent


def _sources() -> dict[str, str]:
    return {p.relative_to(SRC).as_posix(): p.read_text(encoding="utf-8") for p in SRC.rglob("*.py")}


def _module_name(rel: str) -> str:
    name = "attnkit." + rel[:-3].replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _modules() -> dict[str, tuple[str, ast.Module]]:
    return {_module_name(rel): (rel, ast.parse(text)) for rel, text in _sources().items()}


def _is_package(rel: str) -> bool:
    return rel.endswith("__init__.py")


def _resolve(module: str | None, level: int, current: str, package: bool) -> str:
    if not level:
        return module or ""
    base = current.split(".") if package else current.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def test_one_place_chooses_a_kernel():
    """Only the registry walks the kernels and asks them whether they can run a call and prefer it;
    every engine (native, fused, math, triton, sdpa, reference) is a registered kernel."""
    asked = re.compile(r"\.(prefers|not_supported_reasons)\(|\bPRIORITY\b")
    offenders = [
        f"{name}:{i + 1}: {line.strip()}"
        for name, text in _sources().items()
        if name not in ("kernels/registry.py", "kernels/__init__.py")
        for i, line in enumerate(text.splitlines())
        if asked.search(line) and not line.lstrip().startswith(("#", "def ", '"""', "``"))
    ]
    assert not offenders, "\n".join(offenders)
    names = [k.name for k in attnkit.kernels.PRIORITY]
    assert names == ["triton", "native", "fused", "math", "sdpa", "reference"]
    q = __import__("torch").randn(1, 2, 64, 16)
    plan = attnkit.explain(q, q, q, masks.sliding_window(8), dropout_p=0.1)
    for name in ("native", "fused"):
        assert "no dropout (dropout_p=0.1)" in plan.rejected[name], (name, plan.rejected[name])
    assert plan.kernel == "math"


def test_only_prepare_writes_a_prepared_mask():
    """A PreparedMask is frozen, and no module but prepare.py sets its fields or its derived forms."""
    p = attnkit.prepare(masks.causal(), 8, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.kept = 1.0  # type: ignore[misc]
    pattern = re.compile(r"object\.__setattr__|\._derived\b|\.tiles\.(put|get)\(")
    offenders = [
        f"{name}:{i + 1}: {line.strip()}"
        for name, text in _sources().items()
        if name != "prepare.py"
        for i, line in enumerate(text.splitlines())
        if pattern.search(line)
    ]
    assert not offenders, "\n".join(offenders)


def test_no_module_uses_another_modules_private_names():
    """``from attnkit.x import _name`` (a name, not a module) and ``x._name`` on an imported attnkit
    module are what the public-API test is for a module's public surface: each module's own."""
    modules = _modules()
    offenders = []
    for name, (rel, tree) in modules.items():
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _resolve(node.module, node.level, name, _is_package(rel))
                if not source.startswith("attnkit"):
                    continue
                for a in node.names:
                    target = f"{source}.{a.name}"
                    if target in modules:
                        aliases[a.asname or a.name] = target
                    elif a.name.startswith("_") and not a.name.startswith("__"):
                        offenders.append(f"{rel}:{node.lineno}: from {source} import {a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("attnkit") and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and f"{aliases[node.value.id]}.{node.attr}" not in modules
            ):
                offenders.append(f"{rel}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not offenders, "\n".join(sorted(set(offenders)))


def test_no_module_reaches_into_a_masks_private_methods():
    """Mask structure is published (band, limit_only, positions, elements, block_codes, key_limit,
    tensors, value_key, cacheable); only the masks package and prepare.py touch what is private to
    masks (biases have a _part and _in_cache of their own, in bias.py)."""
    private = re.compile(
        r"\._(block_map|dense|held|kv_limit|shift|q_pos|k_pos|position_key|position_value|index_shift)\(|"
        r"\bmask\._(key|part|in_cache)\("
    )
    offenders = [
        f"{name}:{i + 1}: {line.strip()}"
        for name, text in _sources().items()
        if not name.startswith("masks/") and name != "prepare.py"
        for i, line in enumerate(text.splitlines())
        if private.search(line)
    ]
    assert not offenders, "\n".join(offenders)


def test_the_import_graph_has_no_circle():
    """Module-level imports (TYPE_CHECKING ones included) form a graph without a cycle."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, (rel, tree) in modules.items():
        body = list(tree.body) + [n for top in tree.body if isinstance(top, ast.If) for n in top.body]
        deps = set()
        for node in body:
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(node.module, node.level, name, _is_package(rel))
                for a in node.names:
                    deps.add(f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source)
        graph[name] = {d for d in deps if d in modules and d != name}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                circle = path[path.index(dep) :] + [dep]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_files_hold_one_idea_each():
    """No source file over ~600 lines but the C++ engine (native.cpp)."""
    long = {rel: text.count("\n") for rel, text in _sources().items() if text.count("\n") > 650}
    assert not long, long


def test_the_cli_parses_and_prints():
    """cli.py holds no model logic: it imports no tensor library and builds no model; each command
    calls one function of the library and prints what it returns."""
    tree = ast.parse((SRC / "cli.py").read_text())
    imported = {
        a.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for a in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
    }
    assert not imported & {"torch", "numpy", "transformers"}, imported
    assert (SRC / "cli.py").read_text().count("\n") < 400


def test_no_test_module_imports_conftest():
    offenders = [
        str(p.relative_to(TESTS))
        for p in TESTS.rglob("*.py")
        if p.name != "conftest.py" and re.search(r"^\s*(from conftest import|import conftest)", p.read_text(), re.M)
    ]
    assert not offenders, offenders
