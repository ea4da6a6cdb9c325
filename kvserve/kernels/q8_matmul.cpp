// Weight-only 8-bit matmul for small batches on x86-64 CPUs with AVX2 + FMA.
//
// y[m, n] = sum_k x[m, k] * w[n, k] * scale[n, k / 32]        (x, y, scale float32; w int8)
//
// Why: at decode the work is memory bound, so the time is the bytes of weights read; 8-bit weights with a
// float32 scale per 32 values (llama.cpp's Q8_0 layout, split in two arrays) read 3.6x fewer bytes than
// float32. Activations stay float32: no loss beyond the weights' own rounding.
// A block of ROWS weight rows is widened to float32 in an L1-resident buffer once, then used against every
// activation row; the micro-kernel keeps ROWS x COLS accumulators in registers. Threads (OpenMP, sharing
// torch's runtime) split the weight rows. Loaded with ctypes; kvserve/kernels/q8.py builds it.
#include <immintrin.h>
#include <stdint.h>

#include "simd.h"
#include <string.h>

#include <algorithm>

namespace {

using kvserve::hsum;

constexpr int64_t kGroup = 32;
constexpr int ROWS = 4;
constexpr int64_t kMaxChunk = 1024;


// Widen columns [k0, k0 + kc) of rows [n0, n0 + rows) of w to float32 (scales applied) into buf[rows][kc].
inline void widen_rows(const int8_t* w, const float* scales, int64_t k, int64_t k0, int64_t kc, int64_t n0, int rows,
                       float* buf) {
    const int64_t groups = kc / kGroup;
    for (int r = 0; r < rows; ++r) {
        const int8_t* src = w + (n0 + r) * k + k0;
        const float* sc = scales + ((n0 + r) * k + k0) / kGroup;
        float* dst = buf + r * kc;
        for (int64_t g = 0; g < groups; ++g) {
            const __m256 s = _mm256_set1_ps(sc[g]);
            for (int j = 0; j < kGroup; j += 8) {
                __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + g * kGroup + j));
                __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                _mm256_storeu_ps(dst + g * kGroup + j, _mm256_mul_ps(f, s));
            }
        }
    }
}

// x points at column k0 of row 0 (rows k apart); buf holds R widened rows of kc columns. The first k-chunk
// stores into y, later ones add to it.
template <int R, int C, bool ADD>
inline void micro(const float* buf, const float* x, int64_t k, int64_t kc, int64_t m0, int64_t n0, int64_t n,
                  float* y) {
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < kc; i += 8) {
        __m256 wv[R];
        for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_ps(buf + r * kc + i);
        for (int c = 0; c < C; ++c) {
            const __m256 xv = _mm256_loadu_ps(x + (m0 + c) * k + i);
            for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(wv[r], xv, acc[r][c]);
        }
    }
    if constexpr (R == 4) {
        // The four weight rows are four adjacent outputs: reduce their accumulators together into one vector
        // (three horizontal adds and a half-add) and store it once, instead of four scalar reductions.
        for (int c = 0; c < C; ++c) {
            const __m256 h01 = _mm256_hadd_ps(acc[0][c], acc[1][c]), h23 = _mm256_hadd_ps(acc[2][c], acc[3][c]);
            const __m256 h = _mm256_hadd_ps(h01, h23);  // per 128-bit half: [r0, r1, r2, r3]
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            float* out = y + (m0 + c) * n + n0;
            if (ADD) s = _mm_add_ps(s, _mm_loadu_ps(out));
            _mm_storeu_ps(out, s);
        }
    } else {
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c) {
                float* out = y + (m0 + c) * n + n0 + r;
                *out = ADD ? *out + hsum(acc[r][c]) : hsum(acc[r][c]);
            }
    }
}

// Activation rows [m_lo, m_hi) against the widened rows in buf.
template <int R, bool ADD>
inline void rows_times_x_(const float* buf, const float* x, int64_t m_lo, int64_t m_hi, int64_t k, int64_t kc,
                          int64_t n0, int64_t n, float* y) {
    int64_t m0 = m_lo;
    for (; m0 + 3 <= m_hi; m0 += 3) micro<R, 3, ADD>(buf, x, k, kc, m0, n0, n, y);
    if (m_hi - m0 == 2) micro<R, 2, ADD>(buf, x, k, kc, m0, n0, n, y);
    else if (m_hi - m0 == 1) micro<R, 1, ADD>(buf, x, k, kc, m0, n0, n, y);
}

template <int R>
inline void rows_times_x(const float* buf, const float* x, int64_t m_lo, int64_t m_hi, int64_t k, int64_t kc,
                         bool first, int64_t n0, int64_t n, float* y) {
    if (first) rows_times_x_<R, false>(buf, x, m_lo, m_hi, k, kc, n0, n, y);
    else rows_times_x_<R, true>(buf, x, m_lo, m_hi, k, kc, n0, n, y);
}

}  // namespace

extern "C" {

// Requires k % 32 == 0. x: [m, k], w: [n, k], scales: [n, k/32], y: [m, n], all contiguous.
void kvserve_q8_matmul(const float* x, int64_t m, int64_t k, const int8_t* w, const float* scales, int64_t n,
                       float* y) {
    const int64_t blocks = (n + ROWS - 1) / ROWS;
    // Long rows are taken in k-chunks of at most kMaxChunk so that the widened block (ROWS x chunk floats) and
    // the activation rows' chunks share L1: at K = 2048 a whole widened block alone is 32 KB, all of L1.
    const int64_t chunks = (k + kMaxChunk - 1) / kMaxChunk;
    const int64_t kc = (k / kGroup + chunks - 1) / chunks * kGroup;
    // Activation rows are taken in tiles that stay in a core's L2 (~256 KB), so that at prefill sizes each
    // weight block is not multiplied against activations streamed from L3; re-widening a block per tile
    // costs K conversions against 2 x K x tile FLOPs.
    const int64_t tile = m <= 3 ? m : std::max<int64_t>(3, (256 * 1024 / (4 * k)) / 3 * 3);
#pragma omp parallel
    {
        alignas(64) float buf[ROWS * kMaxChunk];
        for (int64_t m_lo = 0; m_lo < m; m_lo += tile) {
            const int64_t m_hi = std::min(m, m_lo + tile);
#pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < blocks; ++b) {
                const int64_t n0 = b * ROWS;
                const int rows = static_cast<int>(n - n0 < ROWS ? n - n0 : ROWS);
                for (int64_t k0 = 0; k0 < k; k0 += kc) {
                    const int64_t len = std::min(kc, k - k0);
                    const bool first = k0 == 0;
                    widen_rows(w, scales, k, k0, len, n0, rows, buf);
                    switch (rows) {
                        case 4: rows_times_x<4>(buf, x + k0, m_lo, m_hi, k, len, first, n0, n, y); break;
                        case 3: rows_times_x<3>(buf, x + k0, m_lo, m_hi, k, len, first, n0, n, y); break;
                        case 2: rows_times_x<2>(buf, x + k0, m_lo, m_hi, k, len, first, n0, n, y); break;
                        default: rows_times_x<1>(buf, x + k0, m_lo, m_hi, k, len, first, n0, n, y); break;
                    }
                }
            }
        }
    }
}


}
