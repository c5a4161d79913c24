"""FlexAttention's idioms as Flex users write them, on attnkit.flex: torch.compile(flex_attention)
with a BlockMask made outside (attnkit's or torch's) or inside, torch.export, torch.func; every
answer against the float64 formula (TESTING.md's rule), and the plan made outside found under
tracing (the kernel visits only the blocks it keeps)."""

from __future__ import annotations

import pytest
import torch
from _oracle import assert_oracle
from torch.nn.attention import flex_attention as torch_flex

from attnkit import flex
from attnkit.masks._codes import EMPTY

L = 384


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


DOCS = torch.arange(L) // 100  # four documents, the last one short


def document_causal(b, h, q_idx, kv_idx):
    return (DOCS[q_idx] == DOCS[kv_idx]) & (q_idx >= kv_idx)


def _dense(mask_mod, lq=L, lk=L, b=1, h=1):
    i, j = torch.arange(lq).view(-1, 1), torch.arange(lk).view(1, -1)
    out = torch.stack(
        [torch.stack([mask_mod(torch.tensor(x), torch.tensor(y), i, j) for y in range(h)]) for x in range(b)]
    )
    return out.expand(b, h, lq, lk)


def formula(q, k, v, allowed, score_mod=None):
    """softmax(q k^T / sqrt(D) (+ score_mod), masked) v, in q's dtype (rows that see nothing: 0)."""
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if score_mod is not None:
        b, h = (torch.arange(n).view(*shape) for n, shape in ((s.shape[0], (-1, 1, 1, 1)), (s.shape[1], (1, -1, 1, 1))))
        s = score_mod(s, b, h, torch.arange(s.shape[2]).view(1, 1, -1, 1), torch.arange(s.shape[3]).view(1, 1, 1, -1))
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0) @ v


def _inputs(b=2, h=2, lq=L, lk=L, d=32, requires_grad=True):
    return tuple(torch.randn(b, h, n, d, requires_grad=requires_grad) for n in (lq, lk, lk))


def _check(out, q, k, v, allowed, score_mod=None, grads=None, factor=2.0, grad_factor=3.0):
    gold = formula(q.detach().double(), k.detach().double(), v.detach().double(), allowed, score_mod)
    naive = formula(q.detach(), k.detach(), v.detach(), allowed, score_mod)
    assert_oracle(out.detach(), gold, naive, factor=factor)
    if grads is None:
        return
    g = torch.randn_like(gold)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    formula(*ref, allowed, score_mod).backward(g)
    naive_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    formula(*naive_in, allowed, score_mod).backward(g.float())
    for got, want, nv in zip(grads(g.float()), ref, naive_in):
        assert_oracle(got, want.grad, nv.grad, factor=grad_factor, what="gradient")


class _Visits:
    """A torch.compile backend that runs the captured graph as it is and records, per call, how many
    blocks the block-sparse operator in it is handed as graph inputs (from outside the graph): the
    sum of the plan's ``kv_num`` (the native engine's operands) or, where the PyTorch engine runs
    (``ATTNKIT_NATIVE=0``), the non-empty entries of the plan's block ``codes``."""

    def __init__(self):
        self.kept: list[int] = []
        self.ops: list[str] = []

    def __call__(self, gm, example_inputs):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "attnkit" in str(n.target)]
        at = [i for i, n in enumerate(placeholders) if n.name.endswith("kv_num")]
        codes = [i for i, n in enumerate(placeholders) if n.name.endswith("plan_codes")]

        def run(*args):
            if at:
                self.kept += [int(args[i].sum()) for i in at]
            else:
                self.kept += [int((args[i] != EMPTY).sum()) for i in codes]
            return gm(*args)

        return run


@pytest.mark.parametrize("how", ["default", "fullgraph", "dynamic"])
def test_compiled_flex_attention_with_a_block_mask_made_outside(how):
    """torch.compile(flex_attention), the standard idiom, with attnkit's BlockMask made outside: forward
    and backward exact; the plan made outside is what the kernel reads (its kept blocks, not all)."""
    torch._dynamo.reset()
    options = {"default": {}, "fullgraph": {"fullgraph": True}, "dynamic": {"dynamic": True}}[how]
    bm = flex.create_block_mask(document_causal, None, None, L, L)
    q, k, v = _inputs()
    out = torch.compile(flex.flex_attention, **options)(q, k, v, block_mask=bm)
    allowed = _dense(document_causal)
    _check(out, q, k, v, allowed, grads=lambda g: torch.autograd.grad(out, (q, k, v), g))
    torch._dynamo.reset()
    visits = _Visits()
    torch.compile(flex.flex_attention, backend=visits, **options)(q, k, v, block_mask=bm)
    plan = bm.plan
    assert any("forward" in op for op in visits.ops), visits.ops  # one block-sparse operator in the graph
    assert visits.kept == [int(plan.kv_num.sum())]  # handed the plan made outside: its kept blocks
    assert plan.kept < 0.5  # about a third of the blocks


def test_compiled_flex_attention_with_torchs_block_mask_and_one_made_inside():
    torch._dynamo.reset()
    q, k, v = _inputs()
    allowed = _dense(document_causal)
    # without attnkit's plan the mask is a dense mask of SDPA in the graph: torch's backward, whose float32
    # dq strays up to ~6x the naive formula's error on this problem (measured), not attnkit's kernel
    sdpa = {"grad_factor": 8.0}
    theirs = torch_flex.create_block_mask(document_causal, None, None, L, L, device="cpu")
    out = torch.compile(flex.flex_attention, fullgraph=True)(q, k, v, block_mask=theirs)
    _check(out, q, k, v, allowed, grads=lambda g: torch.autograd.grad(out, (q, k, v), g), **sdpa)

    @torch.compile(fullgraph=True)
    def inside(q, k, v):
        return flex.flex_attention(q, k, v, block_mask=flex.create_block_mask(document_causal, None, None, L, L))

    out = inside(q, k, v)
    _check(out, q, k, v, allowed, grads=lambda g: torch.autograd.grad(out, (q, k, v), g), **sdpa)


def test_compiled_create_block_mask_is_torchs_traced_and_runs_eagerly():
    """torch.compile(create_block_mask), as torch's docs advise: the BlockMask it returns is exact."""
    torch._dynamo.reset()
    bm = torch.compile(flex.create_block_mask)(document_causal, None, None, L, L)
    made = flex.create_block_mask(document_causal, None, None, L, L)
    assert torch.equal(bm.to_dense(), made.to_dense())
    q, k, v = _inputs()
    _check(flex.flex_attention(q, k, v, block_mask=bm), q, k, v, _dense(document_causal))


def test_compiled_flex_attention_with_a_learnable_score_mod():
    torch._dynamo.reset()
    rel = torch.randn(2, 2 * L, requires_grad=True)

    def relative(score, b, h, q_idx, kv_idx):
        return score + rel[h, q_idx - kv_idx + L]

    q, k, v = _inputs()
    bm = flex.create_block_mask(causal, None, None, L, L)
    out = torch.compile(flex.flex_attention, fullgraph=True)(q, k, v, score_mod=relative, block_mask=bm)
    allowed = _dense(causal)
    got, upstream = [], []

    def gradients(g):
        upstream.append(g)
        got.extend(torch.autograd.grad(out, (q, k, v, rel), g))
        return got[:3]

    _check(out, q, k, v, allowed, relative, grads=gradients)
    g = upstream[0]
    ref = rel.detach().double().requires_grad_()

    def relative64(score, b, h, q_idx, kv_idx):
        return score + ref[h, q_idx - kv_idx + L]

    formula(*(t.detach().double() for t in (q, k, v)), allowed, relative64).backward(g.double())
    torch.testing.assert_close(got[3].double(), ref.grad, atol=1e-3, rtol=1e-3)


def test_a_reused_block_mask_sees_its_mask_mods_new_values_eager_and_compiled():
    """torch's rule for a BlockMask reused after what its mask_mod reads changed in place: its full
    blocks as listed, its partial blocks by the mask_mod now (attnkit served the first call's mask)."""
    torch._dynamo.reset()
    width = torch.tensor([3])

    def window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= width[0]

    bm = flex.create_block_mask(window, None, None, L, L)
    q, k, v = _inputs(requires_grad=False)
    compiled = torch.compile(flex.flex_attention, fullgraph=True)
    for out in (flex.flex_attention(q, k, v, block_mask=bm), compiled(q, k, v, block_mask=bm)):
        _check(out, q, k, v, _dense(window))
    width[0] = 40
    i, j = torch.arange(L).view(-1, 1), torch.arange(L).view(1, -1)
    listed = flex.BlockMask.to_dense(bm)[0, 0]  # (nq, nk) 0/1: the blocks listed at all
    full = torch.zeros_like(listed, dtype=torch.bool)
    nfull = bm.full_kv_num_blocks[0, 0]
    for r in range(full.shape[0]):
        full[r, bm.full_kv_indices[0, 0, r, : nfull[r]].long()] = True
    bq, bk = bm.BLOCK_SIZE
    block_full, block_listed = full[i // bq, j // bk], listed.bool()[i // bq, j // bk]
    torch_rule = block_full | (block_listed & window(0, 0, i, j))
    for out in (flex.flex_attention(q, k, v, block_mask=bm), compiled(q, k, v, block_mask=bm)):
        _check(out, q, k, v, torch_rule)
    theirs = torch_flex.flex_attention(q, k, v, block_mask=bm)  # torch's own eager answer on the same BlockMask
    torch.testing.assert_close(flex.flex_attention(q, k, v, block_mask=bm), theirs, atol=1e-5, rtol=1e-5)


def test_export_of_a_module_calling_flex_attention_with_a_block_mask_made_outside():
    bm = flex.create_block_mask(document_causal, None, None, L, L)

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return flex.flex_attention(q, k, v, block_mask=bm)

    q, k, v = _inputs(requires_grad=False)
    program = torch.export.export(Attend(), (q, k, v))
    q2, k2, v2 = _inputs(requires_grad=False)
    _check(program.module()(q2, k2, v2), q2, k2, v2, _dense(document_causal))


@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev", "vmap"])
def test_torch_func_with_create_block_mask_inside(transform):
    """torch.func over a function that makes its BlockMask inside: exact (it failed reading the
    transform's tensors' bytes)."""
    lq = 64
    q, k, v = _inputs(b=1, h=2, lq=lq, lk=lq, d=8, requires_grad=False)
    allowed = _dense(causal, lq, lq)

    def attend(q):
        bm = flex.create_block_mask(causal, None, None, lq, lq)
        return flex.flex_attention(q, k, v, block_mask=bm)

    gold_in = q.double().requires_grad_()
    gold = formula(gold_in, k.double(), v.double(), allowed)
    if transform == "vmap":
        got = torch.func.vmap(attend)(torch.stack([q, 2 * q]))
        _check(got[1], 2 * q, k, v, allowed)
        _check(got[0], q, k, v, allowed)
        return
    if transform == "grad":
        got = torch.func.grad(lambda q: attend(q).sum())(q)
        (want,) = torch.autograd.grad(gold.sum(), gold_in)
    elif transform == "vjp":
        out, pullback = torch.func.vjp(attend, q)
        cot = torch.randn_like(out)
        (got,) = pullback(cot)
        (want,) = torch.autograd.grad(gold, gold_in, cot.double())
    else:
        got = torch.func.jacrev(lambda q: attend(q)[0, 0, -1, :2])(q)  # (2, B, H, L, D)
        want = torch.stack([torch.autograd.grad(gold[0, 0, -1, i], gold_in, retain_graph=True)[0] for i in range(2)])
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)


def test_compiled_paged_decoding_with_a_score_mod_that_indexes_by_page():
    """torch's PagedAttention's score_mod maps a physical key to its logical position, -1 pages and all:
    indexing a relative bias there goes out of range on the pages a sequence does not own, which
    FlexAttention never asks (it skips the blocks a BlockMask leaves out). Compiled, the plain formula
    evaluates the score_mod only at pairs the mask keeps: no out-of-range read, the float64 answer."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention

    torch._dynamo.reset()
    page, heads, d, batch, length = 64, 2, 16, 2, 128
    rel = torch.randn(2 * length)

    def relative(score, b, h, q_idx, kv_idx):
        return score + rel[q_idx - kv_idx + length]

    n_pages = (batch + 3) * length // page
    paged = PagedAttention(n_pages, page, batch + 3, device="cpu")
    for b in range(batch):  # pages taken in turns: a sequence's pages are not contiguous
        paged.reserve(torch.tensor(b), torch.tensor(length // 2))
    for b in range(batch):
        paged.reserve(torch.tensor(b), torch.tensor(length))
    q, k, v = (torch.randn(batch, heads, length, d) for _ in range(3))
    k_cache, v_cache = torch.zeros(1, heads, n_pages * page, d), torch.zeros(1, heads, n_pages * page, d)
    positions = torch.arange(length)[None].expand(batch, length)
    paged.assign(torch.arange(batch), positions, k, v, k_cache, v_cache)
    lengths = torch.full((batch,), length)
    logical = flex.create_block_mask(causal, batch, None, length, length, BLOCK_SIZE=(length, page))
    physical = paged.convert_logical_block_mask(logical, kv_len=lengths)
    score_mod = paged.get_score_mod(relative, kv_len=lengths)
    out = torch.compile(flex.flex_attention)(q, k_cache, v_cache, score_mod=score_mod, block_mask=physical)
    _check(out, q, k, v, _dense(causal, length, length, b=batch, h=heads), relative)


def test_compiled_score_mod_indexing_through_a_chain_with_a_0d_index():
    """``bias[b][h][which, q_idx]`` with a captured 0-d ``which``: one pair at a time under vmap, traced
    by dynamo as an indexing operation (not a Python int read), exact."""
    torch._dynamo.reset()
    bias = torch.randn(2, 2, 4, L)
    which = torch.tensor(1)

    def chained(score, b, h, q_idx, kv_idx):
        return score + bias[b][h][which, q_idx]

    def chained64(score, b, h, q_idx, kv_idx):
        return score + bias.to(score.dtype)[b, h, 1, q_idx]

    q, k, v = _inputs(requires_grad=False)
    out = torch.compile(flex.flex_attention)(q, k, v, score_mod=chained)
    _check(out, q, k, v, torch.ones(L, L, dtype=torch.bool), chained64)


def test_compiled_dynamic_score_mod_with_an_int_closure():
    """``dynamic=True`` makes a closure's int symbolic; ALiBi's ``8.0 / num_heads`` on it is elementwise,
    proved so while dynamo traces and evaluated by broadcasting (vmap cannot divide by a SymInt)."""
    torch._dynamo.reset()

    def alibi_of(num_heads):
        def alibi(score, b, h, q_idx, kv_idx):
            return score + (kv_idx - q_idx) * torch.exp2(-((h + 1) * 8.0 / num_heads))

        return alibi

    q, k, v = _inputs(requires_grad=False)
    out = torch.compile(flex.flex_attention, dynamic=True)(q, k, v, score_mod=alibi_of(8))
    _check(out, q, k, v, torch.ones(L, L, dtype=torch.bool), alibi_of(8))


def test_create_block_mask_under_compile_where_torchs_attribute_is_attnkits(monkeypatch):
    """A program that puts attnkit's create_block_mask in torch's module (as a shim running torch's own
    tests does) still traces torch's under torch.compile: no recursion."""
    torch._dynamo.reset()
    monkeypatch.setattr(torch_flex, "create_block_mask", flex.create_block_mask)
    bm = torch.compile(flex.create_block_mask)(document_causal, None, None, L, L)
    assert torch.equal(bm.to_dense(), flex.create_block_mask(document_causal, None, None, L, L).to_dense())


def test_make_fx_of_flex_attention_traces_and_runs():
    """make_fx (what torch.func transforms and export build on) traces a function calling flex_attention
    with a score_mod: nothing reads a tensor on the host while it traces; the graph's answer is exact."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def floor_bias(score, b, h, q_idx, kv_idx):
        return score - q_idx // (1 + kv_idx)

    q, k, v = _inputs(lq=16, requires_grad=False)
    gm = make_fx(lambda q, k, v: flex.flex_attention(q, k, v, score_mod=floor_bias))(q, k, v)
    _check(gm(q, k, v), q, k, v, torch.ones(16, L, dtype=torch.bool), floor_bias)


def test_dynamic_compiles_once_for_new_lengths_and_batches():
    """``torch.compile(..., dynamic=True)`` as PyTorch's own dynamic test uses it: BlockMasks made for
    three lengths (two batches), each call's answer exact, one compiled frame for all of them (the
    plan's lengths are symbols in the graph, and a tile's sizes stay static, so no guard fixes a length)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(flex.flex_attention, backend=counter, dynamic=True)
    # sizes 0 and 1 are always specialised, and equal sizes are tied at the first compile (duck
    # sizing): the shapes avoid both, as PyTorch's test does
    for batch, length in ((2, 1024), (4, 512), (4, 256)):
        g = torch.Generator().manual_seed(length)
        q, k, v = (torch.randn(batch, 3, length, 32, generator=g) for _ in range(3))
        bm = flex.create_block_mask(causal, 1, 1, length, length)
        out = compiled(q, k, v, block_mask=bm)
        allowed = _dense(causal, length, length)
        gold = formula(q.double(), k.double(), v.double(), allowed)
        assert_oracle(out, gold, formula(q, k, v, allowed), what=f"L={length}")
        assert counter.frame_count == 1, (length, counter.frame_count)
