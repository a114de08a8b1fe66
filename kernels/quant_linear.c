/* Weight-only quantized linear on CPU: y[M, N] = x[M, K] @ dequant(W)^T, dequantized on the fly.
 *
 * Formats (rows of W are output features; every block holds 32 consecutive weights of one row;
 * d and m are GGUF's f16 values held as float32):
 *   INT8_CHANNEL  q int8 [N, K], one scale per row: w = q * s[n]      (applied to the row's dot product)
 *   Q8_0          q int8 [N, K], d per block:   w = d * q
 *   Q4_0          nibbles [N, K/2], d per block: w = d * (q - 8)
 *   Q4_1          nibbles [N, K/2], d, m per block: w = d * q + m
 * A 4-bit block stores element j in the low nibble of byte j and element j + 16 in its high nibble
 * (GGUF's layout). Rows are interleaved by tiles of ROWS: block b of rows 4t..4t+3 lie side by side,
 * as do their d and m, so a tile reads each array as one sequential stream (quant_linear.py writes
 * this layout; rows past N are zero padding). Block weights are dequantized exactly as gguf.quants
 * does (q * d is exact in fp32; one rounding for + m), so the result differs from F.linear on the
 * dequantized weight only by the order of the fp32 sums. Activations are fp32 or bf16 (computed in
 * fp32, rounded once on output).
 * Built for the running CPU (-march=native): AVX-512 and AVX2 code paths.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float f32x16 __attribute__((vector_size(64)));
enum { INT8_CHANNEL = 0, Q8_0 = 1, Q4_0 = 2, Q4_1 = 3 };
#define ROWS 4  /* weight rows per tile: they share each load of x */

typedef struct {
  const uint8_t* q;
  const float* d;
  const float* m;
  size_t block_bytes;
  int blocks;  /* per row */
} weights;

static inline f32x16 load(const float* p) { f32x16 v; memcpy(&v, p, 64); return v; }

static inline float sum_lanes(f32x16 v) {
  float s = 0;
  for (int i = 0; i < 16; i++) s += v[i];
  return s;
}

#if defined(__AVX512F__)
static inline f32x16 i8_to_f32(__m128i v) { return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }
static inline f32x16 u8_to_f32(__m128i v) { return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }
#else
static inline f32x16 join(__m256 lo, __m256 hi) {
  f32x16 r;
  memcpy(&r, &lo, 32);
  memcpy((char*)&r + 32, &hi, 32);
  return r;
}
static inline f32x16 i8_to_f32(__m128i v) {
  return join(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)),
              _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))));
}
static inline f32x16 u8_to_f32(__m128i v) {
  return join(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)),
              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))));
}
#endif

/* block b of row n: lo holds its elements 0..15, hi 16..31; Q8_0 unscaled unless `scaled` */
static inline size_t block_at(const weights* w, int n, int b) {
  return ((size_t)(n / ROWS) * w->blocks + b) * ROWS + n % ROWS;
}

static inline void dequant_block(int fmt, const weights* w, int n, int b, int scaled, f32x16* lo, f32x16* hi) {
  size_t at = block_at(w, n, b);
  const uint8_t* q = w->q + at * w->block_bytes;
  if (fmt == INT8_CHANNEL || fmt == Q8_0) {
    *lo = i8_to_f32(_mm_loadu_si128((const __m128i*)q));
    *hi = i8_to_f32(_mm_loadu_si128((const __m128i*)(q + 16)));
    if (fmt == Q8_0 && scaled) {
      *lo *= w->d[at];
      *hi *= w->d[at];
    }
    return;
  }
  float d = w->d[at], m = fmt == Q4_1 ? w->m[at] : -8.0f * d;
#if defined(__AVX512F__)
  /* the block's 16 values in a table; permutexvar reads only the low 4 bits of each index */
  __m512 table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                 _mm512_set1_ps(d), _mm512_set1_ps(m));
  __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
  *lo = (f32x16)_mm512_permutexvar_ps(bytes, table);
  *hi = (f32x16)_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
#else
  __m128i v = _mm_loadu_si128((const __m128i*)q), nibble = _mm_set1_epi8(15);
  *lo = u8_to_f32(_mm_and_si128(v, nibble)) * d + m;
  *hi = u8_to_f32(_mm_and_si128(_mm_srli_epi16(v, 4), nibble)) * d + m;
#endif
}

/* out[j * ROWS + i] = dot(x row j, W row n0 + i) for XROWS rows of x */
#define DEFINE_TILE(FMT, XROWS)                                                                  \
  static void tile_##FMT##_##XROWS(const weights* w, int n0, const float* x, int K, float* out) { \
    f32x16 acc[ROWS][XROWS];                                                                     \
    int row[ROWS];                                                                               \
    for (int i = 0; i < ROWS; i++) {                                                             \
      row[i] = n0 + i;                                                                           \
      for (int j = 0; j < XROWS; j++) acc[i][j] = (f32x16){0};                                   \
    }                                                                                            \
    const int late = FMT == Q8_0 && XROWS == 1;  /* scale the block's dot product, not its weights */ \
    for (int b = 0; b < w->blocks; b++) {                                                        \
      f32x16 lo[ROWS], hi[ROWS];                                                                 \
      for (int i = 0; i < ROWS; i++) dequant_block(FMT, w, row[i], b, !late, &lo[i], &hi[i]);   \
      for (int j = 0; j < XROWS; j++) {                                                          \
        f32x16 xl = load(x + (size_t)j * K + 32 * b), xh = load(x + (size_t)j * K + 32 * b + 16); \
        for (int i = 0; i < ROWS; i++) {                                                         \
          f32x16 dot = lo[i] * xl + hi[i] * xh;                                                  \
          acc[i][j] += late ? dot * w->d[block_at(w, row[i], b)] : dot;                           \
        }                                                                                        \
      }                                                                                          \
    }                                                                                            \
    for (int i = 0; i < ROWS; i++)                                                               \
      for (int j = 0; j < XROWS; j++) out[j * ROWS + i] = sum_lanes(acc[i][j]);                  \
  }
#define DEFINE_FORMAT(FMT) DEFINE_TILE(FMT, 1) DEFINE_TILE(FMT, 2) DEFINE_TILE(FMT, 4)
DEFINE_FORMAT(0)
DEFINE_FORMAT(1)
DEFINE_FORMAT(2)
DEFINE_FORMAT(3)

typedef void (*tile_fn)(const weights*, int, const float*, int, float*);
static const tile_fn TILES[4][3] = {{tile_0_1, tile_0_2, tile_0_4}, {tile_1_1, tile_1_2, tile_1_4},
                                    {tile_2_1, tile_2_2, tile_2_4}, {tile_3_1, tile_3_2, tile_3_4}};

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, quiet NaN */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static void to_f32(const void* x, int bf16, size_t count, float* out) {
  if (!bf16) {
    memcpy(out, x, count * 4);
    return;
  }
  const uint16_t* h = x;
  for (size_t i = 0; i < count; i++) {
    uint32_t u = (uint32_t)h[i] << 16;
    memcpy(out + i, &u, 4);
  }
}

static void store_tile(void* y, int bf16, int N, int m0, int xrows, int n0, const float* out,
                       const float* channel_scales) {
  for (int j = 0; j < xrows; j++)
    for (int i = 0; i < ROWS && n0 + i < N; i++) {
      float v = out[j * ROWS + i] * (channel_scales ? channel_scales[n0 + i] : 1.0f);
      size_t at = (size_t)(m0 + j) * N + n0 + i;
      if (bf16) ((uint16_t*)y)[at] = f32_to_bf16(v);
      else ((float*)y)[at] = v;
    }
}

/* Returns 0, or -1 for a bad argument (tile rows other than ROWS, K % 32 != 0, unknown format, out of memory). */
int quant_linear(int fmt, int tile_rows, const uint8_t* q, const float* d, const float* m,
                 const float* channel_scales, const void* x, int bf16, void* y, int M, int N, int K,
                 int threads) {
  if (fmt < 0 || fmt > 3 || tile_rows != ROWS || K % 32 || M < 1 || N < 1) return -1;
  weights w = {q, d, m, fmt == Q4_0 || fmt == Q4_1 ? 16 : 32, K / 32};
  float* xf = malloc((size_t)M * K * sizeof(float));
  if (!xf) return -1;
  to_f32(x, bf16, (size_t)M * K, xf);
  const float* scales = fmt == INT8_CHANNEL ? channel_scales : NULL;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int n0 = 0; n0 < N; n0 += ROWS) {
    float out[ROWS * 4];
    for (int m0 = 0; m0 < M;) {
      int left = M - m0, xrows = left >= 4 ? 4 : left >= 2 ? 2 : 1;
      TILES[fmt][xrows / 2](&w, n0, xf + (size_t)m0 * K, K, out);
      store_tile(y, bf16, N, m0, xrows, n0, out, scales);
      m0 += xrows;
    }
  }
  free(xf);
  return 0;
}
