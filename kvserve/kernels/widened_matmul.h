// The driver shared by the weight-only matmuls (q8_matmul.cpp, gguf_matmul.cpp):
//
// y[m, n] = sum_k x[m, k] * W[n, k]        (x, y float32; W in some compressed format)
//
// A block of ROWS weight rows is widened to float32 in an L1-resident buffer once (by the format's `widen`),
// then used against every activation row; the micro-kernel keeps ROWS x COLS accumulators in registers.
// Threads (OpenMP, sharing torch's runtime) split the weight rows. y's rows are `ldy` floats apart, so a
// layer made of several parts (a fused QKV whose Q, K and V are stored in different formats) writes each
// part's columns in place.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include <algorithm>

#include "simd.h"

namespace kvserve {

constexpr int kWidenRows = 4;
constexpr int64_t kMaxChunk = 1024;

// The R x C dot products in acc (8 lanes each) reduced and stored at y[m0 + c, n0 + r]; the first k-chunk
// stores, later ones add.
template <int R, int C, bool ADD>
inline void store_dots(__m256 (&acc)[R][C], int64_t m0, int64_t n0, int64_t ldy, float* y) {
    if constexpr (R == 4) {
        // The four weight rows are four adjacent outputs: reduce their accumulators together into one vector
        // (three horizontal adds and a half-add) and store it once, instead of four scalar reductions.
        for (int c = 0; c < C; ++c) {
            const __m256 h01 = _mm256_hadd_ps(acc[0][c], acc[1][c]), h23 = _mm256_hadd_ps(acc[2][c], acc[3][c]);
            const __m256 h = _mm256_hadd_ps(h01, h23);  // per 128-bit half: [r0, r1, r2, r3]
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            float* out = y + (m0 + c) * ldy + n0;
            if (ADD) s = _mm_add_ps(s, _mm_loadu_ps(out));
            _mm_storeu_ps(out, s);
        }
    } else {
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c) {
                float* out = y + (m0 + c) * ldy + n0 + r;
                *out = ADD ? *out + hsum(acc[r][c]) : hsum(acc[r][c]);
            }
    }
}

// The vector the micro-kernel accumulates in: AVX-512 where the library is built with it (kvserve/kernels/native.py
// builds for it where the CPU has it), else AVX2. `half` folds one into the 8 lanes store_dots reduces.
#if defined(__AVX512F__)
// 16 lanes and 32 registers: twice the FLOPs per instruction of AVX2, and 4 x 4 accumulators (measured on the LM
// head at 8 and 32 rows against 4 x 6, which leaves 2-row tails at those batch sizes, and 8 weight rows x 3: both
// slower; so is a k-chunk small enough that 32 activation rows stay in L1). kc is a multiple of 16: every
// format's block is a multiple of 32 weights.
struct Lanes {
    using V = __m512;
    static constexpr int kWidth = 16;
    static V zero() { return _mm512_setzero_ps(); }
    static V load(const float* p) { return _mm512_loadu_ps(p); }
    static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    static __m256 half(V v) {  // lanes i and i + 8 added
        return _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    }
};
constexpr int kMicroCols = 4;
#else
struct Lanes {
    using V = __m256;
    static constexpr int kWidth = 8;
    static V zero() { return _mm256_setzero_ps(); }
    static V load(const float* p) { return _mm256_loadu_ps(p); }
    static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    static __m256 half(V v) { return v; }
};
constexpr int kMicroCols = 3;  // 4 x 3 accumulators, 4 weight vectors and one activation vector: 17 registers
#endif

// x points at column k0 of row 0 (rows k apart); buf holds R widened rows of kc columns.
template <int R, int C, bool ADD>
inline void widened_micro(const float* buf, const float* x, int64_t k, int64_t kc, int64_t m0, int64_t n0,
                          int64_t ldy, float* y) {
    typename Lanes::V acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = Lanes::zero();
    for (int64_t i = 0; i < kc; i += Lanes::kWidth) {
        typename Lanes::V wv[R];
        for (int r = 0; r < R; ++r) wv[r] = Lanes::load(buf + r * kc + i);
        for (int c = 0; c < C; ++c) {
            const typename Lanes::V xv = Lanes::load(x + (m0 + c) * k + i);
            for (int r = 0; r < R; ++r) acc[r][c] = Lanes::fmadd(wv[r], xv, acc[r][c]);
        }
    }
    __m256 half[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) half[r][c] = Lanes::half(acc[r][c]);
    store_dots<R, C, ADD>(half, m0, n0, ldy, y);
}

// Activation rows [m_lo, m_hi) against the widened rows in buf, kMicroCols at a time.
template <int R, bool ADD>
inline void widened_rows_(const float* buf, const float* x, int64_t m_lo, int64_t m_hi, int64_t k, int64_t kc,
                          int64_t n0, int64_t ldy, float* y) {
    int64_t m0 = m_lo;
    static_assert(kMicroCols <= 4, "the tails below are of up to 3 rows");
    for (; m0 + kMicroCols <= m_hi; m0 += kMicroCols)
        widened_micro<R, kMicroCols, ADD>(buf, x, k, kc, m0, n0, ldy, y);
    switch (m_hi - m0) {  // the remainder, fewer than kMicroCols rows
        case 3: if constexpr (kMicroCols > 3) widened_micro<R, 3, ADD>(buf, x, k, kc, m0, n0, ldy, y); break;
        case 2: widened_micro<R, 2, ADD>(buf, x, k, kc, m0, n0, ldy, y); break;
        case 1: widened_micro<R, 1, ADD>(buf, x, k, kc, m0, n0, ldy, y); break;
        default: break;
    }
}

template <int R>
inline void widened_rows(const float* buf, const float* x, int64_t m_lo, int64_t m_hi, int64_t k, int64_t kc,
                         bool first, int64_t n0, int64_t ldy, float* y) {
    if (first) widened_rows_<R, false>(buf, x, m_lo, m_hi, k, kc, n0, ldy, y);
    else widened_rows_<R, true>(buf, x, m_lo, m_hi, k, kc, n0, ldy, y);
}

// x [m, k] times the n rows that `widen(n0, rows, k0, kc, buf)` widens (columns [k0, k0 + kc) of rows
// [n0, n0 + rows) into buf[rows][kc]) into y [m, ldy]. `group`: the format's block length along k; k-chunks
// are whole blocks.
template <typename Widen>
void widened_matmul(const float* x, int64_t m, int64_t k, int64_t n, int64_t group, float* y, int64_t ldy,
                    const Widen& widen) {
    const int64_t blocks = (n + kWidenRows - 1) / kWidenRows;
    // Long rows are taken in k-chunks of at most kMaxChunk so that the widened block (ROWS x chunk floats) and
    // the activation rows' chunks share L1: at K = 2048 a whole widened block alone is 32 KB, all of L1.
    const int64_t chunks = (k + kMaxChunk - 1) / kMaxChunk;
    const int64_t kc = (k / group + chunks - 1) / chunks * group;
    // Activation rows are taken in tiles that stay in a core's L2 (~256 KB), so that at prefill sizes each
    // weight block is not multiplied against activations streamed from L3; re-widening a block per tile
    // costs K conversions against 2 x K x tile FLOPs.
    const int64_t tile =
        m <= kMicroCols ? m : std::max<int64_t>(kMicroCols, (256 * 1024 / (4 * k)) / kMicroCols * kMicroCols);
#pragma omp parallel
    {
        // A chunk of whole blocks may pass kMaxChunk by less than a block (K-quants: 256).
        alignas(64) float buf[kWidenRows * (kMaxChunk + 256)];
        for (int64_t m_lo = 0; m_lo < m; m_lo += tile) {
            const int64_t m_hi = std::min(m, m_lo + tile);
#pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < blocks; ++b) {
                const int64_t n0 = b * kWidenRows;
                const int rows = static_cast<int>(n - n0 < kWidenRows ? n - n0 : kWidenRows);
                for (int64_t k0 = 0; k0 < k; k0 += kc) {
                    const int64_t len = std::min(kc, k - k0);
                    const bool first = k0 == 0;
                    widen(n0, rows, k0, len, buf);
                    switch (rows) {
                        case 4: widened_rows<4>(buf, x + k0, m_lo, m_hi, k, len, first, n0, ldy, y); break;
                        case 3: widened_rows<3>(buf, x + k0, m_lo, m_hi, k, len, first, n0, ldy, y); break;
                        case 2: widened_rows<2>(buf, x + k0, m_lo, m_hi, k, len, first, n0, ldy, y); break;
                        default: widened_rows<1>(buf, x + k0, m_lo, m_hi, k, len, first, n0, ldy, y); break;
                    }
                }
            }
        }
    }
}

}  // namespace kvserve
