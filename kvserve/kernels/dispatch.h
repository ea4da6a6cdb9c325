// A run-time count to a compile-time one, for the micro-kernels that take their row or head count as a template
// argument (so that their accumulator arrays live in registers): one switch, instead of one per micro-kernel.
// (kvserve/kernels/native.py hashes this header with the sources.)
#pragma once

#include <stdint.h>

#include <type_traits>

namespace kvserve {

// f(std::integral_constant<int, n>{}) for n in [1, N]; n above N calls f with N, below 1 with 1.
template <int N, typename Fn>
__attribute__((always_inline)) inline void with_count(int64_t n, Fn&& f) {
    if constexpr (N > 1) {
        if (n >= N) return f(std::integral_constant<int, N>{});
        return with_count<N - 1>(n, static_cast<Fn&&>(f));
    } else {
        return f(std::integral_constant<int, 1>{});
    }
}

}  // namespace kvserve
