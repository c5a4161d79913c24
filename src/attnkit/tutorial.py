"""The names of the tutorial "Attention: the core of the Transformer", on attnkit's kernels.

A learner who has the tutorial's code can delete its definitions and write::

    from attnkit.tutorial import *

and the rest runs unchanged: the same names, signatures, attributes and return
values. Everything here runs on attnkit (``attnkit.attention_with_weights`` and
``attnkit.MultiHeadAttention``); nothing is implemented twice.

Where the tutorial's code is wrong, attnkit fixes it, and each function's docstring
says how:

- **One mask convention.** The tutorial's attention hides the positions where the
  mask is 0, but its ``create_causal_mask`` marks the *future* with True, so the
  causal mask hid the past and could not be combined with the padding mask. Here
  every mask marks what **may be attended** with True (or any nonzero value), and
  ``create_padding_mask(seq) & create_causal_mask(L)`` is the mask a decoder wants.
- **Fully masked rows give 0, not NaN** (a padded query that may see nothing, for
  example), with zero gradients.
- **Dropout is applied.** The tutorial's ``MultiHeadAttention`` creates
  ``self.dropout`` but never uses it; here it drops attention weights in training
  mode (the returned weights are those before dropout).
- **The heatmap says what it draws.** ``visualize_attention`` draws
  ``attention_weights[0]`` as the tutorial does (and head 0 of 4-D weights), and
  when the matrix and the tokens disagree (the tutorial's example passes a 10 x 10
  matrix with 6 tokens) it says so instead of failing inside matplotlib.

``attnkit.scaled_dot_product_attention``, ``attnkit.create_padding_mask``,
``attnkit.create_causal_mask`` and ``attnkit.visualize_attention`` are the same
objects as the names here.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from attnkit import masks
from attnkit._types import Device
from attnkit._validate import AttnkitTypeError, AttnkitValueError, check_nonnegative_int
from attnkit.functional import attention_with_weights
from attnkit.nn import attention as _fast
from attnkit.viz.heatmap import visualize_attention

__all__ = [
    "MultiHeadAttention",
    "causal_mask_attention",
    "create_causal_mask",
    "create_padding_mask",
    "scaled_dot_product_attention",
    "visualize_attention",
]


def _as_bool_mask(mask):
    """The tutorial's masks hide where they are 0: any dtype -> bool, True = may attend."""
    if mask is None or isinstance(mask, masks.Mask):
        return mask
    if not isinstance(mask, torch.Tensor):
        raise AttnkitTypeError(
            "mask must be a tensor (0 = hidden, nonzero or True = may attend) or an "
            f"attnkit.masks object, but got {type(mask).__name__}."
        )
    return mask if mask.dtype == torch.bool else mask != 0


def scaled_dot_product_attention(
    Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor | masks.Mask | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(Q K^T / sqrt(d_k)) V``; returns ``(output, attention_weights)``.

    ``Q: (..., Lq, d_k)``, ``K: (..., Lk, d_k)``, ``V: (..., Lk, d_v)`` (the tutorial
    uses ``(batch_size, num_heads, seq_len, d_k)``); ``output`` is ``(..., Lq, d_v)``
    and ``attention_weights`` ``(..., Lq, Lk)``.

    ``mask`` hides the positions where it is 0, as in the tutorial (any dtype: a
    bool mask is True where attention is allowed), broadcast like ``scores``, so
    :func:`create_padding_mask` and :func:`create_causal_mask` can be passed
    directly and combined with ``&``. Fix: a row with every key hidden gives 0 (and
    zero weights), where the tutorial's ``masked_fill(-inf)`` + softmax gives NaN.

    >>> Q = K = V = torch.randn(2, 8, 10, 64)
    >>> output, attention = scaled_dot_product_attention(Q, K, V)
    >>> tuple(output.shape), tuple(attention.shape)
    ((2, 8, 10, 64), (2, 8, 10, 10))
    """
    return attention_with_weights(Q, K, V, _as_bool_mask(mask))


def causal_mask_attention(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention in which each position sees itself and the positions before it.

    The same as ``scaled_dot_product_attention(Q, K, V, create_causal_mask(L))`` for
    ``Q``, ``K``, ``V`` of equal length ``L``; returns ``(output, attention_weights)``.
    The mask is attnkit's ``masks.causal()``, so no ``(L, L)`` tensor is built for
    the output, and the kernel skips the blocks above the diagonal. When ``K`` is
    longer than ``Q`` (a continuation), the queries are the *last* ``Lq`` positions.

    Fix: the tutorial's causal mask marks the future with True; here the allowed
    positions (the lower triangle) are True, like every other mask.
    """
    return attention_with_weights(Q, K, V, masks.causal())


def create_padding_mask(seq: torch.Tensor, pad_idx: int = 0) -> torch.Tensor:
    """``(B, 1, 1, L)`` bool mask of real tokens: True where ``seq != pad_idx``.

    ``seq: (B, L)`` token ids. Broadcasts over heads and queries.

    >>> create_padding_mask(torch.tensor([[5, 7, 0]])).int().tolist()
    [[[[1, 1, 0]]]]
    """
    if not isinstance(seq, torch.Tensor):
        raise AttnkitTypeError(f"seq must be a tensor of token ids, but got {type(seq).__name__}.")
    if seq.dim() != 2:
        raise AttnkitValueError(f"seq must have shape (B, L), but got {tuple(seq.shape)}.")
    return (seq != pad_idx)[:, None, None, :]  # (B, L) -> (B, 1, 1, L)


def create_causal_mask(seq_len: int, *, device: Device = None) -> torch.Tensor:
    """``(L, L)`` bool mask, True = may attend: the lower triangle.

    Fix: the tutorial's version marks the *future* positions with True while its
    attention hides the positions where the mask is 0, so the two cannot be used
    together. Here True means "may attend", as for every attnkit mask:

    >>> create_causal_mask(3).int().tolist()
    [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    seq_len = check_nonnegative_int(seq_len, "seq_len")
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()


class MultiHeadAttention(_fast.MultiHeadAttention):
    """The tutorial's multi-head attention, as an :class:`attnkit.MultiHeadAttention`.

    Attributes as in the tutorial: ``W_q``, ``W_k``, ``W_v``, ``W_o`` (the four
    ``nn.Linear(d_model, d_model)``), ``d_model``, ``num_heads``, ``d_k`` and
    ``dropout`` (an ``nn.Dropout``). ``forward(query, key, value, mask=None)``
    always returns ``(output, attention_weights)`` with per-head weights
    ``(batch, num_heads, seq_q, seq_k)``, and ``split_heads(x, batch_size)`` takes
    the batch size.

    It *is* an ``attnkit.MultiHeadAttention`` whose projections are registered
    under the tutorial's names, so it runs on the same kernels, takes the same
    masks (the tutorial's 0/1 masks and ``attnkit.masks`` objects), KV caches and
    hooks. Converting, both ways, keeps the weights:

    - ``MultiHeadAttention.from_attnkit(fast)`` and ``tutorial_mha.to_attnkit()``
      copy the weights into the other class;
    - ``state_dict()`` keys are the tutorial's (``W_q.weight``, ...), and either
      class loads either layout: a state dict saved from the tutorial's own class
      loads here, and this one's loads into ``attnkit.MultiHeadAttention``.

    Fixes: ``dropout`` is applied to the attention weights in training mode (the
    tutorial creates it but never uses it; the returned weights are those before
    dropout); rows with every key masked give 0, not NaN.
    """

    _other_layout: ClassVar[dict[str, str]] = {fast: tutorial for tutorial, fast in _fast.TUTORIAL_NAMES.items()}

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        dropout: float = 0.1,
        *,
        bias: bool = True,
        device: Device = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(d_model, num_heads, dropout, bias=bias, device=device, dtype=dtype)
        for tutorial, fast in _fast.TUTORIAL_NAMES.items():
            setattr(self, tutorial, self._modules.pop(fast))  # the same nn.Linear, the tutorial's name
        self.d_k = self.head_dim
        self.dropout = nn.Dropout(self.dropout)  # type: ignore[assignment]  # the tutorial's attribute

    # attnkit.MultiHeadAttention reads its projections by these names.
    W_q: nn.Linear
    W_k: nn.Linear
    W_v: nn.Linear
    W_o: nn.Linear

    @property
    def q_proj(self) -> nn.Linear:  # type: ignore[override]
        return self.W_q

    @property
    def k_proj(self) -> nn.Linear:  # type: ignore[override]
        return self.W_k

    @property
    def v_proj(self) -> nn.Linear:  # type: ignore[override]
        return self.W_v

    @property
    def out_proj(self) -> nn.Linear:  # type: ignore[override]
        return self.W_o

    def _dropout_p(self) -> float:
        return float(self.dropout.p)  # type: ignore[attr-defined]

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, num_heads={self.num_heads}, d_k={self.d_k}"

    def split_heads(self, x: torch.Tensor, batch_size: int) -> torch.Tensor:  # type: ignore[override]
        """``(batch_size, seq, d_model) -> (batch_size, num_heads, seq, d_k)``.

        The tutorial's signature: the second argument is the **batch size** (the
        number of heads is ``self.num_heads``), unlike the static
        ``attnkit.MultiHeadAttention.split_heads(x, num_heads)``. A ``batch_size``
        that is not ``x``'s raises instead of silently regrouping the data.
        """
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            raise AttnkitValueError(
                f"split_heads expects x of shape (batch_size, seq, {self.d_model}), but got "
                f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}."
            )
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size != x.shape[0]:
            raise AttnkitValueError(
                f"split_heads(x, batch_size) takes the batch size, x.size(0) = {x.shape[0]}, "
                f"but got batch_size={batch_size!r}. (The number of heads, {self.num_heads}, "
                "comes from the module.)"
            )
        return x.view(batch_size, -1, self.num_heads, self.d_k).permute(0, 2, 1, 3)

    def forward(  # type: ignore[override]  # the tutorial's signature: key and value are required
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | masks.Mask | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output, attention_weights)``: ``(B, Lq, d_model)`` and ``(B, num_heads, Lq, Lk)``.

        ``mask`` hides where it is 0 (see :func:`scaled_dot_product_attention`) and
        broadcasts to ``(B, num_heads, Lq, Lk)``; ``attnkit.masks`` objects work too.
        """
        out, weights = super().forward(query, key, value, _as_bool_mask(mask), need_weights=True)
        assert weights is not None
        return out, weights

    @classmethod
    def from_attnkit(cls, module: _fast.MultiHeadAttention) -> MultiHeadAttention:
        """The tutorial's class with a copy of an ``attnkit.MultiHeadAttention``'s weights."""
        if not isinstance(module, _fast.MultiHeadAttention):
            raise AttnkitTypeError(
                f"from_attnkit expects an attnkit.MultiHeadAttention, but got {type(module).__name__}."
            )
        if module.num_kv_heads != module.num_heads or module.kdim != module.d_model or module.vdim != module.d_model:
            raise AttnkitValueError(
                "the tutorial's MultiHeadAttention has num_kv_heads == num_heads and "
                f"kdim == vdim == d_model, but the module has {module.extra_repr()}."
            )
        weight = module.q_proj.weight
        new = cls(
            module.d_model,
            module.num_heads,
            module._dropout_p(),
            bias=module.q_proj.bias is not None,
            device=weight.device,
            dtype=weight.dtype,
        )
        new.load_state_dict(module.state_dict())
        return new.train(module.training)

    def to_attnkit(self) -> _fast.MultiHeadAttention:
        """An ``attnkit.MultiHeadAttention`` with a copy of these weights (same outputs)."""
        weight = self.W_q.weight
        new = _fast.MultiHeadAttention(
            self.d_model,
            self.num_heads,
            self._dropout_p(),
            bias=self.W_q.bias is not None,
            device=weight.device,
            dtype=weight.dtype,
        )
        new.load_state_dict(self.state_dict())
        return new.train(self.training)
