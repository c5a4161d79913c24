// attnkit native engine: the operator that runs a mask predicate's program (predicate.h) over many
// pairs: its checks, the choice of int32 or int64 lanes, and the threads.
#pragma once

#include "predicate.h"

namespace {

// Whether every value of every instruction lies in int32 (the lanes may be int32): bounds per
// slot from the inputs' and tables' ranges, each operation's exact result (before its dtype's
// wrap) bounded in 128 bits; an operation whose result no bound holds (a division by a range
// holding 0, a shift by a wide range) keeps the int64 lanes.
bool fits_int32(const PredProgram& p) {
    using W = __int128;
    const W lo32 = INT32_MIN, hi32 = INT32_MAX, huge = W{1} << 100;
    std::vector<W> lo(p.n), hi(p.n);
    for (const PredTable& t : p.tables)  // int32 lanes index a table of fewer than 2^31 entries
        if (static_cast<W>(t.size[0]) * t.size[1] * t.size[2] > hi32) return false;
    auto span = [](W x) {  // the bits that hold |x| and its sign: [-2^k, 2^k - 1]
        W k = 1;
        while (k <= x || -k > x) k <<= 1;
        return k;
    };
    for (int64_t i = 0; i < p.n; ++i) {
        const int64_t* c = p.ins(i);
        const int64_t op = c[0], dt = c[1];
        const W al = c[2] >= 0 && op != P_INPUT && op != P_CONST && op != P_LOAD ? lo[c[2]] : 0;
        const W ah = c[2] >= 0 && op != P_INPUT && op != P_CONST && op != P_LOAD ? hi[c[2]] : 0;
        const W bl = c[3] >= 0 && op != P_LOAD ? lo[c[3]] : 0, bh = c[3] >= 0 && op != P_LOAD ? hi[c[3]] : 0;
        W l = 0, h = 0;
        switch (op) {
            case P_INPUT: l = p.inputs[c[2]].least, h = p.inputs[c[2]].most; break;
            case P_CONST: l = h = c[2]; break;
            case P_LOAD: l = p.tables[c[2]].least, h = p.tables[c[2]].most; break;
            case P_ADD: l = al + bl, h = ah + bh; break;
            case P_SUB: l = al - bh, h = ah - bl; break;
            case P_MUL: {
                const W v[4] = {al * bl, al * bh, ah * bl, ah * bh};
                l = *std::min_element(v, v + 4), h = *std::max_element(v, v + 4);
                break;
            }
            case P_NEG: l = -ah, h = -al; break;
            case P_ABS: l = al >= 0 ? al : ah <= 0 ? -ah : 0, h = std::max(-al, ah); break;
            case P_SIGN: l = -1, h = 1; break;
            case P_FLOORDIV: case P_TRUNCDIV: {
                if (bl <= 0 && bh >= 0) return false;
                const W v[4] = {al / bl, al / bh, ah / bl, ah / bh};
                l = *std::min_element(v, v + 4) - 1, h = *std::max_element(v, v + 4) + 1;
                break;
            }
            case P_REMAINDER: case P_FMOD: {
                const W d = std::max(bl < 0 ? -bl : bl, bh < 0 ? -bh : bh);
                l = -d, h = d;
                break;
            }
            case P_AND: case P_OR: case P_XOR: case P_NOT: {
                const W k = std::max({span(al), span(ah), span(bl), span(bh)});
                l = (al >= 0 && bl >= 0 && op != P_NOT) ? 0 : -k, h = k - 1;
                break;
            }
            case P_SHL: {
                if (bl < 0 || bh > 62) return false;
                const W scale = W{1} << static_cast<int>(bh);
                l = std::min<W>({al, al * scale, 0}), h = std::max<W>({ah, ah * scale, 0});
                break;
            }
            case P_SHR: l = std::min<W>(al, -1), h = std::max<W>(ah, 0); break;
            case P_MIN: l = std::min(al, bl), h = std::min(ah, bh); break;
            case P_MAX: l = std::max(al, bl), h = std::max(ah, bh); break;
            case P_WHERE: l = std::min(bl, lo[c[4]]), h = std::max(bh, hi[c[4]]); break;
            case P_CAST: l = al, h = ah; break;
            default: l = 0, h = 1; break;  // comparisons and logic
        }
        if (l < -huge || h > huge || l < lo32 || h > hi32) return false;
        const int bits = pred_bits(dt);  // the dtype's wrap: where the bound leaves it, its whole range
        if (dt == T_BOOL) l = 0, h = 1;
        else if (bits < 64) {
            const W top = dt == T_U8 ? W{255} : (W{1} << (bits - 1)) - 1, bottom = dt == T_U8 ? W{0} : -(W{1} << (bits - 1));
            if (l < bottom || h > top) l = bottom, h = top;
        }
        lo[i] = l, hi[i] = h;
    }
    return true;
}


at::Tensor native_predicate(const at::Tensor& program, const std::vector<at::Tensor>& inputs,
                            const std::vector<at::Tensor>& tables, at::IntArrayRef shape, int64_t mode) {
    TORCH_CHECK(program.dim() == 2 && program.size(1) == 6 && program.scalar_type() == at::kLong &&
                    program.size(0) > 0,
                "attnkit.native: program must be (n, 6) int64 with n > 0, but has ", program.sizes(), " ",
                program.scalar_type());
    TORCH_CHECK(mode >= 0 && mode <= 2, "attnkit.native: mode must be 0, 1 or 2, not ", mode);
    TORCH_CHECK(shape.size() == 3 && shape[0] >= 0 && shape[1] >= 0 && shape[2] >= 0,
                "attnkit.native: the pairs' shape must be (T, X, Y), not ", shape);
    PredProgram p;
    const at::Tensor code = program.contiguous();
    p.n = code.size(0);
    p.code.assign(code.data_ptr<int64_t>(), code.data_ptr<int64_t>() + 6 * p.n);
    p.T = shape[0], p.X = shape[1], p.Y = shape[2];
    const int64_t T = p.T, X = p.X, Y = p.Y;
    at::Tensor out;
    if (mode == 0) out = at::empty({T, X, Y}, at::kBool);
    else if (mode == 1) out = at::zeros({T, X, (Y + 7) / 8}, at::kByte);
    else out = at::zeros({T}, at::kByte);
    std::vector<at::Tensor> views;
    for (const auto& in : inputs) {
        TORCH_CHECK(in.scalar_type() == at::kLong && in.device().is_cpu() && in.dim() <= 3,
                    "attnkit.native: predicate inputs must be int64 CPU tensors of at most 3 dims, not ", in.sizes(),
                    " ", in.scalar_type());
        views.push_back(in.expand(shape));  // raises where it does not broadcast to the pairs' shape
        const bool some = in.numel() > 0;
        p.inputs.push_back({views.back().data_ptr<int64_t>(), views.back().stride(0), views.back().stride(1),
                            views.back().stride(2), some ? in.min().item<int64_t>() : 0,
                            some ? in.max().item<int64_t>() : 0});
    }
    std::vector<at::Tensor> narrow;
    for (const auto& tb : tables) {
        TORCH_CHECK(tb.scalar_type() == at::kLong && tb.is_contiguous() && tb.dim() >= 1 && tb.dim() <= 3 &&
                        tb.device().is_cpu(),
                    "attnkit.native: predicate tables must be contiguous int64 CPU tensors with 1 to 3 dims, not ",
                    tb.sizes(), " on ", tb.device());
        const bool some = tb.numel() > 0;
        PredTable t{tb.data_ptr<int64_t>(), nullptr, tb.dim(), {1, 1, 1}, {0, 0, 0},
                    some ? tb.min().item<int64_t>() : 0, some ? tb.max().item<int64_t>() : 0};
        for (int64_t d = 0; d < tb.dim(); ++d) t.size[d] = tb.size(d), t.stride[d] = tb.stride(d);
        p.tables.push_back(t);
    }
    for (int64_t i = 0; i < p.n; ++i) {  // every operand an earlier slot, every op known
        const int64_t* c = p.ins(i);
        TORCH_CHECK(c[0] >= 0 && c[0] < P_COUNT && c[1] >= T_BOOL && c[1] <= T_I64,
                    "attnkit.native: instruction ", i, " has op ", c[0], " dtype ", c[1]);
        if (c[0] == P_INPUT) {
            TORCH_CHECK(c[2] >= 0 && c[2] < static_cast<int64_t>(inputs.size()), "attnkit.native: input ", c[2]);
        } else if (c[0] == P_LOAD) {
            TORCH_CHECK(c[2] >= 0 && c[2] < static_cast<int64_t>(tables.size()), "attnkit.native: table ", c[2]);
            for (int64_t d = 0; d < 3; ++d)
                TORCH_CHECK(d < p.tables[c[2]].dims ? (c[3 + d] >= 0 && c[3 + d] < i) : c[3 + d] == -1,
                            "attnkit.native: instruction ", i, " indexes with ", c[3 + d]);
        } else if (c[0] != P_CONST) {
            const int64_t used = c[0] == P_WHERE ? 3 : (c[0] == P_NEG || c[0] == P_ABS || c[0] == P_NOT ||
                                                         c[0] == P_LNOT || c[0] == P_CAST || c[0] == P_SIGN) ? 1 : 2;
            for (int64_t d = 0; d < 3; ++d)
                TORCH_CHECK(d < used ? (c[2 + d] >= 0 && c[2 + d] < i) : c[2 + d] == -1,
                            "attnkit.native: instruction ", i, " reads slot ", c[2 + d]);
        }
    }
    if (T == 0 || X == 0 || Y == 0) return out;
    const bool lanes32 = fits_int32(p);
    if (lanes32)
        for (size_t i = 0; i < tables.size(); ++i) {
            narrow.push_back(tables[i].to(at::kInt));
            p.tables[i].data32 = narrow.back().data_ptr<int32_t>();
        }
    // a tile's all / any stops at the first chunk that holds both: small chunks there
    const int64_t rows = std::max<int64_t>(1, (mode == 2 ? PRED_LANES / 8 : PRED_LANES) / Y);
    const int64_t chunks_per_tile = (X + rows - 1) / rows;
    std::vector<std::atomic<uint8_t>> seen(mode == 2 ? T : 0);
    for (auto& s : seen) s.store(0);
    std::atomic<int> failed{E_NONE};
    uint8_t* dst = static_cast<uint8_t*>(out.data_ptr());  // bool is one byte
    const int64_t grain = std::max<int64_t>(1, 16384 / (rows * Y));
    p.lower();
    auto evaluate = [&](auto lane) {
        using V = decltype(lane);
        at::parallel_for(0, T * chunks_per_tile, grain, [&](int64_t begin, int64_t end) {
            const int64_t lanes = rows * Y, Yl = Y, Xl = X;  // locals: byte stores may alias anything
            std::vector<V> regs(p.buffers * lanes);
            int64_t last_tile = -1;
            for (int64_t w = begin; w < end && failed.load(std::memory_order_relaxed) == E_NONE; ++w) {
                const int64_t t = w / chunks_per_tile, x0 = (w % chunks_per_tile) * rows, nx = std::min(rows, Xl - x0);
                if (mode == 2 && seen[t].load(std::memory_order_relaxed) == 3) continue;
                const int err = p.run<V>(t, x0, nx, regs.data(), lanes, t == last_tile);
                last_tile = t;
                if (err) { failed.store(err); break; }
                const V* res = regs.data() + p.result * lanes;
                if (mode == 0) {
                    uint8_t* o = dst + (t * Xl + x0) * Yl;
                    for (int64_t j = 0; j < nx * Yl; ++j) o[j] = res[j] != 0;
                } else if (mode == 1) {
                    const int64_t bytes = (Yl + 7) / 8, whole = Yl / 8;
                    for (int64_t x = 0; x < nx; ++x) {
                        uint8_t* o = dst + (t * Xl + x0 + x) * bytes;
                        const V* row = res + x * Yl;
                        for (int64_t k = 0; k < whole; ++k) o[k] = pack8(row + 8 * k);
                        for (int64_t y = 8 * whole; y < Yl; ++y) o[y >> 3] |= static_cast<uint8_t>((row[y] != 0) << (y & 7));
                    }
                } else {
                    uint8_t any_true = 0, any_false = 0;
                    for (int64_t j = 0; j < nx * Yl; ++j) any_true |= res[j] != 0, any_false |= res[j] == 0;
                    seen[t].fetch_or(static_cast<uint8_t>(any_true | (any_false << 1)), std::memory_order_relaxed);
                }
            }
        });
    };
    if (lanes32) evaluate(int32_t{});
    else evaluate(int64_t{});
    const int err = failed.load();
    TORCH_CHECK(err == E_NONE, "attnkit.native: the predicate program ",
                err & E_INDEX ? "indexed a table out of range" : err & E_ZERO ? "divided by zero" : "shifted by a negative amount",
                "; evaluate it with torch to see where");
    if (mode == 2)
        for (int64_t t = 0; t < T; ++t) dst[t] = seen[t].load();
    return out;
}

}  // namespace
