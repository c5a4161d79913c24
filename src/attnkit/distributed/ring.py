"""Ring attention: exact attention over a sequence split across the ranks of a process group.

Every rank holds a part of the queries and of the keys/values (see
:mod:`attnkit.distributed.layout`). In step ``s`` of ``W``, rank r receives the
keys/values of rank ``(r - s) % W`` that its queries may attend (whole pieces, or the
range of a piece that the mask reaches) and sends its own to rank ``(r + s) % W``,
posting step ``s + 1``'s transfers before computing step s.
Each (query piece, key piece) rectangle is one :func:`attnkit.attention` call on the
global mask's part (:meth:`attnkit.masks.Mask.part`); the partial results merge by
log-sum-exp in float32. Keys nobody at that distance may attend are never sent.

The backward pass runs the ring again: each rank recomputes its rectangles,
accumulates dQ and sends the partial dK/dV of each received piece back to its owner.
"""

from __future__ import annotations

import datetime
import math
import time
import zlib
from typing import Any

import torch
import torch.distributed as dist

from attnkit import bias as _bias
from attnkit._validate import AttnkitError, AttnkitTypeError, AttnkitValueError, short
from attnkit.bias import BiasLike
from attnkit.call import check_qkv, make_call
from attnkit.distributed import layout as _layout
from attnkit.functional import attention
from attnkit.kernels import registry
from attnkit.kernels.lse import accumulator_dtype, add_sinks, merge_into
from attnkit.masks import Mask
from attnkit.plan import MaskLike

__all__ = ["RingError", "ring_attention"]

#: Seconds a rank waits for any transfer before failing (every collective is bounded).
DEFAULT_TIMEOUT = 300.0

_GRAD_TAG = 1 << 16

#: Seconds the ranks that are alive get to deliver once one peer has failed.
_GRACE = 5.0


class RingError(AttnkitError, RuntimeError):
    """A rank of the ring failed, died or disagreed with the others."""


class RingGroup:
    """The process group, this rank, and transfers that fail with a clear error."""

    def __init__(self, group: dist.ProcessGroup | None, timeout: float):
        if not dist.is_available() or not dist.is_initialized():
            if group is not None:
                raise AttnkitValueError("group= was given but torch.distributed is not initialized.")
            self.group, self.rank, self.size = None, 0, 1
        else:
            self.group = group
            self.rank = dist.get_rank(group)
            self.size = dist.get_world_size(group)
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise AttnkitValueError(f"timeout must be a positive number of seconds, but got {short(timeout)}.")
        self.timeout = float(timeout)

    def global_rank(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def wait(self, work: Any, peer: int | None, what: str, timeout: float | None = None) -> None:
        try:
            done = work.wait(datetime.timedelta(seconds=self.timeout if timeout is None else timeout))
        except Exception as e:  # gloo/NCCL raise RuntimeError subclasses with long texts
            raise self.error(peer, what, e) from e
        if done is False:
            raise self.error(peer, what, None)

    def error(self, peer: int | list[int] | None, what: str, cause: BaseException | None) -> RingError:
        peers = [] if peer is None else list(peer) if isinstance(peer, (list, tuple)) else [peer]
        if peers and all(f"rank {p}" in what for p in peers):  # the peers are named already: refer back
            who, whose = ("It", "its error") if len(peers) == 1 else ("They", "their errors")
        elif peers:
            who = " and ".join(f"rank {p}" for p in peers)
            who, whose = who[0].upper() + who[1:], "that rank's error" if len(peers) == 1 else "their errors"
        else:
            who, whose = "Another rank", "that rank's error"
        detail = f" ({str(cause).splitlines()[0][:200]})" if cause is not None else ""
        return RingError(
            f"ring attention on rank {self.rank}: {what} failed or did not finish within {self.timeout:g} s"
            f"{detail}. {who} may have died, raised, or not called ring_attention with the same arguments; "
            f"see {whose}."
        )

    def all_gather(self, t: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape everywhere), by point-to-point transfers so that a
        failure names the ranks that did not answer.

        A peer that fails does not stop this rank from delivering ``t`` to the others: every
        transfer is posted and waited for on its own before the error is raised, so the ranks
        that are alive all name the rank that failed rather than each other.
        """
        if self.size == 1:
            return [t]
        out = [t if r == self.rank else torch.empty_like(t) for r in range(self.size)]
        failed: dict[int, Exception] = {}
        sends: list = []
        recvs: list = []
        for r in range(self.size):
            if r == self.rank:
                continue
            for pending, transfer in ((sends, ([(r, t, 0)], [])), (recvs, ([], [(r, out[r], 0)]))):
                try:
                    pending += self.exchange(*transfer)
                except RingError as e:
                    failed.setdefault(r, e)
        deadline = time.monotonic() + self.timeout
        for work, peer, label in recvs + sends:  # receives first, in rank order
            # once a peer has failed, the others get a short grace to deliver, not the whole timeout
            left = deadline - time.monotonic() if not failed else min(_GRACE, deadline - time.monotonic())
            try:
                self.wait(work, peer, f"{what}: {label}", timeout=max(left, 0.01))
            except RingError as e:
                failed.setdefault(peer, e)
        if failed:
            peers = sorted(failed)
            first = failed[peers[0]]
            if len(peers) == 1:
                raise first
            raise self.error(peers, what, first.__cause__) from first
        return out

    def exchange(self, sends: list, recvs: list) -> list:
        """Post point-to-point transfers: ``sends``/``recvs`` are ``(peer, tensor, tag)``."""
        ops = [dist.P2POp(dist.isend, t, self.global_rank(p), self.group, tag) for p, t, tag in sends]
        ops += [dist.P2POp(dist.irecv, t, self.global_rank(p), self.group, tag) for p, t, tag in recvs]
        if not ops:
            return []
        peers = [(p, "sending to") for p, _, _ in sends] + [(p, "receiving from") for p, _, _ in recvs]
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as e:  # a peer that is gone can fail the posting itself
            named = sorted({p for p, _ in peers})
            raise self.error(
                named[0] if len(named) == 1 else None, f"{' and '.join(f'{verb} rank {p}' for p, verb in peers)}", e
            ) from e
        return [(w, p, f"{verb} rank {p}") for w, (p, verb) in zip(works, peers)]

    def finish(self, pending: list) -> None:
        for work, peer, what in pending:
            self.wait(work, peer, what)


# --- the call's description, checked the same on every rank -------------------------------


def _fingerprint(obj) -> int:
    """A number that differs when two ranks hold different masks or biases."""
    if obj is None:
        return 0
    held = obj.tensors() if isinstance(obj, Mask) else tuple(obj.params())
    crc = zlib.crc32(repr(obj).encode())
    for t in held:
        t = t.detach().cpu().contiguous()
        crc = zlib.crc32(str((tuple(t.shape), t.dtype)).encode(), crc)
        crc = zlib.crc32(t.view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b"", crc)
    return crc


_FIELDS = (
    "batch",
    "query heads",
    "key heads",
    "head size",
    "value size",
    "query dtype",
    "local query length",
    "local key length",
    "layout",
    "mask",
    "bias",
    "softcap",
    "scale",
    "sinks",
)


def _describe(q, k, v, mask, attn_bias, softcap, scale, sinks, layout) -> torch.Tensor:
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    values = [
        math.prod(q.shape[:-3]),
        q.shape[-3],
        k.shape[-3],
        q.shape[-1],
        v.shape[-1],
        dtypes.index(q.dtype) if q.dtype in dtypes else -1,
        q.shape[-2],
        k.shape[-2],
        _layout.LAYOUTS.index(layout),
        _fingerprint(mask),
        _fingerprint(attn_bias),
        zlib.crc32(repr(softcap).encode()),
        zlib.crc32(repr(scale).encode()),
        0 if sinks is None else zlib.crc32(sinks.detach().cpu().float().numpy().tobytes()),
    ]
    return torch.tensor(values, dtype=torch.int64)


def _agree(comm: RingGroup, desc: torch.Tensor) -> list[torch.Tensor]:
    """All ranks' descriptions; raise naming the ranks and fields that differ."""
    rows = comm.all_gather(desc, "checking that every rank called ring_attention alike")
    for field, name in enumerate(_FIELDS):
        if name.startswith("local"):
            continue
        values = [int(r[field]) for r in rows]
        if len(set(values)) > 1:
            odd = [i for i, x in enumerate(values) if x != values[0]]
            shown = values if field < 6 else ["..." if x != values[0] else "same as rank 0" for x in values]
            raise RingError(
                f"ring attention on rank {comm.rank}: the ranks disagree on the {name} "
                f"(ranks {odd} differ from rank 0: {shown}). Every rank must pass its shard of the same "
                "problem, with the same mask, bias, softcap, scale, sinks and layout."
            )
    return rows


def _lengths(comm, rows, layout, field, what) -> int:
    """The global length from the ranks' local lengths; checks they match the layout."""
    local = [int(r[field]) for r in rows]
    total = sum(local)
    expected = [sum(b - a for a, b in p) for p in _layout.pieces(total, comm.size, layout)]
    if local != expected:
        raise AttnkitValueError(
            f"ring attention: the ranks hold {what} of lengths {local}, but a sequence of {total} split "
            f"{layout!r} over {comm.size} ranks has parts of lengths {expected}. Split it with "
            f"attnkit.distributed.shard(x, dim, layout={layout!r})."
        )
    return total


def _split(x: torch.Tensor, sizes) -> list[torch.Tensor]:
    return list(torch.split(x, list(sizes), dim=-2))


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(buf: torch.Tensor, k_shape, v_shape):
    nk = math.prod(k_shape)
    return buf[:nk].view(k_shape), buf[nk:].view(v_shape)


class _Ring:
    """One ring call: the group, the schedule, and the per-rectangle attention."""

    def __init__(self, comm, sched, mask, attn_bias, softcap, scale):
        self.comm, self.sched = comm, sched
        self.mask, self.attn_bias, self.softcap, self.scale = mask, attn_bias, softcap, scale
        # each rectangle's part of the mask, made once: the forward's and backward's calls find its
        # prepared plan in the implicit cache (a part holding tensors is found by its identity)
        self._parts: dict = {}

    def sizes(self, pieces) -> list[int]:
        return [b - a for a, b in pieces]

    def part(self, q_piece, kv_piece, attn_bias):
        """``(mask, bias)`` of one rectangle of the global problem (the mask made once)."""
        s = self.sched
        key = (tuple(q_piece), tuple(kv_piece))
        mask = self._parts.get(key)
        if mask is None and key not in self._parts:
            mask = self._parts[key] = _layout.part_of(self.mask, s.q_len, s.kv_len, q_piece, kv_piece)
        part_bias = None
        if attn_bias is not None:
            (a, b), (c, d) = q_piece, kv_piece
            part_bias = attn_bias.part(s.q_len, s.kv_len, q=slice(a, b), kv=slice(c, d))
        return mask, part_bias

    def rectangle(self, q, k, v, q_piece, kv_piece, attn_bias):
        mask, part_bias = self.part(q_piece, kv_piece, attn_bias)
        return attention(q, k, v, mask, attn_bias=part_bias, softcap=self.softcap, scale=self.scale, return_lse=True)

    def _own(self, pieces, j, lo, hi):
        """Rows ``[lo, hi)`` (global) of this rank's piece ``j``."""
        a = self.sched.kv_pieces[self.comm.rank][j][0]
        return pieces[j][..., lo - a : hi - a, :]

    def _post(self, step, tag, sends, recv_spans, k_like, v_like, dtype):
        """Post one step's transfers of (K, V)-shaped pairs.

        ``sends``: ``(peer, j, packed)`` (see :func:`_pack`); ``recv_spans``: ``(peer, j, lo, hi)``.
        Returns (pending works, {j: (buffer, k shape, v shape, lo, hi)}).
        """
        out = [(peer, packed, tag + step * 8 + j) for peer, j, packed in sends]
        bufs = {}
        for _peer, j, lo, hi in recv_spans:
            ks, vs = (*k_like.shape[:-2], hi - lo, k_like.shape[-1]), (*v_like.shape[:-2], hi - lo, v_like.shape[-1])
            bufs[j] = (torch.empty(math.prod(ks) + math.prod(vs), dtype=dtype, device=k_like.device), ks, vs, lo, hi)
        recvs = [(peer, bufs[j][0], tag + step * 8 + j) for peer, j, _, _ in recv_spans]
        return self.comm.exchange(out, recvs), bufs

    def _post_kv(self, step, k_pieces, v_pieces, k, v):
        """Post step ``step``'s K/V transfers: send what rank ``me + step`` reads of ours,
        receive what we read of rank ``me - step``'s."""
        me, s = self.comm.rank, self.sched
        src, dst = s.source(me, step), s.target(me, step)
        sends = [
            (dst, j, _pack(self._own(k_pieces, j, lo, hi), self._own(v_pieces, j, lo, hi)))
            for j, lo, hi in s.needs[dst][me]
        ]
        recvs = [(src, j, lo, hi) for j, lo, hi in s.needs[me][src]]
        return self._post(step, 0, sends, recvs, k, v, k.dtype)

    def _keys(self, step, nxt, k_pieces, v_pieces, k, v):
        """This step's keys ``{j: (k rows, v rows, (lo, hi))}`` and the next step's transfers."""
        me, s = self.comm.rank, self.sched
        if step == 0:
            kv = {
                j: (self._own(k_pieces, j, lo, hi), self._own(v_pieces, j, lo, hi), (lo, hi))
                for j, lo, hi in s.needs[me][me]
            }
        else:
            pending, bufs = nxt
            self.comm.finish(pending)
            kv = {j: (*_unpack(buf, ks, vs), (lo, hi)) for j, (buf, ks, vs, lo, hi) in bufs.items()}
        if step + 1 < self.comm.size:
            nxt = self._post_kv(step + 1, k_pieces, v_pieces, k, v)
        else:
            nxt = ([], {})
        return kv, nxt

    def forward(self, q, k, v, attn_bias):
        me, s, comm = self.comm.rank, self.sched, self.comm
        q_pieces = _split(q, self.sizes(s.q_pieces[me]))
        k_pieces = _split(k, self.sizes(s.kv_pieces[me]))
        v_pieces = _split(v, self.sizes(s.kv_pieces[me]))
        dv, acc = v.shape[-1], accumulator_dtype(q)
        outs = [torch.zeros(*p.shape[:-1], dv, dtype=acc, device=q.device) for p in q_pieces]
        lses = [torch.full(p.shape[:-1], -math.inf, dtype=acc, device=q.device) for p in q_pieces]
        nxt = ([], {})
        for step in range(comm.size):
            kv, nxt = self._keys(step, nxt, k_pieces, v_pieces, k, v)
            for i, j in s.pairs[me][s.source(me, step)]:
                kk, vv, span = kv[j]
                out, lse = self.rectangle(q_pieces[i], kk, vv, s.q_pieces[me][i], span, attn_bias)
                outs[i], lses[i] = merge_into(outs[i], lses[i], out, lse)
        comm.finish(nxt[0])
        return torch.cat(outs, dim=-2).to(q.dtype), torch.cat(lses, dim=-1)

    def backward(self, q, k, v, out, lse, dout, dlse, attn_bias, params):
        """Gradients of q, k, v and of the bias parameters (this rank's contribution)."""
        me, s, comm = self.comm.rank, self.sched, self.comm
        q_sizes = self.sizes(s.q_pieces[me])
        acc = accumulator_dtype(q)
        q_pieces, out_pieces = _split(q, q_sizes), _split(out.to(acc), q_sizes)
        dout_pieces = _split(dout.to(acc), q_sizes)
        lse_pieces = list(torch.split(lse, q_sizes, dim=-1))
        dlse_pieces = list(torch.split(dlse, q_sizes, dim=-1)) if dlse is not None else [None] * len(q_sizes)
        k_pieces = _split(k, self.sizes(s.kv_pieces[me]))
        v_pieces = _split(v, self.sizes(s.kv_pieces[me]))
        # whole gradients, accumulated through views of their pieces (no concatenation at the end)
        dq_all, dk_all, dv_all = (torch.zeros_like(t, dtype=acc) for t in (q, k, v))
        dq = _split(dq_all, q_sizes)
        dk_own = _split(dk_all, self.sizes(s.kv_pieces[me]))
        dv_own = _split(dv_all, self.sizes(s.kv_pieces[me]))
        dparams = [None] * len(params)
        learned = any(p.requires_grad for p in params)  # bias parameters: recompute with autograd
        nxt = ([], {})
        grads_in_flight = ([], {})  # the previous step's dK/dV transfers and receive buffers
        for step in range(comm.size):
            src, dst = s.source(me, step), s.target(me, step)
            kv, nxt = self._keys(step, nxt, k_pieces, v_pieces, k, v)
            if step == 0:  # our own keys: straight into our gradients
                flat = {}
                dkv = {
                    j: (self._own(dk_own, j, lo, hi), self._own(dv_own, j, lo, hi))
                    for j, (_, _, (lo, hi)) in kv.items()
                }
            else:  # each received piece's dK/dV live in one buffer, sent back as it is (no packing copy)
                flat = {
                    j: torch.zeros(kk.numel() + vv.numel(), dtype=acc, device=kk.device)
                    for j, (kk, vv, _) in kv.items()
                }
                dkv = {j: _unpack(flat[j], kk.shape, vv.shape) for j, (kk, vv, _) in kv.items()}
            for i, j in s.pairs[me][src]:
                kk, vv, span = kv[j]
                grad = self._rectangle_grad if learned else self._rectangle_backward
                grads = grad(
                    q_pieces[i],
                    kk,
                    vv,
                    s.q_pieces[me][i],
                    span,
                    attn_bias,
                    params,
                    out_pieces[i],
                    lse_pieces[i],
                    dout_pieces[i],
                    dlse_pieces[i],
                )
                dq[i].add_(grads[0])
                dkv[j][0].add_(grads[1])
                dkv[j][1].add_(grads[2])
                for n, g in enumerate(grads[3:]):
                    if g is not None:
                        dparams[n] = g if dparams[n] is None else dparams[n] + g
                grads = None  # freed before the next rectangle's are made
            if step == 0:
                continue
            kv = dkv = None  # the received keys are used up: free them before more buffers arrive
            self._collect(grads_in_flight, dk_own, dv_own)
            # dK/dV of the keys received from src go back to it; those of our keys that
            # rank dst read come from it
            sends = [(src, j, flat[j]) for j in sorted(flat)]
            recvs = [(dst, j, lo, hi) for j, lo, hi in s.needs[dst][me]]
            grads_in_flight = self._post(step, _GRAD_TAG, sends, recvs, dk_own[0], dv_own[0], acc)
        self._collect(grads_in_flight, dk_own, dv_own)
        comm.finish(nxt[0])
        return dq_all.to(q.dtype), dk_all.to(k.dtype), dv_all.to(v.dtype), *dparams

    def _collect(self, in_flight, dk_own, dv_own) -> None:
        """Wait for dK/dV transfers and add what arrived to this rank's own gradients."""
        pending, bufs = in_flight
        self.comm.finish(pending)
        for j, (buf, ks, vs, lo, hi) in bufs.items():
            dk_part, dv_part = _unpack(buf, ks, vs)
            self._own(dk_own, j, lo, hi).add_(dk_part)
            self._own(dv_own, j, lo, hi).add_(dv_part)

    def _rectangle_backward(self, q, k, v, q_piece, kv_piece, attn_bias, params, out, lse, dout, dlse):
        """d loss / d (q, k, v) of one rectangle by the backward over a part of the keys of the kernel
        the registry chooses (:func:`attnkit.kernels.backward_part`), given the merged output and
        lse (no forward is recomputed)."""
        mask, part_bias = self.part(q_piece, kv_piece, attn_bias)
        call = make_call(
            q, k, v, mask=mask, scale=self.scale, return_lse=True, attn_bias=part_bias, softcap=self.softcap
        )
        dq, dk, dv = registry.backward_part(call, out, lse, dout, dlse)
        return [dq, dk, dv, *([None] * len(params))]

    def _rectangle_grad(self, q, k, v, q_piece, kv_piece, attn_bias, params, out, lse, dout, dlse):
        """d loss / d (q, k, v, params) of one rectangle, from the merged ``out`` and ``lse``.

        The merged output is ``sum_i w_i out_i`` with ``w_i = exp(lse_i - lse)``; so this
        rectangle's ``out_i`` gets ``w_i * dout`` and its ``lse_i`` gets
        ``w_i * (dout . (out_i - out) + dlse)``.
        """
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            out_i, lse_i = self.rectangle(q, k, v, q_piece, kv_piece, attn_bias)
            safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
            w = torch.exp(lse_i.detach().to(lse.dtype) - safe)  # 0 where the row is empty
            g_out = (w[..., None] * dout).to(out_i.dtype)
            row = (dout * (out_i.detach().to(out.dtype) - out)).sum(-1)
            if dlse is not None:
                row = row + dlse.to(row.dtype)
            g_lse = (w * row).to(lse_i.dtype)
            wanted = [q, k, v, *[p for p in params if p.requires_grad]]
            found = torch.autograd.grad([out_i, lse_i], wanted, [g_out, g_lse], allow_unused=True)
        grads = list(found[:3])
        grads = [torch.zeros_like(t) if g is None else g for t, g in zip((q, k, v), grads)]
        it = iter(found[3:])
        grads += [next(it) if p.requires_grad else None for p in params]
        return grads


class _RingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ring, attn_bias, q, k, v, *params):
        out, lse = ring.forward(q, k, v, attn_bias)
        ctx.ring, ctx.attn_bias, ctx.n_params = ring, attn_bias, len(params)
        ctx.save_for_backward(q, k, v, out, lse, *params)
        ctx.set_materialize_grads(False)  # an unused lse gets no gradient: the fused backward can run
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *params = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        grads = ctx.ring.backward(q, k, v, out, lse, dout, dlse, ctx.attn_bias, params)
        return (None, None, *grads)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskLike = None,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
    scale: float | None = None,
    attn_bias: BiasLike = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over a sequence whose queries and keys are split across the ranks of ``group``.

    Each rank passes its own part, ``q: (B, Hq, Lq_local, D)``, ``k: (B, Hkv, Lk_local, D)``,
    ``v: (B, Hkv, Lk_local, Dv)``, split with :func:`~attnkit.distributed.shard` under the
    same ``layout`` (``"zigzag"`` or ``"contiguous"``); lengths need not divide the number
    of ranks. ``mask``, ``attn_bias``, ``softcap``, ``scale`` and ``sinks`` describe the
    **whole** problem, exactly as for :func:`attnkit.attention` on the unsplit tensors, and
    must be the same on every rank (checked up front). Masks are mask objects or bool
    tensors of the global shape; every kind keeps its meaning across the split, and a rank
    skips (and never receives) key pieces its mask empties.

    Returns this rank's part of the output ``(B, Hq, Lq_local, Dv)`` (and of the lse, in
    float32, with ``return_lse=True``), differentiable with respect to q, k, v, the bias
    parameters and sinks. Parameter gradients are this rank's contribution: sum them over
    the group (DDP/FSDP over the same ranks do).

    Every transfer waits at most ``timeout`` seconds; a rank that dies, raises or disagrees
    makes the others raise :class:`RingError` naming it, instead of hanging. Without an
    initialized process group this is ordinary attention on one process.

    Backends: gloo (CPU tensors) and NCCL (CUDA tensors) run the same code.
    """
    comm = RingGroup(group, timeout)
    layout = _layout.check_layout(layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise AttnkitTypeError(f"{name} must be a torch.Tensor, but got {type(t).__name__}.")
        if t.dim() != 4:
            raise AttnkitValueError(
                f"{name} must have shape (B, H, L_local, D) on each rank, but got {tuple(t.shape)}."
            )
    check_qkv(q, k, v)
    mask = _layout.as_ring_mask(mask)
    if attn_bias is not None and not isinstance(attn_bias, _bias.Bias):
        if isinstance(attn_bias, torch.Tensor):
            attn_bias = _bias.dense(attn_bias)
        else:
            raise AttnkitTypeError(
                f"attn_bias must be an attnkit.bias object or a float tensor, but got {type(attn_bias).__name__}."
            )
    if sinks is not None and (
        not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or tuple(sinks.shape) != (q.shape[1],)
    ):
        raise AttnkitTypeError(
            f"sinks must be a float tensor of shape (Hq,) = ({q.shape[1]},), one logit per query head, but got "
            + (short(sinks) if not isinstance(sinks, torch.Tensor) else f"{sinks.dtype} of shape {tuple(sinks.shape)}")
            + "."
        )
    rows = _agree(comm, _describe(q, k, v, mask, attn_bias, softcap, scale, sinks, layout))
    q_len = _lengths(comm, rows, layout, _FIELDS.index("local query length"), "queries")
    kv_len = _lengths(comm, rows, layout, _FIELDS.index("local key length"), "keys")
    if mask is not None:
        mask.check(q_len, kv_len)
        mask.check_values(q_len, kv_len)
        _check_mask_fits(mask, q, q_len, kv_len)
    if attn_bias is not None:
        attn_bias.check(q.shape[0], q.shape[1], q_len, kv_len, q.device)
    sched = _layout.schedule(mask, q_len, kv_len, comm.size, layout, ranks={comm.rank})
    ring = _Ring(comm, sched, mask, attn_bias, softcap, scale)
    params = tuple(attn_bias.params()) if attn_bias is not None else ()
    out, lse = _RingFunction.apply(ring, attn_bias, q, k, v, *params)
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out


def _check_mask_fits(mask, q, q_len, kv_len) -> None:
    batch, heads = mask.lead_shape()
    if batch not in (1, q.shape[0]) or heads not in (1, q.shape[1]):
        raise AttnkitValueError(
            f"{mask!r} has (batch, heads) = {(batch, heads)}, which does not broadcast to the inputs' "
            f"({q.shape[0]}, {q.shape[1]})."
        )
