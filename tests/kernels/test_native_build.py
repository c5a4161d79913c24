"""The native engine's build, its cache and its operators' registrations (attnkit.kernels.native_build).

Builds in other processes use a cache folder of their own (ATTNKIT_CACHE). Where a test needs a
rebuild that would compile again, a stand-in compiler copies the library this process built (the
real build is what the rest of the suite runs), so that the checks of the cache are what is tested.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _oracle import assert_oracle, dense_of, gold_and_naive, naive_attention

import attnkit
from attnkit import masks
from attnkit.kernels.native import build as native_build

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def built():
    """This process's build of the engine (skips where it cannot be built)."""
    ok, why = native_build.status()
    if not ok:
        pytest.skip(why)
    return native_build.library_path()


def _python(code: str, env: dict, timeout: int = 900) -> subprocess.CompletedProcess:
    full = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full, timeout=timeout
    )


PROBE = """
    import json, warnings
    with warnings.catch_warnings(record=True) as caught:  # from the import on: a cached build is loaded then
        warnings.simplefilter("always")
        import torch, attnkit
        from attnkit import masks
        from attnkit.kernels.native import build as native_build
        ok, why = native_build.status()
    torch.manual_seed(0)
    q = torch.randn(1, 2, 200, 16, dtype=torch.float64).float()
    out = attnkit.attention(q, q, q, masks.sliding_window(30), kernel="tiled")
    # TESTING.md's rule: 2x the larger of SDPA's (dense mask) and the naive float32 formula's error
    allowed = masks.sliding_window(30).materialize(200, 200)
    gold = attnkit.attention(q.double(), q.double(), q.double(), allowed, kernel="reference")
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=allowed)
    naive = torch.softmax((q @ q.transpose(-2, -1) / 4.0).masked_fill(~allowed, float("-inf")), -1) @ q
    bound = 2 * max(float((sdpa.double() - gold).abs().max()), float((naive.double() - gold).abs().max())) + 1e-7
    plan = attnkit.explain(q, q, q, masks.sliding_window(30), kernel="tiled")
    print(json.dumps({"ok": ok, "why": why, "err": float((out.double() - gold).abs().max()), "bound": bound,
                      "kernel": plan.kernel,
                      "native": list(plan.rejected.get("native", ())),
                      "warnings": [str(w.message) for w in caught]}))
"""


def _probe(env: dict) -> dict:
    done = _python(PROBE, env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_without_a_compiler_the_other_kernels_run(tmp_path):
    env = {"PATH": str(tmp_path), "CXX": "", "ATTNKIT_CACHE": str(tmp_path / "cache"), "ATTNKIT_NATIVE": "1"}
    got = _probe(env)
    assert not got["ok"] and "no C++ compiler found" in got["why"], got
    (warning,) = got["warnings"]  # one, with what to install (test_native_store.py: only where it was wanted)
    assert "apt-get install g++" in warning, warning
    assert got["err"] <= got["bound"]
    assert got["kernel"] == "fused" and any("no C++ compiler found" in r for r in got["native"]), got


def test_a_build_that_fails_warns_once_and_falls_back(tmp_path):
    broken = tmp_path / "broken-c++"
    broken.write_text("#!/bin/sh\necho 'this compiler is broken' >&2\nexit 1\n")
    broken.chmod(0o755)
    got = _probe({"CXX": str(broken), "ATTNKIT_CACHE": str(tmp_path / "cache"), "ATTNKIT_NATIVE": "1"})
    assert not got["ok"] and "building attnkit's native engine failed" in got["why"]
    assert len(got["warnings"]) == 1 and "this compiler is broken" in got["warnings"][0]
    assert got["err"] <= got["bound"] and got["kernel"] == "fused"


def test_turned_off_by_the_environment(tmp_path):
    got = _probe({"ATTNKIT_NATIVE": "0", "ATTNKIT_CACHE": str(tmp_path / "cache")})
    assert got == {**got, "ok": False, "why": "native engine turned off by ATTNKIT_NATIVE=0"}
    assert not (tmp_path / "cache").exists()  # nothing is built when it is off
    assert got["err"] <= got["bound"]


def test_the_build_is_cached_and_reused(built):
    stamp = built.stat().st_mtime_ns
    assert native_build.build() == built and built.stat().st_mtime_ns == stamp
    assert built.parent.parent == native_build.cache_dir()
    manifest = json.loads(built.with_suffix(".json").read_text())
    assert manifest["interface"] == native_build.VERSION and manifest["size"] == built.stat().st_size
    assert native_build.check_library(built) is None


# --- a damaged cache ends in a rebuild or a clear warning -------------------------------------------


def _stand_in_compiler(tmp_path: Path, library: Path, fail_after: int | None = None) -> Path:
    """A "compiler" that copies ``library`` where the link step writes (and counts its links)."""
    script = tmp_path / "stand-in-c++"
    count = tmp_path / "links"
    fail = (
        ""
        if fail_after is None
        else f'[ "$(wc -l < {count})" -gt {fail_after} ] && {{ echo "no more builds" >&2; exit 1; }}'
    )
    script.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/sh
            if [ "$1" = "--version" ]; then echo "stand-in c++ 1.0"; exit 0; fi
            out=""; shared=0; prev=""
            for a in "$@"; do
              [ "$prev" = "-o" ] && out="$a"
              [ "$a" = "-shared" ] && shared=1
              prev="$a"
            done
            if [ $shared = 1 ]; then echo link >> {count}; {fail}
              cp {library} "$out"; else : > "$out"; fi
            """
        )
    )
    script.chmod(0o755)
    count.write_text("")
    return script


def _links(tmp_path: Path) -> int:
    return len((tmp_path / "links").read_text().splitlines())


def _cached(cache: Path) -> Path:
    (found,) = cache.glob("native-*/libattnkit_native.so")
    return found


DAMAGE = {
    "truncated": lambda lib, other: lib.write_bytes(lib.read_bytes()[: lib.stat().st_size // 3]),
    "empty": lambda lib, other: lib.write_bytes(b""),
    "wrong symbols": lambda lib, other: shutil.copyfile(other, lib),
    "old interface": lambda lib, other: lib.with_suffix(".json").write_text(
        json.dumps({**json.loads(lib.with_suffix(".json").read_text()), "interface": native_build.VERSION - 1})
    ),
    "no manifest": lambda lib, other: lib.with_suffix(".json").unlink(),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_cache_is_rebuilt_once(damage, built, tmp_path):
    """A truncated (it used to kill the process with SIGBUS), empty, replaced or older library, or
    one without its manifest, is found before it is loaded, and rebuilt once under the lock."""
    cache = tmp_path / "cache"
    env = {"CXX": str(_stand_in_compiler(tmp_path, built)), "ATTNKIT_CACHE": str(cache), "ATTNKIT_NATIVE": "1"}
    assert _probe(env)["ok"] and _links(tmp_path) == 1
    other = Path(torch.__file__).parent / "lib" / "libshm.so"  # a shared library without attnkit's operators
    DAMAGE[damage](_cached(cache), other)
    got = _probe(env)
    assert got["ok"] and got["warnings"] == [] and got["kernel"] == "native", got
    assert _links(tmp_path) == 2  # rebuilt, once
    assert native_build.check_library(_cached(cache)) is None
    assert _probe(env)["ok"] and _links(tmp_path) == 2  # and then reused


def test_a_damaged_cache_that_cannot_be_rebuilt_warns_with_what_was_found(built, tmp_path):
    cache = tmp_path / "cache"
    env = {"CXX": str(_stand_in_compiler(tmp_path, built, fail_after=1)), "ATTNKIT_CACHE": str(cache)}
    assert _probe(env)["ok"]
    DAMAGE["truncated"](_cached(cache), None)
    got = _probe(env)
    assert not got["ok"] and got["kernel"] == "fused" and got["err"] <= got["bound"]
    (warning,) = got["warnings"]
    assert "no more builds" in warning and "truncated or replaced" in warning, warning


def test_a_library_that_matches_its_manifest_but_defines_no_operators_is_refused_clearly(built, tmp_path):
    """A manifest rewritten to match another library (it loads, but registers nothing): a warning
    that names the file and how to rebuild it; every call runs on the other kernels."""
    cache = tmp_path / "cache"
    env = {"CXX": str(_stand_in_compiler(tmp_path, built)), "ATTNKIT_CACHE": str(cache)}
    assert _probe(env)["ok"]
    lib = _cached(cache)
    shutil.copyfile(Path(torch.__file__).parent / "lib" / "libshm.so", lib)
    manifest = json.loads(lib.with_suffix(".json").read_text())
    manifest.update(size=lib.stat().st_size, sha256=hashlib.sha256(lib.read_bytes()).hexdigest())
    lib.with_suffix(".json").write_text(json.dumps(manifest))
    got = _probe(env)
    assert not got["ok"] and got["kernel"] == "fused" and got["err"] <= got["bound"]
    (warning,) = got["warnings"]
    assert "defines none of attnkit's operators" in warning and str(lib.parent) in warning, warning


# --- the operators ---------------------------------------------------------------------------------


def _sample(dtype=torch.float32, band=False, requires_grad=True):
    q = torch.randn(2, 4, 70, 16, dtype=dtype, requires_grad=requires_grad)
    k, v = (torch.randn(2, 2, 90, 16, dtype=dtype, requires_grad=requires_grad) for _ in range(2))
    prepared = attnkit.prepare(masks.document(torch.arange(90) // 30, q_offset=20) & masks.causal(), 70, 90)
    b = torch.randn(4, 70 + 90 - 1, requires_grad=requires_grad) if band else None
    bq, bk = prepared.block_size
    return (q, k, v, *prepared.native_plan(), b, bq, bk, 0.25, 0.0)


@pytest.mark.parametrize("band", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_passes_on_the_forward_operator(built, dtype, band):
    """Schema, fake (meta) implementation, autograd registration and AOT dispatch with dynamic shapes."""
    torch.library.opcheck(torch.ops.attnkit.native_forward.default, _sample(dtype, band))


def test_opcheck_passes_on_the_backward_operator(built):
    args = _sample(requires_grad=False)
    out, lse = torch.ops.attnkit.native_forward(*args)
    q, k, v, *plan = args
    backward_args = (torch.randn_like(out), torch.randn_like(lse), q, k, v, out, lse, *plan, False, False)
    torch.library.opcheck(
        torch.ops.attnkit.native_backward.default, backward_args, test_utils=("test_schema", "test_faketensor")
    )


def test_opcheck_passes_on_the_statistics_operator(built):
    """``native_stats``: schema and fake implementation (it has no gradient), with sinks and top-k;
    its lse is the forward operator's."""
    q, k, v, *plan, band, bq, bk, scale, softcap = _sample(requires_grad=False)
    qpos = (torch.arange(70, dtype=torch.float32) + 20)[None]
    kpos = torch.arange(90, dtype=torch.float32)[None]
    sinks = torch.randn(4)
    args = (q, k, *plan, band, sinks, qpos, kpos, bq, bk, scale, softcap, 2, 3)
    torch.library.opcheck(torch.ops.attnkit.native_stats.default, args, test_utils=("test_schema", "test_faketensor"))
    found = torch.ops.attnkit.native_stats(q, k, *plan, None, None, qpos, kpos, bq, bk, scale, softcap, 2, 3)
    _, lse = torch.ops.attnkit.native_forward(q, k, v, *plan, None, bq, bk, scale, softcap)
    torch.testing.assert_close(found[0], lse)
    assert found[7].shape == found[8].shape == (2, 4, 70, 3) and found[8].dtype == torch.int64
    with pytest.raises(RuntimeError, match="sink_tokens and topk must be >= 0"):
        torch.ops.attnkit.native_stats(*args[:-1], -1)


def test_the_operators_check_every_argument(built):
    q, k, v, kv_num, kv_indices, tile_ids, bits, limit, band, bq, bk, scale, softcap = _sample(requires_grad=False)
    op = torch.ops.attnkit.native_forward
    bad = kv_indices.clone()
    bad[0, 0, 0, 0] = 10_000
    with pytest.raises(RuntimeError, match="kv_indices holds 10000, outside"):
        op(q, k, v, kv_num, bad, tile_ids, bits, limit, band, bq, bk, scale, softcap)
    with pytest.raises(RuntimeError, match="block_q must be a positive multiple of 32"):
        op(q, k, v, kv_num, kv_indices, tile_ids, bits, limit, band, 48, bk, scale, softcap)
    with pytest.raises(RuntimeError, match="k must be torch.float32 like q, but is torch.float16"):
        op(q, k.half(), v, kv_num, kv_indices, tile_ids, bits, limit, band, bq, bk, scale, softcap)
    with pytest.raises(RuntimeError, match="Hq must be a multiple of Hkv"):
        op(q[:, :3], k, v, kv_num, kv_indices, tile_ids, bits, limit, band, bq, bk, scale, softcap)
    with pytest.raises(RuntimeError, match=r"band must be \(1 or Hq, Lq \+ Lk - 1\)"):
        op(q, k, v, kv_num, kv_indices, tile_ids, bits, limit, torch.zeros(4, 5), bq, bk, scale, softcap)
    with pytest.raises(RuntimeError, match="softcap must be finite and >= 0"):
        op(q, k, v, kv_num, kv_indices, tile_ids, bits, limit, band, bq, bk, scale, -1.0)


def test_the_forward_operator_traces_as_one_op_under_torch_compile(built):
    """torch.compile(fullgraph=True) calls the operator itself, forward and backward: no Python wrapper."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    q, k, v = (torch.randn(1, 2, 256, 16, requires_grad=True) for _ in range(3))
    prepared = attnkit.prepare(masks.sliding_window(40), 256, 256)
    step = torch.compile(
        lambda q, k, v: attnkit.attention(q, k, v, prepared).square().sum(), fullgraph=True, backend=backend
    )
    step(q, k, v).backward()
    code = graphs[0].code
    assert "torch.ops.attnkit.native_forward" in code, code
    want = attnkit.attention(q, k, v, prepared, kernel="reference")
    grads = [t.grad.clone() for t in (q, k, v)]
    expected = torch.autograd.grad(want.square().sum(), (q, k, v))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, atol=2e-5, rtol=1e-4)


# --- builds for other CPUs -------------------------------------------------------------------------


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 instruction sets")
@pytest.mark.parametrize("arch", ["x86-64-v2"])
def test_other_vector_widths_are_exact(arch, tmp_path):
    """Built for SSE4 (4 floats a vector): the same answers within the oracle rule. (AVX2's build,
    x86-64-v3, and AVX-512's run the native tests in make wheel: the wheel carries them.)"""
    code = """
        import json, torch, attnkit
        from attnkit import masks
        from attnkit.kernels.native import build as native_build
        assert native_build.available(), native_build.status()
        torch.manual_seed(0)
        q = torch.randn(2, 4, 300, 40, requires_grad=True)
        k, v = (torch.randn(2, 2, 300, 40, requires_grad=True) for _ in range(2))
        mask = masks.document(torch.arange(300) // 70) & masks.causal()
        out = attnkit.attention(q, k, v, mask, kernel="native", softcap=5.0)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        allowed = attnkit.prepare(mask, 300, 300).materialize()
        s = 5.0 * torch.tanh(q64 @ k64.repeat_interleave(2, 1).transpose(-2, -1) * 40 ** -0.5 / 5.0)
        gold = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v64.repeat_interleave(2, 1)
        want = torch.autograd.grad(gold.sum(), (q64, k64, v64))
        errs = [float((out.double() - gold).abs().max())]
        errs += [float((g.double() - w).abs().max()) for g, w in zip(grads, want)]
        from attnkit.masks import _program  # a predicate's program: int32 lanes, then int64 ones, bits packed
        z = torch.zeros((), dtype=torch.int64)
        x, y = torch.arange(100).view(1, -1, 1), torch.arange(77).view(1, 1, -1)
        for fn in (lambda b, h, q, kv: ((q - kv).abs() % 3 == 0) | (q < kv // 2),
                   lambda b, h, q, kv: (q * 2**40 + kv) % 7 == 3):
            program = _program.trace(fn, z, z, z, z)
            want_bits = fn(z, z, x, y)
            bits = _program.evaluate(program, (z, z, x, y), (1, 100, 77), 0)
            packed = _program.evaluate(program, (z, z, x, y), (1, 100, 77), 1)
            errs.append(float(not torch.equal(bits, want_bits)))
            first = (bits[0, :, :8].int() << torch.arange(8)).sum(-1).byte()  # each row's first byte
            errs.append(float(not torch.equal(packed[0, :, 0], first)))
        print(json.dumps({"info": native_build.info(), "errs": errs}))
    """
    done = _python(code, {"ATTNKIT_NATIVE_ARCH": arch, "ATTNKIT_CACHE": str(tmp_path), "ATTNKIT_NATIVE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["info"].startswith({"x86-64-v3": "AVX2 (8 floats", "x86-64-v2": "SSE/portable (4 floats"}[arch]), got
    assert "widened to float32" in got["info"]  # no AVX512-BF16 in these builds
    assert max(got["errs"]) < 5e-5, got


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


BF16_PATH = """
    import sys, torch, attnkit
    from attnkit import masks
    from attnkit.kernels.native import build as native_build
    torch.manual_seed(0)
    q = torch.randn(2, 4, 1100, 64).bfloat16().requires_grad_()
    k, v = (torch.randn(2, 2, 1100, 64).bfloat16().requires_grad_() for _ in range(2))
    grad = torch.randn(2, 4, 1100, 64).bfloat16()
    result = {"info": native_build.info()}
    for name, mask in {"none": None, "documents": masks.document(torch.arange(1100) // 300) & masks.causal(),
                       "padding": masks.padding(torch.tensor([1100, 777]))}.items():
        out = attnkit.attention(q, k, v, mask, kernel="native")
        result[name] = (out.detach(), *torch.autograd.grad(out, (q, k, v), grad))
    torch.save(result, sys.argv[1])
"""


def test_the_bfloat16_paths_say_which_they_are_and_agree(built, tmp_path):
    """bf16 products on AMX tiles where the CPU has them (oneDNN's brgemm, runs of full blocks as one
    step), AVX512-BF16 dot products with ATTNKIT_NATIVE_AMX=0 or without AMX: info() names the path
    each process took, and each is within TESTING.md's bf16 rule of the float64 formula (outputs)
    and 3% of the largest gradient, on full blocks (no mask), partial blocks (documents & causal)
    and a key limit (padding)."""
    got = {}
    for amx in ("1", "0"):
        file = tmp_path / f"amx-{amx}.pt"
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(BF16_PATH), str(file)],
            capture_output=True,
            text=True,
            env={**os.environ, "ATTNKIT_NATIVE_AMX": amx},
            timeout=900,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        got[amx] = torch.load(file)
    flags = _cpu_flags()
    assert "AMX" not in got["0"]["info"], got["0"]["info"]
    if "AMX tiles" in got["1"]["info"]:
        assert "amx_bf16" in flags, got["1"]["info"]  # taken only where the CPU has the tiles
    if native_build.info().startswith("AVX-512") and "avx512_bf16" in flags:
        assert "AVX512-BF16 dot products" in got["0"]["info"], got["0"]["info"]
    torch.manual_seed(0)
    q = torch.randn(2, 4, 1100, 64).bfloat16()
    k, v = (torch.randn(2, 2, 1100, 64).bfloat16() for _ in range(2))
    grad = torch.randn(2, 4, 1100, 64).bfloat16()
    cases = {
        "none": None,
        "documents": masks.document(torch.arange(1100) // 300) & masks.causal(),
        "padding": masks.padding(torch.tensor([1100, 777])),
    }
    for name, mask in cases.items():
        allowed = None if mask is None else dense_of(mask, 1100, 1100)
        gold, naive = gold_and_naive(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), allowed)
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        out64, _ = naive_attention(q64, k64.repeat_interleave(2, 1), v64.repeat_interleave(2, 1), allowed)
        want = torch.autograd.grad(out64, (q64, k64, v64), grad.double())
        for amx in ("1", "0"):
            out, *grads = got[amx][name]
            assert_oracle(out, gold, naive, what=f"{name} {got[amx]['info']}")
            for g, w in zip(grads, want):
                torch.testing.assert_close(g.double(), w, atol=3e-2 * w.abs().max().item(), rtol=0)
