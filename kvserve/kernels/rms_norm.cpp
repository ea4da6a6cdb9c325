// RMSNorm in one call: out = x / sqrt(mean(x^2) + eps) * w, float32, AVX2 + FMA.
//
// Why: torch's rms_norm on CPU is a chain of small ops (about 30 us per call for one 640-wide row here) and a
// decode step calls it about 90 times; this is one pass per row. The rows may be strided groups, so the
// per-head Q and K norms read straight out of the fused QKV projection:
// row r = (token t, group g) lives at x + t * x_stride + g * dim and goes to out + t * out_stride + g * dim.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "simd.h"

extern "C" void kvserve_rms_norm(const float* x, int64_t tokens, int64_t x_stride, int64_t groups, int64_t dim,
                                 const float* w, float eps, float* out, int64_t out_stride) {
    const int64_t rows = tokens * groups;
#pragma omp parallel for schedule(static) if (rows * dim >= (1 << 16))
    for (int64_t r = 0; r < rows; ++r) {
        const float* src = x + (r / groups) * x_stride + (r % groups) * dim;
        float* dst = out + (r / groups) * out_stride + (r % groups) * dim;
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8) {
            const __m256 v = _mm256_loadu_ps(src + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = kvserve::hsum(acc);
        for (; i < dim; ++i) ss += src[i] * src[i];
        const float inv = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
        const __m256 scale = _mm256_set1_ps(inv);
        i = 0;
        for (; i + 8 <= dim; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(src + i), scale),
                                                    _mm256_loadu_ps(w + i)));
        for (; i < dim; ++i) dst[i] = src[i] * inv * w[i];
    }
}
