"""The native engine as a wheel carries it: compiled when the wheel is built, once per x86-64
level, and one of them chosen at load from the running CPU (as PyTorch's own CPU kernels are
compiled per instruction set and dispatched by ``cpuinfo``).

The levels, best first: ``x86-64-v4-bf16`` (AVX-512 with AVX512-BF16 dot products; AMX tiles
through oneDNN where the CPU has them, decided at run time), ``x86-64-v4`` (AVX-512) and
``x86-64-v3`` (AVX2 and FMA). The wheel's ``engines/manifest.json`` names the PyTorch they were
linked against and each library's size and SHA-256; a library is loaded only when PyTorch's
release and C++ ABI match and the file matches its entry. ``ATTNKIT_NATIVE_ISA=<level>`` picks a
level (to test one build on a CPU that could run a better one); a level the CPU cannot run is
refused with its missing instructions, never loaded.

Where no level fits (another architecture, another PyTorch, an editable install, which carries
none), :mod:`attnkit.kernels.native.build` compiles the engine at first use where a compiler exists.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from attnkit.kernels.native import store

__all__ = ["FOLDER", "LEVELS", "LIBRARY", "TORCH_RPATH", "Choice", "Level", "choose", "cpu_flags", "torch_key"]

#: Where a wheel's library finds PyTorch's: site-packages/torch/lib, from
#: site-packages/attnkit/kernels/native/engines/<level>/ (never the build machine's own path).
TORCH_RPATH = "$ORIGIN/../../../../../torch/lib"
#: Where a wheel keeps its builds (absent from a source checkout and an editable install).
FOLDER = Path(__file__).with_name("engines")
LIBRARY = "libattnkit_native.so"


@dataclass(frozen=True)
class Level:
    """One build of the wheel: its name, its compiler flags and the CPU flags it needs (as
    ``/proc/cpuinfo`` names them; ``abm`` is LZCNT)."""

    name: str
    compiler_flags: tuple[str, ...]
    needs: frozenset[str]


_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

#: Best first: the first whose needs the CPU has is loaded.
LEVELS = (
    Level("x86-64-v4-bf16", ("-march=x86-64-v4", "-mavx512bf16"), _V4 | {"avx512_bf16"}),
    Level("x86-64-v4", ("-march=x86-64-v4",), _V4),
    Level("x86-64-v3", ("-march=x86-64-v3",), _V3),
)


def cpu_flags() -> frozenset[str]:
    """The running CPU's flags, as Linux names them (empty off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def torch_key() -> dict:
    """What a prebuilt library must share with the running PyTorch: its release (without the
    local ``+cpu``/``+cu…`` part: the CPU operators' ABI is the same) and its C++ ABI flag."""
    return {"torch": torch.__version__.split("+")[0], "cxx11_abi": int(torch._C._GLIBCXX_USE_CXX11_ABI)}


@dataclass(frozen=True)
class Choice:
    """The build to load (``library``, ``level``), or why none: ``refused`` when none may run at
    all (an ``ATTNKIT_NATIVE_ISA`` this CPU cannot run), else the engine is compiled at first use."""

    library: Path | None
    level: str
    why: str
    refused: bool = False


def _manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def choose(
    interface: int, *, folder: Path = FOLDER, flags: frozenset[str] | None = None, wanted: str | None = None
) -> Choice:
    """The wheel's build for this CPU and PyTorch (see the module's docstring). ``wanted`` defaults
    to ``$ATTNKIT_NATIVE_ISA``."""
    if wanted is None:
        wanted = os.environ.get("ATTNKIT_NATIVE_ISA") or None
    names = [level.name for level in LEVELS]
    if wanted is not None and wanted not in names:
        return Choice(None, "", f"ATTNKIT_NATIVE_ISA={wanted} is not one of {', '.join(names)}", refused=True)
    manifest = _manifest(folder)
    if manifest is None:
        return Choice(None, "", "this install carries no prebuilt engine (a source checkout or an editable install)")
    if platform.machine() not in ("x86_64", "AMD64"):
        return Choice(None, "", f"the prebuilt engine is for x86-64; this machine is {platform.machine()}")
    want = {k: manifest.get(k) for k in torch_key()}
    if want != torch_key() or manifest.get("interface") != interface:
        return Choice(
            None,
            "",
            f"the wheel's engine was built for torch {want['torch']} (C++ ABI {want['cxx11_abi']}, interface "
            f"{manifest.get('interface')}) and this is torch {torch.__version__} (C++ ABI {torch_key()['cxx11_abi']}, "
            f"interface {interface}): it is not loaded; the engine is compiled for this torch at first use where "
            "a C++ compiler exists, else the PyTorch kernels run",
        )
    flags = cpu_flags() if flags is None else flags
    builds = manifest.get("builds", {})
    for level in LEVELS:
        if wanted is not None and level.name != wanted:
            continue
        missing = sorted(level.needs - flags)
        if level.name not in builds:
            if wanted is not None:
                return Choice(None, wanted, f"ATTNKIT_NATIVE_ISA={wanted}: the wheel has no such build", refused=True)
            continue
        if missing:
            if wanted is not None:
                return Choice(
                    None, wanted, f"ATTNKIT_NATIVE_ISA={wanted}: this CPU lacks {', '.join(missing)}", refused=True
                )
            continue
        entry = builds[level.name]
        library = folder / level.name / LIBRARY
        why = _mismatch(library, entry)
        if why is not None:
            return Choice(None, level.name, f"the wheel's {level.name} build cannot be loaded: {why}")
        how = "chosen by ATTNKIT_NATIVE_ISA" if wanted else "chosen for this CPU"
        return Choice(library, level.name, f"the wheel's {level.name} build ({how}; torch {want['torch']})")
    return Choice(None, "", "this CPU runs none of the wheel's builds (x86-64-v3, AVX2, at least)")


def _mismatch(library: Path, entry: dict) -> str | None:
    try:
        st = library.stat()
    except OSError:
        return f"{library} is missing"
    if st.st_mode & 0o002:
        return f"{library} is writable by anyone"
    if st.st_size != entry.get("size") or store.digest(library) != entry.get("sha256"):
        return f"{library} does not match the wheel's manifest (size or SHA-256)"
    return None
