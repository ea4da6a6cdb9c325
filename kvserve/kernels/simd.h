// AVX2 + FMA helpers shared by the kernels in this folder (kvserve/kernels/native.py hashes this header with
// the sources, so editing it rebuilds the library).
#pragma once

#include <immintrin.h>
#include <math.h>

namespace kvserve {

// The sum of the 8 lanes.
inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// exp with a degree-6 polynomial (relative error about 2e-7); inputs clamped to [-87, 88].
inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // r = x - n ln2, in two parts for accuracy
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// SiLU, x / (1 + exp(-x)), on 8 lanes with exp256, and on one float (the tails of a vector loop).
inline __m256 silu256(__m256 x) {
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}
inline float silu1(float x) { return x / (1.0f + expf(-x)); }

#if defined(__AVX512F__)
// exp256's arithmetic on 16 lanes: the same operations in the same order, so each lane's result is bit-identical.
inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

// The float vector operations a kernel written once for both widths needs: F32x8 (AVX2) and, where the build has
// AVX-512, F32x16; a kernel templated on one of them keeps a single body (kernels/recurrent.cpp).
struct F32x8 {
    using V = __m256;
    static constexpr int kLanes = 8;
    static V load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
    static V set1(float x) { return _mm256_set1_ps(x); }
    static V zero() { return _mm256_setzero_ps(); }
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
    static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }     // a b + c
    static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }   // c - a b
    static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
    static V max(V a, V b) { return _mm256_max_ps(a, b); }
    static V exp(V x) { return exp256(x); }
    static float hsum(V v) { return kvserve::hsum(v); }
    static float hmax(V v) {
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    }
    // Lane t of the result = the sum of a[t]'s lanes, for kLanes vectors at once: a tree of unpacks, shuffles and
    // adds (21 operations for 8 sums, where 8 horizontal sums take about 40).
    __attribute__((always_inline)) static V sum_lanes(const V* a) {
        V s[4], u[2];
        for (int i = 0; i < 4; ++i)  // per 128-bit lane: a0 + a2, b0 + b2, a1 + a3, b1 + b3
            s[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
        for (int i = 0; i < 2; ++i)  // per 128-bit lane: a, b, c, d over that lane's 4 elements
            u[i] = _mm256_add_ps(_mm256_shuffle_ps(s[2 * i], s[2 * i + 1], 0x44),
                                 _mm256_shuffle_ps(s[2 * i], s[2 * i + 1], 0xEE));
        return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
    }
    // kv_dtypes.h's element types, kLanes at a time, as float32.
    template <typename E>
    static V load_kv(const typename E::T* p) { return E::load8(p); }
};

#if defined(__AVX512F__)
struct F32x16 {
    using V = __m512;
    static constexpr int kLanes = 16;
    static V load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
    static V set1(float x) { return _mm512_set1_ps(x); }
    static V zero() { return _mm512_setzero_ps(); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
    static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
    static V max(V a, V b) { return _mm512_max_ps(a, b); }
    static V exp(V x) { return exp512(x); }
    static float hsum(V v) { return _mm512_reduce_add_ps(v); }
    static float hmax(V v) { return _mm512_reduce_max_ps(v); }
    // F32x8::sum_lanes for 16 vectors: then the four 128-bit lanes are added across by two more levels (45
    // operations for 16 sums).
    __attribute__((always_inline)) static V sum_lanes(const V* a) {
        V s[8], u[4], w[2];
        for (int i = 0; i < 8; ++i)
            s[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
        for (int i = 0; i < 4; ++i)  // per 128-bit lane: keys 4i .. 4i + 3 over that lane's 4 elements
            u[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0x44),
                                 _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0xEE));
        for (int i = 0; i < 2; ++i)  // lanes (0 + 1, 2 + 3) of u[2i], then of u[2i + 1]
            w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                                 _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
        return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
    }
    template <typename E>
    static V load_kv(const typename E::T* p) { return E::load16(p); }
};
#endif

}  // namespace kvserve
