"""A block-sparse FlashAttention-2 kernel in Triton that reads prepared masks as data.

One compiled kernel per dtype, head size and set of score modifications, never per
mask or shape: each program (one query block of one batch row and head) walks the
prepared mask's list of kept key blocks (``kv_num``/``kv_indices``). Full blocks need
no element mask. Inside partial blocks the mask is evaluated from its parameters for
the positional masks (causal and sliding windows with their offsets and alignment,
which covers the diagonal of every causal model), and read from precomputed bit
tiles of the partial blocks for every other mask (documents, prefixes, padding,
``&``/``|`` combinations, dense tensors, ``from_fn``): O(partial blocks) bytes, like
FlashMask's per-column ranges. Keys past each sequence's ``kv_limit`` are never read.

Score modifications: soft-capping and ALiBi (slopes per head, symmetric or causal)
in the kernel; sinks from the returned lse (the registry adds them). The backward
pass is one kernel per query block: dQ in registers, dK/dV by atomic adds in float32.

On CUDA this is the ``triton`` kernel of the registry. Under ``TRITON_INTERPRET=1``
Triton runs it on CPU tensors (slowly): that is how the tests check its logic on any
machine.
"""

from __future__ import annotations

import torch

from attnkit import _cache
from attnkit import bias as _bias
from attnkit.kernels.contract import Call, Form, Kernel, Reason
from attnkit.kernels.triton.env import AVAILABLE, interpreted, triton

if AVAILABLE:
    from attnkit.kernels.triton.jit import backward_kernel, forward_kernel

__all__ = ["AVAILABLE", "TritonKernel", "interpreted", "triton_attention"]

#: Query and key block sizes (the prepared mask is made for these).
BLOCK_Q, BLOCK_K = 64, 64


# --- the mask and modifications as kernel arguments ---------------------------------------------


_BIG = 1 << 40


def _alibi(attn_bias):
    """The ALiBi bias when the kernel can compute it (int offsets), else None."""
    if not isinstance(attn_bias, _bias.Alibi):
        return None
    if isinstance(attn_bias.q_offset, torch.Tensor) or isinstance(attn_bias.kv_offset, torch.Tensor):
        return None
    return attn_bias


def _plan(call: Call):
    """The prepared mask at this kernel's block sizes and its element bits (``prepared.partial_bits``),
    through the one bounded cache: once per mask, lengths and device."""
    prepared = call.prepared_at(TritonKernel.block_size)
    if prepared.band is not None or not prepared.masked:  # evaluated in the kernel from two ints, or none
        store = _cache.plan_store(prepared)
        key = ("triton no bits", str(call.q.device))
        cached = store.get(key)
        if cached is None:
            cached = (
                torch.ones(1, BLOCK_Q, BLOCK_K, dtype=torch.int8, device=call.q.device),
                torch.full(prepared.kv_indices.shape, -1, dtype=torch.int32, device=call.q.device),
            )
            store.put(key, cached, cached[0].numel() + 4 * cached[1].numel())
        return prepared, cached
    return prepared, prepared.partial_bits(call.q.device)


def _next_pow2(n: int) -> int:
    return max(16, 1 << (max(n, 1) - 1).bit_length())


class _Args:
    """Everything the two kernels take besides q, k, v."""

    def __init__(self, call: Call, q4, k4, v4):
        self.prepared, (self.bits, self.listed) = _plan(call)
        p = self.prepared
        b, hq, lq, d = q4.shape
        hkv, lk, dv = k4.shape[1], k4.shape[2], v4.shape[-1]
        self.shape = (b, hq, hkv, lq, lk, d, dv)
        self.scale = float(call.scale)
        self.has_softcap = call.softcap is not None
        self.softcap = float(call.softcap) if call.softcap is not None else 1.0
        alibi = _alibi(call.bias)
        self.alibi_mode = 0
        self.slopes = torch.zeros(1, device=q4.device, dtype=torch.float32)
        q_shift = kv_shift = 0  # the kernel's positions: qp = i + q_shift, kp = j + kv_shift
        if alibi is not None:
            self.alibi_mode = 2 if alibi.causal else 1
            self.slopes = alibi.slopes.detach().to(q4.device, torch.float32).contiguous()
            q_shift = alibi.q_offset + (lk - lq if alibi.align == "bottom_right" else 0)
            kv_shift = alibi.kv_offset
        self.band = p.band
        lo = hi = 0
        if p.band is not None:  # lo <= j - i <= hi, as kp - qp: j - i = kp - qp + q_shift - kv_shift
            offset = q_shift - kv_shift
            lo = _BIG if p.band[0] is None else -(p.band[0] - offset)
            hi = _BIG if p.band[1] is None else p.band[1] - offset
        self.positions = (q_shift, kv_shift, lo, hi)
        self.kv_num = p.kv_num.to(q4.device).contiguous()
        self.kv_idx = p.kv_indices.to(q4.device).contiguous()
        self.limit = p.kv_limit.to(q4.device, torch.int32).contiguous() if p.kv_limit is not None else self.kv_num
        self.mask_b = int(p.codes.shape[0] > 1)
        self.mask_h = int(p.codes.shape[1] > 1)

    def strides(self):
        n, i = self.kv_num.stride(), self.kv_idx.stride()
        return (n[0], n[1], n[2], i[0], i[1], i[2])

    def flags(self, q4):
        return dict(
            MASK_B=self.mask_b,
            MASK_H=self.mask_h,
            HAS_LIMIT=self.prepared.kv_limit is not None,
            BQ=BLOCK_Q,
            BK=BLOCK_K,
            BD=_next_pow2(self.shape[5]),
            BDV=_next_pow2(self.shape[6]),
            SOFTCAP=self.has_softcap,
            ALIBI=self.alibi_mode,
            BAND=self.band is not None,
            # Triton's interpreter computes bfloat16 dot products wrongly: upcast there
            FP32=q4.dtype == torch.float32 or self.upcast(q4),
            UPCAST=self.upcast(q4),
        )

    @staticmethod
    def upcast(q4) -> bool:
        return q4.dtype == torch.bfloat16 and interpreted()


def _forward(args: _Args, q4, k4, v4):
    b, hq, hkv, lq, lk, d, dv = args.shape
    out = torch.empty(b, hq, lq, dv, dtype=q4.dtype, device=q4.device)
    lse = torch.empty(b, hq, lq, dtype=torch.float32, device=q4.device)
    grid = (triton.cdiv(lq, BLOCK_Q), b * hq)
    forward_kernel[grid](
        q4,
        k4,
        v4,
        out,
        lse,
        args.kv_num,
        args.kv_idx,
        args.listed,
        args.bits,
        args.limit,
        args.slopes,
        *q4.stride()[:3],
        *k4.stride()[:3],
        *v4.stride()[:3],
        *out.stride()[:3],
        *args.strides(),
        hq,
        hq // hkv,
        lq,
        lk,
        d,
        dv,
        args.scale,
        args.softcap,
        *args.positions,
        **args.flags(q4),
    )
    return out, lse


def _backward(args: _Args, q4, k4, v4, out, lse, grad_out, grad_lse):
    b, hq, hkv, lq, lk, d, dv = args.shape
    go = grad_out.contiguous()
    delta = (go.float() * out.float()).sum(-1)
    if grad_lse is not None:  # d lse / d s = p: lowers delta by the lse's gradient
        delta = delta - grad_lse.float()
    dq = torch.zeros(b, hq, lq, d, dtype=torch.float32, device=q4.device)
    dk = torch.zeros(b, hkv, lk, d, dtype=torch.float32, device=q4.device)
    dvv = torch.zeros(b, hkv, lk, dv, dtype=torch.float32, device=q4.device)
    grid = (triton.cdiv(lq, BLOCK_Q), b * hq)
    backward_kernel[grid](
        q4,
        k4,
        v4,
        go,
        lse.contiguous(),
        delta.contiguous(),
        dq,
        dk,
        dvv,
        args.kv_num,
        args.kv_idx,
        args.listed,
        args.bits,
        args.limit,
        args.slopes,
        *q4.stride()[:3],
        *k4.stride()[:3],
        *v4.stride()[:3],
        *args.strides(),
        hq,
        hkv,
        hq // hkv,
        lq,
        lk,
        d,
        dv,
        args.scale,
        args.softcap,
        *args.positions,
        **args.flags(q4),
    )
    return dq.to(q4.dtype), dk.to(k4.dtype), dvv.to(v4.dtype)


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q4, k4, v4, args):
        out, lse = _forward(args, q4, k4, v4)
        ctx.save_for_backward(q4, k4, v4, out, lse)
        ctx.args = args
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q4, k4, v4, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        return (*_backward(ctx.args, q4, k4, v4, out, lse, grad_out, grad_lse), None)


def triton_attention(call: Call) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a validated call (4-D view of its inputs)."""
    s = call.shapes
    lead = (1,) * (4 - s.rank)
    q4, k4, v4 = (t.reshape(*lead, *t.shape).contiguous() for t in (call.q, call.k, call.v))
    args = _Args(call, q4, k4, v4)
    if call.backward:
        out, lse = _TritonAttention.apply(q4, k4, v4, args)
    else:
        out, lse = _forward(args, q4, k4, v4)
    return out.reshape(s.out), lse.reshape(s.scores[:-1])


class TritonKernel(Kernel):
    """The block-sparse Triton kernel: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``."""

    name = "triton"
    block_size = (BLOCK_Q, BLOCK_K)
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    supports_lse = True
    supports_score_mods = ("bias", "softcap")  # bias: ALiBi only (see _reasons); sinks from the lse
    max_rank = 4

    def runs_on(self, device_type: str) -> bool:
        return AVAILABLE and (device_type == "cuda" or (device_type == "cpu" and interpreted()))

    def _reasons(self, call: Call) -> list[str]:
        reasons = []
        if not AVAILABLE:
            return ["Triton is not installed (pip install 'attnkit[gpu]')"]
        if call.q.device.type != "cuda" and not (interpreted() and call.q.device.type == "cpu"):
            reasons.append(f"runs on CUDA (or on the CPU under TRITON_INTERPRET=1), not {call.q.device.type}")
        if call.compiling:
            reasons.append("prepares its block lists on the host, which torch.compile cannot trace")
        if call.float_mask:
            reasons.append("no additive float mask (pass it as attn_bias=attnkit.bias.dense(...) to another kernel)")
        if call.bias is not None:
            alibi = _alibi(call.bias)
            if alibi is None:
                reasons.append(f"computes ALiBi biases only (with int offsets), not {call.bias.describe()}")
            elif call.softcap is not None:
                reasons.append("soft-capping and ALiBi together (one or the other)")
            elif alibi.slopes.requires_grad and call.backward:
                reasons.append("no gradient for learnable ALiBi slopes")
        if call.q.shape[-1] > 256 or call.v.shape[-1] > 256:
            reasons.append(f"head sizes up to 256, not {call.q.shape[-1]}/{call.v.shape[-1]}")
        return reasons

    def prefers(self, call: Call) -> tuple[bool, Reason]:
        if call.q.device.type != "cuda":
            return False, "Triton's interpreter is for tests on the CPU (kernel='triton' forces it)"
        plain = not call.mods and not call.return_lse and call.dropout_p == 0.0
        if plain and call.form is Form.NONE:
            return False, "no mask: PyTorch's flash/cuDNN kernels are faster"
        if plain and call.form is Form.CAUSAL and call.scale > 0.0:
            return False, "is_causal: PyTorch's flash/cuDNN kernels are faster"
        kept = call.prepared_at(self.block_size).kept
        return (
            True,
            f"block-sparse on CUDA, {kept:.0%} of blocks kept; the mask is read as data "
            "(no dense mask, no compile per mask)",
        )

    supports_backward_part = True

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, lse = triton_attention(call)
        return out, lse if call.return_lse else None

    def backward_part(
        self, call: Call, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, grad_lse: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # its backward takes delta = rowsum(grad_out * out) from the output it is given: with the
        # merged output and lse, that is the gradient of this part of the keys
        s = call.shapes
        lead = (1,) * (4 - s.rank)
        q4, k4, v4 = (t.reshape(*lead, *t.shape).contiguous() for t in (call.q, call.k, call.v))
        args = _Args(call, q4, k4, v4)
        return _backward(args, q4, k4, v4, out.to(q4.dtype), lse.float(), grad_out, grad_lse)
