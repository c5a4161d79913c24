"""The wheel carries the native CPU engine, compiled here once per x86-64 level.

Everything else about the package is in pyproject.toml. A wheel (``pip wheel .``, ``pip install .``,
``python -m build``: build_backend/attnkit_build.py puts the tested PyTorch in their build
environment; ``make wheel`` builds beside the venv's torch with ``--no-isolation``) holds
``attnkit/kernels/native/engines/<level>/libattnkit_native.so`` for AVX2 (x86-64-v3), AVX-512
(x86-64-v4) and AVX-512 with AVX512-BF16, linked against that PyTorch, with a manifest; the running
CPU picks one at load (attnkit.kernels.native.prebuilt). It is then a platform wheel
(``py3-none-linux_x86_64``, made ``manylinux`` by ``auditwheel repair``: scripts/build_wheel.py;
the library is loaded by PyTorch, not by Python's C API). A wheel build that cannot compile the
engine (no PyTorch importable, no C++ compiler) fails and says how to build one; with
``ATTNKIT_PREBUILT=0``, or off x86-64 Linux, the wheel is pure Python, saying so, and the engine is
compiled at first use on the user's machine. An editable install (``pip install -e .``) never
prebuilds: it compiles at first use.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
from pathlib import Path

from setuptools import Distribution as Distribution_
from setuptools import setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent


def _prebuild_why_not() -> tuple[str | None, bool]:
    """Why this build of the wheel carries no engine (None: it does), and whether that is an error
    (a wheel build here should carry it but cannot) rather than a choice."""
    if os.environ.get("ATTNKIT_PREBUILT") == "0":
        return "ATTNKIT_PREBUILT=0", False
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the prebuilt engine is built on x86-64 Linux (this is {sys.platform} {platform.machine()})", False
    try:
        import torch  # noqa: F401
    except ImportError:
        return "PyTorch is not importable in this build environment (the engine is compiled against it)", True
    if not any(shutil.which(c) for c in (os.environ.get("CXX") or "g++", "c++") if c):
        return "no C++ compiler ($CXX, g++ or c++) in this build environment", True
    return None, False


WHY_NOT, FATAL = _prebuild_why_not()
HOW = (
    "build with the standard isolated build (pip wheel ., python -m build: it installs the tested torch), or "
    "with --no-isolation beside torch and g++ (make wheel), or set ATTNKIT_PREBUILT=0 for a pure-Python wheel "
    "that compiles the engine at first use on the user's machine"
)


class BuildPy(build_py):
    """build_py, then the engine for every level into the build folder (not for editable installs)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        if WHY_NOT is not None and FATAL:
            raise SystemExit(f"attnkit: cannot build a wheel with its native engine: {WHY_NOT}. To fix: {HOW}.")
        if WHY_NOT is not None:
            print(f"attnkit: the wheel carries no prebuilt engine: {WHY_NOT}", file=sys.stderr)
            return
        sys.path.insert(0, str(ROOT / "src"))
        from attnkit.kernels.native import build, prebuilt, wheel

        compiler = build._compiler()
        folder = Path(self.build_lib) / "attnkit" / "kernels" / "native" / "engines"
        print(f"attnkit: compiling the native engine for {', '.join(x.name for x in prebuilt.LEVELS)}", file=sys.stderr)

        def say(text: str) -> None:
            print(f"attnkit: {text}", file=sys.stderr, flush=True)

        manifest = wheel.build_all(folder, build.VERSION, compiler=compiler, say=say)
        print(f"attnkit: built {sorted(manifest['builds'])} for torch {manifest['torch']}", file=sys.stderr)
        for name, err in manifest["not_built"].items():
            print(f"attnkit: {name} not built (the compiler said: {err})", file=sys.stderr)


class BdistWheel(bdist_wheel):
    """A platform wheel when it carries the engine (any Python 3: no Python C API)."""

    def get_tag(self) -> tuple[str, str, str]:
        python, abi, plat = super().get_tag()
        return (python, abi, plat) if WHY_NOT is not None else ("py3", "none", plat)


class Distribution(Distribution_):
    """Holds a compiled library when the engine is prebuilt: installed as platform code."""

    def has_ext_modules(self) -> bool:
        return WHY_NOT is None


setup(cmdclass={"build_py": BuildPy, "bdist_wheel": BdistWheel}, distclass=Distribution)
