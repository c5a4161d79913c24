// attnkit native engine: a mask predicate's program evaluated pair by pair, vectorised and threaded.
#pragma once

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// ---- mask predicates as programs -------------------------------------------------------------
//
// attnkit.masks._program traces a from_fn predicate once (a TorchFunctionMode over one pair's
// index tensors) into straight-line code over integers and bools; this evaluates that code over
// many pairs at once, with no (tq, Lk) intermediates in memory: the pairs of a call are cut in
// chunks of whole rows, each chunk's values held in one small buffer per instruction (SSA: the
// instruction's index is its slot) and every instruction one loop over the chunk's lanes.
//
// program (n, 6) int64, one row per instruction: op, dtype, a, b, c, d. Values are int64 lanes
// wrapped after every instruction to the dtype torch computed in (dtype: 0 bool, 1 uint8, 2 int8,
// 3 int16, 4 int32, 5 int64), so integer overflow and casts wrap exactly as torch's do.
// Operands a..d are earlier instructions' slots, except for INPUT (a: which input), CONST (a: the
// value) and LOAD (a: which table; b, c, d: index slots, -1 where the table has fewer dims).
// inputs: int64 tensors that broadcast to shape (T, X, Y); the pairs are T x X x Y.
// tables: int64, contiguous, at most 3 dims (a captured tensor the predicate indexes).
// The last instruction is the result (a bool).
//
// Before it runs, each instruction's values are bounded from the inputs' and tables' ranges (an
// interval per slot); where every value of every instruction fits in int32 the lanes are int32 (twice
// the values per vector), else int64. Either way the values are the ones torch computes.
//
// mode 0: bool (T, X, Y); mode 1: the result packed along Y, uint8 (T, X, ceil(Y / 8)), bit y % 8 of
// byte y / 8 (a prepared mask's bits when Y is the queries); mode 2: uint8 (T,), bit 0 set where
// some pair of the tile is True and bit 1 where some is False (a tile stops being evaluated once it
// has both). An index outside a table, a division by zero or a shift outside [0, bits) raises: the
// caller evaluates the predicate with torch instead, which says what is wrong.

enum PredOp : int64_t {
    P_INPUT = 0, P_CONST, P_ADD, P_SUB, P_MUL, P_NEG, P_ABS, P_FLOORDIV, P_TRUNCDIV, P_REMAINDER, P_FMOD,
    P_EQ, P_NE, P_LT, P_LE, P_GT, P_GE, P_AND, P_OR, P_XOR, P_NOT, P_LNOT, P_SHL, P_SHR, P_MIN, P_MAX,
    P_WHERE, P_CAST, P_LOAD, P_LAND, P_LOR, P_LXOR, P_SIGN, P_COUNT
};

enum PredType : int64_t { T_BOOL = 0, T_U8, T_I8, T_I16, T_I32, T_I64 };

constexpr int64_t PRED_LANES = 2048;  // pairs a chunk holds (at least one whole row): the steps' own cost amortised

inline int pred_bits(int64_t dt) {
    switch (dt) {
        case T_BOOL: return 1;
        case T_U8: case T_I8: return 8;
        case T_I16: return 16;
        case T_I32: return 32;
        default: return 64;
    }
}

template <class V>
inline void pred_wrap(V* r, int64_t n, int64_t dt) {
    switch (dt) {
        case T_BOOL: for (int64_t j = 0; j < n; ++j) r[j] = r[j] != 0; break;
        case T_U8: for (int64_t j = 0; j < n; ++j) r[j] = static_cast<uint8_t>(r[j]); break;
        case T_I8: for (int64_t j = 0; j < n; ++j) r[j] = static_cast<int8_t>(r[j]); break;
        case T_I16: for (int64_t j = 0; j < n; ++j) r[j] = static_cast<int16_t>(r[j]); break;
        case T_I32: for (int64_t j = 0; j < n; ++j) r[j] = static_cast<int32_t>(r[j]); break;
        default: break;
    }
}

// eight values' "!= 0" as the bits of a byte (bit k: v[k])
inline uint8_t pack8(const int64_t* v) {
#if defined(__AVX512F__)
    const __m512i x = _mm512_loadu_si512(v);
    return static_cast<uint8_t>(_mm512_test_epi64_mask(x, x));
#elif defined(__AVX2__)
    const __m256i zero = _mm256_setzero_si256();
    const int lo = _mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpeq_epi64(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(v)), zero)));
    const int hi = _mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpeq_epi64(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(v + 4)), zero)));
    return static_cast<uint8_t>(~(lo | (hi << 4)));
#else
    uint8_t byte = 0;
    for (int bit = 0; bit < 8; ++bit) byte |= static_cast<uint8_t>((v[bit] != 0) << bit);
    return byte;
#endif
}

inline uint8_t pack8(const int32_t* v) {
#if defined(__AVX2__) || defined(__AVX512F__)
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
    const int zero = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(x, _mm256_setzero_si256())));
    return static_cast<uint8_t>(~zero);
#else
    uint8_t byte = 0;
    for (int bit = 0; bit < 8; ++bit) byte |= static_cast<uint8_t>((v[bit] != 0) << bit);
    return byte;
#endif
}

struct PredTable {
    const int64_t* data;
    const int32_t* data32;  // the same values as int32 (where the lanes are)
    int64_t dims, size[3], stride[3], least, most;
};

struct PredInput {
    const int64_t* data;
    int64_t s0, s1, s2, least, most;
};

enum PredError : int { E_NONE = 0, E_INDEX = 1, E_ZERO = 2, E_SHIFT = 4 };

// floor division of int64 (Python's //): C's truncation moved down where the signs differ
inline int64_t floor_div(int64_t a, int64_t b) {
    if (b == -1) return static_cast<int64_t>(0ull - static_cast<uint64_t>(a));  // INT64_MIN / -1 wraps
    const int64_t q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

inline int64_t floor_mod(int64_t a, int64_t b) {
    if (b == -1) return 0;
    const int64_t r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

struct PredProgram {
    std::vector<int64_t> code;  // (n, 6)
    int64_t n = 0;
    std::vector<PredInput> inputs;
    std::vector<PredTable> tables;
    int64_t T = 0, X = 0, Y = 0;

    const int64_t* ins(int64_t i) const { return code.data() + 6 * i; }

    // whether an instruction's int64 result may lie outside its dtype (comparisons and logic give 0 / 1)
    static bool needs_wrap(int64_t op, int64_t dt) {
        if (op == P_INPUT || op == P_CONST || op == P_LOAD || dt == T_I64) return false;
        const bool zero_one = (op >= P_EQ && op <= P_GE) || op == P_LNOT || op == P_LAND || op == P_LOR || op == P_LXOR;
        return !(zero_one || (dt == T_BOOL && (op == P_AND || op == P_OR || op == P_XOR || op == P_MIN ||
                                               op == P_MAX || op == P_WHERE || op == P_MUL)));
    }

    // Where each slot varies, as bits: 1 along the rows (x), 2 along a row (y); 0 once per tile, 3 per
    // pair. An operation varies where its operands do, so what depends on the rows alone (a table read
    // at the key, the key's coordinates) is computed once per row, and what depends on the position
    // along a row alone once per chunk, not once per pair.
    std::vector<int> level;

    int64_t size_at(int L, int64_t rows) const { return (L & 1 ? rows : 1) * (L & 2 ? Y : 1); }

    // The program as run: each instruction's operands at its level (a narrower operand widened by
    // an explicit step, once), and every value in one of a few buffers, reused once a value is
    // dead, so that a chunk's live values stay in the L1 cache.
    struct Step {
        int64_t op, dt;
        int L, from;         // the level computed at; WIDEN: the source's level
        int64_t raw;         // INPUT: which input; CONST: the value; LOAD: which table
        int64_t arg[3];      // operand buffers (-1: none)
        int kind[2];         // of a binary operation on pairs (L = 3): each operand's own level, read in place
        int64_t dst;         // the buffer written
        const int64_t* k;    // a constant divisor or shift, where the operand is one
    };
    static constexpr int64_t P_WIDEN = P_COUNT;
    std::vector<Step> steps;
    std::vector<uint8_t> per_tile;  // steps whose value depends on the tile alone (levels 0 and 2)
    int64_t buffers = 0;
    int64_t result = 0;  // the buffer holding the result, per pair

    void lower() {
        level.assign(n, 0);
        std::vector<int64_t> value(n, -1);          // slot -> virtual value at its own level
        std::vector<std::array<int64_t, 4>> wide(n, {-1, -1, -1, -1});
        std::vector<Step> virt;                      // dst: the virtual value defined
        auto widen = [&](int64_t slot, int L) -> int64_t {
            if (level[slot] == L) return value[slot];
            if (wide[slot][L] < 0) {
                virt.push_back({P_WIDEN, 5, L, level[slot], 0, {value[slot], -1, -1}, {L, L}, 0, nullptr});
                virt.back().dst = wide[slot][L] = static_cast<int64_t>(virt.size()) - 1;
            }
            return wide[slot][L];
        };
        for (int64_t i = 0; i < n; ++i) {
            const int64_t* c = ins(i);
            const int64_t op = c[0];
            const int first = op == P_LOAD ? 3 : 2;
            if (op == P_INPUT) {
                const PredInput& in = inputs[c[2]];
                level[i] = (in.s1 != 0 ? 1 : 0) | (in.s2 != 0 ? 2 : 0);
            } else if (op != P_CONST) {
                for (int d = first; d < 6; ++d)
                    if (c[d] >= 0) level[i] |= level[c[d]];
            }
            Step st{op, c[1], level[i], 0, (op == P_INPUT || op == P_CONST || op == P_LOAD) ? c[2] : 0,
                    {-1, -1, -1}, {level[i], level[i]}, 0, nullptr};
            const bool constant_divisor = (op == P_FLOORDIV || op == P_REMAINDER || op == P_TRUNCDIV || op == P_FMOD) &&
                                          ins(c[3])[0] == P_CONST && level[c[2]] == level[i];
            const bool in_place = (level[i] == 3 && broadcasts(op)) || constant_divisor;  // operands at their own level
            if (op != P_INPUT && op != P_CONST)
                for (int d = first; d < first + 3 && d < 6; ++d) {
                    if (c[d] < 0) continue;
                    st.arg[d - first] = in_place ? value[c[d]] : widen(c[d], level[i]);
                    if (in_place) st.kind[d - first] = level[c[d]];
                }
            if ((op == P_FLOORDIV || op == P_REMAINDER || op == P_TRUNCDIV || op == P_FMOD) && ins(c[3])[0] == P_CONST)
                st.k = &ins(c[3])[2];
            virt.push_back(st);
            virt.back().dst = value[i] = static_cast<int64_t>(virt.size()) - 1;
        }
        const int64_t out = widen(n - 1, 3);
        // buffers: a value's buffer is free after its last reader (never shared with the step's own operands)
        std::vector<int64_t> last(virt.size(), -1);
        for (int64_t s = 0; s < static_cast<int64_t>(virt.size()); ++s)
            for (int64_t a : virt[s].arg)
                if (a >= 0) last[a] = s;
        last[out] = static_cast<int64_t>(virt.size());
        std::vector<int64_t> phys(virt.size(), -1), free;
        steps = virt;
        per_tile.assign(virt.size(), 0);
        for (int64_t s = 0; s < static_cast<int64_t>(virt.size()); ++s) {
            // a value of the tile alone keeps its buffer for the whole tile (the chunks after the
            // first of a tile skip its step), so it is never freed
            per_tile[s] = (virt[s].L & 1) == 0;
            if (per_tile[s]) last[s] = static_cast<int64_t>(virt.size());
            int64_t b;
            if (!free.empty() && !per_tile[s]) b = free.back(), free.pop_back();  // a tile's value: its own buffer
            else b = buffers++;
            phys[s] = b;
            steps[s].dst = b;
            for (int d = 0; d < 3; ++d) steps[s].arg[d] = virt[s].arg[d] >= 0 ? phys[virt[s].arg[d]] : -1;
            for (int d = 0; d < 3; ++d) {
                const int64_t a = virt[s].arg[d];
                if (a >= 0 && last[a] == s && std::find(free.begin(), free.end(), phys[a]) == free.end())
                    free.push_back(phys[a]);
            }
            if (last[s] < 0) free.push_back(b);  // never read (a value only widened is read by the widening)
        }
        result = phys[out];
    }

    // operations of two operands that read a narrower operand in place (no widening pass)
    static bool broadcasts(int64_t op) {
        return op == P_ADD || op == P_SUB || op == P_MUL || (op >= P_EQ && op <= P_XOR) || op == P_MIN ||
               op == P_MAX || op == P_LAND || op == P_LOR || op == P_LXOR || op == P_SHL || op == P_SHR;
    }

    // r = f(a, b) for a binary operation: over m values where both are at the step's level, else
    // over the chunk's pairs with each operand read at its own level (kind: 0 one value, 1 one per
    // row, 2 one per position along a row, 3 one per pair)
    template <class V, class F>
    void binary(const Step& st, V* r, const V* a, const V* b, int64_t rows, int64_t m, F f) const {
        const int ka = st.kind[0], kb = st.kind[1];
        const int64_t Y = this->Y;  // a local: stores through r cannot change it (the loops vectorise)
        if (st.L != 3 || (ka == 3 && kb == 3)) {
            for (int64_t j = 0; j < m; ++j) r[j] = f(a[j], b[j]);
            return;
        }
        for (int64_t x = 0; x < rows; ++x) {
            V* o = r + x * Y;
            const V* pa = ka == 3 ? a + x * Y : a;
            const V* pb = kb == 3 ? b + x * Y : b;
            if (ka >= 2 && kb >= 2) {
                for (int64_t y = 0; y < Y; ++y) o[y] = f(pa[y], pb[y]);
            } else if (ka >= 2) {
                const V v = b[kb == 1 ? x : 0];
                for (int64_t y = 0; y < Y; ++y) o[y] = f(pa[y], v);
            } else if (kb >= 2) {
                const V v = a[ka == 1 ? x : 0];
                for (int64_t y = 0; y < Y; ++y) o[y] = f(v, pb[y]);
            } else {
                std::fill(o, o + Y, f(a[ka == 1 ? x : 0], b[kb == 1 ? x : 0]));
            }
        }
    }

    // Evaluate rows [x0, x0 + rows) of tile t into regs (buffers of `lanes`); returns the error bits.
    // same_tile: the previous chunk this thread ran was of tile t (its per-tile values stand)
    template <class V>
    int run(int64_t t, int64_t x0, int64_t rows, V* regs, int64_t lanes, bool same_tile) const {
        using U = std::make_unsigned_t<V>;
        int err = E_NONE;
        const int64_t Y = this->Y;  // a local: stores through r cannot change it (the loops vectorise)
        for (size_t si = 0; si < steps.size(); ++si) {
            if (same_tile && per_tile[si]) continue;
            const Step& st = steps[si];
            const int64_t op = st.op, dt = st.dt;
            const int L = st.L;
            const int64_t m = size_at(L, rows);
            V* r = regs + st.dst * lanes;
            const V* a = st.arg[0] >= 0 ? regs + st.arg[0] * lanes : nullptr;
            const V* b = st.arg[1] >= 0 ? regs + st.arg[1] * lanes : nullptr;
            const V* e = st.arg[2] >= 0 ? regs + st.arg[2] * lanes : nullptr;
            switch (op) {
                case P_WIDEN:  // to every pair (3) from a tile's value (0), a row's (1) or a position's (2)
                    if (st.from == 0) std::fill(r, r + m, a[0]);
                    else if (st.from == 1)
                        for (int64_t x = 0; x < rows; ++x) std::fill(r + x * Y, r + (x + 1) * Y, a[x]);
                    else
                        for (int64_t x = 0; x < rows; ++x) std::copy(a, a + Y, r + x * Y);
                    continue;
                case P_INPUT: {
                    const PredInput& in = inputs[st.raw];
                    const int64_t ny = Y, s1 = in.s1, s2 = in.s2;  // locals, as Y
                    const int64_t* base = in.data + t * in.s0 + x0 * s1;
                    if (L != 3) {  // one value per tile, per row or per position along a row
                        const int64_t step = L == 1 ? s1 : s2;
                        for (int64_t j = 0; j < m; ++j) r[j] = static_cast<V>(base[j * step]);
                        break;
                    }
                    for (int64_t x = 0; x < rows; ++x) {
                        const int64_t* src = base + x * s1;
                        V* dst = r + x * ny;
                        if (s2 == 1) std::copy(src, src + ny, dst);
                        else for (int64_t y = 0; y < ny; ++y) dst[y] = static_cast<V>(src[y * s2]);
                    }
                    break;
                }
                case P_CONST: r[0] = static_cast<V>(st.raw); break;
                case P_ADD:
                    binary(st, r, a, b, rows, m, [](V u, V v) { return static_cast<V>(static_cast<U>(u) + static_cast<U>(v)); });
                    break;
                case P_SUB:
                    binary(st, r, a, b, rows, m, [](V u, V v) { return static_cast<V>(static_cast<U>(u) - static_cast<U>(v)); });
                    break;
                case P_MUL:
                    binary(st, r, a, b, rows, m, [](V u, V v) { return static_cast<V>(static_cast<U>(u) * static_cast<U>(v)); });
                    break;
                case P_EQ:
                    binary(st, r, a, b, rows, m, [](V u, V v) { return static_cast<V>(u == v); });
                    break;
                case P_NE:
                    binary(st, r, a, b, rows, m, [](V u, V v) { return static_cast<V>(u != v); });
                    break;
                case P_LT:
                    binary(st, r, a, b, rows, m, [](V u, V v) { return static_cast<V>(u < v); });
                    break;
                case P_LE:
                    binary(st, r, a, b, rows, m, [](V u, V v) { return static_cast<V>(u <= v); });
                    break;
                case P_GT:
                    binary(st, r, a, b, rows, m, [](V u, V v) { return static_cast<V>(u > v); });
                    break;
                case P_GE:
                    binary(st, r, a, b, rows, m, [](V u, V v) { return static_cast<V>(u >= v); });
                    break;
                case P_AND:
                    binary(st, r, a, b, rows, m, [](V u, V v) { return static_cast<V>(u & v); });
                    break;
                case P_OR:
                    binary(st, r, a, b, rows, m, [](V u, V v) { return static_cast<V>(u | v); });
                    break;
                case P_XOR:
                    binary(st, r, a, b, rows, m, [](V u, V v) { return static_cast<V>(u ^ v); });
                    break;
                case P_LAND:
                    binary(st, r, a, b, rows, m, [](V u, V v) { return static_cast<V>((u != 0) & (v != 0)); });
                    break;
                case P_LOR:
                    binary(st, r, a, b, rows, m, [](V u, V v) { return static_cast<V>((u != 0) | (v != 0)); });
                    break;
                case P_LXOR:
                    binary(st, r, a, b, rows, m, [](V u, V v) { return static_cast<V>((u != 0) ^ (v != 0)); });
                    break;
                case P_MIN:
                    binary(st, r, a, b, rows, m, [](V u, V v) { return std::min(u, v); });
                    break;
                case P_MAX:
                    binary(st, r, a, b, rows, m, [](V u, V v) { return std::max(u, v); });
                    break;
                case P_NEG:
                    for (int64_t j = 0; j < m; ++j) r[j] = static_cast<V>(U{0} - static_cast<U>(a[j]));
                    break;
                case P_ABS:
                    for (int64_t j = 0; j < m; ++j)
                        r[j] = a[j] < 0 ? static_cast<V>(U{0} - static_cast<U>(a[j])) : a[j];
                    break;
                case P_SIGN: for (int64_t j = 0; j < m; ++j) r[j] = (a[j] > 0) - (a[j] < 0); break;
                case P_FLOORDIV: case P_REMAINDER: case P_TRUNCDIV: case P_FMOD:
                    err |= divide<V>(op, st.k, a, b, r, m);
                    break;
                case P_NOT: for (int64_t j = 0; j < m; ++j) r[j] = ~a[j]; break;
                case P_LNOT: for (int64_t j = 0; j < m; ++j) r[j] = a[j] == 0; break;
                case P_SHL: case P_SHR: {  // past the width: 0 (or the sign) as torch; negative amounts refused
                    const int64_t width = pred_bits(dt), nb = size_at(st.kind[1], rows);
                    V least = 0;
                    for (int64_t j = 0; j < nb; ++j) least = std::min(least, b[j]);
                    if (least < 0) { err |= E_SHIFT; break; }
                    if (op == P_SHL)
                        binary(st, r, a, b, rows, m, [width](V u, V v) {  // a wider shift of a V lane leaves 0 (fits32)
                            const int64_t top = std::min<int64_t>(width, 8 * sizeof(V));
                            return v >= top ? V{0} : static_cast<V>(static_cast<U>(u) << (v & (8 * sizeof(V) - 1)));
                        });
                    else
                        binary(st, r, a, b, rows, m, [](V u, V v) { return static_cast<V>(u >> std::min<V>(v, 8 * sizeof(V) - 1)); });
                    break;
                }
                case P_WHERE: for (int64_t j = 0; j < m; ++j) r[j] = a[j] != 0 ? b[j] : e[j]; break;
                case P_CAST: std::copy(a, a + m, r); break;
                case P_LOAD: err |= load<V>(st, a, b, e, r, m); break;
                default: TORCH_CHECK(false, "attnkit.native: predicate program with op ", op);
            }
            if (err) return err;
            if (needs_wrap(op, dt)) pred_wrap(r, m, dt);
        }
        return err;
    }

    template <class V>
    static int divide(int64_t op, const int64_t* k, const V* a, const V* b, V* r, int64_t m) {
        if (k != nullptr && *k > 0 && (*k & (*k - 1)) == 0) {  // a power of two: shifts and masks (floor)
            const int64_t d = *k;
            int shift = 0;
            while ((int64_t{1} << shift) < d) ++shift;
            if (op == P_FLOORDIV) { for (int64_t j = 0; j < m; ++j) r[j] = static_cast<V>(a[j] >> shift); return E_NONE; }
            if (op == P_REMAINDER) { for (int64_t j = 0; j < m; ++j) r[j] = static_cast<V>(a[j] & (d - 1)); return E_NONE; }
        }
        if (k != nullptr && *k > 0 && *k < (int64_t{1} << 31)) {  // a positive divisor: through double, corrected
            const int64_t d = *k;
            bool small = true;
            for (int64_t j = 0; j < m; ++j) small &= a[j] > -(int64_t{1} << 52) && a[j] < (int64_t{1} << 52);
            if (small) {
                const double inv = 1.0 / static_cast<double>(d);
                for (int64_t j = 0; j < m; ++j) {
                    const int64_t x = a[j];
                    int64_t q = static_cast<int64_t>(std::floor(static_cast<double>(x) * inv));
                    int64_t rem = x - q * d;
                    q += (rem >= d) - (rem < 0);  // the product's rounding: at most one off
                    rem = x - q * d;
                    int64_t out;
                    if (op == P_FLOORDIV) out = q;
                    else if (op == P_REMAINDER) out = rem;
                    else if (op == P_TRUNCDIV) out = (rem != 0 && x < 0) ? q + 1 : q;
                    else out = (rem != 0 && x < 0) ? rem - d : rem;
                    r[j] = static_cast<V>(out);
                }
                return E_NONE;
            }
        }
        std::vector<V> same;
        if (k != nullptr) same.assign(m, static_cast<V>(*k)), b = same.data();  // a constant divisor is not widened
        for (int64_t j = 0; j < m; ++j)
            if (b[j] == 0) return E_ZERO;
        for (int64_t j = 0; j < m; ++j) {
            const int64_t x = a[j], y = b[j];
            int64_t out;
            if (op == P_FLOORDIV) out = floor_div(x, y);
            else if (op == P_REMAINDER) out = floor_mod(x, y);
            else if (op == P_TRUNCDIV) out = y == -1 ? static_cast<int64_t>(0ull - static_cast<uint64_t>(x)) : x / y;
            else out = y == -1 ? 0 : x % y;
            r[j] = static_cast<V>(out);
        }
        return E_NONE;
    }

    template <class V>
    int load(const Step& st, const V* i0, const V* i1, const V* i2, V* r, int64_t m) const {
        const PredTable& tb = tables[st.raw];
        const V* data;
        if constexpr (sizeof(V) == 4) data = tb.data32;
        else data = tb.data;
        if (tb.dims == 1) {  // the indices, checked as a whole, then one gather
            const V size = static_cast<V>(tb.size[0]);
            V least = 0, most = 0;
            for (int64_t j = 0; j < m; ++j) {
                const V i = i0[j] < 0 ? i0[j] + size : i0[j];
                r[j] = i;
                least = std::min(least, i), most = std::max(most, i);
            }
            if (least < 0 || most >= size) return E_INDEX;
            for (int64_t j = 0; j < m; ++j) r[j] = data[r[j]];
            return E_NONE;
        }
        const V* idx[3] = {i0, i1, i2};
        for (int64_t j = 0; j < m; ++j) {
            int64_t at = 0;
            for (int64_t d = 0; d < tb.dims; ++d) {
                int64_t i = idx[d][j];
                if (i < 0) i += tb.size[d];
                if (i < 0 || i >= tb.size[d]) return E_INDEX;
                at += i * tb.stride[d];
            }
            r[j] = data[at];
        }
        return E_NONE;
    }
};

}  // namespace
