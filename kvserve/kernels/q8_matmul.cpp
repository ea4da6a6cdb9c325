// Weight-only 8-bit matmul for small batches on x86-64 CPUs with AVX2 + FMA.
//
// y[m, n] = sum_k x[m, k] * w[n, k] * scale[n, k / 32]        (x, y, scale float32; w int8)
//
// Why: at decode the work is memory bound, so the time is the bytes of weights read; 8-bit weights with a
// float32 scale per 32 values (llama.cpp's Q8_0 layout, split in two arrays) read 3.6x fewer bytes than
// float32. Activations stay float32: no loss beyond the weights' own rounding.
// The blocked driver (widened_matmul.h) does the rest; this file only widens the format. Loaded with ctypes.
#include <immintrin.h>
#include <stdint.h>

#include "kernels.h"
#include "widened_matmul.h"

namespace {

constexpr int64_t kGroup = 32;


// Widen columns [k0, k0 + kc) of rows [n0, n0 + rows) of w to float32 (scales applied) into buf[rows][kc].
inline void widen_rows(const int8_t* w, const float* scales, int64_t k, int64_t k0, int64_t kc, int64_t n0, int rows,
                       float* buf) {
    const int64_t groups = kc / kGroup;
    for (int r = 0; r < rows; ++r) {
        const int8_t* src = w + (n0 + r) * k + k0;
        const float* sc = scales + ((n0 + r) * k + k0) / kGroup;
        float* dst = buf + r * kc;
        for (int64_t g = 0; g < groups; ++g) {
#if defined(__AVX512F__)
            const __m512 s = _mm512_set1_ps(sc[g]);
            for (int j = 0; j < kGroup; j += 16) {
                const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + g * kGroup + j));
                _mm512_storeu_ps(dst + g * kGroup + j, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), s));
            }
#else
            const __m256 s = _mm256_set1_ps(sc[g]);
            for (int j = 0; j < kGroup; j += 8) {
                __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + g * kGroup + j));
                __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                _mm256_storeu_ps(dst + g * kGroup + j, _mm256_mul_ps(f, s));
            }
#endif
        }
    }
}

}  // namespace

extern "C" {

// Requires k % 32 == 0. x: [m, k], w: [n, k], scales: [n, k/32], y: [m, n], all contiguous.
void kvserve_q8_matmul(const float* x, int64_t m, int64_t k, const int8_t* w, const float* scales, int64_t n,
                       float* y) {
    kvserve::widened_matmul(x, m, k, n, kGroup, y, n, [&](int64_t n0, int rows, int64_t k0, int64_t kc, float* buf) {
        widen_rows(w, scales, k, k0, kc, n0, rows, buf);
    });
}

}
