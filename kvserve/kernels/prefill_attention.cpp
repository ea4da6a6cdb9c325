// Prefill attention straight on the paged KV cache: a chunk of L query tokens of one sequence (the last L positions
// of its context) attends causally, optionally within a sliding window, to the context read through the sequence's
// block table, with no gathered copy of K and V. A cache of another element type than float32 (kv_dtypes.h) has each
// key tile's K and V rows converted (and an 8-bit one's scales applied) into the tile's float32 buffers as they are
// read, 64 keys at a time.
//
// Why: torch's CPU flash SDPA ran at ~76 GFLOP/s on Gemma 3's prefill shapes (4 query heads, 1 KV head,
// head_dim 256), and the torch path first gathers and transposes K/V out of the cache every layer.
// How (flash attention, online softmax):
// - A work item is (KV head, tile of queries); its rows are the tile's queries x the query heads sharing that
//   KV head (GQA/MQA folded: 16 queries x 4 heads = 64 rows at head_dim 256; more at smaller heads, row_tile),
//   query-major, so a block of `group` rows shares one position and one mask. Each key tile (K and V rows, found
//   through the block table) is then used by all rows while it sits in L1/L2, and key tiles and micro-blocks that
//   the causal or window mask hides entirely are never computed.
// - Scores (Q K^T) and the output (P V) are small GEMMs with register-blocked FMA micro-kernels: 16 query rows x
//   6 keys (Q is packed transposed, so each step broadcasts a key element against two vectors of rows and no
//   horizontal sums are needed), and 4 rows x 24 output columns over the keys. Scores and probabilities stay
//   transposed ([key][row]), so the online softmax runs 8 rows per vector.
// - Where the library is built for AVX-512 (kvserve/kernels/native.py builds for the best set the CPU has), the
//   scores, the softmax and the output run on 16-float vectors: the same operations on each value in the same
//   order, so the results are bit-identical to the AVX2 build's, at 1.4-1.5x its speed on Gemma 3's shapes
//   (85 queries x 1,485 keys: 1.8 against 2.7 ms on this project's 2-core Intel host, scripts/ab_kernel_shapes.py).
// - The packed tiles' strides avoid multiples of 256 bytes, which map a column walk onto a few L1 sets; the
//   V tile is copied for that reason (its rows lie kv_heads x dim floats apart in the cache, often 1 KB).
// - On a bfloat16 cache where the library is built for AVX512_BF16, both GEMMs take bfloat16 dot products
//   (vdpbf16ps, twice a float32 FMA's multiply-adds): K straight from the cache, the queries and the softmax weights
//   rounded to bfloat16, every sum in float32 (the "bfloat16 dot-product path" below; docs/KV_QUANT.md).
// - Work items are handed out dynamically, heaviest (latest queries, most keys) first, so that the two ends
//   of the causal triangle balance across threads.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <unistd.h>

#include "attention_merge.h"
#include "dispatch.h"
#include "kernels.h"
#include "kv_dtypes.h"
#include "simd.h"

#include <algorithm>
#include <new>
#include <type_traits>
#include <vector>

namespace {

using kvserve::exp256;

constexpr int64_t kKeyTile = 64;  // keys per online-softmax step: the K and V tiles stay in L2 (64 KB each)
constexpr int kRows = 4;          // output micro-kernel rows (one query's 4 heads for Gemma 3)
constexpr int kKeys = 6;          // AVX2 scores micro-kernel: 6 keys x 16 rows = 12 accumulators
constexpr int kVecs = 3;          // output micro-kernel width in 8-float vectors: 4 x 3 accumulators
// Query rows per work item: 64 at head_dim 256 (Q and O tiles of 64 KB each), as many more as a smaller head leaves
// room for in the same bytes, at most 256 (Qwen2.5's head_dim 64: 256 rows). Every item walks every key tile of its
// KV head, so taller items read the context fewer times: at head_dim 64, 512 queries over 16k keys, 24 layers'
// caches (so K and V come from memory, as in the model), 256 rows against 64 took 4.3 against 5.2 s on a float32
// cache and 2.8 against 3.3 on a bfloat16 one (Zen 4, 2 threads; scripts/ab_prefill_attention_depth.py).
int64_t row_tile(int64_t dim) { return std::clamp<int64_t>(64 * 256 / std::max<int64_t>(dim, 1), 64, 256); }
// Rows per item for a short chunk taken whole by each thread (see kvserve_paged_prefill_attention): 192 at head_dim
// 256 (Q and O tiles of ~200 KB each), scaled to the same bytes for smaller heads up to 768 rows, only where a core's
// L2 holds 1 MiB or more (the AVX-512 hosts here: 1-2 MiB); elsewhere row_tile's. At head_dim 64 an agent's later
// turn (52 new tokens over 19k cached, 90 over 9k) is then one item per KV head: 552 against 793 ms (float32 cache)
// and 386 against 475 ms (bfloat16) over 24 layers, against 192 rows.
int64_t short_chunk_rows(int64_t dim) {
    static const bool large_l2 = sysconf(_SC_LEVEL2_CACHE_SIZE) >= (1 << 20);
    return large_l2 ? std::clamp<int64_t>(192 * 256 / std::max<int64_t>(dim, 1), 192, 768) : row_tile(dim);
}

// Transposes the 8 x 8 block in r0..r7 (rows) in place: r_i becomes column i.
inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

// The float vectors the two GEMMs run on: AVX2's 8 lanes, and AVX-512's 16 where the library is built for it.
// Both GEMMs are written once over these; each value's sums are the same operations in the same order at either
// width (each score a sequence of fused multiply-adds over d from zero, each output column one over the keys from
// alpha x O), so the AVX-512 build's results are bit-identical to the AVX2 build's.
struct F32x8 {
    using V = __m256;
    static constexpr int kWidth = 8;
    static V zero() { return _mm256_setzero_ps(); }
    static V load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
    static V set1(float x) { return _mm256_set1_ps(x); }
    static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
};
#if defined(__AVX512F__)
struct F32x16 {
    using V = __m512;
    static constexpr int kWidth = 16;
    static V zero() { return _mm512_setzero_ps(); }
    static V load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
    static V set1(float x) { return _mm512_set1_ps(x); }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
};
#endif

// st[c * ld + r] = q_r . k_c for N vectors of query rows, stored transposed (qt[d * ld + r]), and C keys (row
// pointers): each step broadcasts one element of each key against the N vectors of rows, so the sums build up
// in place, without horizontal reductions, whatever head_dim is.
template <typename L, int C, int N>
inline void scores_micro(const float* qt, int64_t ld, const float* const* k, int64_t dim, float* st) {
    typename L::V acc[C][N];
    for (int c = 0; c < C; ++c)
        for (int n = 0; n < N; ++n) acc[c][n] = L::zero();
    for (int64_t d = 0; d < dim; ++d) {
        typename L::V qv[N];
        for (int n = 0; n < N; ++n) qv[n] = L::load(qt + d * ld + L::kWidth * n);
        for (int c = 0; c < C; ++c) {
            const typename L::V kc = L::set1(k[c][d]);
            for (int n = 0; n < N; ++n) acc[c][n] = L::fmadd(kc, qv[n], acc[c][n]);
        }
    }
    for (int c = 0; c < C; ++c)
        for (int n = 0; n < N; ++n) L::store(st + c * ld + L::kWidth * n, acc[c][n]);
}

// scores_micro for exactly `left` keys (fewer than C + 1).
template <typename L, int C, int N>
inline void scores_tail(int64_t left, const float* qt, int64_t ld, const float* const* k, int64_t dim, float* st) {
    if (left == C) scores_micro<L, C, N>(qt, ld, k, dim, st);
    else if constexpr (C > 1) scores_tail<L, C - 1, N>(left, qt, ld, k, dim, st);
}

// Scores of N vectors of rows against keys [j0, j1), C keys a micro-kernel call.
template <typename L, int C, int N>
inline void scores_block(const float* qt, int64_t ld, const float* const* k, int64_t j0, int64_t j1, int64_t dim,
                         float* st) {
    int64_t j = j0;
    for (; j + C <= j1; j += C) scores_micro<L, C, N>(qt, ld, k + j, dim, st + j * ld);
    if (j < j1) scores_tail<L, C - 1, N>(j1 - j, qt, ld, k + j, dim, st + j * ld);
}

// o_r[d0 : d0 + V lanes] = alpha_r o_r[...] + sum_{j in [j0, j1)} pt[j * ld + r] v_j[d0 : ...] for R rows of o
// (stride dim): the online-softmax rescale rides on the load of the accumulators.
template <typename L, int R, int V>
inline void output_micro(const float* pt, int64_t ld, const float* const* v, int64_t j0, int64_t j1, int64_t d0,
                         const float* alpha, float* o, int64_t dim) {
    typename L::V acc[R][V];
    for (int r = 0; r < R; ++r) {
        const typename L::V a = L::set1(alpha[r]);
        for (int n = 0; n < V; ++n) acc[r][n] = L::mul(L::load(o + r * dim + d0 + L::kWidth * n), a);
    }
    for (int64_t j = j0; j < j1; ++j) {
        typename L::V vv[V];
        for (int n = 0; n < V; ++n) vv[n] = L::load(v[j] + d0 + L::kWidth * n);
        for (int r = 0; r < R; ++r) {
            const typename L::V pr = L::set1(pt[j * ld + r]);
            for (int n = 0; n < V; ++n) acc[r][n] = L::fmadd(pr, vv[n], acc[r][n]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int n = 0; n < V; ++n) L::store(o + r * dim + d0 + L::kWidth * n, acc[r][n]);
}

// Each block of kRows rows that sees any key (j0[b] < j1[b]): f(R, r0, b), R its rows as a compile-time count.
template <typename Fn>
__attribute__((always_inline)) inline void for_row_blocks(int64_t rows, const int64_t* j0, const int64_t* j1, Fn&& f) {
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
        const int64_t b = r0 / kRows;
        if (j1[b] > j0[b]) kvserve::with_count<kRows>(rows - r0, [&](auto R) { f(R, r0, b); });
    }
}

// Output columns [d0, d0 + V vectors) of every row: each block of kRows rows over the keys any of them sees
// (j0[b], j1[b]). The columns are the outer loop so that this slice of the V tile (64 keys x V vectors) and the
// probabilities stay in L1 while every row block uses them.
template <typename L, int V>
inline void output_columns(const float* pt, int64_t ld, const float* const* v, const int64_t* j0,
                           const int64_t* j1, int64_t rows, int64_t d0, const float* alpha, float* o, int64_t dim) {
    for_row_blocks(rows, j0, j1, [&](auto R, int64_t r0, int64_t b) {
        output_micro<L, decltype(R)::value, V>(pt + r0, ld, v, j0[b], j1[b], d0, alpha + r0, o + r0 * dim, dim);
    });
}

// The AVX-512 build's scores step takes 32 rows (two vectors) by 12 keys, 24 accumulators, so that its loads (two
// of Q, one broadcast per key) stay under its FMAs; 16 rows where fewer are left. Its output step takes 4 rows x
// 64 columns.
constexpr int kKeys512 = 12;

// The key range [lo, hi) that any of rows [r0, r1) sees; empty rows (hi <= lo) count for nothing.
inline void key_union(const float* lo, const float* hi, int64_t r0, int64_t r1, int64_t* j0, int64_t* j1) {
    float a = INFINITY, b = -INFINITY;
    for (int64_t r = r0; r < r1; ++r)
        if (hi[r] > lo[r]) a = std::min(a, lo[r]), b = std::max(b, hi[r]);
    *j0 = b > a ? static_cast<int64_t>(a) : 0;
    *j1 = b > a ? static_cast<int64_t>(b) : 0;
}

// Per-thread scratch of one work item; ld: rows padded (see kvserve_paged_prefill_attention).
// Cache-line-aligned storage for the packed tiles: the AVX-512 build's 16-float loads then never split a line.
template <typename T>
struct LineAligned {
    using value_type = T;
    LineAligned() = default;
    template <typename U>
    LineAligned(const LineAligned<U>&) {}
    T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
    void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
    template <typename U>
    bool operator==(const LineAligned<U>&) const { return true; }
    template <typename U>
    bool operator!=(const LineAligned<U>&) const { return false; }
};
using Floats = std::vector<float, LineAligned<float>>;
using Pairs = std::vector<uint32_t, LineAligned<uint32_t>>;  // bfloat16 pairs (the bfloat16 dot-product path)

struct Tile {
    Floats qt, st, o;                   // Q^T [dim, ld] (scaled); scores, then probabilities, [kKeyTile, ld];
                                        // O [ld, dim]
    std::vector<float> m, l, alpha;     // running max, running sum, this step's rescale; per row
    std::vector<float> lo, hi;          // each row's visible keys [lo, hi) in the current key tile
    Floats vp;                          // the key tile's V rows [kKeyTile, vld]
    Floats kp;                          // a converted cache's K rows [kKeyTile, vld] (a float32 cache's are read
                                        // in place)
    std::vector<const float*> src;      // each row's query in q
    std::vector<const float*> k, v;     // the key tile's K rows (in the cache) and V rows (in vp)
    std::vector<int64_t> j0, j1;        // per block of kRows rows: the keys any of its rows sees
    Pairs qp, pp, vp2;                  // the bfloat16 dot-product path's Q^T [dim / 2, ld], P^T [kKeyTile / 2, ld]
                                        // and V [kKeyTile / 2, vld], as pairs
    std::vector<const uint16_t*> k16, v16;  // its key tile's K and V rows, in the cache
};

// One cache row (dim elements of E) to float32 at dst, times `scale` for an 8-bit type.
template <typename E>
inline void widen_row(const typename E::T* src, int64_t dim, float scale, float* dst) {
    if constexpr (std::is_same_v<E, kvserve::kv::Float32>) {
        std::copy(src, src + dim, dst);
    } else {
        const __m256 sv = _mm256_set1_ps(scale);
        int64_t d = 0;
        for (; d + 8 <= dim; d += 8) {
            const __m256 x = E::load8(src + d);
            _mm256_storeu_ps(dst + d, E::kScaled ? _mm256_mul_ps(x, sv) : x);
        }
        for (; d < dim; ++d) dst[d] = E::kScaled ? E::load1(src + d) * scale : E::load1(src + d);
    }
}

#if defined(__AVX512BF16__)
// The bfloat16 dot-product path (a bfloat16 cache on a CPU with AVX512_BF16): vdpbf16ps multiplies pairs of bfloat16
// values and adds both products to a float32 lane, twice the multiply-adds of a float32 FMA per instruction. The
// scores pair the head dimensions (Q^T packed as [dim / 2][rows] pairs, each key's pair broadcast straight from the
// cache: no widened copy of K), the output pairs the keys (P packed as [keys / 2][rows] pairs, V as [keys / 2][dim]).
// Queries and probabilities are rounded to bfloat16 (nearest even) where they enter a product, as flash attention
// does on a GPU; every sum is float32.
inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }

// st[c * ld + r] = q_r . k_c over pairs of dimensions: qp[d2 * ld + r] holds row r's (d, d + 1) = (2 d2, 2 d2 + 1).
template <int C, int N>
inline void scores_micro_bf16(const uint32_t* qp, int64_t ld, const uint16_t* const* k, int64_t dim, float* st) {
    __m512 acc[C][N];
    for (int c = 0; c < C; ++c)
        for (int n = 0; n < N; ++n) acc[c][n] = _mm512_setzero_ps();
    for (int64_t d2 = 0; d2 < dim / 2; ++d2) {
        __m512i qv[N];
        for (int n = 0; n < N; ++n) qv[n] = _mm512_loadu_si512(qp + d2 * ld + 16 * n);
        for (int c = 0; c < C; ++c) {
            uint32_t pair;
            memcpy(&pair, k[c] + 2 * d2, 4);
            const __m512i kc = _mm512_set1_epi32(static_cast<int>(pair));
            for (int n = 0; n < N; ++n) acc[c][n] = _mm512_dpbf16_ps(acc[c][n], as_bh(kc), as_bh(qv[n]));
        }
    }
    for (int c = 0; c < C; ++c)
        for (int n = 0; n < N; ++n) _mm512_storeu_ps(st + c * ld + 16 * n, acc[c][n]);
}

template <int C, int N>
inline void scores_tail_bf16(int64_t left, const uint32_t* qp, int64_t ld, const uint16_t* const* k, int64_t dim,
                             float* st) {
    if (left == C) scores_micro_bf16<C, N>(qp, ld, k, dim, st);
    else if constexpr (C > 1) scores_tail_bf16<C - 1, N>(left, qp, ld, k, dim, st);
}

template <int C, int N>
inline void scores_block_bf16(const uint32_t* qp, int64_t ld, const uint16_t* const* k, int64_t j0, int64_t j1,
                              int64_t dim, float* st) {
    int64_t j = j0;
    for (; j + C <= j1; j += C) scores_micro_bf16<C, N>(qp, ld, k + j, dim, st + j * ld);
    if (j < j1) scores_tail_bf16<C - 1, N>(j1 - j, qp, ld, k + j, dim, st + j * ld);
}

// o_r[d0 : d0 + 16 V] = alpha_r o_r + sum over the key pairs [j0 / 2, ceil(j1 / 2)) of pp[j2 * ld + r] . vp[j2][d]:
// a pair's key outside [j0, j1) has probability 0 for these rows (masked, or zeroed where P was packed).
template <int R, int V>
inline void output_micro_bf16(const uint32_t* pp, int64_t ld, const uint32_t* vp, int64_t vld, int64_t j0,
                              int64_t j1, int64_t d0, const float* alpha, float* o, int64_t dim) {
    __m512 acc[R][V];
    for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
        for (int n = 0; n < V; ++n) acc[r][n] = _mm512_mul_ps(_mm512_loadu_ps(o + r * dim + d0 + 16 * n), a);
    }
    for (int64_t j2 = j0 / 2; j2 < (j1 + 1) / 2; ++j2) {
        __m512i vv[V];
        for (int n = 0; n < V; ++n) vv[n] = _mm512_loadu_si512(vp + j2 * vld + d0 + 16 * n);
        for (int r = 0; r < R; ++r) {
            const __m512i pr = _mm512_set1_epi32(static_cast<int>(pp[j2 * ld + r]));
            for (int n = 0; n < V; ++n) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], as_bh(pr), as_bh(vv[n]));
        }
    }
    for (int r = 0; r < R; ++r)
        for (int n = 0; n < V; ++n) _mm512_storeu_ps(o + r * dim + d0 + 16 * n, acc[r][n]);
}

template <int V>
inline void output_columns_bf16(const uint32_t* pp, int64_t ld, const uint32_t* vp, int64_t vld, const int64_t* j0,
                                const int64_t* j1, int64_t rows, int64_t d0, const float* alpha, float* o,
                                int64_t dim) {
    for_row_blocks(rows, j0, j1, [&](auto R, int64_t r0, int64_t b) {
        output_micro_bf16<decltype(R)::value, V>(pp + r0, ld, vp, vld, j0[b], j1[b], d0, alpha + r0, o + r0 * dim, dim);
    });
}

// Q^T as bfloat16 pairs of dimensions, scaled: qp[d2 * ld + r] = (q_r[2 d2], q_r[2 d2 + 1]) x scale, rounded to
// nearest even; rows past `rows` (padding up to ld) are 0.
inline void pack_queries_bf16(const float* const* src, int64_t rows, int64_t ld, int64_t dim, float scale,
                              uint32_t* qp) {
    const __m512 sv = _mm512_set1_ps(scale);
    alignas(64) uint32_t pairs[16];
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < dim; d += 32) {  // 32 dimensions: 16 pairs, in order
            const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(src[r] + d), sv);
            const __m512 hi = d + 16 < dim ? _mm512_mul_ps(_mm512_loadu_ps(src[r] + d + 16), sv) : _mm512_setzero_ps();
            _mm512_store_si512(pairs, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
            for (int i = 0; i < 16 && d / 2 + i < dim / 2; ++i) qp[(d / 2 + i) * ld + r] = pairs[i];
        }
    for (int64_t d2 = 0; d2 < dim / 2; ++d2) std::fill(qp + d2 * ld + rows, qp + d2 * ld + ld, 0u);
}

// Two bfloat16 rows (dim values each, dim a multiple of 16) as pairs: out[d] = a[d] | b[d] << 16; b null: zeros.
inline void pair_rows(const uint16_t* a, const uint16_t* b, int64_t dim, uint32_t* out) {
    for (int64_t d = 0; d < dim; d += 16) {
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d)));
        const __m512i hi = b != nullptr
                               ? _mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + d))),
                                     16)
                               : _mm512_setzero_si512();
        _mm512_storeu_si512(out + d, _mm512_or_si512(lo, hi));
    }
}

// P^T (float32 [keys][ld]) as bfloat16 pairs of keys, 8 rows at a time: pp[j2 * ld + r] = (p[2 j2][r], p[2 j2 + 1][r]),
// a key outside the 8 rows' visible range [lo, hi) (never written by this tile's softmax) taken as 0.
inline void pack_probabilities(const float* st, int64_t ld, int64_t rows, const float* lo, const float* hi,
                               uint32_t* pp) {
    const __m256i interleave = _mm256_setr_epi16(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
        int64_t j0, j1;
        key_union(lo, hi, r0, std::min(rows, r0 + 8), &j0, &j1);
        for (int64_t j2 = j0 / 2; j2 < (j1 + 1) / 2; ++j2) {
            const int64_t j = 2 * j2;
            const __m256 x = j >= j0 ? _mm256_loadu_ps(st + j * ld + r0) : _mm256_setzero_ps();
            const __m256 y = j + 1 < j1 ? _mm256_loadu_ps(st + (j + 1) * ld + r0) : _mm256_setzero_ps();
            const __m256i both = reinterpret_cast<__m256i>(_mm256_cvtne2ps_pbh(y, x));  // x's 8 then y's 8
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp + j2 * ld + r0),
                                _mm256_permutexvar_epi16(interleave, both));
        }
    }
}
#endif

// One sequence's chunk of queries, causal over its context (kernels.h: KvservePrefillAttention), on a cache of E.
template <typename E>
void prefill_attention(const KvservePrefillAttention* a) {
    using T = typename E::T;
    const float* q = a->q;
    const T* k_cache = static_cast<const T*>(a->k_cache);
    const T* v_cache = static_cast<const T*>(a->v_cache);
    const int64_t* block_table = a->block_table;
    float* out = a->out;
    const int64_t q_len = a->q_len, seq_len = a->seq_len, heads = a->heads, kv_heads = a->kv_heads, dim = a->dim;
    const int64_t block_size = a->block_size, window = a->window;
    const float scale = static_cast<float>(a->scale);
    const int64_t group = heads / kv_heads;
    const int64_t first_pos = seq_len - q_len;
#if defined(__AVX512BF16__)
    const bool dot16 = std::is_same_v<E, kvserve::kv::Bfloat16> && dim % 16 == 0;
#else
    constexpr bool dot16 = false;
#endif
    // Queries per item: rows up to row_tile, but smaller tiles when a short chunk would leave threads idle. A
    // short chunk over a long context (a chat turn after a prefix-cache hit: ~90 queries, 1,500 keys) instead
    // takes one item per thread when its rows fit short_chunk_rows and the core's L2 holds the larger tiles: every
    // item walks every key tile (its K rows read and its V rows copied once per item), so fewer, taller items
    // repeat less of that (85 queries x 1,485 keys, Gemma 3's shapes, 2 threads: 2.84 against 3.39 ms).
    const int64_t threads = omp_get_max_threads();
    const int64_t fill = (q_len * kv_heads + 2 * threads - 1) / (2 * threads);
    const int64_t one_each = (q_len * kv_heads + threads - 1) / threads;
    const int64_t tile_q = one_each * group <= short_chunk_rows(dim)
                               ? one_each
                               : std::max<int64_t>(1, std::min(row_tile(dim) / group, fill));
    const int64_t q_tiles = (q_len + tile_q - 1) / tile_q;
    // Split-K: with fewer (query tile, KV head) items than twice the threads (a speculative verification's k + 1
    // queries over a long context: 1-2 items, one per KV head), each item's keys are split into parts of whole key
    // tiles, each part's running max, sum and unnormalized output kept per row and merged by their log-sum-exp at the
    // end, so that every thread works; at least 4 key tiles a part.
    const int64_t tile_items = q_tiles * kv_heads;
    const int64_t span = window > 0 ? std::min(seq_len, window + tile_q) : seq_len;  // keys an item sees at most
    const int64_t parts = tile_items >= 2 * threads
                              ? 1
                              : std::clamp<int64_t>(span / (4 * kKeyTile), 1, (2 * threads + tile_items - 1) / tile_items);
    const int64_t part_stride = dim + 2;  // a row of a part: max, sum, output
    std::vector<float> partial(parts > 1 ? static_cast<size_t>(tile_items * parts * tile_q * group * part_stride) : 0);
    // Row vectors padded to 16 rows, and then so that the transposed tiles' stride is no multiple of 256 bytes:
    // a power-of-two stride maps the 16-row column of Q^T walked in the scores step onto a quarter of L1's
    // sets, and it thrashes. AVX2: 8 more rows. AVX-512: an odd number of cache lines per row (whole lines,
    // so that its 16-row loads stay aligned).
    const int64_t rows16 = (tile_q * group + 15) / 16 * 16;
#if defined(__AVX512F__)
    const int64_t ld = rows16 / 16 % 2 == 0 ? rows16 + 16 : rows16;
#else
    const int64_t ld = rows16 + 8;
#endif
    // The V tile is copied to rows of dim + 16 floats, for the same reason: the output step walks one slice of
    // columns down all 64 V rows, and the cache's stride (kv_heads x dim floats) is often a power of two.
    const int64_t vld = dim + 16;
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY), one = _mm256_set1_ps(1.0f);
#pragma omp parallel
    {
        Tile t;
        t.qt.resize(dim * ld), t.st.resize(kKeyTile * ld), t.o.resize(ld * dim);
        t.m.resize(ld), t.l.resize(ld), t.alpha.resize(ld), t.lo.resize(ld), t.hi.resize(ld);
        t.vp.resize(kKeyTile * vld), t.src.resize(ld), t.k.resize(kKeyTile), t.v.resize(kKeyTile);
        if (!std::is_same_v<E, kvserve::kv::Float32>) t.kp.resize(kKeyTile * vld);
        t.j0.resize(ld / kRows), t.j1.resize(ld / kRows);
        if (dot16) {
            t.qp.resize(dim / 2 * ld), t.pp.resize(kKeyTile / 2 * ld), t.vp2.resize(kKeyTile / 2 * vld);
            t.k16.resize(kKeyTile), t.v16.resize(kKeyTile);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < tile_items * parts; ++item) {
            const int64_t tile_item = item / parts, part = item % parts;
            const int64_t h = tile_item % kv_heads;
            const int64_t i0 = (q_tiles - 1 - tile_item / kv_heads) * tile_q;  // latest (costliest) tiles first
            const int64_t nq = std::min(tile_q, q_len - i0);
            const int64_t rows = nq * group;
            for (int64_t r = 0; r < rows; ++r)
                t.src[r] = q + ((i0 + r / group) * heads + h * group + r % group) * dim;
            if (dot16) {
#if defined(__AVX512BF16__)
                pack_queries_bf16(t.src.data(), rows, ld, dim, scale, t.qp.data());
#endif
            } else {
                for (int64_t d = 0; d < dim; ++d)  // padding rows score 0 and are never read
                    std::fill(&t.qt[d * ld + rows], &t.qt[d * ld + ld], 0.0f);
                // Q^T, scaled, in 8 x 8 blocks (a scalar loop does the remaining rows and columns).
                const __m256 sv = _mm256_set1_ps(scale);
                const int64_t r8 = rows & ~int64_t{7}, d8 = dim & ~int64_t{7};
                for (int64_t r0 = 0; r0 < r8; r0 += 8)
                    for (int64_t d0 = 0; d0 < d8; d0 += 8) {
                        __m256 b[8];
                        for (int i = 0; i < 8; ++i) b[i] = _mm256_mul_ps(_mm256_loadu_ps(t.src[r0 + i] + d0), sv);
                        transpose8(b);
                        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(&t.qt[(d0 + i) * ld + r0], b[i]);
                    }
                for (int64_t r = 0; r < rows; ++r)
                    for (int64_t d = r < r8 ? d8 : 0; d < dim; ++d) t.qt[d * ld + r] = t.src[r][d] * scale;
            }
            std::fill(t.o.begin(), t.o.begin() + rows * dim, 0.0f);
            std::fill(t.m.begin(), t.m.end(), -INFINITY);
            std::fill(t.l.begin(), t.l.end(), 0.0f);
            const int64_t p_first = first_pos + i0, p_last = first_pos + i0 + nq - 1;
            const int64_t k_first = window > 0 ? std::max<int64_t>(0, p_first - window + 1) : 0;
            const int64_t per = ((p_last + 1 - k_first + parts - 1) / parts + kKeyTile - 1) / kKeyTile * kKeyTile;
            const int64_t k_begin = k_first + part * per, k_end = std::min(p_last + 1, k_begin + per);
            for (int64_t k0 = k_begin; k0 < k_end; k0 += kKeyTile) {
                const int64_t nk = std::min(kKeyTile, k_end - k0);
                for (int64_t j = 0; j < nk; ++j) {
                    const int64_t pos = k0 + j;
                    const int64_t row = (block_table[pos / block_size] * block_size + pos % block_size) * kv_heads + h;
                    if (dot16) {  // K read in place, V paired below
                        t.k16[j] = reinterpret_cast<const uint16_t*>(k_cache + row * dim);
                        t.v16[j] = reinterpret_cast<const uint16_t*>(v_cache + row * dim);
                        continue;
                    }
                    if constexpr (std::is_same_v<E, kvserve::kv::Float32>) {
                        t.k[j] = k_cache + row * dim;
                    } else {
                        widen_row<E>(k_cache + row * dim, dim, E::kScaled ? a->k_scales[row] * E::kUnit : 1.0f,
                                     t.kp.data() + j * vld);
                        t.k[j] = t.kp.data() + j * vld;
                    }
                    widen_row<E>(v_cache + row * dim, dim, E::kScaled ? a->v_scales[row] * E::kUnit : 1.0f,
                                 t.vp.data() + j * vld);
                    t.v[j] = t.vp.data() + j * vld;
                }
#if defined(__AVX512BF16__)
                if (dot16)
                    for (int64_t j = 0; j < nk; j += 2)
                        pair_rows(t.v16[j], j + 1 < nk ? t.v16[j + 1] : nullptr, dim, t.vp2.data() + j / 2 * vld);
#endif
                for (int64_t r = 0; r < ld; ++r) {
                    const int64_t pos = first_pos + i0 + r / group;
                    t.lo[r] = r < rows ? std::max<int64_t>(0, (window > 0 ? pos - window + 1 : 0) - k0) : 0;
                    t.hi[r] = r < rows ? std::clamp<int64_t>(pos + 1 - k0, 0, nk) : 0;
                }
                int64_t j0, j1;
                // Scores, per 16 rows (32 with AVX-512) over the keys any of them sees.
#if defined(__AVX512BF16__)
                if (dot16)
                    for (int64_t r0 = 0; r0 < rows; r0 += 32) {
                        key_union(t.lo.data(), t.hi.data(), r0, std::min(rows, r0 + 32), &j0, &j1);
                        const uint32_t* qp = t.qp.data() + r0;
                        float* st = t.st.data() + r0;
                        if (rows - r0 > 16) scores_block_bf16<kKeys512, 2>(qp, ld, t.k16.data(), j0, j1, dim, st);
                        else scores_block_bf16<kKeys512, 1>(qp, ld, t.k16.data(), j0, j1, dim, st);
                    }
#endif
#if defined(__AVX512F__)
                for (int64_t r0 = 0; r0 < rows && !dot16; r0 += 32) {
                    key_union(t.lo.data(), t.hi.data(), r0, std::min(rows, r0 + 32), &j0, &j1);
                    const float* qt = t.qt.data() + r0;
                    float* st = t.st.data() + r0;
                    if (rows - r0 > 16) scores_block<F32x16, kKeys512, 2>(qt, ld, t.k.data(), j0, j1, dim, st);
                    else scores_block<F32x16, kKeys512, 1>(qt, ld, t.k.data(), j0, j1, dim, st);
                }
#else
                for (int64_t r0 = 0; r0 < rows; r0 += 16) {
                    key_union(t.lo.data(), t.hi.data(), r0, std::min(rows, r0 + 16), &j0, &j1);
                    scores_block<F32x8, kKeys, 2>(t.qt.data() + r0, ld, t.k.data(), j0, j1, dim, t.st.data() + r0);
                }
#endif
                // Online softmax, 8 rows at a time (16 with AVX-512): scores -> probabilities in place (0 where
                // masked, across the whole range the output step reads), and the rescale of what came before.
                int64_t r_soft = 0;
#if defined(__AVX512F__)
                for (; r_soft + 16 <= rows; r_soft += 16) {
                    const int64_t r0 = r_soft;
                    key_union(t.lo.data(), t.hi.data(), r0, r0 + 16, &j0, &j1);
                    const __m512 lo = _mm512_loadu_ps(&t.lo[r0]), hi = _mm512_loadu_ps(&t.hi[r0]);
                    const __m512 neg_inf16 = _mm512_set1_ps(-INFINITY);
                    float* st = t.st.data() + r0;
                    __m512 mx = neg_inf16;
                    for (int64_t j = j0; j < j1; ++j) {
                        const __m512 jv = _mm512_set1_ps(static_cast<float>(j));
                        const __mmask16 seen =
                            _mm512_cmp_ps_mask(jv, lo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(jv, hi, _CMP_LT_OQ);
                        mx = _mm512_mask_max_ps(mx, seen, mx, _mm512_loadu_ps(st + j * ld));
                    }
                    const __m512 m_old = _mm512_loadu_ps(&t.m[r0]);
                    const __m512 m_new = _mm512_max_ps(m_old, mx);
                    const __m512 alpha =
                        _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_new, neg_inf16, _CMP_EQ_OQ),
                                             kvserve::exp512(_mm512_sub_ps(m_old, m_new)), _mm512_set1_ps(1.0f));
                    __m512 sum = _mm512_setzero_ps();
                    for (int64_t j = j0; j < j1; ++j) {
                        const __m512 jv = _mm512_set1_ps(static_cast<float>(j));
                        const __mmask16 seen =
                            _mm512_cmp_ps_mask(jv, lo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(jv, hi, _CMP_LT_OQ);
                        const __m512 e = kvserve::exp512(_mm512_sub_ps(_mm512_loadu_ps(st + j * ld), m_new));
                        const __m512 p = _mm512_maskz_mov_ps(seen, e);
                        _mm512_storeu_ps(st + j * ld, p);
                        sum = _mm512_add_ps(sum, p);
                    }
                    _mm512_storeu_ps(&t.m[r0], m_new);
                    _mm512_storeu_ps(&t.alpha[r0], alpha);
                    _mm512_storeu_ps(&t.l[r0], _mm512_fmadd_ps(_mm512_loadu_ps(&t.l[r0]), alpha, sum));
                }
#endif
                for (int64_t r0 = r_soft; r0 < rows; r0 += 8) {
                    key_union(t.lo.data(), t.hi.data(), r0, std::min(rows, r0 + 8), &j0, &j1);
                    const __m256 lo = _mm256_loadu_ps(&t.lo[r0]), hi = _mm256_loadu_ps(&t.hi[r0]);
                    float* st = t.st.data() + r0;
                    __m256 mx = neg_inf;
                    for (int64_t j = j0; j < j1; ++j) {
                        const __m256 jv = _mm256_set1_ps(static_cast<float>(j));
                        const __m256 seen = _mm256_and_ps(_mm256_cmp_ps(jv, lo, _CMP_GE_OQ),
                                                          _mm256_cmp_ps(jv, hi, _CMP_LT_OQ));
                        mx = _mm256_max_ps(mx, _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(st + j * ld), seen));
                    }
                    const __m256 m_old = _mm256_loadu_ps(&t.m[r0]);
                    const __m256 m_new = _mm256_max_ps(m_old, mx);
                    // Rows that have seen nothing yet keep alpha 1 (and their zero O), not exp(-inf + inf).
                    const __m256 alpha = _mm256_blendv_ps(exp256(_mm256_sub_ps(m_old, m_new)), one,
                                                          _mm256_cmp_ps(m_new, neg_inf, _CMP_EQ_OQ));
                    __m256 sum = _mm256_setzero_ps();
                    for (int64_t j = j0; j < j1; ++j) {
                        const __m256 jv = _mm256_set1_ps(static_cast<float>(j));
                        const __m256 seen = _mm256_and_ps(_mm256_cmp_ps(jv, lo, _CMP_GE_OQ),
                                                          _mm256_cmp_ps(jv, hi, _CMP_LT_OQ));
                        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(st + j * ld), m_new));
                        const __m256 p = _mm256_and_ps(e, seen);
                        _mm256_storeu_ps(st + j * ld, p);
                        sum = _mm256_add_ps(sum, p);
                    }
                    _mm256_storeu_ps(&t.m[r0], m_new);
                    _mm256_storeu_ps(&t.alpha[r0], alpha);
                    _mm256_storeu_ps(&t.l[r0], _mm256_fmadd_ps(_mm256_loadu_ps(&t.l[r0]), alpha, sum));
                }
                // Output += P V.
                for (int64_t r0 = 0; r0 < rows; r0 += kRows)
                    key_union(t.lo.data(), t.hi.data(), r0, std::min(rows, r0 + kRows), &t.j0[r0 / kRows],
                              &t.j1[r0 / kRows]);
#if defined(__AVX512BF16__)
                if (dot16) {
                    pack_probabilities(t.st.data(), ld, rows, t.lo.data(), t.hi.data(), t.pp.data());
                    int64_t d = 0;
                    for (; d + 64 <= dim; d += 64)
                        output_columns_bf16<4>(t.pp.data(), ld, t.vp2.data(), vld, t.j0.data(), t.j1.data(), rows, d,
                                               t.alpha.data(), t.o.data(), dim);
                    for (; d < dim; d += 16)
                        output_columns_bf16<1>(t.pp.data(), ld, t.vp2.data(), vld, t.j0.data(), t.j1.data(), rows, d,
                                               t.alpha.data(), t.o.data(), dim);
                    continue;
                }
#endif
                const int64_t dv = dim & ~int64_t{7};
                int64_t d = 0;
#if defined(__AVX512F__)
                for (; d + 64 <= dv; d += 64)
                    output_columns<F32x16, 4>(t.st.data(), ld, t.v.data(), t.j0.data(), t.j1.data(), rows, d,
                                      t.alpha.data(), t.o.data(), dim);
#endif
                for (; d + 8 * kVecs <= dv; d += 8 * kVecs)
                    output_columns<F32x8, kVecs>(t.st.data(), ld, t.v.data(), t.j0.data(), t.j1.data(), rows, d,
                                          t.alpha.data(), t.o.data(), dim);
                if (dv - d == 16)
                    output_columns<F32x8, 2>(t.st.data(), ld, t.v.data(), t.j0.data(), t.j1.data(), rows, d,
                                      t.alpha.data(), t.o.data(), dim);
                else if (dv - d == 8)
                    output_columns<F32x8, 1>(t.st.data(), ld, t.v.data(), t.j0.data(), t.j1.data(), rows, d,
                                      t.alpha.data(), t.o.data(), dim);
                for (d = dv; d < dim; ++d)  // head_dim not a multiple of 8
                    for (int64_t r = 0; r < rows; ++r) {
                        const int64_t b = r / kRows;
                        float acc = t.o[r * dim + d] * t.alpha[r];
                        for (int64_t j = t.j0[b]; j < t.j1[b]; ++j) acc += t.st[j * ld + r] * t.v[j][d];
                        t.o[r * dim + d] = acc;
                    }
            }
            if (parts > 1) {  // this part's sums, merged below
                float* dst = partial.data() + item * tile_q * group * part_stride;
                for (int64_t r = 0; r < rows; ++r) {
                    dst[r * part_stride] = t.m[r];
                    dst[r * part_stride + 1] = t.l[r];
                    std::copy(t.o.data() + r * dim, t.o.data() + (r + 1) * dim, dst + r * part_stride + 2);
                }
                continue;
            }
            for (int64_t r = 0; r < rows; ++r) {
                const float inv = 1.0f / t.l[r];
                const float* src = t.o.data() + r * dim;
                float* dst = out + ((i0 + r / group) * heads + h * group + r % group) * dim;
                for (int64_t d = 0; d < dim; ++d) dst[d] = src[d] * inv;
            }
        }
        if (parts > 1) {
            // Each row's parts rescaled to their common max; a part that saw none of the row's keys has sum 0.
#pragma omp for schedule(static)
            for (int64_t row = 0; row < tile_items * tile_q * group; ++row) {
                const int64_t tile_item = row / (tile_q * group), r = row % (tile_q * group);
                const int64_t h = tile_item % kv_heads, i0 = (q_tiles - 1 - tile_item / kv_heads) * tile_q;
                if (i0 + r / group >= q_len) continue;  // the last tile's missing queries
                const float* first = partial.data() + (tile_item * parts * tile_q * group + r) * part_stride;
                const int64_t part_step = tile_q * group * part_stride;
                float* dst = out + ((i0 + r / group) * heads + h * group + r % group) * dim;
                kvserve::merge_attention_parts(first, parts, part_step, dim, dst);
            }
        }
    }
}

}  // namespace

extern "C" {

void kvserve_paged_prefill_attention(const KvservePrefillAttention* a) {
    kvserve::kv::dispatch(a->kv_dtype, [&](auto type) { prefill_attention<decltype(type)>(a); });
}

}
