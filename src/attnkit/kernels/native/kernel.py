"""The ``native`` kernel: attnkit's C++ block-sparse flash attention, as PyTorch operators.

One call of ``torch.ops.attnkit.native_forward`` runs a whole plan: it reads a PreparedMask's
block lists and partial blocks' bits as tensors (:meth:`attnkit.PreparedMask.native_plan`), never
the host-side runs, and applies the mask, soft-capping and a bias of ``kv - q`` (ALiBi, T5's
relative bias, their sums: :meth:`attnkit.bias.Bias.band`, learnable) inside its tile loop.
Softmax statistics are float32; float32 inputs are read in place, bfloat16 and float16 ones a
tile at a time (bfloat16 products on AMX tiles or as AVX512-BF16 dot products where the CPU has
them: :func:`attnkit.kernels.native.build.info`). Calls of at most
:func:`few_rows` query rows (decoding) take a row path that reads only the keys some row sees,
and a padding mask reaches it as its lengths (:func:`limit_plan`: nothing prepared per step).
``native_stats`` computes :func:`attnkit.inspect.attention_stats` in two passes. The forward op is
differentiable through its registered autograd formula (``native_backward``), and traced by
``torch.compile`` as one op over the PreparedMask's tensors. It is built once per machine
(:mod:`attnkit.kernels.native.build`); where it cannot be, the registry runs the fused or math
kernel and ``attnkit.explain`` says why.

Equivalent PyTorch code (forward)::

    s = (q @ k.transpose(-2, -1)) * scale          # (B, Hq, Lq, Lk), K/V heads repeated for GQA
    s = softcap * torch.tanh(s / softcap)          # when softcap is given
    s = s + bias                                   # a bias of kv - q only (Bias.band)
    s = s.masked_fill(~prepared.materialize(), float("-inf"))
    lse = s.logsumexp(-1)                          # -inf where a query sees no key
    out = torch.softmax(s, -1).nan_to_num(0) @ v
"""

from __future__ import annotations

import array
from collections.abc import Callable

import torch

from attnkit import _cache
from attnkit.kernels import sparsity
from attnkit.kernels.contract import (
    Call,
    Form,
    Kernel,
    LimitRunner,
    Reason,
    RelevanceRequest,
    Runner,
    StatsRequest,
    first_derivative_only,
)
from attnkit.kernels.native import build as native_build
from attnkit.kernels.sparsity import BLOCK_SIZE
from attnkit.plan import PreparedMask

__all__ = [
    "DENSE_PLANS",
    "MIN_QUERIES",
    "MIN_ROWS",
    "NativeKernel",
    "backward",
    "few_rows",
    "forward",
    "limit_plan",
]

#: It is preferred for calls of at least this many queries (it computes 32 query rows at a time),
#: and for calls of at most :func:`few_rows` whose keys end at a limit per sequence.
MIN_ROWS = 16
#: It is preferred to SDPA for calls with at least this many query rows in all (B * Hq * Lq;
#: benchmarks/cpu.py and core.py: unmasked calls 0.76-0.92x SDPA's time from 2048 rows on, causal
#: 0.5-0.75x; at 1024 rows, unmasked, 1.04x). It does not depend on Lk, so a decoding step's
#: choice stays the same as its cache grows (the lean path relies on it).
MIN_QUERIES = 2048


#: The native engine's plan of every block kept, by ``(nq, nk, bq, bk)`` (plain tensors, never changed).
DENSE_PLANS = _cache.Bounded(32, "plans of every block kept")


def few_rows() -> int:
    """Calls of at most this many queries take the engine's row path (one dot product per score,
    each key read once for the query heads of its group): read from the loaded library."""
    return native_build.constants()["FEW_ROWS"]


def _require() -> None:
    ok, why = native_build.status()
    if not ok:
        raise RuntimeError(f"attnkit's native engine cannot run here: {why}")


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prepared: PreparedMask,
    *,
    scale: float,
    softcap: float | None = None,
    band: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, Hq, Lq, Dv) in q's dtype, lse (B, Hq, Lq) float32)``, differentiable in q, k, v
    and ``band``.

    q: (B, Hq, Lq, D), k: (B, Hkv, Lk, D), v: (B, Hkv, Lk, Dv) on the CPU, Hq a multiple of Hkv,
    any strides; ``prepared`` at a block size whose rows are a multiple of 32; ``band``: a bias
    of ``kv - q`` as ``(Hq or 1, Lq + Lk - 1)`` float32 (:meth:`attnkit.bias.Bias.band`).
    """
    _require()
    bq, bk = prepared.block_size
    plan = prepared.native_plan()
    return torch.ops.attnkit.native_forward(q, k, v, *plan, band, bq, bk, scale, softcap or 0.0)


def limit_plan(call: Call) -> tuple | None:
    """``(kv_num, kv_indices, tile_ids, bits, kv_limit)`` for a mask that hides exactly the keys
    past each sequence's limit (padding), made from the limits alone: every block listed (one
    plan per size, kept in ``attnkit.DENSE_PLANS``) and the limits as ``kv_limit``, so a
    decoding step's new padding mask is never prepared. None for other masks."""
    if isinstance(call.mask, PreparedMask) or call.form not in (Form.LIMIT, Form.LIMITS, Form.ALL, Form.NONE):
        return None
    limits = call.limits
    if limits is None and _few_rows_over_every_key(call):
        limits = (call.shapes.lk,) * call.shapes.batch[0]  # every key of every sequence
    if limits is None:
        return None
    return (*_dense_plan(call.shapes.lq, call.shapes.lk), torch.tensor(limits, dtype=torch.int64))


def _dense_plan(lq: int, lk: int) -> tuple:
    """``(kv_num, kv_indices, tile_ids, bits)`` listing every block of ``lq x lk`` as full (one per
    size, kept in ``DENSE_PLANS``)."""
    bq, bk = BLOCK_SIZE
    nq, nk = -(-lq // bq), -(-lk // bk)
    key = (nq, nk, bq, bk)
    dense = DENSE_PLANS.get(key)
    if dense is None:
        dense = (
            torch.full((1, 1, nq), nk, dtype=torch.int32),
            torch.arange(nk, dtype=torch.int32).expand(1, 1, nq, nk).contiguous(),
            torch.full((1, 1, nq, nk), -1, dtype=torch.int32),
            torch.zeros(1, bk, bq // 8, dtype=torch.uint8),
        )
        DENSE_PLANS.put(key, dense)
    return dense


def _plan(call: Call) -> tuple:
    """The native plan of an eager call: from its key limits (padding) or its prepared mask."""
    return limit_plan(call) or call.prepared_at(BLOCK_SIZE).native_plan()


def _few_rows(call: Call) -> bool:
    """A rank-4 eager call of at most FEW_ROWS queries, with no modification or dropout and no
    PreparedMask: what the row path can take."""
    return (
        call.shapes.lq <= few_rows()
        and call.shapes.rank == 4
        and not call.compiling
        and not call.mods
        and call.dropout_p == 0.0
        and not isinstance(call.mask, PreparedMask)
    )


def _few_rows_over_every_key(call: Call) -> bool:
    """Whether the row path takes this call, which sees every key (no mask, or one that hides
    nothing here: a causal mask at a decoding step): where K/V heads are shared (GQA), see
    :func:`_row_path_pays_over_every_key`."""
    return _few_rows(call) and _row_path_pays_over_every_key(call) and call.shapes.lk > 0 and _row_path_type(call)


#: The types the row path takes (it computes in float32 whatever the inputs', see ``_row_path_in_words``).
_ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _row_path_type(call: Call) -> bool:
    """Whether the row path takes this call's type, asked with the engine loaded: every one of
    :data:`_ROW_DTYPES` but bfloat16 where the engine's bfloat16 products run on AMX tiles. There
    PyTorch's bfloat16 kernel runs on them too, and an Intel Xeon with AMX measured the row path
    (bfloat16 rows widened to float32) at 1.2-1.3x SDPA's time for one layer of a ``StaticCache``
    step (docs/benchmarks.md); those steps stay on SDPA over each sequence's first keys."""
    return call.q.dtype in _ROW_DTYPES and not (call.q.dtype == torch.bfloat16 and _amx())


def _row_path_pays_over_every_key(call: Call) -> bool:
    """A call that sees every key, over shared K/V heads or with one query (a decoding step), asked
    without the engine, in float32, bfloat16 or float16.

    The row path reads each key once for the group's query heads (SDPA's ``enable_gqa`` reads it once
    per query head) and, over every key of a sequence, one run of K/V rows with no list of keys:
    measured on an Intel Xeon (one query, 8 query heads, 2 threads), the kernel alone 0.42-0.76x
    SDPA's time with groups of 4 over 1k-8k keys, and 0.66-0.84x without groups over 512-4096 keys
    (0.9-1.0x on one thread). Without groups a call of 2-8 queries stays on SDPA: such a call is as
    often a short self-attention (8 tokens) as a step of a decoder, and SDPA's fixed cost is lower
    there. In half precision the row path widens each K/V row as it reads it; on an AMD Zen 4 (one
    query, 1k and 8k keys, 1 and 2 threads) the kernel alone is 0.78-0.98x SDPA's time on a group's
    query heads folded into one head's rows (bfloat16, 1 or 4 sequences) and 0.14-0.3x SDPA's
    without groups (its half-precision kernel with one query); inside a whole model
    (benchmarks/models.py, bfloat16, 4 sequences) 0.75-0.85x SDPA's folded call. (An Intel Xeon
    measured earlier: 0.67-0.73x SDPA's time alone at 4 sequences, 1.15-1.28x at one.)"""
    s = call.shapes
    return call.form in (Form.NONE, Form.ALL) and call.q.dtype in _ROW_DTYPES and (s.hkv < s.hq or s.lq == 1)


def _few_rows_by_limit(call: Call) -> bool:
    """Whether the row path takes this call whatever its key limits: a rank-4 call of at most
    FEW_ROWS queries whose mask hides exactly the keys past each sequence's limit (padding), or one
    that sees every key where :func:`_few_rows_over_every_key` says so; float32 or half precision, no
    modification or dropout, eager. A bfloat16 ``StaticCache`` step of benchmarks/models.py (its
    empty slots past each sequence's limit) on an AMD Zen 4: 0.83x the attention time of SDPA's
    folded call over each sequence's first keys, 0.95x the whole step's."""
    if call.form is Form.ALL or call.limits is None:  # every key seen: as with no mask
        return _few_rows_over_every_key(call)
    return _few_rows(call) and _row_path_type(call)


def _row_path(call: Call) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, tuple | None], torch.Tensor]:
    """``(q, k, v, limits) -> out``: the row path over each sequence's first ``limits`` keys (None:
    every key), at any key length (a growing cache's), with no gradient (the fast path's signatures
    say so); a :data:`LimitRunner`."""
    scale, lq = call.scale, call.shapes.lq
    bq, bk = BLOCK_SIZE
    op = torch.ops.attnkit.native_forward

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limits: tuple | None) -> torch.Tensor:
        # the limits as a tensor over an array's memory (torch.tensor of a tuple costs 3x as much,
        # ~3.5 us, a tenth of a decoding step); None: every key of every sequence
        kv_limit = None if limits is None else torch.frombuffer(array.array("q", limits), dtype=torch.int64)
        with torch._C._AutoDispatchBelowAutograd():
            return op(q, k, v, *_dense_plan(lq, k.shape[2]), kv_limit, None, bq, bk, scale, 0.0)[0]

    return run


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prepared: PreparedMask,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None = None,
    *,
    scale: float,
    softcap: float | None = None,
    band: torch.Tensor | None = None,
    own_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` in the inputs' dtypes, recomputed from the saved ``lse``.

    ``out`` and ``lse`` are the forward's, or with ``own_lse=False`` (a part of the keys: ring
    attention) the merged output and log-sum-exp: the gradient of this part is the same formula
    with ``delta = rowsum(grad_out * out)``; a call's own keys use the sum of ``P * dP`` over
    them with ``P`` renormalised (the softmax's own backward). ``grad_lse``: (B, Hq, Lq) or None.
    Arguments as :func:`forward`'s.
    """
    return _backward(
        q, k, v, prepared.native_plan(), prepared.block_size, out, lse, grad_out, grad_lse, scale=scale,
        softcap=softcap, band=band, own_lse=own_lse,
    )  # fmt: skip


def _backward(q, k, v, plan, block_size, out, lse, grad_out, grad_lse, *, scale, softcap, band, own_lse):
    _require()
    bq, bk = block_size
    grad_out, out = grad_out.to(q.dtype), out.to(q.dtype)
    grad_lse = None if grad_lse is None else grad_lse.float()
    band = None if band is None else band.detach()
    dq, dk, dv, _ = torch.ops.attnkit.native_backward(
        grad_out, grad_lse, q, k, v, out, lse.float(), *plan, band, bq, bk, scale, softcap or 0.0, not own_lse,
        False,
    )  # fmt: skip
    return dq, dk, dv


def _kept_in_words(call: Call) -> str:
    if call.mask is None:
        return "no mask"
    limits = None if isinstance(call.mask, PreparedMask) else call.limits
    if limits is not None:
        return f"keys up to each sequence's limit ({min(limits)}-{max(limits)} of {call.shapes.lk})"
    return f"{call.prepared_at(BLOCK_SIZE).kept:.0%} of blocks kept"


def _row_path_in_words(call: Call) -> str:
    """The row path computes in float32 whatever the inputs' type (its rows are widened as read)."""
    how = native_build.describe(False)
    return f"{how}; {str(call.q.dtype).removeprefix('torch.')} rows widened to float32" if call.half else how


def _worth_loading(call: Call) -> bool:
    """Whether :meth:`NativeKernel.prefers` could take this call, asked without the engine (its
    sizes are read from the library): where not, nothing is loaded or compiled for it."""
    s = call.shapes
    if s.lq < MIN_ROWS:
        return (
            s.rank == 4
            and not call.mods
            and call.dropout_p == 0.0
            and not isinstance(call.mask, PreparedMask)
            and (call.limits is not None or _row_path_pays_over_every_key(call))
        )
    if call.mods or call.return_lse or sparsity.rows_of(call) >= MIN_QUERIES:
        return True
    return call.mask is not None and bool(sparsity.sparse_pays(call, sparsity.LIMITS, squares=True)[0])


def _band(call: Call) -> torch.Tensor | None:
    """The call's bias as a band of ``kv - q`` (differentiable in the bias's tensors), or None."""
    return call.bias_band


def _amx() -> bool:
    """The engine's bf16 products run on AMX tiles in this process (``native_build.info()``)."""
    return "AMX tiles" in native_build.info()


class NativeKernel(Kernel):
    """attnkit's C++ engine over a prepared mask (see the module's docstring)."""

    name = "native"
    devices = ("cpu",)
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    block_size = BLOCK_SIZE
    supports_lse = True
    supports_backward_part = True
    supports_stats = True
    supports_relevance = True
    supports_score_mods = ("bias", "softcap")  # bias: a band of kv - q; sinks from the lse
    max_rank = 4

    def state(self) -> object:
        # ATTNKIT_NATIVE=0 (or the attribute set in this process), and whether the engine was loaded
        # yet: a choice made before the first load (which declined to load it) is made again after
        return native_build.ENABLED, native_build.tried()

    def unavailable(self) -> str | None:
        found = native_build.loaded_state()
        if not native_build.ENABLED or found is None or found[0]:  # off by the user's choice, or not tried
            return None
        return found[1].removeprefix("native engine unavailable: ")

    def _reasons(self, call: Call) -> list[str]:
        reasons = sparsity.compile_refusals(call)
        if not native_build.tried() and native_build.ENABLED and not call.compiling and not _worth_loading(call):
            # the engine is loaded (or compiled) at the first call that would take it, not for one that
            # would not: an 8-token call runs on SDPA without waiting for a build
            reasons.append("not loaded yet: this call would not take it (it loads at the first call that would)")
            return reasons
        if call.compiling:  # built and loaded at trace time where it was not yet (an eager step of tracing)
            why = native_build.refusal_while_tracing()
            if why:
                reasons.append(why)
            elif isinstance(call.mask, PreparedMask) and call.mask.block_size != BLOCK_SIZE:
                reasons.append(f"under torch.compile: a PreparedMask of block size {BLOCK_SIZE} (the default)")
            return reasons
        ok, why = native_build.status()
        if not ok:
            reasons.append(why)
        if call.bias is not None and _band(call) is None:
            reasons.append(
                "a bias that is not a finite function of kv - q alone (the math kernel evaluates it per tile)"
            )
        return reasons

    def prefers(self, call: Call) -> tuple[bool, Reason]:
        s = call.shapes
        if s.lq < MIN_ROWS:
            if _few_rows_by_limit(call):
                return (
                    True,
                    lambda: (
                        (
                            f"{s.lq} queries over every key, {s.hq // s.hkv} query heads a K/V head: the row path "
                            f"reads each key once for the group; {_row_path_in_words(call)}"
                            if s.hq > s.hkv
                            else f"{s.lq} queries over every key: the row path reads K and V once, as one run of "
                            f"rows; {_row_path_in_words(call)}"
                        )
                        if call.limits is None
                        else f"{s.lq} queries whose keys end at each sequence's limit: the row path reads only "
                        f"those keys, no mask; {_row_path_in_words(call)}"
                    ),
                )
            return (
                False,
                lambda: (
                    f"{s.lq} queries: it computes {native_build.constants()['ROWS']} rows at a time "
                    "(decoding steps run elsewhere)"
                ),
            )
        if call.compiling:
            return True, "under torch.compile: torch.ops.attnkit.native_forward over the PreparedMask's tensors"
        how = native_build.describe(call.half)
        if call.mods or call.return_lse:
            mods = sparsity.modifications_in_words(call, True) or "return_lse=True"
            return True, lambda: f"{_kept_in_words(call)}, {mods}; {how}"
        rows = sparsity.rows_of(call)
        # half precision with a backward, on PyTorch's own dense (fp16: and causal, where bf16 runs on
        # AMX tiles) SDPA: its backward uses half-precision products, the engine's computes in float32,
        # but for bf16 on AMX tiles (docs/benchmarks.md: 0.7-0.85x SDPA's time there, causal and dense)
        tiles = _amx() and call.q.dtype == torch.bfloat16
        half_training = (
            call.half and call.backward and not tiles and (call.mask is None or (_amx() and call.causal_shift() == 0))
        )
        if rows >= MIN_QUERIES and not call.tensor_mask and not half_training and call.dropout_p == 0.0:
            return True, lambda: f"{_kept_in_words(call)}, {rows} query rows; {how}"
        if half_training and rows >= MIN_QUERIES:
            return False, (
                f"{'no mask' if call.mask is None else 'causal'}, half precision with a backward: SDPA's "
                "backward uses half-precision products (the engine's computes in float32 but for bfloat16 "
                "on AMX tiles)"
            )
        yes, why = sparsity.sparse_pays(call, sparsity.LIMITS, squares=True)
        if not yes:
            return yes, why
        return True, lambda: f"{why if isinstance(why, str) else why()}; {how}"

    def runner(self, call: Call) -> Runner | None:
        if call.mods or call.compiling:
            return None
        s, plan, scale = call.shapes, _plan(call), call.scale
        bq, bk = BLOCK_SIZE
        lead = (1,) * (4 - s.rank)
        op = torch.ops.attnkit.native_forward

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if not lead:
                return op(q, k, v, *plan, None, bq, bk, scale, 0.0)[0]
            q4, k4, v4 = (t.reshape(*lead, *t.shape) for t in (q, k, v))  # (B, H, L, D)
            return op(q4, k4, v4, *plan, None, bq, bk, scale, 0.0)[0].reshape(s.out)

        if call.backward:
            return first_derivative_only(run, self)

        def run_no_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # no gradient is asked for (the signature says so): the operator's CPU kernel directly,
            # without its autograd formula's Python wrapper (a decoding step's overhead)
            with torch._C._AutoDispatchBelowAutograd():
                return run(q, k, v)

        return run_no_grad

    def any_length_runner(self, call: Call) -> Runner | None:
        if call.mask is not None or call.backward or not _few_rows_over_every_key(call):
            return None
        by_limits = _row_path(call)
        return lambda q, k, v: by_limits(q, k, v, None)  # every key of every sequence

    def limit_runner(self, call: Call) -> LimitRunner | None:
        if call.backward or not _few_rows_by_limit(call):
            return None
        return _row_path(call)

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        s = call.shapes
        q4, k4, v4 = call.as4d()
        if call.compiling:
            prepared = call.mask
            assert isinstance(prepared, PreparedMask), "compiled calls carry a PreparedMask"
            bq, bk = prepared.block_size
            plan = prepared.native_plan()
            out, lse = torch.ops.attnkit.native_forward(
                q4, k4, v4, *plan, None, bq, bk, call.scale, call.softcap or 0.0
            )
        else:
            _require()
            bq, bk = BLOCK_SIZE
            out, lse = torch.ops.attnkit.native_forward(
                q4, k4, v4, *_plan(call), _band(call), bq, bk, call.scale, call.softcap or 0.0
            )
        return out.reshape(s.out), lse.reshape(s.scores[:-1]) if call.return_lse else None

    def backward_part(
        self, call: Call, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, grad_lse: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q4, k4, v4 = call.as4d()
        return _backward(
            q4, k4, v4, _plan(call), BLOCK_SIZE, out, lse, grad_out, grad_lse, scale=call.scale,
            softcap=call.softcap, band=_band(call), own_lse=False,
        )  # fmt: skip

    def stats(self, call: Call, request: StatsRequest) -> dict[str, torch.Tensor]:
        """The statistics from one operator call, ``torch.ops.attnkit.native_stats``: the engine's own
        two passes (the lse, then the weights reduced tile by tile)."""
        _require()
        bq, bk = BLOCK_SIZE
        band = _band(call)
        sinks = None if call.sinks is None else call.sinks.detach().float().reshape(-1)
        found = torch.ops.attnkit.native_stats(
            call.q, call.k, *_plan(call), None if band is None else band.detach(), sinks, request.qpos.float(),
            request.kpos.float(), bq, bk, call.scale, call.softcap or 0.0, request.sink_tokens, request.topk,
        )  # fmt: skip
        names = ("lse", "entropy", "max_weight", "argmax", "sink_mass", "mean_distance", "received")
        out = dict(zip(names, found))
        if request.topk:
            out["topk_weights"], out["topk_keys"] = found[7], found[8]
        return out

    def relevance(self, call: Call, request: RelevanceRequest) -> torch.Tensor:
        """The gradient rule's reduction from one operator call, ``torch.ops.attnkit.native_relevance``:
        per 32 rows, a pass summing the weights ``exp(s - lse)`` (and the sink's) with the forward's lse, whose
        float32 rounding the sum divides out, then the pass over the listed blocks, ``dA = dO V^T`` per step."""
        _require()
        bq, bk = BLOCK_SIZE
        band = _band(call)

        def f32(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(torch.float32).contiguous()

        sinks = None if call.sinks is None else f32(call.sinks).reshape(-1)
        return torch.ops.attnkit.native_relevance(
            call.q, call.k, call.v, *_plan(call), None if band is None else band.detach(), sinks, f32(request.lse),
            None if request.d_out is None else f32(request.d_out), f32(request.r), f32(request.head_weights),
            bq, bk, call.scale, call.softcap or 0.0,
        )  # fmt: skip
