// Matmul on GGUF quantized blocks as the file stores them (x86-64, AVX2 + FMA + F16C; AVX-512 where built for it).
//
// y[m, n] = sum_k x[m, k] * W[n, k]        (x, y float32; each row of W a run of GGUF blocks along k)
//
// Why: `--quantization gguf` runs the file's own bits, so the result is a float32 matmul on the weights
// HF transformers dequantizes from the same file (up to summation order) and a decode step reads the file's
// bytes (4.5-8.5 bits a weight) instead of a re-quantized copy. Each block is decoded to small integers with
// byte-wide AVX2 operations. At 1-4 activation rows (decode) they are converted to float32 in registers and
// dotted with the activations, four weight rows at a time, scales applied per run of 16-32 (gemv below); at
// more rows they are widened to float32 with their scales (the same float32 products, in the same order, as
// gguf-py's dequantize: bit-exact weights) into the L1 buffer of the shared blocked driver (widened_matmul.h)
// and reused across the rows. Both prefetch the rows they read next in software (prefetch_block).
// The formats (block layouts and their decoders) are the table in gguf_formats.h.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>
#include <vector>

#include "gguf_formats.h"
#include "kernels.h"
#include "widened_matmul.h"

namespace {

using kvserve::hsum;
using namespace kvserve::gguf;

// A run of 32 values q (s_lo for the first 16, s_hi after, minus min for formats with one) to float32 at dst.
template <typename F>
inline void widen_run(const int8_t* q, float s_lo, float s_hi, float min, float* dst) {
#if defined(__AVX512F__)
    for (int i = 0; i < 2; ++i) {  // 16 at a time: half the instructions of the AVX2 loop, the same products
        const __m128i q16 = load16(reinterpret_cast<const uint8_t*>(q) + 16 * i);
        const __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q16));
        __m512 w = _mm512_mul_ps(qf, _mm512_set1_ps(i == 0 ? s_lo : s_hi));
        if constexpr (F::kMin) w = _mm512_sub_ps(w, _mm512_set1_ps(min));
        _mm512_storeu_ps(dst + 16 * i, w);
    }
#else
    for (int i = 0; i < 4; ++i) {
        __m256 w = _mm256_mul_ps(cvt8(q + 8 * i), _mm256_set1_ps(i < 2 ? s_lo : s_hi));
        if constexpr (F::kMin) w = _mm256_sub_ps(w, _mm256_set1_ps(min));
        _mm256_storeu_ps(dst + 8 * i, w);
    }
#endif
}

// One block to float32 at dst: the same float32 products (scale, then minus min), in the same order, as
// gguf-py's dequantize, so the weights are bit-exact.
template <typename F>
inline void decode(const uint8_t* b, float* dst) {
    alignas(32) int8_t tmp[32];
    F::visit(b, tmp, [&](int64_t offset, const int8_t* q, float s_lo, float s_hi, float min) {
        widen_run<F>(q, s_lo, s_hi, min, dst + offset);
    });
}

// Row `row`'s block b of w to float32 at dst, as decode: a Q5_0 block of a tile straight from its codes (the
// same values and products as decode of the block copied out, without the copy).
template <typename F>
inline void decode_row_block(const RowBlocks& w, int64_t row, int64_t b, float* dst) {
    if constexpr (std::is_same_v<F, Q5_0>) {
        if (w.tiles && row < w.grouped) {
            const uint8_t* tile = w.w + (row - row % 4) * w.row_bytes + b / 4 * Q5Tile::kBytes;
            const int r = static_cast<int>(row % 4), i = static_cast<int>(b % 4);
            alignas(32) int8_t q[32];
            _mm256_store_si256(reinterpret_cast<__m256i*>(q),
                               _mm256_sub_epi8(Q5Tile::codes(tile, r, i), _mm256_set1_epi8(F::kZero)));
            const float d = f16(tile + 2 * (4 * r + i));
            widen_run<F>(q, d, d, 0.0f, dst);
            return;
        }
    }
    alignas(32) uint8_t copy[F::kBytes];
    decode<F>(w.block(row, b, copy), dst);
}


// Columns [k0, k0 + kc) (whole blocks) of rows [n0, n0 + rows) of w to float32 in buf[rows][kc].
template <typename F>
inline void widen_blocks(const RowBlocks& w, int64_t n, int64_t n0, int rows, int64_t k0, int64_t kc, float* buf) {
    // The same columns of the next block of rows are prefetched (see prefetch_block).
    const bool prefetch = n0 + 2 * kvserve::kWidenRows <= n;
    for (int r = 0; r < rows; ++r) {
        const int64_t row = n0 + r, b0 = k0 / F::kBlock;
        for (int64_t b = 0; b < kc / F::kBlock; ++b) {
            if (prefetch) prefetch_block<F>(w.near(row + kvserve::kWidenRows, b0 + b));
            decode_row_block<F>(w, row, b0 + b, buf + r * kc + b * F::kBlock);
        }
    }
}

// Each weight row's dot products with C activation rows in registers. Weight rows are taken R at a time
// (interleaved block by block: R * C independent accumulator chains, so that no chain of FMAs through one
// register bounds the speed) while the rows ahead are prefetched (prefetch_ahead). Each run of 32 integers
// is converted in registers and dotted with x; its scale is applied to the partial sum (s * sum(q x) instead of sum((s q) x):
// the same terms, rounded in another order), and a K-quant's min as min * sum(x) over the run, with the runs'
// sums of x computed once per call (xsum). Where the library is built for AVX-512 a run is two 16-lane vectors
// (half the instructions of four 8-lane ones: these gemvs are bound by instructions, not bytes, on 4-6-bit blocks).
#if defined(__AVX512F__)
using GemvVec = __m512;
constexpr int kGemvLanes = 16;
inline GemvVec gemv_zero() { return _mm512_setzero_ps(); }
inline float gemv_hsum(GemvVec v) { return _mm512_reduce_add_ps(v); }
// s_lo * sum(q[0:16) x[0:16)) + s_hi * sum(q[16:32) x[16:32)) + acc, as 16 lane sums.
template <bool kSplit>
__attribute__((always_inline)) inline GemvVec gemv_run(const int8_t* q, const float* x, float s_lo, float s_hi,
                                                       GemvVec acc) {
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(reinterpret_cast<const uint8_t*>(q))));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(reinterpret_cast<const uint8_t*>(q) + 16)));
    if constexpr (kSplit) {
        return _mm512_fmadd_ps(_mm512_mul_ps(q0, _mm512_loadu_ps(x)), _mm512_set1_ps(s_lo),
                               _mm512_fmadd_ps(_mm512_mul_ps(q1, _mm512_loadu_ps(x + 16)), _mm512_set1_ps(s_hi), acc));
    } else {
        const __m512 p = _mm512_fmadd_ps(q1, _mm512_loadu_ps(x + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(x)));
        return _mm512_fmadd_ps(p, _mm512_set1_ps(s_lo), acc);
    }
}
#else
using GemvVec = __m256;
constexpr int kGemvLanes = 8;
inline GemvVec gemv_zero() { return _mm256_setzero_ps(); }
inline float gemv_hsum(GemvVec v) { return hsum(v); }
// A run's 32 codes (unsigned bytes: visit<true>) to float32 without a convert: each code
// zero-extended by unpacks into the low bits of a float whose high bits are 0x4B00 (the float 2^23 + code), then
// 2^23 + the format's offset taken off (exact: both are integers below 2^24). The unpacks work within 128-bit lanes,
// so vector i holds codes 4i .. 4i + 3 (lanes 0-3) and 16 + 4i .. 16 + 4i + 3 (lanes 4-7): x is permuted the same way
// once per call (permute_runs), and lanes 0-3 are always the run's first 16 weights. 10 operations a run where
// sign-extending pieces of the decoded values and converting them took 14 (these gemvs are bound by their
// instructions on AVX2): Zen 3, cold, Q5_0 / Q4_0 / Q4_K / Q6_K 9.1 / 9.3 / 8.5 / 10.2 -> 12.4 / 12.7 / 11.4 / 12.5
// GB/s. Q8_0's bytes are the values: they are widened straight from memory (cvt8), as fast as the bytes stream.
template <typename F>
constexpr bool kFromCodes = !F::kSigned;
template <typename F>
__attribute__((always_inline)) inline void codes_to_float(const int8_t* q, __m256* f) {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i zero = _mm256_setzero_si256();
    const __m256i lo = _mm256_unpacklo_epi8(c, zero), hi = _mm256_unpackhi_epi8(c, zero);
    const __m256i magic = _mm256_set1_epi16(0x4B00);
    const __m256 m = _mm256_set1_ps(8388608.0f + static_cast<float>(F::kZero));
    f[0] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(lo, magic)), m);
    f[1] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(lo, magic)), m);
    f[2] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(hi, magic)), m);
    f[3] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(hi, magic)), m);
}
// x [rows, k] -> xp in codes_to_float's order, run by run of 32.
inline void permute_runs(const float* x, int64_t rows, int64_t k, float* xp) {
    for (int64_t i = 0; i < rows * k; i += 32)
        for (int v = 0; v < 4; ++v) {
            _mm_storeu_ps(xp + i + 8 * v, _mm_loadu_ps(x + i + 4 * v));
            _mm_storeu_ps(xp + i + 8 * v + 4, _mm_loadu_ps(x + i + 16 + 4 * v));
        }
}
// s_lo * sum(q[0:16) x[0:16)) + s_hi * sum(q[16:32) x[16:32)) + acc: for codes q and x permuted (permute_runs)
// where kFromCodes, else for values q and x as it is.
template <typename F>
__attribute__((always_inline)) inline GemvVec gemv_run(const int8_t* q, const float* xp, float s_lo, float s_hi,
                                                       GemvVec acc) {
    __m256 f[4];
    if constexpr (kFromCodes<F>) codes_to_float<F>(q, f);
    else
        for (int i = 0; i < 4; ++i) f[i] = cvt8(q + 8 * i);
    __m256 p = _mm256_mul_ps(f[0], _mm256_loadu_ps(xp));
    p = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xp + 8), p);
    p = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xp + 16), p);
    p = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xp + 24), p);
    static_assert(!F::kSplitScale || kFromCodes<F>);  // lanes 0-3 the first 16 weights only in the permuted order
    const __m256 s = F::kSplitScale ? _mm256_set_m128(_mm_set1_ps(s_hi), _mm_set1_ps(s_lo)) : _mm256_set1_ps(s_lo);
    return _mm256_fmadd_ps(p, s, acc);
}
#endif

// rows: the first row's first block; row r's block b at rows + r * row_step + b * block_step (RowBlocks);
// group_bytes: the bytes of R rows, the distance to the same block of the next group.
template <typename F, int R, int C>
inline void gemv_rows(const float* x, int64_t k, const uint8_t* rows, int64_t group_bytes, int64_t row_step,
                      int64_t block_step, int64_t groups_after, int64_t ahead, const float* xsum, float* y,
                      int64_t ldy) {
#if defined(__AVX512F__)
    constexpr bool kCodes = false;  // the decoded values, widened in registers
#else
    constexpr bool kCodes = kFromCodes<F>;  // the stored codes, for codes_to_float; x permuted by permute_runs
#endif
    alignas(32) int8_t tmp[32];
    GemvVec acc[R][C];
    float mins[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
            acc[r][c] = gemv_zero();
            mins[r][c] = 0.0f;
        }
    const int64_t runs = k / 32;
    for (int64_t b = 0; b < k / F::kBlock; ++b) {
        for (int r = 0; r < R; ++r) {
            const uint8_t* block = rows + r * row_step + b * block_step;
            prefetch_ahead<F>(block, group_bytes, groups_after, ahead);
            const auto run = [&](int64_t offset, const int8_t* q, float s_lo, float s_hi, float min) {
                const int64_t at = b * F::kBlock + offset;
                for (int c = 0; c < C; ++c) {
#if defined(__AVX512F__)
                    acc[r][c] = gemv_run<F::kSplitScale>(q, x + c * k + at, s_lo, s_hi, acc[r][c]);
#else
                    acc[r][c] = gemv_run<F>(q, x + c * k + at, s_lo, s_hi, acc[r][c]);
#endif
                    if constexpr (F::kMin) mins[r][c] += min * xsum[c * runs + at / 32];
                }
            };
            F::template visit<kCodes>(block, tmp, run);
        }
    }
    for (int c = 0; c < C; ++c) {
        float* out = y + c * ldy;
#if !defined(__AVX512F__)
        if constexpr (R == 4) {
            // four adjacent outputs reduced together, as widened_matmul.h's micro-kernel does
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0][c], acc[1][c]),
                                            _mm256_hadd_ps(acc[2][c], acc[3][c]));
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            if constexpr (F::kMin) s = _mm_sub_ps(s, _mm_setr_ps(mins[0][c], mins[1][c], mins[2][c], mins[3][c]));
            _mm_storeu_ps(out, s);
            continue;
        }
#endif
        for (int r = 0; r < R; ++r) out[r] = gemv_hsum(acc[r][c]) - mins[r][c];
    }
}

// C <= 4 activation rows (decode): each weight is used C times only, so widening it to float32 in memory costs
// more than it saves. Four weight rows at a time (measured against two at C = 3 and 4: four is faster even where
// the accumulators spill); the last n % 4 rows one at a time.
template <typename F, int C>
void gemv(const float* x, int64_t k, const uint8_t* w, int32_t type, int64_t n, float* y, int64_t ldy) {
    constexpr int R = 4;
    const RowBlocks wb(w, type, n, k, F::kBlock, F::kBytes);
    const int64_t row_bytes = k / F::kBlock * F::kBytes, runs = k / 32, groups = n / R;
    std::vector<float> xsum(F::kMin ? C * runs : 0);
    if constexpr (F::kMin) {
        for (int c = 0; c < C; ++c)
            for (int64_t j = 0; j < runs; ++j) {
                const float* xr = x + c * k + 32 * j;
                const __m256 lo = _mm256_add_ps(_mm256_loadu_ps(xr), _mm256_loadu_ps(xr + 8));
                const __m256 hi = _mm256_add_ps(_mm256_loadu_ps(xr + 16), _mm256_loadu_ps(xr + 24));
                xsum[c * runs + j] = hsum(_mm256_add_ps(lo, hi));
            }
    }
    const float* xs = xsum.data();
#if !defined(__AVX512F__)
    std::vector<float> permuted(kFromCodes<F> ? C * k : 0);
    if constexpr (kFromCodes<F>) {
        permute_runs(x, C, k, permuted.data());
        x = permuted.data();
    }
#endif
#pragma omp parallel
    {
        const auto [first, last] = thread_share(groups);
        if (wb.tiles) {  // each group's rows copied out of their tiles first (the int8 gemv reads tiles in place)
            std::vector<uint8_t> rows(R * row_bytes);
            alignas(32) uint8_t tmp[F::kBytes];
            for (int64_t g = first; g < last; ++g) {
                for (int r = 0; r < R; ++r)
                    for (int64_t b = 0; b < k / F::kBlock; ++b)
                        memcpy(rows.data() + r * row_bytes + b * F::kBytes, wb.block(g * R + r, b, tmp), F::kBytes);
                gemv_rows<F, R, C>(x, k, rows.data(), R * row_bytes, row_bytes, F::kBytes, 0, 1, xs, y + g * R, ldy);
            }
        } else {
            const int64_t ahead = std::min(prefetch_groups(R * row_bytes, last - first), last - first);
            prefetch_lead_in(w + first * R * row_bytes, R * row_bytes, ahead);
            for (int64_t g = first; g < last; ++g)
                gemv_rows<F, R, C>(x, k, w + g * R * row_bytes, R * row_bytes, wb.row_step(g * R),
                                   wb.block_step(g * R), last - 1 - g, ahead, xs, y + g * R, ldy);
        }
    }
    for (int64_t r = groups * R; r < n; ++r)
        gemv_rows<F, 1, C>(x, k, w + r * row_bytes, row_bytes, row_bytes, F::kBytes, 0, 1, xs, y + r, ldy);
}

template <typename F>
void matmul(const float* x, int64_t m, int64_t k, const uint8_t* w, int32_t type, int64_t n, float* y, int64_t ldy) {
    switch (m) {
        case 1: gemv<F, 1>(x, k, w, type, n, y, ldy); return;
        case 2: gemv<F, 2>(x, k, w, type, n, y, ldy); return;
        case 3: gemv<F, 3>(x, k, w, type, n, y, ldy); return;
        case 4: gemv<F, 4>(x, k, w, type, n, y, ldy); return;
        default: break;
    }
    const RowBlocks wb(w, type, n, k, F::kBlock, F::kBytes);
    kvserve::widened_matmul(x, m, k, n, F::kBlock, y, ldy, [&](int64_t n0, int rows, int64_t k0, int64_t kc,
                                                                float* buf) {
        widen_blocks<F>(wb, n, n0, rows, k0, kc, buf);
    });
}

template <typename F>
void dequantize(const uint8_t* w, int32_t type, int64_t rows, int64_t k, float* out) {
    const RowBlocks wb(w, type, rows, k, F::kBlock, F::kBytes);
#pragma omp parallel for schedule(static) if (rows >= 64)
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < k / F::kBlock; ++b) decode_row_block<F>(wb, r, b, out + r * k + b * F::kBlock);
}

// w [n, k] in the file's layout -> out in the layout of kernel type `type` (kRows4, and kQ5Tiles or not), the same
// bytes.
template <typename F>
void interleave_rows(const uint8_t* w, int32_t type, int64_t n, int64_t k, uint8_t* out) {
    const RowBlocks src(w, 0, n, k, F::kBlock, F::kBytes), dst(out, type, n, k, F::kBlock, F::kBytes);
    const int64_t blocks = k / F::kBlock, row_bytes = src.row_bytes;
    uint8_t* unused = nullptr;
#pragma omp parallel for schedule(static) if (n >= 64)
    for (int64_t g = 0; g < n / 4; ++g) {
        uint8_t* group = out + 4 * g * row_bytes;
        if (dst.tiles) memset(group, 0, 4 * row_bytes);
        for (int r = 0; r < 4; ++r)
            for (int64_t b = 0; b < blocks; ++b) {
                const uint8_t* block = src.block(4 * g + r, b, unused);
                if (dst.tiles)
                    Q5Tile::put(block, r, static_cast<int>(b % 4), group + b / 4 * Q5Tile::kBytes);
                else
                    memcpy(group + (4 * b + r) * F::kBytes, block, F::kBytes);
            }
    }
    memcpy(out + n / 4 * 4 * row_bytes, w + n / 4 * 4 * row_bytes, n % 4 * row_bytes);  // the rows after the groups
}

}  // namespace

extern "C" {

// x: [m, k] contiguous; w: [n, k / block] blocks of `type`, rows contiguous, or interleaved four at a time where
// type has kRows4 (and in Q5_0 tiles with kQ5Tiles; gguf_formats.h's RowBlocks); y: [m, >= n], rows ldy apart.
// Requires k to be a multiple of the type's block (32 or 256).
void kvserve_gguf_matmul(const float* x, int64_t m, int64_t k, const uint8_t* w, int32_t type, int64_t n,
                         float* y, int64_t ldy) {
    dispatch(type, [&](auto format) { matmul<decltype(format)>(x, m, k, w, type, n, y, ldy); });
}

// rows of k weights stored as blocks of `type` (in either layout) -> out [rows, k] float32 (an embedding's
// looked-up rows).
void kvserve_gguf_dequantize(const uint8_t* w, int32_t type, int64_t rows, int64_t k, float* out) {
    dispatch(type, [&](auto format) { dequantize<decltype(format)>(w, type, rows, k, out); });
}

// w [n, k] of a ggml type as the file stores it -> out (as many bytes) in the layout of kernel type `type` (that
// ggml type plus kRows4, and plus kQ5Tiles for Q5_0 tiles).
void kvserve_gguf_interleave_rows(const uint8_t* w, int32_t type, int64_t n, int64_t k, uint8_t* out) {
    dispatch(type, [&](auto format) { interleave_rows<decltype(format)>(w, type, n, k, out); });
}

}
