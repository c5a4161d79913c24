"""attnkit: exact attention for any mask, attention you can see into, and the
tutorial's API on top.

One mask convention everywhere: True means "may attend".
"""

from attnkit import masks, tutorial
from attnkit._validate import AttnkitError, AttnkitTypeError, AttnkitValueError
from attnkit.functional import attention, attention_weights, attention_with_weights, explain
from attnkit.inspect import capture
from attnkit.kernels import use_kernels
from attnkit.nn import KVCache, MultiHeadAttention
from attnkit.prepare import PreparedMask, prepare

# The tutorial's functions, also at the top level (the same objects as attnkit.tutorial's).
from attnkit.tutorial import (
    create_causal_mask,
    create_padding_mask,
    scaled_dot_product_attention,
    visualize_attention,
)

__version__ = "0.1.0"

__all__ = [
    "AttnkitError",
    "AttnkitTypeError",
    "AttnkitValueError",
    "KVCache",
    "MultiHeadAttention",
    "PreparedMask",
    "attention",
    "attention_weights",
    "attention_with_weights",
    "capture",
    "create_causal_mask",
    "create_padding_mask",
    "explain",
    "masks",
    "prepare",
    "scaled_dot_product_attention",
    "tutorial",
    "use_kernels",
    "visualize_attention",
]

