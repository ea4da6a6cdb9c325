// The element types of a paged KV cache (kernels.h: KvserveKvDtype) as the attention kernels read them and the
// decoder layer writes them, one struct a type (a row of type traits, as gguf_formats.h is for the weights):
//   float32    as is
//   bfloat16   the top half of a float32: read by a shift; written rounded to nearest even, as torch's cast
//   float16    IEEE half: read and written by F16C's vcvtph2ps / vcvtps2ph (round to nearest even)
//   int8       x = q * scale, one float32 scale per token and KV head (kvserve/kv/quant.py)
//   fp8_e5m2   x = q * scale; an e5m2 byte is the top byte of a float16, so F16C reads it after a shift
//   fp8_e4m3   x = q * scale; the byte's exponent and mantissa moved into a float16's (bits 7-14) read as a half
//              256 times too small (its exponent bias is 7 against 15): kUnit = 256 rides on the row's scale
// Reading converts in registers where the values are used (no widened copy of the cache); a scaled type's values
// come without their scale, which the kernel applies once per dot product (K) or per softmax weight (V).
// Writing is bit-exact with kvserve/kv/quant.py's store (tests/unit/test_kv_dtype_kernels.py): the 8-bit scales as
// compute_scales makes them (amax / max, at least 1e-30, one ulp down where max x scale would pass amax), the
// values as quantize divides, clamps and casts them (torch's float -> float8 casts round to nearest even).
#pragma once

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>

#include "kernels.h"

namespace kvserve::kv {

inline uint32_t float_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

// float32 -> bfloat16 rounded to nearest even; NaN as torch's scalar cast makes it (0x7FC0).
inline uint16_t bf16_from_float(float x) {
    if (isnan(x)) return 0x7FC0;
    const uint32_t u = float_bits(x);
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// A float8 encoding of y (|y| at most the format's largest finite value, as quantize's clamp leaves it), rounded to
// nearest even: the values below the smallest normal are multiples of its quantum (2^-9 for e4m3, 2^-16 for e5m2),
// the others keep kMant mantissa bits of y's float32 bits (a carry moves into the exponent, as it should). NaN: 0x7F.
template <int kMant, int kBias>
inline uint8_t fp8_from_float(float y) {
    if (isnan(y)) return 0x7F;
    const uint32_t u = float_bits(y);
    const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
    const uint32_t a = u & 0x7FFFFFFFu;
    constexpr int kMinNormalExp = 1 - kBias;                // e4m3: 2^-6, e5m2: 2^-14
    constexpr int kQuantumExp = kMinNormalExp - kMant;      // e4m3: 2^-9, e5m2: 2^-16
    if (a < static_cast<uint32_t>(127 + kMinNormalExp) << 23) {  // below the smallest normal: a multiple of the quantum
        float magnitude;
        memcpy(&magnitude, &a, 4);
        return sign | static_cast<uint8_t>(nearbyintf(ldexpf(magnitude, -kQuantumExp)));
    }
    constexpr int kDrop = 23 - kMant;
    const uint32_t r = (a + ((1u << (kDrop - 1)) - 1u) + ((a >> kDrop) & 1u)) >> kDrop;
    return sign | static_cast<uint8_t>(r - (static_cast<uint32_t>(127 - kBias) << kMant));
}

struct Float32 {
    using T = float;
    static constexpr int64_t kCode = kKvFloat32;
    static constexpr bool kScaled = false;
    static constexpr float kUnit = 1.0f;
    static float load1(const T* p) { return *p; }
    static __m256 load8(const T* p) { return _mm256_loadu_ps(p); }
#if defined(__AVX512F__)
    static __m512 load16(const T* p) { return _mm512_loadu_ps(p); }
#endif
    static void store(const float* x, int64_t n, T* out) { memcpy(out, x, n * sizeof(float)); }
};

struct Bfloat16 {
    using T = uint16_t;
    static constexpr int64_t kCode = kKvBfloat16;
    static constexpr bool kScaled = false;
    static constexpr float kUnit = 1.0f;
    static float load1(const T* p) {
        const uint32_t u = static_cast<uint32_t>(*p) << 16;
        float x;
        memcpy(&x, &u, 4);
        return x;
    }
    static __m256 load8(const T* p) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
#if defined(__AVX512F__)
    static __m512 load16(const T* p) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
#endif
    static void store(const float* x, int64_t n, T* out) {
        for (int64_t i = 0; i < n; ++i) out[i] = bf16_from_float(x[i]);
    }
};

struct Float16 {
    using T = uint16_t;
    static constexpr int64_t kCode = kKvFloat16;
    static constexpr bool kScaled = false;
    static constexpr float kUnit = 1.0f;
    static float load1(const T* p) { return _cvtsh_ss(*p); }
    static __m256 load8(const T* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#if defined(__AVX512F__)
    static __m512 load16(const T* p) {
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
#endif
    static void store(const float* x, int64_t n, T* out) {
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
        for (; i < n; ++i) out[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
    }
};

struct Int8 {
    using T = int8_t;
    static constexpr int64_t kCode = kKvInt8;
    static constexpr bool kScaled = true;
    static constexpr float kUnit = 1.0f;
    static constexpr float kMax = 127.0f;
    static float load1(const T* p) { return static_cast<float>(*p); }
    static __m256 load8(const T* p) {
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    }
#if defined(__AVX512F__)
    static __m512 load16(const T* p) {
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    }
#endif
    static T encode(float y) { return static_cast<T>(nearbyintf(y)); }  // y clamped: round half to even
};

struct Fp8E5m2 {
    using T = uint8_t;
    static constexpr int64_t kCode = kKvFp8E5m2;
    static constexpr bool kScaled = true;
    static constexpr float kUnit = 1.0f;
    static constexpr float kMax = 57344.0f;
    static float load1(const T* p) { return _cvtsh_ss(static_cast<uint16_t>(*p << 8)); }
    static __m256 load8(const T* p) {
        const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
        return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
    }
#if defined(__AVX512F__)
    static __m512 load16(const T* p) {
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
    }
#endif
    static T encode(float y) { return fp8_from_float<2, 15>(y); }
};

struct Fp8E4m3 {
    using T = uint8_t;
    static constexpr int64_t kCode = kKvFp8E4m3;
    static constexpr bool kScaled = true;
    static constexpr float kUnit = 256.0f;  // the half read below is the value / 2^(15 - 7)
    static constexpr float kMax = 448.0f;
    static float load1(const T* p) {
        return _cvtsh_ss(static_cast<uint16_t>(((*p & 0x80) << 8) | ((*p & 0x7F) << 7)));
    }
    static __m128i half_bits(__m128i w) {  // 8 bytes widened to 16-bit lanes -> their float16 bits
        return _mm_or_si128(_mm_and_si128(_mm_slli_epi16(w, 8), _mm_set1_epi16(static_cast<int16_t>(0x8000))),
                            _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(0x3F80)));
    }
    static __m256 load8(const T* p) {
        return _mm256_cvtph_ps(half_bits(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
    }
#if defined(__AVX512F__)
    static __m512 load16(const T* p) {
        const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        const __m256i h =
            _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(w, 8), _mm256_set1_epi16(static_cast<int16_t>(0x8000))),
                            _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(0x3F80)));
        return _mm512_cvtph_ps(h);
    }
#endif
    static T encode(float y) { return fp8_from_float<3, 7>(y); }
};

// One token's head vector (dim floats) into a row of the cache, and for an 8-bit type its scale, exactly as
// kvserve/kv/quant.py's store writes it.
template <typename E>
inline void store_row(const float* x, int64_t dim, typename E::T* out, float* scale_out) {
    if constexpr (!E::kScaled) {
        E::store(x, dim, out);
    } else {
        float amax = 0.0f;
        for (int64_t i = 0; i < dim; ++i) amax = std::max(amax, fabsf(x[i]));
        float scale = std::max(amax / E::kMax, 1e-30f);
        if (scale * E::kMax > amax) scale = nextafterf(scale, 0.0f);
        for (int64_t i = 0; i < dim; ++i) out[i] = E::encode(std::clamp(x[i] / scale, -E::kMax, E::kMax));
        *scale_out = scale;
    }
}

// call(Type{}) for a KvserveKvDtype code; another code is a bug in the caller (kvserve/kernels/ops.py maps the
// cache's torch dtype), never a silent misread: the process aborts with a message.
template <typename Call>
void dispatch(int64_t code, const Call& call) {
    switch (code) {
        case kKvFloat32: call(Float32{}); break;
        case kKvBfloat16: call(Bfloat16{}); break;
        case kKvFloat16: call(Float16{}); break;
        case kKvInt8: call(Int8{}); break;
        case kKvFp8E4m3: call(Fp8E4m3{}); break;
        case kKvFp8E5m2: call(Fp8E5m2{}); break;
        default:
            fprintf(stderr, "kvserve: no KV cache element type %lld; aborting\n", static_cast<long long>(code));
            abort();
    }
}

}  // namespace kvserve::kv
