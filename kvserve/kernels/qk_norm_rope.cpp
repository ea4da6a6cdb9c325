// Per-head RMSNorm of Q and K (Gemma 3, Qwen 3) and rotary embedding, in one pass over the fused QKV output.
//
// Why: in torch this is two norm calls, an allocation, a multiply, a roll (two slices and a cat) and an
// addcmul per layer: ~7 dispatches of ~10 us at decode, and four passes over [T, heads, dim] at prefill. Here
// each head vector is read once: its inverse RMS is taken, then every output element combines the element and
// its rope partner (i +- dim/2), both normalized on the fly.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "simd.h"

extern "C" {

// The per-head norms and NEOX rope of every Q and K head (kernels.h: KvserveQkNormRope).
void kvserve_qk_norm_rope(const KvserveQkNormRope* args) {
    const float *qkv = args->qkv, *q_weight = args->q_weight, *k_weight = args->k_weight;
    const float *cos = args->cos, *signed_sin = args->signed_sin;
    float* out = args->out;
    const int64_t tokens = args->tokens, row_stride = args->row_stride, heads = args->heads;
    const int64_t q_heads = args->q_heads, dim = args->dim;
    const float eps = static_cast<float>(args->eps);
    const int64_t half = dim / 2, rotary = args->rotary_dim;
    if (rotary != dim) {  // partial rope (Qwen3.5: a quarter of each head): scalar, it is a small part of a layer
#pragma omp parallel for schedule(static) if (tokens * heads >= 64)
        for (int64_t item = 0; item < tokens * heads; ++item) {
            const int64_t t = item / heads, h = item % heads, r2 = rotary / 2;
            const float* x = qkv + t * row_stride + h * dim;
            const float* w = h < q_heads ? q_weight : k_weight;
            const float* c = cos + t * rotary;
            const float* s = signed_sin + t * rotary;
            float* o = out + item * dim;
            float inv = 1.0f;
            if (w != nullptr) {
                float ss = 0.0f;
                for (int64_t i = 0; i < dim; ++i) ss += x[i] * x[i];
                inv = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
            }
            for (int64_t i = 0; i < dim; ++i) o[i] = x[i] * inv * (w != nullptr ? w[i] : 1.0f);
            for (int64_t i = 0; i < r2; ++i) {
                const float a = o[i], b = o[r2 + i];
                o[i] = a * c[i] + b * s[i];
                o[r2 + i] = b * c[r2 + i] + a * s[r2 + i];
            }
        }
        return;
    }
#pragma omp parallel for schedule(static) if (tokens * heads >= 64)
    for (int64_t item = 0; item < tokens * heads; ++item) {
        const int64_t t = item / heads, h = item % heads;
        const float* x = qkv + t * row_stride + h * dim;
        const float* w = h < q_heads ? q_weight : k_weight;
        const float* c = cos + t * dim;
        const float* s = signed_sin + t * dim;
        float* o = out + item * dim;
        float inv = 1.0f;
        if (w != nullptr) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t i = 0; i < dim; i += 8) {
                const __m256 v = _mm256_loadu_ps(x + i);
                acc = _mm256_fmadd_ps(v, v, acc);
            }
            inv = 1.0f / sqrtf(kvserve::hsum(acc) / static_cast<float>(dim) + eps);
        }
        const __m256 iv = _mm256_set1_ps(inv);
        for (int64_t i = 0; i < half; i += 8) {
            __m256 a = _mm256_mul_ps(_mm256_loadu_ps(x + i), iv);          // first-half element
            __m256 b = _mm256_mul_ps(_mm256_loadu_ps(x + half + i), iv);   // its partner in the second half
            if (w != nullptr) {
                a = _mm256_mul_ps(a, _mm256_loadu_ps(w + i));
                b = _mm256_mul_ps(b, _mm256_loadu_ps(w + half + i));
            }
            _mm256_storeu_ps(o + i, _mm256_fmadd_ps(b, _mm256_loadu_ps(s + i), _mm256_mul_ps(a, _mm256_loadu_ps(c + i))));
            _mm256_storeu_ps(o + half + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(s + half + i),
                                                           _mm256_mul_ps(b, _mm256_loadu_ps(c + half + i))));
        }
    }
}

}
