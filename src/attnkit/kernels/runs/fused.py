"""The ``fused`` kernel: a prepared mask's runs, each one call of PyTorch's fused CPU flash kernel.

It walks the plan (:mod:`attnkit.kernels.runs.walk`) with the fused engine
(:mod:`attnkit.kernels.runs.fused_engine`): a partial run with its tile as the additive mask, a
bias of ``kv - q`` alone (ALiBi, T5's relative bias, their sums) as one band per head, causal
squares as one ``is_causal`` call. It needs Dv == D and no dropout, softcap or score_mod. Used
where the native engine is not (no compiler, ``ATTNKIT_NATIVE=0``) and for calls of fewer than
16 queries (decoding steps).

Equivalent pytorch code: ``reference.attention(q, k, v, prepared.materialize(), scale=scale)``.
"""

from __future__ import annotations

import torch

from attnkit.kernels import sparsity
from attnkit.kernels.contract import Call, Kernel, Reason, Runner, first_derivative_only
from attnkit.kernels.runs import aten, compiled, walk

__all__ = ["FusedKernel"]


class FusedKernel(Kernel):
    """PyTorch's fused CPU flash kernel per run of a prepared mask (see the module's docstring)."""

    name = "fused"
    devices = ("cpu",)
    block_size = sparsity.BLOCK_SIZE
    supports_lse = True
    supports_backward_part = True
    supports_score_mods = ("bias",)  # a band of kv - q; sinks: added by the registry from the lse
    max_rank = 4

    def state(self) -> object:
        return aten.AVAILABLE  # PyTorch's fused CPU ops, probed at import

    def _reasons(self, call: Call) -> list[str]:
        reasons = sparsity.compile_refusals(call)
        if not aten.AVAILABLE:
            reasons.append("PyTorch's fused CPU flash kernel is not in this build of PyTorch")
        if call.shapes.d != call.shapes.dv:
            reasons.append(f"needs Dv == D, not Dv={call.shapes.dv} and D={call.shapes.d}")
        if call.bias is not None and not call.compiling and call.bias_band is None:
            reasons.append("a bias that is not a finite function of kv - q alone")
        return reasons

    def prefers(self, call: Call) -> tuple[bool, Reason]:
        if call.compiling:  # the user prepared the mask for this: no host reads while tracing
            return True, "under torch.compile: block-sparse through a custom op over the PreparedMask's tensors"
        if call.bias is not None:
            p = call.prepared_at(self.block_size)
            return True, lambda: f"{p.kept:.0%} of blocks kept, {sparsity.modifications_in_words(call, True)}"
        if call.return_lse:
            p = call.prepared_at(self.block_size)
            return True, lambda: f"return_lse=True, {p.kept:.0%} of blocks kept"
        if call.sinks is not None:
            p = call.prepared_at(self.block_size)
            return True, lambda: f"{p.kept:.0%} of blocks kept, sinks from the lse"
        return sparsity.sparse_pays(call, sparsity.LIMITS, squares=True)

    def runner(self, call: Call) -> Runner | None:
        if call.mods or call.dropout_p > 0.0 or call.compiling:
            return None
        s, prepared, scale = call.shapes, call.prepared_at(self.block_size), call.scale
        lead = (1,) * (4 - s.rank)

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q4, k4, v4 = (t.reshape(*lead, *t.shape) for t in (q, k, v))  # (B, H, L, D)
            return walk.attention(q4, k4, v4, prepared, engine="fused", scale=scale)[0].reshape(s.out)

        return first_derivative_only(run, self) if call.backward else run

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        if call.compiling:
            return compiled.run(call, "fused", self.block_size)
        s = call.shapes
        q4, k4, v4 = call.as4d()
        prepared = call.prepared_at(self.block_size)
        out, lse = walk.attention(
            q4, k4, v4, prepared, engine="fused", scale=call.scale, bias=call.bias, band=call.bias_band
        )
        return out.reshape(s.out), lse.reshape(s.scores[:-1]) if call.return_lse else None

    def backward_part(
        self, call: Call, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, grad_lse: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q4, k4, v4 = call.as4d()
        prepared = call.prepared_at(self.block_size)
        return walk.backward_part(
            q4, k4, v4, prepared, out, lse, grad_out, grad_lse, engine="fused", scale=call.scale, bias=call.bias,
            band=call.bias_band,
        )  # fmt: skip
