"""When block sparsity pays: the decision the block-sparse CPU kernels (native, fused, math) take in
their ``prefers``, each with its own :class:`Limits`, against PyTorch's dense or per-limit SDPA.

A shared part of the kernels: it reads the call's form and its prepared plan, never a kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from attnkit.kernels import blocks
from attnkit.kernels.contract import Call, Form, Reason
from attnkit.plan import PreparedMask

__all__ = [
    "BLOCK_SIZE",
    "LIMITS",
    "MAX_LIMIT_GROUPS",
    "Limits",
    "compile_refusals",
    "limit_groups",
    "modifications_in_words",
    "rows_of",
    "sparse_pays",
    "squares_and_full",
]

#: The block size of the CPU kernels' prepared masks (benchmarks/cpu.py).
BLOCK_SIZE = (128, 64)

#: Sequences of at most this many different key limits run as one SDPA call per limit (each over
#: its own keys, no mask, no copy of K/V); more run as one call with the dense mask.
MAX_LIMIT_GROUPS = 16


def limit_groups(call: Call) -> tuple[int, ...] | None:
    """The call's key limits when they differ and a few SDPA calls over each sequence's own keys
    run it (at most :data:`MAX_LIMIT_GROUPS` different limits), else None."""
    if call.form is not Form.LIMITS or call.limits is None:
        return None
    if len(set(call.limits)) > MAX_LIMIT_GROUPS:
        return None
    return call.limits


@dataclass(frozen=True)
class Limits:
    """A kernel's thresholds for masked calls, from benchmarks/cpu.py and core.py.

    - ``min_pairs``: below this many (query, key) pairs one dense call beats tiling a plan ...
    - ``min_keys``: ... unless the keys are many (decoding over a long padded cache reads only
      each sequence's own keys here);
    - ``padding_min_keys``: a mask that only cuts each sequence's keys (padding) from this many
      keys on (decoding: 1.3-6x faster than the dense mask at 128-1024 keys, batches of 1-64);
    - ``max_kept[(half precision, backward)]``: masked plans keeping at most this fraction of
      blocks; ``max_kept_full``: plans of full blocks (or causal squares and full blocks, a
      prefix-LM: 1.6-2x faster than the dense mask at 54-69% kept).
    """

    min_pairs: int = 256 * 256
    min_keys: int = 1024
    padding_min_keys: int = 128
    max_kept: tuple[tuple[tuple[bool, bool], float], ...] = (
        ((False, False), 0.85),
        ((False, True), 0.6),
        ((True, False), 0.6),
        ((True, True), 0.3),
    )
    max_kept_full: float = 0.85

    def kept_limit(self, half: bool, backward: bool) -> float:
        return dict(self.max_kept)[(half, backward)]


#: The thresholds of the fused and math kernels (and of the native one below its row limit).
LIMITS = Limits()


def squares_and_full(prepared: PreparedMask, call: Call) -> bool:
    """Whether the plan runs as causal squares plus row blocks of full runs only: a plan of one
    group that costs what a plan of full blocks does (Hq == Hkv, Dv == D: PyTorch's fused kernel
    takes the squares)."""
    if not blocks.single(prepared) or call.shapes.hq != call.shapes.hkv or call.shapes.d != call.shapes.dv:
        return False
    steps = blocks.steps_with_squares(prepared, 0)
    return any(isinstance(s, blocks.Square) for s in steps) and all(
        isinstance(s, blocks.Square) or all(run.full for run in s.runs) for s in steps
    )


def sparse_pays(call: Call, limits: Limits = LIMITS, squares: bool = False) -> tuple[bool, Reason]:
    """Whether a plain masked call (no score modification, dropout or lse) runs faster block-sparse
    than as SDPA's dense mask, and why, by ``limits``. ``squares``: a plan of causal squares and full
    blocks counts as full (:func:`squares_and_full`). Prepares the mask only where the answer needs
    its plan."""
    s = call.shapes
    form = call.form
    if form is Form.NONE:
        return False, "no mask: SDPA's fused kernel"
    if form is Form.CAUSAL and call.scale > 0.0:
        return False, "is_causal: SDPA's fused kernel"
    small = lambda: f"dense mask: Lq*Lk={call.pairs} is small"  # noqa: E731
    if call.tensor_mask and call.pairs < limits.min_pairs:
        return False, small
    if form is Form.ALL:
        return False, "the mask hides nothing here"
    if form is Form.LIMIT:
        return False, f"every sequence's keys end at {call.shared_key_limit()}: SDPA over those keys"
    if limit_groups(call) is not None:  # no mask, no copy, the keys past a limit unread
        return False, "each sequence's keys end at its own limit: SDPA over each one's keys (a call per limit)"
    padding = call.facts.limit_only and s.lk >= limits.padding_min_keys
    if call.pairs < limits.min_pairs and s.lk <= limits.min_keys and not padding:
        return False, small
    p = call.prepared_at(BLOCK_SIZE)
    if p.hides_nothing:
        return False, "the mask hides nothing here"
    if p.limit_only and p.kv_limit_value and s.rank == 4:
        return False, lambda: f"every sequence's keys end at {p.kv_limit_value}: SDPA over those keys"
    if not p.masked and p.kv_limit is not None:
        return True, lambda: f"{p.kept:.0%} of blocks kept, all full, keys past each sequence's end unread"
    if not p.masked and p.kept <= limits.max_kept_full:
        return True, lambda: f"{p.kept:.0%} of blocks kept, all full"
    if call.pairs < limits.min_pairs:
        return False, small
    if p.kept <= limits.kept_limit(call.half, call.backward):
        return True, lambda: f"{p.kept:.0%} of blocks kept"
    if p.kept <= limits.max_kept_full and squares and squares_and_full(p, call):
        return True, lambda: f"{p.kept:.0%} of blocks kept: causal squares and full blocks"
    return False, lambda: f"{p.kept:.0%} of blocks kept: the dense mask is faster"


def modifications_in_words(call: Call, band: bool | None) -> str:
    """How a call's score modifications are applied, for explain (``band``: a bias as a band)."""
    parts = []
    if call.bias is not None:
        parts.append(f"attn_bias {'as a band of kv - q' if band else 'on each tile'}")
    if call.softcap is not None or call.score_mod is not None:
        parts.append("softcap/score_mod on each tile")
    if call.sinks is not None:
        parts.append("sinks from the lse")
    return ", ".join(parts)


def compile_refusals(call: Call) -> list[str]:
    """Why a block-sparse CPU kernel cannot run a call under torch.compile."""
    reasons = []
    if call.compiling:
        if not isinstance(call.mask, PreparedMask):
            reasons.append(
                "under torch.compile it reads a PreparedMask made outside the compiled function "
                "(attnkit.prepare); mask objects become dense masks in the graph"
            )
        if call.bias is not None or call.score_mod is not None or call.dropout_p > 0.0:
            reasons.append("under torch.compile: no attn_bias, score_mod or dropout (they run eagerly only)")
    return reasons


def rows_of(call: Call) -> int:
    """Query rows in all: B * Hq * Lq."""
    s = call.shapes
    return math.prod(s.batch) * s.hq * s.lq
