"""Building and loading attnkit's native CPU engine (``csrc/``): PyTorch operators in C++.

A wheel of attnkit carries the engine built for the PyTorch it was built against, once per
x86-64 level, and the build for the running CPU is loaded at the first call that uses the engine
(:mod:`attnkit.kernels.native.prebuilt`; no compiler needed). Otherwise (a source checkout,
another PyTorch or architecture) the source is compiled once per machine, at the first call
that would use the engine (never at import; progress on stderr), with the C++ compiler found on
the machine (``$CXX``, else ``g++`` or ``c++``) against the PyTorch that is running, with the
include and library paths and ABI flag of :mod:`torch.utils.cpp_extension`: ``-O3
-march=native``, OpenMP through PyTorch's own runtime (it shares PyTorch's threads and follows
``torch.set_num_threads``). :func:`build_name` says which build runs. The library registers three operators,
``torch.ops.attnkit.native_forward``, ``native_backward`` and ``native_stats`` (the statistics of
:func:`attnkit.inspect.attention_stats`), whose fake (meta) and autograd implementations are
registered here: the forward is differentiable, runs
under ``torch.inference_mode()`` and is traced by ``torch.compile`` as one op
(``torch.library.opcheck`` passes on it).

Builds are kept in ``$ATTNKIT_CACHE`` (default ``~/.cache/attnkit``), private to the user
(:mod:`attnkit.kernels.native.store`: a cache others can write to is refused), under a key of the source,
the compiler, PyTorch, the CPU and the flags, each beside a manifest of its size, SHA-256 and
interface version. A library is loaded only when it matches its manifest: a truncated, empty,
replaced or older build is rebuilt once (under the build lock), and where that fails too the
warning says what was found. ``ATTNKIT_NATIVE_ARCH`` replaces ``native`` in ``-march=``
(``-mcpu=`` off x86), e.g. ``x86-64-v3`` for a build that runs on any AVX2 machine;
``ATTNKIT_NATIVE_SANITIZE=address,undefined`` builds with those sanitizers at ``-O1`` (for tests
run with the sanitizer's runtime preloaded; the sanitizers' usual level, half the compile time
of ``-O3``, the same intrinsics).

Where there is neither a build for this CPU nor a compiler, the build fails, or
``ATTNKIT_NATIVE=0`` is set, :func:`status` says why (one warning, with what to install, where
it was wanted) and the kernel registry runs the other CPU kernels (``attnkit.explain`` says so).
Softmax statistics and sums are float32; bfloat16/float16 inputs are read one tile at a time.
bfloat16's products take the CPU's matrix units where it has them: on AMX-BF16 machines the
forward's Q K^T and P V (and the backward's recomputed scores) are PyTorch's batch-reduce GEMM on
AMX tiles (``at::native::cpublas::brgemm``, oneDNN), on AVX512-BF16 ones bfloat16 dot products
(``vdpbf16ps``), elsewhere float32 on widened tiles; :func:`info` says which this process takes.
``ATTNKIT_NATIVE_AMX=0`` keeps the dot products on an AMX machine (to test or compare them).
float64 runs elsewhere.

Equivalent PyTorch code (forward)::

    s = (q @ k.transpose(-2, -1)) * scale          # (B, Hq, Lq, Lk), K/V heads repeated for GQA
    s = softcap * torch.tanh(s / softcap)          # when softcap is given
    s = s + bias                                   # a bias of kv - q only (Bias.band)
    s = s.masked_fill(~prepared.materialize(), float("-inf"))
    lse = s.logsumexp(-1)                          # -inf where a query sees no key
    out = torch.softmax(s, -1).nan_to_num(0) @ v
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

from attnkit._validate import traced_as_constant
from attnkit.kernels.native import prebuilt, store
from attnkit.kernels.native.store import cache_dir

__all__ = [
    "ENABLED",
    "SOURCES",
    "VERSION",
    "NO_COMPILER",
    "UntrustedCache",
    "available",
    "build",
    "build_name",
    "cache_dir",
    "check_library",
    "commands",
    "constants",
    "describe",
    "info",
    "library_path",
    "loaded_state",
    "status",
    "tried",
]

#: The engine's C++ sources: one translation unit (``ops.cpp``) and its stage headers.
SOURCE_DIR = Path(__file__).with_name("csrc")
SOURCE = SOURCE_DIR / "ops.cpp"
#: The interface version of the operators this module speaks to (``native_interface()`` in ops.cpp).
VERSION = 11
#: Whether the engine may be used at all: ``ATTNKIT_NATIVE=0`` turns it off for the process
#: (the other CPU kernels run instead), read once at import.
ENABLED = os.environ.get("ATTNKIT_NATIVE", "1") != "0"


def sources() -> list[Path]:
    """The C++ files of the engine, in a stable order."""
    return sorted(SOURCE_DIR.glob("*.[ch]*"))


SOURCES = sources()


# --- building -------------------------------------------------------------------------------


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _openmp() -> bool:
    """Whether PyTorch's at::parallel_for is OpenMP (its code is then compiled into the caller)."""
    return "parallel backend: OpenMP" in torch._C._parallel_info()


def _cpu_key() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _arch() -> str:
    return os.environ.get("ATTNKIT_NATIVE_ARCH", "native")


def _arch_flags() -> list[str]:
    x86 = platform.machine() in ("x86_64", "AMD64", "i686")
    return [f"-march={_arch()}"] if x86 else [f"-mcpu={_arch()}"]


def _sanitize() -> list[str]:
    wanted = os.environ.get("ATTNKIT_NATIVE_SANITIZE", "")
    if not wanted:
        return []
    return [f"-fsanitize={wanted}", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g"]


def commands(
    compiler: str, out: Path, obj: Path, arch: list[str] | None = None, rpath: list[str] | None = None
) -> list[list[str]]:
    """The compile and link commands (torch.utils.cpp_extension's paths and ABI flag); ``arch``:
    the instruction-set flags (default ``-march=$ATTNKIT_NATIVE_ARCH``, ``native``); ``rpath``: where
    the library finds PyTorch's (default: this PyTorch's folder; a wheel's builds say where torch
    lies relative to them)."""
    from torch.utils import cpp_extension

    openmp = _openmp()
    sanitize = _sanitize()
    compile_ = [
        compiler,
        "-c",
        "-O1" if sanitize else "-O3",  # a sanitized build is for tests: -O1, half the compile time
        *(_arch_flags() if arch is None else arch),
        "-std=c++20",
        "-fPIC",
        "-ffp-contract=fast",  # a * b + c as one fused multiply-add
        "-fno-math-errno",
        "-fno-trapping-math",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        *(["-fopenmp"] if openmp else []),
        *sanitize,
        f"-I{SOURCE_DIR}",
        str(SOURCE),
        "-o",
        str(obj),
    ]
    lib_dirs = cpp_extension.library_paths()
    link = [compiler, "-shared", str(obj), "-o", str(out), *sanitize]
    link += [f"-L{d}" for d in lib_dirs] + ["-ltorch_cpu", "-lc10"]
    link += [f"-Wl,-rpath,{d}" for d in (lib_dirs if rpath is None else rpath)]
    if openmp:  # PyTorch's own OpenMP runtime when it ships one (one thread pool), else the compiler's
        lib = Path(lib_dirs[0])
        bundled = sorted(lib.glob("libgomp*.so*")) + sorted(lib.glob("libiomp*.so*"))
        link += [str(bundled[0])] if bundled else ["-fopenmp"]
    return [compile_, link]


def _library_path(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256()
    parts = [p.name.encode() + b"\0" + p.read_bytes() for p in sources()]
    for part in (*parts, version.encode(), torch.__version__.encode(), torch.__file__.encode()):
        key.update(part)
        key.update(b"\0")
    for text in (_cpu_key(), _arch(), " ".join(_sanitize())):
        key.update(text.encode())
        key.update(b"\0")
    return cache_dir() / f"native-{key.hexdigest()[:20]}" / "libattnkit_native.so"


def check_library(library: Path) -> str | None:
    """Why the cached ``library`` cannot be loaded (None: it can): it must exist and match its
    manifest (interface version, size, SHA-256), so a truncated, empty, replaced or older build is
    found before it is mapped into the process."""
    return store.check_library(library, VERSION)


class UntrustedCache(RuntimeError):
    """The build cache is not private to this user (:func:`attnkit.kernels.native.store.distrust`)."""


def _trust(target: Path) -> None:
    """Refuse a cache that others could have written to, before anything in it is read or loaded."""
    root = cache_dir()
    why = store.distrust(root, target.parent, target, store.manifest_of(target), target.parent / "build.lock")
    if why is not None:
        raise UntrustedCache(store.refusal(why, root))


def _say(text: str) -> None:
    """Progress of a build at first use, on stderr (it takes tens of seconds, once per machine)."""
    print(f"attnkit: {text}", file=sys.stderr, flush=True)


def _run(cmd: list[str], started: float) -> subprocess.CompletedProcess:
    """One compiler command, saying every 15 seconds that it is still running."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        while True:
            try:
                out, err = proc.communicate(timeout=15)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() - started > 900:
                    proc.kill()
                    raise RuntimeError(
                        f"building attnkit's native engine took over 15 minutes: {' '.join(cmd)}"
                    ) from None
                _say(f"  ... still compiling ({time.monotonic() - started:.0f} s)")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _compile(compiler: str, target: Path) -> None:
    started = time.monotonic()
    _say(
        f"compiling the native CPU engine for this machine with {compiler} (once; tens of seconds; "
        f"kept in {target.parent})"
    )
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "native.o", Path(tmp) / target.name
        for cmd in commands(compiler, lib, obj):
            done = _run(cmd, started)
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip()[-2000:]
                last = tail.splitlines()[-1] if tail else "it printed nothing"
                raise RuntimeError(
                    f"building attnkit's native engine failed ({Path(cmd[0]).name} exited with status "
                    f"{done.returncode}: {last})\n$ {' '.join(cmd)}\n{tail}"
                )
        if not lib.exists() or lib.stat().st_size == 0:
            raise RuntimeError(f"building attnkit's native engine wrote no library ({' '.join(cmd)})")
        manifest = {
            "interface": VERSION,
            "size": lib.stat().st_size,
            "sha256": store.digest(lib),
            "torch": torch.__version__,
        }
        store.manifest_of(lib).write_text(json.dumps(manifest))
        store.private_file(store.manifest_of(lib))
        store.private_file(lib, executable=True)
        os.replace(store.manifest_of(lib), store.manifest_of(target))  # the manifest first: a reader of the
        os.replace(lib, target)  # new library finds it; a reader in between sees a mismatch and waits on the lock
    _say(f"native engine built in {time.monotonic() - started:.0f} s")


def build(force: bool = False) -> Path:
    """Compile the engine for this machine (once: a cached build that matches its manifest is
    reused; a damaged one is rebuilt) and return its path. The cache must be private to this user
    (:class:`UntrustedCache` otherwise: nothing in it is read).

    Raises ``RuntimeError`` with the compiler's message when it cannot be built.
    """
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError(NO_COMPILER)
    target = _library_path(compiler)
    _trust(target)
    if not force and check_library(target) is None:
        return target
    store.private_dir(target.parent, cache_dir())
    _trust(target)
    with store.file_lock(target.parent / "build.lock"):
        found = check_library(target)
        if found is None and not force:  # another process built it meanwhile
            return target
        try:
            _compile(compiler, target)
        except RuntimeError as err:
            if found is not None and found != "not built yet":  # say what was found in the cache, then why
                raise RuntimeError(f"{err}\n(it was being rebuilt because {found})") from None
            raise
        after = check_library(target)
        if after is not None:
            raise RuntimeError(f"attnkit's native engine was rebuilt but cannot be trusted: {after}")
    return target


NO_COMPILER = "no C++ compiler found ($CXX, g++ or c++): install one, e.g. apt-get install g++"


# --- loading ----------------------------------------------------------------------------------


class _Loaded:
    """The operators once loaded, what the build computes with and which build it is; or why there are none."""

    def __init__(self, ok: bool, why: str, info: str = "", build: str = ""):
        self.ok, self.why, self.info, self.build = ok, why, info, build


_loaded: _Loaded | None = None
_lock = threading.Lock()


def _ops_defined() -> bool:
    return hasattr(torch.ops.attnkit, "native_forward") and hasattr(torch.ops.attnkit, "native_interface")


def library_path() -> Path:
    """Where :func:`build` keeps the library for this machine, compiler, PyTorch and flags."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError(NO_COMPILER)
    return _library_path(compiler)


@traced_as_constant
def loaded_state() -> tuple[bool, str] | None:
    """``status()`` without building or loading: None while nothing was tried in this process."""
    if not ENABLED:
        return False, "native engine turned off by ATTNKIT_NATIVE=0"
    return None if _loaded is None else (_loaded.ok, _loaded.why)


@traced_as_constant
def tried() -> bool:
    """Whether this process has loaded the engine or found why it cannot (part of the registry's
    state: a choice made before the first load is made again after it)."""
    return _loaded is not None


@traced_as_constant
def refusal_while_tracing() -> str:
    """Why the engine cannot run, '' where it can: what code traced by ``torch.compile`` asks. Run
    once at trace time, eagerly (it may build and load the engine then; it is never built at import),
    its answer a constant of the graph."""
    ok, why = status()
    return "" if ok else why


def _load_library(path: Path) -> str:
    """Load the library and check the operators it registers; returns its info string."""
    torch.ops.load_library(str(path))
    if not _ops_defined():
        raise RuntimeError(f"{path} loaded but defines none of attnkit's operators; delete {path.parent} to rebuild it")
    interface = torch.ops.attnkit.native_interface()
    if interface != VERSION:
        raise RuntimeError(f"{path} defines interface {interface}; this attnkit speaks {VERSION}")
    _register_python_parts()
    return torch.ops.attnkit.native_info()


def constants() -> dict:
    """The engine's own sizes Python decides with, read from the loaded library once
    (``native_constants()``): ``FEW_ROWS`` (calls of at most this many queries take its row path),
    ``ROWS`` (query rows computed together; its block of queries is a multiple of this)."""
    found = _CONSTANTS.get("value")
    if found is None:
        _require_loaded()
        found = _CONSTANTS["value"] = json.loads(torch.ops.attnkit.native_constants())
    return found


_CONSTANTS: dict = {}


def _require_loaded() -> None:
    ok, why = status()
    if not ok:
        raise RuntimeError(f"attnkit's native engine cannot run here: {why}")


def _warn(text: str) -> None:
    warnings.warn(f"attnkit's native CPU engine is off; the PyTorch kernels run instead.\n{text}", RuntimeWarning, 4)


def _load_prebuilt(choice: prebuilt.Choice) -> _Loaded | None:
    assert choice.library is not None
    try:
        return _Loaded(True, "the native C++ engine", _load_library(choice.library), choice.why)
    except (OSError, RuntimeError) as err:
        _warn(f"{choice.why} did not load ({err}); compiling one for this machine where a compiler exists")
        return None


def _load_built(after: str) -> _Loaded:
    try:
        path = build()
        arch = " ".join(_arch_flags())
        return _Loaded(True, "the native C++ engine", _load_library(path), f"built on this machine ({arch})")
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        text = str(err)
        if text == NO_COMPILER and after:
            text = (
                f"no C++ compiler found ($CXX, g++ or c++), and {after}: install a compiler (e.g. "
                f"apt-get install g++) or a wheel of attnkit built for torch {prebuilt.torch_key()['torch']}"
            )
        _warn(text)
        return _Loaded(False, f"native engine unavailable: {text}".split("\n")[0])


def _load() -> _Loaded:
    """The engine for this process: the wheel's build for this CPU where there is one, else one
    compiled here (at the first call that would use it, never at import)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        explicit = "ATTNKIT_NATIVE_ARCH" in os.environ or _sanitize()  # a build asked for by name
        choice = None if explicit else prebuilt.choose(VERSION)
        found = None
        if choice is not None and choice.refused:
            _warn(choice.why)
            found = _Loaded(False, f"native engine unavailable: {choice.why}")
        elif choice is not None and choice.library is not None:
            found = _load_prebuilt(choice)
        _loaded = found or _load_built("" if choice is None else choice.why)
    return _loaded


@traced_as_constant
def status() -> tuple[bool, str]:
    """``(available, why)``: whether the engine can run here, and in words why not (the wheel's
    build for this CPU is loaded on the first call that uses it; without one, it is compiled then,
    once per machine, which takes tens of seconds)."""
    if not ENABLED:
        return False, "native engine turned off by ATTNKIT_NATIVE=0"
    loaded = _load()
    return loaded.ok, loaded.why


@traced_as_constant
def available() -> bool:
    """Whether the engine can run here (see :func:`status`)."""
    return ENABLED and _load().ok


@traced_as_constant
def info() -> str:
    """What the build computes with, e.g. ``"AVX-512 (16 floats a vector); bfloat16: AMX tiles
    (oneDNN brgemm)"`` or ``"...; bfloat16: AVX512-BF16 dot products"`` ('' where the engine is not
    available)."""
    return _load().info if available() else ""


@traced_as_constant
def build_name() -> str:
    """Which build runs: ``"the wheel's x86-64-v4-bf16 build (chosen for this CPU; torch 2.13.0)"``
    or ``"built on this machine (-march=native)"`` ('' where the engine is not available)."""
    return _load().build if available() else ""


def describe(half: bool) -> str:
    """The build and its vector width in a few words, for ``attnkit.explain``: bfloat16's products
    named only for ``half`` inputs."""
    what = info() if half else info().split("; bfloat16")[0]
    return f"{what}, {build_name()}"


# --- the operators' fake and autograd implementations -------------------------------------------

_registered = [False]


def _register_python_parts() -> None:
    """Fake (meta) shapes of the operators and the autograd formula of the forward (once)."""
    if _registered[0]:
        return
    _registered[0] = True

    @torch.library.register_fake("attnkit::native_forward")
    def _(q, k, v, kv_num, kv_indices, tile_ids, bits, kv_limit, band, block_q, block_k, scale, softcap):
        b, hq, lq, _ = q.shape
        return q.new_empty(b, hq, lq, v.shape[-1]), q.new_empty(b, hq, lq, dtype=torch.float32)

    @torch.library.register_fake("attnkit::native_backward")
    def _(grad_out, grad_lse, q, k, v, out, lse, kv_num, kv_indices, tile_ids, bits, kv_limit, band, *scalars):
        band_grad = scalars[-1]
        dband = q.new_empty(band.shape if band_grad else (0,), dtype=torch.float32)
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dband

    @torch.library.register_fake("attnkit::native_stats")
    def _(q, k, kv_num, kv_indices, tile_ids, bits, kv_limit, band, sinks, qpos, kpos, *scalars):
        b, hq, lq, _ = q.shape
        topk = scalars[-1]
        rows = [q.new_empty(b, hq, lq, dtype=torch.float32) for _ in range(3)]
        argmax = q.new_empty(b, hq, lq, dtype=torch.int64)
        more = [q.new_empty(b, hq, lq, dtype=torch.float32) for _ in range(2)]
        received = q.new_empty(b, hq, k.shape[2], dtype=torch.float32)
        top = [q.new_empty(b, hq, lq, topk, dtype=torch.float32), q.new_empty(b, hq, lq, topk, dtype=torch.int64)]
        return [*rows, argmax, *more, received, *top]

    @torch.library.register_fake("attnkit::native_predicate")
    def _(program, inputs, tables, shape, mode):
        t, x, y = shape
        if mode == 0:
            return program.new_empty(t, x, y, dtype=torch.bool)
        return (
            program.new_empty(t, x, -(-y // 8), dtype=torch.uint8)
            if mode == 1
            else program.new_empty(t, dtype=torch.uint8)
        )

    def setup_context(ctx, inputs, output):
        q, k, v, kv_num, kv_indices, tile_ids, bits, kv_limit, band, block_q, block_k, scale, softcap = inputs
        ctx.save_for_backward(q, k, v, *output, kv_num, kv_indices, tile_ids, bits, kv_limit, band)
        ctx.scalars = (block_q, block_k, scale, softcap)

    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, *plan = ctx.saved_tensors
        band_grad = bool(ctx.needs_input_grad[8])  # a learned bias of kv - q (ALiBi slopes, T5's table)
        dq, dk, dv, dband = torch.ops.attnkit.native_backward(
            grad_out, grad_lse, q, k, v, out, lse, *plan, *ctx.scalars, False, band_grad
        )
        return dq, dk, dv, None, None, None, None, None, dband if band_grad else None, None, None, None, None

    torch.library.register_autograd("attnkit::native_forward", backward, setup_context=setup_context)
