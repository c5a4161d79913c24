"""What a benchmark ran on, for its JSON: ``lscpu``'s model and flags, the matrix and vector
units attnkit's native engine can use there, PyTorch's version and threads."""

from __future__ import annotations

import platform
import subprocess

import torch

#: lscpu flags that decide the engine's paths (and PyTorch's own CPU kernels).
UNITS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")


def describe() -> dict:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    pairs = (line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in pairs}
    flags = fields.get("Flags", "").split()
    return {
        "model": fields.get("Model name", platform.processor() or platform.machine()),
        "units": [unit for unit in UNITS if unit in flags],
        "flags": " ".join(flags),
        "engine": _engine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def _engine() -> str:
    """The native engine's build (what it computes with), or why there is none; "-" for a tree
    of attnkit before the engine had ``native_build`` (benchmarks/compare.py runs old trees)."""
    try:
        from attnkit.kernels.native import build as native_build
    except ImportError:
        return "-"
    ok, why = native_build.status()
    return native_build.info() if ok else why
