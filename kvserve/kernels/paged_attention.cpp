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
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float r = kvserve::hsum(acc);
    for (; i < n; ++i) r += a[i] * b[i];
    return r;
}

inline void axpy(float w, const float* x, float* y, int64_t n) {  // y += w * x
    const __m256 wv = _mm256_set1_ps(w);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) y[i] += w * x[i];
}

}  // namespace

extern "C" {

// q, out: [batch, heads, dim] contiguous. k_cache, v_cache: [blocks, block_size, kv_heads, dim] contiguous.
// block_tables: [batch, table_width] int64. seq_lens: [batch] int64 (the query is the last position).
// window <= 0: no sliding window; else keys at positions > seq_len - 1 - window only.
void kvserve_paged_decode_attention(const float* q, const float* k_cache, const float* v_cache,
                                    const int64_t* block_tables, int64_t table_width, const int64_t* seq_lens,
                                    int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                                    int64_t block_size, int64_t window, float scale, float* out) {
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
            for (int64_t p = 0; p < n; ++p) {
                const int64_t pos = first + p;
                const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
                const float* k = k_cache + (slot * kv_heads + h) * dim;
                for (int64_t g = 0; g < group; ++g)
                    scores[g * n + p] = dot(q + (b * heads + h * group + g) * dim, k, dim) * scale;
            }
            for (int64_t g = 0; g < group; ++g) {
                float* s = scores.data() + g * n;
                float* a = acc + g * stride;
                const float m = n ? *std::max_element(s, s + n) : -INFINITY;
                float sum = 0.0f;
                for (int64_t p = 0; p < n; ++p) sum += (s[p] = expf(s[p] - m));
                a[0] = m;
                a[1] = sum;
                std::fill(a + 2, a + stride, 0.0f);
            }
            for (int64_t p = 0; p < n; ++p) {
                const int64_t pos = first + p;
                const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
                const float* v = v_cache + (slot * kv_heads + h) * dim;
                for (int64_t g = 0; g < group; ++g) axpy(scores[g * n + p], v, acc + g * stride + 2, dim);
            }
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

}
