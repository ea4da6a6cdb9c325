// Decode attention straight on the paged KV cache: one query token per sequence attends to its context, read
// through its block table in place, in the cache's own element type (kv_dtypes.h), with no gathered copy.
//
// Why: the torch path gathers each sequence's K and V into new padded tensors every layer of every step and then
// calls SDPA; at decode those copies cost more than the attention arithmetic, and over a long context (an agent's
// 25k tokens) attention is most of a step: 14 query heads x 64 dims x 4 FLOPs a key and layer.
// How:
// - Work items are (sequence, part of its keys), every KV head of a token read together (they are adjacent in the
//   cache). A decode step at batch 1 has one sequence and few KV heads (2 on Qwen2.5-0.5B, 1 on Gemma 3 270M), so
//   parallelism over heads would leave cores idle: each context is split into parts over the threads instead
//   (split-K, flash-decoding): each part keeps its running max, its sum of exp(score - max) and its exp-weighted sum
//   of V rows per query head, and a merge rescales the parts to their common max (the log-sum-exp merge).
// - Within a part, keys go by chunks of kChunk keys whose K and V rows (32-128 KB a KV head) stay in L1/L2 between
//   the scores and the weighted sum; the softmax is online across chunks (each chunk's max, the earlier sums
//   rescaled). The next chunk's slots are prefetched into L2 while one is computed, a few lines at a time from inside
//   the arithmetic's loops (LinePrefetcher).
// - Scores: the query heads sharing a KV head (GQA: 7 on Qwen2.5-0.5B) against kLanes keys at a time (16 with
//   AVX-512, 8 with AVX2): each key's dot product accumulates over head_dim in one register (one FMA per vector of
//   dims, the key's row read from L1), and the kLanes sums then reduce together by a tree of shuffles (simd.h's
//   sum_lanes: about 3 operations a key, where a horizontal sum takes 8). The rows come straight from a float32
//   cache; other types are first converted, kLanes rows at a time, into an L1 tile (each element once, whatever the
//   group size).
// - Weighted sum of V: the group's heads x a slice of columns accumulate in registers across the chunk's keys, each
//   V row converted in registers once (bf16 by a shift, fp16 and fp8 by F16C, int8 by a widening convert).
// - An 8-bit cache's K scale multiplies each score, its V scale each softmax weight (after their sum).
// - With AVX2 alone, a group of at least four query heads a KV head takes the heads-on-lanes path instead
//   (attend_part_lanes): each K row read once, converted in registers, against all the group's heads, one vector of
//   scores a key with a head on each lane, so that the softmax runs down the keys with no horizontal max or sum.
//   On a Zen 3 host, against the keys-on-lanes path (which widens K into a tile, reads it once a head and reduces 8
//   sums a key and head): one step's attention at Qwen2.5-0.5B's shapes 1.2-1.3x faster at 4k-32k tokens
//   (docs/PERFORMANCE_NOTES.md, attempt 75).
// - On a bfloat16 cache where the library is built for AVX512_BF16, scores and the weighted sum take bfloat16 dot
//   products (vdpbf16ps: a pair of products a float32 lane, twice a float32 FMA's multiply-adds), as prefill attention
//   does (the "bfloat16 dot-product path" below): K's rows are transposed in registers, 16 keys at a time, into pairs
//   of dimensions with the keys on the lanes (no horizontal sums, nothing widened), V's rows are interleaved two keys
//   at a time; the queries and the softmax weights are rounded to bfloat16, every sum is float32.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "attention_merge.h"
#include "dispatch.h"
#include "kernels.h"
#include "kv_dtypes.h"
#include "simd.h"

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX512F__)
using L = kvserve::F32x16;
constexpr int kAccRegs = 24;  // of 32 vector registers: the weighted sum's accumulators
constexpr int kMaxHeads = 8;  // query heads a weighted-sum pass holds (more: several passes)
#else
using L = kvserve::F32x8;
constexpr int kAccRegs = 12;  // of 16
// Three heads a pass, so that a pass holds column slices of 4 vectors (12 accumulators): on a Zen 3 host one step's
// decode attention over 16k cached tokens at Qwen2.5-0.5B's shapes (7 heads a KV head) took 2-7% less than in one
// pass of all 7 heads, one vector of columns at a time (scripts/ab_decode_attention_depth.py, 1 and 2 threads).
constexpr int kMaxHeads = 3;
#endif
using V = L::V;
constexpr int64_t kLanes = L::kLanes;
constexpr int64_t kMinPart = 64;   // keys a part of a split context gets at least
// Keys a chunk: its K and V rows of a KV head (32 KB each at head_dim 64 in float32, 128 KB at 256) stay in L1/L2
// between the scores and the weighted sum. A constant, so that the weight of head g and key j sits at a fixed
// offset from one pointer (a run-time row length put the heads' row pointers in spilled registers).
constexpr int64_t kChunk = 128;

// Per-thread scratch, kept between calls (the threads of OpenMP's pool persist). Per query head unless said.
struct Scratch {
    std::vector<float> qs;           // [heads, dim]: the queries times the softmax scale
    std::vector<float> s;            // [heads, kChunk]: scores, then softmax weights
    std::vector<float> o;            // [heads, dim]: the running weighted sums of V
    std::vector<float> m, l, alpha;  // [heads]: running max, running sum, this chunk's rescale
    std::vector<float> tile;         // [kLanes, dim]: K rows converted to float32
    std::vector<float> kscale;       // [kv_heads, kChunk]: each key's K scale (8-bit caches)
    std::vector<float> vscale;       // [kv_heads, kChunk]
    std::vector<int64_t> slot;       // [kChunk]: each key's slot in the cache
    std::vector<const void*> krow;   // heads-on-lanes path: [kv_heads, kChunk]: each key's K row
    std::vector<const void*> vrow;   // [kv_heads, kChunk]: each key's V row
    std::vector<const char*> ahead;  // [kChunk]: the next chunk's slots (K, then V at `v_offset`), prefetched meanwhile
    std::vector<uint32_t> qp;        // bfloat16 path: [heads, padded dim / 2] the scaled queries as bfloat16 pairs
    std::vector<uint32_t> pp;        // bfloat16 path: [heads, kChunk / 2] the softmax weights as bfloat16 pairs
    std::vector<uint32_t> kt;        // bfloat16 path: [padded dim / 2, 32] a tile's K, pairs of dims by key
};

// The next chunk's K and V rows, prefetched into L2 a few cache lines at a time from inside the arithmetic's loops
// (step), so that the requests spread over the chunk's compute. Issued in bursts (all of a tile's share before its
// scores, as an earlier version did), they filled the core's queue of outstanding misses and stalled the loads of the
// chunk being computed: one decode step's attention over 16k tokens on the instruct model's shapes (24 layers' caches,
// scripts/ab_decode_attention_depth.py; Zen 5, 2 threads) took 15.0 ms on a float32 cache against 19.2, 12.5 against
// 18.0 on a float16 one. (Every other line, or only each block's first lines for the hardware's streamer to follow,
// were slower still: the rows of a KV head are 128-512 bytes apart, too sparse for it.) The lines are spread evenly
// over the steps (a running credit, as a line is drawn from integer steps), not one or more at each step until
// they run out: rounded up to one a step, the next chunk's 1,024 lines (bfloat16, Qwen2.5-0.5B's shapes) went out
// in the first 45% of the chunk's 2,304 steps; evenly, the same 24 layers' attention on a Zen 3 host took a median
// 37.9 / 37.3 ms against 41.8 / 40.6 at 16k (200 alternated repeats, twice), 11.9 against 12.8 at 4k, 70.7 against
// 77.5 at 32k. Prefetching two chunks ahead instead was slower (45.1 / 43.0 at 16k).
struct LinePrefetcher {
    const char* const* slot = nullptr;  // each slot's K row (all KV heads); its V row `v_offset` bytes on
    int64_t slots = 0, lines = 0, v_offset = 0;  // lines: a slot's K (or V) row in cache lines
    int64_t total = 0, steps = 1, credit = 0;    // lines to fetch in all, over `steps` steps
    int64_t j = 0, line = 0;                     // line: 0 .. 2 lines, K's then V's
    __attribute__((always_inline)) void step() {
        credit += total;
        while (credit >= steps && j < slots) {
            const char* p = slot[j] + (line < lines ? 64 * line : v_offset + 64 * (line - lines));
            _mm_prefetch(p, _MM_HINT_T1);
            if (++line == 2 * lines) line = 0, ++j;
            credit -= steps;
        }
    }
    void rest() {  // whatever the steps left
        credit = total * steps;
        step();
    }
};

// out(j, slot) for the slots of a sequence's positions [pos, pos + n) (its block table `table`), block by block (no
// division a key).
template <typename Out>
__attribute__((always_inline)) inline void slots_of(const int64_t* table, int64_t block_size, int64_t pos, int64_t n,
                                                    Out&& out) {
    int64_t block = pos / block_size, off = pos % block_size;
    for (int64_t j = 0; j < n;) {
        const int64_t base = table[block] * block_size, run = std::min(n - j, block_size - off);
        for (int64_t i = 0; i < run; ++i) out(j + i, base + off + i);
        j += run, ++block, off = 0;
    }
}

// The prefetcher of the next chunk's n slots (positions from pos; their K rows into ahead[]), its lines spread over
// `steps` steps of this chunk's loops. A slot's K row (every KV head) is slot_bytes long, its V row v_offset on.
inline LinePrefetcher next_chunk(const int64_t* table, int64_t block_size, int64_t pos, int64_t n, const char* k_cache,
                                 int64_t slot_bytes, int64_t v_offset, int64_t steps, const char** ahead) {
    slots_of(table, block_size, pos, n, [&](int64_t j, int64_t slot) { ahead[j] = k_cache + slot * slot_bytes; });
    LinePrefetcher pf;
    pf.slot = ahead, pf.slots = n, pf.lines = (slot_bytes + 63) / 64, pf.v_offset = v_offset;
    pf.total = 2 * pf.lines * n, pf.steps = std::max<int64_t>(steps, 1);
    return pf;
}

// s[t] = q . k_t over the first `dims` (a multiple of kLanes) elements, for the kLanes rows k + t * stride: a vector of
// q against the same slice of every row, the rows addressed four at a time from one pointer (16 row pointers, as a
// first version had, spilled the general registers). Inlined, so that the kLanes sums stay in registers through
// simd.h's sum_lanes.
__attribute__((always_inline)) inline V dots(const float* q, const float* k, int64_t stride, int64_t dims) {
    V acc[kLanes];
    for (int t = 0; t < kLanes; ++t) acc[t] = L::zero();
    for (int64_t d = 0; d < dims; d += kLanes) {
        const V qv = L::load(q + d);
        const float* p = k + d;
        for (int t = 0; t < kLanes; t += 4, p += 4 * stride) {
            acc[t] = L::fmadd(qv, L::load(p), acc[t]);
            acc[t + 1] = L::fmadd(qv, L::load(p + stride), acc[t + 1]);
            acc[t + 2] = L::fmadd(qv, L::load(p + 2 * stride), acc[t + 2]);
            acc[t + 3] = L::fmadd(qv, L::load(p + 3 * stride), acc[t + 3]);
        }
    }
    return L::sum_lanes(acc);
}

// o[g][c0 .. c0 + W vectors) = alpha[g] o[g][...] + sum over the n keys of p[g * ld + j] V_j[...], for G heads.
template <typename E, int G, int W>
inline void weighted_columns(const float* p, const void* const* vrow, int64_t n, int64_t c0, const float* alpha,
                             float* o, int64_t dim, LinePrefetcher& pf) {
    V acc[G][W];
    for (int g = 0; g < G; ++g) {
        const V a = L::set1(alpha[g]);
        for (int w = 0; w < W; ++w) acc[g][w] = L::mul(L::load(o + g * dim + c0 + w * kLanes), a);
    }
    LinePrefetcher ahead = pf;  // a local copy, held in registers across the loop
    for (int64_t j = 0; j < n; ++j) {
        ahead.step();
        const typename E::T* row = static_cast<const typename E::T*>(vrow[j]) + c0;
        V vv[W];
        for (int w = 0; w < W; ++w) vv[w] = L::template load_kv<E>(row + w * kLanes);
        for (int g = 0; g < G; ++g) {
            const V pj = L::set1(p[g * kChunk + j]);
            for (int w = 0; w < W; ++w) acc[g][w] = L::fmadd(pj, vv[w], acc[g][w]);
        }
    }
    for (int g = 0; g < G; ++g)
        for (int w = 0; w < W; ++w) L::store(o + g * dim + c0 + w * kLanes, acc[g][w]);
    pf = ahead;
}

// The widest column slice, in vectors (4, 2 or 1), whose accumulators for a weighted-sum pass's heads (at most
// kMaxHeads of `group`) fit kAccRegs.
inline int column_vectors(int64_t group) {
    const int64_t heads = std::min<int64_t>(group, kMaxHeads);
    return heads * 4 <= kAccRegs ? 4 : heads * 2 <= kAccRegs ? 2 : 1;
}

// The chunk's weighted sum of V for all `group` heads: column slices of column_vectors(group), then narrower, heads
// in even passes of at most kMaxHeads; columns past the last whole vector (a head size that is no multiple of kLanes)
// one at a time.
template <typename E>
void weighted_sum(int64_t group, const float* p, const void* const* vrow, int64_t n, const float* alpha, float* o,
                  int64_t dim, LinePrefetcher& pf) {
    const int64_t vecs = dim / kLanes;
    const int wide = column_vectors(group);
    const int64_t passes = (group + kMaxHeads - 1) / kMaxHeads;
    for (int64_t pass = 0; pass < passes; ++pass) {
        const int64_t g0 = pass * group / passes, g1 = (pass + 1) * group / passes;
        const float* pg = p + g0 * kChunk;
        float* og = o + g0 * dim;
        int64_t v = 0;
        auto columns = [&](auto W) {  // W vectors of columns from v, for the pass's heads
            kvserve::with_count<kMaxHeads>(g1 - g0, [&](auto G) {
                weighted_columns<E, decltype(G)::value, decltype(W)::value>(pg, vrow, n, v * kLanes, alpha + g0, og,
                                                                             dim, pf);
            });
        };
        for (; wide >= 4 && v + 4 <= vecs; v += 4) columns(std::integral_constant<int, 4>{});
        for (; wide >= 2 && v + 2 <= vecs; v += 2) columns(std::integral_constant<int, 2>{});
        for (; v < vecs; ++v) columns(std::integral_constant<int, 1>{});
    }
    for (int64_t d = vecs * kLanes; d < dim; ++d)
        for (int64_t g = 0; g < group; ++g) {
            float acc = o[g * dim + d] * alpha[g];
            for (int64_t j = 0; j < n; ++j)
                acc += p[g * kChunk + j] * E::load1(static_cast<const typename E::T*>(vrow[j]) + d);
            o[g * dim + d] = acc;
        }
}

#if defined(__AVX512BF16__)
// The bfloat16 dot-product path. A head's dims go by blocks of 32 (one 64-byte vector of a row; a last partial block is
// loaded masked, its missing dims 0), which vdpbf16ps takes as 16 pairs of dimensions.
constexpr bool kBf16DotProducts = true;
inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }

// The dims of block blk (dims [32 blk, 32 blk + 32)) that a row of `dim` has, as a mask of 16-bit elements.
inline __mmask32 block_mask(int64_t blk, int64_t dim) {
    const int64_t left = dim - 32 * blk;
    return left >= 32 ? ~__mmask32{0} : (__mmask32{1} << left) - 1;
}

// r[k] (16 vectors of 16 32-bit lanes) -> r[j] lane k = the old r[k] lane j: unpacks of 32- then 64-bit elements
// within the 128-bit lanes, then the 128-bit lanes moved across by two levels of shuffles (64 operations).
__attribute__((always_inline)) inline void transpose16(__m512i* r) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; ++i) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // b[4i + m] lane L = rows 4i .. 4i + 3 at column 4L + m
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int m = 0; m < 4; ++m) {  // column 4L + m: lane L of b[m], b[4 + m], b[8 + m], b[12 + m]
        const __m512i c0 = _mm512_shuffle_i32x4(b[m], b[4 + m], 0x88), c1 = _mm512_shuffle_i32x4(b[m], b[4 + m], 0xDD);
        const __m512i c2 = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0x88);
        const __m512i c3 = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0xDD);
        r[m] = _mm512_shuffle_i32x4(c0, c2, 0x88), r[4 + m] = _mm512_shuffle_i32x4(c1, c3, 0x88);
        r[8 + m] = _mm512_shuffle_i32x4(c0, c2, 0xDD), r[12 + m] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
    }
}

// 32 keys' K rows (bfloat16, `dim`; k[t] for key t) -> kt[p * 32 + t] = key t's pair of dims p (kt: `pairs` = dim
// rounded up to 32, halved, pairs of 32 lanes): each block of 32 dims of 16 rows loaded (masked past dim, so 0) and
// transposed in registers. Done once per tile and KV head, for all the heads of its group.
inline void transpose_keys_bf16(const uint16_t* const* k, int64_t dim, uint32_t* kt) {
    for (int half = 0; half < 2; ++half)
        for (int64_t blk = 0; blk * 32 < dim; ++blk) {
            const __mmask32 mask = block_mask(blk, dim);
            __m512i r[16];
            for (int t = 0; t < 16; ++t) r[t] = _mm512_maskz_loadu_epi16(mask, k[16 * half + t] + 32 * blk);
            transpose16(r);
            for (int j = 0; j < 16; ++j) _mm512_storeu_si512(kt + (16 * blk + j) * 32 + 16 * half, r[j]);
        }
}

// s[g * kChunk + t] = q_g . k_t for G heads and the 32 keys of kt (transpose_keys_bf16), over `pairs` pairs of dims:
// each head's pair (qp: the heads' pairs, `pairs` apart, 0 past dim) broadcast against the keys' pair, 2 G
// independent sums.
template <int G>
inline void scores_bf16(const uint32_t* qp, int64_t pairs, const uint32_t* kt, float* s, LinePrefetcher& pf) {
    __m512 acc0[G], acc1[G];
    for (int g = 0; g < G; ++g) acc0[g] = _mm512_setzero_ps(), acc1[g] = _mm512_setzero_ps();
    LinePrefetcher ahead = pf;  // a local copy, held in registers across the loop
    for (int64_t p = 0; p < pairs; ++p) {
        ahead.step();
        const __m512bh k0 = as_bh(_mm512_loadu_si512(kt + 32 * p)), k1 = as_bh(_mm512_loadu_si512(kt + 32 * p + 16));
        for (int g = 0; g < G; ++g) {
            const __m512bh qv = as_bh(_mm512_set1_epi32(static_cast<int>(qp[g * pairs + p])));
            acc0[g] = _mm512_dpbf16_ps(acc0[g], k0, qv);
            acc1[g] = _mm512_dpbf16_ps(acc1[g], k1, qv);
        }
    }
    for (int g = 0; g < G; ++g) {
        _mm512_storeu_ps(s + g * kChunk, acc0[g]);
        _mm512_storeu_ps(s + g * kChunk + 16, acc1[g]);
    }
    pf = ahead;
}

// o[g][block c0 / 32 ..) = alpha[g] o[g] + sum over the keys of p[g][j] V_j, for G heads and W / 2 blocks of 32 dims
// from dim c0, the keys in pairs: two rows' blocks interleaved by 16-bit unpacks (within 128-bit lanes), so that o
// holds each block's dims permuted (lanes 0-15: dims 0-3, 8-11, 16-19, 24-27; lanes 16-31: 4-7, 12-15, ...; see
// unpermute_bf16). pp[g * (kChunk / 2) + j2]: head g's weights of keys 2 j2 and 2 j2 + 1 as a bfloat16 pair.
template <int G, int W>
inline void weighted_columns_bf16(const uint32_t* pp, const void* const* vrow, int64_t n, int64_t c0,
                                  const float* alpha, float* o, int64_t odim, int64_t dim, LinePrefetcher& pf) {
    __m512 acc[G][W];
    for (int g = 0; g < G; ++g) {
        const __m512 a = _mm512_set1_ps(alpha[g]);
        for (int w = 0; w < W; ++w) acc[g][w] = _mm512_mul_ps(_mm512_loadu_ps(o + g * odim + c0 + 16 * w), a);
    }
    __mmask32 mask[W / 2];
    for (int w = 0; w < W; w += 2) mask[w / 2] = block_mask(c0 / 32 + w / 2, dim);
    LinePrefetcher ahead = pf;  // a local copy, held in registers across the loop
    for (int64_t j2 = 0; 2 * j2 < n; ++j2) {  // an odd last key pairs with itself, at weight 0
        ahead.step();
        const uint16_t* r0 = static_cast<const uint16_t*>(vrow[2 * j2]);
        const uint16_t* r1 = static_cast<const uint16_t*>(vrow[2 * j2 + 1 < n ? 2 * j2 + 1 : 2 * j2]);
        __m512i vv[W];
        for (int w = 0; w < W; w += 2) {
            const __m512i x0 = _mm512_maskz_loadu_epi16(mask[w / 2], r0 + c0 + 16 * w);
            const __m512i x1 = _mm512_maskz_loadu_epi16(mask[w / 2], r1 + c0 + 16 * w);
            vv[w] = _mm512_unpacklo_epi16(x0, x1), vv[w + 1] = _mm512_unpackhi_epi16(x0, x1);
        }
        for (int g = 0; g < G; ++g) {
            const __m512i pj = _mm512_set1_epi32(static_cast<int>(pp[g * (kChunk / 2) + j2]));
            for (int w = 0; w < W; ++w) acc[g][w] = _mm512_dpbf16_ps(acc[g][w], as_bh(pj), as_bh(vv[w]));
        }
    }
    for (int g = 0; g < G; ++g)
        for (int w = 0; w < W; ++w) _mm512_storeu_ps(o + g * odim + c0 + 16 * w, acc[g][w]);
    pf = ahead;
}

// The chunk's weighted sum of V for all `group` heads (o: `odim` = dim rounded up to 32 floats a head): blocks of 64
// dims where column_vectors allows 4 vectors, else of 32; heads in even passes.
inline void weighted_sum_bf16(int64_t group, const uint32_t* pp, const void* const* vrow, int64_t n,
                              const float* alpha, float* o, int64_t odim, int64_t dim, LinePrefetcher& pf) {
    const int64_t passes = (group + kMaxHeads - 1) / kMaxHeads;
    const bool wide = column_vectors(group) == 4;
    for (int64_t pass = 0; pass < passes; ++pass) {
        const int64_t g0 = pass * group / passes, g1 = (pass + 1) * group / passes;
        int64_t c = 0;
        auto columns = [&](auto W) {  // W / 2 blocks of 32 dims from c, for the pass's heads
            kvserve::with_count<kMaxHeads>(g1 - g0, [&](auto G) {
                weighted_columns_bf16<decltype(G)::value, decltype(W)::value>(pp + g0 * (kChunk / 2), vrow, n, c,
                                                                               alpha + g0, o + g0 * odim, odim, dim, pf);
            });
        };
        for (; wide && c + 64 <= odim; c += 64) columns(std::integral_constant<int, 4>{});
        for (; c < odim; c += 32) columns(std::integral_constant<int, 2>{});
    }
}

// A head's queries times the softmax scale as bfloat16 pairs (rounded to nearest even), padded with 0 to `qld` pairs.
inline void pack_query_bf16(const float* q, int64_t dim, float scale, int64_t qld, uint32_t* qp) {
    alignas(64) float x[32];
    for (int64_t d = 0; d < 2 * qld; d += 32) {
        for (int i = 0; i < 32; ++i) x[i] = d + i < dim ? q[d + i] * scale : 0.0f;
        const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_load_ps(x + 16), _mm512_load_ps(x));
        _mm512_storeu_si512(qp + d / 2, reinterpret_cast<__m512i>(h));
    }
}

// A head's vec_n weights (a multiple of 16; 0 past the chunk's keys) -> bfloat16 pairs of keys, 0 up to 32.
inline void pack_weights_bf16(const float* p, int64_t vec_n, uint32_t* pp) {
    for (int64_t j = 0; j < vec_n; j += 32) {
        const __m512 lo = _mm512_loadu_ps(p + j), hi = j + 16 < vec_n ? _mm512_loadu_ps(p + j + 16) : _mm512_setzero_ps();
        _mm512_storeu_si512(pp + j / 2, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
}

// A head's weighted sum as weighted_columns_bf16 left it (each block of 32 dims permuted) -> dims in order.
inline void unpermute_bf16(const float* o, int64_t dim, float* out) {
    for (int64_t d = 0; d < dim; ++d) {
        const int64_t e = d % 32, lane = e / 8, r = e % 8;
        out[d] = o[d - e + (r < 4 ? 0 : 16) + 4 * lane + r % 4];
    }
}
#else
constexpr bool kBf16DotProducts = false;
#endif

// The passes over a chunk's keys that weighted_sum (bf16: weighted_sum_bf16) makes for `group` heads of `dim` sums:
// head passes x column slices (dims past the last whole vector, done one at a time, excepted).
inline int64_t weighted_passes(int64_t group, int64_t dim, bool bf16) {
    const int64_t head_passes = (group + kMaxHeads - 1) / kMaxHeads;
    const int wide = column_vectors(group);
    if (bf16) return head_passes * (wide == 4 ? dim / 64 + dim % 64 / 32 : dim / 32);
    const int64_t vecs = dim / kLanes;
    return head_passes * (wide == 4 ? vecs / 4 + vecs % 4 / 2 + vecs % 2 : wide == 2 ? vecs / 2 + vecs % 2 : vecs);
}

// Keys [first, last) of sequence b, every KV head -> part[g] = (max, sum, weighted V [dim]) for each query head g.
// An item reads whole slots (all KV heads of a token are adjacent in the cache), block after block.
template <typename E>
void attend_part(const KvserveDecodeAttention& a, int64_t b, int64_t first, int64_t last, Scratch& sc, float* part) {
    using T = typename E::T;
    const int64_t heads = a.heads, kv_heads = a.kv_heads, group = heads / kv_heads;
    const int64_t dim = a.dim, dims = dim / kLanes * kLanes, block_size = a.block_size, stride = kv_heads * dim;
    const int64_t* table = a.block_tables + b * a.table_width;
    const T* k_cache = static_cast<const T*>(a.k_cache);
    const T* v_cache = static_cast<const T*>(a.v_cache);
    const float scale = static_cast<float>(a.scale);
    const float* q = a.q + b * heads * dim;
    // The scratch's arrays by pointer: the pointers stored into them would otherwise make the compiler reload each
    // vector's own pointer (through the thread-local's address) after every store.
    int64_t* const slots = sc.slot.data();
    const void** const vrows = sc.vrow.data();
    const char** const ahead = sc.ahead.data();
    float* const scores = sc.s.data();
    float* const kscales = sc.kscale.data();
    float* const vscales = sc.vscale.data();
    // The bfloat16 dot-product path (kBf16DotProducts) keeps each head's sums in whole blocks of 32 dims (odim).
    const bool pairs = kBf16DotProducts && std::is_same_v<E, kvserve::kv::Bfloat16> && dim % 16 == 0;
    const int64_t odim = pairs ? (dim + 31) / 32 * 32 : dim, qld = odim / 2;
#if defined(__AVX512BF16__)
    if (pairs)
        for (int64_t g = 0; g < heads; ++g) pack_query_bf16(q + g * dim, dim, scale, qld, sc.qp.data() + g * qld);
#endif
    if (!pairs)
        for (int64_t i = 0; i < heads * dim; ++i) sc.qs[i] = q[i] * scale;
    std::fill(sc.o.begin(), sc.o.begin() + heads * odim, 0.0f);
    std::fill(sc.m.begin(), sc.m.begin() + heads, -INFINITY);
    std::fill(sc.l.begin(), sc.l.begin() + heads, 0.0f);
    const int64_t slot_bytes = stride * static_cast<int64_t>(sizeof(T));
    const char* const k_bytes = reinterpret_cast<const char*>(k_cache);
    const int64_t v_offset = reinterpret_cast<const char*>(v_cache) - k_bytes;
    // Chunks end at multiples of kLanes positions, so that after the first one each run of kLanes keys lies in one
    // block wherever blocks hold a multiple of kLanes tokens, and is read in place (float32).
    for (int64_t c0 = first; c0 < last;) {
        const int64_t c1 = std::min(last, (c0 / kLanes) * kLanes + kChunk), n = c1 - c0;
        slots_of(table, block_size, c0, n, [&](int64_t j, int64_t slot) {
            slots[j] = slot;
            for (int64_t h = 0; h < kv_heads; ++h) {
                const int64_t row = slot * kv_heads + h;
                vrows[h * kChunk + j] = v_cache + row * dim;
                if constexpr (E::kScaled) {
                    kscales[h * kChunk + j] = a.k_scales[row] * E::kUnit;
                    vscales[h * kChunk + j] = a.v_scales[row] * E::kUnit;
                }
            }
        });
        const int64_t tiles = (n + kLanes - 1) / kLanes;
        // The steps of this chunk (LinePrefetcher): on the bfloat16 path each pair of dims of a 32-key tile's scores
        // and each key pair of a weighted-sum pass; else each head's scores of a tile and each key of a pass.
        const int64_t steps = kv_heads * (pairs ? (group + kMaxHeads - 1) / kMaxHeads * (n + 31) / 32 * qld +
                                                      (n + 1) / 2 * weighted_passes(group, odim, true)
                                                : tiles * group + n * weighted_passes(group, dim, false));
        // the next chunk's slots, prefetched meanwhile
        LinePrefetcher pf = next_chunk(table, block_size, c1, std::min(last, c1 + kChunk) - c1, k_bytes, slot_bytes,
                                       v_offset, steps, ahead);
        for (int64_t h = 0; h < kv_heads; ++h) {
            // Scores of the group's heads, kLanes keys at a time (the bfloat16 path: 32); lanes past the chunk's end
            // get -inf.
            const int64_t tile_keys = pairs ? 32 : kLanes;
            for (int64_t t0 = 0; t0 < n; t0 += tile_keys) {
                const int64_t nt = std::min(tile_keys, n - t0);
#if defined(__AVX512BF16__)
                if (pairs) {  // missing rows repeat the first (their lanes are masked)
                    const uint16_t* rows[32];
                    for (int64_t t = 0; t < 32; ++t)
                        rows[t] = reinterpret_cast<const uint16_t*>(k_cache +
                                                                    (slots[t0 + (t < nt ? t : 0)] * kv_heads + h) * dim);
                    transpose_keys_bf16(rows, dim, sc.kt.data());
                    for (int64_t g0 = h * group; g0 < (h + 1) * group; g0 += kMaxHeads)
                        kvserve::with_count<kMaxHeads>((h + 1) * group - g0, [&](auto G) {
                            scores_bf16<decltype(G)::value>(sc.qp.data() + g0 * qld, qld, sc.kt.data(),
                                                            scores + g0 * kChunk + t0, pf);
                        });
                    for (int64_t g = h * group; g < (h + 1) * group; ++g)
                        for (int64_t t = nt; t < 32; ++t) scores[g * kChunk + t0 + t] = -INFINITY;
                    continue;
                }
#endif
                const float* base;
                int64_t row_stride;
                const T* k0 = k_cache + (slots[t0] * kv_heads + h) * dim;
                if (std::is_same_v<E, kvserve::kv::Float32> && nt == kLanes &&
                    (c0 + t0) / block_size == (c0 + t0 + kLanes - 1) / block_size) {
                    base = reinterpret_cast<const float*>(k0), row_stride = stride;  // one block's rows, in place
                } else {
                    for (int64_t t = 0; t < kLanes; ++t) {  // missing rows repeat the first (their lanes are masked)
                        const T* src = k_cache + (slots[t0 + (t < nt ? t : 0)] * kv_heads + h) * dim;
                        float* dst = sc.tile.data() + t * dim;
                        int64_t d = 0;
                        for (; d < dims; d += kLanes) L::store(dst + d, L::template load_kv<E>(src + d));
                        for (; d < dim; ++d) dst[d] = E::load1(src + d);
                    }
                    base = sc.tile.data(), row_stride = dim;
                }
                for (int64_t g = h * group; g < (h + 1) * group; ++g) {
                    pf.step();
                    float* sg = scores + g * kChunk + t0;
                    const float* qg = sc.qs.data() + g * dim;
                    V sv = dims ? dots(qg, base, row_stride, dims) : L::zero();
                    if (dims < dim) {  // a head size that is no multiple of kLanes: the rest of each dot product
                        alignas(64) float tail[kLanes];
                        for (int64_t t = 0; t < kLanes; ++t) {
                            float r = 0.0f;
                            for (int64_t d = dims; d < dim; ++d) r += qg[d] * base[t * row_stride + d];
                            tail[t] = r;
                        }
                        sv = L::add(sv, L::load(tail));
                    }
                    if constexpr (E::kScaled) sv = L::mul(sv, L::load(kscales + h * kChunk + t0));
                    L::store(sg, sv);
                    for (int64_t t = nt; t < kLanes; ++t) sg[t] = -INFINITY;
                }
            }
            // The online softmax over the chunk, per head: scores -> weights exp(s - max), earlier sums rescaled.
            const int64_t vec_n = tiles * kLanes;
            for (int64_t g = h * group; g < (h + 1) * group; ++g) {
                float* sg = scores + g * kChunk;
                V mx = L::load(sg);
                for (int64_t j = kLanes; j < vec_n; j += kLanes) mx = L::max(mx, L::load(sg + j));
                const float m_new = std::max(sc.m[g], L::hmax(mx));
                sc.alpha[g] = expf(sc.m[g] - m_new);  // 0 for the first chunk (m = -inf), whose sums are 0 anyway
                const V mv = L::set1(m_new);
                V sum = L::zero();
                for (int64_t j = 0; j < vec_n; j += kLanes) {
                    V e = L::exp(L::sub(L::load(sg + j), mv));
                    if (j + kLanes > n) {  // the lanes past the chunk's end: weight 0 (exp of -inf is clamped)
                        alignas(64) float lanes[kLanes];
                        L::store(lanes, e);
                        for (int64_t i = n - j; i < kLanes; ++i) lanes[i] = 0.0f;
                        e = L::load(lanes);
                    }
                    sum = L::add(sum, e);
                    if constexpr (E::kScaled)  // V's scales ride on the weights, after their sum
                        e = L::mul(e, L::load(vscales + h * kChunk + j));
                    L::store(sg + j, e);
                }
                sc.l[g] = sc.l[g] * sc.alpha[g] + L::hsum(sum);
                sc.m[g] = m_new;
#if defined(__AVX512BF16__)
                if (pairs) pack_weights_bf16(sg, vec_n, sc.pp.data() + g * (kChunk / 2));
#endif
            }
#if defined(__AVX512BF16__)
            if (pairs) {
                weighted_sum_bf16(group, sc.pp.data() + h * group * (kChunk / 2), vrows + h * kChunk, n,
                                  sc.alpha.data() + h * group, sc.o.data() + h * group * odim, odim, dim, pf);
                continue;
            }
#endif
            weighted_sum<E>(group, scores + h * group * kChunk, vrows + h * kChunk, n,
                            sc.alpha.data() + h * group, sc.o.data() + h * group * dim, dim, pf);
        }
        pf.rest();
        c0 = c1;
    }
    const int64_t stride_out = dim + 2;
    for (int64_t g = 0; g < heads; ++g) {
        float* pg = part + g * stride_out;
        pg[0] = sc.m[g];
        pg[1] = sc.l[g];
#if defined(__AVX512BF16__)
        if (pairs) {
            unpermute_bf16(sc.o.data() + g * odim, dim, pg + 2);
            continue;
        }
#endif
        memcpy(pg + 2, sc.o.data() + g * dim, dim * sizeof(float));
    }
}

#if !defined(__AVX512F__)
// The heads-on-lanes path (AVX2; a group of at least kMinLaneHeads query heads a KV head, head size a multiple of
// 16). Where the keys-on-lanes path above widens each tile of K into float32 in memory, then reads it once per head
// and reduces 8 sums a key per head, this one reads each K row once, converted in registers, against every head of
// the group (the queries are FMA's memory operands), and one tree of shuffles (sum_lanes) turns the group's 8
// accumulators into one vector of scores: lane g is head g's. The online softmax then runs down the keys with the
// heads on the lanes (one exp a key for the whole group, no horizontal max or sum), and each weight is broadcast from
// its lane into the weighted sum of V. A row is read 16 values at a time (load16): a bfloat16 row as the even and the
// odd elements of one 32-byte load, by a shift and a mask (one operation a vector of 8 where a widening takes two),
// the queries permuted to match and the weighted sums put back in order once a part.
constexpr int64_t kMinLaneHeads = 4;  // fewer: most of a score vector's lanes would be idle
constexpr int kLaneHeads = 8;         // heads a pass of scores holds (a vector's lanes)
constexpr int kSumHeads = 6;          // heads a weighted-sum pass holds: 6 x 2 accumulators, 2 V vectors, a weight

// 16 elements of a row -> two float32 vectors: bfloat16's even elements (lanes 0-7 of lo) and odd ones (hi), the
// other types' first and last 8 (bf16_order says which).
template <typename E>
__attribute__((always_inline)) inline void load16(const typename E::T* p, __m256& lo, __m256& hi) {
    if constexpr (std::is_same_v<E, kvserve::kv::Bfloat16>) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        lo = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
        hi = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
    } else {
        lo = E::load8(p), hi = E::load8(p + 8);
    }
}

// A head's `dim` values in load16's order (bfloat16: each block of 16 as its 8 even elements, then its 8 odd ones),
// times `scale`; and back (unpermute: in order again).
template <typename E>
inline void permute16(const float* x, int64_t dim, float scale, float* out) {
    for (int64_t b = 0; b < dim; b += 16)
        for (int64_t i = 0; i < 16; ++i)
            out[b + i] = scale * (std::is_same_v<E, kvserve::kv::Bfloat16> ? x[b + 2 * (i % 8) + i / 8] : x[b + i]);
}
template <typename E>
inline void unpermute16(const float* x, int64_t dim, float* out) {
    for (int64_t b = 0; b < dim; b += 16)
        for (int64_t i = 0; i < 16; ++i)
            out[b + i] = std::is_same_v<E, kvserve::kv::Bfloat16> ? x[b + (i % 2) * 8 + i / 2] : x[b + i];
}

// s[j * 8 + g] = q_g . k_j for the G heads at qs (their rows `dim` apart, in load16's order) and the n keys' rows;
// lanes G .. 7 get 0.
template <typename E, int G>
inline void lane_scores(const float* qs, const void* const* krow, int64_t n, int64_t dim, float* s,
                        LinePrefetcher& pf) {
    LinePrefetcher ahead = pf;
    for (int64_t j = 0; j < n; ++j) {
        ahead.step();
        const typename E::T* k = static_cast<const typename E::T*>(krow[j]);
        __m256 acc[kLaneHeads];
        for (int g = 0; g < kLaneHeads; ++g) acc[g] = _mm256_setzero_ps();
        for (int64_t d = 0; d < dim; d += 16) {
            __m256 lo, hi;
            load16<E>(k + d, lo, hi);
            for (int g = 0; g < G; ++g) {
                acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + g * dim + d), lo, acc[g]);
                acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + g * dim + d + 8), hi, acc[g]);
            }
        }
        _mm256_storeu_ps(s + 8 * j, kvserve::F32x8::sum_lanes(acc));
    }
    pf = ahead;
}

// o[g][d .. d + 16) = alpha[g] o[g][...] + sum over the n keys of s[j * 8 + g] V_j[...], for G heads.
template <typename E, int G>
inline void lane_weighted(const float* s, const void* const* vrow, int64_t n, int64_t d, const float* alpha, float* o,
                          int64_t dim, LinePrefetcher& pf) {
    __m256 acc[G][2];
    for (int g = 0; g < G; ++g) {
        const __m256 a = _mm256_set1_ps(alpha[g]);
        acc[g][0] = _mm256_mul_ps(_mm256_loadu_ps(o + g * dim + d), a);
        acc[g][1] = _mm256_mul_ps(_mm256_loadu_ps(o + g * dim + d + 8), a);
    }
    LinePrefetcher ahead = pf;
    for (int64_t j = 0; j < n; ++j) {
        ahead.step();
        __m256 lo, hi;
        load16<E>(static_cast<const typename E::T*>(vrow[j]) + d, lo, hi);
        for (int g = 0; g < G; ++g) {
            const __m256 w = _mm256_broadcast_ss(s + 8 * j + g);
            acc[g][0] = _mm256_fmadd_ps(w, lo, acc[g][0]);
            acc[g][1] = _mm256_fmadd_ps(w, hi, acc[g][1]);
        }
    }
    for (int g = 0; g < G; ++g) {
        _mm256_storeu_ps(o + g * dim + d, acc[g][0]);
        _mm256_storeu_ps(o + g * dim + d + 8, acc[g][1]);
    }
    pf = ahead;
}

// attend_part's job on the heads-on-lanes path.
template <typename E>
void attend_part_lanes(const KvserveDecodeAttention& a, int64_t b, int64_t first, int64_t last, Scratch& sc,
                       float* part) {
    using T = typename E::T;
    const int64_t heads = a.heads, kv_heads = a.kv_heads, group = heads / kv_heads, dim = a.dim;
    const int64_t block_size = a.block_size, stride = kv_heads * dim;
    const int64_t* table = a.block_tables + b * a.table_width;
    const T* k_cache = static_cast<const T*>(a.k_cache);
    const T* v_cache = static_cast<const T*>(a.v_cache);
    const float* q = a.q + b * heads * dim;
    const void** const krows = sc.krow.data();
    const void** const vrows = sc.vrow.data();
    const char** const ahead = sc.ahead.data();
    float* const s = sc.s.data();
    float* const o = sc.o.data();
    for (int64_t g = 0; g < heads; ++g)
        permute16<E>(q + g * dim, dim, static_cast<float>(a.scale), sc.qs.data() + g * dim);
    std::fill(o, o + heads * dim, 0.0f);
    std::fill(sc.m.begin(), sc.m.begin() + heads, -INFINITY);
    std::fill(sc.l.begin(), sc.l.begin() + heads, 0.0f);
    // Score passes of at most kLaneHeads heads, weighted-sum passes of at most kSumHeads, each split evenly.
    const int64_t lane_passes = (group + kLaneHeads - 1) / kLaneHeads;
    const int64_t slot_bytes = stride * static_cast<int64_t>(sizeof(T));
    const char* const k_bytes = reinterpret_cast<const char*>(k_cache);
    const int64_t v_offset = reinterpret_cast<const char*>(v_cache) - k_bytes;
    int64_t sum_passes = 0;  // weighted-sum passes over a chunk's keys, for the prefetcher's steps
    for (int64_t lp = 0; lp < lane_passes; ++lp) {
        const int64_t lg = (lp + 1) * group / lane_passes - lp * group / lane_passes;
        sum_passes += (lg + kSumHeads - 1) / kSumHeads * (dim / 16);
    }
    for (int64_t c0 = first; c0 < last;) {
        const int64_t c1 = std::min(last, c0 + kChunk), n = c1 - c0;
        slots_of(table, block_size, c0, n, [&](int64_t j, int64_t slot) {
            for (int64_t h = 0; h < kv_heads; ++h) {
                const int64_t row = slot * kv_heads + h;
                krows[h * kChunk + j] = k_cache + row * dim;
                vrows[h * kChunk + j] = v_cache + row * dim;
                if constexpr (E::kScaled) {
                    sc.kscale[h * kChunk + j] = a.k_scales[row] * E::kUnit;
                    sc.vscale[h * kChunk + j] = a.v_scales[row] * E::kUnit;
                }
            }
        });
        LinePrefetcher pf = next_chunk(table, block_size, c1, std::min(last, c1 + kChunk) - c1, k_bytes, slot_bytes,
                                       v_offset, kv_heads * n * (lane_passes + sum_passes), ahead);
        for (int64_t h = 0; h < kv_heads; ++h)
            for (int64_t lp = 0; lp < lane_passes; ++lp) {
                const int64_t g0 = h * group + lp * group / lane_passes;
                const int64_t lg = h * group + (lp + 1) * group / lane_passes - g0;
                kvserve::with_count<kLaneHeads>(lg, [&](auto G) {
                    lane_scores<E, decltype(G)::value>(sc.qs.data() + g0 * dim, krows + h * kChunk, n, dim, s, pf);
                });
                // The online softmax down the keys, a head a lane: the chunk's max, the earlier sums rescaled.
                __m256 mx = _mm256_set1_ps(-INFINITY);
                for (int64_t j = 0; j < n; ++j) {
                    __m256 sj = _mm256_loadu_ps(s + 8 * j);
                    if constexpr (E::kScaled) sj = _mm256_mul_ps(sj, _mm256_broadcast_ss(&sc.kscale[h * kChunk + j]));
                    _mm256_storeu_ps(s + 8 * j, sj);
                    mx = _mm256_max_ps(mx, sj);
                }
                alignas(32) float m_old[8] = {}, l_old[8] = {}, alpha[8], l_new[8], m_new[8];
                for (int64_t g = 0; g < lg; ++g) m_old[g] = sc.m[g0 + g], l_old[g] = sc.l[g0 + g];
                const __m256 mv = _mm256_max_ps(_mm256_load_ps(m_old), mx);
                // exp of (-inf) - m is clamped to exp(-87), and multiplies sums that are still 0
                const __m256 av = kvserve::exp256(_mm256_sub_ps(_mm256_load_ps(m_old), mv));
                __m256 sum = _mm256_setzero_ps();
                for (int64_t j = 0; j < n; ++j) {
                    __m256 e = kvserve::exp256(_mm256_sub_ps(_mm256_loadu_ps(s + 8 * j), mv));
                    sum = _mm256_add_ps(sum, e);
                    if constexpr (E::kScaled) e = _mm256_mul_ps(e, _mm256_broadcast_ss(&sc.vscale[h * kChunk + j]));
                    _mm256_storeu_ps(s + 8 * j, e);
                }
                _mm256_store_ps(l_new, _mm256_fmadd_ps(_mm256_load_ps(l_old), av, sum));
                _mm256_store_ps(alpha, av), _mm256_store_ps(m_new, mv);
                for (int64_t g = 0; g < lg; ++g) sc.m[g0 + g] = m_new[g], sc.l[g0 + g] = l_new[g];
                const int64_t sum_count = (lg + kSumHeads - 1) / kSumHeads;
                for (int64_t sp = 0; sp < sum_count; ++sp) {
                    const int64_t w0 = sp * lg / sum_count, w1 = (sp + 1) * lg / sum_count;
                    for (int64_t d = 0; d < dim; d += 16)
                        kvserve::with_count<kSumHeads>(w1 - w0, [&](auto G) {
                            lane_weighted<E, decltype(G)::value>(s + w0, vrows + h * kChunk, n, d, alpha + w0,
                                                                 o + (g0 + w0) * dim, dim, pf);
                        });
                }
            }
        pf.rest();
        c0 = c1;
    }
    const int64_t stride_out = dim + 2;
    for (int64_t g = 0; g < heads; ++g) {
        float* pg = part + g * stride_out;
        pg[0] = sc.m[g];
        pg[1] = sc.l[g];
        unpermute16<E>(o + g * dim, dim, pg + 2);
    }
}
#endif

template <typename E>
void decode_attention(const KvserveDecodeAttention& a) {
    const int64_t batch = a.batch, heads = a.heads, kv_heads = a.kv_heads, dim = a.dim;
    auto visible = [&](int64_t b) {  // [lo, len) of sequence b's keys
        const int64_t len = a.seq_lens[b];
        return std::pair<int64_t, int64_t>{a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0, len};
    };
    // Items: (sequence, part of its keys), in parts of kMinPart keys at least. One sequence: a part a thread (its parts
    // are equal, and each more costs a first chunk that nothing prefetched and a merge: two a thread made the 24
    // layers' attention of a step at 4k / 16k on a Zen 3 host 1.04-1.11x slower, medians of 200-300 alternated
    // repeats). Fewer sequences than twice the threads: about twice as many items as threads, so that sequences of
    // different lengths (or a thread that the OS parks for a while) leave their slack to the others.
    const int64_t threads = omp_get_max_threads();
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; ++b) longest = std::max(longest, visible(b).second - visible(b).first);
    const int64_t items_wanted = batch == 1 ? threads : 2 * threads;
    const int64_t splits = batch >= items_wanted ? 1
                                                 : std::clamp<int64_t>((longest + kMinPart - 1) / kMinPart, 1,
                                                                       (items_wanted + batch - 1) / batch);
    const int64_t stride_out = dim + 2;
    std::vector<float> partial(static_cast<size_t>(batch * splits * heads * stride_out));
#pragma omp parallel
    {
        thread_local Scratch sc;
        const int64_t odim = (dim + 31) / 32 * 32;  // the bfloat16 path's blocks of 32 dims
        sc.qs.resize(heads * dim), sc.o.resize(heads * odim), sc.s.resize(std::max(heads, int64_t{8}) * kChunk);
        sc.qp.resize(heads * odim / 2), sc.pp.resize(heads * kChunk / 2), sc.kt.resize(odim / 2 * 32);
        sc.m.resize(heads), sc.l.resize(heads), sc.alpha.resize(heads);
        sc.tile.resize(kLanes * dim), sc.kscale.resize(kv_heads * kChunk), sc.vscale.resize(kv_heads * kChunk);
        sc.slot.resize(kChunk), sc.krow.resize(kv_heads * kChunk), sc.vrow.resize(kv_heads * kChunk);
        sc.ahead.resize(kChunk);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < batch * splits; ++item) {
            const int64_t b = item / splits, part = item % splits;
            const auto [lo, len] = visible(b);
            // Parts at multiples of kLanes positions (their ends excepted), so that their chunks align.
            const int64_t base = lo / kLanes * kLanes;
            const int64_t per = ((len - base + splits - 1) / splits + kLanes - 1) / kLanes * kLanes;
            const int64_t first = std::max(lo, base + part * per), last = std::min(len, base + (part + 1) * per);
            float* out = partial.data() + item * heads * stride_out;
#if !defined(__AVX512F__)
            if (heads / kv_heads >= kMinLaneHeads && dim % 16 == 0) {
                attend_part_lanes<E>(a, b, first, std::max(first, last), sc, out);
                continue;
            }
#endif
            attend_part<E>(a, b, first, std::max(first, last), sc, out);
        }
        // Merge the parts of each (sequence, query head): each part's sums rescaled to their common max.
#pragma omp for schedule(static)
        for (int64_t row = 0; row < batch * heads; ++row) {
            const int64_t b = row / heads, g = row % heads;
            const float* first = partial.data() + (b * splits * heads + g) * stride_out;
            kvserve::merge_attention_parts(first, splits, heads * stride_out, dim, a.out + row * dim);
        }
    }
}

}  // namespace

extern "C" {

// The query of each sequence over its context (kernels.h: KvserveDecodeAttention).
void kvserve_paged_decode_attention(const KvserveDecodeAttention* a) {
    kvserve::kv::dispatch(a->kv_dtype, [&](auto type) { decode_attention<decltype(type)>(*a); });
}

}
