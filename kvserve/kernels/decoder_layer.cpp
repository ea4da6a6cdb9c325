// A whole decoder layer (llama / qwen2 / qwen3 / gemma3) in one call, float32 activations:
//   input norm -> fused QKV projection (+ bias) -> per-head q/k RMSNorm + NEOX rope -> K/V written into the
//   paged cache at slot_mapping -> paged attention (decode kernel where every row of the step is a decode, the
//   prefill kernel per sequence otherwise) -> output projection -> residual (gemma3: normed first) ->
//   MLP norm -> gate/up projection -> act(gate) * up -> down projection -> residual.
//
// Why: a decode step of the torch path is ~300 small ops and Python module calls (~10-20 us each on this CPU,
// about 5 ms a step at batch 1), each moving almost nothing; here a layer is one ctypes call that runs the same
// kernels back to back (kernels.h: the functions are called directly, not duplicated). The weights may be
// q8_0 (Q8Linear), GGUF blocks (GGUFLinear, one run of blocks per fused part) or float32 (nn.Linear); the
// caller (kvserve/model/native_layer.py) describes them and the step in kernels.h's structs, whose layout its
// ctypes.Structure classes (kernels/abi.py) mirror field for field. Scratch memory comes from the caller (sized by
// kvserve_decoder_layer_scratch), so a layer allocates nothing beyond what the attention kernels do.
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>

#include "kernels.h"
#include "kv_dtypes.h"
#include "simd.h"
#include "widened_matmul.h"

namespace {

enum : int64_t { kFloat32 = 0, kQ8_0 = 1, kGGUF = 2 };

struct Buffers {
    float *xn, *qkv, *qk, *q, *attn, *proj, *gate_up, *act, *qd, *od, *gated, *mixed;
};

// The widths of a Gated DeltaNet layer's parts: its convolution's channels (q, k, v) and its values (z, o).
inline int64_t gdn_conv_dim(const KvserveLayer& l) {
    return 2 * l.linear_key_heads * l.linear_key_dim + l.linear_value_heads * l.linear_value_dim;
}
inline int64_t gdn_value_size(const KvserveLayer& l) { return l.linear_value_heads * l.linear_value_dim; }

// Lays the buffers out in `base` (when given) and returns the floats they take; each starts on 64 bytes.
// A short-conv layer's in_proj output (B, C, x), and a Gated DeltaNet layer's in_proj_qkvz output, land where an
// attention layer's QKV does; `gated` holds an attention layer's output gate, or a Gated DeltaNet layer's b, a then
// beta, g; `mixed` its convolution's output; `attn` its recurrence's output.
int64_t carve(const KvserveLayer& l, int64_t t, int64_t decodes, float* base, Buffers* b) {
    const int64_t q_size = l.heads * l.head_dim, gate = l.output_gate ? q_size : 0;
    // With an output gate, `attn` first holds the queries and K side by side (the rope's input).
    int64_t qkv_size = (l.heads + 2 * l.kv_heads) * l.head_dim + gate, gated = gate, mixed = 0;
    int64_t attn = l.output_gate ? (l.heads + l.kv_heads) * l.head_dim : q_size;
    if (l.linear_value_heads) {
        qkv_size = gdn_conv_dim(l) + gdn_value_size(l);
        gated = 4 * l.linear_value_heads;
        mixed = gdn_conv_dim(l);
        attn = gdn_value_size(l);
    } else if (l.conv_kernel) {
        qkv_size = 3 * l.hidden;
    }
    const int64_t sizes[12] = {t * l.hidden, t * qkv_size, t * (l.heads + l.kv_heads) * l.head_dim, t * q_size,
                               t * attn, t * l.hidden, t * 2 * l.intermediate, t * l.intermediate,
                               decodes * q_size, decodes * q_size, t * gated, t * mixed};
    float** slots[12] = {&b->xn,      &b->qkv, &b->qk, &b->q,  &b->attn,  &b->proj,
                         &b->gate_up, &b->act, &b->qd, &b->od, &b->gated, &b->mixed};
    int64_t at = 0;
    for (int i = 0; i < 12; ++i) {
        if (base != nullptr) *slots[i] = base + at;
        at += (sizes[i] + 15) / 16 * 16;
    }
    return at;
}

void f32_matmul(const float* x, int64_t m, int64_t k, const float* w, int64_t n, float* y, int64_t ldy) {
    kvserve::widened_matmul(x, m, k, n, 8, y, ldy, [&](int64_t n0, int rows, int64_t k0, int64_t kc, float* buf) {
        for (int r = 0; r < rows; ++r) memcpy(buf + r * kc, w + (n0 + r) * k + k0, kc * sizeof(float));
    });
}

void linear(const KvserveLinear& lin, const float* x, int64_t m, float* y) {
    const int64_t k = lin.in_features, n = lin.out_features;
    if (lin.kind == kQ8_0) {
        kvserve_q8_matmul(x, m, k, static_cast<const int8_t*>(lin.weight[0]), lin.scales, n, y);
    } else {
        int64_t start = 0;
        for (int64_t p = 0; p < lin.parts; ++p) {
            if (lin.kind == kFloat32)
                f32_matmul(x, m, k, static_cast<const float*>(lin.weight[p]), lin.rows[p], y + start, n);
            else if (lin.int8_activations)
                kvserve_gguf_matmul_int8(x, m, k, static_cast<const uint8_t*>(lin.weight[p]),
                                         static_cast<int32_t>(lin.qtype[p]), lin.rows[p], y + start, n);
            else
                kvserve_gguf_matmul(x, m, k, static_cast<const uint8_t*>(lin.weight[p]),
                                    static_cast<int32_t>(lin.qtype[p]), lin.rows[p], y + start, n);
            start += lin.rows[p];
        }
    }
    if (lin.bias != nullptr)
        for (int64_t r = 0; r < m; ++r)
            for (int64_t i = 0; i < n; ++i) y[r * n + i] += lin.bias[i];
}

inline void add_into(float* h, const float* x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) h[i] += x[i];
}

// A state layer's second half: h += mixer output (in x), then h += down(act(gate) * up) of its normed self.
void residual_and_mlp(const KvserveLayer& l, const Buffers& b, int64_t t, float* h, const float* x) {
    const int64_t hidden = l.hidden;
    add_into(h, x, t * hidden);
    kvserve_rms_norm(h, t, hidden, 1, hidden, l.post_attention_norm, static_cast<float>(l.eps), b.xn, hidden);
    linear(l.gate_up, b.xn, t, b.gate_up);
    kvserve_gated_act(b.gate_up, t, l.intermediate, static_cast<int32_t>(l.act), b.act);
    linear(l.down, b.act, t, b.proj);
    add_into(h, b.proj, t * hidden);
}

// Each row's new K (roped, in b.qk after the queries) and V (in b.qkv) into the caches at its slot, per KV head, as
// kvserve/kv/quant.py's store writes them (kv_dtypes.h's store_row).
template <typename E>
void write_kv(const KvserveLayer& l, const KvserveStep& s, const Buffers& b, void* k_cache, void* v_cache,
              float* k_scales, float* v_scales) {
    using T = typename E::T;
    const int64_t dim = l.head_dim, q_size = l.heads * dim, kv_size = l.kv_heads * dim, qk_size = q_size + kv_size;
    const int64_t qkv_size = qk_size + kv_size + (l.output_gate ? q_size : 0), v_at = qk_size + (l.output_gate ? q_size : 0);
#pragma omp parallel for schedule(static) if (s.tokens >= 64)
    for (int64_t r = 0; r < s.tokens; ++r) {
        const float* k = b.qk + r * qk_size + q_size;
        const float* v = b.qkv + r * qkv_size + v_at;
        for (int64_t h = 0; h < l.kv_heads; ++h) {
            const int64_t row = s.slot_mapping[r] * l.kv_heads + h;
            kvserve::kv::store_row<E>(k + h * dim, dim, static_cast<T*>(k_cache) + row * dim,
                                      E::kScaled ? k_scales + row : nullptr);
            kvserve::kv::store_row<E>(v + h * dim, dim, static_cast<T*>(v_cache) + row * dim,
                                      E::kScaled ? v_scales + row : nullptr);
        }
    }
}

// Attention of every query row in b.q ([tokens, heads, dim]) into b.attn, as kvserve/attention/cpu.py does it: the
// decode kernel for the decode rows, the prefill kernel for each longer chunk; both read the cache in place.
void attention(const KvserveLayer& l, const KvserveStep& s, const Buffers& b, const void* k_cache,
               const void* v_cache, const float* k_scales, const float* v_scales, int64_t kv_dtype) {
    const int64_t q_size = l.heads * l.head_dim;
    // One decode call's arguments; a mixed step points them at its decode rows only.
    KvserveDecodeAttention d{b.q,          k_cache,      v_cache,  k_scales,      v_scales, s.block_tables,
                             s.seq_lens,   b.attn,       s.table_width, s.seqs,  l.heads,  l.kv_heads,
                             l.head_dim,   s.block_size, l.window, kv_dtype,      l.scale};
    if (s.all_decode) {
        kvserve_paged_decode_attention(&d);
        return;
    }
    if (s.decode_count > 0) {
        for (int64_t i = 0; i < s.decode_count; ++i)
            memcpy(b.qd + i * q_size, b.q + s.decode_rows[i] * q_size, q_size * sizeof(float));
        d.q = b.qd;
        d.block_tables = s.decode_tables;
        d.seq_lens = s.decode_lens;
        d.out = b.od;
        d.batch = s.decode_count;
        kvserve_paged_decode_attention(&d);
        for (int64_t i = 0; i < s.decode_count; ++i)
            memcpy(b.attn + s.decode_rows[i] * q_size, b.od + i * q_size, q_size * sizeof(float));
    }
    for (int64_t i = 0; i < s.seqs; ++i) {
        const int64_t start = s.query_start_loc[i], q_len = s.query_start_loc[i + 1] - start;
        if (q_len <= 1) continue;
        const KvservePrefillAttention p{b.q + start * q_size, k_cache,     v_cache,      k_scales,
                                        v_scales,             s.block_tables + i * s.table_width,
                                        b.attn + start * q_size, q_len,    s.seq_lens[i], l.heads,
                                        l.kv_heads,           l.head_dim,  s.block_size, l.window,
                                        kv_dtype,             l.scale};
        kvserve_paged_prefill_attention(&p);
    }
}

}  // namespace

extern "C" {

void kvserve_abi_sizes(int64_t* sizes) {
    sizes[0] = sizeof(KvserveLinear);
    sizes[1] = sizeof(KvserveLayer);
    sizes[2] = sizeof(KvserveStep);
    sizes[3] = sizeof(KvserveDecodeAttention);
    sizes[4] = sizeof(KvservePrefillAttention);
    sizes[5] = sizeof(KvserveQkNormRope);
}

// rows x dim float32 head vectors as the layer writes them into a cache of kv_dtype (for its tests).
void kvserve_store_kv_rows(const float* x, int64_t rows, int64_t dim, int64_t kv_dtype, void* out, float* scales) {
    kvserve::kv::dispatch(kv_dtype, [&](auto type) {
        using E = decltype(type);
        for (int64_t r = 0; r < rows; ++r)
            kvserve::kv::store_row<E>(x + r * dim, dim, static_cast<typename E::T*>(out) + r * dim,
                                      E::kScaled ? scales + r : nullptr);
    });
}

// The scratch floats kvserve_decoder_layer needs for `tokens` rows, `decode_count` of them decodes of a
// mixed step (0 when every row is a decode).
void kvserve_decoder_layer_scratch(const KvserveLayer* layer, int64_t tokens, int64_t decode_count,
                                   int64_t* floats) {
    Buffers unused;
    *floats = carve(*layer, tokens, decode_count, nullptr, &unused);
}

void kvserve_short_conv_layer(const KvserveLayer* layer, const KvserveStep* step, float* h, float* conv_states) {
    const KvserveLayer& l = *layer;
    const KvserveStep& s = *step;
    const int64_t t = s.tokens, hidden = l.hidden;
    const float eps = static_cast<float>(l.eps);
    Buffers b;
    carve(l, t, 0, s.scratch, &b);
    kvserve_rms_norm(h, t, hidden, 1, hidden, l.input_norm, eps, b.xn, hidden);
    linear(l.qkv, b.xn, t, b.qkv);  // [t, 3 x hidden]: B, C, x
    kvserve_causal_conv(b.qkv + 2 * hidden, b.qkv, b.qkv + hidden, 3 * hidden, l.conv_weight, l.conv_bias, conv_states,
                        s.state_slots, s.query_start_loc, s.state_continues, s.seqs, hidden, l.conv_kernel, 0,
                        b.proj);
    linear(l.o, b.proj, t, b.xn);
    residual_and_mlp(l, b, t, h, b.xn);
}

void kvserve_gated_deltanet_layer(const KvserveLayer* layer, const KvserveStep* step, float* h, float* conv_states,
                                  float* recurrent_states) {
    const KvserveLayer& l = *layer;
    const KvserveStep& s = *step;
    const int64_t t = s.tokens, hidden = l.hidden, n = l.linear_value_heads;
    const int64_t conv_dim = gdn_conv_dim(l), value_size = gdn_value_size(l), width = conv_dim + value_size;
    const int64_t key_size = l.linear_key_heads * l.linear_key_dim;
    Buffers b;
    carve(l, t, 0, s.scratch, &b);
    kvserve_rms_norm(h, t, hidden, 1, hidden, l.input_norm, static_cast<float>(l.eps), b.xn, hidden);
    linear(l.qkv, b.xn, t, b.qkv);   // [t, conv_dim + value_size]: q, k, v then z
    linear(l.ba, b.xn, t, b.gated);  // [t, 2 n]: b then a
    kvserve_causal_conv(b.qkv, nullptr, nullptr, width, l.conv_weight, nullptr, conv_states, s.state_slots,
                        s.query_start_loc, s.state_continues, s.seqs, conv_dim, l.conv_kernel, 1, b.mixed);
    float* beta = b.gated + 2 * t * n;  // [t, n] each, after the [t, 2 n] projection
    float* g = beta + t * n;
    for (int64_t r = 0; r < t; ++r) {
        const float* ba = b.gated + r * 2 * n;
        for (int64_t i = 0; i < n; ++i) {
            beta[r * n + i] = 1.0f / (1.0f + expf(-ba[i]));
            const float x = ba[n + i] + l.dt_bias[i];
            const float softplus = x > 20.0f ? x : log1pf(expf(x));  // torch's softplus (threshold 20)
            g[r * n + i] = -expf(l.a_log[i]) * softplus;
        }
    }
    kvserve_gated_delta_rule(b.mixed, b.mixed + key_size, b.mixed + 2 * key_size, conv_dim, conv_dim, g, beta, n,
                             recurrent_states, s.state_slots, s.query_start_loc, s.state_continues, s.seqs,
                             l.linear_key_heads, n, l.linear_key_dim, l.linear_value_dim, b.attn);
    // The gated norm: rms_norm(o) x weight x silu(z), per value head.
    kvserve_rms_norm(b.attn, t, value_size, n, l.linear_value_dim, l.state_norm, static_cast<float>(l.eps), b.attn,
                     value_size);
#pragma omp parallel for schedule(static) if (t * value_size >= (1 << 15))
    for (int64_t r = 0; r < t; ++r) {
        const float* z = b.qkv + r * width + conv_dim;
        float* o = b.attn + r * value_size;
        int64_t i = 0;
        for (; i + 8 <= value_size; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), kvserve::silu256(_mm256_loadu_ps(z + i))));
        for (; i < value_size; ++i) o[i] *= kvserve::silu1(z[i]);
    }
    linear(l.o, b.attn, t, b.proj);
    residual_and_mlp(l, b, t, h, b.proj);
}

// h: [tokens, hidden] float32, the residual stream, updated in place. cos / signed_sin: [tokens, head_dim] of
// this layer's rope (RotaryEmbedding.cos_sin). k_cache / v_cache: [blocks, block_size, kv_heads, head_dim] of
// kv_dtype, contiguous, with k_scales / v_scales [blocks, block_size, kv_heads] float32 for an 8-bit type (else null).
void kvserve_decoder_layer(const KvserveLayer* layer, const KvserveStep* step, float* h, const float* cos,
                           const float* signed_sin, void* k_cache, void* v_cache, float* k_scales, float* v_scales,
                           int64_t kv_dtype) {
    const KvserveLayer& l = *layer;
    const KvserveStep& s = *step;
    const int64_t t = s.tokens, dim = l.head_dim, hidden = l.hidden;
    const int64_t q_size = l.heads * dim, kv_size = l.kv_heads * dim, qk_size = q_size + kv_size;
    const int64_t gate = l.output_gate ? q_size : 0, qkv_size = qk_size + kv_size + gate;
    const float eps = static_cast<float>(l.eps);
    Buffers b;
    carve(l, t, s.all_decode ? 0 : s.decode_count, s.scratch, &b);

    kvserve_rms_norm(h, t, hidden, 1, hidden, l.input_norm, eps, b.xn, hidden);
    linear(l.qkv, b.xn, t, b.qkv);
    const float* qk_rows = b.qkv;  // a row's Q heads then K heads, qk_stride apart
    int64_t qk_stride = qkv_size;
    if (l.output_gate) {  // each head's query then its gate: the queries and K side by side in `attn` for the rope,
        for (int64_t r = 0; r < t; ++r) {  // the gates to `gated`
            const float* row = b.qkv + r * qkv_size;
            float* qk = b.attn + r * qk_size;
            for (int64_t hd = 0; hd < l.heads; ++hd) {
                memcpy(qk + hd * dim, row + 2 * hd * dim, dim * sizeof(float));
                memcpy(b.gated + r * q_size + hd * dim, row + (2 * hd + 1) * dim, dim * sizeof(float));
            }
            memcpy(qk + q_size, row + 2 * q_size, kv_size * sizeof(float));
        }
        qk_rows = b.attn;
        qk_stride = qk_size;
    }
    const bool qk_norm = l.q_norm != nullptr && l.k_norm != nullptr;
    const KvserveQkNormRope rope{qk_rows,    qk_norm ? l.q_norm : nullptr, qk_norm ? l.k_norm : nullptr,
                                 cos,        signed_sin,
                                 b.qk,       t,
                                 qk_stride,  l.heads + l.kv_heads,
                                 l.heads,    dim,
                                 l.rotary_dim ? l.rotary_dim : dim,
                                 qk_norm ? l.eps : 0.0};
    kvserve_qk_norm_rope(&rope);
    for (int64_t r = 0; r < t; ++r) memcpy(b.q + r * q_size, b.qk + r * qk_size, q_size * sizeof(float));
    kvserve::kv::dispatch(kv_dtype, [&](auto type) {
        write_kv<decltype(type)>(l, s, b, k_cache, v_cache, k_scales, v_scales);
    });
    attention(l, s, b, k_cache, v_cache, k_scales, v_scales, kv_dtype);
    if (l.output_gate)  // Qwen3.5: the output times the sigmoid of its gate
        for (int64_t i = 0; i < t * q_size; ++i) b.attn[i] /= 1.0f + expf(-b.gated[i]);
    linear(l.o, b.attn, t, b.proj);
    if (l.sandwich) kvserve_rms_norm(b.proj, t, hidden, 1, hidden, l.post_attention_norm, eps, b.proj, hidden);
    add_into(h, b.proj, t * hidden);

    kvserve_rms_norm(h, t, hidden, 1, hidden, l.sandwich ? l.pre_feedforward_norm : l.post_attention_norm, eps,
                     b.xn, hidden);
    linear(l.gate_up, b.xn, t, b.gate_up);
    kvserve_gated_act(b.gate_up, t, l.intermediate, static_cast<int32_t>(l.act), b.act);
    linear(l.down, b.act, t, b.proj);
    if (l.sandwich) kvserve_rms_norm(b.proj, t, hidden, 1, hidden, l.post_feedforward_norm, eps, b.proj, hidden);
    add_into(h, b.proj, t * hidden);
}

}
