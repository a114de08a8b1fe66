// GGUF (llama.cpp) weight blocks as they lie in the file: their types, sizes, and each block decoded to
// integers with a float scale and offset per group (w = scale * q + offset), the arithmetic of
// gguf.quants' dequantization (scale products first, then one multiply and one add: no fused
// multiply-add, so a dequantized weight is bit-equal to gguf's). Type numbers are ggml's.
#pragma once
#include <cstdint>
#include <cstring>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "common.h"

namespace pd::gguf {

enum Type : int64_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23, BF16 = 30,
};

struct Layout {
  int block;  // weights per block (0: not a type these kernels take)
  int bytes;  // bytes per block
  int group;  // weights sharing one scale and offset
};

constexpr Layout layout(int64_t type) {
  switch (type) {
    case F32: return {1, 4, 1};
    case F16: case BF16: return {1, 2, 1};
    case Q4_0: return {32, 18, 32};
    case Q4_1: return {32, 20, 32};
    case Q5_0: return {32, 22, 32};
    case Q5_1: return {32, 24, 32};
    case Q8_0: return {32, 34, 32};
    case IQ4_NL: return {32, 18, 32};
    case Q4_K: return {256, 144, 32};
    case Q5_K: return {256, 176, 32};
    case Q6_K: return {256, 210, 16};
    case IQ4_XS: return {256, 136, 32};
    default: return {0, 0, 0};
  }
}

constexpr bool is_k_type(int64_t type) { return layout(type).block == 256; }
constexpr bool is_dense(int64_t type) { return type == F32 || type == F16 || type == BF16; }

constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa) {  // subnormal: mantissa * 2^-24, exact in float
    float f = float(mantissa) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  } else {
    bits = sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);  // NOTE: exact, as half_to_float
#else
  return half_to_float(h);
#endif
}

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int* scale, int* min) {
  if (j < 4) {
    *scale = q[j] & 63;
    *min = q[j + 4] & 63;
  } else {
    *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

inline int iq4_xs_scale(const uint8_t* b, int j) {  // the signed 6-bit scale of sub-block j
  uint16_t high;
  std::memcpy(&high, b + 2, 2);
  return (((b[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((high >> (2 * j)) & 3) << 4)) - 32;
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")  // NOTE: gguf.quants rounds each product and sum on its own
// Block `b` of `type`: q[layout.block] integers (unless q is null), scale[g] and offset[g] per group of
// layout.group.
inline void decode(int64_t type, const uint8_t* b, int* q, float* scale, float* offset) {
  switch (type) {
    case Q4_0: case Q4_1: case IQ4_NL: {
      const float d = half_at(b);
      scale[0] = d;
      offset[0] = type == Q4_1 ? half_at(b + 2) : 0.0f;
      const uint8_t* qs = b + (type == Q4_1 ? 4 : 2);
      for (int j = 0; q && j < 16; ++j) {
        int lo = qs[j] & 0xF, hi = qs[j] >> 4;
        q[j] = type == IQ4_NL ? IQ4_VALUES[lo] : type == Q4_0 ? lo - 8 : lo;
        q[j + 16] = type == IQ4_NL ? IQ4_VALUES[hi] : type == Q4_0 ? hi - 8 : hi;
      }
      return;
    }
    case Q5_0: case Q5_1: {
      const bool has_min = type == Q5_1;
      scale[0] = half_at(b);
      offset[0] = has_min ? half_at(b + 2) : 0.0f;
      uint32_t high;
      std::memcpy(&high, b + (has_min ? 4 : 2), 4);
      const uint8_t* qs = b + (has_min ? 8 : 6);
      for (int j = 0; q && j < 16; ++j) {
        int lo = (qs[j] & 0xF) | (((high >> j) & 1) << 4), hi = (qs[j] >> 4) | (((high >> (j + 16)) & 1) << 4);
        q[j] = has_min ? lo : lo - 16;
        q[j + 16] = has_min ? hi : hi - 16;
      }
      return;
    }
    case Q8_0:
      scale[0] = half_at(b);
      offset[0] = 0.0f;
      for (int j = 0; q && j < 32; ++j) q[j] = int8_t(b[2 + j]);
      return;
    case Q4_K: case Q5_K: {
      const float d = half_at(b), dmin = half_at(b + 2);
      const uint8_t* qs = b + (type == Q5_K ? 48 : 16);
      for (int j = 0; j < 8; ++j) {
        int sc, m;
        scale_min_k4(j, b + 4, &sc, &m);
        scale[j] = d * float(sc);
        offset[j] = -(dmin * float(m));
        for (int l = 0; q && l < 32; ++l) {
          int v = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0xF;
          q[32 * j + l] = type == Q5_K ? v | (((b[16 + l] >> j) & 1) << 4) : v;
        }
      }
      return;
    }
    case Q6_K: {
      const float d = half_at(b + 208);
      for (int g = 0; g < 16; ++g) {
        scale[g] = d * float(int8_t(b[192 + g]));
        offset[g] = 0.0f;
      }
      for (int half = 0; q && half < 2; ++half) {
        const uint8_t *ql = b + 64 * half, *qh = b + 128 + 32 * half;
        for (int l = 0; l < 32; ++l) {
          int* out = q + 128 * half + l;
          out[0] = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
          out[32] = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
          out[64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
          out[96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        }
      }
      return;
    }
    case IQ4_XS: {
      const float d = half_at(b);
      for (int j = 0; j < 8; ++j) {
        scale[j] = d * float(iq4_xs_scale(b, j));
        offset[j] = 0.0f;
        const uint8_t* qs = b + 8 + 16 * j;
        for (int l = 0; q && l < 16; ++l) {
          q[32 * j + l] = IQ4_VALUES[qs[l] & 0xF];
          q[32 * j + l + 16] = IQ4_VALUES[qs[l] >> 4];
        }
      }
      return;
    }
    default: return;
  }
}

// Block `b` of a quantized type as float32 weights (bit-equal to gguf.quants.dequantize).
inline void dequantize_block(int64_t type, const uint8_t* b, float* out) {
  const Layout l = layout(type);
  int q[256];
  float scale[16], offset[16];
  decode(type, b, q, scale, offset);
  for (int i = 0; i < l.block; ++i) {
    const float scaled = scale[i / l.group] * float(q[i]);
    out[i] = scaled + offset[i / l.group];
  }
}

#pragma GCC pop_options

// Element k of a dense row (F32, F16, BF16) as float32.
inline float dense_at(int64_t type, const uint8_t* row, int64_t k) {
  if (type == F32) {
    float f;
    std::memcpy(&f, row + 4 * k, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, row + 2 * k, 2);
  return type == F16 ? half_to_float(h) : to_float(bf16(h));
}

}  // namespace pd::gguf
