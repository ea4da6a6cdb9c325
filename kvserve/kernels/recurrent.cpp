// The recurrent parts of hybrid models, over a flat batch of sequences whose states live in slots
// (kvserve/kv/state.py): each sequence reads its state from its slot (or starts from zeros), runs its rows, and
// leaves its final state in the slot.
//
// kvserve_causal_conv: a depthwise causal convolution of `kernel` taps (LFM2's short convolution, the convolution
// before Qwen3.5's Gated DeltaNet):
//   out[t, c] = gate[t, c] * act(bias[c] + sum_j w[c, j] * window[t + j, c]),  window = state then pre * x rows
// kvserve_gated_delta_rule: Qwen3.5's Gated DeltaNet recurrence, token by token, per value head h (key head
// h / (v_heads / k_heads)), with q and k L2-normalized and q scaled by key_dim^-1/2:
//   S = exp(g) S;  S += k (beta (v - S^T k))^T;  out = S^T q          (S: [key_dim, value_dim])
//
// Why natively: torch runs both as a Python loop over the step's sequences (and the recurrence over its tokens);
// here each is one call, OpenMP over sequences (and heads). The recurrence costs 4 key_dim x value_dim flops a token
// and head, small beside the layer's projections, so prefill runs it token by token too (no chunked form).
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "kernels.h"

extern "C" {

void kvserve_causal_conv(const float* x, const float* pre, const float* gate, int64_t row_stride, const float* weight,
                         const float* bias, float* states, const int64_t* slots, const int64_t* starts,
                         const int64_t* continues, int64_t seqs, int64_t channels, int64_t kernel, int64_t act,
                         float* out) {
    const int64_t keep = kernel - 1;
    std::vector<float> taps(kernel * channels);  // [kernel, channels]: the channel loop reads them in order
    for (int64_t c = 0; c < channels; ++c)
        for (int64_t j = 0; j < kernel; ++j) taps[j * channels + c] = weight[c * kernel + j];
    const float* w = taps.data();
#pragma omp parallel for schedule(dynamic, 1) if (seqs > 1 && (starts[seqs] - starts[0]) * channels >= (1 << 15))
    for (int64_t s = 0; s < seqs; ++s) {
        float* state = states + slots[s] * keep * channels;  // [keep, channels], the oldest input first
        std::vector<float> window((keep + 1) * channels);
        if (continues[s])
            memcpy(window.data(), state, keep * channels * sizeof(float));
        else
            memset(window.data(), 0, keep * channels * sizeof(float));
        float* newest = window.data() + keep * channels;
        for (int64_t t = starts[s]; t < starts[s + 1]; ++t) {
            const float* xr = x + t * row_stride;
            float* y = out + t * channels;
            if (pre) {
                const float* pr = pre + t * row_stride;
                for (int64_t c = 0; c < channels; ++c) newest[c] = pr[c] * xr[c];
            } else {
                memcpy(newest, xr, channels * sizeof(float));
            }
            for (int64_t c = 0; c < channels; ++c) {
                float acc = bias ? bias[c] : 0.0f;
                for (int64_t j = 0; j < kernel; ++j) acc += w[j * channels + c] * window[j * channels + c];
                y[c] = act == 1 ? acc / (1.0f + expf(-acc)) : acc;
            }
            if (gate) {
                const float* gr = gate + t * row_stride;
                for (int64_t c = 0; c < channels; ++c) y[c] *= gr[c];
            }
            memmove(window.data(), window.data() + channels, keep * channels * sizeof(float));
        }
        memcpy(state, window.data(), keep * channels * sizeof(float));
    }
}

void kvserve_gated_delta_rule(const float* q, const float* k, const float* v, int64_t qk_stride, int64_t v_stride,
                              const float* g, const float* beta, int64_t gb_stride, float* states,
                              const int64_t* slots, const int64_t* starts, const int64_t* continues, int64_t seqs,
                              int64_t k_heads, int64_t v_heads, int64_t key_dim, int64_t value_dim, float* out) {
    const int64_t group = v_heads / k_heads;
    const float scale = 1.0f / sqrtf((float)key_dim);
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t s = 0; s < seqs; ++s) {
        for (int64_t h = 0; h < v_heads; ++h) {
            float* S = states + ((slots[s] * v_heads) + h) * key_dim * value_dim;  // [key_dim, value_dim]
            if (!continues[s]) memset(S, 0, key_dim * value_dim * sizeof(float));
            std::vector<float> qn(key_dim), kn(key_dim), delta(value_dim);
            const int64_t kh = h / group;
            for (int64_t t = starts[s]; t < starts[s + 1]; ++t) {
                const float* qr = q + t * qk_stride + kh * key_dim;
                const float* kr = k + t * qk_stride + kh * key_dim;
                const float* vr = v + t * v_stride + h * value_dim;
                float qq = 0.0f, kk = 0.0f;
                for (int64_t i = 0; i < key_dim; ++i) {
                    qq += qr[i] * qr[i];
                    kk += kr[i] * kr[i];
                }
                const float qs = scale / sqrtf(qq + 1e-6f), ks = 1.0f / sqrtf(kk + 1e-6f);
                for (int64_t i = 0; i < key_dim; ++i) {
                    qn[i] = qr[i] * qs;
                    kn[i] = kr[i] * ks;
                }
                const float decay = expf(g[t * gb_stride + h]), b = beta[t * gb_stride + h];
                for (int64_t j = 0; j < value_dim; ++j) delta[j] = 0.0f;
                for (int64_t i = 0; i < key_dim; ++i) {  // decay S, and S^T k of the decayed state
                    float* row = S + i * value_dim;
                    for (int64_t j = 0; j < value_dim; ++j) {
                        row[j] *= decay;
                        delta[j] += row[j] * kn[i];
                    }
                }
                for (int64_t j = 0; j < value_dim; ++j) delta[j] = b * (vr[j] - delta[j]);
                float* o = out + (t * v_heads + h) * value_dim;
                for (int64_t j = 0; j < value_dim; ++j) o[j] = 0.0f;
                for (int64_t i = 0; i < key_dim; ++i) {  // S += k delta^T, then out = S^T q
                    float* row = S + i * value_dim;
                    const float ki = kn[i], qi = qn[i];
                    for (int64_t j = 0; j < value_dim; ++j) {
                        row[j] += ki * delta[j];
                        o[j] += row[j] * qi;
                    }
                }
            }
        }
    }
}

}
