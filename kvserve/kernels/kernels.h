// The C entry points of the kernels in this folder, declared once: the sources that define them include this
// header (so the compiler checks each definition against its declaration) and decoder_layer.cpp calls them
// directly, in the same library, instead of duplicating them. kvserve/kernels/native.py keeps the ctypes side.
#pragma once

#include <stdint.h>

extern "C" {

void kvserve_q8_matmul(const float* x, int64_t m, int64_t k, const int8_t* w, const float* scales, int64_t n,
                       float* y);
void kvserve_gguf_matmul(const float* x, int64_t m, int64_t k, const uint8_t* w, int32_t type, int64_t n,
                         float* y, int64_t ldy);
void kvserve_rms_norm(const float* x, int64_t tokens, int64_t x_stride, int64_t groups, int64_t dim,
                      const float* w, float eps, float* out, int64_t out_stride);
void kvserve_gated_act(const float* gate_up, int64_t rows, int64_t inter, int32_t act, float* out);
void kvserve_qk_norm_rope(const float* qkv, int64_t tokens, int64_t row_stride, int64_t heads, int64_t q_heads,
                          int64_t dim, const float* q_weight, const float* k_weight, float eps, const float* cos,
                          const float* signed_sin, float* out);
void kvserve_paged_decode_attention(const float* q, const float* k_cache, const float* v_cache,
                                    const int64_t* block_tables, int64_t table_width, const int64_t* seq_lens,
                                    int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                                    int64_t block_size, int64_t window, float scale, float* out);
void kvserve_paged_decode_attention_i8(const float* q, const int8_t* k_cache, const int8_t* v_cache,
                                       const float* k_scales, const float* v_scales, const int64_t* block_tables,
                                       int64_t table_width, const int64_t* seq_lens, int64_t batch, int64_t heads,
                                       int64_t kv_heads, int64_t dim, int64_t block_size, int64_t window,
                                       float scale, float* out);
void kvserve_quantize_int8_rows(const float* x, int64_t rows, int64_t dim, int8_t* q, float* scales);
void kvserve_paged_prefill_attention(const float* q, const float* k_cache, const float* v_cache,
                                     const int64_t* block_table, int64_t q_len, int64_t seq_len, int64_t heads,
                                     int64_t kv_heads, int64_t dim, int64_t block_size, int64_t window,
                                     float scale, float* out);

}
