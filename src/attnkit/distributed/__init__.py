"""Attention over sequences split across processes (context parallelism).

>>> # on each of W ranks, after torch.distributed.init_process_group("gloo" or "nccl"):
>>> # q_local, pos = shard(q, dim=2)                      # this rank's part, global positions
>>> # out_local = ring_attention(q_local, k_local, v_local, masks.causal())
>>> # out = unshard(out_local, dim=2)                      # the whole output, on every rank

See :func:`ring_attention` and ``examples/ring.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnkit._types import Device
from attnkit._validate import AttnkitTypeError, AttnkitValueError, check_nonnegative_int, short
from attnkit.bias import BiasLike
from attnkit.distributed import layout as _layout
from attnkit.distributed.layout import pieces, positions
from attnkit.distributed.ring import DEFAULT_TIMEOUT, RingError, RingGroup, ring_attention
from attnkit.nn.attention import MultiHeadAttention
from attnkit.plan import MaskLike

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from attnkit.masks import Mask

__all__ = [
    "RingError",
    "RingMultiHeadAttention",
    "RingReport",
    "explain",
    "pieces",
    "positions",
    "ring_attention",
    "shard",
    "unshard",
]


def _dim(x: torch.Tensor, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise AttnkitTypeError(f"expected a torch.Tensor, but got {type(x).__name__}.")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise AttnkitValueError(
            f"dim must be an int in [{-x.dim()}, {x.dim() - 1}] for shape {tuple(x.shape)}, but got {short(dim)}."
        )
    return dim % x.dim()


def shard(
    x: torch.Tensor, dim: int, layout: str = "zigzag", group: ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of the whole tensor ``x`` along ``dim``, and its global positions.

    Returns ``(local, positions)`` with ``positions: (L_local,)`` int64 on ``x``'s device
    (feed them to a rotary embedding). Every rank passes the same ``x``.

    >>> x = torch.arange(10.0)
    >>> shard(x, 0)  # one process: the whole tensor
    (tensor([0., 1., 2., 3., 4., 5., 6., 7., 8., 9.]), tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9]))
    """
    dim = _dim(x, dim)
    comm = RingGroup(group, DEFAULT_TIMEOUT)
    parts = pieces(x.shape[dim], comm.size, _layout.check_layout(layout))[comm.rank]
    local = torch.cat([x.narrow(dim, a, b - a) for a, b in parts], dim=dim)
    return local, torch.cat([torch.arange(a, b, device=x.device) for a, b in parts])


def unshard(
    local: torch.Tensor,
    dim: int,
    layout: str = "zigzag",
    group: ProcessGroup | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> torch.Tensor:
    """The whole tensor on every rank, from each rank's part (the inverse of :func:`shard`).

    A collective: every rank of ``group`` must call it. Not differentiable (for
    evaluation and checks; training keeps the parts).
    """
    dim = _dim(local, dim)
    comm = RingGroup(group, timeout)
    layout = _layout.check_layout(layout)
    if comm.size == 1:
        return local
    sizes = [int(n) for n in comm.all_gather(torch.tensor([local.shape[dim]]), "gathering the parts' lengths")]
    total = sum(sizes)
    parts = pieces(total, comm.size, layout)
    expected = [sum(b - a for a, b in p) for p in parts]
    if sizes != expected:
        raise AttnkitValueError(
            f"unshard: the ranks hold parts of lengths {sizes}, but {layout!r} over {comm.size} ranks "
            f"gives {expected} for a sequence of {total}."
        )
    longest = max(sizes)
    pad = list(local.shape)
    pad[dim] = longest - local.shape[dim]
    padded = torch.cat([local, local.new_zeros(pad)], dim=dim).contiguous()
    gathered = comm.all_gather(padded, "gathering the parts")
    chunks = []
    for rank, rank_parts in enumerate(parts):
        offset = 0
        for a, b in rank_parts:
            chunks.append((a, gathered[rank].narrow(dim, offset, b - a)))
            offset += b - a
    return torch.cat([c for _, c in sorted(chunks, key=lambda item: item[0])], dim=dim)


@dataclass(frozen=True)
class RingReport:
    """Per-rank work and traffic of one ring attention call (see :func:`explain`).

    ``work[r]``: query-key pairs in the 128x128 tiles rank r computes (the kernel's work);
    ``received[r]`` / ``sent[r]``: keys (K and V rows) rank r receives / sends in the
    forward pass (the backward pass sends as many dK/dV rows back); ``rectangles[r]``:
    (query piece, key piece) attention calls.
    """

    world_size: int
    layout: str
    q_len: int
    kv_len: int
    work: tuple
    received: tuple
    sent: tuple
    rectangles: tuple
    dense_work: int

    @property
    def balance(self) -> float:
        """max / min work over the ranks (1.0 is perfectly balanced)."""
        low = min(self.work)
        return float("inf") if low == 0 else max(self.work) / low

    def bytes_sent(
        self, rank: int, batch: int, kv_heads: int, head_dim: int, value_dim: int | None = None, element_size: int = 4
    ) -> int:
        """Bytes rank ``rank`` sends in the forward pass for these sizes."""
        value_dim = head_dim if value_dim is None else value_dim
        return self.sent[rank] * batch * kv_heads * (head_dim + value_dim) * element_size

    def __str__(self) -> str:
        lines = [
            f"ring attention, {self.world_size} ranks, layout={self.layout!r}, Lq={self.q_len}, Lk={self.kv_len}: "
            f"work balance (max/min) {self.balance:.2f}",
            f"{'rank':>4} {'work (pairs)':>14} {'of dense':>9} {'calls':>6} {'keys in':>9} {'keys out':>9}",
        ]
        for r in range(self.world_size):
            share = self.work[r] / self.dense_work if self.dense_work else 0.0
            lines.append(
                f"{r:>4} {self.work[r]:>14,} {share:>9.1%} {self.rectangles[r]:>6} "
                f"{self.received[r]:>9,} {self.sent[r]:>9,}"
            )
        return "\n".join(lines)


def explain(
    mask: Mask | torch.Tensor | None,
    q_len: int,
    kv_len: int | None = None,
    *,
    world_size: int | None = None,
    layout: str = "zigzag",
    group: ProcessGroup | None = None,
) -> RingReport:
    """What :func:`ring_attention` would do on each rank: work, calls, keys sent and received.

    Needs no process group: pass ``world_size`` (default: the group's size).

    >>> from attnkit import masks
    >>> r = explain(masks.causal(), 4096, world_size=4, layout="zigzag")
    >>> r.balance
    1.0
    """
    from attnkit import masks as _masks

    q_len = check_nonnegative_int(q_len, "q_len")
    kv_len = q_len if kv_len is None else check_nonnegative_int(kv_len, "kv_len")
    if world_size is None:
        world_size = RingGroup(group, DEFAULT_TIMEOUT).size
    world_size = check_nonnegative_int(world_size, "world_size")
    if world_size < 1:
        raise AttnkitValueError(f"world_size must be >= 1, but got {world_size}.")
    mask = _layout.as_ring_mask(mask)
    if isinstance(mask, _masks.Mask):
        mask.check(q_len, kv_len)
    sched = _layout.schedule(mask, q_len, kv_len, world_size, _layout.check_layout(layout))
    work, received, sent, calls = [], [], [], []
    for r in range(world_size):
        w = n = 0
        for c in range(world_size):
            for i, j in sched.pairs[r][c]:
                w += _layout.kept_area(mask, q_len, kv_len, sched.q_pieces[r][i], sched.span(r, c, j))
                n += 1
        work.append(w)
        calls.append(n)
        received.append(sched.keys_received(r))
        sent.append(sched.keys_sent(r))
    dense = _layout.kept_area(mask, q_len, kv_len, (0, q_len), (0, kv_len))
    return RingReport(world_size, layout, q_len, kv_len, tuple(work), tuple(received), tuple(sent), tuple(calls), dense)


class RingMultiHeadAttention(MultiHeadAttention):
    """:class:`~attnkit.MultiHeadAttention` over a sequence split across ``group``'s ranks.

    The same parameters and state dict as ``MultiHeadAttention`` (load one into the
    other); ``forward`` takes this rank's part of the sequence, ``(B, L_local, E)``, cut
    with :func:`shard` under ``layout``, and the mask/bias of the whole sequence. Call it
    on every rank. A ``rotary`` embedding is applied at each token's global position
    (``positions=`` from :func:`shard`, or worked out from the layout). No KV cache or
    ``need_weights`` (use the unsplit module to decode or to look at weights).

    >>> import torch
    >>> from attnkit import masks
    >>> mha = RingMultiHeadAttention(32, 4)  # one process: plain attention
    >>> out, _ = mha(torch.randn(2, 10, 32), mask=masks.causal())
    """

    def __init__(
        self,
        *args: Any,
        group: ProcessGroup | None = None,
        layout: str = "zigzag",
        timeout: float = DEFAULT_TIMEOUT,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.group = group
        self.layout = _layout.check_layout(layout)
        self.timeout = timeout

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, layout={self.layout!r}"

    def holds_a_shard(self) -> bool:
        """Whether this layer runs over several ranks (each holding a part of the sequence)."""
        return RingGroup(self.group, self.timeout).size > 1

    def local_positions(self, local_length: int, device: Device = None) -> torch.Tensor:
        """The global positions ``(L_local,)`` of this rank's part of a sequence split under
        ``layout`` (what :func:`shard` returns; the rotary embedding's positions).

        A collective when the group has several ranks (it gathers the parts' lengths): pass
        ``positions=`` to :meth:`forward`, from :func:`shard`, to skip it.
        """
        comm = RingGroup(self.group, self.timeout)
        lengths = comm.all_gather(torch.tensor([local_length]), "gathering the parts' lengths for the positions")
        total = sum(int(n) for n in lengths)
        local = _layout.positions(total, comm.size, comm.rank, self.layout)
        if local.numel() != local_length:
            raise AttnkitValueError(
                f"this rank holds {local_length} positions, but a sequence of {total} split {self.layout!r} over "
                f"{comm.size} ranks gives it {local.numel()}: cut the sequence with attnkit.distributed.shard."
            )
        return local.to(device)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        mask: MaskLike = None,
        need_weights: bool = False,
        *,
        attn_bias: BiasLike = None,
        positions: torch.Tensor | None = None,
        **unsupported: Any,
    ) -> tuple[torch.Tensor, None]:
        if need_weights or unsupported:
            what = "need_weights=True" if need_weights else ", ".join(f"{k}=" for k in unsupported)
            raise AttnkitValueError(
                f"RingMultiHeadAttention does not take {what}: it attends over a split sequence. Use "
                "attnkit.MultiHeadAttention (same state dict) to decode with a cache or to return weights."
            )
        if self.training and self._dropout_p() > 0:
            raise AttnkitValueError("RingMultiHeadAttention has no attention dropout: build it with dropout=0.0.")
        if isinstance(query, torch.Tensor) and query.dim() != 3:
            raise AttnkitValueError(
                f"query must have shape (B, L_local, {self.d_model}), but got {tuple(query.shape)}."
            )
        q, k, v = self.project(query, key, value)
        if self.rotary is not None:
            if key is not None and key is not query:
                raise AttnkitValueError("rotary embeddings are for self-attention: call forward(x) without key/value.")
            if positions is None:
                positions = self.local_positions(q.shape[-2], q.device)
            q, k = self._rotate(q, positions), self._rotate(k, positions)
        mods = dict(attn_bias=attn_bias, softcap=self.softcap, sinks=self.sinks, dropout_p=0.0)
        if self.hook_points.hooks["lse"]:
            raise AttnkitValueError(
                "RingMultiHeadAttention gives no lse to hooks (each rank merges its shards' lse): roll out or "
                "capture an attnkit.MultiHeadAttention with the same state dict on the whole sequence."
            )
        self.hook_points.before(self, q, k, v, mask, mods)
        out = ring_attention(
            q,
            k,
            v,
            mask,
            group=self.group,
            layout=self.layout,
            attn_bias=attn_bias,
            softcap=self.softcap,
            sinks=self.sinks,
            timeout=self.timeout,
        )
        assert isinstance(out, torch.Tensor)
        return self.out_proj(self.merge_heads(self.hook_points.after(self, out))), None
