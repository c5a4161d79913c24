"""The kernel contract: what every kernel imports, and all it needs to know of the others.

A kernel takes one validated :class:`~attnkit.call.Call` and returns ``(out, lse)``:
``out: (..., Hq, Lq, Dv)`` in q's dtype and ``lse: (..., Hq, Lq)`` (float32, float64 for
float64 inputs; ``-inf`` for a row that sees no key), or ``lse=None`` when the call did not
ask for it. A kernel is a :class:`Kernel` subclass in a module (or folder) of its own: it
declares what it can do (devices, dtypes, the block size of the PreparedMask it reads,
modifications, lse, dropout, backward, statistics), says in words why it cannot run a call
(:meth:`Kernel.not_supported_reasons`) and whether it is the right kernel for one
(:meth:`Kernel.prefers`, which owns its thresholds). Kernel modules import this module and the
shared parts of :mod:`attnkit.kernels` (``sparsity``, ``dense``, ``blocks``, ``lse``), never each
other and never the registry; the registry (:mod:`attnkit.kernels.registry`) imports them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

import torch

from attnkit._validate import AttnkitValueError
from attnkit.call import Call, Form

__all__ = [
    "Call",
    "Form",
    "Kernel",
    "LimitRunner",
    "Reason",
    "RelevanceRequest",
    "Runner",
    "StatsRequest",
    "double_backward_error",
    "first_derivative_only",
    "mark_first_derivative_only",
]

#: Why a kernel was (not) chosen: the words, or a function giving them (formatted only when read).
Reason = Union[str, Callable[[], str]]

#: A function that runs later calls of one signature: ``(q, k, v) -> out`` (see :meth:`Kernel.runner`).
Runner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
#: The same for calls whose key limits change: ``(q, k, v, limits) -> out`` (:meth:`Kernel.limit_runner`).
LimitRunner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, tuple], torch.Tensor]


@dataclass(frozen=True)
class StatsRequest:
    """What :meth:`Kernel.stats` reduces the weights to, besides their row statistics.

    ``qpos (1 or B, Lq)`` and ``kpos (1 or B, Lk)``: where queries and keys sit (the mask's
    positions, in the statistics' dtype); ``sink_tokens``: how many first keys count as sinks;
    ``topk``: how many largest weights of each row to keep (0: none).
    """

    qpos: torch.Tensor
    kpos: torch.Tensor
    sink_tokens: int
    topk: int


@dataclass(frozen=True)
class RelevanceRequest:
    """What :meth:`Kernel.relevance` reduces a call's weights ``A = exp(s - lse)`` to, row vectors
    ``r`` carrying each query's share to the keys:

    - with ``d_out``: ``out[b, :, j] = sum_i r[b, :, i] sum_h w_h max(0, dA[b, h, i, j] A[b, h, i, j])``,
      ``dA[b, h, i, j] = d_out[b, h, i] . v[b, h, j]``, ``w = head_weights``: the gradient rule of
      attention attribution (Chefer et al. 2021: ``dA = dO V^T`` times the weights, clipped at 0,
      averaged over heads);
    - without (None): ``out[b, :, j] = sum_i r[b, :, i] sum_h w_h A[b, h, i, j]``, the
      weights themselves (``r @ A``: attention rollout's step).

    ``lse (B, Hq, Lq)``: the call's row log-sum-exp (the sinks' mass included); ``r (B, R, Lq)``;
    ``d_out (B, Hq, Lq, Dv)`` or None; ``head_weights (Hq,)``. Rows whose ``r`` is 0 add nothing
    and a kernel may skip them.
    """

    lse: torch.Tensor
    r: torch.Tensor
    d_out: torch.Tensor | None
    head_weights: torch.Tensor


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
    #: Sinks need only the log-sum-exp: the registry adds them for any kernel with lse.
    supports_score_mods: tuple[str, ...] = ()
    #: Largest input rank (None: any).
    max_rank: int | None = None
    #: Whether it implements :meth:`backward_part`.
    supports_backward_part: bool = False
    #: Whether it implements :meth:`stats`.
    supports_stats: bool = False
    #: Whether it implements :meth:`relevance`.
    supports_relevance: bool = False
    #: Whether it runs under torch.func transforms (grad, vjp, jacrev, jacfwd, jvp, vmap) and
    #: forward-mode AD: only a kernel made of PyTorch's own differentiable operations, with no
    #: custom operator, autograd.Function or host read of its inputs, does.
    supports_transforms: bool = False

    def state(self) -> object:
        """What this kernel's availability depends on in this process besides the call (a switch, a
        probe's answer), as a hashable value: part of the key of every cached choice, so changing it
        is never served stale. None (the default): nothing."""
        return None

    def unavailable(self) -> str | None:
        """Why this kernel cannot run in this process at all, in words that say what would make it
        run (a library to install, a compiler), or None: it can, or that is not known yet (nothing is
        loaded to answer). ``attnkit.explain`` adds it to the printed line of a call this kernel's
        device would have run elsewhere. None (the default)."""
        return None

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
        if call.transform is not None and not self.supports_transforms:
            reasons.append(
                f"cannot run under {call.transform} (its operators have no rule for it); kernel='auto' runs "
                "the reference kernel there"
            )
        reasons += call.mod_refusals(self.supports_score_mods, self.supports_lse)
        if self.max_rank is not None and call.shapes.rank > self.max_rank:
            reasons.append(f"takes inputs of rank 2 to {self.max_rank}, not {call.shapes.rank}")
        if call.transform is not None and not self.supports_transforms:
            return reasons  # its own reasons may read the mask's values, which a transform's tensors do not have
        return reasons + self._reasons(call)

    def _reasons(self, call: Call) -> list[str]:
        return []

    def prefers(self, call: Call) -> tuple[bool, Reason]:
        """``(True, why)`` if this kernel is the right choice for a call it can run, else
        ``(False, why not)``: the next kernel in the priority list is asked. The kernel owns
        its thresholds here."""
        return True, "the kernel can run this call"

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

    def stats(self, call: Call, request: StatsRequest) -> dict[str, torch.Tensor]:
        """The statistics of the weights of a 4-D call, without its ``Lq x Lk`` matrix: ``{name:
        tensor}`` with every field of :class:`attnkit.inspect.AttentionStats` (``lse`` with the
        sinks' mass; the sinks' own entropy term is added by the caller)."""
        raise NotImplementedError(f"the {self.name!r} kernel computes no statistics")

    def relevance(self, call: Call, request: RelevanceRequest) -> torch.Tensor:
        """``(B, R, Lk)``: the reduction :class:`RelevanceRequest` defines, over the tiles the call's
        mask keeps, without its ``Lq x Lk`` matrix (float32; float64 for float64 inputs)."""
        raise NotImplementedError(f"the {self.name!r} kernel computes no relevance")

    def runner(self, call: Call) -> Runner | None:
        """Optionally, a function ``(q, k, v) -> out`` that runs every later call of this call's
        signature (same shapes, dtypes, devices, mask value, scale, autograd; no modifications,
        dropout or lse) without validating or choosing again. None: no such shortcut."""
        return None

    def any_length_runner(self, call: Call) -> Runner | None:
        """Optionally, a runner for every later call of this unmasked rank-4 call's signature at any
        key length (a decoding step over a growing cache), valid only where the registry would choose
        this kernel for any Lk (see :mod:`attnkit.kernels.fastpath`). None: no such shortcut."""
        return None

    def limit_runner(self, call: Call) -> LimitRunner | None:
        """Optionally, a function ``(q, k, v, limits) -> out`` that runs every later call of this
        call's signature whose mask differs from this one only in each sequence's key limit (a
        decoding step's new :func:`attnkit.masks.padding`; ``limits``: one int per sequence, in
        ``[0, Lk]``), valid only where the registry would choose this kernel for any limits (see
        :mod:`attnkit.kernels.fastpath`). None: no such shortcut."""
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


def first_derivative_only(fn: Runner, kernel: Kernel) -> Runner:
    """``fn`` with outputs that refuse a second derivative clearly, unless the kernel has one."""
    if kernel.supports_double_backward:
        return fn

    def guarded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = fn(q, k, v)
        mark_first_derivative_only(out, kernel.name)
        return out

    return guarded
