// LFM2's gated short convolution over a flat batch of sequences, with each sequence's state (its last kernel - 1
// inputs) read from and written back to its slot:
//   y[t, c] = C[t, c] * (bias[c] + sum_j w[c, j] * window[t + j, c]),  window = state (or zeros) then B * x rows
// where each row of bcx is in_proj's output [B | C | x] of `channels` each.
//
// Why: torch runs it as chunk, multiply, and per sequence a concatenation, an unfold and a reduction (a Python loop
// over the step's sequences); here it is one pass over the step's rows, OpenMP over sequences, the channel loop
// vectorized by the compiler (the taps are transposed to [kernel, channels] first so that it reads them in order).
#include <stdint.h>
#include <string.h>

#include <vector>

#include "kernels.h"

extern "C" {

void kvserve_short_conv(const float* bcx, const float* weight, const float* bias, float* states, const int64_t* slots,
                        const int64_t* starts, const int64_t* continues, int64_t seqs, int64_t channels,
                        int64_t kernel, float* out) {
    const int64_t keep = kernel - 1;
    std::vector<float> taps(kernel * channels);  // [kernel, channels]
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
            const float* b = bcx + t * 3 * channels;
            const float* g = b + channels;
            const float* x = b + 2 * channels;
            float* y = out + t * channels;
            for (int64_t c = 0; c < channels; ++c) newest[c] = b[c] * x[c];
            for (int64_t c = 0; c < channels; ++c) {
                float acc = bias ? bias[c] : 0.0f;
                for (int64_t j = 0; j < kernel; ++j) acc += w[j * channels + c] * window[j * channels + c];
                y[c] = g[c] * acc;
            }
            memmove(window.data(), window.data() + channels, keep * channels * sizeof(float));
        }
        memcpy(state, window.data(), keep * channels * sizeof(float));
    }
}

}
