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
// here each is one call, OpenMP over sequences (and heads, or runs of channels). The recurrence costs 4 key_dim x
// value_dim flops a token and head; prefill runs it token by token too, over blocks of value columns whose share of
// the state stays in L1 (delta_rule_columns). The chunked form GPUs use (matrix products over chunks of 64 tokens,
// for tensor cores) does about twice the flops; on the Zen 3 and Zen 5 hosts its products alone took longer than
// this whole recurrence (scripts/bench_gated_delta_rule.py measures both; docs/MODELS.md). With AVX-512 a block's
// row is one vector.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "kernels.h"
#include "simd.h"

// One value-column block of one head over a sequence's tokens. The delta rule keeps value columns independent
// (column j of S reads only column j of S, v and out), so a block of W columns of S ([key_dim, W], W * key_dim * 4
// bytes: 8 KiB at W 16, key_dim 128) stays in L1 across every token, where the token-by-token form streamed the whole
// 64 KiB state through L2 twice a token. Per token: seen = exp(g) S^T k, delta = beta (v - seen), then
// S = exp(g) S + k delta^T and out = S^T q in one pass.
// The block holds S / scale: the decay goes into `scale` (a scalar a token) and the update into the block as
// k (delta / scale)^T, one FMA an element where S's own decay would cost a multiply more. When the scale leaves
// [1e-20, 1e20] (a long run of decays), that token's update is written out whole (S = scale S + k delta^T), which
// brings the scale back to 1; at the end the block is scaled back to S.
template <class F, int W>
static inline void delta_rule_columns(float* S, int64_t ld, int64_t key_dim, const float* qn, const float* kn,
                                      const float* v, int64_t v_stride, const float* g, const float* beta,
                                      int64_t gb_stride, float* out, int64_t out_stride, int64_t tokens) {
    using V = typename F::V;
    constexpr int L = W / F::kLanes;  // vectors a row of the block
    constexpr int C = L >= 2 ? 2 : 4;  // chains of the output's sums: at least four FMAs in flight
    float scale = 1.0f;
    for (int64_t t = 0; t < tokens; ++t) {
        const float* qr = qn + t * key_dim;
        const float* kr = kn + t * key_dim;
        V acc[4][L];  // four chains a lane: an FMA's latency (4) times the two FMA pipes, in flight
        for (int c = 0; c < 4; ++c)
            for (int l = 0; l < L; ++l) acc[c][l] = F::zero();
        int64_t i = 0;
        for (; i + 3 < key_dim; i += 4)
            for (int c = 0; c < 4; ++c) {
                const V ki = F::set1(kr[i + c]);
                for (int l = 0; l < L; ++l)
                    acc[c][l] = F::fmadd(F::load(S + (i + c) * ld + F::kLanes * l), ki, acc[c][l]);
            }
        for (; i < key_dim; ++i) {
            const V ki = F::set1(kr[i]);
            for (int l = 0; l < L; ++l)
                acc[0][l] = F::fmadd(F::load(S + i * ld + F::kLanes * l), ki, acc[0][l]);
        }
        const float next_scale = scale * expf(g[t * gb_stride]);
        const bool lazy = next_scale >= 1e-20f && next_scale <= 1e20f;
        const V b = F::set1(beta[t * gb_stride]), ns = F::set1(next_scale);
        const V update = F::set1(lazy ? 1.0f / next_scale : 1.0f);
        V delta[L], o[C][L];
        for (int l = 0; l < L; ++l) {
            const V sum = F::add(F::add(acc[0][l], acc[1][l]), F::add(acc[2][l], acc[3][l]));
            const V d = F::mul(b, F::fnmadd(ns, sum, F::load(v + t * v_stride + F::kLanes * l)));
            delta[l] = F::mul(d, update);
            for (int c = 0; c < C; ++c) o[c][l] = F::zero();
        }
        if (lazy) {
            for (i = 0; i + C - 1 < key_dim; i += C)
                for (int c = 0; c < C; ++c) {
                    const V ki = F::set1(kr[i + c]), qi = F::set1(qr[i + c]);
                    for (int l = 0; l < L; ++l) {
                        float* row = S + (i + c) * ld + F::kLanes * l;
                        const V next = F::fmadd(ki, delta[l], F::load(row));
                        F::store(row, next);
                        o[c][l] = F::fmadd(next, qi, o[c][l]);
                    }
                }
            for (; i < key_dim; ++i) {
                const V ki = F::set1(kr[i]), qi = F::set1(qr[i]);
                for (int l = 0; l < L; ++l) {
                    float* row = S + i * ld + F::kLanes * l;
                    const V next = F::fmadd(ki, delta[l], F::load(row));
                    F::store(row, next);
                    o[0][l] = F::fmadd(next, qi, o[0][l]);
                }
            }
            scale = next_scale;
        } else {
            for (i = 0; i < key_dim; ++i) {
                const V ki = F::set1(kr[i]), qi = F::set1(qr[i]);
                for (int l = 0; l < L; ++l) {
                    float* row = S + i * ld + F::kLanes * l;
                    const V next = F::fmadd(F::load(row), ns, F::mul(ki, delta[l]));
                    F::store(row, next);
                    o[0][l] = F::fmadd(next, qi, o[0][l]);
                }
            }
            scale = 1.0f;
        }
        const V out_scale = F::set1(scale);
        for (int l = 0; l < L; ++l) {
            V sum = o[0][l];
            for (int c = 1; c < C; ++c) sum = F::add(sum, o[c][l]);
            F::store(out + t * out_stride + F::kLanes * l, F::mul(out_scale, sum));
        }
    }
    if (scale != 1.0f) {
        const V s = F::set1(scale);
        for (int64_t i = 0; i < key_dim; ++i)
            for (int l = 0; l < L; ++l) {
                float* row = S + i * ld + F::kLanes * l;
                F::store(row, F::mul(s, F::load(row)));
            }
    }
}

constexpr int64_t kBlock = 16;  // value columns a block
#if defined(__AVX512F__)
using BlockVec = kvserve::F32x16;  // a block's row is one vector
#else
using BlockVec = kvserve::F32x8;
#endif
// Fewer tokens than this (decode) run row by row: one pass of a token over S's contiguous rows streams well, where
// the blocks' packing and strided walks cost more than they save.
constexpr int64_t kBlockedFrom = 8;
constexpr int64_t kConvChannels = 256;  // channels a task of the causal convolution

// A sequence's tokens over whole rows of S: per token, acc = S^T k of the decayed state, then S += k delta^T and
// out = S^T q in a second pass.
static inline void delta_rule_rows(float* S, int64_t key_dim, int64_t value_dim, const float* qn, const float* kn,
                                   const float* v, int64_t v_stride, const float* g, const float* beta,
                                   int64_t gb_stride, float* out, int64_t out_stride, int64_t tokens) {
    std::vector<float> delta(value_dim);
    for (int64_t t = 0; t < tokens; ++t) {
        const float* qr = qn + t * key_dim;
        const float* kr = kn + t * key_dim;
        const float decay = expf(g[t * gb_stride]), b = beta[t * gb_stride];
        for (int64_t j = 0; j < value_dim; ++j) delta[j] = 0.0f;
        for (int64_t i = 0; i < key_dim; ++i) {  // decay S, and S^T k of the decayed state
            float* row = S + i * value_dim;
            for (int64_t j = 0; j < value_dim; ++j) {
                row[j] *= decay;
                delta[j] += row[j] * kr[i];
            }
        }
        const float* vr = v + t * v_stride;
        for (int64_t j = 0; j < value_dim; ++j) delta[j] = b * (vr[j] - delta[j]);
        float* o = out + t * out_stride;
        for (int64_t j = 0; j < value_dim; ++j) o[j] = 0.0f;
        for (int64_t i = 0; i < key_dim; ++i) {  // S += k delta^T, then out = S^T q
            float* row = S + i * value_dim;
            const float ki = kr[i], qi = qr[i];
            for (int64_t j = 0; j < value_dim; ++j) {
                row[j] += ki * delta[j];
                o[j] += row[j] * qi;
            }
        }
    }
}

// The same for one column (the columns past the last whole block of 8, odd head sizes).
static inline void delta_rule_column(float* S, int64_t value_dim, int64_t key_dim, const float* qn, const float* kn,
                                     const float* v, int64_t v_stride, const float* g, const float* beta,
                                     int64_t gb_stride, float* out, int64_t out_stride, int64_t tokens) {
    for (int64_t t = 0; t < tokens; ++t) {
        const float* qr = qn + t * key_dim;
        const float* kr = kn + t * key_dim;
        float acc = 0.0f;
        for (int64_t i = 0; i < key_dim; ++i) acc += S[i * value_dim] * kr[i];
        const float decay = expf(g[t * gb_stride]);
        const float delta = beta[t * gb_stride] * (v[t * v_stride] - decay * acc);
        float o = 0.0f;
        for (int64_t i = 0; i < key_dim; ++i) {
            const float next = S[i * value_dim] * decay + kr[i] * delta;
            S[i * value_dim] = next;
            o += next * qr[i];
        }
        out[t * out_stride] = o;
    }
}

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
    const int64_t runs = (channels + kConvChannels - 1) / kConvChannels;
    // Each (sequence, run of channels) is a task: the convolution is depthwise, so a run's channels never read
    // another's, and a single prompt's 6,144 channels (Qwen3.5) still spread over the threads.
#pragma omp parallel for collapse(2) schedule(dynamic, 1) if ((starts[seqs] - starts[0]) * channels >= (1 << 15))
    for (int64_t s = 0; s < seqs; ++s) {
        for (int64_t r = 0; r < runs; ++r) {
            const int64_t c0 = r * kConvChannels, n = std::min(kConvChannels, channels - c0);
            const int64_t first = starts[s], tokens = starts[s + 1] - first;
            float* state = states + slots[s] * keep * channels + c0;  // [keep, channels], the oldest input first
            const bool warm = continues[s] != 0;
            // The convolution's input m of the sequence: pre * x of its token m, or (m < 0) the state's row keep + m
            // (zeros for a sequence that starts here).
            const auto input8 = [&](int64_t m, int64_t c) -> __m256 {
                if (m < 0) return warm ? _mm256_loadu_ps(state + (keep + m) * channels + c) : _mm256_setzero_ps();
                const int64_t at = (first + m) * row_stride + c0 + c;
                const __m256 v = _mm256_loadu_ps(x + at);
                return pre ? _mm256_mul_ps(_mm256_loadu_ps(pre + at), v) : v;
            };
            const auto input1 = [&](int64_t m, int64_t c) -> float {
                if (m < 0) return warm ? state[(keep + m) * channels + c] : 0.0f;
                const int64_t at = (first + m) * row_stride + c0 + c;
                return pre ? pre[at] * x[at] : x[at];
            };
            for (int64_t t = 0; t < tokens; ++t) {
                float* y = out + (first + t) * channels + c0;
                const float* gr = gate ? gate + (first + t) * row_stride + c0 : nullptr;
                const float* wr = w + c0;
                int64_t c = 0;
                for (; c + 8 <= n; c += 8) {
                    __m256 acc = bias ? _mm256_loadu_ps(bias + c0 + c) : _mm256_setzero_ps();
                    for (int64_t j = 0; j < kernel; ++j)
                        acc = _mm256_fmadd_ps(_mm256_loadu_ps(wr + j * channels + c), input8(t - keep + j, c), acc);
                    if (act == 1) acc = kvserve::silu256(acc);
                    if (gr) acc = _mm256_mul_ps(acc, _mm256_loadu_ps(gr + c));
                    _mm256_storeu_ps(y + c, acc);
                }
                for (; c < n; ++c) {
                    float acc = bias ? bias[c0 + c] : 0.0f;
                    for (int64_t j = 0; j < kernel; ++j) acc += wr[j * channels + c] * input1(t - keep + j, c);
                    if (act == 1) acc = kvserve::silu1(acc);
                    y[c] = gr ? acc * gr[c] : acc;
                }
            }
            // The state becomes the last keep inputs; row k reads row k + tokens of the old state, never written yet.
            for (int64_t k = 0; k < keep; ++k) {
                float* row = state + k * channels;
                for (int64_t c = 0; c < n; ++c) row[c] = input1(tokens - keep + k, c);
            }
        }
    }
}

void kvserve_gated_delta_rule(const float* q, const float* k, const float* v, int64_t qk_stride, int64_t v_stride,
                              const float* g, const float* beta, int64_t gb_stride, float* states,
                              const int64_t* slots, const int64_t* starts, const int64_t* continues, int64_t seqs,
                              int64_t k_heads, int64_t v_heads, int64_t key_dim, int64_t value_dim, float* out) {
    const int64_t group = v_heads / k_heads;
    const float scale = 1.0f / sqrtf((float)key_dim);
    const int64_t out_stride = v_heads * value_dim;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t s = 0; s < seqs; ++s) {
        for (int64_t h = 0; h < v_heads; ++h) {
            float* S = states + ((slots[s] * v_heads) + h) * key_dim * value_dim;  // [key_dim, value_dim]
            if (!continues[s]) memset(S, 0, key_dim * value_dim * sizeof(float));
            const int64_t kh = h / group, first = starts[s], tokens = starts[s + 1] - starts[s];
            std::vector<float> qn(tokens * key_dim), kn(tokens * key_dim);  // q and k normalized, [tokens, key_dim]
            std::vector<float> block(key_dim * kBlock);
            for (int64_t t = 0; t < tokens; ++t) {
                const float* qr = q + (first + t) * qk_stride + kh * key_dim;
                const float* kr = k + (first + t) * qk_stride + kh * key_dim;
                float qq = 0.0f, kk = 0.0f;
                for (int64_t i = 0; i < key_dim; ++i) {
                    qq += qr[i] * qr[i];
                    kk += kr[i] * kr[i];
                }
                const float qs = scale / sqrtf(qq + 1e-6f), ks = 1.0f / sqrtf(kk + 1e-6f);
                for (int64_t i = 0; i < key_dim; ++i) {
                    qn[t * key_dim + i] = qr[i] * qs;
                    kn[t * key_dim + i] = kr[i] * ks;
                }
            }
            const float* vh = v + first * v_stride + h * value_dim;
            const float* gh = g + first * gb_stride + h;
            const float* bh = beta + first * gb_stride + h;
            float* oh = out + first * out_stride + h * value_dim;
            if (tokens < kBlockedFrom) {
                delta_rule_rows(S, key_dim, value_dim, qn.data(), kn.data(), vh, v_stride, gh, bh, gb_stride, oh,
                                out_stride, tokens);
                continue;
            }
            int64_t j = 0;
            for (; j + kBlock <= value_dim; j += kBlock) {
                // The block's rows are value_dim floats apart in S: 512 bytes at value_dim 128, so they would fall
                // in a few of L1's sets and evict each other; it runs on a packed copy.
                for (int64_t i = 0; i < key_dim; ++i)
                    memcpy(&block[i * kBlock], S + i * value_dim + j, kBlock * sizeof(float));
                delta_rule_columns<BlockVec, kBlock>(block.data(), kBlock, key_dim, qn.data(), kn.data(), vh + j,
                                                     v_stride, gh, bh, gb_stride, oh + j, out_stride, tokens);
                for (int64_t i = 0; i < key_dim; ++i)
                    memcpy(S + i * value_dim + j, &block[i * kBlock], kBlock * sizeof(float));
            }
            for (; j + 8 <= value_dim; j += 8)
                delta_rule_columns<kvserve::F32x8, 8>(S + j, value_dim, key_dim, qn.data(), kn.data(), vh + j,
                                                      v_stride, gh, bh, gb_stride, oh + j, out_stride, tokens);
            for (; j < value_dim; ++j)
                delta_rule_column(S + j, value_dim, key_dim, qn.data(), kn.data(), vh + j, v_stride, gh, bh,
                                  gb_stride, oh + j, out_stride, tokens);
        }
    }
}

}
