// Greedy sampling's reduction (kvserve/engine/sampler.py): each row's largest value and the index of its first
// occurrence, as torch's max(dim=-1) gives them on the CPU, NaN preferred (a row holding NaN gives NaN and its
// first NaN's index).
//
// Why: torch's max over the logits of a batch-32 step (32 x 262,144 floats for Gemma 3) runs on one thread at
// about 4 GB/s, ~2 ms of a ~50 ms step (scripts/ab_kernel_shapes.py); this one splits the rows across the threads
// (a single row's columns, at batch 1) and takes 8 floats an instruction, reading each row twice (the maximum,
// then its first index, the row still in L2).
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "kernels.h"

#include <algorithm>
#include <vector>

namespace {

inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

// The first index in [0, cols) where row[c] == target, or where row[c] is NaN when nan is set.
inline int64_t first_index(const float* row, int64_t cols, float target, bool nan) {
    const __m256 t = _mm256_set1_ps(target);
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8) {
        const __m256 v = _mm256_loadu_ps(row + c);
        const int hits = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, t, _CMP_EQ_OQ));
        if (hits) return c + __builtin_ctz(static_cast<unsigned>(hits));
    }
    for (; c < cols; ++c)
        if (nan ? isnan(row[c]) : row[c] == target) return c;
    return 0;  // not reached: target is one of the row's values
}

// Columns [0, cols) of one row: its largest value and first index, or (NaN, its first NaN's index).
inline void scan(const float* row, int64_t cols, float* value, int64_t* index) {
    __m256 mx = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8) {
        const __m256 v = _mm256_loadu_ps(row + c);
        mx = _mm256_max_ps(v, mx);  // a NaN in v leaves mx as it was (max returns the second operand)
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float m = hmax(mx);
    bool nan = _mm256_movemask_ps(unordered) != 0;
    for (; c < cols; ++c) {
        if (isnan(row[c])) nan = true;
        else if (row[c] > m) m = row[c];
    }
    *index = first_index(row, cols, m, nan);
    *value = nan ? NAN : m;
}

}  // namespace

extern "C" {

void kvserve_row_max(const float* x, int64_t rows, int64_t cols, int64_t stride, float* values, int64_t* ids) {
    const int threads = omp_get_max_threads();
    if (rows >= threads || cols < 4096) {
#pragma omp parallel for schedule(static) if (rows > 1)
        for (int64_t r = 0; r < rows; ++r) scan(x + r * stride, cols, &values[r], &ids[r]);
        return;
    }
    // Fewer rows than threads (batch 1): each row's columns split across the threads, the parts' results combined
    // in column order, so the first maximum (or NaN) still wins.
    std::vector<float> part_value(threads);
    std::vector<int64_t> part_index(threads);
    const int64_t chunk = (cols + threads - 1) / threads;
    for (int64_t r = 0; r < rows; ++r) {
        const float* row = x + r * stride;
#pragma omp parallel for schedule(static)
        for (int t = 0; t < threads; ++t) {
            const int64_t lo = std::min(cols, t * chunk), hi = std::min(cols, lo + chunk);
            part_value[t] = -INFINITY, part_index[t] = -1;
            if (hi > lo) scan(row + lo, hi - lo, &part_value[t], &part_index[t]), part_index[t] += lo;
        }
        int best = -1;
        for (int t = 0; t < threads && (best < 0 || !isnan(part_value[best])); ++t) {
            if (part_index[t] < 0) continue;
            if (best < 0 || isnan(part_value[t]) || part_value[t] > part_value[best]) best = t;
        }
        values[r] = part_value[best];
        ids[r] = part_index[best];
    }
}
}
