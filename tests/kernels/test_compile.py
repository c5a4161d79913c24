"""torch.compile(fullgraph=True) keeps block sparsity: the tiled kernel runs as custom ops over a
PreparedMask made outside the compiled function (as FlexAttention's block masks are)."""

from __future__ import annotations

import pytest
import torch
import torch.utils._python_dispatch
from _oracle import ENGINES, assert_oracle, gold_and_naive, pin_engine, randn

import attnkit
from attnkit import masks

L = 2048


def largest_allocation(fn) -> int:
    """Bytes of the largest single allocation while ``fn`` runs (the allocating op's own memory)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.self_cpu_memory_usage for e in prof.events() if e.name != "[memory]"), default=0)


def _documents(count, length=L):
    return masks.document(torch.repeat_interleave(torch.arange(count), length // count)) & masks.causal()


def _step(q, k, v, prepared, sinks=None):
    out = attnkit.attention(q, k, v, prepared, sinks=sinks)
    return out.square().sum()


@pytest.mark.parametrize("engine", ENGINES)
def test_compiled_training_step_keeps_block_sparsity(engine, monkeypatch, request):
    """Each block-sparse kernel under torch.compile: native as its own operator, fused and math as
    the walk's custom op, the plan passed as tensors."""
    pin_engine(request, engine)
    torch._dynamo.reset()
    q, k, v = (randn(1, 4, L, 32, requires_grad=True) for _ in range(3))
    prepared = attnkit.prepare(_documents(8), L, L)
    compiled = torch.compile(_step, fullgraph=True)
    compiled(q, k, v, prepared).backward()  # compile once
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    _step(q, k, v, prepared).backward()  # eager
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad, atol=1e-5, rtol=1e-4)

    def run():
        compiled(q, k, v, prepared).backward()

    sparse = largest_allocation(run)
    assert sparse <= q.numel() * 4  # O(L): the size of q itself, never Lq x Lk
    dense_mask = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, _documents(8)).square().sum(), fullgraph=True)
    dense_mask(q, k, v).backward()
    assert largest_allocation(lambda: dense_mask(q, k, v).backward()) >= L * L  # what a mask object costs there


@pytest.mark.parametrize("engine", ["native", "fused"])
def test_a_new_prepared_mask_runs_the_same_compiled_graph(engine, monkeypatch, request):
    pin_engine(request, engine)
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    q, k, v = (randn(1, 2, 512, 16, requires_grad=True) for _ in range(3))
    compiled = torch.compile(_step, fullgraph=True, backend=backend)
    for count in (4, 8, 16):  # other layouts, the same shapes: the plan's tensors are inputs, not constants
        prepared = attnkit.prepare(_documents(count, 512), 512, 512)
        loss = compiled(q, k, v, prepared)
        assert torch.allclose(loss, _step(q, k, v, prepared), rtol=1e-5)
        loss.backward()
    assert len(graphs) == 1
    op = {"native": "torch.ops.attnkit.native_forward", "fused": "torch.ops.attnkit.tiled_forward"}[engine]
    assert op in graphs[0].code, graphs[0].code


def test_compiled_sinks_and_lse_gradients():
    torch._dynamo.reset()
    q, k, v = (randn(2, 2, 300, 16, requires_grad=True) for _ in range(3))
    sinks = torch.randn(2, requires_grad=True)
    prepared = attnkit.prepare(masks.sliding_window(40) & masks.causal(), 300, 300)

    def step(q, k, v, prepared, sinks):
        out, lse = attnkit.attention(q, k, v, prepared, sinks=sinks, return_lse=True)
        return out.square().sum() + lse.sum()

    compiled = torch.compile(step, fullgraph=True)
    got = torch.autograd.grad(compiled(q, k, v, prepared, sinks), (q, k, v, sinks))
    want = torch.autograd.grad(step(q, k, v, prepared, sinks), (q, k, v, sinks))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_explain_under_compile_names_the_custom_op():
    q = randn(1, 2, 256, 16)
    prepared = attnkit.prepare(_documents(4, 256), 256, 256)
    seen = []

    def f(q, prepared):
        seen.append(str(attnkit.explain(q, q, q, prepared)))
        seen.append(str(attnkit.explain(q, q, q, _documents(4, 256))))
        return q

    torch.compile(f, fullgraph=True)(q, prepared)
    assert "over the PreparedMask's tensors" in seen[0]
    assert seen[1].startswith("sdpa: under torch.compile")


@pytest.mark.parametrize("name", ["none", "causal", "window", "padding", "document"])
def test_compile_fullgraph_with_no_graph_breaks(name):
    torch._dynamo.reset()
    cases = {
        "none": None,
        "causal": masks.causal(),
        "window": masks.sliding_window(8),
        "padding": masks.padding(torch.tensor([40, 64])),
        "document": masks.document(torch.arange(64) // 16),
    }
    mask = cases[name]
    q, k, v = randn(2, 4, 64, 16), randn(2, 4, 64, 16), randn(2, 4, 64, 16)
    compiled = torch.compile(attnkit.attention, fullgraph=True, backend="eager")
    got = compiled(q, k, v, mask)
    gold, naive = gold_and_naive(q, k, v, None if mask is None else mask.materialize(64, 64))
    assert_oracle(got, gold, naive)
    assert_oracle(attnkit.attention(q, k, v, mask), gold, naive)
    explained = torch._dynamo.explain(attnkit.attention)(q, k, v, mask)
    assert explained.graph_break_count == 0


def test_traced_as_constant_marks_what_torchs_decorator_marks():
    """attnkit's stand-in for ``torch.compiler.assume_constant_result`` (which imports torch._dynamo):
    it sets the attributes torch's sets, and dynamo then takes its answer as a constant."""
    from attnkit._validate import traced_as_constant

    def ours():
        return 1

    def theirs():
        return 1

    before = set(vars(theirs))
    torch.compiler.assume_constant_result(theirs)
    traced_as_constant(ours)
    marked = {name: value for name, value in vars(theirs).items() if name not in before}
    assert marked and {name: vars(ours).get(name) for name in marked} == marked

    calls = []

    @traced_as_constant
    def state():
        calls.append(1)
        return len(calls)

    f = torch.compile(lambda x: x * state(), fullgraph=True, backend="eager")
    x = torch.ones(2)
    assert torch.equal(f(x), x) and torch.equal(f(x), x)  # the answer of the trace, not a guard's re-read
