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
//   rescaled). The next chunk's slots are prefetched into L2 while one is computed.
// - Scores: the query heads sharing a KV head (GQA: 7 on Qwen2.5-0.5B) against kLanes keys at a time (16 with
//   AVX-512, 8 with AVX2): each key's dot product accumulates over head_dim in one register (one FMA per vector of
//   dims, the key's row read from L1), and the kLanes sums then reduce together by a tree of shuffles (simd.h's
//   sum_lanes: about 3 operations a key, where a horizontal sum takes 8). The rows come straight from a float32
//   cache; other types are first converted, kLanes rows at a time, into an L1 tile (each element once, whatever the
//   group size).
// - Weighted sum of V: the group's heads x a slice of columns accumulate in registers across the chunk's keys, each
//   V row converted in registers once (bf16 by a shift, fp16 and fp8 by F16C, int8 by a widening convert).
// - An 8-bit cache's K scale multiplies each score, its V scale each softmax weight (after their sum).
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "attention_merge.h"
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
#else
using L = kvserve::F32x8;
constexpr int kAccRegs = 12;  // of 16
#endif
using V = L::V;
constexpr int64_t kLanes = L::kLanes;
constexpr int kMaxHeads = 8;       // query heads a weighted-sum pass holds (more: several passes)
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
    std::vector<const void*> vrow;   // [kv_heads, kChunk]: each key's V row
    std::vector<const char*> ahead;  // [kChunk]: the next chunk's slots (K, then V at `v_offset`), prefetched meanwhile
};

// `bytes` at p into L2, every cache line: the next chunk's rows are fetched while this one is computed (its rows lie
// in blocks scattered over the cache, a few KB each, which the hardware prefetchers follow only within a block).
// Every other line was tried (the L2 fetching pairs): decode at 16k tokens of float16 KV took 47-52 ms a step on the
// instruct model against 40-43 with every line; into L1 instead of L2, 46-47.
__attribute__((always_inline)) inline void prefetch_bytes(const char* p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
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
                             float* o, int64_t dim) {
    V acc[G][W];
    for (int g = 0; g < G; ++g) {
        const V a = L::set1(alpha[g]);
        for (int w = 0; w < W; ++w) acc[g][w] = L::mul(L::load(o + g * dim + c0 + w * kLanes), a);
    }
    for (int64_t j = 0; j < n; ++j) {
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
}

template <typename E, int W>
inline void weighted_heads(int64_t g, const float* p, const void* const* vrow, int64_t n, int64_t c0,
                           const float* alpha, float* o, int64_t dim) {
    switch (g) {
        case 8: weighted_columns<E, 8, W>(p, vrow, n, c0, alpha, o, dim); break;
        case 7: weighted_columns<E, 7, W>(p, vrow, n, c0, alpha, o, dim); break;
        case 6: weighted_columns<E, 6, W>(p, vrow, n, c0, alpha, o, dim); break;
        case 5: weighted_columns<E, 5, W>(p, vrow, n, c0, alpha, o, dim); break;
        case 4: weighted_columns<E, 4, W>(p, vrow, n, c0, alpha, o, dim); break;
        case 3: weighted_columns<E, 3, W>(p, vrow, n, c0, alpha, o, dim); break;
        case 2: weighted_columns<E, 2, W>(p, vrow, n, c0, alpha, o, dim); break;
        default: weighted_columns<E, 1, W>(p, vrow, n, c0, alpha, o, dim); break;
    }
}

// The chunk's weighted sum of V for all `group` heads: column slices of 4, 2 or 1 vectors (the widest whose
// accumulators for up to kMaxHeads heads fit kAccRegs), heads in even passes of at most kMaxHeads; columns past the
// last whole vector (a head size that is no multiple of kLanes) one at a time.
template <typename E>
void weighted_sum(int64_t group, const float* p, const void* const* vrow, int64_t n, const float* alpha, float* o,
                  int64_t dim) {
    const int64_t vecs = dim / kLanes;
    const int64_t heads = std::min<int64_t>(group, kMaxHeads);
    const int wide = heads * 4 <= kAccRegs ? 4 : heads * 2 <= kAccRegs ? 2 : 1;
    const int64_t passes = (group + kMaxHeads - 1) / kMaxHeads;
    for (int64_t pass = 0; pass < passes; ++pass) {
        const int64_t g0 = pass * group / passes, g1 = (pass + 1) * group / passes;
        const float* pg = p + g0 * kChunk;
        float* og = o + g0 * dim;
        int64_t v = 0;
        for (; wide >= 4 && v + 4 <= vecs; v += 4)
            weighted_heads<E, 4>(g1 - g0, pg, vrow, n, v * kLanes, alpha + g0, og, dim);
        for (; wide >= 2 && v + 2 <= vecs; v += 2)
            weighted_heads<E, 2>(g1 - g0, pg, vrow, n, v * kLanes, alpha + g0, og, dim);
        for (; v < vecs; ++v) weighted_heads<E, 1>(g1 - g0, pg, vrow, n, v * kLanes, alpha + g0, og, dim);
    }
    for (int64_t d = vecs * kLanes; d < dim; ++d)
        for (int64_t g = 0; g < group; ++g) {
            float acc = o[g * dim + d] * alpha[g];
            for (int64_t j = 0; j < n; ++j)
                acc += p[g * kChunk + j] * E::load1(static_cast<const typename E::T*>(vrow[j]) + d);
            o[g * dim + d] = acc;
        }
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
    for (int64_t i = 0; i < heads * dim; ++i) sc.qs[i] = q[i] * scale;
    std::fill(sc.o.begin(), sc.o.begin() + heads * dim, 0.0f);
    std::fill(sc.m.begin(), sc.m.begin() + heads, -INFINITY);
    std::fill(sc.l.begin(), sc.l.begin() + heads, 0.0f);
    const int64_t slot_bytes = stride * static_cast<int64_t>(sizeof(T));
    const int64_t v_offset = reinterpret_cast<const char*>(v_cache) - reinterpret_cast<const char*>(k_cache);
    // The slots of positions [pos, pos + n) into out[], block by block (no division per key).
    auto slots_of = [&](int64_t pos, int64_t n, auto&& out) {
        int64_t block = pos / block_size, off = pos % block_size;
        for (int64_t j = 0; j < n;) {
            const int64_t base = table[block] * block_size, run = std::min(n - j, block_size - off);
            for (int64_t i = 0; i < run; ++i) out(j + i, base + off + i);
            j += run, ++block, off = 0;
        }
    };
    // Chunks end at multiples of kLanes positions, so that after the first one each run of kLanes keys lies in one
    // block wherever blocks hold a multiple of kLanes tokens, and is read in place (float32).
    for (int64_t c0 = first; c0 < last;) {
        const int64_t c1 = std::min(last, (c0 / kLanes) * kLanes + kChunk), n = c1 - c0;
        slots_of(c0, n, [&](int64_t j, int64_t slot) {
            sc.slot[j] = slot;
            for (int64_t h = 0; h < kv_heads; ++h) {
                const int64_t row = slot * kv_heads + h;
                sc.vrow[h * kChunk + j] = v_cache + row * dim;
                if constexpr (E::kScaled) {
                    sc.kscale[h * kChunk + j] = a.k_scales[row] * E::kUnit;
                    sc.vscale[h * kChunk + j] = a.v_scales[row] * E::kUnit;
                }
            }
        });
        const int64_t n_next = std::min(last, c1 + kChunk) - c1;  // the next chunk's slots, prefetched tile by tile
        slots_of(c1, n_next, [&](int64_t j, int64_t slot) {
            sc.ahead[j] = reinterpret_cast<const char*>(k_cache + slot * stride);
        });
        const int64_t tiles = (n + kLanes - 1) / kLanes, all_tiles = tiles * kv_heads;
        const int64_t ahead_per_tile = (n_next + all_tiles - 1) / all_tiles;
        for (int64_t h = 0; h < kv_heads; ++h) {
            // Scores of the group's heads, kLanes keys at a time; lanes past the chunk's end get -inf.
            for (int64_t t0 = 0; t0 < n; t0 += kLanes) {
                const int64_t nt = std::min(kLanes, n - t0);
                const int64_t a0 = (h * tiles + t0 / kLanes) * ahead_per_tile, a1 = std::min(n_next, a0 + ahead_per_tile);
                for (int64_t j = a0; j < a1; ++j) {
                    prefetch_bytes(sc.ahead[j], slot_bytes);
                    prefetch_bytes(sc.ahead[j] + v_offset, slot_bytes);
                }
                const float* base;
                int64_t row_stride;
                const T* k0 = k_cache + (sc.slot[t0] * kv_heads + h) * dim;
                if (std::is_same_v<E, kvserve::kv::Float32> && nt == kLanes &&
                    (c0 + t0) / block_size == (c0 + t0 + kLanes - 1) / block_size) {
                    base = reinterpret_cast<const float*>(k0), row_stride = stride;  // one block's rows, in place
                } else {
                    for (int64_t t = 0; t < kLanes; ++t) {  // missing rows repeat the first (their lanes are masked)
                        const T* src = k_cache + (sc.slot[t0 + (t < nt ? t : 0)] * kv_heads + h) * dim;
                        float* dst = sc.tile.data() + t * dim;
                        int64_t d = 0;
                        for (; d < dims; d += kLanes) L::store(dst + d, L::template load_kv<E>(src + d));
                        for (; d < dim; ++d) dst[d] = E::load1(src + d);
                    }
                    base = sc.tile.data(), row_stride = dim;
                }
                for (int64_t g = h * group; g < (h + 1) * group; ++g) {
                    float* sg = sc.s.data() + g * kChunk + t0;
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
                    if constexpr (E::kScaled) sv = L::mul(sv, L::load(sc.kscale.data() + h * kChunk + t0));
                    L::store(sg, sv);
                    for (int64_t t = nt; t < kLanes; ++t) sg[t] = -INFINITY;
                }
            }
            // The online softmax over the chunk, per head: scores -> weights exp(s - max), earlier sums rescaled.
            const int64_t vec_n = tiles * kLanes;
            for (int64_t g = h * group; g < (h + 1) * group; ++g) {
                float* sg = sc.s.data() + g * kChunk;
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
                        e = L::mul(e, L::load(sc.vscale.data() + h * kChunk + j));
                    L::store(sg + j, e);
                }
                sc.l[g] = sc.l[g] * sc.alpha[g] + L::hsum(sum);
                sc.m[g] = m_new;
            }
            weighted_sum<E>(group, sc.s.data() + h * group * kChunk, sc.vrow.data() + h * kChunk, n,
                            sc.alpha.data() + h * group, sc.o.data() + h * group * dim, dim);
        }
        c0 = c1;
    }
    const int64_t stride_out = dim + 2;
    for (int64_t g = 0; g < heads; ++g) {
        float* pg = part + g * stride_out;
        pg[0] = sc.m[g];
        pg[1] = sc.l[g];
        memcpy(pg + 2, sc.o.data() + g * dim, dim * sizeof(float));
    }
}

template <typename E>
void decode_attention(const KvserveDecodeAttention& a) {
    const int64_t batch = a.batch, heads = a.heads, kv_heads = a.kv_heads, dim = a.dim;
    auto visible = [&](int64_t b) {  // [lo, len) of sequence b's keys
        const int64_t len = a.seq_lens[b];
        return std::pair<int64_t, int64_t>{a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0, len};
    };
    // Items: (sequence, part of its keys). With fewer sequences than twice the threads, contexts are split so that
    // there are about that many items (a thread that the OS parks for a while leaves its share to the others), in
    // parts of kMinPart keys at least.
    const int64_t threads = omp_get_max_threads();
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; ++b) longest = std::max(longest, visible(b).second - visible(b).first);
    const int64_t splits = batch >= 2 * threads ? 1
                                                : std::clamp<int64_t>((longest + kMinPart - 1) / kMinPart, 1,
                                                                      (2 * threads + batch - 1) / batch);
    const int64_t stride_out = dim + 2;
    std::vector<float> partial(static_cast<size_t>(batch * splits * heads * stride_out));
#pragma omp parallel
    {
        thread_local Scratch sc;
        sc.qs.resize(heads * dim), sc.o.resize(heads * dim), sc.s.resize(heads * kChunk);
        sc.m.resize(heads), sc.l.resize(heads), sc.alpha.resize(heads);
        sc.tile.resize(kLanes * dim), sc.kscale.resize(kv_heads * kChunk), sc.vscale.resize(kv_heads * kChunk);
        sc.slot.resize(kChunk), sc.vrow.resize(kv_heads * kChunk), sc.ahead.resize(kChunk);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < batch * splits; ++item) {
            const int64_t b = item / splits, part = item % splits;
            const auto [lo, len] = visible(b);
            // Parts at multiples of kLanes positions (their ends excepted), so that their chunks align.
            const int64_t base = lo / kLanes * kLanes;
            const int64_t per = ((len - base + splits - 1) / splits + kLanes - 1) / kLanes * kLanes;
            const int64_t first = std::max(lo, base + part * per), last = std::min(len, base + (part + 1) * per);
            attend_part<E>(a, b, first, std::max(first, last), sc, partial.data() + item * heads * stride_out);
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
