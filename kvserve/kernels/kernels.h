// The C ABI of kvserve's CPU kernels, declared once. Everything else is checked against this file:
// - the sources that define the entry points include it, so the compiler checks each definition against its
//   declaration (two extern "C" functions of one name and different parameters do not compile);
// - kvserve/kernels/native.py reads the declarations below to set each function's ctypes argument types;
// - kvserve/kernels/abi.py mirrors the structs in ctypes, and kvserve_abi_sizes lets a test compare the sizes;
// - tests/unit/test_kernel_contract.py checks that every definition is declared here and every declaration is
//   defined and exported, and that the ctypes fields have the names and sizes of these fields.
// An entry point with many arguments takes one struct of them (every integer int64 and every real a double, so
// that no padding rule can differ between C++ and ctypes).
#pragma once

#include <stdint.h>

extern "C" {

// ---- structs --------------------------------------------------------------------------------------------

// y [m, out_features] = x [m, in_features] W^T (+ bias). Parts are stacked along the output axis (a fused QKV
// or gate/up whose sources were stored in different GGUF types); q8_0 and float32 have one part.
struct KvserveLinear {
    const void* weight[3];  // per part: float32 [rows, k], int8 [rows, k] (q8_0) or uint8 GGUF blocks
    const float* scales;    // q8_0: [out_features, in_features / 32]; else null
    const float* bias;      // [out_features] or null
    int64_t rows[3];        // output rows of each part
    int64_t qtype[3];       // GGUF: ggml type of each part
    int64_t in_features, out_features;
    int64_t kind;  // 0 float32, 1 q8_0, 2 GGUF blocks
    int64_t parts;
    int64_t int8_activations;  // GGUF blocks: 1 multiplies with 8-bit activations (kvserve_gguf_matmul_int8)
};

// The weights and shape facts of one decoder layer (decoder_layer.cpp). A short-convolution layer (LFM2's,
// kvserve_short_conv_layer) keeps its in_proj in `qkv` ([3 x hidden] outputs: B, C, x), its out_proj in `o`, and
// its taps in conv_weight. A Gated DeltaNet layer (Qwen3.5's, kvserve_gated_deltanet_layer) keeps in_proj_qkvz in
// `qkv`, in_proj_ba in `ba`, out_proj in `o`, its convolution's taps in conv_weight, and linear_* > 0.
struct KvserveLayer {
    KvserveLinear qkv, o, gate_up, down, ba;
    const float* input_norm;             // [hidden] each
    const float* post_attention_norm;    // llama/qwen: before the MLP; gemma3: on the attention output
    const float* pre_feedforward_norm;   // gemma3 only (sandwich), else null
    const float* post_feedforward_norm;  // gemma3 only
    const float* q_norm;                 // [head_dim] per-head norms (qwen3, gemma3), or both null
    const float* k_norm;
    const float* conv_weight;            // short conv: [hidden, conv_kernel]; else null
    const float* conv_bias;              // short conv: [hidden] or null
    const float* dt_bias;                // Gated DeltaNet: [linear_value_heads] each; else null
    const float* a_log;
    const float* state_norm;             // Gated DeltaNet: the gated norm's weight [linear_value_dim]
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    int64_t conv_kernel;                 // a state layer's convolution taps; 0 for an attention layer
    int64_t linear_key_heads, linear_value_heads, linear_key_dim, linear_value_dim;  // Gated DeltaNet, else 0
    int64_t output_gate;  // attention (Qwen3.5): q_proj gives each head its query then a gate, interleaved
    int64_t rotary_dim;   // rope turns the first rotary_dim dims of each head (partial rope); head_dim: all
    int64_t window;    // sliding window, 0: none
    int64_t act;       // kvserve_gated_act's code: 0 tanh-GELU, 1 SiLU
    int64_t sandwich;  // gemma3's norms around attention and MLP outputs
    double eps, scale;
};

// One step's flat batch (AttentionMetadata): `tokens` rows of `seqs` sequences; sequence i owns rows
// query_start_loc[i] .. query_start_loc[i + 1] - 1, the last positions of a context of seq_lens[i] tokens.
struct KvserveStep {
    float* scratch;                  // kvserve_decoder_layer_scratch(layer, tokens, decode_count) floats
    const int64_t* slot_mapping;     // [tokens]
    const int64_t* block_tables;     // [seqs, table_width]
    const int64_t* seq_lens;         // [seqs]
    const int64_t* query_start_loc;  // [seqs + 1]
    const int64_t* decode_rows;      // mixed steps: the rows that are decodes (one per such sequence), else null
    const int64_t* decode_tables;    // their block tables [decode_count, table_width]
    const int64_t* decode_lens;      // their seq_lens [decode_count]
    int64_t tokens, seqs, table_width, block_size;
    int64_t all_decode;    // every row is a decode: one decode-attention call for the whole step
    int64_t decode_count;  // rows of decode_rows
    const int64_t* state_slots;      // a hybrid model's state layers: each sequence's state slot [seqs], else null
    const int64_t* state_continues;  // [seqs]: 1 where the sequence's state carries on, 0 where it starts from zeros
};

// The element type of a paged KV cache (kv_dtypes.h says how each is read and written; kvserve/kernels/ops.py maps
// torch dtypes onto these codes). The 8-bit types come with a float32 scale per token and KV head
// ([blocks, block_size, kv_heads], kvserve/kv/quant.py's layout).
enum : int64_t { kKvFloat32 = 0, kKvBfloat16 = 1, kKvFloat16 = 2, kKvInt8 = 3, kKvFp8E4m3 = 4, kKvFp8E5m2 = 5 };

// Paged decode attention: one query per sequence, at position seq_lens[i] - 1.
struct KvserveDecodeAttention {
    const float* q;               // [batch, heads, dim] contiguous
    const void* k_cache;          // [blocks, block_size, kv_heads, dim] contiguous, of kv_dtype
    const void* v_cache;
    const float* k_scales;        // 8-bit caches: [blocks, block_size, kv_heads]; else null
    const float* v_scales;
    const int64_t* block_tables;  // [batch, table_width]
    const int64_t* seq_lens;      // [batch]
    float* out;                   // [batch, heads, dim] contiguous
    int64_t table_width, batch, heads, kv_heads, dim, block_size;
    int64_t window;  // <= 0: no sliding window; else keys at positions > seq_len - 1 - window only
    int64_t kv_dtype;  // the caches' element type (kKv*)
    double scale;
};

// Paged prefill attention of one sequence's chunk: queries at positions seq_len - q_len .. seq_len - 1, causal.
struct KvservePrefillAttention {
    const float* q;              // [q_len, heads, dim] contiguous
    const void* k_cache;         // [blocks, block_size, kv_heads, dim] contiguous, of kv_dtype
    const void* v_cache;
    const float* k_scales;       // 8-bit caches: [blocks, block_size, kv_heads]; else null
    const float* v_scales;
    const int64_t* block_table;  // covering seq_len
    float* out;                  // [q_len, heads, dim] contiguous
    int64_t q_len, seq_len, heads, kv_heads, dim, block_size;
    int64_t window;  // <= 0: none; else a query at position p sees keys at positions in (p - window, p]
    int64_t kv_dtype;  // the caches' element type (kKv*)
    double scale;
};

// Per-head RMSNorm of Q and K heads, then NEOX rope.
struct KvserveQkNormRope {
    const float* qkv;         // [tokens, row_stride]: a row's first heads x dim values are the Q heads then the K
    const float* q_weight;    // [dim] norm weights, or both null for no norm (eps is then unused)
    const float* k_weight;
    const float* cos;         // [tokens, dim] (cos over both halves)
    const float* signed_sin;  // [tokens, dim] (sin negated on the first half)
    float* out;               // [tokens, heads, dim] contiguous
    int64_t tokens, row_stride, heads;
    int64_t q_heads;  // how many of the heads are Q (they use q_weight; the rest use k_weight)
    int64_t dim;
    int64_t rotary_dim;  // rope turns the first rotary_dim dims (pairs i, i + rotary_dim / 2; cos and signed_sin
                         // [tokens, rotary_dim]); the rest are normalized only. dim: all of them
    double eps;
};

// ---- entry points ---------------------------------------------------------------------------------------

// q8_matmul.cpp: x [m, k] @ dequant(w int8 [n, k], scales [n, k / 32])^T -> y [m, n].
void kvserve_q8_matmul(const float* x, int64_t m, int64_t k, const int8_t* w, const float* scales, int64_t n,
                       float* y);
// gguf_matmul.cpp: x [m, k] @ W^T, W [n, k] as GGUF blocks of ggml `type` -> y [m, >= n], rows ldy apart. A type
// it has no kernel for aborts the process with a message (callers check it first: gguf_blocks.NATIVE_GGUF_TYPES).
// Every GGUF entry point takes a type id with kRows4 (256) added for rows interleaved four at a time
// (gguf_formats.h's RowBlocks), and for Q5_0 kQ5Tiles (512) as well for tiles (Q5Tile), as
// kvserve_gguf_interleave_rows lays them out from the file's.
void kvserve_gguf_matmul(const float* x, int64_t m, int64_t k, const uint8_t* w, int32_t type, int64_t n, float* y,
                         int64_t ldy);
// gguf_int8_matmul.cpp: as kvserve_gguf_matmul with x quantized to 8 bits per run of 32 (--activation-quantization
// int8), integer dot products against the blocks; the quantization alone (for tests); the dot product built in.
void kvserve_gguf_matmul_int8(const float* x, int64_t m, int64_t k, const uint8_t* w, int32_t type, int64_t n,
                              float* y, int64_t ldy);
void kvserve_quantize_int8_activations(const float* x, int64_t m, int64_t k, int8_t* q, float* d);
// Weights packed once into the int8 matmul's panels (AVX-512 VNNI builds; bytes 0 elsewhere), and the matmul on them.
void kvserve_gguf_packed_panels_bytes(int32_t type, int64_t n, int64_t k, int64_t* bytes);
void kvserve_gguf_pack_panels_int8(const uint8_t* w, int32_t type, int64_t n, int64_t k, uint8_t* out);
void kvserve_gguf_matmul_int8_packed(const float* x, int64_t m, int64_t k, const uint8_t* w, const uint8_t* packed,
                                     int32_t type, int64_t n, float* y, int64_t ldy);
void kvserve_int8_dot_isa(int64_t* isa);
// rows of k weights stored as blocks of `type` -> out [rows, k] float32 (an embedding's looked-up rows); a weight
// [n, k] of a ggml type in the file's layout -> the same bytes in the layout of kernel type `type` (+ 256, + 512).
void kvserve_gguf_dequantize(const uint8_t* w, int32_t type, int64_t rows, int64_t k, float* out);
void kvserve_gguf_interleave_rows(const uint8_t* w, int32_t type, int64_t n, int64_t k, uint8_t* out);
// rms_norm.cpp: RMSNorm over the last axis of x [tokens, groups, dim] (rows x_stride apart) times w.
void kvserve_rms_norm(const float* x, int64_t tokens, int64_t x_stride, int64_t groups, int64_t dim, const float* w,
                      float eps, float* out, int64_t out_stride);
// gated_act.cpp: act(gate) * up for gate_up [rows, 2 x inter] -> out [rows, inter]; act 0 tanh-GELU, 1 SiLU.
void kvserve_gated_act(const float* gate_up, int64_t rows, int64_t inter, int32_t act, float* out);

// The recurrent parts of hybrid models (recurrent.cpp), each sequence's state in its slot, read where continues[s]
// (else zeros) and left holding its last state; slots / continues [seqs], starts [seqs + 1] row offsets.
// A depthwise causal convolution: rows of x (and of pre, gate when not null) every row_stride floats; weight
// [channels, kernel], bias [channels] or null; states [slots, kernel - 1, channels]; act 0: none, 1: SiLU;
// out [tokens, channels] = gate * act(conv(pre * x)).
void kvserve_causal_conv(const float* x, const float* pre, const float* gate, int64_t row_stride, const float* weight,
                         const float* bias, float* states, const int64_t* slots, const int64_t* starts,
                         const int64_t* continues, int64_t seqs, int64_t channels, int64_t kernel, int64_t act,
                         float* out);
// The gated delta rule: q, k rows of [k_heads, key_dim] every qk_stride floats, v rows of [v_heads, value_dim] every
// v_stride, g (log decay) and beta rows of [v_heads] every gb_stride; states [slots, v_heads, key_dim, value_dim];
// out [tokens, v_heads, value_dim].
void kvserve_gated_delta_rule(const float* q, const float* k, const float* v, int64_t qk_stride, int64_t v_stride,
                              const float* g, const float* beta, int64_t gb_stride, float* states,
                              const int64_t* slots, const int64_t* starts, const int64_t* continues, int64_t seqs,
                              int64_t k_heads, int64_t v_heads, int64_t key_dim, int64_t value_dim, float* out);
// qk_norm_rope.cpp
void kvserve_qk_norm_rope(const KvserveQkNormRope* args);
// row_max.cpp: each row of x [rows, cols] (rows `stride` floats apart, cols >= 1): its largest value and the index
// of its first occurrence; a row holding NaN gives NaN and its first NaN's index (torch's max(dim=-1)).
void kvserve_row_max(const float* x, int64_t rows, int64_t cols, int64_t stride, float* values, int64_t* ids);
// copy_rows.cpp: for each part p and row i, part_bytes[p] bytes from row src_row[i] of src[p] (an address) to row
// dst_row[i] of dst[p], rows src_stride[p] / dst_stride[p] bytes apart; the caller checks every row is in range.
void kvserve_copy_rows(int64_t parts, const int64_t* dst, const int64_t* dst_stride, const int64_t* src,
                       const int64_t* src_stride, const int64_t* part_bytes, int64_t rows, const int64_t* dst_row,
                       const int64_t* src_row);
// paged_attention.cpp: any KvserveKvDtype cache, read in place.
void kvserve_paged_decode_attention(const KvserveDecodeAttention* args);
// prefill_attention.cpp
void kvserve_paged_prefill_attention(const KvservePrefillAttention* args);
// decoder_layer.cpp: a whole decoder layer on the residual stream h [tokens, hidden], in place, its new K/V written
// into caches of kv_dtype (k_scales / v_scales: an 8-bit cache's, else null); the scratch floats it needs.
void kvserve_decoder_layer(const KvserveLayer* layer, const KvserveStep* step, float* h, const float* cos,
                           const float* signed_sin, void* k_cache, void* v_cache, float* k_scales, float* v_scales,
                           int64_t kv_dtype);
void kvserve_decoder_layer_scratch(const KvserveLayer* layer, int64_t tokens, int64_t decode_count,
                                   int64_t* floats);
// decoder_layer.cpp: an LFM2 short-convolution layer on h in place: norm, in_proj, B x -> causal conv with the
// sequences' states (conv_states [slots, conv_kernel - 1, hidden], the step's state_slots / state_continues) -> C
// gate, out_proj, residual, then the MLP as kvserve_decoder_layer's. Its scratch: kvserve_decoder_layer_scratch.
void kvserve_short_conv_layer(const KvserveLayer* layer, const KvserveStep* step, float* h, float* conv_states);
// decoder_layer.cpp: a Qwen3.5 Gated DeltaNet layer on h in place: norm, in_proj_qkvz / in_proj_ba, SiLU causal
// conv over q, k, v with the sequences' conv states, beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), the
// gated delta rule with their recurrent states ([slots, v_heads, key_dim, value_dim]), the gated norm (rms_norm(o) x
// silu(z) per value head), out_proj, residual, then the MLP. Its scratch: kvserve_decoder_layer_scratch.
void kvserve_gated_deltanet_layer(const KvserveLayer* layer, const KvserveStep* step, float* h, float* conv_states,
                                  float* recurrent_states);
// decoder_layer.cpp: rows x dim float32 head vectors as the layer writes them into a cache of kv_dtype (out: rows x
// dim elements; scales: rows floats for an 8-bit type, else unused), for tests.
void kvserve_store_kv_rows(const float* x, int64_t rows, int64_t dim, int64_t kv_dtype, void* out, float* scales);
// sizeof each struct above, in their order here, so that the ctypes mirror can be checked against them.
void kvserve_abi_sizes(int64_t* sizes);
}
