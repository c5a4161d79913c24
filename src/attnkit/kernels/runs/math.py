"""The ``math`` kernel: a prepared mask's runs as matmul, softmax statistics and matmul, in PyTorch.

It walks the plan (:mod:`attnkit.kernels.runs.walk`) with the math engine
(:mod:`attnkit.kernels.runs.math_engine`). It is the block-sparse kernel for everything the others
cannot take: any bias (evaluated one tile at a time, with the gradients of its own tensors),
soft-capping, any ``score_mod`` (autograd on each tile), dropout (a keep-mask drawn per run from a
generator seeded once per call from the global generator, so ``torch.manual_seed`` reproduces
it), Dv != D, float64, and any device (off the CPU a Python loop of small matmuls:
``kernel="math"`` forces it). Its statistics (:meth:`MathKernel.stats`) reduce the weights tile
by tile after a sweep for each row's largest score and sum (:mod:`attnkit.kernels.runs.stats`),
and its gradient rule (:meth:`MathKernel.relevance`, :mod:`attnkit.kernels.runs.relevance`) the
weights ``exp(s - lse)``.

Equivalent pytorch code: ``reference.attention(q, k, v, prepared.materialize(), scale=scale)``.
"""

from __future__ import annotations

import torch

from attnkit.kernels import sparsity
from attnkit.kernels.contract import (
    Call,
    Kernel,
    Reason,
    RelevanceRequest,
    Runner,
    StatsRequest,
    first_derivative_only,
)
from attnkit.kernels.runs import compiled, relevance, stats, walk

__all__ = ["MathKernel"]


class MathKernel(Kernel):
    """The block-sparse walk in PyTorch matmuls (see the module's docstring)."""

    name = "math"
    block_size = sparsity.BLOCK_SIZE
    supports_dropout = True
    supports_lse = True
    supports_backward_part = True
    supports_stats = True
    supports_relevance = True
    supports_score_mods = ("bias", "softcap", "score_mod")  # sinks: added by the registry from the lse
    max_rank = 4

    def _reasons(self, call: Call) -> list[str]:
        return sparsity.compile_refusals(call)

    def prefers(self, call: Call) -> tuple[bool, Reason]:
        if call.compiling:
            return True, "under torch.compile: block-sparse through a custom op over the PreparedMask's tensors"
        if call.q.device.type != "cpu":
            return (
                False,
                lambda: f"on {call.q.device.type} it is a Python loop of small matmuls (kernel='math' forces it)",
            )
        if call.mods:
            p = call.prepared_at(self.block_size)
            return True, lambda: f"{p.kept:.0%} of blocks kept, {sparsity.modifications_in_words(call, False)}"
        if call.dropout_p > 0.0 or call.return_lse:
            p = call.prepared_at(self.block_size)
            why = f"dropout_p={call.dropout_p}" if call.dropout_p > 0.0 else "return_lse=True"
            return True, lambda: f"{why}, {p.kept:.0%} of blocks kept"
        return sparsity.sparse_pays(call, sparsity.LIMITS)

    def runner(self, call: Call) -> Runner | None:
        if call.mods or call.dropout_p > 0.0 or call.compiling:
            return None
        s, prepared, scale = call.shapes, call.prepared_at(self.block_size), call.scale
        lead = (1,) * (4 - s.rank)

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q4, k4, v4 = (t.reshape(*lead, *t.shape) for t in (q, k, v))  # (B, H, L, D)
            return walk.attention(q4, k4, v4, prepared, engine="math", scale=scale)[0].reshape(s.out)

        return first_derivative_only(run, self) if call.backward else run

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        if call.compiling:
            return compiled.run(call, "math", self.block_size)
        s = call.shapes
        q4, k4, v4 = call.as4d()
        out, lse = walk.attention(
            q4,
            k4,
            v4,
            call.prepared_at(self.block_size),
            engine="math",
            scale=call.scale,
            dropout_p=call.dropout_p,
            bias=call.bias,
            softcap=call.softcap,
            score_mod=call.score_mod,
        )
        return out.reshape(s.out), lse.reshape(s.scores[:-1]) if call.return_lse else None

    def backward_part(
        self, call: Call, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, grad_lse: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q4, k4, v4 = call.as4d()
        return walk.backward_part(
            q4,
            k4,
            v4,
            call.prepared_at(self.block_size),
            out,
            lse,
            grad_out,
            grad_lse,
            engine="math",
            scale=call.scale,
            bias=call.bias,
            softcap=call.softcap,
        )

    def stats(self, call: Call, request: StatsRequest) -> dict[str, torch.Tensor]:
        """Two sweeps over the kept tiles of each block of rows: its largest score and sum, then
        its weights reduced (:mod:`attnkit.kernels.runs.stats`)."""
        return stats.reduce(call, call.prepared_at(self.block_size), request)

    def relevance(self, call: Call, request: RelevanceRequest) -> torch.Tensor:
        """One pass over the kept tiles (:mod:`attnkit.kernels.runs.relevance`)."""
        return relevance.reduce(call, call.prepared_at(self.block_size), request)
