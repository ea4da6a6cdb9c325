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

// qkv: [tokens, row_stride] float32, the first (heads) x dim values of a row are the Q heads then the K heads.
// q_weight / k_weight: [dim] norm weights, or null for no norm (then eps is unused). q_heads: how many of the
// heads are Q (they use q_weight; the rest use k_weight). cos / signed_sin: [tokens, dim] (cos over both
// halves; sin negated on the first half). out: [tokens, heads, dim] contiguous.
void kvserve_qk_norm_rope(const float* qkv, int64_t tokens, int64_t row_stride, int64_t heads, int64_t q_heads,
                          int64_t dim, const float* q_weight, const float* k_weight, float eps, const float* cos,
                          const float* signed_sin, float* out) {
    const int64_t half = dim / 2;
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
