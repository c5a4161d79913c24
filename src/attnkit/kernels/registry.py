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
of code (like ``torch.nn.attention.sdpa_kernel``). The registry imports the kernels; no
kernel imports the registry (:mod:`attnkit.kernels.contract` is all they share). Adding a
kernel is one file with a :class:`Kernel` subclass and one :func:`register_kernel` call::

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

The registry is the only place that chooses a kernel: for the forward (:func:`choose`), for
the backward over a part of the keys (:func:`backward_part`, ring attention) and for the
statistics of the weights (:func:`stats`, :func:`attnkit.inspect.attention_stats`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from attnkit._validate import AttnkitTypeError, AttnkitValueError, short
from attnkit.kernels.contract import Call, Kernel, Reason, RelevanceRequest, StatsRequest, mark_first_derivative_only
from attnkit.kernels.lse import add_sinks
from attnkit.kernels.native.kernel import NativeKernel
from attnkit.kernels.reference import ReferenceKernel
from attnkit.kernels.runs.fused import FusedKernel
from attnkit.kernels.runs.math import MathKernel
from attnkit.kernels.sdpa import SDPAKernel
from attnkit.kernels.triton.kernel import TritonKernel
from attnkit.plan import PreparedMask

__all__ = [
    "BUILTIN",
    "FUSED",
    "GROUPS",
    "KERNELS",
    "MATH",
    "NATIVE",
    "PRIORITY",
    "REFERENCE",
    "SDPA",
    "TILED",
    "TRITON",
    "KernelGroup",
    "Plan",
    "active",
    "backward_part",
    "block_size_for",
    "choose",
    "choose_relevance",
    "choose_stats",
    "refusals",
    "register_group",
    "register_kernel",
    "registry_state",
    "relevance",
    "run",
    "stats",
    "unregister_kernel",
    "use_kernels",
]


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


def registry_state() -> tuple:
    """What the choice of a kernel depends on besides the call: the registry's version, the innermost
    use_kernels and each kernel's own :meth:`Kernel.state` (keys of cached choices)."""
    stack = _LOCAL.stack
    return (_GENERATION[0], stack[-1] if stack else None, *[state() for state in _STATEFUL])


#: The state() of each registered kernel whose availability depends on the process (it overrides it).
_STATEFUL: list = []


def active() -> tuple[tuple[Kernel, ...], bool] | None:
    """The innermost :func:`use_kernels`' kernels and whether their preferences are asked, or None."""
    stack = _active_stack()
    return stack[-1] if stack else None


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
    _STATEFUL[:] = [k.state for k in KERNELS.values() if type(k).state is not Kernel.state]
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
    _STATEFUL[:] = [k.state for k in KERNELS.values() if type(k).state is not Kernel.state]
    if kernel in PRIORITY:
        PRIORITY.remove(kernel)


#: Per thread: the kernels :func:`use_kernels` allows and whether their preferences are asked,
#: innermost last. Thread-local (not a ContextVar: torch.compile reads a thread's local state and
#: guards on it), so a block in one thread never changes another thread's choice.
class _Local(threading.local):
    def __init__(self) -> None:  # run once in each thread that reads it: the stack is always there,
        self.stack: list[tuple[tuple[Kernel, ...], bool]] = []  # so no compile guard sees it appear


_LOCAL = _Local()


def _active_stack() -> list[tuple[tuple[Kernel, ...], bool]]:
    """This thread's use_kernels entries, innermost last."""
    return _LOCAL.stack


@contextlib.contextmanager
def use_kernels(*kernels: Kernel | str, prefer: bool = False) -> Iterator[None]:
    """Within the block, ``kernel="auto"`` takes the first of these kernels that can run a call.

    Like ``torch.nn.attention.sdpa_kernel``: the order given is the preference (the
    kernels' own :meth:`Kernel.prefers` is not asked), and it reaches every attnkit call made inside
    (modules, :func:`attnkit.capture`, models run through the transformers integration).
    Names, groups (``"tiled"``: its members in order) or kernel objects; a call none of them
    can run raises an error naming each one's reasons. With ``prefer=True`` the kernels' own
    preferences are asked in this order, as ``auto`` asks :data:`PRIORITY` (the first that can run
    a call and prefers it; else the first that can run it): ``auto`` restricted to these kernels.

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
    stack = _active_stack()
    entry = (_expanded(kernels), bool(prefer))
    stack.append(entry)
    try:
        yield
    finally:
        # this block's own entry (a generator closed late, out of order, never pops another's)
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is entry:
                del stack[i]
                break


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
        inner = active()
        self._allowed = inner[0] if inner else None  # the use_kernels this choice was made under

    @property
    def reason(self) -> str:
        """``"<kernel>: <modifications>; <why>"`` (made when read: the hot path formats nothing)."""
        if not isinstance(self._reason, str):
            why = self._reason[1] if isinstance(self._reason[1], str) else self._reason[1]()  # a Reason
            mods = self._call.describe_mods() if self._call is not None else ""
            self._reason = f"{self.kernel}: {mods + '; ' if mods else ''}{why}{self._off()}"
        return self._reason

    def _off(self) -> str:
        """Each kernel of this call's device that cannot run in this process at all, and why."""
        if self._call is None:
            return ""
        device = self._call.q.device.type
        off = [
            f" ({k.name} is off: {why})"
            for k in KERNELS.values()
            if k is not self.chosen and k.runs_on(device) and (why := k.unavailable())
        ]
        return "".join(off)

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
                if self._allowed is not None and k not in self._allowed:
                    names = ", ".join(x.name for x in self._allowed)
                    self._refusals[name] = [f"not among the kernels of use_kernels({names})"]
                else:
                    self._refusals[name] = k.not_supported_reasons(self._call) or self._after_chosen(k)
        return {name: _refusal_words(why) for name, why in self._refusals.items() if name != self.kernel}

    def _after_chosen(self, kernel: Kernel) -> list[str]:
        """Why a kernel that can run the call lost to the chosen one: it comes later in the order
        asked (and what it says of the call), or it would rather not run it."""
        assert self._call is not None, "asked only for a plan of a call"
        yes, why = kernel.prefers(self._call)
        words = why if isinstance(why, str) else why()
        if not yes:
            return [f"not preferred: {words}"]
        order = list(self._allowed) if self._allowed is not None else PRIORITY
        first = (
            f"{self.kernel} comes before it in the priority order ({', '.join(k.name for k in order)})"
            if self.chosen in order and kernel in order and order.index(self.chosen) < order.index(kernel)
            else f"{self.kernel} was chosen"
        )
        return [f"can run it too ({words}), but {first} and takes it"]

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
    order: tuple[Kernel, ...] | list[Kernel] = PRIORITY
    inner = active()
    if inner is not None:
        allowed, prefer = inner
        if not prefer:  # use_kernels: the user's order is the preference; the first that can run it runs it
            for k in allowed:
                reasons = k.not_supported_reasons(call)
                if not reasons:
                    return _plan(
                        k, f"the first of use_kernels({', '.join(x.name for x in allowed)}) that runs this call",
                        call, refusals,
                    )  # fmt: skip
                refusals[k.name] = reasons
            detail = "; ".join(f"{name}: {', '.join(_refusal_words(why))}" for name, why in refusals.items())
            raise AttnkitValueError(f"no kernel allowed here can run this call ({detail}).")
        order = allowed
    device = call.q.device.type
    for k in order:
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
    for k in order:
        if refusals.get(k.name) is _LATER:
            refusals[k.name] = k.not_supported_reasons(call) or [f"does not run on {device}"]
    detail = "; ".join(f"{name}: {', '.join(_refusal_words(why))}" for name, why in refusals.items())
    raise AttnkitValueError(f"no registered kernel can run this call ({detail}).")


def refusals(name: str, call: Call) -> list[str]:
    """Why the kernel registered as ``name`` may not run ``call`` here (empty: it may): its own
    :meth:`Kernel.not_supported_reasons`, and, inside :func:`use_kernels`, whether it is among the
    kernels allowed. For a computation of one kernel's own, such as the native engine's
    statistics, which then falls back to what :func:`choose` picks."""
    kernel = KERNELS.get(name)
    if kernel is None:
        return [f"no kernel named {name!r} is registered"]
    reasons = kernel.not_supported_reasons(call)
    inner = active()
    if inner is not None and kernel not in inner[0]:
        reasons.append(f"not among the kernels of use_kernels({', '.join(k.name for k in inner[0])})")
    return reasons


def backward_part(
    call: Call, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, grad_lse: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of a part of the keys (see :meth:`Kernel.backward_part`) by the kernel the
    registry chooses among those that implement it: the first of :func:`use_kernels`' list, else
    of :data:`PRIORITY`, that can run the call and prefers it (else the first that can run it)."""
    inner = active()
    order, forced = (inner[0], not inner[1]) if inner is not None else (tuple(PRIORITY), False)
    capable: list[Kernel] = []
    refusals: dict[str, list[str]] = {}
    for k in order:
        if not k.supports_backward_part:
            continue
        reasons = k.not_supported_reasons(call)
        if reasons:
            refusals[k.name] = reasons
            continue
        if forced or k.prefers(call)[0]:
            capable.insert(0, k)
            break
        capable.append(k)
    if not capable:
        detail = "; ".join(f"{name}: {', '.join(why)}" for name, why in refusals.items())
        raise AttnkitValueError(f"no kernel can compute the backward over this part of the keys ({detail}).")
    return capable[0].backward_part(call, out, lse, grad_out, grad_lse)


def block_size_for(device: torch.device | str) -> tuple[int, int] | None:
    """The block size of the first block-sparse kernel in :data:`PRIORITY` for ``device``: one that
    names the device among its own, or (off the CPU) one for any device. A PreparedMask made at it
    runs under ``torch.compile`` without being blocked again."""
    kind = torch.device(device).type
    for kernel in PRIORITY:
        if kernel.block_size is None:
            continue
        if (kernel.devices is not None and kind in kernel.devices) or (kernel.devices is None and kind != "cpu"):
            return (int(kernel.block_size[0]), int(kernel.block_size[1]))
    return None


def _choose_capable(call: Call, capable: str, what: str) -> Plan:
    """The first kernel of :func:`use_kernels`' list, else of :data:`PRIORITY`, whose ``capable``
    flag is set and that can run ``call``; else an error naming each one's reasons."""
    inner = active()
    order = inner[0] if inner is not None else tuple(PRIORITY)
    refusals: dict[str, object] = {}
    for k in order:
        if not getattr(k, capable):
            refusals[k.name] = [f"computes no {what}"]
            continue
        reasons = k.not_supported_reasons(call)
        if not reasons:
            return _plan(k, f"the first kernel that computes {what} and can run this call", call, refusals)
        refusals[k.name] = reasons
    detail = "; ".join(f"{name}: {', '.join(_refusal_words(why))}" for name, why in refusals.items())
    raise AttnkitValueError(f"no kernel allowed here computes the {what} of this call ({detail}).")


def choose_stats(call: Call) -> Plan:
    """The kernel that computes the statistics of a call's weights (:func:`stats`): the first of
    :func:`use_kernels`' list, else of :data:`PRIORITY`, that computes statistics and can run it."""
    return _choose_capable(call, "supports_stats", "statistics")


def choose_relevance(call: Call) -> Plan:
    """The kernel that computes the gradient rule's reduction of a call's weights (:func:`relevance`):
    the first of :func:`use_kernels`' list, else of :data:`PRIORITY`, that computes it and can run it."""
    return _choose_capable(call, "supports_relevance", "relevance")


def relevance(call: Call, request: RelevanceRequest) -> torch.Tensor:
    """The gradient rule's reduction of a 4-D call's weights (:meth:`Kernel.relevance`, ``(B, R, Lk)``)
    by the kernel :func:`choose_relevance` picks."""
    return choose_relevance(call).chosen.relevance(call, request)


def stats(call: Call, request: StatsRequest) -> dict[str, torch.Tensor]:
    """The statistics of a 4-D call's weights (:meth:`Kernel.stats`) by the kernel
    :func:`choose_stats` picks."""
    return choose_stats(call).chosen.stats(call, request)


def run(call: Call, plan: Plan) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the chosen kernel; ``(out, lse or None)``."""
    kernel = KERNELS["reference"] if call.empty else plan.chosen  # empty: zeros (and lse -inf)
    if call.sinks is None or "sinks" in kernel.supports_score_mods:
        out, lse = kernel.run(call)
    else:
        out, lse = kernel.run(call.replace(sinks=None, return_lse=True))
        assert lse is not None, f"{kernel.name} was asked for the lse"
        out, lse = add_sinks(out, lse, call.sinks)
        lse = lse if call.return_lse else None
    if call.backward and not kernel.supports_double_backward and not call.compiling:
        mark_first_derivative_only(out, kernel.name)
        mark_first_derivative_only(lse, kernel.name)
    return out, lse


# --- attnkit's own kernels, registered last-first: each new kernel goes to the front -------------

REFERENCE = register_kernel(ReferenceKernel())
SDPA = register_kernel(SDPAKernel())
MATH = register_kernel(MathKernel())
FUSED = register_kernel(FusedKernel())
NATIVE = register_kernel(NativeKernel())
TRITON = register_kernel(TritonKernel())
TILED = register_group("tiled", ("native", "fused", "math"))
#: PRIORITY as attnkit registered it (what :mod:`attnkit.kernels.fastpath` checks the registry against).
BUILTIN: tuple[Kernel, ...] = tuple(PRIORITY)
