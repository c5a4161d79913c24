"""Rotary position embeddings (RoPE) for the queries and keys of attention."""

from __future__ import annotations

import torch
from torch import nn

from attnkit._validate import AttnkitTypeError, AttnkitValueError

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(nn.Module):
    """Rotate pairs of feature dimensions by angles proportional to the position.

    ``x: (..., L, head_dim)`` and ``positions: (L,)`` or ``(B, L)`` int64 (global positions:
    offsets of a cache or a shard included). The first ``rotary_dims`` dimensions (all
    by default; an even number) are rotated, in the "half" layout of GPT-NeoX/Llama
    (dimension i pairs with i + rotary_dims/2) at frequencies ``base ** (-2i / rotary_dims)``;
    the rest pass unchanged, so a head can match content at any distance. A larger
    ``base`` keeps low frequencies nearly still over long inputs.

    >>> rope = RotaryEmbedding(8)
    >>> q = torch.randn(1, 2, 5, 8)
    >>> rope(q, torch.arange(5)).shape
    torch.Size([1, 2, 5, 8])
    """

    def __init__(self, head_dim: int, base: float = 10000.0, rotary_dims: int | None = None):
        super().__init__()
        rotary_dims = head_dim if rotary_dims is None else rotary_dims
        if (
            isinstance(rotary_dims, bool)
            or not isinstance(rotary_dims, int)
            or not 0 <= rotary_dims <= head_dim
            or rotary_dims % 2
        ):
            raise AttnkitValueError(
                f"rotary_dims must be an even int in [0, head_dim={head_dim}], but got {rotary_dims!r}."
            )
        if not base > 1:
            raise AttnkitValueError(f"base must be > 1, but got {base!r}.")
        self.head_dim, self.base, self.rotary_dims = head_dim, float(base), rotary_dims
        inv_freq = base ** (-torch.arange(0, rotary_dims, 2, dtype=torch.float64) / max(rotary_dims, 1))
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base:g}, rotary_dims={self.rotary_dims}"

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not isinstance(positions, torch.Tensor) or positions.is_floating_point():
            raise AttnkitTypeError("positions must be an integer tensor of shape (L,) or (B, L).")
        if x.shape[-1] != self.head_dim or positions.shape[-1] != x.shape[-2]:
            raise AttnkitValueError(
                f"RotaryEmbedding({self.head_dim}) got x of shape {tuple(x.shape)} and positions of shape "
                f"{tuple(positions.shape)}: the last dims must be (L, {self.head_dim}) and (L,)."
            )
        if self.rotary_dims == 0:
            return x
        angles = positions.to(self.inv_freq.device, torch.float32)[..., None] * self.inv_freq  # (..., L, r/2)
        if positions.dim() == 2 and x.dim() == 4:
            angles = angles[:, None]  # (B, 1, L, r/2): the same for every head
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        half = self.rotary_dims // 2
        x1, x2, rest = x[..., :half], x[..., half : self.rotary_dims], x[..., self.rotary_dims :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
