// Dot products of R weight rows (GGUF blocks) with MT quantized activation rows, integer arithmetic inside
// a block: out[m][r] = sum over blocks of (d_w * d_x * integer dot + offset terms).
// 32-weight blocks against q8: per block, the 32 byte products summed into 8 int32 lanes (vpdpbusd where
// the CPU has AVX512_VNNI or AVX-VNNI, else vpmaddubsw + vpmaddwd), scaled once in float32.
// K types against q8_K: per super-block, each sub-block's pair products (vpmaddubsw) times its integer
// scale summed in int32 (vpdpwssd where there is VNNI, else vpmaddwd + add), scaled once in float32;
// offsets (mins, Q6_K's -32) go through the activations' sums per 16. Signed weights (Q8_0, IQ4) take
// the sign of the weight onto the activation so that the unsigned x signed product applies.
// Elsewhere (no AVX2) each block is dequantized and multiplied in float32 against the dequantized q8.
#pragma once
#include "gguf_acts.h"
#include "gguf_decode.h"

namespace pd::gguf {

#if defined(__AVX2__)
inline __m256i dot_bytes(__m256i u, __m256i s) {  // 8 lanes, each the sum of 4 products u8 x s8
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline __m256i add_scaled(__m256i acc, __m256i pairs, __m256i scale) {  // acc += pairwise pairs * scale
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, pairs, scale);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, pairs, scale);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, scale));
#endif
}

// Each weight row stream is prefetched this far ahead (into L2): a tile's rows are short and contiguous, so
// that is a few tiles on, which the hardware prefetcher, seeing R interleaved streams, does not fetch soon enough.
#ifndef PD_GGUF_AHEAD
#define PD_GGUF_AHEAD 16384
#endif
inline void prefetch_ahead(const uint8_t* p) { __builtin_prefetch(p + PD_GGUF_AHEAD, 0, 2); }

inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// rows[r]: weight row r's first block; x rows m0.. of `a`; blocks: per row. A BIAS subtracted from the quants
// is applied in int32 (8 lanes sum to the block: BIAS / 8 * the activations' sum from each); a min in float.
template <Type T, int R, int MT>
inline void tile32(const uint8_t* const* rows, int64_t blocks, const ActRows& a, int64_t m0, float* out) {
  using W = Block32<T>;
  static_assert(W::BIAS % 8 == 0, "a bias spread evenly over 8 lanes");
  const int64_t K = a.K;
  __m256 acc[R][MT];
  float mins[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps(), mins[r][m] = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i x[MT], bias[MT];
    __m256 dx[MT];
    for (int m = 0; m < MT; ++m) {
      const int64_t at = (m0 + m) * (K / 32) + b;
      x[m] = load32(reinterpret_cast<const uint8_t*>(a.q32 + (m0 + m) * K + 32 * b));
      dx[m] = _mm256_set1_ps(a.d32[at]);
      if (W::BIAS) bias[m] = _mm256_set1_epi32(W::BIAS / 8 * a.sum32[at]);
    }
    for (int r = 0; r < R; ++r) {
      const W w{rows[r] + b * W::BYTES};
      prefetch_ahead(w.b);
      const __m256i q = w.quants();
      const __m256 d = _mm256_set1_ps(w.d());
      const float min = W::HAS_MIN ? w.min() : 0.0f;
      for (int m = 0; m < MT; ++m) {
        __m256i p = W::SIGNED ? dot_bytes(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x[m], q)) : dot_bytes(q, x[m]);
        if (W::BIAS) p = _mm256_sub_epi32(p, bias[m]);
        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(d, dx[m]), acc[r][m]);
        if (W::HAS_MIN) mins[r][m] += min * a.dsum32[(m0 + m) * (K / 32) + b];
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) out[m * R + r] = hsum8(acc[r][m]) + mins[r][m];
}

template <class W, int R, int MT>
inline void tile_k(const uint8_t* const* rows, int64_t blocks, const ActRows& a, int64_t m0, float* out) {
  const int64_t K = a.K;
  __m256 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    W w[R];
    for (int r = 0; r < R; ++r) {
      w[r] = W(rows[r] + b * W::BYTES);
      for (int line = 0; line < W::BYTES; line += 64) prefetch_ahead(w[r].b + line);
    }
    __m256i sums[R][MT];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) sums[r][m] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int sb = 0; sb < 8; ++sb) {
      __m256i x[MT];
      for (int m = 0; m < MT; ++m)
        x[m] = load32(reinterpret_cast<const uint8_t*>(a.q256 + (m0 + m) * K + 256 * b + 32 * sb));
      for (int r = 0; r < R; ++r) {
        const __m256i q = w[r].quants(sb), scale = w[r].scale(sb);
        for (int m = 0; m < MT; ++m) {
          const __m256i pairs = W::SIGNED ? _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x[m], q))
                                          : _mm256_maddubs_epi16(q, x[m]);
          sums[r][m] = add_scaled(sums[r][m], pairs, scale);
        }
      }
    }
    for (int m = 0; m < MT; ++m) {
      const float dx = a.d256[(m0 + m) * (K / 256) + b];
      const int16_t* bsum16 = a.bsum16 + (m0 + m) * (K / 16) + 16 * b;
      for (int r = 0; r < R; ++r) {
        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][m]), _mm256_set1_ps(w[r].d() * dx), acc[r][m]);
        if (W::HAS_OFFSET)
          acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(w[r].offsets(bsum16)),
                                      _mm256_set1_ps(w[r].offset_scale() * dx), acc[r][m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) out[m * R + r] = hsum8(acc[r][m]);
}

template <Type T, int R, int MT>
inline void tile(const uint8_t* const* rows, int64_t blocks, const ActRows& a, int64_t m0, float* out) {
  if constexpr (T == Q4_K || T == Q5_K) tile_k<BlockK<T>, R, MT>(rows, blocks, a, m0, out);
  else if constexpr (T == Q6_K) tile_k<BlockQ6K, R, MT>(rows, blocks, a, m0, out);
  else if constexpr (T == IQ4_XS) tile_k<BlockIQ4XS, R, MT>(rows, blocks, a, m0, out);
  else tile32<T, R, MT>(rows, blocks, a, m0, out);
}

#else  // portable: blocks dequantized, against the dequantized activations

template <Type T, int R, int MT>
inline void tile(const uint8_t* const* rows, int64_t blocks, const ActRows& a, int64_t m0, float* out) {
  constexpr Layout l = layout(T);
  const int64_t K = a.K;
  float w[256];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) {
      float sum = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        dequantize_block(T, rows[r] + b * l.bytes, w);
        for (int i = 0; i < l.block; ++i) {
          const int64_t k = b * l.block + i;
          sum += w[i] * (l.block == 256 ? a.d256[(m0 + m) * (K / 256) + k / 256] * a.q256[(m0 + m) * K + k]
                                        : a.d32[(m0 + m) * (K / 32) + k / 32] * a.q32[(m0 + m) * K + k]);
        }
      }
      out[m * R + r] = sum;
    }
}

#endif

// Dense rows (F32, F16, BF16) against the float32 activations.
inline void dense_tile(int64_t type, const uint8_t* row, const ActRows& a, int64_t m0, int MT, float* out) {
  for (int m = 0; m < MT; ++m) {
    const float* x = a.x + (m0 + m) * a.K;
    float sum = 0.0f;
    for (int64_t k = 0; k < a.K; ++k) sum += dense_at(type, row, k) * x[k];
    out[m] = sum;
  }
}

}  // namespace pd::gguf
