// Rows of GGUF weight blocks as float32 or bfloat16 values: the embedding's gather (rows by token id) and
// the dequantized tile a prefill-sized matmul multiplies (consecutive rows). float32 values are bit-equal
// to gguf.quants.dequantize (the scale of a group, then one multiply and one add, never fused); bfloat16
// ones are those rounded to nearest even. With AVX2 a sub-block's 32 quants come from gguf_decode.h's
// decoders, widened 8 at a time; elsewhere each block goes through gguf_blocks.h's scalar decode.
#pragma GCC optimize("fp-contract=off")
#include "gguf_decode.h"

namespace pd::gguf {

#if defined(__AVX2__)
inline void put8(float* out, __m256 v) { _mm256_storeu_ps(out, v); }
inline void put8(bf16* out, __m256 v) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), (__m128i)_mm256_cvtneps_pbh(v));
#else
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
  for (int i = 0; i < 8; ++i) out[i] = from_float<bf16>(f[i]);
#endif
}

// 32 weights: their quants (int8 where `is_signed`, else uint8 less `bias`), groups of `group` sharing a scale.
template <typename Y>
inline void sub_block(__m256i q, bool is_signed, int bias, const float* scale, const float* offset, int group,
                      bool has_offset, Y* out) {
  alignas(32) uint8_t bytes[32];
  _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), q);
  for (int c = 0; c < 4; ++c) {
    const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8 * c));
    __m256i ints = is_signed ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
    if (bias) ints = _mm256_sub_epi32(ints, _mm256_set1_epi32(bias));
    const int g = 8 * c / group;
    __m256 w = _mm256_mul_ps(_mm256_set1_ps(scale[g]), _mm256_cvtepi32_ps(ints));
    if (has_offset) w = _mm256_add_ps(w, _mm256_set1_ps(offset[g]));
    put8(out + 8 * c, w);
  }
}

template <class W, typename Y>
inline void super_block(const W& w, bool is_signed, int bias, const float* scale, const float* offset, int group,
                        bool has_offset, Y* out) {
  for (int sb = 0; sb < 8; ++sb) {
    const int g = group == 16 ? 2 * sb : sb;
    sub_block(w.quants(sb), is_signed, bias, scale + g, offset + g, group, has_offset, out + 32 * sb);
  }
}

template <Type T, typename Y>
static void block_row(const uint8_t* row, int64_t K, Y* out) {
  constexpr Layout l = layout(T);
  constexpr int bias = T == Q4_0 ? 8 : T == Q5_0 ? 16 : T == Q6_K ? 32 : 0;
  constexpr bool is_signed = T == Q8_0 || T == IQ4_NL || T == IQ4_XS;
  constexpr bool has_offset = T == Q4_1 || T == Q5_1 || T == Q4_K || T == Q5_K;
  float scale[16], offset[16];
  for (int64_t b = 0; b < K / l.block; ++b) {
    const uint8_t* block = row + b * l.bytes;
    decode(T, block, nullptr, scale, offset);
    Y* at = out + b * l.block;
    if constexpr (l.block == 32)
      sub_block(Block32<T>{block}.quants(), is_signed, bias, scale, offset, 32, has_offset, at);
    else if constexpr (T == Q6_K)
      super_block(BlockQ6K(block), is_signed, bias, scale, offset, l.group, has_offset, at);
    else if constexpr (T == IQ4_XS)
      super_block(BlockIQ4XS(block), is_signed, bias, scale, offset, l.group, has_offset, at);
    else
      super_block(BlockK<T>(block), is_signed, bias, scale, offset, l.group, has_offset, at);
  }
}
#endif

template <typename Y>
static void dequantize_row(int64_t type, const uint8_t* row, int64_t K, Y* out) {
  if (is_dense(type)) {
    for (int64_t k = 0; k < K; ++k) out[k] = from_float<Y>(dense_at(type, row, k));
    return;
  }
#if defined(__AVX2__)
  switch (type) {
#define PD_GGUF_CASE(T) \
  case T: return block_row<T>(row, K, out);
    PD_GGUF_CASE(Q4_0) PD_GGUF_CASE(Q4_1) PD_GGUF_CASE(Q5_0) PD_GGUF_CASE(Q5_1) PD_GGUF_CASE(Q8_0)
    PD_GGUF_CASE(IQ4_NL) PD_GGUF_CASE(Q4_K) PD_GGUF_CASE(Q5_K) PD_GGUF_CASE(Q6_K) PD_GGUF_CASE(IQ4_XS)
#undef PD_GGUF_CASE
    default: break;
  }
#endif
  const Layout l = layout(type);
  alignas(64) float values[256];
  for (int64_t b = 0; b < K / l.block; ++b) {
    dequantize_block(type, row + b * l.bytes, values);
    for (int i = 0; i < l.block; ++i) out[b * l.block + i] = from_float<Y>(values[i]);
  }
}

template <typename Y>
static void dequantize_rows(int64_t type, const uint8_t* data, int64_t row_bytes, const int64_t* ids, int64_t first,
                            int64_t count, int64_t K, Y* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (count * K >= (1 << 16))
  for (int64_t i = 0; i < count; ++i)
    dequantize_row(type, data + (ids ? ids[i] : first + i) * row_bytes, K, out + i * K);
}

}  // namespace pd::gguf

// out[i, :] = row ids[i] (or first + i where ids is null) of the blocks at `data`; returns -1 for a type
// these kernels do not take or rows that do not hold K weights.
extern "C" int pd_gguf_dequantize(int64_t type, const uint8_t* data, int64_t row_bytes, const int64_t* ids,
                                  int64_t first, int64_t count, int64_t K, void* out, int bf16, int threads) {
  const pd::gguf::Layout l = pd::gguf::layout(type);
  if (!l.block || K % l.block || row_bytes != K / l.block * l.bytes) return -1;
  if (bf16)
    pd::gguf::dequantize_rows(type, data, row_bytes, ids, first, count, K, static_cast<pd::bf16*>(out), threads);
  else
    pd::gguf::dequantize_rows(type, data, row_bytes, ids, first, count, K, static_cast<float*>(out), threads);
  return 0;
}
