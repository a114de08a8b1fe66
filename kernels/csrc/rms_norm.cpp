// RMSNorm of rows of x (HF LlamaRMSNorm numerics), optionally after adding the residual:
// s = x + residual (rounded to T); out = weight * T(s * rsqrt(mean(s^2) + eps)).
#include "common.h"

namespace pd {

template <typename T>
static float sum_of_squares(const T* x, const T* residual, T* sum_out, int64_t hidden) {
  vf acc = splat(0.0f);
  int64_t i = 0;
  for (; i + LANES <= hidden; i += LANES) {
    vf s = load(x + i);
    if (residual) {
      s = vround<T>(s + load(residual + i));
      store(sum_out + i, s);
    }
    acc += s * s;
  }
  float total = hsum(acc);
  for (; i < hidden; ++i) {
    float s = to_float(x[i]);
    if (residual) {
      s = round_to<T>(s + to_float(residual[i]));
      sum_out[i] = from_float<T>(s);
    }
    total += s * s;
  }
  return total;
}

template <typename T>
static void rms_norm_row(const T* x, const T* residual, const T* weight, float eps, T* out, T* sum_out,
                         int64_t hidden) {
  float inv = 1.0f / std::sqrt(sum_of_squares(x, residual, sum_out, hidden) / float(hidden) + eps);
  const T* s = residual ? sum_out : x;
  int64_t i = 0;
  for (; i + LANES <= hidden; i += LANES) store(out + i, load(weight + i) * vround<T>(load(s + i) * inv));
  for (; i < hidden; ++i) out[i] = from_float<T>(to_float(weight[i]) * round_to<T>(to_float(s[i]) * inv));
}

template <typename T>
static void rms_norm(const T* x, int64_t x_stride, const T* residual, int64_t residual_stride, const T* weight,
                     float eps, T* out, T* sum_out, int64_t rows, int64_t hidden, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * hidden >= 65536)
  for (int64_t r = 0; r < rows; ++r)
    rms_norm_row(x + r * x_stride, residual ? residual + r * residual_stride : nullptr, weight, eps,
                 out + r * hidden, sum_out ? sum_out + r * hidden : nullptr, hidden);
}

}  // namespace pd

#define PD_RMS_NORM(SUFFIX, T)                                                                          \
  extern "C" void pd_rms_norm_##SUFFIX(const T* x, int64_t x_stride, const T* residual,                 \
                                       int64_t residual_stride, const T* weight, float eps, T* out,     \
                                       T* sum_out, int64_t rows, int64_t hidden, int threads) {         \
    pd::rms_norm(x, x_stride, residual, residual_stride, weight, eps, out, sum_out, rows, hidden, threads); \
  }

PD_RMS_NORM(f32, float)
PD_RMS_NORM(bf16, pd::bf16)
