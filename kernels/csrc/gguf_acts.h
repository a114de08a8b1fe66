// Activations quantized per block as llama.cpp does before an integer dot product with weight blocks:
//   q8 (for 32-weight blocks, ggml's q8_0): d = amax / 127, q = round(x / d), one d per 32 values;
//   q8_K (for 256-weight super-blocks): d = max / -127 (max: the value of largest magnitude), q = round(x / d)
//   clamped to 127, one d per 256 values, and the sums of q per 16 values.
// Rounding is to nearest even. Each row of x is quantized once per projection, into a scratch laid out
// row after row (`ActRows`), and read by every weight row of it.
#pragma once
#include <cmath>
#include <cstdint>

#include "common.h"

namespace pd::gguf {

struct ActRows {  // M rows of K activations
  int64_t K;
  float* x;          // [M, K] float32 (the input, widened where it is bfloat16)
  int8_t* q32;       // [M, K] q8 values
  float* d32;        // [M, K/32] their scales
  float* dsum32;     // [M, K/32] d * (sum of the block's q): the weight blocks' offsets multiply it
  int8_t* q256;      // [M, K] q8_K values
  float* d256;       // [M, K/256]
  int16_t* bsum16;   // [M, K/16] sums of q8_K values per 16

  static int64_t bytes(int64_t M, int64_t K) {
    return M * (K * 4 + 2 * K + K / 32 * 8 + K / 256 * 4 + K / 16 * 2) + 64;
  }
  static ActRows carve(uint8_t* p, int64_t M, int64_t K) {
    ActRows a;
    a.K = K;
    a.x = reinterpret_cast<float*>(p);
    a.d32 = a.x + M * K;
    a.dsum32 = a.d32 + M * K / 32;
    a.d256 = a.dsum32 + M * K / 32;
    a.bsum16 = reinterpret_cast<int16_t*>(a.d256 + M * K / 256);
    a.q32 = reinterpret_cast<int8_t*>(a.bsum16 + M * K / 16);
    a.q256 = a.q32 + M * K;
    return a;
  }
};

inline int round_even(float v) { return int(std::nearbyint(v)); }  // NOTE: the default mode: nearest even

inline void quantize_q8(const float* x, int64_t K, int8_t* q, float* d, float* dsum) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* v = x + 32 * b;
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::fabs(v[i]) > amax ? std::fabs(v[i]) : amax;
    const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
      q[32 * b + i] = int8_t(round_even(v[i] * inverse));
      sum += q[32 * b + i];
    }
    d[b] = scale;
    dsum[b] = scale * float(sum);
  }
}

inline void quantize_q8_k(const float* x, int64_t K, int8_t* q, float* d, int16_t* bsum16) {
  for (int64_t b = 0; b < K / 256; ++b) {
    const float* v = x + 256 * b;
    float amax = 0.0f, max = 0.0f;
    for (int i = 0; i < 256; ++i)
      if (std::fabs(v[i]) > amax) {
        amax = std::fabs(v[i]);
        max = v[i];
      }
    const float inverse = amax != 0.0f ? -127.0f / max : 0.0f;
    for (int i = 0; i < 256; ++i) {
      const int r = round_even(inverse * v[i]);
      q[256 * b + i] = int8_t(r < 127 ? r : 127);
    }
    for (int g = 0; g < 16; ++g) {
      int sum = 0;
      for (int i = 0; i < 16; ++i) sum += q[256 * b + 16 * g + i];
      bsum16[16 * b + g] = int16_t(sum);
    }
    d[b] = amax != 0.0f ? 1.0f / inverse : 0.0f;
  }
}

// Row m of x (float32 or bfloat16) into `a`, in the formats `need32` / `need256` ask for.
template <typename T>
inline void quantize_row(const T* x, int64_t m, const ActRows& a, bool need32, bool need256) {
  const int64_t K = a.K;
  float* row = a.x + m * K;
  for (int64_t k = 0; k < K; ++k) row[k] = to_float(x[m * K + k]);
  if (need32) quantize_q8(row, K, a.q32 + m * K, a.d32 + m * K / 32, a.dsum32 + m * K / 32);
  if (need256)
    quantize_q8_k(row, K, a.q256 + m * K, a.d256 + m * K / 256, a.bsum16 + m * K / 16);
}

}  // namespace pd::gguf
