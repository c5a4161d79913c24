"""attnkit inside HuggingFace transformers: ``attn_implementation="attnkit"``.

Importing this module registers ``"attnkit"`` with transformers' ``AttentionInterface``
(the attention function) and ``AttentionMaskInterface`` (the mask function)::

    import attnkit.integrations.transformers
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attnkit")

Both are needed: with the attention function alone, transformers has no mask
function for the name and drops every mask without a warning.

The mask function turns what transformers describes (its mask functions: causal,
bidirectional, sliding windows, packed sequences; the 2-D padding mask; cache
offsets) into attnkit mask objects, which keep their block structure: the kernels
skip what they hide. One object is built per forward and shared by every layer,
so it is prepared once. A pattern it cannot translate becomes a dense mask built
by transformers itself (exact, but without block sparsity); ``attnkit.explain``
then names a ``dense`` mask.

A mask function it does not recognise is wrapped as :func:`attnkit.masks.from_fn`
(transformers' mask functions are index-based, as FlexAttention's ``mask_mod``), so it keeps
its block structure too; only one that cannot be evaluated on index tensors falls back
to transformers' own dense mask.

The attention function maps ``scaling``, ``dropout``, ``softcap`` (Gemma 2),
``s_aux`` (gpt-oss sinks), ``position_bias`` (T5's relative bias, as a dense bias),
GQA and ``output_attentions`` onto :func:`attnkit.attention`; :func:`attnkit.use_kernels`
reaches it. Models that compute attention in their own code (DeBERTa, XLNet, and the ALiBi
models Bloom, Falcon and MPT) would ignore the name: they are refused at load, with the
same words as :func:`check_model` (a module-registration hook of PyTorch sees the model
register its first layer with ``attn_implementation="attnkit"`` set on its config), and
attnkit's own entry points (``capture``, ``attnkit show --model``) check again. Nothing of
transformers is patched; :func:`unregister` removes the name and the hook again. transformers' internals are read
in :mod:`attnkit.integrations._transformers_compat` only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from attnkit import bias as _bias
from attnkit import masks
from attnkit._types import Offset
from attnkit._validate import AttnkitValueError, compiling
from attnkit.integrations import _transformers_compat as compat
from attnkit.nn.hooks import HookPoints
from attnkit.plan import PreparedMask, prepare

__all__ = [
    "NAME",
    "attention_forward",
    "check_model",
    "mask_function",
    "register",
    "register_attention_hook",
    "register_head_output_hook",
    "translate",
    "unregister",
    "uses_attention_interface",
]

#: The name to pass as ``attn_implementation``.
NAME = "attnkit"

#: transformers versions this integration is tested with.
TESTED = compat.TESTED


# --- masks -----------------------------------------------------------------------------


class Untranslatable(Exception):
    """A transformers mask function with no attnkit equivalent here."""


class _All:
    """The mask that lets every pair attend (a transformers mask function that hides nothing)."""


_ALL = _All()


def _and(a, b):
    if a is _ALL:
        return b
    if b is _ALL:
        return a
    return a & b


def _or(a, b):
    if a is _ALL or b is _ALL:
        return _ALL
    return a | b


def translate(
    fn: Callable[..., Any],
    kv_length: int,
    *,
    q_offset: Offset = 0,
    kv_offset: Offset = 0,
    unknown: Callable[[Callable[..., Any]], masks.Mask] | None = None,
) -> masks.Mask | _All:
    """An attnkit mask for a transformers mask function (``_ALL`` when it allows everything).

    Positions follow transformers: query ``i`` is at ``i + q_offset``, key ``j`` at
    ``j + kv_offset``. A part it has no formula for goes to ``unknown(fn)`` (e.g.
    :func:`_as_from_fn`), or raises :class:`Untranslatable` when that is None.
    """
    sub: dict[str, Any] = {"q_offset": q_offset, "kv_offset": kv_offset, "unknown": unknown}
    pos: dict[str, Any] = {"align": "top_left", "q_offset": q_offset, "kv_offset": kv_offset}
    if fn is compat.causal_mask_function:
        return masks.causal(**pos)
    if fn is compat.bidirectional_mask_function:
        return _ALL
    kind, cells = compat.kind(fn), compat.cells(fn)
    if kind in ("and_masks", "or_masks"):
        parts = list(cells["mask_functions"])
        overlay = [p for p in parts if compat.kind(p) == "sliding_window_overlay"]
        if kind == "and_masks" and overlay and compat.causal_mask_function in parts:
            window = compat.cells(overlay[0])["sliding_window"]  # kv > q - window, and kv <= q
            parts = [p for p in parts if p is not overlay[0] and p is not compat.causal_mask_function]
            result: masks.Mask | _All | None = masks.sliding_window(window - 1, 0, **pos)
        else:
            result = _ALL if kind == "and_masks" else None
        for part in parts:
            m = translate(part, kv_length, **sub)
            result = _and(result, m) if kind == "and_masks" else (m if result is None else _or(result, m))
        return _ALL if result is None else result
    if kind == "sliding_window_bidirectional_overlay":
        window = cells["sliding_window"]
        return masks.sliding_window(window, window, **pos)
    if kind == "packed_sequence_mask_function":
        return masks.document(cells["packed_sequence_mask"], q_offset=q_offset, kv_offset=kv_offset)
    if kind == "remap_positions_for_packed_sequence":
        # Positions restart at each packed sequence and rise by one inside it (that is how
        # transformers finds the sequences), so a pattern of position differences is the
        # same on raw indices; transformers always adds the packed-sequence mask beside it.
        return translate(cells["mask_function"], kv_length, **sub)
    if kind == "padding_mask_function":  # (B, kv_offset + kv_length), indexed by key position
        return _key_mask(cells["padding_mask"], kv_offset, kv_length)
    if unknown is not None:
        return unknown(fn)
    raise Untranslatable(getattr(fn, "__qualname__", repr(fn)))


def _as_from_fn(fn, batch_size: int, q_offset, kv_offset) -> masks.Mask:
    """A mask function attnkit has no formula for, as :func:`attnkit.masks.from_fn`: transformers'
    mask functions take broadcasting index tensors (batch, head, query position, key position)."""

    def transformers_mask(b, h, q_idx, kv_idx):
        return torch.as_tensor(fn(b, h, q_idx, kv_idx), dtype=torch.bool)

    transformers_mask.__name__ = getattr(fn, "__qualname__", "mask_function").split(".<locals>")[0]
    return masks.from_fn(transformers_mask, batch_size=batch_size, q_offset=q_offset, kv_offset=kv_offset)


def _key_mask(padding, kv_offset, kv_length):
    """``(B, 1, 1, Lk)`` dense mask of the keys a 2-D padding mask keeps; ``_ALL`` if all."""
    if isinstance(kv_offset, torch.Tensor):
        raise Untranslatable("padding with per-sequence key offsets")
    keys = padding[:, kv_offset : kv_offset + kv_length].to(torch.bool)
    if bool(keys.all()):
        return _ALL
    return masks.dense(keys[:, None, None, :])


def mask_function(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Offset = 0,
    kv_offset: Offset = 0,
    mask_function: Callable[..., Any] = compat.causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """transformers' mask interface for ``"attnkit"``: a :class:`~attnkit.PreparedMask` or None.

    None means "no mask" (bidirectional attention without padding). A pattern with no
    attnkit formula becomes a ``from_fn`` mask; one that cannot be evaluated on index
    tensors comes back as transformers' own dense bool mask.
    """
    device = kwargs.get("device", "cpu")
    padding = compat.padding_mask(attention_mask, kv_length, kv_offset)
    if kwargs.get("allow_is_causal_skip") and compat.ignore_causal_mask(
        padding, q_length, kv_length, q_offset, kv_offset, kwargs.get("local_size")
    ):
        return None  # plain causal attention over every key (the attention function applies it)
    step = q_length == 1 and mask_function is compat.causal_mask_function and padding is None
    if step:
        # one query (a decoding step) at position q_offset sees the keys up to it: a key limit per
        # sequence (a static cache's empty slots past it), which the kernels read as lengths (the
        # row path, with no mask and no plan) instead of a causal band over the whole cache. The
        # offsets are read on the host as ints where they can be (an int, a CPU tensor, eager): a few
        # operations per step in place of a dozen tensor ones, each costly between the layers'
        # products (a bfloat16 StaticCache step on an AMD Zen 4: ~200 us of the step's 8 ms)
        q_ints, kv_ints = _host_offsets(q_offset, batch_size), _host_offsets(kv_offset, batch_size)
        if q_ints is not None and kv_ints is not None:
            lengths = tuple(q - kv + 1 for q, kv in zip(q_ints, kv_ints))
            if all(0 <= n <= kv_length for n in lengths):
                return _carrier(masks.padding(lengths), batch_size, q_length, kv_length)
    q_off = _offset(q_offset)
    kv_off = _offset(kv_offset)
    if step:
        # the same with the limits as tensors (read on the host: under torch.compile a graph break,
        # the step's mask made eagerly)
        limit = q_off - kv_off + 1
        limits = limit.expand(batch_size) if isinstance(limit, torch.Tensor) else torch.full((batch_size,), limit)
        if bool(((limits >= 0) & (limits <= kv_length)).all()):
            return _carrier(masks.padding(limits.to("cpu", torch.long)), batch_size, q_length, kv_length)
    try:
        pattern = translate(
            mask_function,
            kv_length,
            q_offset=q_off,
            kv_offset=kv_off,
            unknown=lambda fn: _as_from_fn(fn, batch_size, q_off, kv_off),
        )
        if padding is not None:
            pattern = _and(pattern, _key_mask(padding, kv_off, kv_length))
        if isinstance(pattern, _All):
            return None
        # Prepared once here, shared by every layer of this forward.
        prepared = prepare(pattern, q_length, kv_length, device=device)
    except (Untranslatable, ValueError, TypeError, IndexError, RuntimeError):  # not evaluable on index tensors
        return compat.dense_mask(  # transformers' own bool mask (B, 1, Lq, Lk): exact, but dense
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            use_vmap=kwargs.get("use_vmap", False),
            device=device,
        )
    return _carrier(prepared, batch_size, q_length, kv_length)


def _carrier(mask: PreparedMask | masks.Mask, batch_size: int, q_length: int, kv_length: int) -> torch.Tensor:
    """A meta bool tensor of the mask's shape ``(B, 1, Lq, Lk)`` that carries the attnkit mask (a
    prepared mask, or for a decoding step the keys' limits).

    transformers passes masks between its functions as 4-D tensors (generation with a
    static cache reads ``.ndim`` and ``.shape`` and hands the mask back in), so the
    mask travels as a tensor that has the shape and no data; the attention function
    reads the prepared mask from it. Used as data anywhere else, a meta tensor fails
    loudly instead of silently meaning "attend everywhere".
    """
    carrier = torch.empty(batch_size, 1, q_length, kv_length, dtype=torch.bool, device="meta")
    carrier.attnkit_mask = mask  # type: ignore[attr-defined]
    return carrier


def _unwrap(mask):
    if isinstance(mask, torch.Tensor) and mask.device.type == "meta":
        prepared = getattr(mask, "attnkit_mask", None)
        if prepared is None:
            raise AttnkitValueError(
                "attnkit's transformers attention got a mask without data (a meta tensor) that "
                "lost its prepared attnkit mask: the model sliced or copied the mask. Please report "
                "the model; attn_implementation='sdpa' runs it meanwhile."
            )
        return prepared
    return mask


def _host_offsets(x, batch_size: int) -> tuple[int, ...] | None:
    """transformers' offset as ``batch_size`` Python ints where it is an int, or an integer CPU
    tensor of 1 or ``batch_size`` elements outside a trace; None otherwise."""
    if isinstance(x, int) and not isinstance(x, bool):
        return (x,) * batch_size
    if (
        not isinstance(x, torch.Tensor)
        or x.device.type != "cpu"
        or x.is_floating_point()
        or x.dtype == torch.bool
        or x.numel() not in (1, batch_size)
        or compiling()
    ):
        return None
    values = tuple(x.reshape(-1).tolist())
    return values * batch_size if len(values) == 1 else values


def _offset(x):
    """transformers' offsets as attnkit takes them: an int, or a ``(B,)``/``(1,)`` tensor."""
    if isinstance(x, torch.Tensor):
        return x.reshape(-1).to(torch.long)
    return int(x)


# --- attention -------------------------------------------------------------------------


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: PreparedMask | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention interface for ``"attnkit"``.

    ``query: (B, Hq, Lq, D)``, ``key``/``value: (B, Hkv, Lk, D)``; returns
    ``(out: (B, Lq, Hq, D), weights or None)`` as transformers expects, the weights
    ``(B, Hq, Lq, Lk)`` when ``output_attentions`` is asked for.
    """
    mask = _unwrap(attention_mask)
    if mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
        if causal and query.shape[2] > 1:
            # transformers leaves the mask out where SDPA's is_causal gives it, which aligns the
            # first query with the first key (top left): a StaticCache's prefill has Lk > Lq, its keys
            # past the prompt empty slots (bottom-right alignment let the queries see them)
            mask = masks.causal(align="top_left")
    elif isinstance(mask, torch.Tensor) and mask.is_floating_point():
        mask = mask.to(query.dtype)  # eager-style additive mask (0 / large negative)
    mods: dict[str, Any] = {
        "attn_bias": None if position_bias is None else _bias.dense(position_bias),
        "softcap": softcap,
        "sinks": s_aux,
        "scale": scaling,
        "dropout_p": dropout,
    }
    need_weights = bool(kwargs.get("output_attentions")) or _capturing_attentions()
    out, weights = HOOK_POINTS.run(module, query, key, value, mask, mods, need_weights=need_weights)
    return out.transpose(1, 2).contiguous(), weights  # (B, Hq, Lq, D) -> (B, Lq, Hq, D)


#: The integration's hooks, one call site for every attention module it runs (:mod:`attnkit.nn.hooks`).
HOOK_POINTS = HookPoints()


def register_lse_hook(hook: Callable[..., None]) -> RemovableHandle:
    """Call ``hook(module, lse)`` after every attention this integration runs without weights, with
    the row log-sum-exp ``lse: (B, Hq, Lq)`` the kernel computed (the call asks for it). The hook
    must not change it. :func:`attnkit.inspect.rollout` uses it. Returns a handle whose
    ``remove()`` unregisters the hook."""
    return HOOK_POINTS.register("lse", hook)


def register_head_output_hook(hook: Callable[..., torch.Tensor | None]) -> RemovableHandle:
    """Call ``hook(module, out)`` after every attention this integration runs, with the heads'
    outputs ``out: (B, Hq, Lq, D)`` before the model's output projection; a tensor it returns
    (same shape) replaces them. :func:`attnkit.inspect.intervene` uses it. Returns a handle whose
    ``remove()`` unregisters the hook."""
    return HOOK_POINTS.register("head_output", hook)


def register_attention_hook(hook: Callable[..., None]) -> RemovableHandle:
    """Call ``hook(module, q, k, v, mask, mods)`` before every attention this integration runs.

    ``q: (B, Hq, Lq, D)``, ``k``/``v: (B, Hkv, Lk, D)``; ``mask`` is what
    :func:`attnkit.attention` gets and ``mods`` its keyword arguments (``attn_bias``,
    ``softcap``, ``sinks``, ``scale``, ``dropout_p``). :func:`attnkit.capture` uses it.
    Returns a handle whose ``remove()`` unregisters the hook.
    """
    return HOOK_POINTS.register("attention", hook)


def _capturing_attentions() -> bool:
    """Whether transformers is collecting attention weights in this forward (``output_attentions``)."""
    collected = compat.active_collector()
    return bool(collected) and ("attentions" in collected or "cross_attentions" in collected)


uses_attention_interface = compat.uses_attention_interface


def _refusal(model_class: type) -> str:
    return (
        f"{model_class.__name__} computes attention in its own code (it never calls transformers' attention "
        "interface), so attn_implementation='attnkit' would run it without attnkit. attnkit cannot run this "
        "architecture through transformers; use attn_implementation='sdpa' (or 'eager')."
    )


def _refuse_at_load(module: torch.nn.Module, name: str, submodule: object) -> None:
    """A module-registration hook: a transformers model set to ``attn_implementation="attnkit"``
    that computes attention in its own code is refused when it registers its first layer (its
    config holds the implementation by then), so loading it fails with the reason."""
    if not isinstance(module, compat.pretrained_model_class()):
        return None
    config = getattr(module, "config", None)
    if getattr(config, "_attn_implementation", None) == NAME and not compat.uses_attention_interface(type(module)):
        raise AttnkitValueError(_refusal(type(module)))
    return None


#: The registration hook of :func:`register` (None while unregistered).
_LOAD_CHECK: list[RemovableHandle] = []


def check_model(model: torch.nn.Module) -> None:
    """Raise a clear error if ``model`` would not run its attention through attnkit.

    Checks that the model (and each of its sub-models: the vision tower and language model of
    LLaVA, say) is set to ``attn_implementation="attnkit"`` and runs its attention through
    transformers' attention interface. A model that computes attention in its own code
    (Bloom, Falcon, MPT) would otherwise silently run without attnkit.
    """
    parts = [m for m in model.modules() if isinstance(m, compat.pretrained_model_class())] or [model]
    for part in parts:
        config = getattr(part, "config", None)
        if config is None or getattr(config, "_attn_implementation", None) != NAME:
            raise AttnkitValueError(
                f"{type(part).__name__} is not set to attn_implementation={NAME!r}: load the model with "
                f"attn_implementation={NAME!r} (after `import attnkit.integrations.transformers`)."
            )
        if not compat.uses_attention_interface(type(part)):
            raise AttnkitValueError(_refusal(type(part)))


def register() -> None:
    """Register ``"attnkit"`` with transformers' attention and mask interfaces (done on import), and
    the check that refuses, at load, a model that would ignore it."""
    compat.register(NAME, attention_forward, mask_function)
    if not _LOAD_CHECK:
        _LOAD_CHECK.append(torch.nn.modules.module.register_module_module_registration_hook(_refuse_at_load))


def unregister() -> None:
    """Remove ``"attnkit"`` from transformers' interfaces again, and the load check (:func:`register`
    adds both back)."""
    compat.unregister(NAME)
    while _LOAD_CHECK:
        _LOAD_CHECK.pop().remove()


register()
