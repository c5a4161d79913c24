"""`make wheel`'s checks of the installed wheel, run with the wheel's venv's Python, outside the repository.

1. On a PATH without any C++ compiler: the first attention call loads the wheel's engine for this
   CPU (nothing is compiled: the build cache is never made), ``attnkit.explain`` names the native
   engine and the build, and the first call's time is printed.
2. The native engine's tests (tests/kernels/test_native.py, test_nan.py, tests/test_predicate_programs.py)
   on each of the wheel's builds this CPU can run, chosen with ATTNKIT_NATIVE_ISA, still without a compiler.

Usage: venv/bin/python scripts/check_wheel.py [--tests]
       python scripts/check_wheel.py --contents WHEEL   (what a wheel file holds: make wheel-standard)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

FIRST_CALL = """
    import json, os, time
    import torch
    import attnkit
    from attnkit import masks
    from attnkit.kernels.native import build as native_build
    assert "site-packages" in attnkit.__file__, attnkit.__file__
    q = torch.randn(1, 4, 1024, 64)
    mask = masks.document(torch.arange(1024) // 256) & masks.causal()
    started = time.perf_counter()
    out = attnkit.attention(q, q, q, mask)
    first = time.perf_counter() - started
    gold = attnkit.attention(q.double(), q.double(), q.double(), mask, kernel="reference")
    print(json.dumps({"first_call_s": first, "explain": str(attnkit.explain(q, q, q, mask)),
                      "build": native_build.build_name(), "status": native_build.status(),
                      "err": float((out.double() - gold).abs().max())}))
"""


def _env(cache: Path, **extra: str) -> dict:
    """This Python's folder only on PATH (no g++, cc or c++), no $CXX, a cache folder of its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "CC", "ATTNKIT_NATIVE_ARCH")}
    env.update(PATH=str(Path(sys.executable).parent), ATTNKIT_CACHE=str(cache), ATTNKIT_NATIVE="1", **extra)
    return env


def _no_compiler(env: dict) -> None:
    import shutil

    for name in ("g++", "c++", "cc", "gcc", "clang++"):
        assert shutil.which(name, path=env["PATH"]) is None, f"{name} is on the checked PATH"


def first_call(workdir: Path) -> None:
    cache = workdir / "cache"
    env = _env(cache)
    _no_compiler(env)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(FIRST_CALL)], env=env, cwd=workdir, text=True,
                          capture_output=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["status"][0], f"the wheel's engine did not load: {got['status'][1]}"
    assert got["explain"].startswith("native:") and "the wheel's" in got["explain"], got["explain"]
    assert "compiling" not in done.stderr, done.stderr  # nothing compiled at first use
    assert not cache.exists(), f"the build cache {cache} was made: something was compiled or looked up"
    assert got["err"] < 1e-5, got
    print(f"wheel, no compiler on PATH: first call {got['first_call_s']:.3f} s; {got['explain']}")


def native_tests(workdir: Path) -> None:
    sys.path.insert(0, str(Path(sys.executable).parent.parent))
    from attnkit.kernels.native import prebuilt

    flags = prebuilt.cpu_flags()
    for level in ("x86-64-v3", "x86-64-v4"):
        needs = next(x.needs for x in prebuilt.LEVELS if x.name == level)
        if not needs <= flags:
            print(f"{level}: this CPU cannot run it (lacks {', '.join(sorted(needs - flags))}); not tested here")
            continue
        env = _env(workdir / f"cache-{level}", ATTNKIT_NATIVE_ISA=level, ATTNKIT_REQUIRE_NATIVE="1")
        _no_compiler(env)
        which = "from attnkit.kernels.native import build as b; print(b.build_name()); print(b.info())"
        done = subprocess.run([sys.executable, "-c", which], env=env, cwd=workdir, text=True, capture_output=True)
        name, info = (done.stdout.splitlines() + ["", ""])[:2]
        width = {"x86-64-v3": "AVX2 (8 floats", "x86-64-v4": "AVX-512 (16 floats"}[level]
        assert f"the wheel's {level} build" in name and info.startswith(width), (name, info, done.stderr[-2000:])
        assert "widened to float32" in info  # neither has AVX512-BF16: bfloat16 on widened tiles
        tests = [str(REPO / "tests" / "kernels" / name) for name in ("test_native.py", "test_nan.py")]
        tests.append(str(REPO / "tests" / "test_predicate_programs.py"))  # int32 and int64 lanes, bits packed
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-x",
            "-n",
            "2",
            "--dist",
            "worksteal",
            *tests,
        ]
        print(f"{level}: {' '.join(cmd[3:])}", flush=True)
        done = subprocess.run(cmd, env=env, cwd=workdir, timeout=3600)
        assert done.returncode == 0, f"the native tests failed on the wheel's {level} build"


def contents(wheel: Path) -> None:
    """The wheel holds the engine: its manifest (for the torch it was built against) and every level's
    library, and is tagged for a platform (not py3-none-any)."""
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    folder = "attnkit/kernels/native/engines"
    manifest = json.loads(zipfile.ZipFile(wheel).read(f"{folder}/manifest.json"))
    missing = [f"{folder}/{level}/libattnkit_native.so" for level in manifest["builds"]]
    missing = [name for name in missing if name not in names]
    assert not missing and len(manifest["builds"]) == 3, (missing, manifest)
    assert "-none-any" not in wheel.name, wheel.name
    print(f"{wheel.name}: the engine for torch {manifest['torch']}, builds {sorted(manifest['builds'])}")


if __name__ == "__main__":
    if "--contents" in sys.argv:
        contents(Path(sys.argv[sys.argv.index("--contents") + 1]))
        sys.exit(0)
    with tempfile.TemporaryDirectory() as tmp:
        first_call(Path(tmp))
        if "--tests" in sys.argv:
            native_tests(Path(tmp))
