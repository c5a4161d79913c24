"""The kernel contract, the registry, and the choice of a kernel for each call.

Every kernel takes one validated :class:`Call` and returns ``(out, lse)``:
``out: (..., Hq, Lq, Dv)`` in q's dtype and ``lse: (..., Hq, Lq)`` (float32, float64
for float64 inputs; ``-inf`` for fully masked rows), or ``lse=None`` when the call
did not ask for it. Each kernel declares what it supports and says, in words, why
it cannot run a given call (:meth:`Kernel.not_supported_reasons`), so
:func:`attnkit.explain` can list every refusal.

Adding a kernel means one file with a :class:`Kernel` subclass and one call of
:func:`register_kernel`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from attnkit import masks as _masks
from attnkit._validate import AttnkitValueError, Shapes, short
from attnkit.prepare import PreparedMask, prepare, prepared_for


@dataclass
class Call:
    """One validated attention call.

    ``mask`` is None, a bool tensor, an additive float tensor, a mask object or a
    :class:`~attnkit.prepare.PreparedMask`; ``prepared`` is filled in by the registry
    when a block-sparse kernel needs it.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: object
    shapes: Shapes
    scale: float
    dropout_p: float
    return_lse: bool
    backward: bool
    compiling: bool
    prepared: PreparedMask | None = None
    #: Score modifications: an :class:`attnkit.bias.Bias`, a soft-cap, ``(Hq,)`` sink logits.
    bias: object = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    def score_mods(self) -> tuple[str, ...]:
        """Which score modifications the call has: among "bias", "softcap", "sinks"."""
        return tuple(name for name, v in (("bias", self.bias), ("softcap", self.softcap), ("sinks", self.sinks))
                     if v is not None)

    def describe_mods(self) -> str:
        """The score modifications in words, for :func:`attnkit.explain` ('' if none)."""
        parts = []
        if self.softcap is not None:
            parts.append(f"softcap={self.softcap:g}")
        if self.bias is not None:
            parts.append(f"attn_bias={self.bias.describe()}")
        if self.sinks is not None:
            parts.append("sinks")
        return ", ".join(parts)

    @property
    def float_mask(self) -> bool:
        return isinstance(self.mask, torch.Tensor) and self.mask.is_floating_point()

    @property
    def empty(self) -> bool:
        return self.shapes.lq == 0 or self.shapes.lk == 0

    @property
    def half(self) -> bool:
        return self.q.dtype in (torch.float16, torch.bfloat16)

    def mask_object(self) -> _masks.Mask | None:
        """The mask as a mask object (bool tensors wrapped, prepared masks unwrapped)."""
        if self.mask is None or isinstance(self.mask, _masks.Mask):
            return self.mask
        if isinstance(self.mask, PreparedMask):
            return self.mask.mask
        return _masks.as_mask(self.mask)

    def get_prepared(self) -> PreparedMask:
        """The prepared mask for this call (prepared once, through the implicit cache)."""
        if self.prepared is None:
            if isinstance(self.mask, PreparedMask):
                self.prepared = self.mask
            else:
                m = self.mask_object()
                s = self.shapes
                if m is None or not isinstance(self.mask, _masks.Mask):  # bool tensors: not cached
                    self.prepared = prepare(m, s.lq, s.lk, device=self.q.device)
                else:
                    self.prepared = prepared_for(m, s.lq, s.lk, self.q.device)
        return self.prepared


class Kernel:
    """What a kernel can do, and how to run it.

    Subclasses set the class attributes and implement :meth:`run`; they may add
    reasons in :meth:`_reasons`.
    """

    name: str = ""
    #: Device types it runs on (None: any).
    devices: tuple[str, ...] | None = None
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    supports_dropout: bool = False
    supports_float_mask: bool = False
    supports_lse: bool = False
    supports_backward: bool = True
    #: Whether its outputs can be differentiated twice (``create_graph=True``).
    supports_double_backward: bool = False
    #: Score modifications it applies itself, among "bias", "softcap" and "sinks".
    #: Sinks need only the log-sum-exp: :func:`run` adds them for any kernel with lse.
    supports_score_mods: tuple[str, ...] = ()
    #: Largest input rank (None: any).
    max_rank: int | None = None

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
        for mod in call.score_mods():
            if mod == "sinks" and self.supports_lse:
                continue
            if mod not in self.supports_score_mods:
                what = {"bias": "attn_bias", "softcap": "softcap", "sinks": "attention sinks (needs the log-sum-exp)"}
                reasons.append(f"no {what[mod]}")
        if self.max_rank is not None and call.shapes.rank > self.max_rank:
            reasons.append(f"takes inputs of rank 2 to {self.max_rank}, not {call.shapes.rank}")
        return reasons + self._reasons(call)

    def _reasons(self, call: Call) -> list[str]:
        return []

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError


#: Every registered kernel by name, in the order they were registered.
KERNELS: dict[str, Kernel] = {}


def register_kernel(kernel: Kernel) -> Kernel:
    """Add ``kernel`` to the registry (replacing one of the same name)."""
    if not kernel.name or kernel.name == "auto":
        raise AttnkitValueError(f"a kernel needs a name other than 'auto', but got {kernel.name!r}.")
    KERNELS[kernel.name] = kernel
    return kernel


class Plan:
    """The kernel chosen for one call, why, and why every other kernel was not.

    ``rejected`` maps each other kernel's name to its reasons (``not supported: ...``
    or why it was not preferred); it is worked out when first read.
    """

    def __init__(self, kernel: str, reason: str, call: Call | None = None, refusals: dict | None = None,
                 prepared: PreparedMask | None = None):
        self.kernel, self.reason, self.prepared = kernel, reason, prepared
        self._call, self._refusals = call, dict(refusals or {})

    @property
    def rejected(self) -> dict:
        for name, k in KERNELS.items():
            if name not in self._refusals and self._call is not None:
                self._refusals[name] = k.not_supported_reasons(self._call)
        return {
            name: tuple(why) if why else ("not preferred here",)
            for name, why in self._refusals.items() if name != self.kernel
        }

    def __str__(self) -> str:
        return self.reason

    def __repr__(self) -> str:
        return f"Plan(kernel={self.kernel!r}, reason={self.reason!r})"

    def report(self) -> str:
        """Several lines: the choice, then each other kernel and its reasons."""
        lines = [f"chosen {self.reason}"]
        lines += [f"  {name}: {'; '.join(why)}" for name, why in self.rejected.items()]
        return "\n".join(lines)


#: Below this many (query, key) pairs one fused call beats tiling a masked plan ...
TILED_MIN_PAIRS = 256 * 256
#: ... unless the keys are many (decoding over a long padded cache reads only each
#: sequence's own keys in the tiled kernel).
TILED_MIN_KEYS = 1024
#: ... and for a bare padding mask from this many keys (decoding: 1.3-6x faster than the
#: dense mask at 128-1024 keys and batches of 1-64; the dense mask wins at ~32 keys).
TILED_PADDING_MIN_KEYS = 128
#: The tiled kernel runs masked plans when at most this fraction of blocks is kept, by
#: (half precision, with backward); plans of full blocks only get TILED_MAX_KEPT_FULL.
#: Measured with benchmarks/cpu.py (see the README's table).
TILED_MAX_KEPT = {(False, False): 0.85, (False, True): 0.6, (True, False): 0.6, (True, True): 0.3}
TILED_MAX_KEPT_FULL = 0.85


def _bare(mask):
    """The mask object behind a prepared one."""
    return mask.mask if isinstance(mask, PreparedMask) else mask


def _causal_shift(call: Call) -> int | None:
    """:meth:`attnkit.masks._Causal._shift` of a causal mask here, else None."""
    m = _bare(call.mask)
    return m._shift(call.shapes.lq, call.shapes.lk) if isinstance(m, _masks._Causal) else None


def _sdpa_causal(call: Call) -> bool:
    """Whether the mask is exactly SDPA's ``is_causal=True`` (top-left aligned) here."""
    return _causal_shift(call) == 0


def _hides_nothing(call: Call) -> bool:
    """Whether a causal mask lets every query see every key here (a decoding step), known
    without preparing it."""
    shift = _causal_shift(call)
    return shift is not None and shift >= call.shapes.lk - 1


def choose(call: Call, kernel: str = "auto") -> Plan:
    """Pick the kernel for a validated call; see :func:`attnkit.explain`."""
    if not isinstance(kernel, str) or (kernel != "auto" and kernel not in KERNELS):
        raise AttnkitValueError(f"kernel must be 'auto' or one of {tuple(KERNELS)}, but got {short(kernel)}.")
    refusals = _Refusals(call)
    if kernel != "auto":
        if refusals[kernel]:
            raise AttnkitValueError(
                f"kernel={kernel!r} cannot run this call: {'; '.join(refusals[kernel])}. "
                "Use kernel='auto' to let attnkit choose."
            )
        prepared = call.get_prepared() if kernel == "tiled" and not call.empty else None
        reason = "forced by kernel="
        if call.score_mods():
            reason = f"{call.describe_mods()}; {reason}"
        if prepared is not None:
            reason += f", {prepared.kept:.0%} of blocks kept"
        return Plan(kernel, f"{kernel}: {reason}", call, refusals, prepared)
    name, reason = _auto(call, refusals)
    mods = call.describe_mods()
    if mods:
        reason = f"{mods}; {reason}"
    return Plan(name, f"{name}: {reason}", call, refusals, call.prepared)


class _Refusals(dict):
    """Each kernel's reasons, worked out the first time they are looked up."""

    def __init__(self, call: Call):
        super().__init__()
        self.call = call

    def __missing__(self, name: str) -> list[str]:
        self[name] = KERNELS[name].not_supported_reasons(self.call)
        return self[name]

    def __contains__(self, name) -> bool:
        return name in KERNELS


def _auto(call: Call, refusals: dict) -> tuple[str, str]:
    def can(name: str) -> bool:
        return name in refusals and not refusals[name]

    s = call.shapes
    if call.q.device.type != "cpu" and can("tiled"):
        refusals["tiled"] = [
            f"on {call.q.device.type} its math engine is a Python loop of small matmuls "
            "(kernel='tiled' forces it)"
        ]
    if call.empty:
        return "reference", f"empty attention matrix (Lq={s.lq}, Lk={s.lk})"
    if call.q.device.type == "cuda" and not call.compiling and "triton" in KERNELS and can("triton"):
        plain = not call.score_mods() and not call.return_lse and call.dropout_p == 0.0
        if plain and call.mask is None:
            return "sdpa", "no mask: PyTorch's flash/cuDNN kernels"
        if plain and _sdpa_causal(call) and call.scale > 0.0:
            return "sdpa", "is_causal: PyTorch's flash/cuDNN kernels"
        if not call.float_mask:
            prepared = call.get_prepared()
            return "triton", (f"block-sparse on CUDA, {prepared.kept:.0%} of blocks kept; the mask is read as "
                              "data (no dense mask, no compile per mask)")
    if call.compiling:
        if can("sdpa"):
            return "sdpa", "under torch.compile (mask objects become dense masks in the graph)"
        return "reference", "under torch.compile"
    if call.score_mods():
        if can("tiled"):
            return "tiled", f"{call.get_prepared().kept:.0%} of blocks kept, the modifications applied per tile"
        if can("sdpa"):
            return "sdpa", "the bias as a dense float mask"
        return "reference", "the plain formula"
    if call.dropout_p > 0.0 or call.return_lse:
        why = f"dropout_p={call.dropout_p}" if call.dropout_p > 0.0 else "return_lse=True"
        if can("tiled"):
            return "tiled", f"{why}, {call.get_prepared().kept:.0%} of blocks kept"
        return "reference", why
    if call.mask is None:
        return "sdpa", "no mask"
    if _sdpa_causal(call) and call.scale > 0.0:
        return "sdpa", "is_causal"
    if call.float_mask or s.rank > 4 or not can("tiled"):
        what = "additive float mask" if call.float_mask else f"rank {s.rank}" if s.rank > 4 else "tiled cannot run"
        return "sdpa", f"dense mask ({what})"
    if isinstance(call.mask, torch.Tensor) and s.lq * s.lk < TILED_MIN_PAIRS:
        return "sdpa", f"dense mask: Lq*Lk={s.lq * s.lk} is small"
    if _hides_nothing(call):
        return "sdpa", "the mask hides nothing here"
    # a bare padding mask has only full blocks and a key limit: the tiled kernel reads each
    # sequence's own keys, which beats the dense mask from TILED_PADDING_MIN_KEYS keys on
    padding = isinstance(_bare(call.mask), _masks._Padding) and s.lk >= TILED_PADDING_MIN_KEYS
    if s.lq * s.lk < TILED_MIN_PAIRS and s.lk <= TILED_MIN_KEYS and not padding:
        return "sdpa", f"dense mask: Lq*Lk={s.lq * s.lk} is small"
    prepared = call.get_prepared()
    if prepared.everything:
        return "sdpa", "the mask hides nothing here"
    if not prepared.masked and prepared.kv_limit is not None:
        return "tiled", f"{prepared.kept:.0%} of blocks kept, all full, keys past each sequence's end unread"
    if not prepared.masked and prepared.kept <= TILED_MAX_KEPT_FULL:
        return "tiled", f"{prepared.kept:.0%} of blocks kept, all full"
    if s.lq * s.lk < TILED_MIN_PAIRS:
        return "sdpa", f"dense mask: Lq*Lk={s.lq * s.lk} is small"
    limit = TILED_MAX_KEPT[(call.half, call.backward)]
    if prepared.kept <= limit:
        return "tiled", f"{prepared.kept:.0%} of blocks kept"
    return "sdpa", f"dense mask: {prepared.kept:.0%} of blocks kept"


def sink_factor(lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(factor, lse')`` of each head's sink logit in the softmax denominator.

    A sink is an extra key per head with value 0 (gpt-oss): every weight of a row is
    multiplied by ``factor = exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink)``,
    and the row's log-sum-exp becomes ``lse' = logaddexp(lse, sink)``. A fully masked
    row (``lse = -inf``) gets factor 0 (its output stays 0, with zero gradients) and
    ``lse' = sink``, also for a sink of ``-inf``. ``sinks: (Hq,)``; ``lse: (..., Hq, Lq)``.
    """
    sink = sinks.to(lse.dtype)
    sink = sink.view(-1, 1) if lse.dim() >= 2 else sink.view(-1)  # (Hq, 1): broadcasts over Lq
    dead = lse == float("-inf")  # rows with no key: only the sink is left (-inf - -inf would be NaN)
    live = lse.masked_fill(dead, 0.0)
    factor = torch.sigmoid(live - sink).masked_fill(dead, 0.0)  # (..., Hq, Lq)
    return factor, torch.where(dead, sink.expand_as(lse), torch.logaddexp(live, sink))


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor):
    """``(out, lse)`` with each head's sink in the softmax denominator (see :func:`sink_factor`)."""
    factor, lse = sink_factor(lse, sinks)
    return (out.to(factor.dtype) * factor[..., None]).to(out.dtype), lse


def double_backward_error(kernel: str) -> AttnkitValueError:
    """The error for a second derivative through a kernel that computes first derivatives only."""
    return AttnkitValueError(
        f"the {kernel!r} kernel computes first derivatives only, but a second one was asked for "
        "(create_graph=True, e.g. a gradient penalty). Pass kernel='reference' to attnkit.attention "
        "for double backward."
    )


def _first_derivative_only(t: torch.Tensor | None, kernel: str) -> None:
    """Make a backward pass with ``create_graph=True`` through ``t`` raise a clear error."""
    if t is None or not t.requires_grad:
        return

    def hook(grad):
        if torch.is_grad_enabled():  # autograd records the backward pass: a second derivative is wanted
            raise double_backward_error(kernel)
        return grad

    t.register_hook(hook)


def run(call: Call, plan: Plan) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the chosen kernel; ``(out, lse or None)``."""
    if plan.prepared is not None and call.prepared is None:
        call.prepared = plan.prepared
    kernel = KERNELS["reference" if call.empty else plan.kernel]  # empty: zeros (and lse -inf)
    if call.sinks is None or "sinks" in kernel.supports_score_mods:
        out, lse = kernel.run(call)
    else:
        out, lse = kernel.run(replace(call, sinks=None, return_lse=True))
        out, lse = add_sinks(out, lse, call.sinks)
        lse = lse if call.return_lse else None
    if call.backward and not kernel.supports_double_backward:
        _first_derivative_only(out, kernel.name)
        _first_derivative_only(lse, kernel.name)
    return out, lse
