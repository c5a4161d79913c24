"""Everything attnkit reads of HuggingFace transformers beyond its public API, in one place.

The transformers integration translates transformers' mask functions (recognised by
their qualified names and closure cells), skips the causal mask where transformers would
(its own SDPA rule), finds whether ``output_attentions`` is being collected (a context
variable), and tells models that call the attention interface from those that compute
attention in their own code (transformers' ``_supports_attention_backend`` flag or the
model module's source). These are transformers internals: they are read here only,
behind :func:`check_version`, and the test suite runs against the versions in
:data:`TESTED`.
"""

from __future__ import annotations

import inspect
import re
import sys
import warnings

try:
    import transformers
    from transformers import AttentionInterface
    from transformers import masking_utils as _mu
except ModuleNotFoundError as err:  # pragma: no cover - depends on the environment
    from attnkit.errors import MissingExtraError

    raise MissingExtraError(
        "attnkit.integrations.transformers needs HuggingFace transformers: pip install 'attnkit[hf]'"
    ) from err

__all__ = [
    "TESTED",
    "active_collector",
    "bidirectional_mask_function",
    "causal_mask_function",
    "cells",
    "check_version",
    "dense_mask",
    "ignore_causal_mask",
    "kind",
    "padding_mask",
    "register",
    "unregister",
    "uses_attention_interface",
]

#: transformers versions (major.minor) the integration is tested with.
TESTED = ("5.24",)
#: The oldest major version whose mask and attention interfaces attnkit knows.
MIN_MAJOR = 5

causal_mask_function = _mu.causal_mask_function
bidirectional_mask_function = _mu.bidirectional_mask_function


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:2])


def check_version(version: str | None = None) -> str:
    """``"tested"`` or ``"untested"`` for a transformers version (default: the installed one).

    Below :data:`MIN_MAJOR` the interfaces differ: ImportError naming the range. An untested
    version warns once, at registration (mask translation falls back to transformers' dense
    masks wherever a pattern is not recognised, so the integration stays exact).
    """
    version = transformers.__version__ if version is None else version
    parsed = _version_tuple(version)
    if not parsed or parsed[0] < MIN_MAJOR:
        raise ImportError(
            f"attnkit's transformers integration needs transformers >= {MIN_MAJOR} (tested with "
            f"{', '.join(TESTED)}), but {version} is installed: pip install 'attnkit[hf]'."
        )
    return "tested" if any(parsed == _version_tuple(t) for t in TESTED) else "untested"


# --- mask functions ---------------------------------------------------------------------------


def cells(fn) -> dict:
    """The variables a mask-function closure holds (``{name: value}``; empty for plain functions)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, fn.__closure__ or ())}


def kind(fn) -> str:
    """The factory a mask function came from (``"and_masks"``, ``"sliding_window_overlay"``, ...)."""
    return getattr(fn, "__qualname__", "").split(".<locals>", 1)[0]


def padding_mask(attention_mask, kv_length: int, kv_offset):
    """transformers' 2-D padding mask for these keys (or None)."""
    return _mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)


def ignore_causal_mask(padding, q_length, kv_length, q_offset, kv_offset, local_size) -> bool:
    """transformers' own rule for when its SDPA path skips the causal mask (``is_causal`` instead)."""
    return _mu._ignore_causal_mask_sdpa(padding, q_length, kv_length, q_offset, kv_offset, local_size)


def dense_mask(**kwargs):
    """transformers' own dense bool mask ``(B, 1, Lq, Lk)`` for a mask function (exact, not sparse)."""
    return _mu.sdpa_mask(allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **kwargs)


def active_collector():
    """The collector transformers records ``output_attentions`` into during a forward, or None."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # other transformers versions: no collector to read
        return None
    return _active_collector.get()


# --- models ----------------------------------------------------------------------------------------


_USES_INTERFACE: dict[str, bool] = {}


def uses_attention_interface(model_class) -> bool:
    """Whether a transformers model class runs its attention through ``ALL_ATTENTION_FUNCTIONS``.

    Some architectures (the ALiBi models Bloom, Falcon and MPT among them) compute
    attention in their own code and would ignore ``attn_implementation="attnkit"``.
    A class qualifies if transformers marks it as taking attention backends
    (``_supports_attention_backend``), if its module calls the attention interface, or
    if it is a composite model (a config with sub-configs, e.g. LLaVA or PaliGemma) whose
    module defines no attention of its own: its vision and text parts are models of their
    own, each checked in turn.
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
        _USES_INTERFACE[module.__name__] = calls or (
            composite and not re.search(r"^class \w*Attention\w*\(", source, re.M)
        )
    return _USES_INTERFACE[module.__name__]


def pretrained_model_class():
    return transformers.PreTrainedModel


# --- registration -------------------------------------------------------------------------------------


def register(name: str, attention_function, mask_function) -> None:
    """Register both functions under ``name`` (the attention function alone would make transformers
    drop every mask: it finds no mask function for the name)."""
    if check_version() == "untested":
        warnings.warn(
            f"attnkit's transformers integration is tested with transformers {', '.join(TESTED)}, "
            f"not {transformers.__version__}: check your model's outputs against attn_implementation='sdpa'.",
            stacklevel=3,
        )
    AttentionInterface.register(name, attention_function)
    _mu.AttentionMaskInterface.register(name, mask_function)


def unregister(name: str) -> None:
    """Remove ``name`` from transformers' attention and mask interfaces (if registered)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for registry in (ALL_ATTENTION_FUNCTIONS, _mu.ALL_MASK_ATTENTION_FUNCTIONS):
        mapping = getattr(registry, "_local_mapping", None)
        if mapping is not None:
            mapping.pop(name, None)
        global_mapping = getattr(registry, "_global_mapping", None)
        if global_mapping is not None:
            global_mapping.pop(name, None)
