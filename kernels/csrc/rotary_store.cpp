// Neox rotary embedding of q and k fused with the KV store: the rotated q goes to q_out, the rotated
// k and v go straight into the paged pool at each token's slot (slot -1 skips the store).
// Numerics as kernels/rotary.py: every product and sum rounded to T.
#include "common.h"

namespace pd {

struct RotaryShape {
  int64_t tokens, q_heads, kv_heads, head_dim;
  int64_t q_token_stride, q_head_stride, k_token_stride, k_head_stride, v_token_stride, v_head_stride;
  int64_t cos_sin_stride, block_size, pool_block_stride, pool_kv_stride, pool_slot_stride, pool_head_stride;
};

template <typename T>
static inline void rotate(const T* x, const float* cos, const float* sin, int64_t half, T* out) {
  for (int64_t i = 0; i < half; ++i) {
    float c = round_to<T>(cos[i]), s = round_to<T>(sin[i]);
    float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    out[i] = from_float<T>(round_to<T>(x1 * c) - round_to<T>(x2 * s));
    out[i + half] = from_float<T>(round_to<T>(x2 * c) + round_to<T>(x1 * s));
  }
}

template <typename T>
static void rotary_token(const T* q, const T* k, const T* v, const int32_t* positions, const float* cos_sin,
                         T* layer_pool, const int32_t* slots, T* q_out, const RotaryShape& sh, int64_t t) {
  const int64_t half = sh.head_dim / 2;
  const float* cos = cos_sin + int64_t(positions[t]) * sh.cos_sin_stride;
  for (int64_t h = 0; h < sh.q_heads; ++h)
    rotate(q + t * sh.q_token_stride + h * sh.q_head_stride, cos, cos + half, half,
           q_out + (t * sh.q_heads + h) * sh.head_dim);
  const int64_t at = slots[t];
  if (at < 0) return;
  T* slot = layer_pool + at / sh.block_size * sh.pool_block_stride + at % sh.block_size * sh.pool_slot_stride;
  for (int64_t h = 0; h < sh.kv_heads; ++h) {
    T* key = slot + h * sh.pool_head_stride;
    rotate(k + t * sh.k_token_stride + h * sh.k_head_stride, cos, cos + half, half, key);
    std::memcpy(key + sh.pool_kv_stride, v + t * sh.v_token_stride + h * sh.v_head_stride, sh.head_dim * sizeof(T));
  }
}

}  // namespace pd

#define PD_ROTARY_STORE(SUFFIX, T)                                                                        \
  extern "C" void pd_rotary_store_##SUFFIX(const T* q, const T* k, const T* v, const int32_t* positions,   \
                                           const float* cos_sin, T* layer_pool, const int32_t* slots,     \
                                           T* q_out, const int64_t* shape, int threads) {                 \
    pd::RotaryShape sh;                                                                                   \
    std::memcpy(&sh, shape, sizeof sh);                                                                   \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (sh.tokens >= 64)")                \
    for (int64_t t = 0; t < sh.tokens; ++t) pd::rotary_token(q, k, v, positions, cos_sin, layer_pool, slots, q_out, sh, t); \
  }

PD_ROTARY_STORE(f32, float)
PD_ROTARY_STORE(bf16, pd::bf16)
