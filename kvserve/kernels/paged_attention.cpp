// Decode attention straight on the paged KV cache (float32): one query token per sequence attends to its
// context, read through its block table, with no gathered copy of K and V.
//
// Why: the torch path gathers each sequence's K and V into new padded tensors every layer of every step and
// then calls SDPA; at decode those copies and the op overheads cost more than the attention arithmetic.
// Work items are (sequence, KV head) pairs, split across OpenMP threads; the query heads sharing a KV head
// (GQA/MQA) are handled together, so each K and V row is read once per step. Softmax is exact (two passes
// over the scores, kept in a per-thread buffer), also when a context is split over threads.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "kernels.h"
#include "simd.h"

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

inline void axpy(float w, const float* x, float* y, int64_t n) {  // y += w * x
    const __m256 wv = _mm256_set1_ps(w);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) y[i] += w * x[i];
}

// 8 cache elements at p as float32: a float32 cache as it is, an int8 one as its integers (the scale of the row
// is applied by the caller, once per dot product or per weight).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Keys per group_dots call and V columns per weighted_columns pass, sized to the vector registers: AVX-512's 32
// hold 4 heads x 4 keys (or x 32 columns) of sums plus the operands, AVX2's 16 half that.
#if defined(__AVX512F__)
constexpr int64_t kDotKeys = 4;
constexpr int kWideColumns = 4;
#else
constexpr int64_t kDotKeys = 2;
constexpr int kWideColumns = 2;
#endif

// scores[g * n + c] = scale_c * (q_g . k_c) for G query heads (q rows dim apart) and C keys: each key is read
// once, and each query vector loaded once serves C keys, so the loop issues fewer loads than FMAs (one key at a
// time it was load-bound: G + 1 loads for G FMAs). Each dot product is summed in the same order whatever C is
// (8-lane partial sums over d, then hsum), so the results do not depend on how keys are grouped.
template <int G, int C, typename T>
inline void group_dots(const float* q, const T* const* k, int64_t dim, const float* scale, float* scores, int64_t n) {
    __m256 acc[G][C];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) acc[g][c] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) {
        __m256 kv[C];
        for (int c = 0; c < C; ++c) kv[c] = load8(k[c] + i);
        for (int g = 0; g < G; ++g) {
            const __m256 qv = _mm256_loadu_ps(q + g * dim + i);
            for (int c = 0; c < C; ++c) acc[g][c] = _mm256_fmadd_ps(qv, kv[c], acc[g][c]);
        }
    }
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) {
            float r = kvserve::hsum(acc[g][c]);
            for (int64_t j = i; j < dim; ++j) r += q[g * dim + j] * static_cast<float>(k[c][j]);
            scores[g * n + c] = r * scale[c];
        }
}

// out[g] (dim floats each, `stride` apart) = sum over the n keys of w[g * n + p] * V row p, for G query heads.
// Columns are taken 16 at a time with all G x 16 sums in registers across the keys, instead of adding each V
// row into memory once per head: the V rows of a sequence stay in L2 between the column passes.
// Columns [c, c + 8V) of out for G heads: V vectors of each V row, G x V sums in registers.
template <int G, int V, typename T>
inline void weighted_columns(const T* const* v_rows, int64_t n, const float* w, int64_t c, float* out,
                             int64_t stride) {
    __m256 acc[G][V];
    for (int g = 0; g < G; ++g)
        for (int x = 0; x < V; ++x) acc[g][x] = _mm256_setzero_ps();
    for (int64_t p = 0; p < n; ++p) {
        __m256 vv[V];
        for (int x = 0; x < V; ++x) vv[x] = load8(v_rows[p] + c + 8 * x);
        for (int g = 0; g < G; ++g) {
            const __m256 wv = _mm256_broadcast_ss(w + g * n + p);
            for (int x = 0; x < V; ++x) acc[g][x] = _mm256_fmadd_ps(wv, vv[x], acc[g][x]);
        }
    }
    for (int g = 0; g < G; ++g)
        for (int x = 0; x < V; ++x) _mm256_storeu_ps(out + g * stride + c + 8 * x, acc[g][x]);
}

template <int G, typename T>
inline void group_weighted_sum(const T* const* v_rows, int64_t n, const float* w, int64_t dim, float* out,
                               int64_t stride) {
    // 8 x kWideColumns columns a pass where the sums fit the registers, else 16; each column's sum runs over the
    // keys in order either way.
    constexpr int kWide = G <= 4 ? kWideColumns : 2;
    int64_t c = 0;
    for (; c + 8 * kWide <= dim; c += 8 * kWide) weighted_columns<G, kWide>(v_rows, n, w, c, out, stride);
    for (; c + 16 <= dim; c += 16) weighted_columns<G, 2>(v_rows, n, w, c, out, stride);
    for (; c < dim; ++c)  // a head size that is not a multiple of 16
        for (int g = 0; g < G; ++g) {
            float sum = 0.0f;
            for (int64_t p = 0; p < n; ++p) sum += w[g * n + p] * static_cast<float>(v_rows[p][c]);
            out[g * stride + c] = sum;
        }
}

// exp(s[i] - m) in place over n scores; returns their sum.
inline float exp_shifted(float* s, int64_t n, float m) {
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = kvserve::exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
        _mm256_storeu_ps(s + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    float total = kvserve::hsum(sum);
    for (; i < n; ++i) total += (s[i] = expf(s[i] - m));
    return total;
}

// Up to four query heads at a time (the group of a KV head may be larger: MQA with many heads).
template <typename Call>
inline void by_heads(int64_t group, const Call& call) {
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
        switch (std::min<int64_t>(4, group - g0)) {
            case 4: call(g0, std::integral_constant<int, 4>{}); break;
            case 3: call(g0, std::integral_constant<int, 3>{}); break;
            case 2: call(g0, std::integral_constant<int, 2>{}); break;
            default: call(g0, std::integral_constant<int, 1>{}); break;
        }
    }
}

// The kernel for a cache of T (float32, or int8 with a float32 scale per token and KV head in k_scales /
// v_scales, [blocks, block_size, kv_heads]: read in place, each row's scale applied to its dot product or to
// its softmax weight).
template <typename T>
void decode_attention(const float* q, const T* k_cache, const T* v_cache, const float* k_scales,
                      const float* v_scales, const int64_t* block_tables, int64_t table_width,
                      const int64_t* seq_lens, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                      int64_t block_size, int64_t window, float scale, float* out) {
    constexpr bool kScaled = !std::is_same_v<T, float>;
    const int64_t group = heads / kv_heads;
    // With fewer (sequence, KV head) pairs than threads (one sequence of a one-KV-head model: Gemma 3 270M at
    // batch 1), each pair's context is split into parts on different threads, whose partial softmax sums are
    // merged at the end (flash-decoding); otherwise one thread would read the whole context alone.
    const int64_t pairs = batch * kv_heads;
    const int64_t threads = omp_get_max_threads();
    const int64_t splits = pairs < threads ? (threads + pairs - 1) / pairs : 1;
    // Per (pair, split, query head): the part's max score, its sum of exp(score - max), then the
    // exp-weighted sum of V rows (dim values).
    const int64_t stride = dim + 2;
    std::vector<float> partial(static_cast<size_t>(pairs * splits * group * stride));
#pragma omp parallel
    {
        std::vector<float> scores;
        std::vector<const T*> keys, rows;  // each key's K and V row
        std::vector<float> k_scale;        // each key's softmax scale (times its K scale in a scaled cache)
        std::vector<float> v_scale;        // each key's V scale (scaled caches)
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < pairs * splits; ++item) {
            const int64_t pair = item / splits, part = item % splits;
            const int64_t b = pair / kv_heads, h = pair % kv_heads;
            const int64_t len = seq_lens[b];
            const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
            const int64_t per = (len - lo + splits - 1) / splits;
            const int64_t first = lo + part * per, last = std::min(len, first + per);
            const int64_t n = std::max<int64_t>(0, last - first);
            const int64_t* table = block_tables + b * table_width;
            float* acc = partial.data() + item * group * stride;
            scores.assign(static_cast<size_t>(group * n), 0.0f);
            keys.resize(static_cast<size_t>(n)), rows.resize(static_cast<size_t>(n));
            k_scale.resize(static_cast<size_t>(n));
            if (kScaled) v_scale.resize(static_cast<size_t>(n));
            const float* q_pair = q + (b * heads + h * group) * dim;
            for (int64_t p = 0; p < n; ++p) {
                const int64_t pos = first + p;
                const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
                keys[p] = k_cache + (slot * kv_heads + h) * dim;
                rows[p] = v_cache + (slot * kv_heads + h) * dim;
                k_scale[p] = kScaled ? scale * k_scales[slot * kv_heads + h] : scale;
                if (kScaled) v_scale[p] = v_scales[slot * kv_heads + h];
            }
            for (int64_t p = 0; p < n; p += kDotKeys) {
                by_heads(group, [&](int64_t g0, auto heads_here) {
                    constexpr int G = decltype(heads_here)::value;
                    const float* qg = q_pair + g0 * dim;
                    float* sg = scores.data() + g0 * n + p;
                    switch (std::min<int64_t>(kDotKeys, n - p)) {
                        case 4: group_dots<G, 4>(qg, keys.data() + p, dim, k_scale.data() + p, sg, n); break;
                        case 3: group_dots<G, 3>(qg, keys.data() + p, dim, k_scale.data() + p, sg, n); break;
                        case 2: group_dots<G, 2>(qg, keys.data() + p, dim, k_scale.data() + p, sg, n); break;
                        default: group_dots<G, 1>(qg, keys.data() + p, dim, k_scale.data() + p, sg, n); break;
                    }
                });
            }
            for (int64_t g = 0; g < group; ++g) {
                float* s = scores.data() + g * n;
                float* a = acc + g * stride;
                const float m = n ? *std::max_element(s, s + n) : -INFINITY;
                a[0] = m;
                a[1] = n ? exp_shifted(s, n, m) : 0.0f;
                if (n == 0) std::fill(a + 2, a + stride, 0.0f);
                if (kScaled)  // the V rows' scales ride on the weights (after their sum, which must not see them)
                    for (int64_t p = 0; p < n; ++p) s[p] *= v_scale[p];
            }
            if (n > 0)
                by_heads(group, [&](int64_t g0, auto heads_here) {
                    group_weighted_sum<decltype(heads_here)::value>(rows.data(), n, scores.data() + g0 * n, dim,
                                                                    acc + g0 * stride + 2, stride);
                });
        }
        // Merge the parts of each (pair, query head): rescale each part's sums to the overall max.
#pragma omp for schedule(static)
        for (int64_t row = 0; row < pairs * group; ++row) {
            const int64_t pair = row / group, g = row % group;
            const int64_t b = pair / kv_heads, h = pair % kv_heads;
            const float* first = partial.data() + (pair * splits * group + g) * stride;
            float m = -INFINITY;
            for (int64_t part = 0; part < splits; ++part) m = std::max(m, first[part * group * stride]);
            float* o = out + (b * heads + h * group + g) * dim;
            std::fill(o, o + dim, 0.0f);
            float total = 0.0f;
            for (int64_t part = 0; part < splits; ++part) {
                const float* a = first + part * group * stride;
                if (a[1] == 0.0f) continue;  // an empty part
                const float w = expf(a[0] - m);
                total += w * a[1];
                axpy(w, a + 2, o, dim);
            }
            const float inv = 1.0f / total;
            for (int64_t i = 0; i < dim; ++i) o[i] *= inv;
        }
    }
}

}  // namespace

extern "C" {

// The query of each sequence over its context (kernels.h: KvserveDecodeAttention); the cache's type is told by
// its scales: a float32 cache has none, an int8 one (kvserve/kv/quant.py's layout) is read in place with them.
void kvserve_paged_decode_attention(const KvserveDecodeAttention* a) {
    const float scale = static_cast<float>(a->scale);
    if (a->k_scales == nullptr) {
        decode_attention<float>(a->q, static_cast<const float*>(a->k_cache), static_cast<const float*>(a->v_cache),
                                nullptr, nullptr, a->block_tables, a->table_width, a->seq_lens, a->batch, a->heads,
                                a->kv_heads, a->dim, a->block_size, a->window, scale, a->out);
        return;
    }
    decode_attention<int8_t>(a->q, static_cast<const int8_t*>(a->k_cache), static_cast<const int8_t*>(a->v_cache),
                             a->k_scales, a->v_scales, a->block_tables, a->table_width, a->seq_lens, a->batch,
                             a->heads, a->kv_heads, a->dim, a->block_size, a->window, scale, a->out);
}

}
