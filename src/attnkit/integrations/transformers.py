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

The attention function maps ``scaling``, ``dropout``, ``softcap`` (Gemma 2),
``s_aux`` (gpt-oss sinks), ``position_bias`` (T5's relative bias, as a dense bias),
GQA and ``output_attentions`` onto :func:`attnkit.attention`. Models that compute
attention themselves (ALiBi models such as Bloom and Falcon) are refused by
:func:`check_model` rather than run without attnkit.
"""

from __future__ import annotations

import collections
import functools
import inspect
import re
import sys
import warnings

import torch
from torch.utils.hooks import RemovableHandle

from attnkit import bias as _bias
from attnkit import masks
from attnkit._validate import AttnkitValueError
from attnkit.functional import attention, attention_with_weights
from attnkit.prepare import prepare

try:
    import transformers
    from transformers import AttentionInterface
    from transformers import masking_utils as _mu
except ModuleNotFoundError as err:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError(
        "attnkit.integrations.transformers needs HuggingFace transformers: pip install 'attnkit[hf]'"
    ) from err

__all__ = ["NAME", "attention_forward", "check_model", "mask_function", "register_attention_hook", "translate"]

#: The name to pass as ``attn_implementation``.
NAME = "attnkit"

#: transformers versions this integration is tested with.
TESTED = ("5.24",)


# --- masks -----------------------------------------------------------------------------


class Untranslatable(Exception):
    """A transformers mask function with no attnkit equivalent here."""


_ALL = object()  # every pair may attend


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


def _closure(fn) -> dict:
    names = fn.__code__.co_freevars
    return {name: cell.cell_contents for name, cell in zip(names, fn.__closure__ or ())}


def _kind(fn) -> str:
    return getattr(fn, "__qualname__", "").split(".<locals>", 1)[0]


def translate(fn, kv_length: int, *, q_offset=0, kv_offset=0):
    """An attnkit mask for a transformers mask function (``_ALL`` when it allows everything).

    Positions follow transformers: query ``i`` is at ``i + q_offset``, key ``j`` at
    ``j + kv_offset``. Raises :class:`Untranslatable` for patterns it does not know.
    """
    sub = {"q_offset": q_offset, "kv_offset": kv_offset}
    pos = {"align": "top_left", "q_offset": q_offset, "kv_offset": kv_offset}
    if fn is _mu.causal_mask_function:
        return masks.causal(**pos)
    if fn is _mu.bidirectional_mask_function:
        return _ALL
    kind, cells = _kind(fn), _closure(fn) if callable(fn) and hasattr(fn, "__code__") else {}
    if kind in ("and_masks", "or_masks"):
        parts = list(cells["mask_functions"])
        overlay = [p for p in parts if _kind(p) == "sliding_window_overlay"]
        if kind == "and_masks" and overlay and _mu.causal_mask_function in parts:
            window = _closure(overlay[0])["sliding_window"]  # kv > q - window, and kv <= q
            parts = [p for p in parts if p is not overlay[0] and p is not _mu.causal_mask_function]
            result = masks.sliding_window(window - 1, 0, **pos)
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
    raise Untranslatable(getattr(fn, "__qualname__", repr(fn)))


def _key_mask(padding, kv_offset, kv_length):
    """``(B, 1, 1, Lk)`` dense mask of the keys a 2-D padding mask keeps; ``_ALL`` if all."""
    if isinstance(kv_offset, torch.Tensor):
        raise Untranslatable("padding with per-sequence key offsets")
    keys = padding[:, kv_offset : kv_offset + kv_length].to(torch.bool)
    if bool(keys.all()):
        return _ALL
    return masks.dense(keys[:, None, None, :])


def mask_function(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                  mask_function=_mu.causal_mask_function, attention_mask=None, **kwargs):
    """transformers' mask interface for ``"attnkit"``: a :class:`~attnkit.PreparedMask` or None.

    None means "no mask" (bidirectional attention without padding). A pattern that
    cannot be translated comes back as transformers' own dense bool mask.
    """
    device = kwargs.get("device", "cpu")
    padding = _mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if kwargs.get("allow_is_causal_skip") and _mu._ignore_causal_mask_sdpa(
        padding, q_length, kv_length, q_offset, kv_offset, kwargs.get("local_size")
    ):
        return None  # plain causal attention over every key (the attention function applies it)
    q_off = _offset(q_offset)
    kv_off = _offset(kv_offset)
    try:
        pattern = translate(mask_function, kv_length, q_offset=q_off, kv_offset=kv_off)
        if padding is not None:
            pattern = _and(pattern, _key_mask(padding, kv_off, kv_length))
    except (Untranslatable, AttnkitValueError, TypeError):
        dense = _mu.sdpa_mask(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
            kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
            allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
            use_vmap=kwargs.get("use_vmap", False), device=device,
        )
        return dense  # transformers' own bool mask (B, 1, Lq, Lk): exact, but dense
    if pattern is _ALL:
        return None
    # Prepared once here, shared by every layer of this forward.
    return _carrier(prepare(pattern, q_length, kv_length, device=device), batch_size)


def _carrier(prepared, batch_size: int) -> torch.Tensor:
    """A meta bool tensor of the mask's shape ``(B, 1, Lq, Lk)`` that carries the prepared mask.

    transformers passes masks between its functions as 4-D tensors (generation with a
    static cache reads ``.ndim`` and ``.shape`` and hands the mask back in), so the
    mask travels as a tensor that has the shape and no data; the attention function
    reads the prepared mask from it. Used as data anywhere else, a meta tensor fails
    loudly instead of silently meaning "attend everywhere".
    """
    carrier = torch.empty(batch_size, 1, prepared.q_len, prepared.kv_len, dtype=torch.bool, device="meta")
    carrier.attnkit_mask = prepared
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


def _offset(x):
    """transformers' offsets as attnkit takes them: an int, or a ``(B,)``/``(1,)`` tensor."""
    if isinstance(x, torch.Tensor):
        return x.reshape(-1).to(torch.long)
    return int(x)


# --- attention -------------------------------------------------------------------------


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, position_bias=None, softcap=None, s_aux=None, **kwargs):
    """transformers' attention interface for ``"attnkit"``.

    ``query: (B, Hq, Lq, D)``, ``key``/``value: (B, Hkv, Lk, D)``; returns
    ``(out: (B, Lq, Hq, D), weights or None)`` as transformers expects, the weights
    ``(B, Hq, Lq, Lk)`` when ``output_attentions`` is asked for.
    """
    mask = _unwrap(attention_mask)
    if mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
        if causal and query.shape[2] > 1:
            mask = masks.causal()
    elif isinstance(mask, torch.Tensor) and mask.is_floating_point():
        mask = mask.to(query.dtype)  # eager-style additive mask (0 / large negative)
    mods = {
        "attn_bias": None if position_bias is None else _bias.dense(position_bias),
        "softcap": softcap,
        "sinks": s_aux,
        "scale": scaling,
        "dropout_p": dropout,
    }
    for hook in tuple(_attention_hooks.values()):
        hook(module, query, key, value, mask, mods)
    if kwargs.get("output_attentions") or _capturing_attentions():
        out, weights = attention_with_weights(query, key, value, mask, **mods)
    else:
        out, weights = attention(query, key, value, mask, **mods), None
    return out.transpose(1, 2).contiguous(), weights  # (B, Hq, Lq, D) -> (B, Lq, Hq, D)


_attention_hooks: collections.OrderedDict = collections.OrderedDict()


def register_attention_hook(hook) -> RemovableHandle:
    """Call ``hook(module, q, k, v, mask, mods)`` before every attention this integration runs.

    ``q: (B, Hq, Lq, D)``, ``k``/``v: (B, Hkv, Lk, D)``; ``mask`` is what
    :func:`attnkit.attention` gets and ``mods`` its keyword arguments (``attn_bias``,
    ``softcap``, ``sinks``, ``scale``, ``dropout_p``). :func:`attnkit.capture` uses it.
    Returns a handle whose ``remove()`` unregisters the hook.
    """
    handle = RemovableHandle(_attention_hooks)
    _attention_hooks[handle.id] = hook
    return handle


def _capturing_attentions() -> bool:
    """Whether transformers is collecting attention weights in this forward (``output_attentions``)."""
    if _collector is None:
        return False
    collected = _collector.get()
    return bool(collected) and ("attentions" in collected or "cross_attentions" in collected)


try:  # transformers records outputs through a context variable, not through kwargs
    from transformers.utils.output_capturing import _active_collector as _collector
except ImportError:  # pragma: no cover - other transformers versions
    _collector = None


# --- models that bypass the interface ----------------------------------------------------------


def uses_attention_interface(model_class) -> bool:
    """Whether a transformers model class runs its attention through ``ALL_ATTENTION_FUNCTIONS``.

    Some architectures (the ALiBi models Bloom, Falcon and MPT among them) compute
    attention in their own code and would ignore ``attn_implementation="attnkit"``.
    A class qualifies if transformers marks it as taking attention backends
    (``_supports_attention_backend``), if its module calls the attention interface, or
    if it is a composite model (a config with sub-configs, e.g. LLaVA or PaliGemma) whose
    module defines no attention of its own: its vision and text parts are models of
    their own, each checked when it is built.
    """
    if getattr(model_class, "_supports_attention_backend", False):
        return True
    module = sys.modules.get(getattr(model_class, "__module__", ""), None)
    if module is None:
        return False
    if module.__name__ not in _USES_INTERFACE:
        try:
            source = inspect.getsource(module)
        except (OSError, TypeError):
            source = ""
        calls = "ALL_ATTENTION_FUNCTIONS" in source or "AttentionInterface" in source
        composite = bool(getattr(getattr(model_class, "config_class", None), "sub_configs", None))
        _USES_INTERFACE[module.__name__] = calls or (composite and not re.search(r"^class \w*Attention\w*\(", source, re.M))
    return _USES_INTERFACE[module.__name__]


_USES_INTERFACE: dict[str, bool] = {}


def check_model(model) -> None:
    """Raise a clear error if ``model`` would not run its attention through attnkit."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != NAME:
        raise AttnkitValueError(
            f"{type(model).__name__} is not set to attn_implementation={NAME!r}: load it with "
            f"attn_implementation={NAME!r} (after `import attnkit.integrations.transformers`)."
        )
    _refuse_bypassing(type(model))


def _refuse_bypassing(model_class) -> None:
    if not uses_attention_interface(model_class):
        raise AttnkitValueError(
            f"{model_class.__name__} computes attention in its own code (it never calls transformers' "
            "attention interface), so attn_implementation='attnkit' would silently run without attnkit. "
            "attnkit cannot run this architecture through transformers; use attn_implementation='sdpa'."
        )


def _refusing(get_correct):
    """Wrap ``PreTrainedModel.get_correct_attn_implementation`` to refuse bypassing models."""

    @functools.wraps(get_correct)
    def wrapper(self, requested_attention=None, *args, **kwargs):
        if requested_attention == NAME:
            _refuse_bypassing(type(self))
        return get_correct(self, requested_attention, *args, **kwargs)

    wrapper._attnkit_refusing = True
    return wrapper


def _register() -> None:
    if not transformers.__version__.startswith(TESTED):
        warnings.warn(
            f"attnkit's transformers integration is tested with transformers {', '.join(TESTED)}, "
            f"not {transformers.__version__}: check your model's outputs against attn_implementation='sdpa'.",
            stacklevel=3,
        )
    AttentionInterface.register(NAME, attention_forward)
    _mu.AttentionMaskInterface.register(NAME, mask_function)
    base = transformers.PreTrainedModel
    if not getattr(base.get_correct_attn_implementation, "_attnkit_refusing", False):
        base.get_correct_attn_implementation = _refusing(base.get_correct_attn_implementation)


_register()
