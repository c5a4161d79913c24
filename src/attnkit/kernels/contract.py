"""The kernel contract: one validated :class:`Call` in, ``(out, lse)`` out, and the
:class:`Kernel` base class every kernel subclasses (what it can do, why it refuses a call,
whether it prefers one, how to run it, and its backward over a part of the keys).

The choice among kernels is :mod:`attnkit.kernels.registry`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

import torch

from attnkit import masks as _masks
from attnkit._validate import AttnkitValueError, Shapes
from attnkit.prepare import DEFAULT_BLOCK_SIZE, MaskFacts, MaskLike, PreparedMask, mask_facts, prepare, prepared_for

if TYPE_CHECKING:
    from attnkit.bias import Bias
    from attnkit.score_mods import ScoreMod


#: Why a kernel was (not) chosen: the words, or a function giving them (formatted only when read).
Reason = Union[str, Callable[[], str]]

#: A function that runs later calls of one signature: ``(q, k, v) -> out`` (see :meth:`Kernel.runner`).
Runner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
#: The same for calls whose key limits change: ``(q, k, v, limits) -> out`` (:meth:`Kernel.limit_runner`).
LimitRunner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, tuple], torch.Tensor]

__all__ = ["Call", "Kernel", "LimitRunner", "Reason", "Runner", "double_backward_error", "mark_first_derivative_only"]


@dataclass
class Call:
    """One validated attention call.

    ``mask`` is None, a bool tensor, an additive float tensor, a mask object or a
    :class:`~attnkit.prepare.PreparedMask`. :meth:`prepared_at` gives the prepared mask
    at a kernel's block size (once per block size); ``prepared`` is the chosen kernel's.
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
    prepared: PreparedMask | None = None
    #: Score modifications: an :class:`attnkit.bias.Bias`, a soft-cap, ``(Hq,)`` sink logits,
    #: a general ``score_mod(score, b, h, q_idx, kv_idx)``.
    bias: Bias | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    score_mod: ScoreMod | None = None
    _by_block: dict = field(default_factory=dict, repr=False)
    _memo: dict = field(default_factory=dict, repr=False)  # per-call answers asked several times (band, mods)

    def cached(self, key: str, make: Callable[[], object]) -> object:
        """A per-call answer a kernel asks more than once (made on the first ask, kept with the call)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def score_mods(self) -> tuple[str, ...]:
        """Which score modifications the call has: among "bias", "softcap", "sinks", "score_mod"."""
        found = self._memo.get("mods")
        if found is None:
            found = self._memo["mods"] = tuple(
                name
                for name, v in (
                    ("bias", self.bias),
                    ("softcap", self.softcap),
                    ("sinks", self.sinks),
                    ("score_mod", self.score_mod),
                )
                if v is not None
            )
        return found

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

    def mask_object(self) -> _masks.Mask | None:
        """The mask as a mask object (bool tensors wrapped, prepared masks unwrapped)."""
        if self.mask is None or isinstance(self.mask, _masks.Mask):
            return self.mask
        if isinstance(self.mask, PreparedMask):
            return self.mask.mask
        return _masks.as_mask(self.mask)

    def facts(self) -> MaskFacts:
        """The mask's :class:`~attnkit.prepare.MaskFacts` (band, limit_only) without preparing it:
        a PreparedMask's own, else worked out by :func:`attnkit.prepare.mask_facts` (the one place)."""
        found = self._memo.get("facts")
        if found is None:
            if isinstance(self.mask, PreparedMask):
                found = MaskFacts(self.mask.band, self.mask.limit_only)
            elif isinstance(self.mask, _masks.Mask):
                found = mask_facts(self.mask, self.shapes.lq, self.shapes.lk)
            else:  # no mask, or a tensor: no facts without reading it
                found = mask_facts(None, self.shapes.lq, self.shapes.lk)
            self._memo["facts"] = found
        return found

    def band(self) -> tuple[int | None, int | None] | None:
        """The mask's band (:meth:`attnkit.masks.Mask.band`) without preparing it; None if it is none."""
        return self.facts().band

    def causal_shift(self) -> int | None:
        """``s`` when the mask is exactly "key j visible iff ``j <= i + s``" (0: SDPA's ``is_causal``)."""
        return self.facts().causal_shift

    def hides_nothing_here(self) -> bool:
        """Whether the mask lets every query see every key at these lengths: a band that does (a
        decoding step, known without preparing), or a mask a kernel of this call has prepared
        and found to hide nothing."""
        if self.facts().band_hides_nothing(self.shapes.lq, self.shapes.lk):
            return True
        prepared = self._by_block.get(DEFAULT_BLOCK_SIZE)
        return prepared is not None and prepared.hides_nothing

    def limit_only(self) -> bool:
        """Whether the mask hides exactly the keys past each sequence's limit (padding)."""
        return self.facts().limit_only

    def key_limits(self) -> tuple[int, ...] | None:
        """Each sequence's key limit, clamped to ``[0, Lk]``, as Python ints, when the mask hides
        exactly the keys from there on (padding, a cache with room left); 4-D inputs. Read from the
        mask itself (one host read of B ints), not from a preparation; None for other masks and
        while tracing (where a PreparedMask's own shared limit is used)."""
        if not self.limit_only() or self.shapes.rank != 4 or self.tensor_mask or self.compiling:
            return None

        def read() -> tuple[int, ...] | None:
            if isinstance(self.mask, PreparedMask):
                limit = self.mask.kv_limit
                return None if limit is None else tuple(limit.tolist())
            mask = self.mask_object()
            limits = None if mask is None else mask.key_limit_values()
            lk = self.shapes.lk
            return None if limits is None else tuple(min(max(n, 0), lk) for n in limits)

        return self.cached("key limits", read)  # type: ignore[return-value]

    def shared_key_limit(self) -> int | None:
        """``n`` when the mask hides exactly the keys from ``n`` on, the same ``n > 0`` for every
        sequence (a padding mask of one length: a decoding step over a cache with room left)."""
        if self.compiling:  # no host reads while tracing: only a PreparedMask's own facts
            if isinstance(self.mask, PreparedMask) and self.mask.limit_only and self.shapes.rank == 4:
                return self.mask.kv_limit_value
            return None
        limits = self.key_limits()
        if not limits or limits[0] <= 0 or any(n != limits[0] for n in limits):
            return None
        return limits[0]

    def prepared_at(self, block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE) -> PreparedMask:
        """The call's mask prepared at ``block_size``: through the implicit cache (mask
        objects), the user's own PreparedMask (at another size: re-prepared once), or for
        a bool tensor once per call."""
        block_size = (block_size[0], block_size[1])
        found = self._by_block.get(block_size)
        if found is None:
            s = self.shapes
            if isinstance(self.mask, PreparedMask):
                found = self.mask.with_block_size(block_size)
            elif self.mask is None or isinstance(self.mask, _masks.Mask):
                found = prepared_for(self.mask, s.lq, s.lk, self.q.device, block_size)
            else:  # a tensor: no value key, no identity worth keeping
                found = prepare(self.mask_object(), s.lq, s.lk, device=self.q.device, block_size=block_size)
            self._by_block[block_size] = found
        return found

    def get_prepared(self) -> PreparedMask:
        """The mask prepared at the default block size (the CPU kernel's)."""
        return self.prepared_at(DEFAULT_BLOCK_SIZE)


class Kernel:
    """What a kernel can do, when it is the right choice, and how to run it.

    Subclasses set the class attributes, implement :meth:`run` and :meth:`prefers`, and
    may add refusals in :meth:`_reasons`.
    """

    name: str = ""
    #: Device types it runs on (None: any).
    devices: tuple[str, ...] | None = None
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    #: ``(bq, bk)`` of the PreparedMask it reads (``call.prepared_at(kernel.block_size)``);
    #: None for a kernel that reads the mask as a dense tensor.
    block_size: tuple[int, int] | None = None
    supports_dropout: bool = False
    supports_float_mask: bool = False
    supports_lse: bool = False
    supports_backward: bool = True
    #: Whether its outputs can be differentiated twice (``create_graph=True``).
    supports_double_backward: bool = False
    #: Whether it runs inside ``torch.compile`` (a traceable path or a custom op).
    supports_compile: bool = True
    #: Score modifications it applies itself, among "bias", "softcap", "sinks" and "score_mod".
    #: Sinks need only the log-sum-exp: :func:`run` adds them for any kernel with lse.
    supports_score_mods: tuple[str, ...] = ()
    #: Largest input rank (None: any).
    max_rank: int | None = None

    def runs_on(self, device_type: str) -> bool:
        """Whether it runs on this device type at all (the registry skips it cheaply otherwise)."""
        return self.devices is None or device_type in self.devices

    def not_supported_reasons(self, call: Call) -> list[str]:
        """Why this kernel cannot run ``call`` (empty if it can)."""
        reasons = []
        if self.devices is not None and call.q.device.type not in self.devices:
            reasons.append(f"runs on {'/'.join(self.devices)}, not {call.q.device.type}")
        if call.q.dtype not in self.dtypes:
            reasons.append(f"does not take {call.q.dtype}")
        if call.dropout_p > 0.0 and not self.supports_dropout:
            reasons.append(f"no dropout (dropout_p={call.dropout_p})")
        if call.float_mask and not self.supports_float_mask:
            reasons.append("no additive float mask")
        if call.return_lse and not self.supports_lse:
            reasons.append("does not return the log-sum-exp (return_lse=True)")
        if call.backward and not self.supports_backward:
            reasons.append("no backward pass")
        if call.compiling and not self.supports_compile:
            reasons.append("cannot run inside torch.compile")
        what = {
            "bias": "attn_bias",
            "softcap": "softcap",
            "sinks": "attention sinks (needs the log-sum-exp)",
            "score_mod": "score_mod (a general score modification)",
        }
        for mod in call.score_mods():
            if mod == "sinks" and self.supports_lse:
                continue
            if mod not in self.supports_score_mods:
                reasons.append(f"no {what[mod]}")
        if self.max_rank is not None and call.shapes.rank > self.max_rank:
            reasons.append(f"takes inputs of rank 2 to {self.max_rank}, not {call.shapes.rank}")
        return reasons + self._reasons(call)

    def _reasons(self, call: Call) -> list[str]:
        return []

    def prefers(self, call: Call) -> tuple[bool, Reason]:
        """``(True, why)`` if this kernel is the right choice for a call it can run, else
        ``(False, why not)``: the next kernel in the priority list is asked. The kernel owns
        its thresholds here."""
        return True, "the kernel can run this call"

    #: Whether it implements :meth:`backward_part`.
    supports_backward_part: bool = False

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def backward_part(
        self, call: Call, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, grad_lse: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` of attention over ``call``'s keys when they are a part of the keys a
        softmax spans (ring attention's ranks, any split of the keys): ``out`` and ``lse`` are the
        *merged* output and log-sum-exp, so this part's share is the usual backward with
        ``P = exp(S - lse)`` and ``delta = rowsum(grad_out * out)``, no forward recomputed.
        4-D inputs; the gradients of a bias's own tensors are not computed here."""
        raise NotImplementedError(f"the {self.name!r} kernel has no backward over a part of the keys")

    def runner(self, call: Call) -> Runner | None:
        """Optionally, a function ``(q, k, v) -> out`` that runs every later call of this call's
        signature (same shapes, dtypes, devices, mask value, scale, autograd; no modifications,
        dropout or lse) without validating or choosing again. None: no such shortcut."""
        return None

    def limit_runner(self, call: Call) -> LimitRunner | None:
        """Optionally, a function ``(q, k, v, limits) -> out`` that runs every later call of this
        call's signature whose mask differs from this one only in each sequence's key limit (a
        decoding step's new :func:`attnkit.masks.padding`; ``limits``: one int per sequence, in
        ``[0, Lk]``), valid only where the registry would choose this kernel for any limits. None:
        no such shortcut."""
        return None

    def __repr__(self) -> str:
        return f"<attnkit kernel {self.name!r}>"


def double_backward_error(kernel: str) -> AttnkitValueError:
    """The error for a second derivative through a kernel that computes first derivatives only."""
    return AttnkitValueError(
        f"the {kernel!r} kernel computes first derivatives only, but a second one was asked for "
        "(create_graph=True, e.g. a gradient penalty). Pass kernel='reference' to attnkit.attention "
        "for double backward."
    )


def mark_first_derivative_only(t: torch.Tensor | None, kernel: str) -> None:
    """Make a backward pass with ``create_graph=True`` through ``t`` raise a clear error."""
    if t is None or not t.requires_grad:
        return

    def hook(grad):
        if torch.is_grad_enabled():  # autograd records the backward pass: a second derivative is wanted
            raise double_backward_error(kernel)
        return grad

    t.register_hook(hook)
