// Activations quantized per block as llama.cpp does before an integer dot product with weight blocks:
//   q8 (for 32-weight blocks, ggml's q8_0): d = amax / 127, q = round(x / d), one d per 32 values;
//   q8_K (for 256-weight super-blocks): d = max / -127 (max: the value of largest magnitude), q = round(x / d)
//   clamped to 127, one d per 256 values, and the sums of q per 16 values.
// Rounding is to nearest even. Each row of x is quantized once per projection, into a scratch laid out
// row after row (`ActRows`), and read by every weight row of it.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "common.h"

namespace pd::gguf {

struct ActRows {  // M rows of K activations
  int64_t K;
  float* x;          // [M, K] float32 (the input, widened where it is bfloat16)
  int8_t* q32;       // [M, K] q8 values
  float* d32;        // [M, K/32] their scales
  float* dsum32;     // [M, K/32] d * (sum of the block's q): the weight blocks' mins multiply it
  int32_t* sum32;    // [M, K/32] the sums themselves: a constant subtracted from the weights' quants meets them
  int8_t* q256;      // [M, K] q8_K values
  float* d256;       // [M, K/256]
  int16_t* bsum16;   // [M, K/16] sums of q8_K values per 16

  static int64_t bytes(int64_t M, int64_t K) {
    return M * (K * 4 + 2 * K + K / 32 * 12 + K / 256 * 4 + K / 16 * 2) + 64;
  }
  static ActRows carve(uint8_t* p, int64_t M, int64_t K) {
    ActRows a;
    a.K = K;
    a.x = reinterpret_cast<float*>(p);
    a.d32 = a.x + M * K;
    a.dsum32 = a.d32 + M * K / 32;
    a.sum32 = reinterpret_cast<int32_t*>(a.dsum32 + M * K / 32);
    a.d256 = reinterpret_cast<float*>(a.sum32 + M * K / 32);
    a.bsum16 = reinterpret_cast<int16_t*>(a.d256 + M * K / 256);
    a.q32 = reinterpret_cast<int8_t*>(a.bsum16 + M * K / 16);
    a.q256 = a.q32 + M * K;
    return a;
  }
};

inline int round_even(float v) { return int(std::nearbyint(v)); }  // NOTE: the default mode: nearest even

#if defined(__AVX2__)
inline float max_abs(const float* v, int n) {  // n: a multiple of 8
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(v + i), magnitude));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

inline int sum_lanes(__m256i v) {
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1)));
}

// q = round(v * inverse) for 32 values (saturating at +-127: never reached but by the largest one), and the
// sums of q over values 0-15 and 16-31.
inline void round32(const float* v, float inverse, int8_t* q, int* sum_low, int* sum_high) {
  const __m256 s = _mm256_set1_ps(inverse);
  __m256i i[4];
  for (int k = 0; k < 4; ++k) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * k), s));
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_max_epi8(ordered, _mm256_set1_epi8(-127)));
  *sum_low = sum_lanes(_mm256_add_epi32(i[0], i[1]));
  *sum_high = sum_lanes(_mm256_add_epi32(i[2], i[3]));
}

inline float largest(const float* v, int n, float amax) {  // the first value of magnitude amax
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), target = _mm256_set1_ps(amax);
  for (int i = 0; i < n; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(v + i), magnitude), target,
                                                     _CMP_EQ_OQ));
    if (hit) return v[i + __builtin_ctz(unsigned(hit))];
  }
  return 0.0f;
}
#else
inline float max_abs(const float* v, int n) {
  float m = 0.0f;
  for (int i = 0; i < n; ++i) m = std::fabs(v[i]) > m ? std::fabs(v[i]) : m;
  return m;
}

inline void round32(const float* v, float inverse, int8_t* q, int* sum_low, int* sum_high) {
  *sum_low = *sum_high = 0;
  for (int i = 0; i < 32; ++i) {
    const int r = round_even(v[i] * inverse);
    q[i] = int8_t(r > 127 ? 127 : r < -127 ? -127 : r);
    *(i < 16 ? sum_low : sum_high) += q[i];
  }
}

inline float largest(const float* v, int n, float amax) {
  for (int i = 0; i < n; ++i)
    if (std::fabs(v[i]) == amax) return v[i];
  return 0.0f;
}
#endif

inline void quantize_q8(const float* x, int64_t K, int8_t* q, float* d, float* dsum, int32_t* sum) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float amax = max_abs(x + 32 * b, 32);
    const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
    int low, high;
    round32(x + 32 * b, inverse, q + 32 * b, &low, &high);
    d[b] = scale;
    sum[b] = low + high;
    dsum[b] = scale * float(sum[b]);
  }
}

inline void quantize_q8_k(const float* x, int64_t K, int8_t* q, float* d, int16_t* bsum16) {
  for (int64_t b = 0; b < K / 256; ++b) {
    const float* v = x + 256 * b;
    const float amax = max_abs(v, 256);
    const float inverse = amax != 0.0f ? -127.0f / largest(v, 256, amax) : 0.0f;
    for (int g = 0; g < 8; ++g) {
      int low, high;
      round32(v + 32 * g, inverse, q + 256 * b + 32 * g, &low, &high);
      bsum16[16 * b + 2 * g] = int16_t(low);
      bsum16[16 * b + 2 * g + 1] = int16_t(high);
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
  if (need32) quantize_q8(row, K, a.q32 + m * K, a.d32 + m * K / 32, a.dsum32 + m * K / 32, a.sum32 + m * K / 32);
  if (need256)
    quantize_q8_k(row, K, a.q256 + m * K, a.d256 + m * K / 256, a.bsum16 + m * K / 16);
}

}  // namespace pd::gguf
