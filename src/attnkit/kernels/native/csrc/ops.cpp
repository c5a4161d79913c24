// attnkit's native CPU attention engine: block-sparse flash attention, forward and backward,
// registered as PyTorch operators:
//
//   torch.ops.attnkit.native_forward(q, k, v, kv_num, kv_indices, tile_ids, bits, kv_limit, band,
//                                    block_q, block_k, scale, softcap) -> (out, lse)
//   torch.ops.attnkit.native_backward(grad_out, grad_lse, q, k, v, out, lse, <the plan as above>,
//                                     block_q, block_k, scale, softcap, delta_from_out, band_grad)
//                                     -> (dq, dk, dv, dband)
//   torch.ops.attnkit.native_stats(q, k, <the plan>, sinks, qpos, kpos, block_q, block_k, scale, softcap,
//                                  sink_tokens, topk) -> [lse, entropy, max_weight, argmax, sink_mass,
//                                  mean_distance, received, topk_weights, topk_keys]
//   torch.ops.attnkit.native_relevance(q, k, v, <the plan>, sinks, lse, d_out, r, head_weights, block_q,
//                                      block_k, scale, softcap) -> out (B, R, Lk) float32: the gradient rule's
//                                      sum_i r[b, :, i] sum_h w_h max(0, (dO V^T) exp(s - lse)), or
//                                      without d_out the weights' sum_i r[b, :, i] sum_h w_h exp(s - lse)
//   torch.ops.attnkit.native_predicate(program, inputs, tables, shape, mode) -> a mask predicate's program
//                                      evaluated over many pairs (predicate.h; attnkit.masks._program)
//
// Built once per machine by attnkit/kernels/native/build.py (the compiler found on the machine, -O3
// -march=native, against the libtorch that is running: at::parallel_for shares PyTorch's threads)
// and loaded with torch.ops.load_library; the fake (meta) and autograd registrations of the
// forward are in build.py. Every argument is checked here (TORCH_CHECK), so a bad call raises
// a RuntimeError naming the argument instead of reading out of bounds.
//
// It walks a PreparedMask's block lists (kv_num, kv_indices and the partial blocks' element bits),
// computes only the blocks a mask keeps, skips the 32-row parts of partial blocks that keep
// nothing, and applies the mask, soft-capping and a bias of kv - q (ALiBi, T5's relative bias)
// inside its tile loop. Softmax statistics and sums are float32; float32 inputs are read in
// place, bfloat16 and float16 inputs one tile at a time. On CPUs with AVX512-BF16, bfloat16
// inputs take Q K^T and P V as bfloat16 dot products with float32 sums (vdpbf16ps), as PyTorch's
// own CPU flash attention does with its bfloat16 GEMMs; elsewhere their tiles are widened to float32.
//
// A call of at most 8 queries (decoding) takes a row path instead: one dot product per score,
// each key read once for the query heads of its group (see ForwardFew).
//
// Layout: the scores of one key block against SB query rows are kept key-major, S^T (keys x SB),
// so K and V are the broadcast operand of one register-blocked micro-kernel and the online
// softmax is vector arithmetic across the SB rows (no horizontal reductions).
//
// Shapes (elements):
//   q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), out (B, Hq, Lq, Dv) in q's dtype,
//   lse (B, Hq, Lq) float32: -inf for a query that sees no key, NaN where a score it sees is NaN.
// Plan (bq x bk blocks; Bm, Hm are 1 or B, Hq):
//   kv_num (Bm, Hm, nq) int32, kv_indices (Bm, Hm, nq, nk) int32 (kept blocks first),
//   tile_ids (Bm, Hm, nq, nk) int32 (-1: a full block, else a tile of bits),
//   bits (T, bk, bq / 8) uint8: key-major, bit r % 8 of byte r / 8 of key c's row is query r;
//   1 = may attend. kv_limit (Bl,) int64 or None: keys from kv_limit[b] on are hidden (never read).
//   band (Hb, Lq + Lk - 1) float32 or None: bias(kv - q) of head h at band[h, kv - q + Lq - 1].
//
// Equivalent PyTorch code (forward):
//   s = (q @ k.transpose(-2, -1)) * scale; s = softcap * tanh(s / softcap); s = s + bias(kv - q)
//   s = s.masked_fill(~mask, -inf); lse = s.logsumexp(-1); out = softmax(s) @ v  (0 where lse = -inf)
//
// Stages, one header each, compiled as this one translation unit: vec.h (vectors), gemm.h (the
// float32 micro-kernel), amx.h (bfloat16 products), plan.h (a call, its plan and steps), forward.h,
// bf16.h (the bfloat16 forward and its backward scores), decode.h (few rows), stats.h, relevance.h,
// backward.h, predicate.h and predicate_call.h (mask predicates).

#include <torch/library.h>

#include "backward.h"
#include "bf16.h"
#include "decode.h"
#include "forward.h"
#include "plan.h"
#include "predicate_call.h"
#include "relevance.h"
#include "stats.h"
#include "vec.h"

// The interface version build.py checks before it trusts a build (its VERSION).
#define ATTNKIT_NATIVE_INTERFACE 11

namespace {

// ---- the operators: every argument checked, then one parallel run ---------------------------

const char* dtype_name(at::ScalarType t) {  // as torch names them
    switch (t) {
        case at::kFloat: return "torch.float32";
        case at::kBFloat16: return "torch.bfloat16";
        case at::kHalf: return "torch.float16";
        case at::kDouble: return "torch.float64";
        case at::kInt: return "torch.int32";
        case at::kLong: return "torch.int64";
        case at::kByte: return "torch.uint8";
        default: return c10::toString(t);
    }
}

// q/k/v-like: 4-D CPU with the call's dtype; made unit-stride in the last dimension when it is not.
at::Tensor rows_contiguous(const at::Tensor& t, const char* name, at::ScalarType dtype) {
    TORCH_CHECK(t.device().is_cpu(), "attnkit.native: ", name, " must be on the CPU, but is on ", t.device());
    TORCH_CHECK(t.dim() == 4, "attnkit.native: ", name, " must be 4-D (B, H, L, X), but has shape ", t.sizes());
    TORCH_CHECK(t.scalar_type() == dtype, "attnkit.native: ", name, " must be ", dtype_name(dtype), " like q, but is ",
                dtype_name(t.scalar_type()));
    return t.stride(3) == 1 || t.size(3) <= 1 ? t : t.contiguous();
}

at::Tensor index_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef shape) {
    TORCH_CHECK(t.device().is_cpu(), "attnkit.native: ", name, " must be on the CPU, but is on ", t.device());
    TORCH_CHECK(t.scalar_type() == dtype, "attnkit.native: ", name, " must be ", dtype_name(dtype), ", but is ",
                dtype_name(t.scalar_type()));
    TORCH_CHECK(t.sizes() == shape, "attnkit.native: ", name, " must have shape ", shape, ", but has ", t.sizes());
    return t.contiguous();
}

// The problem of one call, with the plan checked entry by entry (indices in range), and the
// tensors it keeps alive (contiguous copies, the reversed band).
struct Checked {
    Problem pb{};
    at::Tensor q, k, v, kv_num, kv_idx, tile_ids, bits, kv_limit, band_rev;
};

Checked check_call(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& kv_num_,
                   const at::Tensor& kv_idx_, const at::Tensor& tile_ids_, const at::Tensor& bits_,
                   const std::optional<at::Tensor>& kv_limit_, const std::optional<at::Tensor>& band_,
                   int64_t block_q, int64_t block_k, double scale, double softcap) {
    Checked c;
    const at::ScalarType dtype = q_.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                "attnkit.native: q must be float32, bfloat16 or float16, but is ", dtype_name(dtype));
    c.q = rows_contiguous(q_, "q", dtype);
    c.k = rows_contiguous(k_, "k", dtype);
    c.v = rows_contiguous(v_, "v", dtype);
    Problem& pb = c.pb;
    pb.B = c.q.size(0), pb.Hq = c.q.size(1), pb.Lq = c.q.size(2), pb.D = c.q.size(3);
    pb.Hkv = c.k.size(1), pb.Lk = c.k.size(2), pb.Dv = c.v.size(3);
    TORCH_CHECK(c.k.size(0) == pb.B && c.v.size(0) == pb.B, "attnkit.native: q, k and v must have one batch size, got ",
                pb.B, ", ", c.k.size(0), " and ", c.v.size(0));
    TORCH_CHECK(pb.Hkv > 0 && pb.Hq % pb.Hkv == 0 && c.v.size(1) == pb.Hkv,
                "attnkit.native: Hq must be a multiple of Hkv and v must have Hkv heads, but got Hq=", pb.Hq,
                ", k heads ", pb.Hkv, ", v heads ", c.v.size(1));
    TORCH_CHECK(c.v.size(2) == pb.Lk, "attnkit.native: k and v must have one length, got ", pb.Lk, " and ",
                c.v.size(2));
    TORCH_CHECK(c.k.size(3) == pb.D && pb.D > 0 && pb.Dv > 0,
                "attnkit.native: q and k must have one head dim > 0 and v a head dim > 0, got D=", pb.D, ", k's ",
                c.k.size(3), ", Dv=", pb.Dv);
    pb.group = pb.Hq / pb.Hkv;
    TORCH_CHECK(block_q > 0 && block_q % SB == 0 && block_k > 0,
                "attnkit.native: block_q must be a positive multiple of 32 and block_k positive, got (", block_q, ", ",
                block_k, ")");
    pb.bq = block_q, pb.bk = block_k;
    pb.nq = (pb.Lq + block_q - 1) / block_q, pb.nk = (pb.Lk + block_k - 1) / block_k;
    TORCH_CHECK(kv_num_.dim() == 3, "attnkit.native: kv_num must be (Bm, Hm, nq), but has shape ", kv_num_.sizes());
    pb.Bm = kv_num_.size(0), pb.Hm = kv_num_.size(1);
    TORCH_CHECK((pb.Bm == 1 || pb.Bm == pb.B) && (pb.Hm == 1 || pb.Hm == pb.Hq),
                "attnkit.native: the plan's batch and head sizes must be 1 or the inputs' (B=", pb.B, ", Hq=", pb.Hq,
                "), got (", pb.Bm, ", ", pb.Hm, ")");
    c.kv_num = index_tensor(kv_num_, "kv_num", at::kInt, {pb.Bm, pb.Hm, pb.nq});
    c.kv_idx = index_tensor(kv_idx_, "kv_indices", at::kInt, {pb.Bm, pb.Hm, pb.nq, pb.nk});
    c.tile_ids = index_tensor(tile_ids_, "tile_ids", at::kInt, {pb.Bm, pb.Hm, pb.nq, pb.nk});
    TORCH_CHECK(bits_.dim() == 3 && bits_.size(0) >= 1, "attnkit.native: bits must be (T, block_k, block_q / 8), T >= 1, but has shape ",
                bits_.sizes());
    const int64_t tiles = bits_.size(0);
    c.bits = index_tensor(bits_, "bits", at::kByte, {tiles, block_k, block_q / 8});
    // every listed entry in range: a bad plan raises here instead of reading out of bounds
    const int32_t* num = c.kv_num.data_ptr<int32_t>();
    const int32_t* idx = c.kv_idx.data_ptr<int32_t>();
    const int32_t* tid = c.tile_ids.data_ptr<int32_t>();
    for (int64_t r = 0; r < pb.Bm * pb.Hm * pb.nq; ++r) {
        TORCH_CHECK(num[r] >= 0 && num[r] <= pb.nk, "attnkit.native: kv_num holds ", num[r], " at ", r,
                    ", outside [0, ", pb.nk, "]");
        for (int64_t i = 0; i < num[r]; ++i) {
            TORCH_CHECK(idx[r * pb.nk + i] >= 0 && idx[r * pb.nk + i] < pb.nk, "attnkit.native: kv_indices holds ",
                        idx[r * pb.nk + i], ", outside [0, ", pb.nk, ")");
            TORCH_CHECK(tid[r * pb.nk + i] >= -1 && tid[r * pb.nk + i] < tiles, "attnkit.native: tile_ids holds ",
                        tid[r * pb.nk + i], ", outside [-1, ", tiles, ")");
        }
    }
    pb.kv_num = num, pb.kv_idx = idx, pb.tile_ids = tid, pb.bits = c.bits.data_ptr<uint8_t>();
    pb.kv_limit = nullptr, pb.Bl = 0;
    if (kv_limit_.has_value()) {
        TORCH_CHECK(kv_limit_->dim() == 1 && (kv_limit_->size(0) == 1 || kv_limit_->size(0) == pb.B),
                    "attnkit.native: kv_limit must be (1,) or (B,), but has shape ", kv_limit_->sizes());
        c.kv_limit = index_tensor(*kv_limit_, "kv_limit", at::kLong, {kv_limit_->size(0)});
        pb.kv_limit = c.kv_limit.data_ptr<int64_t>(), pb.Bl = c.kv_limit.size(0);
    }
    TORCH_CHECK(std::isfinite(scale), "attnkit.native: scale must be finite, got ", scale);
    TORCH_CHECK(std::isfinite(softcap) && softcap >= 0.0, "attnkit.native: softcap must be finite and >= 0 (0: none), got ",
                softcap);
    pb.scale = float(scale), pb.softcap = float(softcap);
    TORCH_CHECK(softcap == 0.0 || pb.softcap > 0.0f, "attnkit.native: softcap ", softcap, " rounds to 0 in float32");
    const float mul = softcap > 0.0 ? float(scale / softcap) : 0.0f;
    pb.cap_mul = mul;
    pb.cap_split = softcap > 0.0 && (!std::isfinite(mul) || (mul != 0.0f && std::fabs(mul) < std::numeric_limits<float>::min()) ||
                                     (mul == 0.0f && scale != 0.0));
    pb.cap_fold = false;
    if (softcap > 0.0 && !pb.cap_split) {
        const double m2 = (scale / softcap) * (scale / softcap);
        pb.cap_w = float(double(TANH_SMALL) * TANH_SMALL / m2);
        bool normal = std::isnormal(pb.cap_w);
        double power = m2;
        for (int j = 0; j < 5; ++j, power *= m2) {
            pb.cap_q[j] = float(double(TANH_P[j]) * power);
            normal = normal && std::isnormal(pb.cap_q[j]);
        }
        pb.cap_fold = normal;
    }
    pb.band_rev = nullptr, pb.band_heads = 0;
    if (band_.has_value()) {
        const int64_t width = pb.Lq + pb.Lk - 1;
        TORCH_CHECK(band_->dim() == 2 && (band_->size(0) == 1 || band_->size(0) == pb.Hq) && band_->size(1) == width,
                    "attnkit.native: band must be (1 or Hq, Lq + Lk - 1) = (1 or ", pb.Hq, ", ", width,
                    "), but has shape ", band_->sizes());
        TORCH_CHECK(band_->scalar_type() == at::kFloat && band_->device().is_cpu(),
                    "attnkit.native: band must be float32 on the CPU");
        const at::Tensor band = band_->contiguous();
        pb.band_heads = band.size(0);
        c.band_rev = at::zeros({pb.band_heads, width + SB}, band.options());
        const float* src = band.data_ptr<float>();
        float* dst = c.band_rev.data_ptr<float>();
        for (int64_t h = 0; h < pb.band_heads; ++h)
            for (int64_t i = 0; i < width; ++i) dst[h * (width + SB) + i] = src[h * width + width - 1 - i];
        pb.band_rev = dst;
    }
    return c;
}


template <typename T>
void forward_typed(const Checked& c, at::Tensor& out, at::Tensor& lse) {
    const Problem& pb = c.pb;
    View<const T> q = view_of<const T>(c.q), k = view_of<const T>(c.k), v = view_of<const T>(c.v);
    if (pb.Lq <= FEW_ROWS) {
        int64_t heads = 1;
        const std::vector<Item> items = few_items(pb, heads);
        std::vector<int64_t> cost;  // the keys an item reads, at least one block (its fixed cost)
        for (const Item& it : items) cost.push_back(std::max(pb.key_end(it.b), pb.bk));
        run_items_static(items, cost, ForwardFew<T>{pb, q, k, v, view_of<T>(out), lse.data_ptr<float>(), heads});
        return;
    }
    if constexpr (std::is_same_v<T, c10::BFloat16>)
        if (forward_bf16(pb, c.q, c.k, c.v, c.tile_ids, out, lse)) return;
    run_items(forward_items(pb), Forward<T>{pb, q, k, v, view_of<T>(out), lse.data_ptr<float>()});
}

std::tuple<at::Tensor, at::Tensor> native_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& kv_num, const at::Tensor& kv_indices,
                                                  const at::Tensor& tile_ids, const at::Tensor& bits,
                                                  const std::optional<at::Tensor>& kv_limit,
                                                  const std::optional<at::Tensor>& band, int64_t block_q,
                                                  int64_t block_k, double scale, double softcap) {
    Checked c = check_call(q, k, v, kv_num, kv_indices, tile_ids, bits, kv_limit, band, block_q, block_k, scale, softcap);
    const Problem& pb = c.pb;
    at::Tensor out = at::empty({pb.B, pb.Hq, pb.Lq, pb.Dv}, c.q.options());
    at::Tensor lse = at::empty({pb.B, pb.Hq, pb.Lq}, c.q.options().dtype(at::kFloat));
    if (pb.Lq == 0) return {out, lse};
    switch (c.q.scalar_type()) {
        case at::kFloat: forward_typed<float>(c, out, lse); break;
        case at::kBFloat16: forward_typed<c10::BFloat16>(c, out, lse); break;
        default: forward_typed<c10::Half>(c, out, lse); break;
    }
    return {out, lse};
}

template <typename T>
void backward_typed(Checked& c, const at::Tensor& go, const at::Tensor& of, const at::Tensor& lse,
                    const std::optional<at::Tensor>& gl, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                    at::Tensor& dband) {
    Problem& pb = c.pb;
    const int64_t threads = at::get_num_threads();
    pb.chunks = std::max<int64_t>(1, std::min<int64_t>(pb.nq, (2 * threads + pb.B * pb.Hkv - 1) / (pb.B * pb.Hkv)));
    pb.Dp = round_up(pb.D, W), pb.Dvp = round_up(pb.Dv, W);
    const int64_t rows = pb.nk * pb.bk;
    at::Tensor dk_acc = at::zeros({pb.B, pb.Hkv, pb.chunks, rows, pb.Dp}, c.q.options().dtype(at::kFloat));
    at::Tensor dv_acc = at::zeros({pb.B, pb.Hkv, pb.chunks, rows, pb.Dvp}, c.q.options().dtype(at::kFloat));
    at::Tensor kt, k_finite;  // what the products may keep for the call (bf16.h: K^T)
    Backward<T> work{pb,
                     view_of<const T>(c.q),
                     view_of<const T>(c.k),
                     view_of<const T>(c.v),
                     view_of<const T>(go),
                     view_of<const T>(of),
                     lse.data_ptr<float>(),
                     gl.has_value() ? gl->data_ptr<float>() : nullptr,
                     dq.data_ptr<T>(),
                     dk_acc.data_ptr<float>(),
                     dv_acc.data_ptr<float>(),
                     StepGrads<T>::make(c.k, c.tile_ids, kt, k_finite)};
    const auto states = run_items(backward_items(pb), work);
    if (pb.band_grad) {  // the threads' sums, back in the band's own order
        const int64_t width = pb.Lq + pb.Lk - 1;
        float* g = dband.data_ptr<float>();
        for (const auto& state : states) {
            if (state.gband.empty()) continue;
            for (int64_t hb = 0; hb < pb.band_heads; ++hb)
                for (int64_t i = 0; i < width; ++i) g[hb * width + i] += state.gband[hb * (width + SB) + width - 1 - i];
        }
    }
    // dK, dV: the chunks' sums, in the inputs' dtype
    const float* ka = dk_acc.data_ptr<float>();
    const float* va = dv_acc.data_ptr<float>();
    T* dkp = dk.data_ptr<T>();
    T* dvp = dv.data_ptr<T>();
    at::parallel_for(0, pb.B * pb.Hkv, 1, [&](int64_t begin, int64_t end) {
        Buffer<> row;
        float* sum = row.get(std::max(pb.Dp, pb.Dvp));
        // one key's row of the chunks' sums (the first chunk's own row where there is one chunk)
        auto summed = [&](const float* acc, int64_t bh, int64_t key, int64_t width) -> const float* {
            const float* first = acc + (bh * pb.chunks * rows + key) * width;
            if (pb.chunks == 1) return first;
            std::memcpy(sum, first, width * sizeof(float));
            for (int64_t ch = 1; ch < pb.chunks; ++ch) {
                const float* part = first + ch * rows * width;
                for (int64_t d = 0; d < width; d += W) store(sum + d, load(sum + d) + load(part + d));
            }
            return sum;
        };
        for (int64_t bh = begin; bh < end; ++bh)
            for (int64_t key = 0; key < pb.Lk; ++key) {
                narrow_row(summed(ka, bh, key, pb.Dp), pb.D, dkp + (bh * pb.Lk + key) * pb.D);
                narrow_row(summed(va, bh, key, pb.Dvp), pb.Dv, dvp + (bh * pb.Lk + key) * pb.Dv);
            }
    });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> native_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& kv_num,
    const at::Tensor& kv_indices, const at::Tensor& tile_ids, const at::Tensor& bits,
    const std::optional<at::Tensor>& kv_limit, const std::optional<at::Tensor>& band, int64_t block_q, int64_t block_k,
    double scale, double softcap, bool delta_from_out, bool band_grad) {
    Checked c = check_call(q, k, v, kv_num, kv_indices, tile_ids, bits, kv_limit, band, block_q, block_k, scale, softcap);
    Problem& pb = c.pb;
    pb.delta_from_out = delta_from_out;
    TORCH_CHECK(!band_grad || band.has_value(), "attnkit.native: band_grad needs a band");
    pb.band_grad = band_grad;
    at::Tensor dband = band_grad ? at::zeros({pb.band_heads, pb.Lq + pb.Lk - 1}, c.q.options().dtype(at::kFloat))
                                 : at::zeros({0}, c.q.options().dtype(at::kFloat));
    const at::ScalarType dtype = c.q.scalar_type();
    const at::Tensor go = rows_contiguous(grad_out, "grad_out", dtype);
    const at::Tensor of = rows_contiguous(out, "out", dtype);
    for (const at::Tensor* t : {&go, &of})
        TORCH_CHECK(t->sizes() == at::IntArrayRef({pb.B, pb.Hq, pb.Lq, pb.Dv}), "attnkit.native: grad_out and out must be (B, Hq, Lq, Dv) = ",
                    at::IntArrayRef({pb.B, pb.Hq, pb.Lq, pb.Dv}), ", but one has shape ", t->sizes());
    const at::Tensor l = index_tensor(lse, "lse", at::kFloat, {pb.B, pb.Hq, pb.Lq});
    std::optional<at::Tensor> gl;
    if (grad_lse.has_value()) gl = index_tensor(*grad_lse, "grad_lse", at::kFloat, {pb.B, pb.Hq, pb.Lq});
    at::Tensor dq = at::empty({pb.B, pb.Hq, pb.Lq, pb.D}, c.q.options());
    at::Tensor dk = at::empty({pb.B, pb.Hkv, pb.Lk, pb.D}, c.q.options());
    at::Tensor dv = at::empty({pb.B, pb.Hkv, pb.Lk, pb.Dv}, c.q.options());
    if (pb.Lq == 0 || pb.Lk == 0) {
        dq.zero_(), dk.zero_(), dv.zero_();
        return {dq, dk, dv, dband};
    }
    switch (dtype) {
        case at::kFloat: backward_typed<float>(c, go, of, l, gl, dq, dk, dv, dband); break;
        case at::kBFloat16: backward_typed<c10::BFloat16>(c, go, of, l, gl, dq, dk, dv, dband); break;
        default: backward_typed<c10::Half>(c, go, of, l, gl, dq, dk, dv, dband); break;
    }
    return {dq, dk, dv, dband};
}

std::vector<at::Tensor> native_stats(const at::Tensor& q, const at::Tensor& k, const at::Tensor& kv_num,
                                     const at::Tensor& kv_indices, const at::Tensor& tile_ids, const at::Tensor& bits,
                                     const std::optional<at::Tensor>& kv_limit, const std::optional<at::Tensor>& band,
                                     const std::optional<at::Tensor>& sinks, const at::Tensor& qpos,
                                     const at::Tensor& kpos, int64_t block_q, int64_t block_k, double scale,
                                     double softcap, int64_t sink_tokens, int64_t topk) {
    Checked c = check_call(q, k, k, kv_num, kv_indices, tile_ids, bits, kv_limit, band, block_q, block_k, scale, softcap);
    const Problem& pb = c.pb;
    TORCH_CHECK(sink_tokens >= 0 && topk >= 0, "attnkit.native: sink_tokens and topk must be >= 0, got ", sink_tokens,
                " and ", topk);
    TORCH_CHECK(pb.Lk <= std::numeric_limits<int32_t>::max(), "attnkit.native: the statistics take at most 2^31 - 1 keys, got ",
                pb.Lk);
    auto positions = [&](const at::Tensor& t, const char* name, int64_t len) {
        TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 &&
                        (t.size(0) == 1 || t.size(0) == pb.B) && t.size(1) == len,
                    "attnkit.native: ", name, " must be float32 (1 or B, ", len, ") on the CPU, but has shape ",
                    t.sizes(), " and dtype ", dtype_name(t.scalar_type()));
        return t.contiguous();
    };
    const at::Tensor qp = positions(qpos, "qpos", pb.Lq), kp = positions(kpos, "kpos", pb.Lk);
    at::Tensor sk;
    if (sinks.has_value()) sk = index_tensor(*sinks, "sinks", at::kFloat, {pb.Hq});
    const auto f32 = c.q.options().dtype(at::kFloat), i64 = c.q.options().dtype(at::kLong);
    auto rows = [&](c10::TensorOptions options) { return at::empty({pb.B, pb.Hq, pb.Lq}, options); };
    at::Tensor lse = rows(f32), entropy = rows(f32), max_weight = rows(f32), sink_mass = rows(f32), distance = rows(f32);
    at::Tensor argmax = rows(i64);
    at::Tensor received = at::zeros({pb.B, pb.Hq, pb.Lk}, f32);
    at::Tensor topk_w = at::zeros({pb.B, pb.Hq, pb.Lq, topk}, f32), topk_i = at::empty({pb.B, pb.Hq, pb.Lq, topk}, i64).fill_(-1);
    if (pb.Lq > 0) {
        Stats st{lse.data_ptr<float>(), entropy.data_ptr<float>(), max_weight.data_ptr<float>(),
                 sink_mass.data_ptr<float>(), distance.data_ptr<float>(), topk_w.data_ptr<float>(),
                 argmax.data_ptr<int64_t>(), topk_i.data_ptr<int64_t>(), qp.data_ptr<float>(), kp.data_ptr<float>(),
                 sk.defined() ? sk.data_ptr<float>() : nullptr, qp.size(0), kp.size(0), sink_tokens, topk};
        auto run = [&](auto tag) {
            using T = decltype(tag);
            const auto states = run_items(forward_items(pb), StatsWork<T>{pb, view_of<const T>(c.q), view_of<const T>(c.k), st});
            float* out = received.data_ptr<float>();
            at::parallel_for(0, pb.B * pb.Hq * pb.Lk, 4096, [&](int64_t begin, int64_t end) {
                for (const auto& state : states)
                    if (!state.received.empty())
                        for (int64_t i = begin; i < end; ++i) out[i] += state.received[i];
            });
        };
        switch (c.q.scalar_type()) {
            case at::kFloat: run(float{}); break;
            case at::kBFloat16: run(c10::BFloat16{}); break;
            default: run(c10::Half{}); break;
        }
    }
    return {lse, entropy, max_weight, argmax, sink_mass, distance, received, topk_w, topk_i};
}

at::Tensor native_relevance(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_num,
                            const at::Tensor& kv_indices, const at::Tensor& tile_ids, const at::Tensor& bits,
                            const std::optional<at::Tensor>& kv_limit, const std::optional<at::Tensor>& band,
                            const std::optional<at::Tensor>& sinks, const at::Tensor& lse,
                            const std::optional<at::Tensor>& d_out, const at::Tensor& r,
                            const at::Tensor& head_weights, int64_t block_q, int64_t block_k, double scale,
                            double softcap) {
    Checked c = check_call(q, k, v, kv_num, kv_indices, tile_ids, bits, kv_limit, band, block_q, block_k, scale, softcap);
    const Problem& pb = c.pb;
    TORCH_CHECK(r.dim() == 3 && r.size(0) == pb.B && r.size(2) == pb.Lq,
                "attnkit.native: r must have shape (B, R, Lq) = (", pb.B, ", R, ", pb.Lq, "), but has ", r.sizes());
    const int64_t R = r.size(1);
    const at::Tensor lse_c = index_tensor(lse, "lse", at::kFloat, {pb.B, pb.Hq, pb.Lq});
    at::Tensor d_c;
    if (d_out.has_value()) d_c = index_tensor(*d_out, "d_out", at::kFloat, {pb.B, pb.Hq, pb.Lq, pb.Dv});
    const at::Tensor r_c = index_tensor(r, "r", at::kFloat, {pb.B, R, pb.Lq});
    const at::Tensor w_c = index_tensor(head_weights, "head_weights", at::kFloat, {pb.Hq});
    at::Tensor sk;
    if (sinks.has_value()) sk = index_tensor(*sinks, "sinks", at::kFloat, {pb.Hq});
    at::Tensor out = at::zeros({pb.B, R, pb.Lk}, c.q.options().dtype(at::kFloat));
    if (pb.Lq > 0 && pb.Lk > 0 && R > 0) {
        Relevance rl{lse_c.data_ptr<float>(), d_c.defined() ? d_c.data_ptr<float>() : nullptr, r_c.data_ptr<float>(),
                     w_c.data_ptr<float>(), sk.defined() ? sk.data_ptr<float>() : nullptr, R};
        auto run = [&](auto tag) {
            using T = decltype(tag);
            const auto states = run_items(forward_items(pb), RelevanceWork<T>{pb, view_of<const T>(c.q),
                                                                             view_of<const T>(c.k), view_of<const T>(c.v), rl});
            float* dst = out.data_ptr<float>();
            at::parallel_for(0, pb.B * R * pb.Lk, 4096, [&](int64_t begin, int64_t end) {
                for (const auto& state : states)
                    if (!state.out.empty())
                        for (int64_t i = begin; i < end; ++i) dst[i] += state.out[i];
            });
        };
        switch (c.q.scalar_type()) {
            case at::kFloat: run(float{}); break;
            case at::kBFloat16: run(c10::BFloat16{}); break;
            default: run(c10::Half{}); break;
        }
    }
    return out;
}

std::string native_info() {
    return std::string(ISA) + " (" + std::to_string(W) + " floats a vector); " + bf16_info();
}

// The sizes Python decides with, as JSON (attnkit.kernels.native.build.constants).
std::string native_constants() {
    return "{\"FEW_ROWS\": " + std::to_string(FEW_ROWS) + ", \"ROWS\": " + std::to_string(SB) + "}";
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit, m) {
    m.set_python_module("attnkit.kernels.native.build");  // the fake and autograd registrations
    m.def(
        "native_forward(Tensor q, Tensor k, Tensor v, Tensor kv_num, Tensor kv_indices, Tensor tile_ids, "
        "Tensor bits, Tensor? kv_limit, Tensor? band, int block_q, int block_k, float scale, float softcap) "
        "-> (Tensor, Tensor)");
    m.def(
        "native_backward(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor kv_num, Tensor kv_indices, Tensor tile_ids, Tensor bits, Tensor? kv_limit, Tensor? band, "
        "int block_q, int block_k, float scale, float softcap, bool delta_from_out, bool band_grad) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
    m.def(
        "native_stats(Tensor q, Tensor k, Tensor kv_num, Tensor kv_indices, Tensor tile_ids, Tensor bits, "
        "Tensor? kv_limit, Tensor? band, Tensor? sinks, Tensor qpos, Tensor kpos, int block_q, int block_k, "
        "float scale, float softcap, int sink_tokens, int topk) -> Tensor[]");
    m.def(
        "native_relevance(Tensor q, Tensor k, Tensor v, Tensor kv_num, Tensor kv_indices, Tensor tile_ids, "
        "Tensor bits, Tensor? kv_limit, Tensor? band, Tensor? sinks, Tensor lse, Tensor? d_out, Tensor r, "
        "Tensor head_weights, "
        "int block_q, int block_k, float scale, float softcap) -> Tensor");
    m.def("native_predicate(Tensor program, Tensor[] inputs, Tensor[] tables, int[] shape, int mode) -> Tensor");
    m.def("native_interface() -> int", []() -> int64_t { return ATTNKIT_NATIVE_INTERFACE; });
    m.def("native_info() -> str", []() -> std::string { return native_info(); });
    m.def("native_constants() -> str", []() -> std::string { return native_constants(); });
}

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
    m.impl("native_forward", &native_forward);
    m.impl("native_backward", &native_backward);
    m.impl("native_stats", &native_stats);
    m.impl("native_relevance", &native_relevance);
    m.impl("native_predicate", &native_predicate);
}