"""Predicates and score mods written for one pair, as FlexAttention defines them: evaluated by
broadcasting only where that is proved to give the per-pair answer (attnkit._pointwise), else one
pair at a time; and the values they read, followed wherever they are reached (fingerprints for the
caches, captured tensors for the gradients). Each case that gave a silent wrong answer before is a
test here, against a float64 formula written in the test."""

from __future__ import annotations

import functools

import pytest
import torch
from _oracle import assert_oracle
from torch.nn.attention.flex_attention import and_masks, noop_mask, or_masks

import attnkit
from attnkit import masks
from attnkit._pointwise import broadcast_proved
from attnkit.flex import create_block_mask, flex_attention
from attnkit.kernels.native import build as native_build

L = 256
QI, KJ = torch.arange(L).view(-1, 1), torch.arange(L).view(1, -1)


def _qkv(dtype=torch.float64, requires_grad=False, b=1, h=2):
    return tuple(torch.randn(b, h, L, 16, dtype=dtype, requires_grad=requires_grad) for _ in range(3))


def formula(q, k, v, allowed, add=None):
    s = q @ k.transpose(-2, -1) / 4
    if add is not None:
        s = s + add
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0) @ v


def _exact(out, q, k, v, allowed, add=None):
    assert_oracle(out, formula(q.double(), k.double(), v.double(), allowed, add), formula(q, k, v, allowed, add))


# --- what may be broadcast -------------------------------------------------------------------------

G = torch.tensor([7])
DOCS = torch.arange(L) // 60
REL = torch.randn(2, 2 * L)


def _index():
    return (
        torch.arange(1).view(-1, 1, 1, 1),
        torch.arange(2).view(1, -1, 1, 1),
        QI.view(1, 1, -1, 1),
        KJ.view(1, 1, 1, -1),
    )


PROVED = {
    "comparisons and logic": lambda b, h, q, kv: (q >= kv) & ~((q - kv) % 3 == 1) | (kv == 0),
    "arithmetic and where": lambda b, h, q, kv: torch.where(q // 16 == kv // 16, q >= kv, (q - kv).abs() < 4),
    "an index into a captured table": lambda b, h, q, kv: (DOCS[q] == DOCS[kv]) & (q >= kv),
    "a 2-d table by (head, distance)": lambda b, h, q, kv: REL[h, q - kv + L] > 0,
    "casts and clamps": lambda b, h, q, kv: (q.float() * 0.5).long().clamp(max=50) >= kv.clamp(min=3),
    # torch's and_masks / or_masks start from b.new_ones(()) / b.new_zeros(()): a constant of a given size
    "torch's and_masks and or_masks": and_masks(lambda b, h, q, kv: q >= kv, or_masks(noop_mask, lambda *a: q0(a))),
}


def q0(args):
    return args[2] == 0


UNPROVED = {
    "a reduction over the tile": (lambda b, h, q, kv: (q >= kv) | torch.any(kv == G), "any is not elementwise"),
    "a shape read": (lambda b, h, q, kv: q >= kv - q.shape[2] + L, "reads the shape"),
    "a host read": (lambda b, h, q, kv: (q >= kv) if bool((kv > 0)[0, 0, 0, 0]) else q < 0, "indexes"),
    "an index of an index tensor": (lambda b, h, q, kv: q >= kv[..., :1], "indexes a tensor computed from"),
    "a view": (lambda b, h, q, kv: (q >= kv).reshape(-1).view(1, 1, L, L), "reshape is not elementwise"),
    "an in-place write": (lambda b, h, q, kv: q.clone().add_(0) >= kv, "in place"),
    "a partial index": (lambda b, h, q, kv: REL[h][..., 0] > 0, "indexes 1 of the 2 dimensions"),
    "a constant shaped like an index": (lambda b, h, q, kv: q.new_zeros(q.shape) <= kv, "reads the shape"),
}


@pytest.mark.parametrize("name", list(PROVED))
def test_elementwise_predicates_are_proved_and_broadcast(name):
    fn = PROVED[name]
    out, why = broadcast_proved(fn, *_index())
    assert why == "" and isinstance(out, torch.Tensor)
    q, k, v = _qkv()
    mask = masks.from_fn(fn)
    allowed = torch.vmap(torch.vmap(lambda i, j: fn(torch.tensor(0), torch.tensor(0), i, j), (None, 0)), (0, None))(
        torch.arange(L), torch.arange(L)
    )  # per pair, as FlexAttention defines it
    _exact(attnkit.attention(q, k, v, mask), q, k, v, allowed)


@pytest.mark.parametrize("name", list(UNPROVED))
def test_what_is_not_elementwise_is_not_broadcast(name):
    fn, why = UNPROVED[name]
    out, found = broadcast_proved(fn, *_index())
    assert out is None and why in found, found


def test_a_mask_mod_that_reduces_a_captured_tensor_means_one_pair():
    """(q >= kv) | any(kv == G) for a one-element G: per pair, key 7 is visible to every query;
    evaluated on a tile it was true for every pair of any tile holding key 7 (off by 1.95)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) | torch.any(kv_idx == G)

    allowed = (QI >= KJ) | (KJ == 7)
    q, k, v = _qkv()
    _exact(flex_attention(q, k, v, block_mask=create_block_mask(mask_mod, None, None, L, L)), q, k, v, allowed)
    _exact(attnkit.attention(q, k, v, masks.from_fn(mask_mod)), q, k, v, allowed)
    for kernel in ("native", "fused", "math", "sdpa", "reference"):  # the plan is the one truth for each kernel
        if kernel == "native" and not native_build.available():
            continue  # ATTNKIT_NATIVE=0 or no compiler: the other kernels still answer
        with attnkit.use_kernels(kernel):
            if attnkit.explain(q.float(), k.float(), v.float(), masks.from_fn(mask_mod)).kernel == kernel:
                qf, kf, vf = (t.float() for t in (q, k, v))
                _exact(attnkit.attention(qf, kf, vf, masks.from_fn(mask_mod)), qf, kf, vf, allowed)


def test_a_score_mod_that_reduces_a_captured_tensor_means_one_pair():
    """score + 2 * any(kv == G): per pair, +2 on key 7 only (off by 0.61 when evaluated per tile)."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + 2 * torch.any(kv_idx == G)

    q, k, v = _qkv()
    everything = torch.ones(L, L, dtype=torch.bool)
    _exact(flex_attention(q, k, v, score_mod=score_mod), q, k, v, everything, 2.0 * (KJ == 7))
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    out = attnkit.attention(qf, kf, vf, masks.causal(), score_mod=score_mod, kernel="tiled")
    _exact(out.detach(), qf.detach(), kf.detach(), vf.detach(), QI >= KJ, 2.0 * (KJ == 7))


# --- the values a predicate reads, wherever they are reached ----------------------------------------


class Cfg:
    W = 2


class Holder:
    def __init__(self):
        self.W = 2

    def within(self, b, h, q, kv):
        return (q - kv).abs() <= self.W


class Width(int):
    """An int that carries more than its value."""


def _within(w):
    return (QI - KJ).abs() <= w


def _class_reads():
    """``(predicate, change)`` by how it reaches a class or object whose attribute changes."""
    holder = Holder()
    cls = Cfg

    def via_closure(b, h, q, kv):
        return (q - kv).abs() <= cls.W

    def via_default(b, h, q, kv, c=Cfg):
        return (q - kv).abs() <= c.W

    def via_partial(b, h, q, kv, c):
        return (q - kv).abs() <= c.W

    def via_getattr(b, h, q, kv):
        return (q - kv).abs() <= getattr(Cfg, "W")  # noqa: B009 - how the user wrote it

    class WithClassmethod:
        W = 2

        @classmethod
        def within(cls, b, h, q, kv):
            return (q - kv).abs() <= cls.W

    def bump_cfg(w):
        Cfg.W = w

    def bump_holder(w):
        holder.W = w

    def bump_classmethod(w):
        WithClassmethod.W = w

    return {
        "a closure cell": (via_closure, bump_cfg),
        "a default": (via_default, bump_cfg),
        "a functools.partial": (functools.partial(via_partial, c=Cfg), bump_cfg),
        "getattr": (via_getattr, bump_cfg),
        "a classmethod": (WithClassmethod.within, bump_classmethod),
        "an instance's method": (holder.within, bump_holder),
    }


@pytest.mark.parametrize("name", list(_class_reads()))
def test_a_class_or_object_is_followed_wherever_it_is_reached(name):
    """A user class reached through a closure cell, a default, a partial, a classmethod or getattr
    was keyed by identity: the W=2 mask was served after W = 9 (off by 2.04)."""
    fn, change = _class_reads()[name]
    change(2)
    try:
        mask = masks.from_fn(fn)
        q, k, v = _qkv()
        _exact(attnkit.attention(q, k, v, mask), q, k, v, _within(2))
        change(9)
        _exact(attnkit.attention(q, k, v, mask), q, k, v, _within(9))
        bm = create_block_mask(fn, None, None, L, L)
        change(4)
        _exact(flex_attention(q, k, v, block_mask=create_block_mask(fn, None, None, L, L)), q, k, v, _within(4))
        assert bm.mask_key != create_block_mask(fn, None, None, L, L).mask_key
    finally:
        change(2)


def test_an_int_subclass_is_keyed_by_its_attributes_too():
    a, b = Width(2), Width(2)
    a.extra, b.extra = 1, 2
    assert (
        masks.from_fn(lambda b_, h, q, kv: q - kv <= a).value_key()
        != masks.from_fn(lambda b_, h, q, kv: q - kv <= b).value_key()
    )
    assert attnkit._cache.fingerprint(lambda: a) != attnkit._cache.fingerprint(lambda: 2)


# --- learnable tensors a score_mod reads through attributes ------------------------------------------


class Slopes:
    slope = torch.tensor([0.5, 0.25], dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("qkv_grad", [True, False])
def test_a_learnable_class_attribute_gets_its_gradient(qkv_grad):
    """cfg.slope[h] read through a class attribute got .grad None (with q, k, v not requiring grad:
    an in-place RuntimeError in the backward)."""

    def alibi(score, b, h, q_idx, kv_idx):
        return score + Slopes.slope[h] * (kv_idx - q_idx)

    Slopes.slope.grad = None
    q, k, v = _qkv(torch.float32, requires_grad=qkv_grad)
    out = flex_attention(
        q, k, v, score_mod=alibi, block_mask=create_block_mask(lambda b, h, i, j: i >= j, None, None, L, L)
    )
    g = torch.randn_like(out)
    out.backward(g)
    slope = Slopes.slope.detach().clone().requires_grad_()
    add = slope.view(1, 2, 1, 1) * (KJ - QI)
    formula(*(t.detach().double() for t in (q, k, v)), (QI >= KJ), add).backward(g.double())
    assert Slopes.slope.grad is not None
    torch.testing.assert_close(Slopes.slope.grad, slope.grad, rtol=1e-4, atol=1e-3)


def test_a_captured_tensor_the_score_mod_never_reads_keeps_grad_none():
    """Gradients of tensors that do not reach the output stay None, as autograd leaves them (they were
    zeros: an optimizer's weight decay then moved them)."""
    unused = torch.zeros(3, requires_grad=True)
    used = torch.ones(2, requires_grad=True)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * used[h] if unused is not None else score

    q, k, v = _qkv(torch.float32, requires_grad=True)
    for kernel in ("tiled", "reference"):
        unused.grad = used.grad = None
        attnkit.attention(q, k, v, masks.causal(), score_mod=score_mod, kernel=kernel).sum().backward()
        assert unused.grad is None and used.grad is not None, kernel
