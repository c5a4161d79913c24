"""The kinds of biases: ALiBi, T5's relative position bias, a function, a dense tensor. Users make
them with :mod:`attnkit.bias`' functions."""

from __future__ import annotations

import copy
import math
import numbers

import torch

from attnkit._types import Offset
from attnkit._validate import AttnkitTypeError, AttnkitValueError, broadcasts_to, short
from attnkit.bias._base import Bias, Positional, check_heads, float_tensor

__all__ = ["Alibi", "Dense", "FromFn", "Relative", "relative_buckets"]


def relative_buckets(
    relative_position: torch.Tensor, num_buckets: int, max_distance: int, bidirectional: bool
) -> torch.Tensor:
    """T5's bucket of each ``key position - query position`` (an int64 tensor).

    Half the buckets (``num_buckets // 2``) hold exact distances; the rest grow
    logarithmically up to ``max_distance``, beyond which all distances share the
    last bucket. With ``bidirectional`` keys after the query get buckets of their own.
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    exact = num_buckets // 2
    log_ratio = torch.log(distance.clamp(min=1).float() / exact) / math.log(max_distance / exact)
    far = exact + (log_ratio * (num_buckets - exact)).long()
    far = far.clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < exact, distance, far)


# --- ALiBi -----------------------------------------------------------------------------


class Alibi(Positional):
    """ALiBi (see :func:`alibi`): ``slopes (Hq,)``, ``causal``, and the positions' ``align``,
    ``q_offset`` and ``kv_offset``; public so kernels that compute it in their tile loop
    (the Triton kernel) can read its parameters."""

    def __init__(self, slopes: torch.Tensor, causal: bool, align: str, q_offset: Offset, kv_offset: Offset):
        self.slopes = float_tensor(slopes, "slopes", "of shape (num_heads,)")
        if self.slopes.dim() != 1:
            raise AttnkitValueError(f"slopes must have shape (num_heads,), but got {tuple(self.slopes.shape)}.")
        self.causal = bool(causal)
        self._set_positions(align, q_offset, kv_offset)

    def params(self) -> tuple[torch.Tensor, ...]:
        return (self.slopes,)

    _of_distance = True

    def _by_distance(self, distance: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        d = distance.to(self.slopes.dtype)  # the same arithmetic as elements()
        penalty = d.neg() if self.causal else d.abs()
        return penalty[None, :] * -self.slopes[h][:, None]

    def elements(
        self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, q_len: int, kv_len: int
    ) -> torch.Tensor:
        # One broadcast pass is cheaper here than the Toeplitz layout of Positional.
        qp, kp = self._positions(b, q_idx, kv_idx, q_len, kv_len)
        dt = self.slopes.dtype
        distance = kp.to(dt) - qp.to(dt)  # (Bs or 1, 1, n, S)
        penalty = distance.neg_() if self.causal else distance.abs_()
        return penalty * -self.slopes[h]  # (Bs or 1, 1, n, S) * (1, Hs, 1, 1)

    def check(self, batch: int, num_heads: int, q_len: int, kv_len: int, device: torch.device) -> None:
        super().check(batch, num_heads, q_len, kv_len, device)
        check_heads(self.slopes, 0, num_heads, "the ALiBi slopes")

    def describe(self) -> str:
        return "alibi(causal)" if self.causal else "alibi"


# --- T5's relative position bias -------------------------------------------------------


class Relative(Positional):
    def __init__(self, table, num_buckets, max_distance, bidirectional, align, q_offset, kv_offset):
        self.table = float_tensor(table, "table", "of shape (num_buckets, num_heads)")
        if self.table.dim() != 2 or self.table.shape[0] != num_buckets:
            raise AttnkitValueError(
                f"table must have shape (num_buckets={num_buckets}, num_heads), but got {tuple(self.table.shape)}."
            )
        for name, value, low in (
            ("num_buckets", num_buckets, 4 if bidirectional else 2),
            ("max_distance", max_distance, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                raise AttnkitValueError(f"{name} must be an int >= {low}, but got {short(value)}.")
        self.num_buckets, self.max_distance, self.bidirectional = (
            int(num_buckets),
            int(max_distance),
            bool(bidirectional),
        )
        if self.max_distance <= (self.num_buckets // (2 if bidirectional else 1)) // 2:
            raise AttnkitValueError(
                f"max_distance={max_distance} must exceed the exact range, num_buckets // "
                f"{4 if bidirectional else 2} = {self.num_buckets // (4 if bidirectional else 2)}."
            )
        self._set_positions(align, q_offset, kv_offset)

    def params(self):
        return (self.table,)

    _of_distance = True

    def _bucket(self, distance):
        return relative_buckets(distance, self.num_buckets, self.max_distance, self.bidirectional)

    def _by_distance(self, distance, h):
        return self.table.t()[h][:, self._bucket(distance)]  # (Hs, nb)[:, (m,)] -> (Hs, m)

    def _elementwise(self, distance, h):
        return self.table.t()[h, self._bucket(distance)]  # (Hq, nb)[(1, Hs, 1, 1), (Bs or 1, 1, n, S)]

    def check(self, batch, num_heads, q_len, kv_len, device):
        super().check(batch, num_heads, q_len, kv_len, device)
        check_heads(self.table, 1, num_heads, "the relative position table")

    def describe(self):
        return f"relative({self.num_buckets} buckets)"


# --- any function, any dense tensor -------------------------------------------------------


class FromFn(Positional):
    def __init__(self, fn, params, q_offset, kv_offset):
        if not callable(fn):
            raise AttnkitTypeError(f"fn must be callable as fn(b, h, q_idx, kv_idx), but got {type(fn).__name__}.")
        for i, t in enumerate(params):
            if not isinstance(t, torch.Tensor):
                raise AttnkitTypeError(
                    f"params must be tensors (those fn closes over), but params[{i}] is {type(t).__name__}."
                )
        self.fn, self._params = fn, tuple(params)
        self._set_positions("top_left", q_offset, kv_offset)

    def params(self):
        return self._params

    def elements(self, b, h, q_idx, kv_idx, q_len, kv_len):
        qp, kp = self._positions(b, q_idx, kv_idx, q_len, kv_len)
        out = self.fn(b, h, qp, kp)
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            raise AttnkitTypeError(
                f"the bias function must return a float tensor, but returned {type(out).__name__}"
                f"{'' if not isinstance(out, torch.Tensor) else ' of dtype ' + str(out.dtype)}."
            )
        shape = (b.shape[0], h.shape[1], q_idx.shape[2], kv_idx.shape[3])
        if not broadcasts_to(tuple(out.shape), shape):
            raise AttnkitValueError(
                f"the bias function returned shape {tuple(out.shape)}, which does not broadcast to "
                f"(B, H, n, S) = {shape} for index tensors b {tuple(b.shape)}, h {tuple(h.shape)}, "
                f"q_idx {tuple(q_idx.shape)}, kv_idx {tuple(kv_idx.shape)}."
            )
        return out

    def _in_cache(self, start):
        other = copy.copy(self)
        other.q_offset = self.q_offset + start  # q_idx is each query's position in its sequence
        return other

    def describe(self):
        return f"from_fn({getattr(self.fn, '__name__', 'fn')})"


class Dense(Bias):
    def __init__(self, tensor):
        self.tensor = float_tensor(tensor, "the dense bias", "broadcastable to (B, Hq, Lq, Lk)")
        if not 2 <= self.tensor.dim() <= 4:
            raise AttnkitValueError(
                f"a dense bias must have 2 to 4 dims, broadcastable to (B, Hq, Lq, Lk), but got {tuple(tensor.shape)}."
            )

    def params(self):
        return (self.tensor,)

    def _t4(self):
        t = self.tensor
        return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))

    def _index(self, b, h, q_idx, kv_idx):
        t = self._t4()
        bi = b if t.shape[0] > 1 else torch.zeros_like(b)
        hi = h if t.shape[1] > 1 else torch.zeros_like(h)
        qi = q_idx if t.shape[2] > 1 else torch.zeros_like(q_idx)
        ki = kv_idx if t.shape[3] > 1 else torch.zeros_like(kv_idx)
        return t, (bi, hi, qi, ki)

    def elements(self, b, h, q_idx, kv_idx, q_len, kv_len):
        t, index = self._index(b, h, q_idx, kv_idx)
        return t[index]

    def add_grad(self, grads, dtile, b, h, q_idx, kv_idx, q_len, kv_len):
        if not self.tensor.requires_grad:
            return
        t, index = self._index(b, h, q_idx, kv_idx)
        key = id(self.tensor)
        if key not in grads:
            grads[key] = torch.zeros(t.shape, dtype=dtile.dtype, device=dtile.device)
        index = tuple(i.expand(dtile.shape) for i in index)
        grads[key].index_put_(index, dtile, accumulate=True)  # (B, H, Lq, Lk) += one tile

    def dense(self, batch, num_heads, q_len, kv_len, device):
        return self._t4()

    def _part(self, q_start, kv_start, q_len, kv_len, q_count, kv_count):
        t = self._t4()
        if t.shape[2] != 1:
            t = t[:, :, q_start : q_start + q_count]
        if t.shape[3] != 1:
            t = t[..., kv_start : kv_start + kv_count]
        other = copy.copy(self)
        other.tensor = t  # a view: gradients reach the whole tensor
        return other

    def check(self, batch, num_heads, q_len, kv_len, device):
        super().check(batch, num_heads, q_len, kv_len, device)
        if not broadcasts_to(tuple(self._t4().shape), (batch, num_heads, q_len, kv_len)):
            raise AttnkitValueError(
                f"the dense bias has shape {tuple(self.tensor.shape)}, which does not broadcast to "
                f"(B, Hq, Lq, Lk) = {(batch, num_heads, q_len, kv_len)}."
            )

    def describe(self):
        return f"dense{tuple(self.tensor.shape)}"
