// Every decoder layer of a decode step (one new token per sequence) in one call: the same kernels
// the per-op path calls, in the same order on the same buffers, so the numbers are identical; what
// goes is the Python between them (~10 kernel calls a layer, each with its checks and allocations).
#include "common.h"

extern "C" {
void pd_rms_norm_f32(const float*, int64_t, const float*, int64_t, const float*, float, float*, float*, int64_t,
                     int64_t, int);
void pd_rms_norm_bf16(const pd::bf16*, int64_t, const pd::bf16*, int64_t, const pd::bf16*, float, pd::bf16*,
                      pd::bf16*, int64_t, int64_t, int);
void pd_linear_f32(const float*, int64_t, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int);
void pd_linear_bf16(const pd::bf16*, int64_t, const pd::bf16*, const pd::bf16*, pd::bf16*, int64_t, int64_t, int64_t,
                    int64_t, int);
void pd_rotary_store_f32(const float*, const float*, const float*, const int32_t*, const float*, float*,
                         const int32_t*, float*, const int64_t*, int);
void pd_rotary_store_bf16(const pd::bf16*, const pd::bf16*, const pd::bf16*, const int32_t*, const float*, pd::bf16*,
                          const int32_t*, pd::bf16*, const int64_t*, int);
void pd_decode_attention_f32(const float*, const float*, const int64_t*, int64_t, const int32_t*, const int32_t*,
                             float*, float*, float*, const int64_t*, float, int);
void pd_decode_attention_bf16(const pd::bf16*, const pd::bf16*, const int64_t*, int64_t, const int32_t*,
                              const int32_t*, pd::bf16*, float*, float*, const int64_t*, float, int);
void pd_silu_and_mul_f32(const float*, int64_t, float*, int64_t, int64_t, int);
void pd_silu_and_mul_bf16(const pd::bf16*, int64_t, pd::bf16*, int64_t, int64_t, int);
}

namespace pd {

template <typename T> struct Ops;
template <> struct Ops<float> {
  static constexpr auto rms_norm = pd_rms_norm_f32;
  static constexpr auto linear = pd_linear_f32;
  static constexpr auto rotary_store = pd_rotary_store_f32;
  static constexpr auto attention = pd_decode_attention_f32;
  static constexpr auto silu_and_mul = pd_silu_and_mul_f32;
};
template <> struct Ops<bf16> {
  static constexpr auto rms_norm = pd_rms_norm_bf16;
  static constexpr auto linear = pd_linear_bf16;
  static constexpr auto rotary_store = pd_rotary_store_bf16;
  static constexpr auto attention = pd_decode_attention_bf16;
  static constexpr auto silu_and_mul = pd_silu_and_mul_bf16;
};

// One layer's parameters, in the order of the pointer table the Python side builds (bias may be null).
template <typename T> struct LayerWeights {
  const T *input_norm, *qkv, *qkv_bias, *o, *o_bias, *post_norm, *gate_up, *gate_up_bias, *down, *down_bias;
};

struct StepShape {  // the int64 array the Python side passes, field for field
  int64_t seqs, hidden, q_heads, kv_heads, head_dim, inner, layers, splits;
  int64_t block_size, pool_block, pool_layer, pool_kv, pool_slot, pool_head, table_stride, cos_sin_stride;
  int64_t first_layer_has_residual;
};

template <typename T> struct Scratch {  // [seqs, width] each, laid out one after the other
  T *normed, *qkv, *q, *attention, *gate_up, *act;
  float *partials, *lses;
};

template <typename T>
static void attention_block(const LayerWeights<T>& w, const StepShape& sh, T* h, const Scratch<T>& s,
                            T* layer_pool, const int32_t* positions, const int32_t* slots, const float* cos_sin,
                            const int32_t* tables, const int32_t* lens, float scale, int threads) {
  const int64_t q_size = sh.q_heads * sh.head_dim, kv_size = sh.kv_heads * sh.head_dim;
  const int64_t qkv_width = q_size + 2 * kv_size;
  Ops<T>::linear(s.normed, sh.hidden, w.qkv, w.qkv_bias, s.qkv, qkv_width, sh.seqs, qkv_width, sh.hidden, threads);
  const int64_t rotary[16] = {sh.seqs, sh.q_heads, sh.kv_heads, sh.head_dim, qkv_width, sh.head_dim,
                              qkv_width, sh.head_dim, qkv_width, sh.head_dim, sh.cos_sin_stride, sh.block_size,
                              sh.pool_block, sh.pool_kv, sh.pool_slot, sh.pool_head};
  Ops<T>::rotary_store(s.qkv, s.qkv + q_size, s.qkv + q_size + kv_size, positions, cos_sin, layer_pool, slots, s.q,
                       rotary, threads);
  const int64_t strides[4] = {sh.pool_block, sh.pool_kv, sh.pool_slot, sh.pool_head};
  const int64_t attention[10] = {sh.seqs, sh.q_heads, sh.kv_heads, sh.head_dim, sh.splits,
                                 q_size, sh.head_dim, q_size, sh.head_dim, sh.table_stride};
  Ops<T>::attention(s.q, layer_pool, strides, sh.block_size, tables, lens, s.attention, s.partials, s.lses,
                    attention, scale, threads);
  Ops<T>::linear(s.attention, q_size, w.o, w.o_bias, h, sh.hidden, sh.seqs, sh.hidden, q_size, threads);
}

template <typename T>
static void mlp_block(const LayerWeights<T>& w, const StepShape& sh, T* h, const Scratch<T>& s, int threads) {
  const int64_t width = 2 * sh.inner;
  Ops<T>::linear(s.normed, sh.hidden, w.gate_up, w.gate_up_bias, s.gate_up, width, sh.seqs, width, sh.hidden,
                 threads);
  Ops<T>::silu_and_mul(s.gate_up, width, s.act, sh.seqs, sh.inner, threads);
  Ops<T>::linear(s.act, sh.inner, w.down, w.down_bias, h, sh.hidden, sh.seqs, sh.hidden, sh.inner, threads);
}

// h [S, hidden]: in, the embeddings (or the last layer's output); out, the last layer's output.
// residual [S, hidden]: the running residual sum, in (when first_layer_has_residual) and out.
template <typename T>
static void decode_layers(T* h, T* residual, const int64_t* table, const StepShape& sh, T* pool,
                          const int32_t* positions, const int32_t* slots, const float* cos_sin, const int32_t* tables,
                          const int32_t* lens, const Scratch<T>& s, float eps, float scale, int threads) {
  for (int64_t layer = 0; layer < sh.layers; ++layer) {
    LayerWeights<T> w;
    std::memcpy(&w, table + layer * (sizeof w / sizeof(int64_t)), sizeof w);
    if (layer == 0 && !sh.first_layer_has_residual) {
      std::memcpy(residual, h, sh.seqs * sh.hidden * sizeof(T));
      Ops<T>::rms_norm(h, sh.hidden, nullptr, 0, w.input_norm, eps, s.normed, nullptr, sh.seqs, sh.hidden, threads);
    } else {  // NOTE: the sum is written over the residual it reads, element by element
      Ops<T>::rms_norm(h, sh.hidden, residual, sh.hidden, w.input_norm, eps, s.normed, residual, sh.seqs, sh.hidden,
                       threads);
    }
    attention_block(w, sh, h, s, pool + layer * sh.pool_layer, positions, slots, cos_sin, tables, lens, scale,
                    threads);
    Ops<T>::rms_norm(h, sh.hidden, residual, sh.hidden, w.post_norm, eps, s.normed, residual, sh.seqs, sh.hidden,
                     threads);
    mlp_block(w, sh, h, s, threads);
  }
}

template <typename T>
static Scratch<T> carve(T* scratch, float* partials, const StepShape& sh) {
  const int64_t q_size = sh.q_heads * sh.head_dim, qkv = q_size + 2 * sh.kv_heads * sh.head_dim;
  Scratch<T> s;
  s.normed = scratch;
  s.qkv = s.normed + sh.seqs * sh.hidden;
  s.q = s.qkv + sh.seqs * qkv;
  s.attention = s.q + sh.seqs * q_size;
  s.gate_up = s.attention + sh.seqs * q_size;
  s.act = s.gate_up + sh.seqs * 2 * sh.inner;
  s.partials = sh.splits > 1 ? partials : nullptr;
  s.lses = sh.splits > 1 ? partials + sh.seqs * sh.q_heads * sh.splits * sh.head_dim : nullptr;
  return s;
}

}  // namespace pd

#define PD_DECODE_LAYERS(SUFFIX, T)                                                                             \
  extern "C" void pd_decode_layers_##SUFFIX(T* h, T* residual, const int64_t* table, const int64_t* shape, T* pool, \
                                            const int32_t* positions, const int32_t* slots, const float* cos_sin,  \
                                            const int32_t* tables, const int32_t* lens, T* scratch,               \
                                            float* partials, float eps, float scale, int threads) {               \
    pd::StepShape sh;                                                                                            \
    std::memcpy(&sh, shape, sizeof sh);                                                                          \
    pd::decode_layers(h, residual, table, sh, pool, positions, slots, cos_sin, tables, lens,                     \
                      pd::carve(scratch, partials, sh), eps, scale, threads);                                    \
  }

PD_DECODE_LAYERS(f32, float)
PD_DECODE_LAYERS(bf16, pd::bf16)
