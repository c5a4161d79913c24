"""Fixtures of the whole suite (the shared helpers are in _oracle.py)."""

from __future__ import annotations

import os
import zlib

# Triton kernels run in Triton's interpreter, on CPU tensors, in this suite (set before
# Triton decorates attnkit's kernels, at import).
os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):  # make test's workers (pytest-xdist) share the cores: one thread each
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """A different seed per test, the same on every run."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _fresh_runners():
    """A test that turned a kernel off (pin_engine) leaves no runner of it behind."""
    yield
    from attnkit.kernels import fastpath

    fastpath.LEAN.clear()
    fastpath.LEAN_ANY_LENGTH.clear()
