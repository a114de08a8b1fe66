// GGUF weight blocks unpacked into 32 bytes a sub-block (AVX2 registers), for the integer dot products of
// gguf_dot.h. A decoder wraps one block (K types: a 256-weight super-block) of one weight row:
//   quants(sb)  the 32 weights of sub-block sb as bytes: unsigned (the offset is applied through the
//               activations' sums) or, for SIGNED types, int8;
//   d()         the block's float scale; 32-weight types also BIAS (w = d * (q - BIAS)) or, with HAS_MIN,
//               min() (w = d * q + min);
//   K types:    scale(sb), 16 int16 multipliers of sub-block sb's pair products (its integer scale), and
//               offsets(bsum16) (int32 lanes summing to the offset's dot product with the activation sums,
//               which offset_scale() multiplies).
#pragma once
#include <immintrin.h>

#include "gguf_blocks.h"

#if defined(__AVX2__)
namespace pd::gguf {

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0xF)); }
inline __m256i high_nibbles(__m256i v) { return low_nibbles(_mm256_srli_epi16(v, 4)); }
inline __m256i split_nibbles(const uint8_t* p) {  // byte j: elements j (low nibble) and j + 16 (high)
  const __m128i t = load16(p);
  return low_nibbles(_mm256_set_m128i(_mm_srli_epi16(t, 4), t));
}
inline __m256i bits_to_bytes(const uint8_t* p, int value) {  // byte i: `value` where bit i of p is set, else 0
  uint32_t bits;
  std::memcpy(&bits, p, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_maskz_mov_epi8(__mmask32(bits), _mm256_set1_epi8(char(value)));
#endif
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(bits)), _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                        _mm256_set1_epi64x(-1));
  return _mm256_and_si256(set, _mm256_set1_epi8(char(value)));
}
inline __m256i iq4_lookup(__m256i nibbles) {
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(IQ4_VALUES));
  return _mm256_shuffle_epi8(_mm256_set_m128i(table, table), nibbles);
}
inline __m256i pair_broadcast(int16_t low, int16_t high) {  // lanes 0-7: low, 8-15: high
  return _mm256_set_m128i(_mm_set1_epi16(high), _mm_set1_epi16(low));
}

// --- 32-weight blocks -------------------------------------------------------------------------------
template <Type T> struct Block32 {
  static constexpr int BYTES = layout(T).bytes;
  static constexpr bool SIGNED = T == Q8_0 || T == IQ4_NL;
  static constexpr bool HAS_MIN = T == Q4_1 || T == Q5_1;
  static constexpr int BIAS = T == Q4_0 ? 8 : T == Q5_0 ? 16 : 0;
  const uint8_t* b;
  float d() const { return half_at(b); }
  float min() const { return half_at(b + 2); }
  __m256i quants() const {
    if constexpr (T == Q4_0) return split_nibbles(b + 2);
    if constexpr (T == Q4_1) return split_nibbles(b + 4);
    if constexpr (T == Q5_0) return _mm256_or_si256(split_nibbles(b + 6), bits_to_bytes(b + 2, 16));
    if constexpr (T == Q5_1) return _mm256_or_si256(split_nibbles(b + 8), bits_to_bytes(b + 4, 16));
    if constexpr (T == Q8_0) return load32(b + 2);
    return iq4_lookup(split_nibbles(b + 2));  // IQ4_NL
  }
};

// --- 256-weight super-blocks --------------------------------------------------------------------------
inline __m128i k4_scales_and_mins(const uint8_t* p) {  // bytes 0-7: the 6-bit scales, 8-15: the mins
  uint32_t u[4];
  std::memcpy(u, p, 12);
  const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
  u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4);
  const uint32_t mins_low = u[1] & low6;
  u[1] = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);
  u[2] = mins_low;
  u[0] &= low6;
  return _mm_set_epi32(int(u[3]), int(u[2]), int(u[1]), int(u[0]));
}

template <Type T> struct BlockK {  // Q4_K, Q5_K
  static constexpr int BYTES = layout(T).bytes;
  static constexpr bool SIGNED = false, HAS_OFFSET = true;
  const uint8_t* b;
  alignas(16) int16_t scales[8];
  __m256i mins;  // [m0, m0, m1, m1, ...]: against the sums per 16
  BlockK() = default;
  explicit BlockK(const uint8_t* block) : b(block) {
    const __m128i sm = k4_scales_and_mins(block + 4);
    _mm_store_si128(reinterpret_cast<__m128i*>(scales), _mm_cvtepu8_epi16(sm));
    const __m128i m = _mm_srli_si128(sm, 8);
    mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m));
  }
  float d() const { return half_at(b); }
  float offset_scale() const { return -half_at(b + 2); }
  __m256i scale(int sb) const { return _mm256_set1_epi16(scales[sb]); }
  __m256i offsets(const int16_t* bsum16) const { return _mm256_madd_epi16(mins, _mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(bsum16))); }
  __m256i quants(int sb) const {
    const __m256i packed = load32(b + (T == Q5_K ? 48 : 16) + 32 * (sb / 2));
    const __m256i q = sb % 2 ? high_nibbles(packed) : low_nibbles(packed);
    if constexpr (T == Q4_K) return q;
    const __m256i high = _mm256_srl_epi16(load32(b + 16), _mm_cvtsi32_si128(sb));
    return _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(high, _mm256_set1_epi8(1)), 4));
  }
};

struct BlockQ6K {
  static constexpr int BYTES = 210;
  static constexpr bool SIGNED = false, HAS_OFFSET = true;
  const uint8_t* b;
  alignas(32) int16_t scales[16];
  BlockQ6K() = default;
  explicit BlockQ6K(const uint8_t* block) : b(block) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(scales), _mm256_cvtepi8_epi16(load16(block + 192)));
  }
  float d() const { return half_at(b + 208); }
  float offset_scale() const { return -32.0f * d(); }
  __m256i scale(int sb) const {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m256i pick = _mm256_set_m128i(_mm_set1_epi16(short(2 * sb + 1)), _mm_set1_epi16(short(2 * sb)));
    return _mm256_permutexvar_epi16(pick, _mm256_load_si256(reinterpret_cast<const __m256i*>(scales)));
#else
    return pair_broadcast(scales[2 * sb], scales[2 * sb + 1]);
#endif
  }
  __m256i offsets(const int16_t* bsum16) const {
    return _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(scales)),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsum16)));
  }
  __m256i quants(int sb) const {  // values 0..63 (the weight is d * scale * (q - 32))
    const int half = sb / 4, g = sb % 4;
    const __m256i low = load32(b + 64 * half + 32 * (g & 1));
    const __m256i high = _mm256_srl_epi16(load32(b + 128 + 32 * half), _mm_cvtsi32_si128(2 * g));
    return _mm256_or_si256(g < 2 ? low_nibbles(low) : high_nibbles(low),
                           _mm256_slli_epi16(_mm256_and_si256(high, _mm256_set1_epi8(3)), 4));
  }
};

struct BlockIQ4XS {
  static constexpr int BYTES = 136;
  static constexpr bool SIGNED = true, HAS_OFFSET = false;
  const uint8_t* b;
  BlockIQ4XS() = default;
  explicit BlockIQ4XS(const uint8_t* block) : b(block) {}
  float d() const { return half_at(b); }
  float offset_scale() const { return 0.0f; }
  __m256i scale(int sb) const { return _mm256_set1_epi16(int16_t(iq4_xs_scale(b, sb))); }
  __m256i offsets(const int16_t*) const { return _mm256_setzero_si256(); }
  __m256i quants(int sb) const { return iq4_lookup(split_nibbles(b + 8 + 16 * sb)); }
};

}  // namespace pd::gguf
#endif
