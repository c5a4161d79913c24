"""One attention call, validated once: the input checks of every public attention function and
the :class:`Call` value kernels read.

:func:`make_call` checks q, k, v, the mask and the score modifications (every error names the
values it got and says how to fix them) and returns a frozen :class:`Call` whose facts are
computed here, once: its shapes, its scale, whether a backward pass will run, the mask's
:class:`~attnkit.plan.MaskFacts`, each sequence's key limit where the mask only cuts keys, and
its :class:`Form`, the one place the form of a call is derived. Every kernel decides on these
fields; none derives them again, and no answer depends on which kernel was asked first.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from dataclasses import dataclass, field
from numbers import Real
from typing import TYPE_CHECKING, Any

import torch

from attnkit import bias as _bias
from attnkit import masks as _masks
from attnkit._context import any_autocast, autocast_cast, autocast_dtype, forward_ad_active, transform_of
from attnkit._validate import AttnkitTypeError, AttnkitValueError, broadcasts_to, check_dropout, compiling, short
from attnkit.bias import band_of
from attnkit.plan import DEFAULT_BLOCK_SIZE, MaskFacts, MaskLike, PreparedMask, mask_facts, prepare, prepared_for
from attnkit.score_mods import ScoreModLike, as_score_mod

if TYPE_CHECKING:
    from attnkit.bias import Bias, BiasLike
    from attnkit.score_mods import ScoreMod

__all__ = [
    "Call",
    "Form",
    "Shapes",
    "check_broadcast",
    "clamped_limits",
    "check_qkv",
    "check_scale",
    "check_tensor_mask",
    "make_call",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Shapes:
    """The sizes of one attention call, read from validated q, k, v.

    ``batch`` holds every leading dimension before the head dimension (empty for
    rank-2 and rank-3 inputs); ``hq``/``hkv`` are 1 for rank-2 inputs.
    """

    batch: tuple[int, ...]
    hq: int
    hkv: int
    lq: int
    lk: int
    d: int
    dv: int
    rank: int

    @property
    def scores(self) -> tuple[int, ...]:
        """The shape of the attention matrix, ``(*batch, Hq, Lq, Lk)``."""
        if self.rank == 2:
            return (self.lq, self.lk)
        return (*self.batch, self.hq, self.lq, self.lk)

    @property
    def out(self) -> tuple[int, ...]:
        """The shape of the output, ``(*batch, Hq, Lq, Dv)``."""
        return (*self.scores[:-1], self.dv)


class Form(enum.Enum):
    """What a call's mask is, as the kernels decide on it (``Call.form``)."""

    NONE = "no mask"
    ALL = "a mask that hides nothing here"
    CAUSAL = "causal, query i sees keys j <= i (SDPA's is_causal)"
    LIMIT = "every sequence's keys end at one limit"
    LIMITS = "each sequence's keys end at its own limit"
    BAND = "a band lo <= j - i <= hi"
    BLOCKS = "a mask of blocks to prepare"
    DENSE = "a dense tensor"


# --- the checks -------------------------------------------------------------------------------


def check_qkv(q: Any, k: Any, v: Any) -> Shapes:
    """Check q: (..., Hq, Lq, D), k: (..., Hkv, Lk, D), v: (..., Hkv, Lk, Dv)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise AttnkitTypeError(f"{name} must be a torch.Tensor, but got {type(t).__name__}.")
    if q.dim() < 2:
        raise AttnkitValueError(f"q must have at least 2 dimensions (..., Lq, D), but got shape {tuple(q.shape)}.")
    if not q.dim() == k.dim() == v.dim():
        raise AttnkitValueError(
            "q, k and v must have the same number of dimensions, but got "
            f"q: {tuple(q.shape)}, k: {tuple(k.shape)}, v: {tuple(v.shape)}."
        )
    if not q.dtype == k.dtype == v.dtype:
        raise AttnkitTypeError(
            f"q, k and v must have the same dtype, but got q: {q.dtype}, k: {k.dtype}, "
            f"v: {v.dtype}. Cast them to one dtype, e.g. k.to(q.dtype)."
        )
    if q.dtype not in FLOAT_DTYPES:
        raise AttnkitTypeError(
            f"q, k and v must be floating point (float16, bfloat16, float32 or float64), but got {q.dtype}."
        )
    if not q.device == k.device == v.device:
        raise AttnkitValueError(
            f"q, k and v must be on the same device, but got q: {q.device}, k: {k.device}, v: {v.device}."
        )
    if q.shape[-1] != k.shape[-1]:
        raise AttnkitValueError(
            f"q and k must have the same head dimension D, but got q: {tuple(q.shape)} "
            f"(D={q.shape[-1]}) and k: {tuple(k.shape)} (D={k.shape[-1]})."
        )
    if k.shape[-2] != v.shape[-2]:
        raise AttnkitValueError(
            f"k and v must have the same length Lk, but got k: {tuple(k.shape)} "
            f"(Lk={k.shape[-2]}) and v: {tuple(v.shape)} (Lk={v.shape[-2]})."
        )
    if k.shape[:-2] != v.shape[:-2]:
        raise AttnkitValueError(
            f"k and v must have the same batch and head sizes, but got k: {tuple(k.shape)} and v: {tuple(v.shape)}."
        )
    rank = q.dim()
    if rank == 2:
        return Shapes((), 1, 1, q.shape[0], k.shape[0], q.shape[1], v.shape[1], 2)
    if q.shape[:-3] != k.shape[:-3]:
        raise AttnkitValueError(
            f"q and k must have the same batch sizes, but got q: {tuple(q.shape)} and k: {tuple(k.shape)}."
        )
    hq, hkv = q.shape[-3], k.shape[-3]
    if hkv == 0 or hq % hkv != 0:
        raise AttnkitValueError(
            f"q has Hq={hq} heads and k/v have Hkv={hkv}, but Hq must be a multiple of Hkv "
            "(grouped-query attention shares each K/V head among Hq/Hkv query heads)."
        )
    return Shapes(tuple(q.shape[:-3]), hq, hkv, q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1], rank)


def check_scale(scale: Any, d: int) -> float:
    """Return the softmax scale: ``scale`` as given (0.0 and negatives honoured) or 1/sqrt(D)."""
    if scale is None:
        return 1.0 / math.sqrt(d) if d > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, Real):
        raise AttnkitTypeError(f"scale must be a real number or None, but got {scale!r}.")
    scale = float(scale)
    if not math.isfinite(scale):
        raise AttnkitValueError(f"scale must be finite, but got {scale}.")
    return scale


def check_tensor_mask(mask: torch.Tensor, q: torch.Tensor, shapes: Shapes) -> None:
    """Check a bool or additive float mask against the attention matrix of this call."""
    if mask.dtype != torch.bool and mask.dtype != q.dtype:
        hint = (
            "Use a bool mask (True = may attend), e.g. mask != 0."
            if not mask.is_floating_point()
            else f"Cast it with mask.to({q.dtype})."
        )
        raise AttnkitTypeError(
            f"mask must be bool (True = may attend) or an additive float mask of the query's "
            f"dtype {q.dtype}, but got {mask.dtype}. {hint}"
        )
    if mask.device != q.device:
        raise AttnkitValueError(f"mask must be on the query's device {q.device}, but got {mask.device}.")
    check_broadcast(tuple(mask.shape), shapes, "mask")


def check_broadcast(mask_shape: tuple[int, ...], shapes: Shapes, what: str) -> None:
    """Check ``mask_shape`` broadcasts to the attention matrix without growing it."""
    target = shapes.scores
    if not broadcasts_to(tuple(mask_shape), target):
        names = "(Lq, Lk)" if shapes.rank == 2 else "(..., Hq, Lq, Lk)"
        raise AttnkitValueError(
            f"{what} of shape {mask_shape} does not broadcast to the attention matrix "
            f"{names} = {target}. Each mask dimension must equal the matching size or be 1."
        )


def _lead_fits(lead: tuple[int, ...], shapes: Shapes) -> bool:
    """Whether a mask's ``(B or 1, H or 1)`` broadcasts to the call's batch and heads."""
    rank = len(shapes.scores)
    while len(lead) + 2 > rank and lead and lead[0] == 1:
        lead = lead[1:]
    return broadcasts_to((*lead, shapes.lq, shapes.lk), shapes.scores)


def _check_mask(mask, q: torch.Tensor, shapes: Shapes, tracing: bool):
    """Validate ``mask`` for this call; returns it (a tensor reshaped to at most the scores' rank)."""
    if mask is None:
        return None
    if isinstance(mask, PreparedMask):
        if (mask.q_len, mask.kv_len) != (shapes.lq, shapes.lk):
            raise AttnkitValueError(
                f"the prepared mask was prepared for Lq={mask.q_len}, Lk={mask.kv_len} but is used "
                f"with Lq={shapes.lq}, Lk={shapes.lk}. Prepare it for these lengths."
            )
        if mask.device != q.device:
            raise AttnkitValueError(
                f"the prepared mask is on {mask.device} but q is on {q.device}: use prepared.to({str(q.device)!r})."
            )
        if not _lead_fits(mask.lead_shape, shapes):
            check_broadcast((*mask.lead_shape, shapes.lq, shapes.lk), shapes, "the prepared mask")
        return mask
    if isinstance(mask, _masks.Mask):
        for t in mask.tensors():
            if t.device != q.device and t.device.type != "cpu":  # CPU tensors are moved as needed
                raise AttnkitValueError(
                    f"the {type(mask).__name__.strip('_').lower()} mask holds a tensor on {t.device} but q is "
                    f"on {q.device}: build the mask from tensors on {q.device} or on the CPU."
                )
        mask.check(shapes.lq, shapes.lk)
        if not _lead_fits(mask.lead_shape(), shapes):
            check_broadcast((*mask.lead_shape(), shapes.lq, shapes.lk), shapes, repr(mask))
        if not tracing:
            mask.check_values(shapes.lq, shapes.lk)
        return mask
    if isinstance(mask, torch.Tensor):
        if mask.dim() < 2:  # (Lk,) or a scalar: broadcast like SDPA's attn_mask
            mask = mask.reshape(1, -1) if mask.dim() == 1 else mask.reshape(1, 1)
        while mask.dim() > len(shapes.scores) and mask.shape[0] == 1:  # e.g. (1, Lq, Lk) for 2-D inputs
            mask = mask[0]
        check_tensor_mask(mask, q, shapes)
        if mask.is_floating_point() and not tracing:
            bad = torch.isnan(mask) | (mask == float("inf"))
            if bool(bad.any()):
                index = tuple(int(i) for i in bad.nonzero()[0])
                raise AttnkitValueError(
                    f"the additive float mask holds {mask[index].item()} at {index}: a float mask is "
                    "added to the scores, so it may hold finite values and -inf (hidden), not NaN or +inf."
                )
        return mask
    raise AttnkitTypeError(
        "mask must be None, a bool tensor (True = may attend), a float tensor added to the "
        "scores, an attnkit.masks object or a PreparedMask, but got "
        f"{type(mask).__name__}."
    )


def _check_score_mod(score_mod, q: torch.Tensor, shapes: Shapes):
    """``score_mod=`` as a :class:`~attnkit.score_mods.ScoreMod` (its params on q's device), or None."""
    score_mod = as_score_mod(score_mod)
    if score_mod is None:
        return None
    for t in score_mod.params:
        if t.device != q.device:
            raise AttnkitValueError(
                f"score_mod {score_mod.__name__} holds a tensor on {t.device} but q is on {q.device}: "
                "move it with .to()."
            )
    if shapes.rank > 4:
        raise AttnkitValueError(f"score_mod takes inputs of rank 2 to 4, but q has rank {shapes.rank}.")
    return score_mod


def _check_softcap(softcap, q: torch.Tensor) -> float | None:
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, Real) or not math.isfinite(softcap) or softcap <= 0:
        raise AttnkitValueError(
            f"softcap must be a positive finite number (e.g. 50.0) or None, but got {short(softcap)}."
        )
    softcap = float(softcap)
    # scores are soft-capped in float32 (float64 for float64 inputs): softcap and 1/softcap must be finite there
    info = torch.finfo(torch.float64 if q.dtype == torch.float64 else torch.float32)
    if not info.tiny <= softcap <= info.max:
        raise AttnkitValueError(
            f"softcap={softcap:g} cannot be represented in {q.dtype} attention (scores are capped in "
            f"{info.dtype}, whose range is {info.tiny:g} to {info.max:g}); use a softcap in that range, "
            "e.g. 50.0, or None."
        )
    return softcap


def _check_sinks(sinks, q: torch.Tensor, shapes: Shapes) -> torch.Tensor | None:
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        raise AttnkitTypeError(
            f"sinks must be a float tensor of shape (Hq,) = ({shapes.hq},), one logit per query head, "
            f"but got {type(sinks).__name__ if not isinstance(sinks, torch.Tensor) else sinks.dtype}."
        )
    if tuple(sinks.shape) != (shapes.hq,):
        raise AttnkitValueError(
            f"sinks must have shape (Hq,) = ({shapes.hq},), one logit per query head, but got {tuple(sinks.shape)}."
        )
    if sinks.device != q.device:
        raise AttnkitValueError(f"sinks are on {sinks.device} but q is on {q.device}: use sinks.to(q.device).")
    return sinks


def _check_bias(attn_bias, q: torch.Tensor, shapes: Shapes) -> Bias | None:
    if attn_bias is None:
        return None
    if isinstance(attn_bias, torch.Tensor):
        attn_bias = _bias.dense(attn_bias)
    if not isinstance(attn_bias, _bias.Bias):
        raise AttnkitTypeError(
            "attn_bias must be an attnkit.bias object (alibi, relative, from_fn, dense, or a sum) "
            f"or a float tensor, but got {type(attn_bias).__name__}."
        )
    if shapes.rank > 4:
        raise AttnkitValueError(f"attn_bias takes inputs of rank 2 to 4, but q has rank {shapes.rank}.")
    attn_bias.check(shapes.batch[0] if shapes.batch else 1, shapes.hq, shapes.lq, shapes.lk, q.device)
    return attn_bias


# --- the facts of a call ------------------------------------------------------------------------


def _key_limits(mask, shapes: Shapes, tracing: bool) -> tuple[int, ...] | None:
    """Each sequence's key limit, clamped to ``[0, Lk]``, as Python ints, when the mask hides exactly
    the keys from there on (padding, a cache with room left) on 4-D inputs; read without a device
    sync (a PreparedMask's own, or a mask's limits held on the CPU); None otherwise and, for mask
    objects, while tracing."""
    if shapes.rank != 4 or mask is None or isinstance(mask, torch.Tensor):
        return None
    if isinstance(mask, PreparedMask):
        if not mask.limit_only:
            return None
        return mask.kv_limits if mask.kv_limits is not None else (shapes.lk,) * max(mask.lead_shape[0], 1)
    if tracing or not mask.limit_only():
        return None
    limit = mask.key_limit()
    if limit is None or limit.device.type != "cpu":
        return None
    return clamped_limits(mask, shapes.lk)


def clamped_limits(mask: _masks.Mask, kv_len: int) -> tuple[int, ...] | None:
    """A mask's key limits (:meth:`~attnkit.masks.Mask.key_limit_values`) clamped to ``[0, Lk]``."""
    values = mask.key_limit_values()
    return None if values is None else tuple(min(max(n, 0), kv_len) for n in values)


def _form(mask, facts: MaskFacts, limits: tuple[int, ...] | None, shapes: Shapes) -> Form:
    if mask is None:
        return Form.NONE
    if isinstance(mask, torch.Tensor):
        return Form.DENSE
    if mask.hides_nothing if isinstance(mask, PreparedMask) else facts.band_hides_nothing(shapes.lq, shapes.lk):
        return Form.ALL
    if facts.causal_shift == 0:
        return Form.CAUSAL
    if limits:
        if all(n >= shapes.lk for n in limits):
            return Form.ALL
        if all(n == limits[0] for n in limits) and limits[0] > 0:
            return Form.LIMIT
        return Form.LIMITS
    if facts.band is not None:
        return Form.BAND
    return Form.BLOCKS


_MOD_WORDS = {
    "bias": "attn_bias",
    "softcap": "softcap",
    "sinks": "attention sinks (needs the log-sum-exp)",
    "score_mod": "score_mod (a general score modification)",
}


@dataclass(frozen=True, eq=False, kw_only=True)
class Call:
    """One validated attention call (made by :func:`make_call`; read-only).

    ``mask`` is None, a bool or additive float tensor (of at most the scores' rank), a mask
    object or a :class:`~attnkit.PreparedMask`. ``facts``, ``limits`` and ``form`` are the
    mask's, computed once (read by accessors too: :meth:`band`, :meth:`key_limits`, ...);
    ``mods`` names the score modifications among "bias", "softcap", "sinks" and "score_mod".
    :meth:`prepared_at` gives the mask prepared at a kernel's block size (a memo of
    :func:`attnkit.prepare`: the same answer whichever kernel asks first).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: MaskLike
    shapes: Shapes
    scale: float
    dropout_p: float
    return_lse: bool
    backward: bool
    compiling: bool
    #: Score modifications: an :class:`attnkit.bias.Bias`, a soft-cap, ``(Hq,)`` sink logits,
    #: a general ``score_mod(score, b, h, q_idx, kv_idx)``.
    bias: Bias | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    score_mod: ScoreMod | None = None
    facts: MaskFacts
    limits: tuple[int, ...] | None
    form: Form
    mods: tuple[str, ...]
    #: "torch.func" or "forward-mode AD" where the call runs under such a transform (None: plain
    #: autograd); only kernels made of PyTorch's own operations follow those (``supports_transforms``).
    transform: str | None = None
    _prepared: dict = field(default_factory=dict, repr=False, compare=False)

    def replace(self, **changes: Any) -> Call:
        """This call with some fields changed (the mask stays: its preparations are shared)."""
        new = dataclasses.replace(self, **changes)
        if "mask" not in changes:
            new._prepared.update(self._prepared)
        return new

    def score_mods(self) -> tuple[str, ...]:
        """Which score modifications the call has: among "bias", "softcap", "sinks", "score_mod"."""
        return self.mods

    def describe_mods(self) -> str:
        """The score modifications in words, for :func:`attnkit.explain` ('' if none)."""
        parts = []
        if self.softcap is not None:
            parts.append(f"softcap={self.softcap:g}")
        if self.bias is not None:
            parts.append(f"attn_bias={self.bias.describe()}")
        if self.score_mod is not None:
            parts.append(f"score_mod={getattr(self.score_mod, '__name__', 'fn')}")
        if self.sinks is not None:
            parts.append("sinks")
        return ", ".join(parts)

    def mod_refusals(self, supported: tuple[str, ...], lse: bool) -> list[str]:
        """A kernel's refusals of this call's score modifications (sinks need only the lse)."""
        return [f"no {_MOD_WORDS[mod]}" for mod in self.mods if mod not in supported and not (mod == "sinks" and lse)]

    @property
    def float_mask(self) -> bool:
        return isinstance(self.mask, torch.Tensor) and self.mask.is_floating_point()

    @property
    def tensor_mask(self) -> bool:
        """Whether the mask came as a tensor (bool or float), not as a mask object."""
        return isinstance(self.mask, torch.Tensor)

    @property
    def empty(self) -> bool:
        return self.shapes.lq == 0 or self.shapes.lk == 0

    @property
    def half(self) -> bool:
        return self.q.dtype in (torch.float16, torch.bfloat16)

    @property
    def pairs(self) -> int:
        return self.shapes.lq * self.shapes.lk

    def band(self) -> tuple[int | None, int | None] | None:
        """The mask's band (:meth:`attnkit.masks.Mask.band`); None if it is none."""
        return self.facts.band

    def causal_shift(self) -> int | None:
        """``s`` when the mask is exactly "key j visible iff ``j <= i + s``" (0: SDPA's ``is_causal``)."""
        return self.facts.causal_shift

    def limit_only(self) -> bool:
        """Whether the mask hides exactly the keys past each sequence's limit (padding)."""
        return self.facts.limit_only

    def key_limits(self) -> tuple[int, ...] | None:
        """Each sequence's key limit (the field :attr:`limits`): Python ints in ``[0, Lk]`` where the
        mask only cuts keys, 4-D inputs, read without a device sync; else None."""
        return self.limits

    def shared_key_limit(self) -> int | None:
        """``n > 0`` when every sequence's keys end at ``n`` (:attr:`Form.LIMIT`), else None."""
        return self.limits[0] if self.form is Form.LIMIT and self.limits else None

    def hides_nothing_here(self) -> bool:
        """Whether every query may see every key at these lengths (:attr:`Form.ALL`)."""
        return self.form is Form.ALL

    def mask_object(self) -> _masks.Mask | None:
        """The mask as a mask object (bool tensors wrapped; a PreparedMask's own mask, for its positions)."""
        if self.mask is None or isinstance(self.mask, _masks.Mask):
            return self.mask
        if isinstance(self.mask, PreparedMask):
            return self.mask.mask
        return _masks.as_mask(self.mask)

    def as4d(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v as ``(B, H, L, D)`` views (rank 2 to 4)."""
        lead = (1,) * (4 - self.shapes.rank)
        return tuple(t.reshape(*lead, *t.shape) for t in (self.q, self.k, self.v))  # type: ignore[return-value]

    @functools.cached_property
    def bias_band(self) -> torch.Tensor | None:
        """The bias as one band of ``kv - q`` per head (:func:`attnkit.bias.band_of`), differentiable in
        the bias's tensors; None without a bias, off the CPU, or where it is no finite band."""
        if self.bias is None or self.shapes.rank > 4:
            return None
        q, k, _ = self.as4d()
        return band_of(self.bias, q, k, check=not self.compiling)

    def prepared_at(self, block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE) -> PreparedMask:
        """The call's mask prepared at ``block_size``: the user's own PreparedMask (at another size:
        blocked again from its plan), mask objects through the implicit cache, a tensor once per call."""
        block_size = (block_size[0], block_size[1])
        found = self._prepared.get(block_size)
        if found is None:
            s = self.shapes
            if isinstance(self.mask, PreparedMask):
                found = self.mask.with_block_size(block_size)
            elif self.mask is None or isinstance(self.mask, _masks.Mask):
                found = prepared_for(self.mask, s.lq, s.lk, self.q.device, block_size)
            else:  # a tensor: no value key, no identity worth keeping
                found = prepare(self.mask_object(), s.lq, s.lk, device=self.q.device, block_size=block_size)
            self._prepared[block_size] = found
        return found


def make_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: MaskLike = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    attn_bias: BiasLike = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    score_mod: ScoreModLike = None,
) -> Call:
    """The arguments of one :func:`attnkit.attention` call, validated, as the :class:`Call` kernels
    read (raises the clear errors of the public functions)."""
    cast = autocast_dtype(q.device.type) if isinstance(q, torch.Tensor) and any_autocast() else None
    if cast is not None:
        # under torch.autocast attention runs in the autocast dtype on every kernel, as SDPA does
        # (float64 stays float64): one output dtype per input dtype, whichever kernel runs
        q, k, v = autocast_cast(q, cast), autocast_cast(k, cast), autocast_cast(v, cast)
        mask = autocast_cast(mask, cast)
    shapes = check_qkv(q, k, v)
    tracing = compiling()
    transform = None if tracing else transform_of(q, k, v)
    mask = _check_mask(mask, q, shapes, tracing or transform is not None)
    softcap = _check_softcap(softcap, q)
    sinks = _check_sinks(sinks, q, shapes)
    bias_object = _check_bias(attn_bias, q, shapes)
    mod = _check_score_mod(score_mod, q, shapes)
    learned = [
        *(bias_object.params() if bias_object is not None else ()),
        *((sinks,) if sinks is not None else ()),
        *(mod.params if mod is not None else ()),
    ]
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *learned))
    if isinstance(mask, PreparedMask):
        facts = MaskFacts(mask.band, mask.limit_only)
    else:
        facts = mask_facts(mask if isinstance(mask, _masks.Mask) else None, shapes.lq, shapes.lk)
    limits = _key_limits(mask, shapes, tracing)
    mods = tuple(
        name
        for name, value in (("bias", bias_object), ("softcap", softcap), ("sinks", sinks), ("score_mod", mod))
        if value is not None
    )
    return Call(
        q=q,
        k=k,
        v=v,
        mask=mask,
        shapes=shapes,
        scale=check_scale(scale, shapes.d),
        dropout_p=check_dropout(dropout_p),
        return_lse=bool(return_lse),
        backward=backward,
        compiling=tracing,
        bias=bias_object,
        softcap=softcap,
        sinks=sinks,
        score_mod=mod,
        facts=facts,
        limits=limits,
        form=_form(mask, facts, limits, shapes),
        mods=mods,
        transform=transform if transform is not None else _learned_transform(learned),
    )


def _learned_transform(learned: list[torch.Tensor]) -> str | None:
    """A forward-mode tangent on a bias's or score_mod's own tensors (the inputs have none)."""
    return transform_of(*learned) if learned and forward_ad_active() else None
