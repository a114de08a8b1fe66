// The gated MLP activation: out[:, i] = T(T(silu(x[:, i])) * x[:, I + i]), as F.silu(gate) * up in T.
#include "common.h"

namespace pd {

template <typename T>
static void silu_and_mul_row(const T* x, T* out, int64_t inner) {
  int64_t i = 0;
  for (; i + LANES <= inner; i += LANES) {
    vf gate = load(x + i);
    vf silu = vround<T>(gate / (splat(1.0f) + vexp(-gate)));
    store(out + i, silu * load(x + inner + i));
  }
  for (; i < inner; ++i) {
    float gate = to_float(x[i]);
    out[i] = from_float<T>(round_to<T>(gate / (1.0f + std::exp(-gate))) * to_float(x[inner + i]));
  }
}

}  // namespace pd

#define PD_SILU_AND_MUL(SUFFIX, T)                                                                       \
  extern "C" void pd_silu_and_mul_##SUFFIX(const T* x, int64_t x_stride, T* out, int64_t rows,         \
                                           int64_t inner, int threads) {                                \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (rows * inner >= 65536)")         \
    for (int64_t r = 0; r < rows; ++r) pd::silu_and_mul_row(x + r * x_stride, out + r * inner, inner);   \
  }

PD_SILU_AND_MUL(f32, float)
PD_SILU_AND_MUL(bf16, pd::bf16)
