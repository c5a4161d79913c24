"""Every documented entry point as the FIRST attnkit call of a fresh interpreter.

A warm test worker has loaded the native engine, imported torch._dynamo and filled attnkit's caches
long before most tests run: a crash that only the first call of a process meets (the engine loaded
while torch.compile traces, a cache written under tracing) never shows there. Each case here is a
``python -c`` of its own (a subprocess per case), with the engine's cache warm (the machine's) or
cold (an empty ``ATTNKIT_CACHE``: the engine is compiled during the first trace), the native engine
on or off; each checks its answer against a float64 formula written in the case and prints ``ok``.

Cost: about 3-15 s a case (the interpreter, torch's import, a compile), ~30 s for the cold cache;
about 2 minutes of the suite on 2 workers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

#: What every case starts with: inputs and a float64 oracle (TESTING.md's rule), no attnkit call.
PRELUDE = """
import torch
torch.manual_seed(0)

def formula(q, k, v, allowed):
    s = q.double() @ k.double().transpose(-2, -1) / q.shape[-1] ** 0.5
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0) @ v.double()

def check(out, q, k, v, allowed, factor=2.0):
    gold = formula(q, k, v, allowed)
    s = (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).masked_fill(~allowed, float("-inf"))
    naive = torch.softmax(s, -1).nan_to_num(0) @ v
    rounding = 2 * ((gold.to(out.dtype) + 0.3 - 0.3).double() - gold).abs().max().item()
    err = (out.double() - gold).abs().max().item()
    bound = factor * (naive.double() - gold).abs().max().item() + rounding
    assert err <= bound, (err, bound)

L = 256
i, j = torch.arange(L).view(-1, 1), torch.arange(L).view(1, -1)
CAUSAL = i >= j
q, k, v = (torch.randn(2, 2, L, 32) for _ in range(3))
"""

CASES = {
    "eager attention": """
import sys, attnkit
check(attnkit.attention(q, k, v, attnkit.masks.causal()), q, k, v, CAUSAL)
# an eager call never imports torch.compile's machinery (about 1.5 s of every process's first call)
assert "torch._dynamo" not in sys.modules, "an eager first call imported torch._dynamo"
""",
    "compile with a PreparedMask made outside": """
import attnkit
pm = attnkit.prepare(attnkit.masks.causal(), L, L)
f = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, pm))
check(f(q, k, v), q, k, v, CAUSAL)
""",
    "compile fullgraph with a mask made inside": """
import attnkit
f = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, attnkit.masks.causal()), fullgraph=True)
check(f(q, k, v), q, k, v, CAUSAL)
""",
    "compile dynamic with a padding mask from tensors": """
import attnkit
f = torch.compile(lambda q, k, v, n: attnkit.attention(q, k, v, attnkit.masks.padding(n)), dynamic=True)
n = torch.tensor([100, 256])
allowed = (j < n.view(-1, 1, 1, 1)).expand(2, 1, L, L)
check(f(q, k, v, n), q, k, v, allowed)
""",
    "compile fullgraph with from_fn made inside": """
import attnkit
f = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, attnkit.masks.from_fn(lambda b, h, x, y: x >= y)),
                  fullgraph=True)
check(f(q, k, v), q, k, v, CAUSAL)
""",
    "export with a padding mask": """
import attnkit
class Attend(torch.nn.Module):
    def forward(self, q, k, v, n):
        return attnkit.attention(q, k, v, attnkit.masks.causal() & attnkit.masks.padding(n))
n = torch.tensor([100, 256])
program = torch.export.export(Attend(), (q, k, v, n))
check(program.module()(q, k, v, n), q, k, v, CAUSAL & (j < n.view(-1, 1, 1, 1)))
""",
    "torch.func.grad": """
import attnkit
g = torch.func.grad(lambda q: attnkit.attention(q, k, v, attnkit.masks.causal()).sum())(q)
ref = q.double().requires_grad_()
formula(ref, k, v, CAUSAL).sum().backward()
assert torch.allclose(g.double(), ref.grad, atol=1e-4), (g.double() - ref.grad).abs().max()
""",
    "soft-capped, eager and compiled": """
import attnkit
def capped(q, k, v, allowed, cap):
    s = q.double() @ k.double().transpose(-2, -1) / q.shape[-1] ** 0.5
    s = (cap * torch.tanh(s / cap)).masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1) @ v.double()
capped_call = lambda q, k, v: attnkit.attention(q, k, v, attnkit.masks.causal(), softcap=2.5)
compiled = torch.compile(capped_call, fullgraph=True)
for cap in (50.0, 2.5):  # the polynomial alone; polynomial and exp form in one vector
    gold = capped(q * 3, k, v, CAUSAL, cap)
    out = attnkit.attention(q * 3, k, v, attnkit.masks.causal(), softcap=cap)
    assert (out.double() - gold).abs().max() < 2e-5, (cap, (out.double() - gold).abs().max())
assert (compiled(q * 3, k, v).double() - gold).abs().max() < 2e-5
""",
    "a decoding step over bfloat16 keys, eager and compiled": """
import attnkit
n = torch.tensor([200, 7])
qb, kb, vb = q[:, :, :1].bfloat16(), k.bfloat16(), v.bfloat16()
wide = attnkit.attention(qb.float(), kb.float(), vb.float(), attnkit.masks.padding(n))
check(wide, qb.float(), kb.float(), vb.float(), j < n.view(-1, 1, 1, 1))
step = lambda q, k, v, n: attnkit.attention(q, k, v, attnkit.masks.padding(n))
assert torch.equal(step(qb, kb, vb, n), wide.bfloat16())  # widened exactly, summed as float32 rows are
compiled = torch.compile(step, fullgraph=True)(qb, kb, vb, n)
assert compiled.dtype == torch.bfloat16 and (compiled.float() - wide).abs().max() <= 2 ** -8 * wide.abs().max()
""",
    "flex eager": """
from attnkit.flex import create_block_mask, flex_attention
bm = create_block_mask(lambda b, h, x, y: x >= y, None, None, L, L)
check(flex_attention(q, k, v, block_mask=bm), q, k, v, CAUSAL)
""",
    "a predicate's program on the native engine": """
import attnkit
docs = torch.tensor([0] * 100 + [1] * 156)
mask = attnkit.masks.from_fn(lambda b, h, x, y: (docs[x] == docs[y]) & ((x - y) % 3 == 0) & (y <= x))
out = attnkit.attention(q, k, v, mask)
check(out, q, k, v, (docs[i] == docs[j]) & ((i - j) % 3 == 0) & (j <= i))
from attnkit import _cache
from attnkit.kernels.native import build
assert (len(_cache.PROGRAMS) > 0) == build.available(), _cache.PROGRAMS  # the engine ran the predicate
""",
    "compiled flex with a BlockMask made outside": """
from attnkit.flex import create_block_mask, flex_attention
bm = create_block_mask(lambda b, h, x, y: x >= y, None, None, L, L)
check(torch.compile(flex_attention, fullgraph=True)(q, k, v, block_mask=bm), q, k, v, CAUSAL)
""",
    "compiled flex with a BlockMask made inside": """
from attnkit.flex import create_block_mask, flex_attention
@torch.compile(fullgraph=True)
def f(q, k, v):
    return flex_attention(q, k, v, block_mask=create_block_mask(lambda b, h, x, y: x >= y, None, None, L, L))
check(f(q, k, v), q, k, v, CAUSAL)
""",
    "compiled first, then eager, then compiled again: no recompile": """
import attnkit
from torch._dynamo.testing import CompileCounter
counter = CompileCounter()
f = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, attnkit.masks.causal()), backend=counter)
check(f(q, k, v), q, k, v, CAUSAL)
check(attnkit.attention(q, k, v, attnkit.masks.causal()), q, k, v, CAUSAL)  # the first eager call
check(f(q, k, v), q, k, v, CAUSAL)
assert counter.frame_count == 1, f"{counter.frame_count} compiles: the first eager call changed a guarded state"
""",
    "capture": """
import attnkit
mha = attnkit.MultiHeadAttention(32, 2)
x = torch.randn(2, 16, 32)
with attnkit.capture(mha) as cap:
    mha(x, mask=attnkit.masks.causal())
w = cap.weights[0]
assert w.shape == (2, 2, 16, 16) and torch.allclose(w.sum(-1), torch.ones(2, 2, 16), atol=1e-5)
assert (w.triu(1) == 0).all()
""",
    "transformers integration": """
import transformers, attnkit.integrations.transformers  # registers attn_implementation="attnkit"
config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2)
ids = torch.randint(0, 64, (2, 20))
eager = transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager").eval()
ours = transformers.LlamaForCausalLM._from_config(config, attn_implementation="attnkit").eval()
ours.load_state_dict(eager.state_dict())
with torch.no_grad():
    a, b = eager(ids).logits, ours(ids).logits
assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
""",
}

#: ``(case, extra environment)`` for the runs beyond the default (warm engine cache, engine on).
VARIANTS = [
    ("a predicate's program on the native engine", {"ATTNKIT_NATIVE": "0"}),
    ("compile with a PreparedMask made outside", {"ATTNKIT_NATIVE": "0"}),
    ("compiled flex with a BlockMask made outside", {"ATTNKIT_NATIVE": "0"}),
    ("eager attention", {"ATTNKIT_NATIVE": "0"}),
]
COLD = ["compile with a PreparedMask made outside"]  # the engine compiled during the first trace


def _run(code: str, env_extra: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", **env_extra)
    env.pop("PYTEST_XDIST_WORKER", None)
    script = PRELUDE + textwrap.dedent(code) + "\nprint('ok')\n"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env)


def _assert_ok(done: subprocess.CompletedProcess, name: str) -> None:
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (
        f"{name} as the first call of a fresh process failed:\n{done.stdout[-2000:]}\n{done.stderr[-5000:]}"
    )


@pytest.mark.parametrize("name", list(CASES))
def test_the_first_call_of_a_fresh_process(name):
    _assert_ok(_run(CASES[name], {}), name)


@pytest.mark.parametrize(("name", "env"), VARIANTS, ids=[f"{n}, {e}" for n, e in VARIANTS])
def test_the_first_call_with_the_native_engine_off(name, env):
    _assert_ok(_run(CASES[name], env), name)


@pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None, reason="compiles the engine: needs g++")
@pytest.mark.parametrize("name", COLD)
def test_the_first_call_with_a_cold_engine_cache_compiles_the_engine_while_tracing(name, tmp_path):
    """The crash of issue 49: the engine loaded during the first trace became a guard of the graph."""
    if os.environ.get("ATTNKIT_NATIVE") == "0":
        pytest.skip("native engine turned off by ATTNKIT_NATIVE=0: there is no engine to build")
    cache = tmp_path / "cache"
    done = _run(CASES[name], {"ATTNKIT_CACHE": str(cache)}, timeout=900)
    _assert_ok(done, name)
    assert "native engine built" in done.stderr  # it was compiled in this process, under tracing


def test_the_cli_answers_help_as_a_first_call():
    done = subprocess.run([sys.executable, "-m", "attnkit.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "usage" in done.stdout.lower()
