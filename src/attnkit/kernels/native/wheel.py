"""The native engine built for a wheel: every x86-64 level of :mod:`~attnkit.kernels.native.prebuilt`
compiled into the wheel's ``engines/`` folder with its manifest (what ``setup.py`` runs; a build
machine's job, never a user's process)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from attnkit.kernels.native import build, store
from attnkit.kernels.native.prebuilt import LEVELS, LIBRARY, TORCH_RPATH, torch_key

__all__ = ["build_all"]


def build_all(
    folder: Path, interface: int, *, compiler: str, jobs: int | None = None, say: Callable[[str], None] | None = None
) -> dict:
    """Compile every level into ``folder/<level>/`` and write ``folder/manifest.json`` (what the
    wheel's build runs; levels the compiler cannot emit are left out). Returns the manifest.
    ``say(text)`` hears of each level as it starts and ends (a minute or more each)."""
    say = say or (lambda text: None)
    started = time.monotonic()
    folder.mkdir(parents=True, exist_ok=True)
    jobs = max(1, jobs or os.cpu_count() or 1)
    builds: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        pending = []
        for level in LEVELS:
            lib, obj = folder / level.name / LIBRARY, Path(tmp) / f"{level.name}.o"
            lib.parent.mkdir(exist_ok=True)
            pending.append((level, build.commands(compiler, lib, obj, list(level.compiler_flags), rpath=[TORCH_RPATH])))
        running: list = []
        failed: dict = {}
        while pending or running:
            while pending and len(running) < jobs:
                level, (compile_, link) = pending.pop(0)
                say(f"compiling the {level.name} build ({len(LEVELS) - len(pending)} of {len(LEVELS)})")
                running.append((level, link, subprocess.Popen(compile_, stderr=subprocess.PIPE, text=True)))
            level, link, proc = running.pop(0)
            err = proc.communicate()[1]
            if proc.returncode == 0:
                done = subprocess.run(link, capture_output=True, text=True)
                err, ok = done.stderr, done.returncode == 0
            else:
                ok = False
            if not ok:
                failed[level.name] = err.strip()[-500:] or f"exit status {proc.returncode}, no output"
                say(f"the {level.name} build failed: {failed[level.name].splitlines()[-1]}")
                continue
            say(f"built {level.name} ({time.monotonic() - started:.0f} s so far)")
            lib = folder / level.name / LIBRARY
            builds[level.name] = {"size": lib.stat().st_size, "sha256": store.digest(lib)}
    if not builds:
        raise RuntimeError(f"no level of the native engine could be built: {failed}")
    manifest = {**torch_key(), "interface": interface, "builds": builds, "not_built": failed}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest
