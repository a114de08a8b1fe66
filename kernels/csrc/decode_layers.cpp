// Every decoder layer of a decode step (one new token per sequence) in one call: the same kernels
// the per-op path calls, in the same order on the same buffers, so the numbers are identical; what
// goes is the Python between them (~10 kernel calls a layer, each with its checks and allocations).
// A projection is dense (the native linear), quantized (quant_linear.c, called by address) or GGUF
// blocks (gguf_linear.cpp).
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
                             float*, float*, float*, const int64_t*, float, float, const float*, int);
void pd_decode_attention_bf16(const pd::bf16*, const pd::bf16*, const int64_t*, int64_t, const int32_t*,
                              const int32_t*, pd::bf16*, float*, float*, const int64_t*, float, float, const float*,
                              int);
void pd_silu_and_mul_f32(const float*, int64_t, float*, int64_t, int64_t, int);
void pd_silu_and_mul_bf16(const pd::bf16*, int64_t, pd::bf16*, int64_t, int64_t, int);
int pd_gguf_linear(const int64_t*, int64_t, int64_t, const void*, int, int64_t, void*, int);
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

// quant_linear.c's entry point (another library; its address comes with the step).
typedef int (*QuantLinear)(int fmt, int tile_rows, const uint8_t* q, const float* d, const float* m,
                           const float* channel_scales, const void* x, int bf16, void* y, int M, int N, int K,
                           int threads);
constexpr int QUANT_TILE_ROWS = 4;
constexpr int64_t GGUF_FORMAT = 100;  // NOTE: GGUF_FORMAT in native_decode_layers.py

// A projection: dense (format 0: weight and bias of T), quantized (format f + 1 of quant_linear.c's
// formats: its tiled blocks, block scales and mins, channel scales; bias of T) or GGUF blocks (GGUF_FORMAT:
// weight is gguf_linear's segment table, block_scales holds the number of segments). Null pointers: absent.
struct Projection {
  int64_t format;
  const void *weight, *bias, *block_scales, *mins, *channel_scales;
};

// One layer's parameters, in the order of the table the Python side builds.
template <typename T> struct LayerWeights {
  const T *input_norm, *post_norm;
  Projection qkv, o, gate_up, down;
};
static_assert(sizeof(Projection) == 6 * sizeof(int64_t) && sizeof(LayerWeights<float>) == 26 * sizeof(int64_t),
              "the table's layout: WORDS_PER_PROJECTION and WORDS_PER_LAYER in native_decode_layers.py");

struct StepShape {  // the int64 array the Python side passes, field for field
  int64_t seqs, hidden, q_heads, kv_heads, head_dim, inner, layers, splits;
  int64_t block_size, pool_block, pool_layer, pool_kv, pool_slot, pool_head, table_stride, cos_sin_stride;
  int64_t first_layer_has_residual, window;  // window: every layer's sliding window (0: none)
};

// y[M, N] = x[M, K] @ W^T + bias, x and y contiguous. Returns quant_linear's status (0: done).
template <typename T>
static int project(const Projection& p, const T* x, T* y, int64_t M, int64_t N, int64_t K, QuantLinear quant,
                   int threads) {
  if (p.format == 0) {
    Ops<T>::linear(x, K, static_cast<const T*>(p.weight), static_cast<const T*>(p.bias), y, N, M, N, K, threads);
    return 0;
  }
  const int status = p.format == GGUF_FORMAT
      ? pd_gguf_linear(static_cast<const int64_t*>(p.weight), reinterpret_cast<int64_t>(p.block_scales), K, x,
                       sizeof(T) == 2, M, y, threads)
      : quant(int(p.format - 1), QUANT_TILE_ROWS, static_cast<const uint8_t*>(p.weight),
                           static_cast<const float*>(p.block_scales), static_cast<const float*>(p.mins),
                           static_cast<const float*>(p.channel_scales), x, sizeof(T) == 2, y, int(M), int(N), int(K),
                           threads);
  if (p.bias)  // NOTE: as the per-op path's y.add_(bias): one rounding to T
    for (int64_t i = 0; i < M * N; ++i)
      y[i] = from_float<T>(to_float(y[i]) + to_float(static_cast<const T*>(p.bias)[i % N]));
  return status;
}

template <typename T> struct Scratch {  // [seqs, width] each, laid out one after the other
  T *normed, *qkv, *q, *attention, *gate_up, *act;
  float *partials, *lses;
};

template <typename T>
static int attention_block(const LayerWeights<T>& w, const StepShape& sh, T* h, const Scratch<T>& s,
                           T* layer_pool, const int32_t* positions, const int32_t* slots, const float* cos_sin,
                           const int32_t* tables, const int32_t* lens, float scale, QuantLinear quant, int threads) {
  const int64_t q_size = sh.q_heads * sh.head_dim, kv_size = sh.kv_heads * sh.head_dim;
  const int64_t qkv_width = q_size + 2 * kv_size;
  int status = project(w.qkv, s.normed, s.qkv, sh.seqs, qkv_width, sh.hidden, quant, threads);
  const int64_t rotary[16] = {sh.seqs, sh.q_heads, sh.kv_heads, sh.head_dim, qkv_width, sh.head_dim,
                              qkv_width, sh.head_dim, qkv_width, sh.head_dim, sh.cos_sin_stride, sh.block_size,
                              sh.pool_block, sh.pool_kv, sh.pool_slot, sh.pool_head};
  Ops<T>::rotary_store(s.qkv, s.qkv + q_size, s.qkv + q_size + kv_size, positions, cos_sin, layer_pool, slots, s.q,
                       rotary, threads);
  const int64_t strides[4] = {sh.pool_block, sh.pool_kv, sh.pool_slot, sh.pool_head};
  const int64_t attention[11] = {sh.seqs, sh.q_heads, sh.kv_heads, sh.head_dim, sh.splits,
                                 q_size, sh.head_dim, q_size, sh.head_dim, sh.table_stride, sh.window};
  Ops<T>::attention(s.q, layer_pool, strides, sh.block_size, tables, lens, s.attention, s.partials, s.lses,
                    attention, scale, 0.0f, nullptr, threads);
  return status | project(w.o, s.attention, h, sh.seqs, sh.hidden, q_size, quant, threads);
}

template <typename T>
static int mlp_block(const LayerWeights<T>& w, const StepShape& sh, T* h, const Scratch<T>& s, QuantLinear quant,
                     int threads) {
  const int64_t width = 2 * sh.inner;
  int status = project(w.gate_up, s.normed, s.gate_up, sh.seqs, width, sh.hidden, quant, threads);
  Ops<T>::silu_and_mul(s.gate_up, width, s.act, sh.seqs, sh.inner, threads);
  return status | project(w.down, s.act, h, sh.seqs, sh.hidden, sh.inner, quant, threads);
}

// h [S, hidden]: in, the embeddings (or the last layer's output); out, the last layer's output.
// residual [S, hidden]: the running residual sum, in (when first_layer_has_residual) and out.
template <typename T>
static int decode_layers(T* h, T* residual, const int64_t* table, const StepShape& sh, T* pool,
                         const int32_t* positions, const int32_t* slots, const float* cos_sin, const int32_t* tables,
                         const int32_t* lens, const Scratch<T>& s, float eps, float scale, QuantLinear quant,
                         int threads) {
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
    if (attention_block(w, sh, h, s, pool + layer * sh.pool_layer, positions, slots, cos_sin, tables, lens, scale,
                        quant, threads))
      return -1;
    Ops<T>::rms_norm(h, sh.hidden, residual, sh.hidden, w.post_norm, eps, s.normed, residual, sh.seqs, sh.hidden,
                     threads);
    if (mlp_block(w, sh, h, s, quant, threads)) return -1;
  }
  return 0;
}

// The model's final norm of the last layer's output, and its head: logits [S, head_rows] float32 (the head's
// output in T, widened, as the per-op path's `.float()`).
template <typename T>
static int final_head(T* h, T* residual, const StepShape& sh, const T* final_norm, const int64_t* head,
                      int64_t head_rows, T* head_out, float* logits, const Scratch<T>& s, float eps,
                      QuantLinear quant, int threads) {
  Ops<T>::rms_norm(h, sh.hidden, residual, sh.hidden, final_norm, eps, s.normed, residual, sh.seqs, sh.hidden,
                   threads);
  Projection p;
  std::memcpy(&p, head, sizeof p);
  if (project(p, s.normed, head_out, sh.seqs, head_rows, sh.hidden, quant, threads)) return -1;
  const int64_t n = sh.seqs * head_rows;
#pragma omp parallel for num_threads(threads) schedule(static) if (n >= 65536)
  for (int64_t i = 0; i < n; ++i) logits[i] = to_float(head_out[i]);
  return 0;
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

// Returns 0, or -1 when quant_linear refused a projection (the Python side checked them: a bug). With
// final_norm, the step goes on through the final norm and the head into logits (see final_head).
#define PD_DECODE_LAYERS(SUFFIX, T)                                                                             \
  extern "C" int pd_decode_layers_##SUFFIX(T* h, T* residual, const int64_t* table, const int64_t* shape, T* pool, \
                                           const int32_t* positions, const int32_t* slots, const float* cos_sin,   \
                                           const int32_t* tables, const int32_t* lens, T* scratch,                \
                                           float* partials, float eps, float scale, pd::QuantLinear quant,        \
                                           int threads, const T* final_norm, const int64_t* head,                 \
                                           int64_t head_rows, T* head_out, float* logits) {                       \
    pd::StepShape sh;                                                                                            \
    std::memcpy(&sh, shape, sizeof sh);                                                                          \
    const pd::Scratch<T> s = pd::carve(scratch, partials, sh);                                                   \
    if (pd::decode_layers(h, residual, table, sh, pool, positions, slots, cos_sin, tables, lens, s, eps, scale,  \
                          quant, threads))                                                                       \
      return -1;                                                                                                 \
    if (!final_norm) return 0;                                                                                   \
    return pd::final_head(h, residual, sh, final_norm, head, head_rows, head_out, logits, s, eps, quant,         \
                          threads);                                                                              \
  }

PD_DECODE_LAYERS(f32, float)
PD_DECODE_LAYERS(bf16, pd::bf16)
