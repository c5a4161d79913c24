"""The code's shape as docs/architecture.md describes it, checked on the source: one place chooses a
kernel, kernels are siblings over one contract (none imports another or the registry), one place
derives a call's form, one module holds the fast path, statistics go through the registry, only
plan.py writes a PreparedMask, no module uses another's private names nor another package's private
modules, the import graph has no circle (imports inside functions counted), no module is hidden by a
function of its package, views import no tool, files hold one idea each (none over 600 lines, the
C++ engine's included), importing attnkit starts no subprocess, the CLI holds no model logic, tests
pin kernels through the registry, and no test module imports conftest."""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
import subprocess
import sys
import textwrap
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


@functools.cache
def _modules() -> dict[str, tuple[str, ast.Module]]:
    """Every module parsed once a run (the source does not change while the tests read it)."""
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
    # the fast path reads PRIORITY only to check that the registry is attnkit's own (its invariant)
    read_only = re.compile(r"\.(prefers|not_supported_reasons)\(")
    patterns = {"kernels/registry.py": None, "kernels/__init__.py": None, "kernels/fastpath.py": read_only}
    offenders = [
        f"{name}:{i + 1}: {line.strip()}"
        for name, text in _sources().items()
        if patterns.get(name, asked) is not None
        for i, line in enumerate(text.splitlines())
        if patterns.get(name, asked).search(line) and not line.lstrip().startswith(("#", "def ", '"""', "``"))
    ]
    assert not offenders, "\n".join(offenders)
    names = [k.name for k in attnkit.kernels.PRIORITY]
    assert names == ["triton", "native", "fused", "math", "sdpa", "reference"]
    q = __import__("torch").randn(1, 2, 64, 16)
    plan = attnkit.explain(q, q, q, masks.sliding_window(8), dropout_p=0.1)
    for name in ("native", "fused"):
        assert "no dropout (dropout_p=0.1)" in plan.rejected[name], (name, plan.rejected[name])
    assert plan.kernel == "math"


def test_only_plan_writes_a_prepared_mask():
    """A PreparedMask is frozen, and no module but plan.py sets its fields or its derived forms."""
    p = attnkit.prepare(masks.causal(), 8, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.kept = 1.0  # type: ignore[misc]
    pattern = re.compile(r"object\.__setattr__|\._derived\b|\.tiles\.(put|get)\(")
    offenders = [
        f"{name}:{i + 1}: {line.strip()}"
        for name, text in _sources().items()
        if name != "plan.py"
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
    tensors, value_key, cacheable); only the masks package and plan.py touch what is private to
    masks (biases have a _part and _in_cache of their own, in bias.py)."""
    private = re.compile(
        r"\._(block_map|dense|held|kv_limit|shift|q_pos|k_pos|position_key|position_value|index_shift)\(|"
        r"\bmask\._(key|part|in_cache)\("
    )
    offenders = [
        f"{name}:{i + 1}: {line.strip()}"
        for name, text in _sources().items()
        if not name.startswith("masks/") and name != "plan.py"
        for i, line in enumerate(text.splitlines())
        if private.search(line)
    ]
    assert not offenders, "\n".join(offenders)


def _imports(name: str, rel: str, tree: ast.Module, modules: dict) -> set[str]:
    """Every attnkit module ``name`` imports: at module level, under TYPE_CHECKING and inside functions."""
    deps = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                while parts and ".".join(parts) not in modules:
                    parts.pop()
                if parts:
                    deps.add(".".join(parts))
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(node.module, node.level, name, _is_package(rel))
            for a in node.names:
                deps.add(f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source)
    return {d for d in deps if d in modules and d != name}


def test_the_import_graph_has_no_circle():
    """Imports form a graph without a cycle, counting those inside functions and under TYPE_CHECKING:
    a function-level import is still a tie between two modules."""
    modules = _modules()
    graph = {name: _imports(name, rel, tree, modules) for name, (rel, tree) in modules.items()}
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


def test_views_receive_values_and_the_functions_reach_no_tool():
    """viz/ draws what it is handed and imports nothing of inspect/; functional.py (the public
    functions) imports nothing of inspect/ either: the tools sit above both."""
    modules = _modules()
    offenders = [
        f"{name} imports {dep}"
        for name, (rel, tree) in modules.items()
        if name.startswith("attnkit.viz") or name == "attnkit.functional"
        for dep in _imports(name, rel, tree, modules)
        if dep == "attnkit.inspect" or dep.startswith("attnkit.inspect.")
    ]
    assert not offenders, "\n".join(sorted(offenders))


def test_no_module_imports_a_private_module_of_another_package():
    """``attnkit.masks._kinds`` is the masks package's own: code outside masks/ reads ``attnkit.masks``
    or its public modules (top-level private modules such as ``attnkit._validate`` serve everyone)."""
    modules = _modules()
    offenders = []
    for name, (rel, tree) in modules.items():
        package = name if _is_package(rel) else name.rsplit(".", 1)[0]
        for dep in _imports(name, rel, tree, modules):
            parts = dep.split(".")
            for i, part in enumerate(parts):
                if part.startswith("_") and not part.startswith("__"):
                    owner = ".".join(parts[:i])
                    if not (package == owner or package.startswith(owner + ".")):
                        offenders.append(f"{rel} imports {dep}")
                    break
    assert not offenders, "\n".join(sorted(offenders))


def test_no_module_is_hidden_by_a_function_of_its_package():
    """``import attnkit.inspect.capturing as m`` gives the module: no package binds a submodule's
    name to something else (``attnkit.inspect.capture`` is the function, its module ``capturing``)."""
    import importlib

    hidden = []
    for name, (rel, _) in _modules().items():
        if name.endswith("__main__") or "." not in name[len("attnkit") :]:
            continue
        parent, leaf = name.rsplit(".", 1)
        module = importlib.import_module(name)
        bound = getattr(importlib.import_module(parent), leaf, module)
        if bound is not module:
            hidden.append(f"{parent}.{leaf} is a {type(bound).__name__}, not the module {rel}")
    assert not hidden, "\n".join(sorted(hidden))


def test_files_hold_one_idea_each():
    """No source file over 600 lines: Python, and the C++ engine's stage headers and operators."""
    files = [p for p in SRC.rglob("*") if p.suffix in (".py", ".cpp", ".h")]
    assert any(p.suffix == ".h" for p in files), "the C++ engine is split into stage headers"
    long = {str(p.relative_to(SRC)): n for p in files if (n := p.read_text(encoding="utf-8").count("\n")) > 600}
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


# --- the kernel room: siblings over one contract --------------------------------------------------

#: Modules under attnkit.kernels every kernel may import: the contract and the shared parts.
SHARED = {"contract", "sparsity", "dense", "blocks", "lse"}
#: The kernels' families: a module or a folder each.
FAMILIES = ("native", "runs", "triton", "sdpa", "reference")


def _imports_of(tree: ast.Module, name: str, package: bool) -> set[str]:
    """Every attnkit module a module imports, at its top or inside functions (lazy imports too)."""
    modules = set(_modules())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("attnkit")}
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(node.module, node.level, name, package)
            if source.startswith("attnkit"):
                for a in node.names:
                    found.add(f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source)
    return found


def _kernel_part(module: str) -> str | None:
    """``"shared:<name>"``, ``"family:<name>"``, ``"chooser"`` for a module under attnkit.kernels, else None."""
    if not module.startswith("attnkit.kernels"):
        return None
    rest = module.split(".")[2:]
    if not rest:
        return "chooser"
    if rest[0] in SHARED:
        return f"shared:{rest[0]}"
    if rest[0] in FAMILIES:
        return f"family:{rest[0]}"
    return "chooser"  # registry, fastpath


def _defines_a_kernel(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.ClassDef) and any(getattr(b, "id", getattr(b, "attr", "")) == "Kernel" for b in node.bases)
        for node in tree.body
    )


def test_kernels_are_siblings_over_one_contract():
    """A kernel's module imports the contract, the shared parts and its own family, never another
    family nor the chooser (registry, fast path); the shared parts import no family; within a
    family no module that defines a kernel imports another that does; the registry imports them."""
    modules = _modules()
    offenders = []
    kernel_modules = {name for name, (_, tree) in modules.items() if _defines_a_kernel(tree)}
    assert {"attnkit.kernels.native.kernel", "attnkit.kernels.runs.fused", "attnkit.kernels.sdpa"} <= kernel_modules
    for name, (rel, tree) in modules.items():
        part = _kernel_part(name)
        if part is None or part == "chooser":
            continue
        for dep in _imports_of(tree, name, _is_package(rel)):
            dep_part = _kernel_part(dep)
            if dep_part is None:
                continue
            if part.startswith("shared:") and not dep_part.startswith("shared:"):
                offenders.append(f"{rel}: a shared part imports {dep}")
            elif part.startswith("family:") and dep_part not in (part,) and not dep_part.startswith("shared:"):
                offenders.append(f"{rel}: imports {dep} ({dep_part})")
            elif name in kernel_modules and dep in kernel_modules and dep != name:
                offenders.append(f"{rel}: a kernel imports the kernel {dep}")
    assert not offenders, "\n".join(offenders)
    registry = modules["attnkit.kernels.registry"]
    reached = _imports_of(registry[1], "attnkit.kernels.registry", False)
    assert kernel_modules - {"attnkit.kernels.contract"} <= reached, kernel_modules - reached


def test_one_place_derives_the_form_of_a_call():
    """call.py works out a call's form and mask facts once; no kernel asks the mask for them again."""
    rederived = re.compile(r"mask_facts\(|\.key_limit_values\(|\.limit_only\(\)|mask\.band\(|Form\.__call__")
    offenders = [
        f"{name}:{i + 1}: {line.strip()}"
        for name, text in _sources().items()
        if name.startswith("kernels/")
        for i, line in enumerate(text.splitlines())
        if rederived.search(line) and not line.lstrip().startswith(("#", '"""', "``"))
    ]
    assert not offenders, "\n".join(offenders)
    from attnkit.call import Call

    with pytest.raises(dataclasses.FrozenInstanceError):
        Call.__setattr__(attnkit.call.make_call(*(__import__("torch").randn(1, 1, 4, 8),) * 3), "form", None)


def test_one_module_holds_the_fast_path():
    """The lean caches and their keys live in kernels/fastpath.py; only it asks a kernel for a runner."""
    texts = _sources()
    lean = re.compile(r"\bLEAN(_ANY_LENGTH|_LIMITS)?\s*=|\.(runner|limit_runner)\(call\)")
    offenders = [
        f"{name}:{i + 1}: {line.strip()}"
        for name, text in texts.items()
        if name != "kernels/fastpath.py"
        for i, line in enumerate(text.splitlines())
        if lean.search(line) and not line.lstrip().startswith(("#", "def ", '"""'))
    ]
    assert not offenders, "\n".join(offenders)


def test_inspect_reaches_statistics_through_the_registry():
    """inspect/ imports no kernel: statistics are a kernel capability the registry chooses."""
    modules = _modules()
    offenders = [
        f"{rel}: {dep}"
        for name, (rel, tree) in modules.items()
        if name.startswith("attnkit.inspect")
        for dep in _imports_of(tree, name, _is_package(rel))
        if (_kernel_part(dep) or "chooser").startswith("family:")
    ]
    assert not offenders, "\n".join(offenders)


def test_attribution_asks_the_registry_and_walks_no_plan():
    """Rollout's rules are reductions the kernels compute (``registry.relevance``): attribution prepares
    no mask, reads no block codes or pairs, runs no attention call and imports neither plan.py,
    functional.py nor the kernels' shared walk."""
    rel, tree = _modules()["attnkit.inspect.attribution"]
    deps = _imports_of(tree, "attnkit.inspect.attribution", False)
    assert not deps & {"attnkit.plan", "attnkit.functional", "attnkit.kernels.blocks", "attnkit.kernels.sparsity"}, deps
    text = _sources()["inspect/attribution.py"]
    reads = re.compile(r"\bprepare\(|\.codes\b|\.allowed(_at)?\(|\.kv_limits\b|attention_weights\(")
    assert not reads.findall(text), reads.findall(text)
    assert "registry.relevance(" in text


def test_importing_attnkit_starts_no_subprocess_and_reads_no_engine_source():
    """``import attnkit`` and its kernels (and the first look at attnkit.attention) run no compiler
    query and hash no C++: the engine is built and keyed at its first use."""
    script = textwrap.dedent(
        """
        import builtins, pathlib, subprocess, sys
        import torch  # PyTorch's own import may spawn (its CUDA build runs ldconfig): not attnkit's
        spawned, read = [], []
        real_popen, real_open, real_read = subprocess.Popen.__init__, builtins.open, pathlib.Path.read_bytes
        def popen(self, *a, **kw):
            spawned.append(a[0] if a else kw.get("args"))
            return real_popen(self, *a, **kw)
        def opened(file, *a, **kw):
            if str(file).endswith((".cpp", ".h")):
                read.append(str(file))
            return real_open(file, *a, **kw)
        def read_bytes(self):
            if self.suffix in (".cpp", ".h"):
                read.append(str(self))
            return real_read(self)
        subprocess.Popen.__init__, builtins.open, pathlib.Path.read_bytes = popen, opened, read_bytes
        import attnkit
        import attnkit.kernels, attnkit.functional, attnkit.inspect, attnkit.nn
        attnkit.attention, attnkit.prepare
        print("spawned", spawned, "read", read)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "spawned [] read []" in done.stdout, done.stdout


def test_tests_pin_kernels_through_the_registry():
    """No test flips a module's switch to pin a kernel (native_build.ENABLED, aten.AVAILABLE):
    they use ``use_kernels(...)``, which is part of every cache key."""
    flips = re.compile(r"(ENABLED|AVAILABLE)\s*=[^=]|setattr\([^)]*[\"'](ENABLED|AVAILABLE)[\"']")
    offenders = [
        f"{p.relative_to(TESTS)}:{i + 1}: {line.strip()}"
        for p in TESTS.rglob("*.py")
        if p.name != "test_architecture.py"
        for i, line in enumerate(p.read_text().splitlines())
        if flips.search(line) and not line.rstrip().endswith("# the staleness case itself")
    ]
    assert not offenders, "\n".join(offenders)


def test_one_hook_mechanism():
    """The hook protocol (attention hooks, the call with its lse, head output hooks) is written once,
    in nn/hooks.py, and both call sites (MultiHeadAttention, the transformers integration) run it;
    inspect/ hooks a model only through inspect/sites.py (no tool keeps its own hooks)."""
    sources = _sources()
    runs_hooks = re.compile(r"for hook in tuple\(.*\.values\(\)\)")
    protocol = [name for name, text in sources.items() if runs_hooks.search(text)]
    assert protocol == ["nn/hooks.py"], protocol
    for name in ("nn/attention.py", "integrations/transformers.py"):
        assert "hook_points.run(" in sources[name] or "HOOK_POINTS.run(" in sources[name], name
    registers = re.compile(r"register_(attention|lse|head_output)_hook\(|\.register\(|HOOK_POINTS")
    hooking = sorted(
        name
        for name, text in sources.items()
        if name.startswith("inspect/")
        for line in text.splitlines()
        if registers.search(line) and not line.lstrip().startswith(("#", ">>>", "``"))
    )
    assert set(hooking) == {"inspect/sites.py"}, hooking
