// The log-sum-exp merge shared by the split attention kernels (decode split over keys in paged_attention.cpp, prefill
// split over key ranges in prefill_attention.cpp; kvserve/kernels/native.py hashes this header with the sources).
#pragma once

#include <math.h>
#include <stdint.h>

#include <algorithm>

namespace kvserve {

// One query row's partial results over `parts` key ranges, `step` floats apart, each [the max of its scores, the sum
// of exp(score - max), dim sums of exp(score - max) * V], merged into out (dim floats): every part rescaled to the
// common max, then normalized. A part that saw none of the row's keys has sum 0 and is skipped, its max too.
inline void merge_attention_parts(const float* first, int64_t parts, int64_t step, int64_t dim, float* out) {
    float m = -INFINITY;
    for (int64_t p = 0; p < parts; ++p)
        if (first[p * step + 1] > 0.0f) m = std::max(m, first[p * step]);
    std::fill(out, out + dim, 0.0f);
    float total = 0.0f;
    for (int64_t p = 0; p < parts; ++p) {
        const float* src = first + p * step;
        if (!(src[1] > 0.0f)) continue;
        const float w = expf(src[0] - m);
        total += w * src[1];
        for (int64_t d = 0; d < dim; ++d) out[d] += w * src[2 + d];
    }
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < dim; ++d) out[d] *= inv;
}

}  // namespace kvserve
