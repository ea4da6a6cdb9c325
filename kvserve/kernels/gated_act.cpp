// The gated MLP's middle in one pass: out = act(gate) * up, where each row of the fused gate_up projection
// is [gate (inter) | up (inter)]; act is tanh-approximated GELU (Gemma) or SiLU (Llama, Qwen).
//
// Why: torch runs it as a split, an activation and a multiply over [tokens, 2 x inter] float32 (at a 512-token
// prefill on Gemma 3 270M: 1.9 ms for the GELU alone per layer, 34 ms a prompt); here it is one vectorized pass
// with exp from a degree-6 polynomial (relative error about 2e-7), OpenMP over rows for large inputs.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "simd.h"

namespace {

using kvserve::exp256;
using kvserve::silu1;
using kvserve::silu256;

// gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x * sigmoid(2u) = x / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3)
inline __m256 gelu_tanh256(__m256 x) {
    const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
    const __m256 e = exp256(_mm256_mul_ps(_mm256_set1_ps(-2.0f), u));
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

inline float gelu_tanh1(float x) { return x / (1.0f + expf(-2.0f * 0.7978845608028654f * (x + 0.044715f * x * x * x))); }

}  // namespace

extern "C" {

// gate_up: [rows, 2 * inter] contiguous; out: [rows, inter] contiguous. act: 0 = gelu (tanh), 1 = silu.
void kvserve_gated_act(const float* gate_up, int64_t rows, int64_t inter, int32_t act, float* out) {
#pragma omp parallel for schedule(static) if (rows * inter >= (1 << 16))
    for (int64_t r = 0; r < rows; ++r) {
        const float* g = gate_up + r * 2 * inter;
        const float* u = g + inter;
        float* o = out + r * inter;
        int64_t i = 0;
        for (; i + 8 <= inter; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 a = act == 0 ? gelu_tanh256(gv) : silu256(gv);
            _mm256_storeu_ps(o + i, _mm256_mul_ps(a, _mm256_loadu_ps(u + i)));
        }
        for (; i < inter; ++i) o[i] = (act == 0 ? gelu_tanh1(g[i]) : silu1(g[i])) * u[i];
    }
}

}
