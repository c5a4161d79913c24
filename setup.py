"""The wheel carries the native CPU engine, compiled here once per x86-64 level.

Everything else about the package is in pyproject.toml. A wheel built where PyTorch is importable
(``python -m build --wheel --no-isolation``, ``pip install --no-build-isolation .``; ``make wheel``)
and a C++ compiler exists holds ``attnkit/kernels/native/engines/<level>/libattnkit_native.so``
for AVX2 (x86-64-v3), AVX-512 (x86-64-v4) and AVX-512 with AVX512-BF16, linked against that
PyTorch, with a manifest; the running CPU picks one at load (attnkit.kernels.native.prebuilt). It
is then a platform wheel (``py3-none-linux_x86_64``: the library is loaded by PyTorch, not by
Python's C API). Without PyTorch or a compiler at build time, or with ``ATTNKIT_PREBUILT=0``, the
wheel is pure Python and the engine is compiled at first use on the user's machine.
An editable install (``pip install -e .``) never prebuilds: it compiles at first use.
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


def _prebuild_why_not() -> str | None:
    """Why this build of the wheel carries no engine (None: it does)."""
    if os.environ.get("ATTNKIT_PREBUILT") == "0":
        return "ATTNKIT_PREBUILT=0"
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the prebuilt engine is built on x86-64 Linux (this is {sys.platform} {platform.machine()})"
    try:
        import torch  # noqa: F401
    except ImportError:
        return "PyTorch is not importable here (build with --no-isolation beside torch)"
    if not any(shutil.which(c) for c in (os.environ.get("CXX") or "g++", "c++") if c):
        return "no C++ compiler ($CXX, g++ or c++)"
    return None


WHY_NOT = _prebuild_why_not()


class BuildPy(build_py):
    """build_py, then the engine for every level into the build folder (not for editable installs)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        if WHY_NOT is not None:
            print(f"attnkit: the wheel carries no prebuilt engine: {WHY_NOT}", file=sys.stderr)
            return
        sys.path.insert(0, str(ROOT / "src"))
        from attnkit.kernels.native import build, prebuilt

        compiler = build._compiler()
        folder = Path(self.build_lib) / "attnkit" / "kernels" / "native" / "engines"
        print(f"attnkit: compiling the native engine for {', '.join(x.name for x in prebuilt.LEVELS)}", file=sys.stderr)
        manifest = prebuilt.build_all(folder, build.VERSION, compiler=compiler)
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
