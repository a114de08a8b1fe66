// y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) for few rows M (decode): each thread streams its own
// contiguous share of the weight rows once, against every row of x (held in cache).
// One row of x: one weight row at a time, a purely sequential stream with software prefetch; bfloat16
// where the CPU has AVX512_BF16 takes the tiles at one row instead (below).
// More rows: tiles of R weight rows x up to 8 rows of x, R chosen by the rows of x so that the
// accumulators fill the registers, K unrolled where they are few; each of the R row streams is
// prefetched TILE_AHEAD_BYTES ahead (past its row's end: the same row of the next tile). bfloat16 tiles
// multiply with vdpbf16ps where the CPU has AVX512_BF16 (no widening of w or x).
#include <immintrin.h>

#include "common.h"

namespace pd {

constexpr int TILE_M = 8;
constexpr int64_t PREFETCH_AHEAD = 1024;  // elements ahead on the one-row stream
constexpr int64_t TILE_AHEAD_BYTES = 4096;  // bytes ahead on each row stream of a tile

// Prefetches go to L2 (prefetcht1): into L1 (prefetcht0) a tile's streams ran slower than the one-row
// stream, into L2 as fast or faster (bench/RESULTS.md, "Measured once"). The one-row stream of bfloat16
// measured no better in L2 and keeps L1.
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }
inline void prefetch_row(const float* p) { prefetch_l2(p); }
inline void prefetch_row(const bf16* p) { __builtin_prefetch(p, 0, 3); }

template <typename T>
static inline float dot(const T* w, const T* x, int64_t K) {
  vf a0 = splat(0.0f), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 4 * LANES <= K; k += 4 * LANES) {
    for (int i = 0; i < 4; ++i) prefetch_row(w + k + PREFETCH_AHEAD + i * LANES);
    a0 += load(w + k) * load(x + k);
    a1 += load(w + k + LANES) * load(x + k + LANES);
    a2 += load(w + k + 2 * LANES) * load(x + k + 2 * LANES);
    a3 += load(w + k + 3 * LANES) * load(x + k + 3 * LANES);
  }
  for (; k + LANES <= K; k += LANES) a0 += load(w + k) * load(x + k);
  float sum = hsum((a0 + a1) + (a2 + a3));
  for (; k < K; ++k) sum += to_float(w[k]) * to_float(x[k]);
  return sum;
}

template <typename T>
static void gemv_rows(const T* x, const T* w, const T* bias, T* y, int64_t begin, int64_t end, int64_t K) {
  for (int64_t n = begin; n < end; ++n)
    y[n] = from_float<T>(dot(w + n * K, x, K) + (bias ? to_float(bias[n]) : 0.0f));
}

// A tile's step along K: 64 bytes of a weight row against a row of x, into 16 float lanes.
template <typename T> struct Step {  // float32; bfloat16 without AVX512_BF16 (widened on load)
  static constexpr int64_t WIDTH = LANES;
  typedef vf Vec;
  static Vec get(const T* p) { return load(p); }
  static vf madd(vf acc, Vec w, Vec x) { return acc + w * x; }
};
#ifdef __AVX512BF16__
template <> struct Step<bf16> {  // lane i += w[2i] x[2i] + w[2i+1] x[2i+1], exact products, float32 sums
  static constexpr int64_t WIDTH = 2 * LANES;
  typedef __m512bh Vec;
  static Vec get(const bf16* p) {
    Vec v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static vf madd(vf acc, Vec w, Vec x) { return _mm512_dpbf16_ps(acc, w, x); }
};
#endif

// Whether one row of x goes through the tiles rather than the one-row stream: bfloat16 with vdpbf16ps, which
// multiplies without widening and sums four weight rows' lanes at once; the one-row stream widens every
// load and sums each row's lanes alone, and it ran slower than the tiles and than BLAS (bench/RESULTS.md,
// "Linear: few rows, and one bfloat16 row").
template <typename T> constexpr bool ONE_ROW_TILES = false;
#ifdef __AVX512BF16__
template <> constexpr bool ONE_ROW_TILES<bf16> = true;
#endif

// Weight rows per tile for m rows of x (more than TILE_M: TILE_M's): a tile holds U * R * m
// accumulators and U * R weight vectors, within the 32 vector registers.
constexpr int tile_rows(int64_t m) { return m <= 6 ? 4 : 3; }
// K unrolled so that a tile keeps at least 8 independent accumulators (FMA latency x throughput).
constexpr int k_unroll(int accumulators) { return accumulators >= 8 ? 1 : accumulators >= 4 ? 2 : 4; }

// R weight rows (w, bias, y already offset to the first) against MT rows of x.
template <typename T, int R, int MT>
static inline void linear_tile(const T* x, int64_t ldx, const T* w, int64_t K, const T* bias, T* y, int64_t ldy,
                               bool prefetch) {
  using S = Step<T>;
  constexpr int U = k_unroll(R * MT);
  constexpr int64_t ahead = TILE_AHEAD_BYTES / sizeof(T);
  vf acc[U][R][MT] = {};
  int64_t k = 0;
  for (; k + U * S::WIDTH <= K; k += U * S::WIDTH) {
    const T* next = w + k + ahead + (k + ahead < K ? 0 : (R - 1) * K);  // row r's stream: next + r * K
    typename S::Vec wv[U][R];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) {
        wv[u][r] = S::get(w + r * K + k + u * S::WIDTH);
        if (prefetch) prefetch_l2(next + r * K + u * S::WIDTH);
      }
    for (int i = 0; i < MT; ++i)
      for (int u = 0; u < U; ++u) {
        const typename S::Vec xv = S::get(x + i * ldx + k + u * S::WIDTH);
        for (int r = 0; r < R; ++r) acc[u][r][i] = S::madd(acc[u][r][i], wv[u][r], xv);
      }
  }
  for (; k + S::WIDTH <= K; k += S::WIDTH)
    for (int i = 0; i < MT; ++i) {
      const typename S::Vec xv = S::get(x + i * ldx + k);
      for (int r = 0; r < R; ++r) acc[0][r][i] = S::madd(acc[0][r][i], S::get(w + r * K + k), xv);
    }
  for (int r = 0; r < R; ++r) {
    vf lanes[TILE_M] = {};
    for (int i = 0; i < MT; ++i)
      for (int u = 0; u < U; ++u) lanes[i] += acc[u][r][i];
    const v8f sums = hsum8(lanes);
    for (int i = 0; i < MT; ++i) {
      float sum = sums[i];
      for (int64_t tail = k; tail < K; ++tail) sum += to_float(w[r * K + tail]) * to_float(x[i * ldx + tail]);
      y[i * ldy + r] = from_float<T>(sum + (bias ? to_float(bias[r]) : 0.0f));
    }
  }
}

// R weight rows against all M rows of x, TILE_M at a time (the later ones find the rows in cache).
template <typename T, int R>
static void linear_rows(const T* x, int64_t ldx, const T* w, int64_t K, const T* bias, T* y, int64_t ldy,
                        int64_t M) {
  bool prefetch = true;
  for (int64_t m = 0; m < M; m += TILE_M, prefetch = false) {
    const T* xm = x + m * ldx;
    T* ym = y + m * ldy;
    switch (M - m >= TILE_M ? TILE_M : M - m) {
      case 8: linear_tile<T, R, 8>(xm, ldx, w, K, bias, ym, ldy, prefetch); break;
      case 7: linear_tile<T, R, 7>(xm, ldx, w, K, bias, ym, ldy, prefetch); break;
      case 6: linear_tile<T, R, 6>(xm, ldx, w, K, bias, ym, ldy, prefetch); break;
      case 5: linear_tile<T, R, 5>(xm, ldx, w, K, bias, ym, ldy, prefetch); break;
      case 4: linear_tile<T, R, 4>(xm, ldx, w, K, bias, ym, ldy, prefetch); break;
      case 3: linear_tile<T, R, 3>(xm, ldx, w, K, bias, ym, ldy, prefetch); break;
      case 2: linear_tile<T, R, 2>(xm, ldx, w, K, bias, ym, ldy, prefetch); break;
      case 1: linear_tile<T, R, 1>(xm, ldx, w, K, bias, ym, ldy, prefetch); break;
    }
  }
}

// Weight rows [begin, end) in tiles of R rows, the last few one row at a time.
template <typename T, int R>
static void linear_range(const T* x, int64_t ldx, const T* w, const T* bias, T* y, int64_t ldy, int64_t M,
                         int64_t K, int64_t begin, int64_t end) {
  int64_t n = begin;
  for (; n + R <= end; n += R) linear_rows<T, R>(x, ldx, w + n * K, K, bias ? bias + n : nullptr, y + n, ldy, M);
  for (; n < end; ++n) linear_rows<T, 1>(x, ldx, w + n * K, K, bias ? bias + n : nullptr, y + n, ldy, M);
}

template <typename T, int R>
static void linear_team(const T* x, int64_t ldx, const T* w, const T* bias, T* y, int64_t ldy, int64_t M,
                        int64_t N, int64_t K, int threads) {
#pragma omp parallel num_threads(threads)
  {
    int64_t begin, end;
    team_range(N, R, &begin, &end);  // whole tiles; coarser units split small N unevenly
    if (M == 1 && !ONE_ROW_TILES<T>)
      gemv_rows(x, w, bias, y, begin, end, K);
    else
      linear_range<T, R>(x, ldx, w, bias, y, ldy, M, K, begin, end);
  }
}

template <typename T>
static void linear(const T* x, int64_t ldx, const T* w, const T* bias, T* y, int64_t ldy, int64_t M, int64_t N,
                   int64_t K, int threads) {
  if (tile_rows(M) == 4)
    linear_team<T, 4>(x, ldx, w, bias, y, ldy, M, N, K, threads);
  else
    linear_team<T, 3>(x, ldx, w, bias, y, ldy, M, N, K, threads);
}

}  // namespace pd

extern "C" {
void pd_linear_f32(const float* x, int64_t ldx, const float* w, const float* bias, float* y, int64_t ldy,
                   int64_t M, int64_t N, int64_t K, int threads) {
  pd::linear(x, ldx, w, bias, y, ldy, M, N, K, threads);
}
void pd_linear_bf16(const pd::bf16* x, int64_t ldx, const pd::bf16* w, const pd::bf16* bias, pd::bf16* y,
                    int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
  pd::linear(x, ldx, w, bias, y, ldy, M, N, K, threads);
}
}
