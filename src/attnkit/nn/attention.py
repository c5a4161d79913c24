"""``MultiHeadAttention``: projections around :func:`attnkit.attention`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from attnkit import masks
from attnkit._types import Device, IntLike
from attnkit._validate import AttnkitTypeError, AttnkitValueError, check_dropout
from attnkit.bias import BiasLike
from attnkit.nn.hooks import HookPoints
from attnkit.plan import MaskLike

if TYPE_CHECKING:
    from attnkit.nn.cache import KVCache

# The tutorial names the four projections W_q, W_k, W_v and W_o; a state dict saved
# under those names (attnkit.tutorial.MultiHeadAttention, or the tutorial's own class)
# loads into this module as it is.
TUTORIAL_NAMES = {"W_q": "q_proj", "W_k": "k_proj", "W_v": "v_proj", "W_o": "out_proj"}


def _split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(B, L, H * d) -> (B, H, L, d)``."""
    b, length, width = x.shape
    return x.view(b, length, num_heads, width // num_heads).transpose(1, 2)


def _positive_int(x, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise AttnkitTypeError(f"{name} must be an int, but got {x!r}.")
    if x <= 0:
        raise AttnkitValueError(f"{name} must be positive, but got {name}={x}.")
    return x


class MultiHeadAttention(nn.Module):
    """Multi-head attention over batch-first inputs; self, cross or bidirectional.

    ``softmax(Q K^T / sqrt(d_k)) V`` per head, with ``Q = query W_q``,
    ``K = key W_k``, ``V = value W_v``, the heads merged and projected by ``W_o``.

    Args:
        d_model: width of the queries and of the output.
        num_heads: number of query heads; must divide ``d_model``.
        dropout: dropout on the attention weights, applied in training mode only.
        bias: whether the four projections have a bias.
        kdim: width of ``key`` (cross-attention from another width); default ``d_model``.
        vdim: width of ``value``; default ``d_model``.
        num_kv_heads: number of K/V heads (grouped-query attention); must divide
            ``num_heads``. Defaults to ``num_heads``.
        softcap: soft-cap the scaled scores, ``softcap * tanh(s / softcap)`` (Gemma 2).
        sinks: give each head a learnable sink logit ``self.sinks: (num_heads,)``, an
            extra key with value 0 in every softmax denominator (gpt-oss); starts at 0.
        rotary: a :class:`~attnkit.nn.RotaryEmbedding` applied to the projected queries
            and keys (RoPE) at ``positions`` (``forward(..., positions=)``; by default
            ``0..L-1``, after the tokens of a ``cache``: ``cache.positions``).

    Shapes: ``query: (B, Lq, d_model)``, ``key: (B, Lk, kdim)``, ``value: (B, Lk, vdim)``
    (or unbatched ``(L, E)``); returns ``(out, weights)`` with ``out: (B, Lq, d_model)``
    and ``weights: (B, num_heads, Lq, Lk)`` if ``need_weights`` else None.

    >>> import torch, attnkit
    >>> mha = attnkit.MultiHeadAttention(64, 8)
    >>> x = torch.randn(2, 10, 64)
    >>> out, w = mha(x, x, x, mask=attnkit.masks.causal(), need_weights=True)
    >>> out.shape, w.shape
    (torch.Size([2, 10, 64]), torch.Size([2, 8, 10, 10]))
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        dropout: float = 0.0,
        *,
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        num_kv_heads: int | None = None,
        softcap: float | None = None,
        sinks: bool = False,
        rotary: nn.Module | None = None,
        device: Device = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        d_model = _positive_int(d_model, "d_model")
        num_heads = _positive_int(num_heads, "num_heads")
        if d_model % num_heads != 0:
            raise AttnkitValueError(
                f"d_model must be divisible by num_heads, but got d_model={d_model} and "
                f"num_heads={num_heads} (d_model % num_heads = {d_model % num_heads})."
            )
        num_kv_heads = num_heads if num_kv_heads is None else _positive_int(num_kv_heads, "num_kv_heads")
        if num_heads % num_kv_heads != 0:
            raise AttnkitValueError(
                f"num_heads must be a multiple of num_kv_heads, but got num_heads={num_heads} "
                f"and num_kv_heads={num_kv_heads}."
            )
        self.d_model = d_model
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = d_model // num_heads
        self.kdim = d_model if kdim is None else _positive_int(kdim, "kdim")
        self.vdim = d_model if vdim is None else _positive_int(vdim, "vdim")
        self.dropout = check_dropout(dropout, "dropout")
        kv_width = num_kv_heads * self.head_dim
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(d_model, d_model, bias=bias, **factory)
        self.k_proj = nn.Linear(self.kdim, kv_width, bias=bias, **factory)
        self.v_proj = nn.Linear(self.vdim, kv_width, bias=bias, **factory)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias, **factory)
        if softcap is not None and (
            isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0
        ):
            raise AttnkitValueError(f"softcap must be a positive number or None, but got {softcap!r}.")
        self.softcap = None if softcap is None else float(softcap)
        if not isinstance(sinks, bool):
            raise AttnkitTypeError(f"sinks must be True or False (a learnable logit per head), but got {sinks!r}.")
        self.sinks = nn.Parameter(torch.zeros(num_heads, **factory)) if sinks else None
        if rotary is not None and not isinstance(rotary, nn.Module):
            raise AttnkitTypeError(
                f"rotary must be an nn.Module such as attnkit.nn.RotaryEmbedding, but got {type(rotary).__name__}."
            )
        self.rotary = rotary
        #: this layer's hooks (attention, lse, head output): :mod:`attnkit.nn.hooks`
        self.hook_points = HookPoints()

    def register_head_output_hook(self, hook: Callable[..., torch.Tensor | None]) -> RemovableHandle:
        """Call ``hook(module, out)`` on every forward with the heads' outputs ``out: (B, num_heads,
        Lq, head_dim)``, before the output projection; a tensor it returns (same shape) replaces
        them (``None``: unchanged). :func:`attnkit.inspect.intervene` and ``capture(mode="heads")``
        use it. Returns a handle whose ``remove()`` unregisters it.

        >>> import torch, attnkit
        >>> mha = attnkit.MultiHeadAttention(16, 4)
        >>> keep = torch.tensor([0.0, 1, 1, 1]).view(4, 1, 1)  # head 0 off
        >>> handle = mha.register_head_output_hook(lambda module, out: out * keep)
        >>> y, _ = mha(torch.randn(2, 5, 16))
        >>> handle.remove()
        """
        if not callable(hook):
            raise AttnkitTypeError(f"hook must be callable as hook(module, out), but got {type(hook).__name__}.")
        return self.hook_points.register("head_output", hook)

    def register_lse_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(module, lse)`` on every forward with the attention's row log-sum-exp ``lse:
        (B, num_heads, Lq)`` (float32; ``-inf`` for a row that sees no key), as the kernel computed
        it (the call asks for it: ``return_lse=True``); not with ``need_weights=True``. The hook
        must not change it. :func:`attnkit.inspect.rollout` (``method="grad"``) uses it to rebuild
        the weights without running attention again. Returns a handle whose ``remove()``
        unregisters it.
        """
        if not callable(hook):
            raise AttnkitTypeError(f"hook must be callable as hook(module, lse), but got {type(hook).__name__}.")
        return self.hook_points.register("lse", hook)

    def register_attention_hook(self, hook: Callable[..., None], *, with_kwargs: bool = False) -> RemovableHandle:
        """Call ``hook(module, q, k, v, mask)`` on every forward, just before attention.

        ``q: (B, num_heads, Lq, head_dim)``, ``k``/``v: (B, num_kv_heads, Lk, head_dim)``
        are the projected heads (keys and values of a cache included, rotary embeddings
        applied) and ``mask`` is the mask the attention call gets. With
        ``with_kwargs=True`` (as in ``torch.nn.Module.register_forward_pre_hook``) the hook
        is called as ``hook(module, q, k, v, mask, kwargs)`` with the call's other keyword
        arguments: ``attn_bias`` (aligned with a cache), ``softcap``, ``sinks`` and
        ``dropout_p``. The hook must not change them; its return value is ignored. Returns
        a handle whose ``remove()`` unregisters it, like ``register_forward_hook``.

        >>> import torch, attnkit
        >>> mha = attnkit.MultiHeadAttention(16, 4)
        >>> shapes = []
        >>> handle = mha.register_attention_hook(lambda m, q, k, v, mask: shapes.append(tuple(q.shape)))
        >>> _ = mha(torch.randn(2, 5, 16))
        >>> handle.remove()
        >>> shapes
        [(2, 4, 5, 4)]
        """
        if not callable(hook):
            raise AttnkitTypeError(
                f"hook must be callable as hook(module, q, k, v, mask), but got {type(hook).__name__}."
            )
        if with_kwargs:
            return self.hook_points.register("attention", hook)
        return self.hook_points.register("attention", lambda module, q, k, v, mask, kwargs: hook(module, q, k, v, mask))

    def extra_repr(self) -> str:
        extra = f"d_model={self.d_model}, num_heads={self.num_heads}"
        if self.num_kv_heads != self.num_heads:
            extra += f", num_kv_heads={self.num_kv_heads}"
        if self.kdim != self.d_model or self.vdim != self.d_model:
            extra += f", kdim={self.kdim}, vdim={self.vdim}"
        if self.softcap is not None:
            extra += f", softcap={self.softcap:g}"
        if self.sinks is not None:
            extra += ", sinks=True"
        return extra + f", dropout={self.dropout}"

    @staticmethod
    def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
        """``(B, L, H * d) -> (B, H, L, d)``.

        This takes the number of heads; the tutorial's ``split_heads(x, batch_size)``
        is :meth:`attnkit.tutorial.MultiHeadAttention.split_heads`.
        """
        return _split_heads(x, num_heads)

    @staticmethod
    def merge_heads(x: torch.Tensor) -> torch.Tensor:
        """``(B, H, L, d) -> (B, L, H * d)``, the inverse of :meth:`split_heads`."""
        b, h, length, d = x.shape
        return x.transpose(1, 2).reshape(b, length, h * d)

    def _dropout_p(self) -> float:
        """The dropout probability on the attention weights in training mode."""
        return self.dropout

    # Names of the projections in the other layout, mapped to this class's names.
    _other_layout: ClassVar[dict[str, str]] = TUTORIAL_NAMES

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Accept both layouts: the tutorial's names (W_q.weight, ...) and attnkit's
        # (q_proj.weight, ...); load_state_dict passes its own copy, renamed here in place.
        for old, new in self._other_layout.items():
            for key in [k for k in state_dict if k.startswith(f"{prefix}{old}.")]:
                state_dict[f"{prefix}{new}.{key[len(prefix) + len(old) + 1 :]}"] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _check_input(self, x, name: str, width: int) -> None:
        if not isinstance(x, torch.Tensor):
            raise AttnkitTypeError(f"{name} must be a torch.Tensor, but got {type(x).__name__}.")
        if not x.is_floating_point():
            raise AttnkitTypeError(
                f"{name} must be a floating point tensor (embeddings), but got {x.dtype}. Token ids go "
                "through an nn.Embedding first."
            )
        if x.dim() not in (2, 3) or x.shape[-1] != width:
            raise AttnkitValueError(
                f"{name} must have shape (B, L, {width}) or (L, {width}), but got {tuple(x.shape)}."
            )

    def _project_q(self, query):
        """``(B, Lq, d_model)`` or ``(Lq, d_model)`` -> ``(B, num_heads, Lq, head_dim)``."""
        self._check_input(query, "query", self.d_model)
        if query.dim() == 2:
            query = query[None]
        return _split_heads(self.q_proj(query), self.num_heads)  # (B, Lq, d_model) -> (B, H, Lq, hd)

    def project(
        self, query: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The per-head queries, keys and values of :meth:`forward`.

        Returns ``q: (B, num_heads, Lq, head_dim)``, ``k: (B, num_kv_heads, Lk, head_dim)``
        and ``v: (B, num_kv_heads, Lk, head_dim)`` for batched 3-D inputs.
        """
        key = query if key is None else key
        value = key if value is None else value
        q = self._project_q(query)
        k, v = self.project_kv(key, value)
        if query.dim() != key.dim():
            raise AttnkitValueError(
                "query, key and value must all be batched (B, L, E) or all unbatched (L, E), "
                f"but got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}."
            )
        if q.shape[0] != k.shape[0]:
            raise AttnkitValueError(
                f"query and key must have the same batch size, but got query: "
                f"{tuple(query.shape)} and key: {tuple(key.shape)}."
            )
        return q, k, v

    def project_kv(self, key: torch.Tensor, value: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys and values ``(B, num_kv_heads, Lk, head_dim)`` of a fixed memory.

        Compute them once and pass ``kv=`` to :meth:`forward` on every decoding step
        (cross-attention over an encoder's output).
        """
        value = key if value is None else value
        self._check_input(key, "key", self.kdim)
        self._check_input(value, "value", self.vdim)
        if key.shape[:-1] != value.shape[:-1]:
            raise AttnkitValueError(
                f"key and value must have the same batch size and length, but got "
                f"key: {tuple(key.shape)} and value: {tuple(value.shape)}."
            )
        if key.dim() == 2:
            key, value = key[None], value[None]
        k = _split_heads(self.k_proj(key), self.num_kv_heads)  # (B, Lk, kdim) -> (B, Hkv, Lk, hd)
        v = _split_heads(self.v_proj(value), self.num_kv_heads)  # (B, Lk, vdim) -> (B, Hkv, Lk, hd)
        return k, v

    def _rotate(self, t: torch.Tensor, positions) -> torch.Tensor:
        if self.rotary is None:
            return t
        if positions is None:
            positions = torch.arange(t.shape[-2], device=t.device)
        return self.rotary(t, positions)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        mask: MaskLike = None,
        need_weights: bool = False,
        *,
        cache: KVCache | None = None,
        counts: IntLike | None = None,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        attn_bias: BiasLike = None,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend from ``query`` to ``key``/``value`` (both default to ``query``).

        ``mask`` is any mask :func:`attnkit.attention` takes (True = may attend),
        broadcastable to ``(B, num_heads, Lq, Lk)``; the tutorial's
        ``create_padding_mask`` ``(B, 1, 1, L)`` and ``create_causal_mask`` ``(L, L)``
        fit as they are. ``weights`` are the probabilities before dropout.

        Decoding:

        - ``cache``: a :class:`~attnkit.nn.KVCache`. The keys and values of ``query``'s
          tokens are appended (``counts: (B,)`` real tokens per sequence, default all)
          and the queries attend over everything stored; a mask object (e.g.
          ``masks.causal()``) and a bias object (e.g. ``bias.relative(...)``) are aligned
          with each sequence's own end (:meth:`KVCache.mask`, :meth:`KVCache.bias`), so
          decoding a batch of mixed fills equals recomputing each prefix.
        - ``kv``: keys and values from :meth:`project_kv`, reused across calls.

        ``attn_bias``: an :mod:`attnkit.bias` object (or float tensor) added to the
        scores of this call, e.g. ``attnkit.bias.alibi(slopes)``.

        ``positions``: ``(Lq,)`` or ``(B, Lq)`` positions of the query tokens for
        ``rotary`` (self-attention without a cache: also of the keys).
        """
        unbatched = isinstance(query, torch.Tensor) and query.dim() == 2
        if counts is not None and cache is None:
            raise AttnkitValueError("counts= says how many new entries of a KV cache are real: pass it with cache=.")
        if kv is not None and (
            not isinstance(kv, (tuple, list)) or len(kv) != 2 or not all(isinstance(t, torch.Tensor) for t in kv)
        ):
            raise AttnkitTypeError(
                "kv must be the pair (k, v) of tensors returned by project_kv, but got "
                f"{type(kv).__name__}{f' of length {len(kv)}' if isinstance(kv, (tuple, list)) else ''}."
            )
        if cache is not None or kv is not None:
            if key is not None or value is not None:
                raise AttnkitValueError("pass key/value, or cache= / kv=, not both.")
            q = self._project_q(query)
            if kv is not None:
                k, v = kv
                q = self._rotate(q, positions)
            else:
                assert cache is not None
                new_k, new_v = self.project_kv(query)
                if self.rotary is not None:
                    if positions is None:  # after each sequence's tokens so far (a compressed cache's dropped ones too)
                        positions = cache.positions.to(q.device)[:, None] + torch.arange(q.shape[-2], device=q.device)
                    q, new_k = self._rotate(q, positions), self._rotate(new_k, positions)
                cache.append(new_k, new_v, counts)
                k, v = cache.stored()
                if mask is None or isinstance(mask, masks.Mask):
                    mask = cache.mask(mask, num_heads=self.num_heads)
                attn_bias = cache.bias(attn_bias)
        else:
            q, k, v = self.project(query, key, value)
            if self.rotary is not None:
                if key is not None and key is not query:
                    raise AttnkitValueError(
                        "rotary embeddings are for self-attention: call forward(x) without key/value."
                    )
                q, k = self._rotate(q, positions), self._rotate(k, positions)
        p = self._dropout_p() if self.training else 0.0
        mods: dict[str, Any] = dict(attn_bias=attn_bias, softcap=self.softcap, sinks=self.sinks, dropout_p=p)
        cross = kv is not None or (key is not None and key is not query)  # keys from another sequence
        out, weights = self.hook_points.run(self, q, k, v, mask, mods, need_weights=need_weights, cross=cross)
        out = self.out_proj(self.merge_heads(out))  # (B, H, Lq, hd) -> (B, Lq, d_model)
        if unbatched:
            out = out[0]
            weights = None if weights is None else weights[0]
        return out, weights

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiHeadAttention:
        """An attnkit module with the weights of a ``torch.nn.MultiheadAttention``.

        Outputs and per-head weights match ``module(..., average_attn_weights=False)``.
        attnkit takes batch-first inputs ``(B, L, E)``; transpose yours if the torch
        module has ``batch_first=False``. Torch's bool ``attn_mask`` marks the
        positions to *hide*; pass ``~attn_mask`` to attnkit.
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise AttnkitTypeError(
                f"from_torch expects a torch.nn.MultiheadAttention, but got {type(module).__name__}."
            )
        if module.bias_k is not None or module.add_zero_attn:
            raise AttnkitValueError(
                "from_torch does not support add_bias_kv=True or add_zero_attn=True: they "
                "append extra keys that attnkit's MultiHeadAttention does not have."
            )
        ref = module.out_proj.weight
        new = cls(
            module.embed_dim,
            module.num_heads,
            module.dropout,
            bias=module.in_proj_bias is not None,
            kdim=module.kdim,
            vdim=module.vdim,
            device=ref.device,
            dtype=ref.dtype,
        )
        if module._qkv_same_embed_dim:
            weights = module.in_proj_weight.chunk(3)
        else:
            weights = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
        biases = module.in_proj_bias.chunk(3) if module.in_proj_bias is not None else (None,) * 3
        with torch.no_grad():
            for proj, w, b in zip((new.q_proj, new.k_proj, new.v_proj), weights, biases):
                proj.weight.copy_(w)
                if b is not None:
                    proj.bias.copy_(b)
            new.out_proj.weight.copy_(module.out_proj.weight)
            if module.out_proj.bias is not None:
                new.out_proj.bias.copy_(module.out_proj.bias)
        return new.train(module.training)
