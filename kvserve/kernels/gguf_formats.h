// The GGUF weight formats kvserve's kernels read, as one table: each struct is a row of type traits (ggml's
// type_traits_cpu is the model): its block size and bytes, whether it has a min (K-quants) or a scale per 16
// weights (Q6_K), and `visit`, which decodes a block into runs of 32 small signed integers. Two matmuls use the
// rows: gguf_matmul.cpp (float32 activations: the integers widened to float32) and gguf_int8_matmul.cpp
// (`--activation-quantization int8`: the integers dotted with 8-bit activations by integer instructions).
// Block layouts (ggml-common.h; gguf-py's quants.py): sizes in bytes per block of 32 or 256 weights.
//   Q4_0 (18 / 32):   f16 d, 16 B nibbles (low: weights 0-15, high: 16-31);              w = d (q - 8)
//   Q5_0 (22 / 32):   f16 d, u32 fifth bits, 16 B nibbles as Q4_0;                       w = d (q - 16)
//   Q8_0 (34 / 32):   f16 d, 32 int8;                                                      w = d q
//   Q4_K (144 / 256): f16 d, f16 dmin, 12 B of 6-bit (scale, min) x 8, 128 B nibbles; per 32-weight
//                     sub-block j: w = (d sc_j) q - (dmin m_j), nibbles of chunk j/2 (low for even j)
//   Q5_K (176 / 256): as Q4_K plus 32 B of fifth bits (bit j of byte l for weight 32 j + l)
//   Q6_K (210 / 256): 128 B low nibbles, 64 B high 2-bit pairs, 16 int8 scales (one per 16), f16 d;
//                     w = (d sc) (q - 32)
#pragma once

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <utility>

namespace kvserve::gguf {

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

// 16 bytes of nibbles at p -> 32 bytes: the low nibbles, then the high ones (the bytes loaded into both halves,
// the upper half shifted by 4: two operations where a shift, two ands and an insert took four).
inline __m256i nibbles32(const uint8_t* p) {
    const __m256i b = _mm256_broadcastsi128_si256(load16(p));
    return _mm256_and_si256(_mm256_srlv_epi64(b, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
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
// `visit<true>` passes the stored codes instead, unsigned, before the format's offset kZero is taken off
// (q = code - kZero): an integer dot product can multiply the codes as unsigned bytes and take kZero * sum(x) off
// once per run, where signed values cost it two more operations (gguf_int8_matmul.cpp). Q8_0 stores signed bytes
// (kSigned): its visit<true> is its visit.

struct Q4_0 {
    static constexpr int64_t kBlock = 32, kBytes = 18;
    static constexpr bool kMin = false, kSplitScale = false, kSigned = false;
    static constexpr int kZero = 8;
    template <bool kCodes = false, typename Run>
    static void visit(const uint8_t* b, int8_t* tmp, const Run& run) {
        const __m256i q = nibbles32(b + 2);
        store32(tmp, kCodes ? q : _mm256_sub_epi8(q, _mm256_set1_epi8(kZero)));
        const float d = f16(b);
        run(0, tmp, d, d, 0.0f);
    }
};

struct Q5_0 {
    static constexpr int64_t kBlock = 32, kBytes = 22;
    static constexpr bool kMin = false, kSplitScale = false, kSigned = false;
    static constexpr int kZero = 16;
    template <bool kCodes = false, typename Run>
    static void visit(const uint8_t* b, int8_t* tmp, const Run& run) {
        uint32_t bits;
        memcpy(&bits, b + 2, 4);
        const __m256i low = nibbles32(b + 6), zero = _mm256_set1_epi8(kZero);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
        // the fifth bits as a byte mask: code = low + 16 where set; the value, low - 16 where clear
        store32(tmp, kCodes ? _mm256_mask_add_epi8(low, _cvtu32_mask32(bits), low, zero)
                            : _mm256_mask_sub_epi8(low, _cvtu32_mask32(~bits), low, zero));
#else
        const __m256i q = _mm256_or_si256(low, bits_to_0x10(bits));
        store32(tmp, kCodes ? q : _mm256_sub_epi8(q, zero));
#endif
        const float d = f16(b);
        run(0, tmp, d, d, 0.0f);
    }
};

struct Q8_0 {
    static constexpr int64_t kBlock = 32, kBytes = 34;
    static constexpr bool kMin = false, kSplitScale = false, kSigned = true;
    static constexpr int kZero = 0;
    template <bool kCodes = false, typename Run>
    static void visit(const uint8_t* b, int8_t*, const Run& run) {
        const float d = f16(b);
        run(0, reinterpret_cast<const int8_t*>(b + 2), d, d, 0.0f);
    }
};

// The 8 six-bit (scale, min) pairs of a Q4_K / Q5_K block, as float32 products with d and dmin. The 12 bytes hold,
// byte-wise, scale j (j < 4) in the low 6 bits of byte j, min j in those of byte j + 4, and for j >= 4 the low 4
// bits in byte j + 4's nibbles (scale low, min high) with the top 2 bits in bits 6-7 of bytes j - 4 (scale) and j
// (min): unpacked four at a time in 32-bit words, then converted and scaled 8 at a time.
inline void k_scales(const uint8_t* b, float* scale, float* min) {
    uint32_t u[3];
    memcpy(u, b + 4, 12);
    const uint32_t low6 = 0x3F3F3F3F, low4 = 0x0F0F0F0F, top2 = 0x03030303;
    const uint64_t sc = (u[0] & low6) | static_cast<uint64_t>((u[2] & low4) | ((u[0] >> 6) & top2) << 4) << 32;
    const uint64_t mn = (u[1] & low6) | static_cast<uint64_t>(((u[2] >> 4) & low4) | ((u[1] >> 6) & top2) << 4) << 32;
    const auto widen = [](uint64_t bytes) {
        return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(bytes))));
    };
    _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_set1_ps(f16(b)), widen(sc)));
    _mm256_storeu_ps(min, _mm256_mul_ps(_mm256_set1_ps(f16(b + 2)), widen(mn)));
}

struct Q4_K {
    static constexpr int64_t kBlock = 256, kBytes = 144;
    static constexpr bool kMin = true, kSplitScale = false, kSigned = false;
    static constexpr int kZero = 0;  // the codes are the values; the min is taken off apart
    // The block's 8 run scales and mins as visit passes them, at once (gguf_int8_matmul.cpp scales 8 runs a vector).
    static void block_scales(const uint8_t* b, float* scale, float* min) { k_scales(b, scale, min); }
    template <bool kCodes = false, typename Run>
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
    static constexpr bool kMin = true, kSplitScale = false, kSigned = false;
    static constexpr int kZero = 0;  // the codes are the values; the min is taken off apart
    // The block's 8 run scales and mins as visit passes them, at once (gguf_int8_matmul.cpp scales 8 runs a vector).
    static void block_scales(const uint8_t* b, float* scale, float* min) { k_scales(b, scale, min); }
    template <bool kCodes = false, typename Run>
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
    static constexpr bool kMin = false, kSplitScale = true, kSigned = false;
    static constexpr int kZero = 32;
    // The block's 16 half-run scales as visit passes them (s_lo, s_hi of run j: scale[2 j], scale[2 j + 1]).
    static void block_scales(const uint8_t* b, float* scale, float*) {
        const __m256 d = _mm256_set1_ps(f16(b + 208));
        const __m128i sc = load16(b + 192);
        _mm256_storeu_ps(scale, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
        _mm256_storeu_ps(scale + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
    }
    template <bool kCodes = false, typename Run>
    static void visit(const uint8_t* b, int8_t* tmp, const Run& run) {
        const float d = f16(b + 208);
        const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
        const __m256i mask = _mm256_set1_epi8(0x0F), bias = _mm256_set1_epi8(kZero);
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
                store32(tmp, kCodes ? q[s] : _mm256_sub_epi8(q[s], bias));
                const int i = 8 * h + 2 * s;  // one scale per 16 weights
                run(128 * h + 32 * s, tmp, d * static_cast<float>(sc[i]), d * static_cast<float>(sc[i + 1]), 0.0f);
            }
        }
    }
};

// ggml's type ids (GGMLQuantizationType).
enum : int32_t { kQ4_0 = 2, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

// The kernels' type ids: a ggml type id, plus kRows4 where the weight rows are interleaved four at a time
// (RowBlocks below; gguf_blocks.py's ROWS4), plus kQ5Tiles (Q5_0 only) where each group of four rows is stored in
// tiles of 128 weights (Q5Tile below; gguf_blocks.py's Q5_TILES).
constexpr int32_t kRows4 = 256, kQ5Tiles = 512;
inline bool rows4(int32_t type) { return (type & kRows4) != 0; }
inline bool q5_tiles(int32_t type) { return (type & kQ5Tiles) != 0; }

// A tile of Q5_0 (kQ5Tiles): rows 4g .. 4g + 3 by weights 128 j .. 128 j + 127 (blocks 4 j .. 4 j + 3 of each row),
// 352 bytes, the same as its 16 blocks: [0, 32) the 16 f16 scales, row r's block i at 2 (4 r + i); [32, 96) the
// fifth bits, 16 bytes a row (row r at 32 + 16 r): bit 2 i of byte t is weight t's of block i, bit 2 i + 1 weight
// t + 16's; [96, 352) the low four bits, 64 bytes a row (row r at 96 + 64 r): byte t of its first 32 holds weight t
// of block 0 (low nibble) and of block 1 (high nibble), of its last 32 blocks 2 and 3. Why: the file's Q5_0 gathers
// each weight's fifth bit from a 32-bit mask with a byte shuffle, a compare and two masks a block (six operations of
// the ~14 an AVX2 int8 gemv spends on a block of one row, and these gemvs are bound by their instructions there);
// from a tile's bit planes it is a shift, a mask and an or, its nibbles two blocks to a load, and a row's four scales
// one load (gguf_int8_matmul.cpp's q5_tile_rows).
struct Q5Tile {
    static constexpr int64_t kWeights = 128, kBytes = 352;
    // The 32 codes (0-31: the file's nibble | fifth bit << 4) of row r's block i (0-3), in weight order.
    static __m256i codes(const uint8_t* tile, int r, int i) {
        const __m256i h = _mm256_broadcastsi128_si256(load16(tile + 32 + 16 * r));
        const __m256i n = load32(tile + 96 + 64 * r + 32 * (i / 2));
        const __m256i low = _mm256_and_si256(i % 2 ? _mm256_srli_epi16(n, 4) : n, _mm256_set1_epi8(0x0F));
        // block i's fifth bits are bits 2 i (weights 0-15, the low 16 bytes) and 2 i + 1 (16-31): to bit 4
        const int lo = 4 - 2 * i, hi = 3 - 2 * i;
        const __m256i bit = hi >= 0 ? _mm256_sllv_epi32(h, _mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi))
                                    : _mm256_srlv_epi32(h, _mm256_setr_epi32(-lo, -lo, -lo, -lo, -hi, -hi, -hi, -hi));
        return _mm256_or_si256(low, _mm256_and_si256(bit, _mm256_set1_epi8(0x10)));
    }
    // Row r's block i (0-3) of the tile as the file stores it (22 bytes at out).
    static void block(const uint8_t* tile, int r, int i, uint8_t* out) {
        memcpy(out, tile + 2 * (4 * r + i), 2);
        const __m256i c = codes(tile, r, i);
        const uint32_t fifth = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(c, 3)));
        memcpy(out + 2, &fifth, 4);
        const __m128i low = _mm256_castsi256_si128(c), high = _mm256_extracti128_si256(c, 1);  // weights 0-15, 16-31
        const __m128i packed = _mm_or_si128(_mm_and_si128(low, _mm_set1_epi8(0x0F)),
                                            _mm_slli_epi16(_mm_and_si128(high, _mm_set1_epi8(0x0F)), 4));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 6), packed);
    }
    // The file's block (22 bytes) into row r's block i of a tile whose bits and nibbles start zeroed.
    static void put(const uint8_t* block, int r, int i, uint8_t* tile) {
        memcpy(tile + 2 * (4 * r + i), block, 2);
        uint32_t fifth;
        memcpy(&fifth, block + 2, 4);
        uint8_t* bits = tile + 32 + 16 * r;
        uint8_t* low = tile + 96 + 64 * r + 32 * (i / 2);
        const int shift = 4 * (i % 2);
        for (int t = 0; t < 16; ++t) {
            bits[t] |= static_cast<uint8_t>((fifth >> t & 1) << (2 * i) | (fifth >> (t + 16) & 1) << (2 * i + 1));
            low[t] |= static_cast<uint8_t>((block[6 + t] & 15) << shift);
            low[t + 16] |= static_cast<uint8_t>((block[6 + t] >> 4) << shift);
        }
    }
};

// Where each weight row's blocks lie, for a weight [n, k] of blocks of F. As the file stores it: row after row.
// Interleaved (kRows4): rows 4g .. 4g + 3 of each whole group of four are stored block by block (block b of row
// 4g + r at group g's start + (4 b + r) * kBytes; a group takes the bytes of its four rows), the last n % 4 rows
// as in the file; with kQ5Tiles a group is its tiles instead, one after another along k. Why: the gemvs read four
// rows at a time, and four rows read side by side are four streams of a few hundred bytes each, which a Zen 3
// host's memory served at 14-16 GB/s where one stream of the same bytes came at 22-27 (two threads, a scratch loop
// of loads); interleaved, the four rows are one stream.
struct RowBlocks {
    const uint8_t* w;
    int64_t row_bytes, block_bytes;
    int64_t grouped;  // rows in whole interleaved groups (0 in the file's layout)
    bool tiles;
    RowBlocks(const uint8_t* weights, int32_t type, int64_t n, int64_t k, int64_t block, int64_t bytes)
        : w(weights), row_bytes(k / block * bytes), block_bytes(bytes), grouped(rows4(type) ? n / 4 * 4 : 0),
          tiles(q5_tiles(type)) {
        if (tiles && ((type & ~(kRows4 | kQ5Tiles)) != kQ5_0 || !rows4(type) || k % Q5Tile::kWeights != 0)) {
            fprintf(stderr, "kvserve: Q5_0 tiles need type Q5_0 with kRows4 and k a multiple of 128; aborting\n");
            abort();
        }
    }
    // Row `row`'s block b: in place, or (tiles) copied out of its tile into tmp (kBytes).
    const uint8_t* block(int64_t row, int64_t b, uint8_t* tmp) const {
        if (row >= grouped) return w + row * row_bytes + b * block_bytes;
        const uint8_t* group = w + (row - row % 4) * row_bytes;
        if (!tiles) return group + (4 * b + row % 4) * block_bytes;
        Q5Tile::block(group + b / 4 * Q5Tile::kBytes, static_cast<int>(row % 4), static_cast<int>(b % 4), tmp);
        return tmp;
    }
    // An address in row `row`'s block b (tiles: in its tile), to prefetch.
    const uint8_t* near(int64_t row, int64_t b) const {
        if (row >= grouped) return w + row * row_bytes + b * block_bytes;
        const uint8_t* group = w + (row - row % 4) * row_bytes;
        return tiles ? group + b / 4 * Q5Tile::kBytes + 96 + 64 * (row % 4) : group + (4 * b + row % 4) * block_bytes;
    }
    // Bytes from one row's block to the next row's (within a group of four from 4g), and to the row's next block;
    // not for tiles.
    int64_t row_step(int64_t row) const { return row < grouped ? block_bytes : row_bytes; }
    int64_t block_step(int64_t row) const { return row < grouped ? 4 * block_bytes : block_bytes; }
};

// call(Format{}) for a type id (with kRows4 / kQ5Tiles or not); another type is a bug in the caller (callers pass only
// gguf_blocks.NATIVE_GGUF_TYPES), never an unwritten output: the process aborts with a message.
template <typename Call>
void dispatch(int32_t type, const Call& call) {
    switch (type & ~(kRows4 | kQ5Tiles)) {
        case kQ4_0: call(Q4_0{}); break;
        case kQ5_0: call(Q5_0{}); break;
        case kQ8_0: call(Q8_0{}); break;
        case kQ4_K: call(Q4_K{}); break;
        case kQ5_K: call(Q5_K{}); break;
        case kQ6_K: call(Q6_K{}); break;
        default:
            fprintf(stderr, "kvserve: no GGUF kernel for ggml type %d; aborting\n", static_cast<int>(type));
            abort();
    }
}

// Prefetch one block's bytes (every cache line it touches) into L1: the matmuls stream weights that are far too
// large for the caches, and the hardware prefetchers alone keep too few lines in flight while each block costs
// tens of instructions to decode (the LM head at one activation row ran at ~4 GB/s per core).
// Both prefetch helpers are always inlined: a function holding only prefetches counts as free of side effects to
// GCC 12 (-O1 and up), which then deletes the calls to it that it has not inlined early (prefetch_ahead's were).
template <typename F, int kHint = _MM_HINT_T0>
__attribute__((always_inline)) inline void prefetch_block(const uint8_t* p) {
    for (int64_t o = 0; o < F::kBytes; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p + o), static_cast<_mm_hint>(kHint));
}

// How far ahead the gemvs (1-4 activation rows, 4 weight rows a group) prefetch, in groups of rows, for a thread whose
// share of the rows is `share` groups (thread_share): into L1 that far, into L2 only twice as far.
// - AVX-512 builds: four groups. Four (~11 KB ahead at k = 640) took the Q8_0 LM head at one row on a Zen 5 host
//   (measured read bandwidth ~53 GB/s) from ~20 to ~37 GB/s (float32 activations) and from ~26 to ~52 (int8) against
//   one group (eight: a little slower than four); the L2 prefetch at eight took an Intel host's int8 decode step at
//   batch 1 from 11.7 to 11.2 ms and the exact path's from 14.1 to 14.0 (scripts/ab_decode_step.py; a second L1
//   prefetch at that distance, or an L1 distance of 8, gained nothing).
// - AVX2 builds (Zen 3-class hosts, whose memory under the VM answers later): ~43 KB of weights ahead (sixteen groups
//   of the default model's LM head rows), at least four groups and at most a 32nd of the share, whose first groups
//   are prefetched at the start (prefetch_lead_in). On a Zen 3 host that took the default model's Q8_0 LM head in a
//   decode step from 10.6 to 9.7 ms with int8 activations and the step 1.062x faster (scripts/ab_decode_step.py
//   OLD.so; docs/PERFORMANCE_NOTES.md attempt 70); at sixteen groups for every matrix, with no cap and no lead-in, the
//   LM head gained as much but the layers' small matrices lost most of it again (their first 16-24 groups of a
//   128-group share went unprefetched).
#if defined(__AVX512F__)
__attribute__((always_inline)) inline int64_t prefetch_groups(int64_t, int64_t) { return 4; }
#else
constexpr int64_t kPrefetchBytes = 16 * 4 * 680;  // sixteen groups of the default model's LM head rows
__attribute__((always_inline)) inline int64_t prefetch_groups(int64_t group_bytes, int64_t share) {
    return std::clamp<int64_t>(kPrefetchBytes / group_bytes, 4, std::max<int64_t>(4, share / 32));
}
#endif

// The calling thread's share [first, last) of `groups` groups of rows inside an OpenMP parallel region: contiguous
// and as even as it can be, as schedule(static) would split them. The gemvs prefetch only within their own share
// (past its end are the next thread's rows, which that thread reads and prefetches itself).
__attribute__((always_inline)) inline std::pair<int64_t, int64_t> thread_share(int64_t groups) {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t per = groups / threads, extra = groups % threads;
    const int64_t first = t * per + std::min(t, extra);
    return {first, first + per + (t < extra ? 1 : 0)};
}

// The first `ahead` groups of a thread's share, which prefetch_ahead leaves out: every line of them, at the start.
__attribute__((always_inline)) inline void prefetch_lead_in(const uint8_t* first, int64_t group_bytes, int64_t ahead) {
    for (int64_t o = 0; o < ahead * group_bytes; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(first + o), _MM_HINT_T0);
}

// A gemv's prefetches of the weight block at `block`, for the rows `ahead` groups on (into L1) and twice as far
// (into L2) where they exist (groups_after: the groups of rows after this one in the thread's share; group_bytes:
// the bytes of a group of rows).
template <typename F>
__attribute__((always_inline)) inline void prefetch_ahead(const uint8_t* block, int64_t group_bytes,
                                                          int64_t groups_after, int64_t ahead) {
    if (groups_after >= ahead) {
        prefetch_block<F>(block + ahead * group_bytes);
        if (groups_after >= 2 * ahead) prefetch_block<F, _MM_HINT_T1>(block + 2 * ahead * group_bytes);
    }
}

}  // namespace kvserve::gguf
