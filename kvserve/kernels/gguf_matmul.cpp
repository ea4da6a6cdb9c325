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
// Block layouts (ggml-common.h; gguf-py's quants.py): sizes in bytes per block of 32 or 256 weights.
//   Q4_0 (18 / 32):   f16 d, 16 B nibbles (low: weights 0-15, high: 16-31);              w = d (q - 8)
//   Q5_0 (22 / 32):   f16 d, u32 fifth bits, 16 B nibbles as Q4_0;                       w = d (q - 16)
//   Q8_0 (34 / 32):   f16 d, 32 int8;                                                      w = d q
//   Q4_K (144 / 256): f16 d, f16 dmin, 12 B of 6-bit (scale, min) x 8, 128 B nibbles; per 32-weight
//                     sub-block j: w = (d sc_j) q - (dmin m_j), nibbles of chunk j/2 (low for even j)
//   Q5_K (176 / 256): as Q4_K plus 32 B of fifth bits (bit j of byte l for weight 32 j + l)
//   Q6_K (210 / 256): 128 B low nibbles, 64 B high 2-bit pairs, 16 int8 scales (one per 16), f16 d;
//                     w = (d sc) (q - 32)
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "kernels.h"
#include "widened_matmul.h"

namespace {

using kvserve::hsum;

inline float f16(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 8 int8 at q -> float32.
inline __m256 cvt8(const int8_t* q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}

// 16 bytes of nibbles -> 32 bytes: the low nibbles, then the high ones.
inline __m256i nibbles32(__m128i b) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
}

// Byte j of the result is 0x10 where bit j of `bits` is set, else 0.
inline __m256i bits_to_0x10(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int>(bits)),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

inline void store32(int8_t* dst, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v); }

// Each format's `visit(block, tmp, run)` decodes one block into runs of 32 small integers and calls
// run(offset, q, s_lo, s_hi, min) for each: weight offset + i is s * q[i] (- min, for formats with kMin), with
// s = s_lo for i < 16 and s_hi after (kSplitScale: Q6_K has a scale per 16; elsewhere s_lo == s_hi). q points
// into the block (Q8_0) or at tmp[32].

struct Q4_0 {
    static constexpr int64_t kBlock = 32, kBytes = 18;
    static constexpr bool kMin = false, kSplitScale = false;
    template <typename Run>
    static void visit(const uint8_t* b, int8_t* tmp, const Run& run) {
        store32(tmp, _mm256_sub_epi8(nibbles32(load16(b + 2)), _mm256_set1_epi8(8)));
        const float d = f16(b);
        run(0, tmp, d, d, 0.0f);
    }
};

struct Q5_0 {
    static constexpr int64_t kBlock = 32, kBytes = 22;
    static constexpr bool kMin = false, kSplitScale = false;
    template <typename Run>
    static void visit(const uint8_t* b, int8_t* tmp, const Run& run) {
        uint32_t bits;
        memcpy(&bits, b + 2, 4);
        const __m256i q = _mm256_or_si256(nibbles32(load16(b + 6)), bits_to_0x10(bits));
        store32(tmp, _mm256_sub_epi8(q, _mm256_set1_epi8(16)));
        const float d = f16(b);
        run(0, tmp, d, d, 0.0f);
    }
};

struct Q8_0 {
    static constexpr int64_t kBlock = 32, kBytes = 34;
    static constexpr bool kMin = false, kSplitScale = false;
    template <typename Run>
    static void visit(const uint8_t* b, int8_t*, const Run& run) {
        const float d = f16(b);
        run(0, reinterpret_cast<const int8_t*>(b + 2), d, d, 0.0f);
    }
};

// The 8 six-bit (scale, min) pairs of a Q4_K / Q5_K block, as float32 products with d and dmin.
inline void k_scales(const uint8_t* b, float* scale, float* min) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t* s = b + 4;
    for (int j = 0; j < 4; ++j) {
        scale[j] = d * static_cast<float>(s[j] & 63);
        min[j] = dmin * static_cast<float>(s[j + 4] & 63);
        scale[j + 4] = d * static_cast<float>((s[j + 8] & 0x0F) | ((s[j] >> 6) << 4));
        min[j + 4] = dmin * static_cast<float>((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

struct Q4_K {
    static constexpr int64_t kBlock = 256, kBytes = 144;
    static constexpr bool kMin = true, kSplitScale = false;
    template <typename Run>
    static void visit(const uint8_t* b, int8_t* tmp, const Run& run) {
        float scale[8], min[8];
        k_scales(b, scale, min);
        const __m256i mask = _mm256_set1_epi8(0x0F);
        for (int j = 0; j < 8; ++j) {
            const __m256i q = load32(b + 16 + 32 * (j / 2));
            store32(tmp, _mm256_and_si256(j % 2 ? _mm256_srli_epi16(q, 4) : q, mask));
            run(32 * j, tmp, scale[j], scale[j], min[j]);
        }
    }
};

struct Q5_K {
    static constexpr int64_t kBlock = 256, kBytes = 176;
    static constexpr bool kMin = true, kSplitScale = false;
    template <typename Run>
    static void visit(const uint8_t* b, int8_t* tmp, const Run& run) {
        float scale[8], min[8];
        k_scales(b, scale, min);
        const __m256i mask = _mm256_set1_epi8(0x0F), high = load32(b + 16), five = _mm256_set1_epi8(0x10);
        for (int j = 0; j < 8; ++j) {
            const __m256i q = load32(b + 48 + 32 * (j / 2));
            const __m256i low = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(q, 4) : q, mask);
            const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
            const __m256i fifth = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(high, bit), bit), five);
            store32(tmp, _mm256_or_si256(low, fifth));
            run(32 * j, tmp, scale[j], scale[j], min[j]);
        }
    }
};

struct Q6_K {
    static constexpr int64_t kBlock = 256, kBytes = 210;
    static constexpr bool kMin = false, kSplitScale = true;
    template <typename Run>
    static void visit(const uint8_t* b, int8_t* tmp, const Run& run) {
        const float d = f16(b + 208);
        const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
        const __m256i mask = _mm256_set1_epi8(0x0F), bias = _mm256_set1_epi8(32);
        for (int h = 0; h < 2; ++h) {
            const __m256i la = load32(b + 64 * h), lb = load32(b + 64 * h + 32), hb = load32(b + 128 + 32 * h);
            // The four runs of 32 weights of this half: low nibbles of la / lb, then their high nibbles, each
            // with its pair of high bits (bits 0-1, 2-3, 4-5, 6-7 of hb) as bits 4-5.
            const __m256i q[4] = {
                _mm256_or_si256(_mm256_and_si256(la, mask),
                                _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(0x03)), 4)),
                _mm256_or_si256(_mm256_and_si256(lb, mask),
                                _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(0x0C)), 2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), mask),
                                _mm256_and_si256(hb, _mm256_set1_epi8(0x30))),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), mask),
                                _mm256_srli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(static_cast<char>(0xC0))), 2)),
            };
            for (int s = 0; s < 4; ++s) {
                store32(tmp, _mm256_sub_epi8(q[s], bias));
                const int i = 8 * h + 2 * s;  // one scale per 16 weights
                run(128 * h + 32 * s, tmp, d * static_cast<float>(sc[i]), d * static_cast<float>(sc[i + 1]), 0.0f);
            }
        }
    }
};

// One block to float32 at dst: the same float32 products (scale, then minus min), in the same order, as
// gguf-py's dequantize, so the weights are bit-exact.
template <typename F>
inline void decode(const uint8_t* b, float* dst) {
    alignas(32) int8_t tmp[32];
    F::visit(b, tmp, [&](int64_t offset, const int8_t* q, float s_lo, float s_hi, float min) {
#if defined(__AVX512F__)
        for (int i = 0; i < 2; ++i) {  // 16 at a time: half the instructions of the AVX2 loop, the same products
            const __m128i q16 = load16(reinterpret_cast<const uint8_t*>(q) + 16 * i);
            const __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q16));
            __m512 w = _mm512_mul_ps(qf, _mm512_set1_ps(i == 0 ? s_lo : s_hi));
            if constexpr (F::kMin) w = _mm512_sub_ps(w, _mm512_set1_ps(min));
            _mm512_storeu_ps(dst + offset + 16 * i, w);
        }
#else
        for (int i = 0; i < 4; ++i) {
            __m256 w = _mm256_mul_ps(cvt8(q + 8 * i), _mm256_set1_ps(i < 2 ? s_lo : s_hi));
            if constexpr (F::kMin) w = _mm256_sub_ps(w, _mm256_set1_ps(min));
            _mm256_storeu_ps(dst + offset + 8 * i, w);
        }
#endif
    });
}

// Prefetch one block's bytes (every cache line it touches) into L1: the matmuls below stream weights that are
// far too large for the caches, and the hardware prefetchers alone keep too few lines in flight while each
// block costs tens of instructions to decode (the LM head at one activation row ran at ~4 GB/s per core).
template <typename F>
inline void prefetch_block(const uint8_t* p) {
    for (int64_t o = 0; o < F::kBytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T0);
}

// Columns [k0, k0 + kc) (whole blocks) of rows [n0, n0 + rows) of w to float32 in buf[rows][kc].
template <typename F>
inline void widen_blocks(const uint8_t* w, int64_t k, int64_t n, int64_t n0, int rows, int64_t k0, int64_t kc,
                         float* buf) {
    const int64_t row_bytes = k / F::kBlock * F::kBytes;
    // The same columns of the next block of rows are prefetched (see prefetch_block).
    const bool prefetch = n0 + 2 * kvserve::kWidenRows <= n;
    for (int r = 0; r < rows; ++r) {
        const uint8_t* src = w + (n0 + r) * row_bytes + k0 / F::kBlock * F::kBytes;
        for (int64_t b = 0; b < kc / F::kBlock; ++b) {
            if (prefetch) prefetch_block<F>(src + kvserve::kWidenRows * row_bytes + b * F::kBytes);
            decode<F>(src + b * F::kBytes, buf + r * kc + b * F::kBlock);
        }
    }
}

// Each weight row's dot products with C activation rows in registers. Weight rows are taken R at a time
// (interleaved block by block: R * C independent accumulator chains, so that no chain of FMAs through one
// register bounds the speed) while the next R rows are prefetched. Each run of 32 integers is converted in
// registers and dotted with x; its scale is applied to the partial sum (s * sum(q x) instead of sum((s q) x):
// the same terms, rounded in another order), and a K-quant's min as min * sum(x) over the run, with the runs'
// sums of x computed once per call (xsum).
template <typename F, int R, int C>
inline void gemv_rows(const float* x, int64_t k, const uint8_t* rows, int64_t row_bytes, bool prefetch,
                      const float* xsum, float* y, int64_t ldy) {
    alignas(32) int8_t tmp[32];
    __m256 acc[R][C];
    float mins[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
            acc[r][c] = _mm256_setzero_ps();
            mins[r][c] = 0.0f;
        }
    const int64_t runs = k / 32;
    for (int64_t b = 0; b < k / F::kBlock; ++b) {
        for (int r = 0; r < R; ++r) {
            const uint8_t* block = rows + r * row_bytes + b * F::kBytes;
            if (prefetch) prefetch_block<F>(block + R * row_bytes);
            F::visit(block, tmp, [&](int64_t offset, const int8_t* q, float s_lo, float s_hi, float min) {
                const __m256 q0 = cvt8(q), q1 = cvt8(q + 8), q2 = cvt8(q + 16), q3 = cvt8(q + 24);
                const int64_t at = b * F::kBlock + offset;
                for (int c = 0; c < C; ++c) {
                    const float* xr = x + c * k + at;
                    if constexpr (F::kSplitScale) {
                        const __m256 lo = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xr + 8),
                                                          _mm256_mul_ps(q0, _mm256_loadu_ps(xr)));
                        const __m256 hi = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xr + 24),
                                                          _mm256_mul_ps(q2, _mm256_loadu_ps(xr + 16)));
                        acc[r][c] = _mm256_fmadd_ps(lo, _mm256_set1_ps(s_lo),
                                                    _mm256_fmadd_ps(hi, _mm256_set1_ps(s_hi), acc[r][c]));
                    } else {
                        __m256 p = _mm256_mul_ps(q0, _mm256_loadu_ps(xr));
                        p = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xr + 8), p);
                        p = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xr + 16), p);
                        p = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xr + 24), p);
                        acc[r][c] = _mm256_fmadd_ps(p, _mm256_set1_ps(s_lo), acc[r][c]);
                    }
                    if constexpr (F::kMin) mins[r][c] += min * xsum[c * runs + at / 32];
                }
            });
        }
    }
    for (int c = 0; c < C; ++c) {
        float* out = y + c * ldy;
        if constexpr (R == 4) {
            // four adjacent outputs reduced together, as widened_matmul.h's micro-kernel does
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0][c], acc[1][c]),
                                            _mm256_hadd_ps(acc[2][c], acc[3][c]));
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            if constexpr (F::kMin) s = _mm_sub_ps(s, _mm_setr_ps(mins[0][c], mins[1][c], mins[2][c], mins[3][c]));
            _mm_storeu_ps(out, s);
        } else {
            for (int r = 0; r < R; ++r) out[r] = hsum(acc[r][c]) - mins[r][c];
        }
    }
}

// C <= 4 activation rows (decode): each weight is used C times only, so widening it to float32 in memory costs
// more than it saves. Four weight rows at a time (measured against two at C = 3 and 4: four is faster even where
// the accumulators spill); the last n % 4 rows one at a time.
template <typename F, int C>
void gemv(const float* x, int64_t k, const uint8_t* w, int64_t n, float* y, int64_t ldy) {
    constexpr int R = 4;
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
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; ++g)
        gemv_rows<F, R, C>(x, k, w + g * R * row_bytes, row_bytes, g + 1 < groups, xs, y + g * R, ldy);
    for (int64_t r = groups * R; r < n; ++r)
        gemv_rows<F, 1, C>(x, k, w + r * row_bytes, row_bytes, false, xs, y + r, ldy);
}

template <typename F>
void matmul(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, float* y, int64_t ldy) {
    switch (m) {
        case 1: gemv<F, 1>(x, k, w, n, y, ldy); return;
        case 2: gemv<F, 2>(x, k, w, n, y, ldy); return;
        case 3: gemv<F, 3>(x, k, w, n, y, ldy); return;
        case 4: gemv<F, 4>(x, k, w, n, y, ldy); return;
        default: break;
    }
    kvserve::widened_matmul(x, m, k, n, F::kBlock, y, ldy, [&](int64_t n0, int rows, int64_t k0, int64_t kc,
                                                                float* buf) {
        widen_blocks<F>(w, k, n, n0, rows, k0, kc, buf);
    });
}

template <typename F>
void dequantize(const uint8_t* w, int64_t rows, int64_t k, float* out) {
    const int64_t row_bytes = k / F::kBlock * F::kBytes;
#pragma omp parallel for schedule(static) if (rows >= 64)
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < k / F::kBlock; ++b)
            decode<F>(w + r * row_bytes + b * F::kBytes, out + r * k + b * F::kBlock);
}

// ggml's type ids (GGMLQuantizationType).
enum : int32_t { kQ4_0 = 2, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

template <typename Call>
void dispatch(int32_t type, const Call& call) {
    switch (type) {
        case kQ4_0: call(Q4_0{}); break;
        case kQ5_0: call(Q5_0{}); break;
        case kQ8_0: call(Q8_0{}); break;
        case kQ4_K: call(Q4_K{}); break;
        case kQ5_K: call(Q5_K{}); break;
        case kQ6_K: call(Q6_K{}); break;
        default:  // callers pass only gguf_blocks.NATIVE_GGUF_TYPES: another type is a bug, not an unwritten output
            fprintf(stderr, "kvserve: no GGUF kernel for ggml type %d; aborting\n", static_cast<int>(type));
            abort();
    }
}

}  // namespace

extern "C" {

// x: [m, k] contiguous; w: [n, k / block] blocks of `type`, rows contiguous; y: [m, >= n], rows ldy apart.
// Requires k to be a multiple of the type's block (32 or 256).
void kvserve_gguf_matmul(const float* x, int64_t m, int64_t k, const uint8_t* w, int32_t type, int64_t n,
                         float* y, int64_t ldy) {
    dispatch(type, [&](auto format) { matmul<decltype(format)>(x, m, k, w, n, y, ldy); });
}

// rows of k weights stored as blocks of `type` -> out [rows, k] float32 (an embedding's looked-up rows).
void kvserve_gguf_dequantize(const uint8_t* w, int32_t type, int64_t rows, int64_t k, float* out) {
    dispatch(type, [&](auto format) { dequantize<decltype(format)>(w, rows, k, out); });
}

}
