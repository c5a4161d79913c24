"""Where the native engine comes from: the build cache's privacy checks, the wheel's builds chosen
by CPU (attnkit.kernels.native.store and .prebuilt), and the engine loaded only for calls that use it.

Builds in other processes use a stand-in compiler that copies the library this process built (as
in test_native_build.py), so what is tested is what is checked before a library is loaded.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from test_native_build import _cached, _links, _probe, _python, _stand_in_compiler, built  # noqa: F401

from attnkit.kernels.native import build as native_build
from attnkit.kernels.native import prebuilt, store

POSIX = hasattr(os, "getuid")


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


# --- the cache is private --------------------------------------------------------------------------


@pytest.mark.skipif(not POSIX, reason="POSIX permissions")
def test_the_cache_is_private_whatever_the_umask(built, tmp_path):  # noqa: F811
    cache = tmp_path / "deep" / "cache"
    code = """
        import os
        os.umask(0)
        from attnkit.kernels.native import build as native_build
        assert native_build.available(), native_build.status()
    """
    done = _python(code, {"CXX": str(_stand_in_compiler(tmp_path, built)), "ATTNKIT_CACHE": str(cache)})
    assert done.returncode == 0, done.stderr[-2000:]
    modes = _modes(cache)
    lib = str(_cached(cache).relative_to(cache))
    assert modes["."] == 0o700 and modes[str(Path(lib).parent)] == 0o700, modes
    assert modes[lib] == 0o700 and modes[lib.replace(".so", ".json")] == 0o600, modes
    assert all(mode & 0o077 == 0 for mode in modes.values()), modes  # nothing readable or writable by others
    assert "compiling the native CPU engine" in done.stderr  # the build at first use says so


@pytest.mark.skipif(not POSIX, reason="POSIX permissions")
@pytest.mark.parametrize("where", ["cache folder", "build folder", "library"])
def test_a_cache_others_can_write_to_is_refused_with_a_warning(where, built, tmp_path):  # noqa: F811
    """A library planted where others can write, with a manifest that matches it, is never loaded."""
    cache = tmp_path / "cache"
    env = {"CXX": str(_stand_in_compiler(tmp_path, built)), "ATTNKIT_CACHE": str(cache)}
    assert _probe(env)["ok"] and _links(tmp_path) == 1
    lib = _cached(cache)
    os.chmod({"cache folder": cache, "build folder": lib.parent, "library": lib}[where], 0o777)
    got = _probe(env)
    assert not got["ok"] and "is writable by others (mode 0777)" in got["why"], got
    (warning,) = got["warnings"]
    assert "not private" in warning and f"rm -r {cache}" in warning and "ATTNKIT_CACHE" in warning, warning
    assert got["kernel"] == "fused" and got["err"] <= got["bound"]
    assert _links(tmp_path) == 1  # neither loaded nor rebuilt over


@pytest.mark.skipif(not POSIX or os.getuid() != 0, reason="chown to another user needs root")
def test_a_cache_owned_by_someone_else_is_refused(built, tmp_path):  # noqa: F811
    cache = tmp_path / "cache"
    env = {"CXX": str(_stand_in_compiler(tmp_path, built)), "ATTNKIT_CACHE": str(cache)}
    assert _probe(env)["ok"]
    os.chown(_cached(cache).parent, 12345, 12345)
    got = _probe(env)
    assert not got["ok"] and "owned by uid 12345, not by this user (uid 0)" in got["why"], got
    assert len(got["warnings"]) == 1 and got["kernel"] == "fused"


@pytest.mark.skipif(not POSIX, reason="POSIX symbolic links")
def test_the_build_lock_is_never_followed_through_a_symbolic_link(built, tmp_path):  # noqa: F811
    cache = tmp_path / "cache"
    env = {"CXX": str(_stand_in_compiler(tmp_path, built)), "ATTNKIT_CACHE": str(cache)}
    assert _probe(env)["ok"]
    lib = _cached(cache)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (lib.parent / "build.lock").unlink()
    (lib.parent / "build.lock").symlink_to(victim)
    lib.write_bytes(b"")  # damaged: a rebuild would take the lock
    got = _probe(env)
    assert not got["ok"] and "build.lock is a symbolic link" in got["why"], got
    assert victim.read_text() == "precious" and _links(tmp_path) == 1
    with pytest.raises(RuntimeError, match="symbolic link"):  # the lock itself, asked directly
        with store.file_lock(lib.parent / "build.lock"):
            pass
    assert victim.read_text() == "precious"


def test_private_dir_makes_only_what_is_missing(tmp_path):
    old = os.umask(0)
    try:
        store.private_dir(tmp_path / "a" / "b" / "c", tmp_path / "a")
    finally:
        os.umask(old)
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "a").rglob("*")} == {"b": 0o700, "c": 0o700}
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o700
    assert store.distrust(tmp_path / "a", tmp_path / "a" / "b", tmp_path / "missing") is None


# --- the wheel's builds, chosen by CPU --------------------------------------------------------------

V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm"})
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@pytest.fixture
def wheel_folder(tmp_path):
    """A wheel's engines/ folder with stand-in libraries (bytes only: choose() never loads)."""
    folder = tmp_path / "engines"
    builds = {}
    for level in prebuilt.LEVELS:
        lib = folder / level.name / prebuilt.LIBRARY
        lib.parent.mkdir(parents=True)
        lib.write_bytes(level.name.encode() * 100)
        builds[level.name] = {"size": lib.stat().st_size, "sha256": store.digest(lib)}
    manifest = {**prebuilt.torch_key(), "interface": native_build.VERSION, "builds": builds}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the wheel's builds are x86-64")
@pytest.mark.parametrize(
    "flags, wanted, level",
    [
        (V4 | {"avx512_bf16", "amx_bf16"}, None, "x86-64-v4-bf16"),
        (V4, None, "x86-64-v4"),  # AVX-512 without AVX512-BF16 (Skylake-X)
        (V3, None, "x86-64-v3"),  # AVX2 (Zen 3)
        (V4 | {"avx512_bf16"}, "x86-64-v3", "x86-64-v3"),  # the environment picks a lower one to test it
    ],
)
def test_the_best_build_the_cpu_runs_is_chosen(wheel_folder, flags, wanted, level):
    choice = prebuilt.choose(native_build.VERSION, folder=wheel_folder, flags=frozenset(flags), wanted=wanted)
    assert choice.library == wheel_folder / level / prebuilt.LIBRARY and choice.level == level, choice
    assert f"the wheel's {level} build" in choice.why and not choice.refused


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the wheel's builds are x86-64")
def test_what_cannot_be_chosen_says_why(wheel_folder, tmp_path):
    version = native_build.VERSION
    got = prebuilt.choose(version, folder=wheel_folder, flags=V3, wanted="x86-64-v4")
    assert got.refused and got.library is None and "this CPU lacks avx512bw, avx512cd" in got.why, got
    got = prebuilt.choose(version, folder=wheel_folder, flags=V3, wanted="avx9000")
    assert got.refused and "not one of x86-64-v4-bf16, x86-64-v4, x86-64-v3" in got.why
    got = prebuilt.choose(version, folder=wheel_folder, flags=frozenset({"sse2"}))
    assert got.library is None and not got.refused and "x86-64-v3, AVX2, at least" in got.why
    got = prebuilt.choose(version, folder=tmp_path / "nothing", flags=V4)
    assert got.library is None and "carries no prebuilt engine" in got.why
    got = prebuilt.choose(version + 1, folder=wheel_folder, flags=V4)
    assert got.library is None and f"this is torch {torch.__version__}" in got.why
    manifest = json.loads((wheel_folder / "manifest.json").read_text())
    (wheel_folder / "manifest.json").write_text(json.dumps({**manifest, "torch": "2.0.0"}))
    got = prebuilt.choose(version, folder=wheel_folder, flags=V4)
    assert got.library is None and "built for torch 2.0.0" in got.why
    assert "compiled for this torch at first use" in got.why
    (wheel_folder / "manifest.json").write_text(json.dumps(manifest))
    (wheel_folder / "x86-64-v4" / prebuilt.LIBRARY).write_bytes(b"replaced")
    got = prebuilt.choose(version, folder=wheel_folder, flags=V4)
    assert got.library is None and "does not match the wheel's manifest" in got.why


# --- loaded only for calls that use it ---------------------------------------------------------------

FIRST_CALLS = """
    import json, warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import torch, attnkit
        from attnkit import masks
        from attnkit.kernels.native import build as native_build
        q = torch.randn(1, 2, 8, 16)
        attnkit.attention(q, q, q)
        small = {"tried": native_build.tried(), "warnings": len(caught), "explain": str(attnkit.explain(q, q, q))}
        q = torch.randn(1, 4, 1024, 32)
        mask = masks.document(torch.arange(1024) // 256) & masks.causal()
        attnkit.attention(q, q, q, mask)
        attnkit.attention(q, q, q, mask)
    print(json.dumps({"small": small, "tried": native_build.tried(), "explain": str(attnkit.explain(q, q, q, mask)),
                      "warnings": [str(w.message) for w in caught]}))
"""


def test_without_an_engine_one_warning_says_what_to_install_and_explain_says_it_too(tmp_path):
    """No compiler and no wheel build: an 8-token call loads nothing and warns of nothing; the first
    call that would take the engine warns once (what to install), and explain's line says it."""
    env = {"PATH": str(tmp_path), "CXX": "", "ATTNKIT_CACHE": str(tmp_path / "cache"), "ATTNKIT_NATIVE": "1"}
    done = _python(FIRST_CALLS, env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["small"] == {"tried": False, "warnings": 0, "explain": "sdpa: no mask"}, got
    assert got["tried"], got
    (warning,) = got["warnings"]
    assert "no C++ compiler found" in warning and "apt-get install g++" in warning and "wheel" in warning, warning
    assert "(native is off: no C++ compiler found" in got["explain"] and "apt-get install g++" in got["explain"]
    assert not (tmp_path / "cache").exists()


MISMATCHED = """
    import functools, json, warnings
    import torch, attnkit
    from attnkit import masks
    from attnkit.kernels.native import build as native_build, prebuilt
    prebuilt.choose = functools.partial(prebuilt.choose, folder=__import__("pathlib").Path({folder!r}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = torch.randn(1, 2, 1024, 32)
        mask = masks.document(torch.arange(1024) // 256) & masks.causal()
        out = attnkit.attention(q, q, q, mask)
    gold = attnkit.attention(q.double(), q.double(), q.double(), mask, kernel="reference")
    print(json.dumps({{"status": native_build.status(), "explain": str(attnkit.explain(q, q, q, mask)),
                      "warnings": [str(w.message) for w in caught], "err": float((out.double() - gold).abs().max())}}))
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the wheel's builds are x86-64")
def test_a_wheel_engine_built_for_another_torch_is_refused_with_the_reason_and_the_fallback(wheel_folder, tmp_path):
    """A wheel installed beside another PyTorch (an unpinned install): its engine is never loaded; the
    warning and explain say for which torch it was built, which torch runs, and what runs instead."""
    manifest = json.loads((wheel_folder / "manifest.json").read_text())
    (wheel_folder / "manifest.json").write_text(json.dumps({**manifest, "torch": "2.12.0"}))
    env = {"PATH": str(tmp_path), "CXX": "", "ATTNKIT_CACHE": str(tmp_path / "cache"), "ATTNKIT_NATIVE": "1"}
    done = _python(MISMATCHED.format(folder=str(wheel_folder)), env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert not got["status"][0] and got["err"] < 1e-5, got
    (warning,) = got["warnings"]
    for said in ("built for torch 2.12.0", f"this is torch {torch.__version__}", "else the PyTorch kernels run"):
        assert said in warning, warning
    assert "native is off" in got["explain"] and "2.12.0" in got["explain"], got["explain"]


def test_an_isa_the_cpu_cannot_run_is_refused_not_built(tmp_path):
    env = {"ATTNKIT_NATIVE_ISA": "avx9000", "ATTNKIT_CACHE": str(tmp_path / "cache"), "ATTNKIT_NATIVE": "1"}
    got = _probe(env)
    assert not got["ok"] and "ATTNKIT_NATIVE_ISA=avx9000 is not one of" in got["why"], got
    assert len(got["warnings"]) == 1 and not (tmp_path / "cache").exists()
