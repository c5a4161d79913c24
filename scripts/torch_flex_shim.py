"""A pytest plugin that points PyTorch's own Flex tests at ``attnkit.flex``.

Loaded with ``-p torch_flex_shim`` (``scripts/`` on ``PYTHONPATH``) before a test file is
imported, it replaces ``flex_attention`` and ``create_block_mask`` in
``torch.nn.attention.flex_attention``, so a test file that imports them from there (and torch's
``PagedAttention``, which does the same) runs attnkit's. Everything else is torch's, unchanged:
``torch.compile`` and inductor, ``BlockMask``, ``and_masks``/``or_masks``/``noop_mask`` (attnkit
re-exports torch's), the tests' assertions and tolerances.

The oracle. Torch's tests call the same ``flex_attention`` three times: in float64 (the "golden"
answer), in the test's dtype (the "reference" error), and under ``torch.compile``; they pass when
the compiled error stays within a factor of the reference error. With ``ATTNKIT_TORCH_ORACLE=torch``
(the default) an eager float64 call runs torch's own FlexAttention (its dense math path), so
attnkit's fp32/bf16 results, eager and compiled, are measured against torch's float64 answer, not
attnkit's own; ``ATTNKIT_TORCH_ORACLE=attnkit`` sends every call to attnkit.

``ATTNKIT_TORCH_AGAINST=torch`` installs nothing: the same tests on torch's own FlexAttention, the
baseline that tells a test this torch fails itself (a test file of another torch version) from one
attnkit fails.
"""

from __future__ import annotations

import os

import torch
import torch.nn.attention.flex_attention as torch_flex

import attnkit.flex

ORACLE = os.environ.get("ATTNKIT_TORCH_ORACLE", "torch")
if ORACLE not in ("torch", "attnkit"):
    raise ValueError(f"ATTNKIT_TORCH_ORACLE must be 'torch' or 'attnkit', not {ORACLE!r}")

TORCH_FLEX_ATTENTION = torch_flex.flex_attention
TORCH_CREATE_BLOCK_MASK = torch_flex.create_block_mask


def _is_oracle_call(args, kwargs) -> bool:
    query = args[0] if args else kwargs.get("query")
    return (
        ORACLE == "torch"
        and isinstance(query, torch.Tensor)
        and query.dtype == torch.float64
        and not torch.compiler.is_compiling()
    )


def flex_attention(*args, **kwargs):
    """attnkit's ``flex_attention``; an eager float64 call goes to torch's (the oracle)."""
    if _is_oracle_call(args, kwargs):
        return TORCH_FLEX_ATTENTION(*args, **kwargs)
    return attnkit.flex.flex_attention(*args, **kwargs)


def install() -> None:
    torch_flex.flex_attention = flex_attention
    torch_flex.create_block_mask = attnkit.flex.create_block_mask


def pytest_configure(config) -> None:
    if os.environ.get("ATTNKIT_TORCH_AGAINST", "attnkit") == "attnkit":
        install()
