"""The native engine of the tiled kernel: block-sparse flash attention in C++ (``native.cpp``).

The source ships with attnkit and is compiled once per machine, at its first use, with the
C++ compiler found on the machine (``$CXX``, ``g++``, ``c++`` or ``clang++``) against the
PyTorch that is running: ``-O3 -march=native``, OpenMP through PyTorch's own runtime, so it
shares PyTorch's threads and follows ``torch.set_num_threads``. The library is kept in
``$ATTNKIT_CACHE`` (default ``~/.cache/attnkit``) under a key of the source, the compiler,
PyTorch and the CPU, and is called through :mod:`ctypes` with raw pointers: no Python
extension module, no pybind11, nothing compiled per mask or shape. ``ATTNKIT_NATIVE_ARCH``
replaces ``native`` in ``-march=`` (``-mcpu=`` off x86), e.g. ``x86-64-v3`` for a build that
runs on any AVX2 machine.

Where there is no compiler, the build fails, or ``ATTNKIT_NATIVE=0`` is set, :func:`status`
says why and the tiled kernel runs its PyTorch engines instead (``attnkit.explain`` shows
which engine runs). The engine computes in float32: bfloat16 and float16 inputs are widened
on the way in and the outputs rounded back; float64 stays on the math engine.

Equivalent PyTorch code (forward)::

    s = (q @ k.transpose(-2, -1)) * scale          # (B, Hq, Lq, Lk), K/V heads repeated for GQA
    s = softcap * torch.tanh(s / softcap)          # when softcap is given
    s = s + bias                                   # a bias of kv - q only (Bias.band)
    s = s.masked_fill(~prepared.materialize(), float("-inf"))
    lse = s.logsumexp(-1)                          # -inf where a query sees no key
    out = torch.softmax(s, -1).nan_to_num(0) @ v
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from attnkit.kernels import _aten

if TYPE_CHECKING:
    from attnkit.prepare import PreparedMask

__all__ = ["ENABLED", "SOURCE", "available", "backward", "build", "forward", "status"]

SOURCE = Path(__file__).with_name("native.cpp")
#: The interface version of the source this module speaks to (``attnkit_native_version()``).
VERSION = 4
#: Whether the engine may be used at all: ``ATTNKIT_NATIVE=0`` turns it off for the process
#: (the tiled kernel then runs its PyTorch engines); tests set this attribute.
ENABLED = os.environ.get("ATTNKIT_NATIVE", "1") != "0"

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_STRIDES = _I64 * 3


class _Args(ctypes.Structure):
    """The C struct ``AttnArgs`` of native.cpp, field for field."""

    _fields_ = [
        *((name, _I64) for name in ("B", "Hq", "Hkv", "Lq", "Lk", "D", "Dv")),
        ("q", _PTR),
        ("k", _PTR),
        ("v", _PTR),
        ("qs", _STRIDES),
        ("ks", _STRIDES),
        ("vs", _STRIDES),
        *((name, _I64) for name in ("Bm", "Hm", "nq", "nk", "bq", "bk")),
        ("kv_num", _PTR),
        ("kv_idx", _PTR),
        ("tile_ids", _PTR),
        ("bits_t", _PTR),
        ("kv_limit", _PTR),
        ("Bl", _I64),
        ("scale", _F32),
        ("softcap", _F32),
        ("band_rev", _PTR),
        ("band_heads", _I64),
        ("out", _PTR),
        ("os", _STRIDES),
        ("lse", _PTR),
        ("grad_out", _PTR),
        ("gs", _STRIDES),
        ("fwd_out", _PTR),
        ("ofs", _STRIDES),
        ("grad_lse", _PTR),
        ("dq", _PTR),
        ("dk_acc", _PTR),
        ("dv_acc", _PTR),
        ("chunks", _I64),
        ("Dp", _I64),
        ("Dvp", _I64),
        ("delta_from_out", _I64),
    ]


# --- building and loading -------------------------------------------------------------------


class _Loaded:
    """The library once loaded, with the sizes it pads for; or why there is none."""

    def __init__(self, lib: ctypes.CDLL | None, why: str):
        self.lib, self.why = lib, why
        self.rows = lib.attnkit_native_rows() if lib is not None else 0  # query rows per step (SB)
        self.width = lib.attnkit_native_width() if lib is not None else 0  # floats per vector (W)


_loaded: _Loaded | None = None
_lock = threading.Lock()


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _torch_lib() -> Path:
    return Path(torch.__file__).parent / "lib"


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


def _command(compiler: str, out: Path, obj: Path) -> tuple[list[str], list[str]]:
    """The compile and link commands."""
    torch_dir = Path(torch.__file__).parent
    target = os.environ.get("ATTNKIT_NATIVE_ARCH", "native")  # e.g. x86-64-v3: a build for other machines
    arch = [f"-march={target}"] if platform.machine() in ("x86_64", "AMD64", "i686") else [f"-mcpu={target}"]
    openmp = _openmp()
    compile_ = [
        compiler,
        "-c",
        "-O3",
        *arch,
        "-std=c++17",
        "-fPIC",
        "-ffp-contract=fast",  # a * b + c as one fused multiply-add
        "-fno-math-errno",
        "-fno-trapping-math",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-I{torch_dir / 'include'}",
        *(["-fopenmp"] if openmp else []),
        str(SOURCE),
        "-o",
        str(obj),
    ]
    lib = _torch_lib()
    link = [compiler, "-shared", str(obj), "-o", str(out), f"-L{lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]
    if openmp:  # PyTorch's own OpenMP runtime when it ships one (one thread pool), else the compiler's
        bundled = sorted(lib.glob("libgomp*.so*")) + sorted(lib.glob("libiomp*.so*"))
        link += [str(bundled[0])] if bundled else ["-fopenmp"]
    return compile_, link


def cache_dir() -> Path:
    """Where built libraries are kept: ``$ATTNKIT_CACHE``, else ``$XDG_CACHE_HOME/attnkit`` or ``~/.cache/attnkit``."""
    root = os.environ.get("ATTNKIT_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attnkit"


def _library_path(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), version.encode(), torch.__version__.encode(), str(_torch_lib()).encode()):
        key.update(part)
        key.update(b"\0")
    key.update(_cpu_key().encode())
    key.update(os.environ.get("ATTNKIT_NATIVE_ARCH", "native").encode())
    return cache_dir() / f"native-{key.hexdigest()[:20]}" / "libattnkit_native.so"


@contextlib.contextmanager
def _file_lock(path: Path):
    """One process builds while the others wait (several ranks of a ring may start at once)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, the atomic rename still keeps the file whole
        yield
        return
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(force: bool = False) -> Path:
    """Compile the engine for this machine (once: a cached build is reused) and return its path.

    Raises ``RuntimeError`` with the compiler's message when it cannot be built.
    """
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found ($CXX, g++, c++ or clang++); install one, e.g. apt-get install g++")
    target = _library_path(compiler)
    if target.exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / "build.lock"):
        if target.exists() and not force:  # another process built it meanwhile
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            obj, lib = Path(tmp) / "native.o", Path(tmp) / target.name
            for cmd in _command(compiler, lib, obj):
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                if done.returncode != 0:
                    tail = (done.stderr or done.stdout).strip()[-2000:]
                    raise RuntimeError(f"building attnkit's native engine failed:\n$ {' '.join(cmd)}\n{tail}")
            os.replace(lib, target)  # atomic: a reader sees the whole file or none
    return target


def _load() -> _Loaded:
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        lib, why = None, "the native C++ engine"
        try:
            path = build()
            lib = ctypes.CDLL(str(path))
            if lib.attnkit_native_version() != VERSION:
                raise RuntimeError(f"{path} speaks interface {lib.attnkit_native_version()}, attnkit {VERSION}")
            for fn in (lib.attnkit_native_forward, lib.attnkit_native_backward):
                fn.argtypes, fn.restype = [ctypes.POINTER(_Args)], ctypes.c_int
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            lib, why = None, f"native engine unavailable: {err}".split("\n")[0]
            if _compiler() is not None:  # a compiler that fails is worth a word; no compiler is a known case
                warnings.warn(
                    f"attnkit's native CPU engine could not be built; the PyTorch engines run instead.\n{err}",
                    RuntimeWarning,
                    stacklevel=3,
                )
        _loaded = _Loaded(lib, why)
    return _loaded


def status() -> tuple[bool, str]:
    """``(available, why)``: whether the engine can run here, and in words why not (it is built
    on the first call, which takes a few seconds once per machine)."""
    if not ENABLED:
        return False, "native engine turned off by ATTNKIT_NATIVE=0"
    loaded = _load()
    return loaded.lib is not None, loaded.why


def available() -> bool:
    """Whether the engine can run here (see :func:`status`)."""
    return ENABLED and _load().lib is not None


# --- calls ------------------------------------------------------------------------------------


def _f32(t: torch.Tensor) -> torch.Tensor:
    """float32 with a unit stride in the last dimension (the kernel reads rows as memory)."""
    return _aten.rows_contiguous(t.float())


def _strides(t: torch.Tensor) -> ctypes.Array:
    return _STRIDES(*t.stride()[:3])


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _plan(prepared: PreparedMask) -> tuple:
    """``(kv_num, kv_indices, tile_ids, bits, kv_limit)`` as the kernel reads them, kept on the
    prepared mask (the bits by ``packed_partial_bits`` itself; anything its cache has no room for
    is made again on the next call)."""
    key = ("native plan",)
    found = prepared.tiles.get(key)
    if found is None:
        limit = None if prepared.kv_limit is None else prepared.kv_limit.cpu().to(torch.int64).contiguous()
        kv_num, kv_indices = (t.cpu().to(torch.int32).contiguous() for t in (prepared.kv_num, prepared.kv_indices))
        found = (kv_num, kv_indices, limit)
        prepared.tiles.put(key, found, sum(t.numel() * t.element_size() for t in found if t is not None))
    bits, tile_ids = prepared.packed_partial_bits(torch.device("cpu"))
    return found[0], found[1], tile_ids, bits, found[2]


def _band_rev(band: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """The band reversed, with ``rows`` zeros after it (the kernel reads a vector of rows past its end)."""
    if band is None:
        return None
    return torch.cat([band.flip(-1), band.new_zeros(band.shape[0], rows)], dim=-1).contiguous()


def _args(loaded: _Loaded, q, k, v, prepared: PreparedMask, scale: float, softcap: float | None, band) -> _Args:
    b, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[-1]
    kv_num, kv_idx, tile_ids, bits, limit = _plan(prepared)
    band_rev = _band_rev(band, loaded.rows)
    bm, hm, nq, nk = prepared.codes.shape
    bq, bk = prepared.block_size
    a = _Args(b, hq, hkv, lq, lk, d, dv, _ptr(q), _ptr(k), _ptr(v), _strides(q), _strides(k), _strides(v))
    a.Bm, a.Hm, a.nq, a.nk, a.bq, a.bk = bm, hm, nq, nk, bq, bk
    a.kv_num, a.kv_idx, a.tile_ids, a.bits_t = _ptr(kv_num), _ptr(kv_idx), _ptr(tile_ids), _ptr(bits)
    a.kv_limit, a.Bl = _ptr(limit), 0 if limit is None else limit.shape[0]
    a.scale, a.softcap = scale, softcap or 0.0
    a.band_rev, a.band_heads = _ptr(band_rev), 0 if band_rev is None else band_rev.shape[0]
    a._keep = (kv_num, kv_idx, tile_ids, bits, limit, band_rev)  # alive until the call returns
    return a


def _checked(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"attnkit's native {what} refused its arguments (code {rc}): please report this")


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prepared: PreparedMask,
    *,
    scale: float,
    softcap: float | None = None,
    band: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, Hq, Lq, Dv) in q's dtype, lse (B, Hq, Lq) float32)``.

    q: (B, Hq, Lq, D), k: (B, Hkv, Lk, D), v: (B, Hkv, Lk, Dv) on the CPU, Hq a multiple of Hkv,
    any strides; ``prepared`` at a block size whose rows are a multiple of 32; ``band``: a bias
    of ``kv - q`` as ``(Hq or 1, Lq + Lk - 1)`` float32 (:meth:`attnkit.bias.Bias.band`).
    """
    loaded = _load()
    assert loaded.lib is not None, "forward() needs the engine: check available() first"
    dtype = q.dtype
    qf, kf, vf = _f32(q), _f32(k), _f32(v)
    b, hq, lq, _ = q.shape
    out = torch.empty(b, hq, lq, v.shape[-1])
    lse = torch.empty(b, hq, lq)
    a = _args(loaded, qf, kf, vf, prepared, scale, softcap, band)
    a.out, a.os, a.lse = _ptr(out), _strides(out), _ptr(lse)
    _checked(loaded.lib.attnkit_native_forward(ctypes.byref(a)), "forward")
    return out.to(dtype), lse


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prepared: PreparedMask,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None = None,
    *,
    scale: float,
    softcap: float | None = None,
    band: torch.Tensor | None = None,
    own_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` in the inputs' dtypes, recomputed from the saved ``lse``.

    ``out`` and ``lse`` are the forward's, or with ``own_lse=False`` (a part of the keys: ring
    attention) the merged output and log-sum-exp: the gradient of this part is the same formula
    with ``delta = rowsum(grad_out * out)``; a call's own keys use the sum of ``P * dP`` over
    them (the softmax's own backward). ``grad_lse``: (B, Hq, Lq) or None. Arguments as
    :func:`forward`'s.
    """
    loaded = _load()
    assert loaded.lib is not None, "backward() needs the engine: check available() first"
    b, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[-1]
    qf, kf, vf = _f32(q), _f32(k), _f32(v)
    go, of = _f32(grad_out), _f32(out)
    lse32 = lse.float().contiguous()
    gl = None if grad_lse is None else grad_lse.float().contiguous()
    nq, nk = prepared.codes.shape[2], prepared.codes.shape[3]
    bk = prepared.block_size[1]
    # dK/dV are summed per (sequence, K/V head, chunk of row blocks): enough items for every thread
    chunks = max(1, min(nq, -(-2 * torch.get_num_threads() // (b * hkv))))
    w = loaded.width
    dp, dvp = -(-d // w) * w, -(-dv // w) * w
    dq = torch.empty(b, hq, lq, d)
    dk_acc = torch.zeros(b, hkv, chunks, nk * bk, dp)
    dv_acc = torch.zeros(b, hkv, chunks, nk * bk, dvp)
    a = _args(loaded, qf, kf, vf, prepared, scale, softcap, band)
    a.lse, a.grad_out, a.gs, a.fwd_out, a.ofs = _ptr(lse32), _ptr(go), _strides(go), _ptr(of), _strides(of)
    a.grad_lse, a.dq, a.dk_acc, a.dv_acc = _ptr(gl), _ptr(dq), _ptr(dk_acc), _ptr(dv_acc)
    a.chunks, a.Dp, a.Dvp, a.delta_from_out = chunks, dp, dvp, int(not own_lse)
    _checked(loaded.lib.attnkit_native_backward(ctypes.byref(a)), "backward")
    dk_sum = dk_acc[:, :, 0] if chunks == 1 else dk_acc.sum(2)
    dv_sum = dv_acc[:, :, 0] if chunks == 1 else dv_acc.sum(2)
    return dq.to(q.dtype), dk_sum[:, :, :lk, :d].to(k.dtype), dv_sum[:, :, :lk, :dv].to(v.dtype)
