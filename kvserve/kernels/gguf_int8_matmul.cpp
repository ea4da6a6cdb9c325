// Matmul on GGUF quantized blocks with 8-bit activations (`--activation-quantization int8`):
//
// y[m, n] = sum_k x8[m, k] * W[n, k]        (x8: x quantized per run of 32 values; W the file's blocks)
//
// Why: the float32 path (gguf_matmul.cpp) widens every weight to float32 and multiplies float32 activations,
// so its speed is bounded by the float32 FMA rate (prefill, batches) or by the instructions spent widening
// each block (decode). Here each row of activations is quantized once per call as llama.cpp's Q8_0 activation
// blocks are (per run of 32: d = max|x| / 127, q = round(x / d), rounding half to even), and each run of 32
// weights is dotted with it as integers: products of 8-bit values summed in 32-bit lanes, one scale multiply per
// run instead of one per weight. The result equals the float32 matmul of the dequantized weights with the
// dequantized activations (d q) up to summation order; kernels/ops.py's torch path computes exactly that, and
// is what this file is tested against. The K-quants' mins are applied as min * d * sum(q) per run.
//
// Two shapes, chosen by the number of activation rows:
// - up to 4 rows (decode): each weight row's runs decoded to their stored unsigned codes (gguf_formats.h's
//   visit<true>) and dotted with each activation row in registers, codes (unsigned) times x (signed), the
//   format's offset taken back as kZero * sum(x) (for one-run blocks once a block for four weight rows, in float;
//   for Q6_K in the integer sum's initial value), Q8_0's signed bytes as
//   w + 128 with offset 128: `vpdpbusd` where the CPU has VNNI (AVX-512 VNNI on 256-bit registers, or
//   AVX-VNNI); else `vpmaddubsw` + `vpmaddwd` (AVX2), Q8_0 as |w| times x with w's sign (codes <= 63,
//   |w| <= 128 and |x| <= 127 keep its 16-bit pair sums from saturating);
// - more rows, with no VNNI at all (AVX2): the quantized rows dequantized back to float32 (d q, per run) and
//   multiplied by gguf_matmul.cpp's blocked float32 matmul, which widens each weight block once for all the rows:
//   the same definition (the dequantized weights times the dequantized activations), where the four-row gemvs
//   decoded every block again for each four rows (a 512-token prefill of the instruct model on a Zen 3 took 5.1 s
//   that way, hardly ahead of its exact path);
// - more rows, with AVX-512 VNNI: weights packed 32 rows at a time in an L2-resident panel whose 16 lanes are
//   16 weight rows (each 32-bit lane 4 consecutive weights of its row, offset to unsigned by +128), so that one
//   `vpdpbusd` multiplies 16 rows by 4 broadcast activation bytes and a run's scales are applied to 16 outputs
//   per instruction; the +128 is taken back as -128 * sum(q) per run of the activation row. With AVX-VNNI only
//   (256-bit, no AVX-512) the rows go through the first shape four at a time.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "gguf_formats.h"
#include "kernels.h"
#include "simd.h"

namespace {

using kvserve::hsum;
using namespace kvserve::gguf;

// The activation rows, quantized: q [m, k] int8, per run of 32 its scale d and, for the corrections below, the
// sums of q over each half-run of 16 (sums16 [m, k / 16]) and d * sum(q) over each run (dsum [m, k / 32]).
struct Q8Rows {
    std::vector<int8_t> q;
    std::vector<float> d, dsum;
    std::vector<int32_t> sums16;
    int64_t m = 0, k = 0;
};

inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

// One run of 32 floats -> 32 int8 at q; returns d. q = round_half_even(x * (1 / d)), d = max|x| / 127 (0: all 0).
inline float quantize_run(const float* x, int8_t* q, int32_t* sums16) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    const float d = hmax(amax) / 127.0f;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256i i32[4];
    for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));  // MXCSR: half to even
    sums16[0] = hsum_i32(_mm256_add_epi32(i32[0], i32[1]));
    sums16[1] = hsum_i32(_mm256_add_epi32(i32[2], i32[3]));
    // packs interleave the 128-bit lanes: dwords come out as (0, 2, 4, 6, 1, 3, 5, 7) of the wanted order
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    return d;
}

void quantize_rows(const float* x, int64_t m, int64_t k, Q8Rows& a) {
    const int64_t runs = k / 32;
    a.m = m;
    a.k = k;
    a.q.resize(m * k);
    a.d.resize(m * runs);
    a.dsum.resize(m * runs);
    a.sums16.resize(m * 2 * runs);
#pragma omp parallel for schedule(static) if (m * k >= 65536)
    for (int64_t r = 0; r < m; ++r)
        for (int64_t j = 0; j < runs; ++j) {
            const int64_t at = r * runs + j;
            int32_t* sums = a.sums16.data() + 2 * at;
            const float d = quantize_run(x + r * k + 32 * j, a.q.data() + r * k + 32 * j, sums);
            a.d[at] = d;
            a.dsum[at] = d * static_cast<float>(sums[0] + sums[1]);
        }
}

// acc + 8 lanes, each the sum of 4 adjacent products u[i] * s[i] (u unsigned bytes, s signed).
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// Where vpdpbusd exists, signed bytes (Q8_0) go in as codes too: w + 128 (w with its top bit flipped), 128 their
// offset; one operation a run where |w| and x with w's sign took two. vpmaddubsw cannot take them so: its 16-bit
// pair sums of 255 x 127 would saturate.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
constexpr bool kFlipSigned = true;
#else
constexpr bool kFlipSigned = false;
#endif

// The offset a format's codes are stored above their values (gguf_formats.h's kZero; 128 for flipped signed bytes).
template <typename F>
constexpr int kOffset = F::kSigned ? (kFlipSigned ? 128 : 0) : F::kZero;

// Each activation row's -kOffset * sum(x) per half run as the initial value of that run's integer dot product:
// lane 0 the first half's, lane 4 the second's (the lanes a format with a scale per 16 scales apart), the rest 0;
// [m, runs, 8], empty where the offset is 0. The dot of the codes plus this is the dot of the values, exactly.
template <typename F>
std::vector<int32_t> zero_offsets(const Q8Rows& a) {
    const int64_t runs = a.k / 32;
    std::vector<int32_t> out(kOffset<F> == 0 || F::kBlock == 32 ? 0 : a.m * runs * 8, 0);
    for (int64_t i = 0; i < static_cast<int64_t>(out.size()) / 8; ++i) {
        out[i * 8] = -kOffset<F> * a.sums16[2 * i];
        out[i * 8 + 4] = -kOffset<F> * a.sums16[2 * i + 1];
    }
    return out;
}

// Lane r (0-3) of each 128-bit half of v, in all four lanes of that half: vshufps with an immediate (r is a
// constant once gemv_rows is unrolled). _mm256_permutevar_ps with a broadcast index did the same in one
// instruction, but GCC built the index vector again for each use (vmovd + vpbroadcastd, or a reload from the
// stack). Fewer instructions; no change measured in a decode step (docs/PERFORMANCE_NOTES.md attempt 73).
inline __m256 lane_of_halves(__m256 v, int r) {
    switch (r) {
        case 0: return _mm256_shuffle_ps(v, v, 0x00);
        case 1: return _mm256_shuffle_ps(v, v, 0x55);
        case 2: return _mm256_shuffle_ps(v, v, 0xAA);
        default: return _mm256_shuffle_ps(v, v, 0xFF);
    }
}

// R weight rows against C activation rows (rows c0 .. c0 + C - 1 of a), in registers; see gguf_matmul.cpp's
// gemv_rows for the R x C accumulator layout. Lanes 0-3 of a run's dot hold its first 16 weights, lanes 4-7 the
// rest, so a format with a scale per 16 (Q6_K) scales the halves apart. The weights' codes go in as they are,
// their offset taken off by `offsets` (zero_offsets); without VNNI, Q8_0's signed bytes as |w| against x with w's
// sign. rows: the first row's first block; row r's block b at rows + r * row_step + b * block_step (RowBlocks);
// group_bytes: the bytes of R rows, the distance to the same block of the next group.
template <typename F, int R, int C>
inline void gemv_rows(const Q8Rows& a, const int32_t* offsets, int64_t c0, const uint8_t* rows, int64_t group_bytes,
                      int64_t row_step, int64_t block_step, int64_t groups_after, int64_t ahead, float* y,
                      int64_t ldy) {
    alignas(32) int8_t tmp[32];
    const int64_t k = a.k, runs = k / 32;
    constexpr bool kSignTrick = F::kSigned && !kFlipSigned;
    constexpr bool kOneRun = F::kBlock == 32;
    // One-run blocks (Q4_0, Q5_0, Q8_0): the R rows' f16 scales gathered in a general register, converted together and
    // multiplied by each activation row's d; each row's product then broadcast from that register (an in-lane
    // permute) into the run's FMA. The format's offset is taken off per block for the R rows at once, as
    // kOffset * s * dsum (dsum: d * sum(q) of the activation run), instead of as an integer term of every run's dot.
    // K-quants: a row's 8 runs' scale products (16 half runs for Q6_K) made a block at a time and broadcast from
    // memory, its mins' products with the runs' d * sum(q) as one FMA a block; Q6_K's offset as `offsets`.
    constexpr int kScales = F::kSplitScale ? 16 : 8;
    alignas(32) float sdx[C][kScales];
    __m256 acc[R][C], min_acc[R][C];
    __m128 off[C];
    for (int c = 0; c < C; ++c) off[c] = _mm_setzero_ps();
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = min_acc[r][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < k / F::kBlock; ++b) {
        __m256 sd[C];
        if constexpr (kOneRun) {
            uint64_t halves = 0;
            for (int r = 0; r < R; ++r) {
                uint16_t h;
                memcpy(&h, rows + r * row_step + b * block_step, 2);
                halves |= static_cast<uint64_t>(h) << (16 * r);
            }
            const __m128 s = _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<long long>(halves)));
            for (int c = 0; c < C; ++c) {
                const __m128 p = _mm_mul_ps(s, _mm_set1_ps(a.d[(c0 + c) * runs + b]));
                sd[c] = _mm256_set_m128(p, p);
                if constexpr (kOffset<F> != 0)
                    off[c] = _mm_fmadd_ps(s, _mm_set1_ps(static_cast<float>(kOffset<F>) * a.dsum[(c0 + c) * runs + b]),
                                          off[c]);
            }
        }
        for (int r = 0; r < R; ++r) {
            const uint8_t* block = rows + r * row_step + b * block_step;
            // Blocks of at most half a cache line (Q4_0, Q5_0): every other block's prefetch still touches every line
            // ahead, at half the instructions (these gemvs are bound by their instructions on AVX2).
            constexpr int64_t kEvery = F::kBytes * 2 <= 64 ? 2 : 1;
            if (b % kEvery == 0) prefetch_ahead<F>(block, group_bytes, groups_after, ahead);
            if constexpr (!kOneRun) {
                alignas(32) float s[16], mn[8];
                F::block_scales(block, s, mn);
                for (int c = 0; c < C; ++c) {
                    const int64_t at = (c0 + c) * runs + b * (F::kBlock / 32);
                    const __m256 dx = _mm256_loadu_ps(a.d.data() + at);
                    if constexpr (F::kSplitScale) {
                        const __m256 lo = _mm256_permutevar8x32_ps(dx, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
                        const __m256 hi = _mm256_permutevar8x32_ps(dx, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
                        _mm256_store_ps(sdx[c], _mm256_mul_ps(_mm256_load_ps(s), lo));
                        _mm256_store_ps(sdx[c] + 8, _mm256_mul_ps(_mm256_load_ps(s + 8), hi));
                    } else {
                        _mm256_store_ps(sdx[c], _mm256_mul_ps(_mm256_load_ps(s), dx));
                    }
                    if constexpr (F::kMin)
                        min_acc[r][c] = _mm256_fmadd_ps(_mm256_load_ps(mn), _mm256_loadu_ps(a.dsum.data() + at),
                                                        min_acc[r][c]);
                }
            }
            F::template visit<true>(block, tmp, [&](int64_t offset, const int8_t* q, float, float, float) {
                const int64_t j = offset / 32, run = b * (F::kBlock / 32) + j;
                const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
                const __m256i wabs = kSignTrick ? _mm256_abs_epi8(w) : w;
                for (int c = 0; c < C; ++c) {
                    const int64_t row = c0 + c;
                    const __m256i x =
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + row * k + 32 * run));
                    const __m256i u =  // flipped signed bytes where kOffset takes them back (VNNI)
                        F::kSigned && !kSignTrick ? _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80))) : w;
                    __m256i dot;
                    if constexpr (kSignTrick)
                        dot = dot_u8s8(_mm256_setzero_si256(), wabs, _mm256_sign_epi8(x, w));
                    else if constexpr (kOffset<F> != 0 && !kOneRun) {
                        const int32_t* o = offsets + (row * runs + run) * 8;
                        dot = dot_u8s8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o)), u, x);
                    } else {
                        dot = dot_u8s8(_mm256_setzero_si256(), u, x);
                    }
                    __m256 scale;
                    if constexpr (kOneRun)  // row r's lane of each 128-bit half
                        scale = lane_of_halves(sd[c], r);
                    else if constexpr (F::kSplitScale)  // lanes 0-3 the run's first 16 weights, 4-7 the rest
                        scale = _mm256_set_m128(_mm_broadcast_ss(&sdx[c][2 * j + 1]),
                                                _mm_broadcast_ss(&sdx[c][2 * j]));
                    else
                        scale = _mm256_broadcast_ss(&sdx[c][j]);
                    acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r][c]);
                }
            });
        }
    }
    for (int c = 0; c < C; ++c) {
        float* out = y + c * ldy;
        alignas(16) float o[4];
        _mm_store_ps(o, off[c]);
        for (int r = 0; r < R; ++r)
            out[r] = (F::kMin ? hsum(acc[r][c]) - hsum(min_acc[r][c]) : hsum(acc[r][c])) - o[r];
    }
}

// Activation rows [c0, c0 + C) against one group of four weight rows stored in Q5_0 tiles (gguf_formats.h's
// Q5Tile), in registers: per tile and weight row, its four blocks' codes (nibbles | the fifth bit shifted out of
// its bit plane to bit 4), their dots with each activation row's four runs, the row's four scales (one load) times
// the runs' d applied per run, and the offset 16 taken off per tile as 16 s * dsum. y[c * ldy + r] for row r.
template <int C>
inline void q5_tile_rows(const Q8Rows& a, int64_t c0, const uint8_t* group, int64_t group_bytes, int64_t groups_after,
                         int64_t ahead, float* y, int64_t ldy) {
    const int64_t k = a.k, runs = k / 32;
    __m256 acc[4][C];
    __m128 off[4][C];
    for (int r = 0; r < 4; ++r)
        for (int c = 0; c < C; ++c) {
            acc[r][c] = _mm256_setzero_ps();
            off[r][c] = _mm_setzero_ps();
        }
    for (int64_t t = 0; t < k / Q5Tile::kWeights; ++t) {
        const uint8_t* tile = group + t * Q5Tile::kBytes;
        prefetch_ahead<Q5Tile>(tile, group_bytes, groups_after, ahead);  // the whole tile, as a block
        __m256i xq[C][4];
        __m128 xd[C], xs[C];
        for (int c = 0; c < C; ++c) {
            const int64_t row = c0 + c;
            const int8_t* q = a.q.data() + row * k + 128 * t;
            for (int i = 0; i < 4; ++i) xq[c][i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * i));
            xd[c] = _mm_loadu_ps(a.d.data() + row * runs + 4 * t);
            xs[c] = _mm_mul_ps(_mm_loadu_ps(a.dsum.data() + row * runs + 4 * t), _mm_set1_ps(16.0f));
        }
        for (int r = 0; r < 4; ++r) {
            const __m128 s = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(tile + 8 * r)));
            const __m256i codes[4] = {Q5Tile::codes(tile, r, 0), Q5Tile::codes(tile, r, 1), Q5Tile::codes(tile, r, 2),
                                      Q5Tile::codes(tile, r, 3)};
            for (int c = 0; c < C; ++c) {
                const __m128 sd = _mm_mul_ps(s, xd[c]);
                const __m256 sd2 = _mm256_set_m128(sd, sd);
                off[r][c] = _mm_fmadd_ps(s, xs[c], off[r][c]);
                for (int i = 0; i < 4; ++i) {
                    const __m256i dot = dot_u8s8(_mm256_setzero_si256(), codes[i], xq[c][i]);
                    acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), lane_of_halves(sd2, i), acc[r][c]);
                }
            }
        }
    }
    for (int c = 0; c < C; ++c)
        for (int r = 0; r < 4; ++r) {
            __m128 o = _mm_add_ps(off[r][c], _mm_movehl_ps(off[r][c], off[r][c]));
            o = _mm_add_ss(o, _mm_movehdup_ps(o));
            y[c * ldy + r] = hsum(acc[r][c]) - _mm_cvtss_f32(o);
        }
}

// Activation rows [c0, c0 + C) against all n weight rows, four weight rows at a time.
template <typename F, int C>
void gemv(const Q8Rows& a, const int32_t* offsets, int64_t c0, const uint8_t* w, int32_t type, int64_t n, float* y,
          int64_t ldy) {
    constexpr int R = 4;
    const RowBlocks wb(w, type, n, a.k, F::kBlock, F::kBytes);
    const int64_t row_bytes = wb.row_bytes, groups = n / R;
    float* yc = y + c0 * ldy;
#pragma omp parallel
    {
        const auto [first, last] = thread_share(groups);
        const int64_t ahead = std::min(prefetch_groups(R * row_bytes, last - first), last - first);
        prefetch_lead_in(w + first * R * row_bytes, R * row_bytes, ahead);
        for (int64_t g = first; g < last; ++g) {
            if constexpr (std::is_same_v<F, Q5_0>) {  // RowBlocks allows tiles of Q5_0 only
                if (wb.tiles) {
                    q5_tile_rows<C>(a, c0, w + g * R * row_bytes, R * row_bytes, last - 1 - g, ahead, yc + g * R, ldy);
                    continue;
                }
            }
            gemv_rows<F, R, C>(a, offsets, c0, w + g * R * row_bytes, R * row_bytes, wb.row_step(g * R),
                               wb.block_step(g * R), last - 1 - g, ahead, yc + g * R, ldy);
        }
    }
    for (int64_t r = groups * R; r < n; ++r)
        gemv_rows<F, 1, C>(a, offsets, c0, w + r * row_bytes, row_bytes, row_bytes, F::kBytes, 0, 1, yc + r, ldy);
}

template <typename F>
void gemv_all(const Q8Rows& a, const uint8_t* w, int32_t type, int64_t n, float* y, int64_t ldy) {
    const std::vector<int32_t> offsets = zero_offsets<F>(a);
    const int32_t* o = offsets.data();
    int64_t c0 = 0;
    for (; c0 + 4 <= a.m; c0 += 4) gemv<F, 4>(a, o, c0, w, type, n, y, ldy);
    switch (a.m - c0) {
        case 3: gemv<F, 3>(a, o, c0, w, type, n, y, ldy); break;
        case 2: gemv<F, 2>(a, o, c0, w, type, n, y, ldy); break;
        case 1: gemv<F, 1>(a, o, c0, w, type, n, y, ldy); break;
        default: break;
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
constexpr int kLanes = 16;             // weight rows per panel: one 512-bit vector of 32-bit lanes
constexpr int kPanelRows = 2 * kLanes;  // two panels per micro-kernel call
constexpr int kMicroRows = 4;          // activation rows per micro-kernel call: 8 + 8 accumulators

// 32 weight rows of the whole k, repacked: for run j, panel p, quad t (weights 4t .. 4t + 3 of the run) and lane
// l, the 4 bytes q[((j * 2 + p) * 8 + t) * 64 + 4 l ...] are row 16 p + l's weights + 128; its scales per half
// run (the same twice unless kSplitScale) and its min per run in s_lo / s_hi / mins[(j * 2 + p) * 16 + l].
// A packed panel as the micro-kernel reads it: in a Panel's buffers, or in weights packed once ahead of time
// (kvserve_gguf_pack_panels_int8). s_hi is read only by formats with two scales a run, mins only by formats with a
// min; elsewhere they may be null.
struct PanelView {
    const uint8_t* q;
    const float* s_lo;
    const float* s_hi;
    const float* mins;
};

struct Panel {
    std::vector<uint8_t> q;
    std::vector<int8_t> rows;  // the 32 rows decoded row-major [32, k], before the transpose into q
    std::vector<float> s_lo, s_hi, mins;
    void size_for(int64_t k) {
        const int64_t runs = k / 32;
        q.resize(runs * 2 * 8 * 64);
        rows.resize(kPanelRows * k);
        s_lo.resize(runs * 2 * kLanes);
        s_hi.resize(runs * 2 * kLanes);
        mins.resize(runs * 2 * kLanes);
    }
    PanelView view() const { return {q.data(), s_lo.data(), s_hi.data(), mins.data()}; }
};

// Bytes of one panel packed ahead of time: its quads, then s_lo, then s_hi and mins where the format reads them.
template <typename F>
int64_t packed_panel_bytes(int64_t k) {
    const int64_t runs = k / 32, scales = runs * 2 * kLanes * static_cast<int64_t>(sizeof(float));
    return runs * 2 * 8 * 64 + scales * (1 + (F::kSplitScale ? 1 : 0) + (F::kMin ? 1 : 0));
}

template <typename F>
PanelView packed_view(const uint8_t* base, int64_t k) {
    const int64_t runs = k / 32, quads = runs * 2 * 8 * 64, scales = runs * 2 * kLanes;
    const float* s = reinterpret_cast<const float*>(base + quads);
    const float* s_hi = F::kSplitScale ? s + scales : nullptr;
    const float* mins = F::kMin ? s + scales * (F::kSplitScale ? 2 : 1) : nullptr;
    return {base, s, s_hi, mins};
}

// 16 rows of 8 quads (32 bytes at src + r * stride) -> out[t * 64 + 4 r ...] = quad t of row r, + 128: an 8 x 8
// transpose of 32-bit quads in each 256-bit half (rows r and r + 8 share a register), with unpacks and one
// cross-lane permute. Gathers did the same at ~20 cycles each, 8 a run, and were the packing's bottleneck.
inline void transpose_quads(const int8_t* src, int64_t stride, uint8_t* out) {
    __m512i a[8], t[8], u[8];
    for (int r = 0; r < 8; ++r) {
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + r * stride));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (r + 8) * stride));
        a[r] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    for (int r = 0; r < 8; r += 2) {
        t[r] = _mm512_unpacklo_epi32(a[r], a[r + 1]);      // quads 0 1 (4 5) of rows r, r + 1
        t[r + 1] = _mm512_unpackhi_epi32(a[r], a[r + 1]);  // quads 2 3 (6 7)
    }
    for (int g = 0; g < 8; g += 4) {
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);          // quad 0 (4) of rows g .. g + 3
        u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);      // quad 1 (5)
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);  // quad 2 (6)
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);  // quad 3 (7)
    }
    // u[q] (rows 0-3) and u[4 + q] (rows 4-7): 128-bit lane 0 quad q, lane 1 quad q + 4, lanes 2-3 the same
    // for rows 8-15. Quad q of rows 0-15 is lanes 0 of u[q], u[4 + q], then lanes 2 of them.
    const __m512i first = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
    const __m512i second = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int q = 0; q < 4; ++q) {
        _mm512_storeu_si512(out + q * 64, _mm512_xor_si512(_mm512_permutex2var_epi64(u[q], first, u[4 + q]), flip));
        _mm512_storeu_si512(out + (q + 4) * 64,
                            _mm512_xor_si512(_mm512_permutex2var_epi64(u[q], second, u[4 + q]), flip));
    }
}

// Two passes: each row's blocks decoded into p.rows (one 32-byte store a run, scales into place), then per run
// and panel the 16 rows' 4-byte quads transposed into the lane order above (transpose_quads). Storing the quads
// one by one straight from the decode (4-byte scatters) packed at ~6 GB/s of blocks and dominated the LM head
// at batch 32.
template <typename F>
void pack_panel(const RowBlocks& w, int64_t k, int64_t n, int64_t n0, Panel& p) {
    alignas(32) int8_t tmp[32];
    const int64_t runs = k / 32;
    for (int i = 0; i < kPanelRows; ++i) {
        const int64_t panel = i / kLanes, lane = i % kLanes;
        int8_t* dst = p.rows.data() + i * k;
        if (n0 + i >= n) {  // past the last row: weights 0 and scales 0
            memset(dst, 0, k);
            for (int64_t j = 0; j < runs; ++j) {
                const int64_t s = (j * 2 + panel) * kLanes + lane;
                p.s_lo[s] = p.s_hi[s] = p.mins[s] = 0.0f;
            }
            continue;
        }
        const int64_t row = n0 + i;
        const bool prefetch = row + kPanelRows < n;  // the same row of the next panel, block by block
        alignas(32) uint8_t copy[F::kBytes];
        for (int64_t b = 0; b < k / F::kBlock; ++b) {
            if (prefetch) prefetch_block<F>(w.near(row + kPanelRows, b));
            F::visit(w.block(row, b, copy), tmp, [&](int64_t offset, const int8_t* q, float s_lo, float s_hi, float min) {
                const int64_t at = b * F::kBlock + offset, s = (at / 32 * 2 + panel) * kLanes + lane;
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + at),
                                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
                p.s_lo[s] = s_lo;
                p.s_hi[s] = s_hi;
                p.mins[s] = min;
            });
        }
    }
    for (int64_t j = 0; j < runs; ++j) {
        for (int panel = 0; panel < 2; ++panel) transpose_quads(p.rows.data() + panel * kLanes * k + 32 * j, k,
                                                                &p.q[(j * 2 + panel) * 8 * 64]);
    }
}

inline int32_t load_i32(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

// Activation rows [m0, m0 + M) against the 32 rows of a panel -> y[m0 + i, n0 .. n0 + 31] (the first `valid`).
template <typename F, int M>
inline void panel_micro(const PanelView& p, const Q8Rows& a, int64_t m0, float* y, int64_t ldy, int64_t n0, int valid) {
    const int64_t k = a.k, runs = k / 32;
    __m512 acc[M][2];
    for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    constexpr int kHalves = F::kSplitScale ? 2 : 1, kQuads = 8 / kHalves;
    for (int64_t j = 0; j < runs; ++j) {
        const uint8_t* qj = p.q + j * 2 * 8 * 64;
        for (int h = 0; h < kHalves; ++h) {
            __m512i dot[M][2];
            for (int i = 0; i < M; ++i) {
                const int32_t* sums = &a.sums16[((m0 + i) * runs + j) * 2];
                const int32_t sum = kHalves == 2 ? sums[h] : sums[0] + sums[1];
                dot[i][0] = dot[i][1] = _mm512_set1_epi32(-128 * sum);  // the +128 of the packed weights
            }
            for (int t = h * kQuads; t < (h + 1) * kQuads; ++t) {
                const __m512i w0 = _mm512_loadu_si512(qj + t * 64), w1 = _mm512_loadu_si512(qj + (8 + t) * 64);
                for (int i = 0; i < M; ++i) {
                    const __m512i x = _mm512_set1_epi32(load_i32(a.q.data() + (m0 + i) * k + 32 * j + 4 * t));
                    dot[i][0] = _mm512_dpbusd_epi32(dot[i][0], w0, x);
                    dot[i][1] = _mm512_dpbusd_epi32(dot[i][1], w1, x);
                }
            }
            const float* sv = h == 0 ? p.s_lo : p.s_hi;
            const __m512 s0 = _mm512_loadu_ps(sv + j * 2 * kLanes), s1 = _mm512_loadu_ps(sv + (j * 2 + 1) * kLanes);
            for (int i = 0; i < M; ++i) {
                const __m512 dx = _mm512_set1_ps(a.d[(m0 + i) * runs + j]);
                acc[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][0]), _mm512_mul_ps(s0, dx), acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][1]), _mm512_mul_ps(s1, dx), acc[i][1]);
            }
        }
        if constexpr (F::kMin) {
            const __m512 n0v = _mm512_loadu_ps(p.mins + j * 2 * kLanes);
            const __m512 n1v = _mm512_loadu_ps(p.mins + (j * 2 + 1) * kLanes);
            for (int i = 0; i < M; ++i) {
                const __m512 xs = _mm512_set1_ps(a.dsum[(m0 + i) * runs + j]);
                acc[i][0] = _mm512_fnmadd_ps(n0v, xs, acc[i][0]);
                acc[i][1] = _mm512_fnmadd_ps(n1v, xs, acc[i][1]);
            }
        }
    }
    const __mmask16 lo = valid >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
    const __mmask16 hi = valid >= kPanelRows ? 0xFFFF
                         : valid <= kLanes   ? 0
                                             : static_cast<__mmask16>((1u << (valid - kLanes)) - 1);
    for (int i = 0; i < M; ++i) {
        float* out = y + (m0 + i) * ldy + n0;
        _mm512_mask_storeu_ps(out, lo, acc[i][0]);
        _mm512_mask_storeu_ps(out + kLanes, hi, acc[i][1]);
    }
}

// packed: the weights packed ahead of time (kvserve_gguf_pack_panels_int8), read in place; null: each panel is
// packed here, once per activation tile.
template <typename F>
void panel_gemm(const Q8Rows& a, const uint8_t* weights, int32_t type, const uint8_t* packed, int64_t n, float* y,
                int64_t ldy) {
    const int64_t k = a.k, m = a.m, panels = (n + kPanelRows - 1) / kPanelRows;
    const RowBlocks w(weights, type, n, k, F::kBlock, F::kBytes);
    // Activation rows in tiles whose int8 rows stay in a core's L2 while a tile runs against every panel; a panel
    // is repacked once per tile (k * 32 bytes against 2 * k * 32 * tile multiply-adds).
    const int64_t tile = std::max<int64_t>(kMicroRows, (512 * 1024 / k) / kMicroRows * kMicroRows);
    const int64_t panel_bytes = packed_panel_bytes<F>(k);
#pragma omp parallel
    {
        Panel p;
        if (packed == nullptr) p.size_for(k);
        for (int64_t m_lo = 0; m_lo < m; m_lo += tile) {
            const int64_t m_hi = std::min(m, m_lo + tile);
#pragma omp for schedule(static)
            for (int64_t g = 0; g < panels; ++g) {
                const int64_t n0 = g * kPanelRows;
                const int valid = static_cast<int>(std::min<int64_t>(kPanelRows, n - n0));
                if (packed == nullptr) pack_panel<F>(w, k, n, n0, p);
                const PanelView v = packed == nullptr ? p.view() : packed_view<F>(packed + g * panel_bytes, k);
                int64_t m0 = m_lo;
                for (; m0 + kMicroRows <= m_hi; m0 += kMicroRows) panel_micro<F, kMicroRows>(v, a, m0, y, ldy, n0, valid);
                switch (m_hi - m0) {
                    case 3: panel_micro<F, 3>(v, a, m0, y, ldy, n0, valid); break;
                    case 2: panel_micro<F, 2>(v, a, m0, y, ldy, n0, valid); break;
                    case 1: panel_micro<F, 1>(v, a, m0, y, ldy, n0, valid); break;
                    default: break;
                }
            }
        }
    }
}

// Every panel of w [n, k] packed into out, panel after panel (packed_panel_bytes each).
template <typename F>
void pack_panels(const uint8_t* weights, int32_t type, int64_t k, int64_t n, uint8_t* out) {
    const RowBlocks w(weights, type, n, k, F::kBlock, F::kBytes);
    const int64_t panels = (n + kPanelRows - 1) / kPanelRows, bytes = packed_panel_bytes<F>(k);
    const int64_t runs = k / 32, quads = runs * 2 * 8 * 64, scales = runs * 2 * kLanes * sizeof(float);
#pragma omp parallel
    {
        Panel p;
        p.size_for(k);
#pragma omp for schedule(static)
        for (int64_t g = 0; g < panels; ++g) {
            pack_panel<F>(w, k, n, g * kPanelRows, p);
            uint8_t* dst = out + g * bytes;
            memcpy(dst, p.q.data(), quads);
            memcpy(dst + quads, p.s_lo.data(), scales);
            int64_t at = quads + scales;
            if (F::kSplitScale) memcpy(dst + at, p.s_hi.data(), scales), at += scales;
            if (F::kMin) memcpy(dst + at, p.mins.data(), scales);
        }
    }
}
constexpr bool kPanelPath = true;
#else
constexpr bool kPanelPath = false;
template <typename F>
void panel_gemm(const Q8Rows&, const uint8_t*, int32_t, const uint8_t*, int64_t, float*, int64_t) {}
template <typename F>
int64_t packed_panel_bytes(int64_t) { return 0; }
template <typename F>
void pack_panels(const uint8_t*, int32_t, int64_t, int64_t, uint8_t*) {}
#endif

// Builds with no integer dot-product instruction: more than 4 rows go through the float32 matmul (see the top).
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
constexpr bool kWidenedRows = false;
#else
constexpr bool kWidenedRows = true;
#endif

template <typename F>
void matmul(const float* x, int64_t m, int64_t k, const uint8_t* w, int32_t type, int64_t n, float* y, int64_t ldy,
            const uint8_t* packed = nullptr) {
    Q8Rows a;
    quantize_rows(x, m, k, a);
    if (kWidenedRows && m > 4) {
        std::vector<float> dequantized(m * k);
        const int64_t runs = k / 32;
#pragma omp parallel for schedule(static) if (m * k >= 65536)
        for (int64_t r = 0; r < m; ++r)
            for (int64_t j = 0; j < runs; ++j) {
                const __m256 d = _mm256_set1_ps(a.d[r * runs + j]);
                const int8_t* q = a.q.data() + r * k + 32 * j;
                for (int i = 0; i < 4; ++i)
                    _mm256_storeu_ps(dequantized.data() + r * k + 32 * j + 8 * i,
                                     _mm256_mul_ps(cvt8(q + 8 * i), d));
            }
        kvserve_gguf_matmul(dequantized.data(), m, k, w, type, n, y, ldy);
    } else if (kPanelPath && m > 4) {
        panel_gemm<F>(a, w, type, packed, n, y, ldy);
    } else {
        gemv_all<F>(a, w, type, n, y, ldy);
    }
}

}  // namespace

extern "C" {

// As kvserve_gguf_matmul, with x quantized to 8 bits per run of 32 (see the top of this file).
void kvserve_gguf_matmul_int8(const float* x, int64_t m, int64_t k, const uint8_t* w, int32_t type, int64_t n,
                              float* y, int64_t ldy) {
    dispatch(type, [&](auto format) { matmul<decltype(format)>(x, m, k, w, type, n, y, ldy); });
}

// Bytes of w [n, k] of `type` packed into panels ahead of time (kvserve_gguf_pack_panels_int8); 0 where this
// build has no panel path (it needs AVX-512 VNNI).
void kvserve_gguf_packed_panels_bytes(int32_t type, int64_t n, int64_t k, int64_t* bytes) {
    dispatch(type, [&](auto format) {
        *bytes = kPanelPath ? (n + 31) / 32 * packed_panel_bytes<decltype(format)>(k) : 0;
    });
}

// w's panels, as kvserve_gguf_matmul_int8 packs them at every call above 4 rows, packed once into out (the LM head's
// at batch 32 took about as long to pack as to multiply).
void kvserve_gguf_pack_panels_int8(const uint8_t* w, int32_t type, int64_t n, int64_t k, uint8_t* out) {
    dispatch(type, [&](auto format) { pack_panels<decltype(format)>(w, type, k, n, out); });
}

// kvserve_gguf_matmul_int8 with w's panels packed ahead of time (read in place above 4 rows; w below).
void kvserve_gguf_matmul_int8_packed(const float* x, int64_t m, int64_t k, const uint8_t* w, const uint8_t* packed,
                                     int32_t type, int64_t n, float* y, int64_t ldy) {
    dispatch(type, [&](auto format) { matmul<decltype(format)>(x, m, k, w, type, n, y, ldy, packed); });
}

// x [m, k] (k a multiple of 32) -> q [m, k] int8 and d [m, k / 32]: the activation quantization above, exposed
// so that the torch path can be tested against it.
void kvserve_quantize_int8_activations(const float* x, int64_t m, int64_t k, int8_t* q, float* d) {
    Q8Rows a;
    quantize_rows(x, m, k, a);
    memcpy(q, a.q.data(), m * k);
    memcpy(d, a.d.data(), m * (k / 32) * sizeof(float));
}

// Which integer dot product this build uses: 2 AVX-512 VNNI (with the 32-row panels), 1 AVX-VNNI, 0 AVX2.
void kvserve_int8_dot_isa(int64_t* isa) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    *isa = 2;
#elif defined(__AVXVNNI__)
    *isa = 1;
#else
    *isa = 0;
#endif
}
}
