"""attnkit's build backend: setuptools', with PyTorch in the build environment of a wheel.

A wheel of attnkit carries its native CPU engine compiled against PyTorch (setup.py). A standard
build (``pip wheel .``, ``pip install .``, ``python -m build``) runs in an isolated environment
that holds only what the backend asks for: setuptools alone gave a wheel without the engine,
silently. This backend asks for the PyTorch release attnkit is tested with (the ``torch==`` line of
constraints.txt; ``ATTNKIT_BUILD_TORCH`` names another requirement) for wheels only: an editable
install (``pip install -e .``, what ``make demo`` does) compiles the engine at first use and needs
no PyTorch to build, nor does an sdist.
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  (every hook of setuptools' backend)

_ROOT = Path(__file__).resolve().parents[1]


def torch_requirement() -> str:
    """The PyTorch a wheel is built against: ``$ATTNKIT_BUILD_TORCH``, else constraints.txt's pin."""
    wanted = os.environ.get("ATTNKIT_BUILD_TORCH")
    if wanted:
        return wanted
    for line in (_ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        if line.strip().startswith("torch=="):
            return line.split("#")[0].strip()
    raise RuntimeError("constraints.txt pins no torch== release for the wheel's engine")


def get_requires_for_build_wheel(config_settings=None):
    # numpy: attnkit's modules the build imports to compile the engine (attnkit.kernels.native) need it
    return [*_setuptools.get_requires_for_build_wheel(config_settings), torch_requirement(), "numpy>=1.23"]
