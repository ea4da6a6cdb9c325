// Decode attention straight on the paged KV cache (float32): one query token per sequence attends to its
// context, read through its block table, with no gathered copy of K and V.
//
// Why: the torch path gathers each sequence's K and V into new padded tensors every layer of every step and
// then calls SDPA; at decode those copies and the op overheads cost more than the attention arithmetic.
// Work items are (sequence, KV head) pairs, split across OpenMP threads; the query heads sharing a KV head
// (GQA/MQA) are handled together, so each K and V row is read once per step. Softmax is exact (two passes
// over the scores, kept in a per-thread buffer).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    float r = _mm_cvtss_f32(s);
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
#pragma omp parallel
    {
        std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < batch * kv_heads; ++item) {
            const int64_t b = item / kv_heads, h = item % kv_heads;
            const int64_t len = seq_lens[b];
            const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
            const int64_t n = len - lo;
            const int64_t* table = block_tables + b * table_width;
            scores.assign(static_cast<size_t>(group * n), 0.0f);
            for (int64_t p = 0; p < n; ++p) {
                const int64_t pos = lo + p;
                const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
                const float* k = k_cache + (slot * kv_heads + h) * dim;
                for (int64_t g = 0; g < group; ++g)
                    scores[g * n + p] = dot(q + (b * heads + h * group + g) * dim, k, dim) * scale;
            }
            for (int64_t g = 0; g < group; ++g) {
                float* s = scores.data() + g * n;
                const float m = *std::max_element(s, s + n);
                float sum = 0.0f;
                for (int64_t p = 0; p < n; ++p) sum += (s[p] = expf(s[p] - m));
                const float inv = 1.0f / sum;
                for (int64_t p = 0; p < n; ++p) s[p] *= inv;
                float* o = out + (b * heads + h * group + g) * dim;
                std::fill(o, o + dim, 0.0f);
            }
            for (int64_t p = 0; p < n; ++p) {
                const int64_t pos = lo + p;
                const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
                const float* v = v_cache + (slot * kv_heads + h) * dim;
                for (int64_t g = 0; g < group; ++g)
                    axpy(scores[g * n + p], v, out + (b * heads + h * group + g) * dim, dim);
            }
        }
    }
}

}
