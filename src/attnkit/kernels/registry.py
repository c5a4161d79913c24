"""The kernel contract, the registry, and the choice of a kernel for each call.

Every kernel takes one validated :class:`Call` and returns ``(out, lse)``:
``out: (..., Hq, Lq, Dv)`` in q's dtype and ``lse: (..., Hq, Lq)`` (float32, float64
for float64 inputs; ``-inf`` for fully masked rows), or ``lse=None`` when the call
did not ask for it. A kernel declares what it can do (devices, dtypes, the block size
of the :class:`~attnkit.PreparedMask` it reads, modifications, lse, dropout, backward),
says in words why it cannot run a call (:meth:`Kernel.not_supported_reasons`) and
whether it is the right kernel for it (:meth:`Kernel.prefers`, which owns the
kernel's thresholds).

The registry is an ordered priority list (:data:`PRIORITY`): ``kernel="auto"`` walks it
and takes the first kernel that can run the call and prefers it; :func:`attnkit.explain`
reports every refusal. :func:`use_kernels` restricts and reorders the list for a block
of code (like ``torch.nn.attention.sdpa_kernel``). Adding a kernel is one file with a
:class:`Kernel` subclass and one :func:`register_kernel` call::

    class MyKernel(Kernel):
        name = "mine"
        devices = ("cpu",)
        block_size = (64, 64)           # prepared masks are made at this size for it
        def prefers(self, call):
            return True, "my reason"
        def run(self, call):
            prepared = call.prepared_at(self.block_size)
            ...
            return out, lse

    register_kernel(MyKernel())        # first in the list; before=/after= to place it

Kernels that are engines of one family can be named together: ``"tiled"`` is the group of
attnkit's block-sparse CPU kernels (``native``, ``fused``, ``math``), so ``kernel="tiled"``
runs the first of them that can run a call (:func:`register_group`).

The registry is the only place that chooses a kernel, for the forward (:func:`choose`) and
for the backward over a part of the keys (:func:`backward_part`, ring attention).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Union

import torch

from attnkit import masks as _masks
from attnkit._validate import AttnkitTypeError, AttnkitValueError, Shapes, short
from attnkit.kernels.lse import add_sinks
from attnkit.prepare import DEFAULT_BLOCK_SIZE, MaskFacts, MaskLike, PreparedMask, mask_facts, prepare, prepared_for

if TYPE_CHECKING:
    from attnkit.bias import Bias
    from attnkit.score_mods import ScoreMod

#: Why a kernel was (not) chosen: the words, or a function giving them (formatted only when read).
Reason = Union[str, Callable[[], str]]

#: A function that runs later calls of one signature: ``(q, k, v) -> out`` (see :meth:`Kernel.runner`).
Runner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

__all__ = [
    "GROUPS",
    "KERNELS",
    "PRIORITY",
    "Call",
    "Kernel",
    "KernelGroup",
    "Plan",
    "backward_part",
    "choose",
    "register_group",
    "register_kernel",
    "run",
    "use_kernels",
]


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

    def shared_key_limit(self) -> int | None:
        """``n`` when the mask hides exactly the keys from ``n`` on, the same ``n > 0`` for every
        sequence (a padding mask of one length: a decoding step over a cache with room left);
        4-D inputs. Padding masks are prepared for it (block codes from the lengths: cheap)."""
        if not self.limit_only() or self.shapes.rank != 4 or self.tensor_mask:
            return None
        if self.compiling:  # no preparation while tracing: only a PreparedMask's own facts
            return self.mask.kv_limit_value if isinstance(self.mask, PreparedMask) and self.mask.limit_only else None
        prepared = self.prepared_at(DEFAULT_BLOCK_SIZE)
        return prepared.kv_limit_value if prepared.limit_only and prepared.kv_limit_value else None

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

    def __repr__(self) -> str:
        return f"<attnkit kernel {self.name!r}>"


class KernelGroup:
    """Kernels named together (e.g. ``"tiled"``: attnkit's block-sparse CPU engines). As ``kernel=``
    it runs the first member that can run a call; in :func:`use_kernels` it stands for its
    members in their order."""

    def __init__(self, name: str, members: tuple[str, ...]):
        self.name, self.members = name, tuple(members)

    def kernels(self) -> tuple[Kernel, ...]:
        """The registered members, in order."""
        return tuple(KERNELS[m] for m in self.members if m in KERNELS)

    def __repr__(self) -> str:
        return f"<attnkit kernel group {self.name!r}: {', '.join(self.members)}>"


#: Every registered kernel by name.
KERNELS: dict[str, Kernel] = {}
#: Every kernel group by name.
GROUPS: dict[str, KernelGroup] = {}
#: The order ``kernel="auto"`` asks the kernels in.
PRIORITY: list[Kernel] = []
_GENERATION = [0]  # bumped by every change to the registry


#: PRIORITY right after attnkit registered its own kernels (set by attnkit.kernels).
BUILTIN_STATE: list[tuple] = []


def builtin_registry() -> bool:
    """Whether the registry holds attnkit's own kernels as registered, with no use_kernels active:
    then an unmasked call's choice depends only on its device, dtypes and rank, not on its lengths."""
    if not BUILTIN_STATE or _ACTIVE or len(PRIORITY) != len(BUILTIN_STATE[0]):
        return False
    return all(a is b for a, b in zip(PRIORITY, BUILTIN_STATE[0]))  # a kernel registered and removed again: True


def registry_state() -> tuple:
    """What the choice of a kernel depends on besides the call: the registry's version and the
    innermost use_kernels (keys of cached choices)."""
    return (_GENERATION[0], _ACTIVE[-1] if _ACTIVE else None)


def first_derivative_only(fn: Runner, kernel: Kernel) -> Runner:
    """``fn`` with outputs that refuse a second derivative clearly, unless the kernel has one."""
    if kernel.supports_double_backward:
        return fn

    def guarded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = fn(q, k, v)
        _first_derivative_only(out, kernel.name)
        return out

    return guarded


def _named(kernel) -> Kernel | KernelGroup:
    """A registered kernel or group from its name, or the object itself."""
    if isinstance(kernel, (Kernel, KernelGroup)):
        return kernel
    if isinstance(kernel, str) and kernel in KERNELS:
        return KERNELS[kernel]
    if isinstance(kernel, str) and kernel in GROUPS:
        return GROUPS[kernel]
    raise AttnkitValueError(
        f"kernel must be 'auto', a registered kernel's name {tuple(KERNELS)}, a group's {tuple(GROUPS)} "
        f"or a Kernel, but got {short(kernel)}."
    )


def _kernel_named(kernel) -> Kernel:
    found = _named(kernel)
    if isinstance(found, KernelGroup):
        raise AttnkitValueError(
            f"{found.name!r} names a group of kernels ({', '.join(found.members)}), not one kernel."
        )
    return found


def _expanded(kernels) -> tuple[Kernel, ...]:
    """Kernels and groups as kernels, groups replaced by their members (each kernel once)."""
    out: list[Kernel] = []
    for k in kernels:
        found = _named(k)
        for member in found.kernels() if isinstance(found, KernelGroup) else (found,):
            if member not in out:
                out.append(member)
    return tuple(out)


def register_group(name: str, members: tuple[str, ...] | list[str]) -> KernelGroup:
    """Name kernels together (see :class:`KernelGroup`); returns the group. Members are kernel
    names, registered now or later."""
    if not isinstance(name, str) or not name or name == "auto" or name in KERNELS:
        raise AttnkitValueError(f"a group needs a name that is not 'auto' nor a kernel's, but got {short(name)}.")
    group = GROUPS[name] = KernelGroup(name, tuple(members))
    _GENERATION[0] += 1
    return group


def register_kernel(kernel: Kernel, *, before: Kernel | str | None = None, after: Kernel | str | None = None) -> Kernel:
    """Add ``kernel`` to the registry; returns it.

    A kernel of a name already registered is replaced in its place. A new kernel goes
    first in :data:`PRIORITY` (``auto`` asks it before the built-in ones) unless
    ``before=`` or ``after=`` (a kernel or a name) places it.
    """
    if not isinstance(kernel, Kernel):
        raise AttnkitTypeError(f"register_kernel takes a Kernel instance, but got {type(kernel).__name__}.")
    if not kernel.name or kernel.name == "auto":
        raise AttnkitValueError(f"a kernel needs a name other than 'auto', but got {kernel.name!r}.")
    if before is not None and after is not None:
        raise AttnkitValueError("give before= or after=, not both.")
    old = KERNELS.get(kernel.name)
    KERNELS[kernel.name] = kernel
    _GENERATION[0] += 1
    if old is not None and old in PRIORITY and before is None and after is None:
        PRIORITY[PRIORITY.index(old)] = kernel
        return kernel
    if old in PRIORITY:
        PRIORITY.remove(old)
    if before is not None:
        PRIORITY.insert(PRIORITY.index(_kernel_named(before)), kernel)
    elif after is not None:
        PRIORITY.insert(PRIORITY.index(_kernel_named(after)) + 1, kernel)
    else:
        PRIORITY.insert(0, kernel)
    return kernel


def unregister_kernel(kernel: Kernel | str) -> None:
    """Remove a registered kernel (by name or object)."""
    kernel = _kernel_named(kernel)
    _GENERATION[0] += 1
    KERNELS.pop(kernel.name, None)
    if kernel in PRIORITY:
        PRIORITY.remove(kernel)


#: The kernels :func:`use_kernels` allows, innermost last (module state, like the backend
#: flags of ``sdpa_kernel``: torch.compile can read it, a ContextVar it cannot).
_ACTIVE: list[tuple[Kernel, ...]] = []


@contextlib.contextmanager
def use_kernels(*kernels: Kernel | str) -> Iterator[None]:
    """Within the block, ``kernel="auto"`` takes the first of these kernels that can run a call.

    Like ``torch.nn.attention.sdpa_kernel``: the order given is the preference (the
    kernels' own :meth:`Kernel.prefers` is not asked), and it reaches every attnkit call made inside
    (modules, :func:`attnkit.capture`, models run through the transformers integration).
    Names, groups (``"tiled"``: its members in order) or kernel objects; a call none of them
    can run raises an error naming each one's reasons.

    >>> import torch, attnkit
    >>> q = torch.randn(1, 2, 8, 16)
    >>> with attnkit.use_kernels("math", "reference"):
    ...     print(attnkit.explain(q, q, q).kernel)
    math
    """
    if len(kernels) == 1 and isinstance(kernels[0], (list, tuple)):
        kernels = tuple(kernels[0])
    if not kernels:
        raise AttnkitValueError("use_kernels needs at least one kernel, e.g. use_kernels('tiled', 'reference').")
    _ACTIVE.append(_expanded(kernels))
    try:
        yield
    finally:
        _ACTIVE.pop()


class Plan:
    """The kernel chosen for one call, why, and why every other kernel was not.

    ``kernel`` is the chosen kernel's name and ``chosen`` the kernel itself; ``rejected``
    maps each other kernel's name to its reasons (``not supported: ...`` or why it was not
    preferred); it is worked out when first read.
    """

    def __init__(
        self, kernel: Kernel, reason: str | tuple[str, Reason], call: Call | None = None, refusals: dict | None = None
    ):
        self.chosen, self.kernel, self._reason = kernel, kernel.name, reason
        self._call, self._refusals = call, dict(refusals or {})

    @property
    def reason(self) -> str:
        """``"<kernel>: <modifications>; <why>"`` (made when read: the hot path formats nothing)."""
        if not isinstance(self._reason, str):
            why = self._reason[1] if isinstance(self._reason[1], str) else self._reason[1]()  # a Reason
            mods = self._call.describe_mods() if self._call is not None else ""
            self._reason = f"{self.kernel}: {mods + '; ' if mods else ''}{why}"
        return self._reason

    @property
    def prepared(self) -> PreparedMask | None:
        """The prepared mask the chosen kernel reads (None for kernels that read none)."""
        if self._call is None or self.chosen.block_size is None or self._call.empty:
            return None
        return self._call.prepared_at(self.chosen.block_size)

    @property
    def rejected(self) -> dict:
        for name, k in KERNELS.items():
            if self._call is not None and (name not in self._refusals or self._refusals[name] is _LATER):
                self._refusals[name] = k.not_supported_reasons(self._call)
        return {name: _refusal_words(why) for name, why in self._refusals.items() if name != self.kernel}

    def __str__(self) -> str:
        return self.reason

    def __repr__(self) -> str:
        return f"Plan(kernel={self.kernel!r}, reason={self.reason!r})"

    def report(self) -> str:
        """Several lines: the choice, then each other kernel and its reasons."""
        lines = [f"chosen {self.reason}"]
        lines += [f"  {name}: {'; '.join(why)}" for name, why in self.rejected.items()]
        return "\n".join(lines)


#: A refusal to work out when explain reads it (a kernel skipped for its device), and the mark
#: of a kernel that could run the call but declined it (its reason is formatted when read).
_LATER: list = []
_DECLINED = object()


def _refusal_words(why: object) -> tuple[str, ...]:
    """A refusal as words: the kernel's reasons, or why it declined (see :meth:`Kernel.prefers`)."""
    if isinstance(why, tuple) and why and why[0] is _DECLINED:
        return (f"not preferred: {why[1] if isinstance(why[1], str) else why[1]()}",)
    return tuple(why) if isinstance(why, (list, tuple)) and why else ("not preferred here",)


def _plan(kernel: Kernel, why: Reason, call: Call, refusals: dict) -> Plan:
    """``why`` is a str or a function giving one (formatted only if the plan is read)."""
    return Plan(kernel, (kernel.name, why), call, refusals)


def choose(call: Call, kernel: Kernel | KernelGroup | str = "auto") -> Plan:
    """Pick the kernel for a validated call; see :func:`attnkit.explain`. ``kernel`` is ``"auto"``,
    a kernel (by name or object) or a group (the first member that can run the call)."""
    if isinstance(kernel, str) and kernel == "auto":
        return _auto(call)
    named = _named(kernel)
    refusals: dict[str, object] = {}
    if isinstance(named, KernelGroup):
        chosen = None
        for member in named.kernels():
            reasons = member.not_supported_reasons(call)
            if not reasons:
                chosen = member
                break
            refusals[member.name] = reasons
        if chosen is None:
            detail = "; ".join(f"{name}: {', '.join(_refusal_words(why))}" for name, why in refusals.items())
            raise AttnkitValueError(
                f"kernel={named.name!r} cannot run this call: none of its kernels can ({detail}). "
                "Use kernel='auto' to let attnkit choose."
            )
        forced = f"forced by kernel={named.name!r}: the first of {', '.join(named.members)} that runs it"
    else:
        chosen = named
        reasons = chosen.not_supported_reasons(call)
        if reasons:
            raise AttnkitValueError(
                f"kernel={chosen.name!r} cannot run this call: {'; '.join(reasons)}. "
                "Use kernel='auto' to let attnkit choose."
            )
        forced = "forced by kernel="

    def why() -> str:
        words = forced
        if chosen.block_size is not None and not call.empty and not call.compiling:
            words += f", {call.prepared_at(chosen.block_size).kept:.0%} of blocks kept"
        return words

    refusals[chosen.name] = []
    return _plan(chosen, why, call, refusals)


def _auto(call: Call) -> Plan:
    refusals: dict[str, object] = {}
    if call.empty:  # the contract's own answer: zeros (and lse -inf), any kernel would give it
        return Plan(
            KERNELS["reference"],
            f"reference: empty attention matrix (Lq={call.shapes.lq}, Lk={call.shapes.lk})",
            call,
            refusals,
        )
    if _ACTIVE:  # use_kernels: the user's order is the preference; the first that can run it runs it
        for k in _ACTIVE[-1]:
            reasons = k.not_supported_reasons(call)
            if not reasons:
                return _plan(
                    k,
                    f"the first of use_kernels({', '.join(x.name for x in _ACTIVE[-1])}) that runs this call",
                    call,
                    refusals,
                )
            refusals[k.name] = reasons
        detail = "; ".join(f"{name}: {', '.join(_refusal_words(why))}" for name, why in refusals.items())
        raise AttnkitValueError(f"no kernel allowed here can run this call ({detail}).")
    device = call.q.device.type
    for k in PRIORITY:
        if not k.runs_on(device):
            refusals[k.name] = _LATER
            continue
        reasons = k.not_supported_reasons(call)
        if reasons:
            refusals[k.name] = reasons
            continue
        yes, why = k.prefers(call)
        if yes:
            return _plan(k, why, call, refusals)
        refusals[k.name] = (_DECLINED, why)
    declined = [KERNELS[name] for name, why in refusals.items() if isinstance(why, tuple) and why[0] is _DECLINED]
    if declined:  # every kernel that can run it would rather not: the first of them runs it
        first = declined[0]
        return _plan(
            first,
            f"the only registered kernel that runs this call ({_refusal_words(refusals[first.name])[0]})",
            call,
            refusals,
        )
    for k in PRIORITY:
        if refusals.get(k.name) is _LATER:
            refusals[k.name] = k.not_supported_reasons(call) or [f"does not run on {device}"]
    detail = "; ".join(f"{name}: {', '.join(_refusal_words(why))}" for name, why in refusals.items())
    raise AttnkitValueError(f"no registered kernel can run this call ({detail}).")


def backward_part(
    call: Call, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, grad_lse: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of a part of the keys (see :meth:`Kernel.backward_part`) by the kernel the
    registry chooses among those that implement it: the first of :func:`use_kernels`' list, else
    of :data:`PRIORITY`, that can run the call and prefers it (else the first that can run it)."""
    order = _ACTIVE[-1] if _ACTIVE else tuple(PRIORITY)
    capable: list[Kernel] = []
    refusals: dict[str, list[str]] = {}
    for k in order:
        if not k.supports_backward_part:
            continue
        reasons = k.not_supported_reasons(call)
        if reasons:
            refusals[k.name] = reasons
            continue
        if _ACTIVE or k.prefers(call)[0]:
            capable.insert(0, k)
            break
        capable.append(k)
    if not capable:
        detail = "; ".join(f"{name}: {', '.join(why)}" for name, why in refusals.items())
        raise AttnkitValueError(f"no kernel can compute the backward over this part of the keys ({detail}).")
    kernel = capable[0]
    if kernel.block_size is not None:
        call.prepared = call.prepared_at(kernel.block_size)
    return kernel.backward_part(call, out, lse, grad_out, grad_lse)


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
    kernel = KERNELS["reference"] if call.empty else plan.chosen  # empty: zeros (and lse -inf)
    if kernel.block_size is not None and not call.empty and not call.compiling:
        call.prepared = call.prepared_at(kernel.block_size)
    if call.sinks is None or "sinks" in kernel.supports_score_mods:
        out, lse = kernel.run(call)
    else:
        out, lse = kernel.run(replace(call, sinks=None, return_lse=True, _by_block=call._by_block))
        assert lse is not None, f"{kernel.name} was asked for the lse"
        out, lse = add_sinks(out, lse, call.sinks)
        lse = lse if call.return_lse else None
    if call.backward and not kernel.supports_double_backward and not call.compiling:
        _first_derivative_only(out, kernel.name)
        _first_derivative_only(lse, kernel.name)
    return out, lse
