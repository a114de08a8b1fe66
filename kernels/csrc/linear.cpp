// y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) for few rows M (decode): each thread streams its own
// contiguous share of the weight rows once, against every row of x (held in cache).
// One row of x: one weight row at a time, a purely sequential stream with software prefetch.
// More rows: tiles of 3 weight rows x up to 8 rows of x (24 accumulators), and while a tile
// computes, the next tile's weight rows are prefetched, so memory and arithmetic overlap.
#include "common.h"

namespace pd {

constexpr int TILE_N = 3, TILE_M = 8;
constexpr int64_t PREFETCH_AHEAD = 1024;  // elements ahead on the sequential stream

template <typename T>
static inline float dot(const T* w, const T* x, int64_t K) {
  vf a0 = splat(0.0f), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 4 * LANES <= K; k += 4 * LANES) {
    for (int i = 0; i < 4; ++i) __builtin_prefetch(w + k + PREFETCH_AHEAD + i * LANES);
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

// R weight rows (w, bias, y already offset to the first) against MT rows of x; prefetches `next`.
template <typename T, int R, int MT>
static inline void linear_tile(const T* x, int64_t ldx, const T* w, int64_t K, const T* bias, T* y,
                               int64_t ldy, const T* next) {
  vf acc[R][MT] = {};
  int64_t k = 0;
  for (; k + LANES <= K; k += LANES) {
    vf wv[R];
    for (int r = 0; r < R; ++r) {
      wv[r] = load(w + r * K + k);
      if (next) __builtin_prefetch(next + r * K + k);
    }
    for (int i = 0; i < MT; ++i) {
      vf xv = load(x + i * ldx + k);
      for (int r = 0; r < R; ++r) acc[r][i] += wv[r] * xv;
    }
  }
  for (int r = 0; r < R; ++r) {
    vf lanes[TILE_M] = {};
    for (int i = 0; i < MT; ++i) lanes[i] = acc[r][i];
    const v8f sums = hsum8(lanes);
    for (int i = 0; i < MT; ++i) {
      float sum = sums[i];
      for (int64_t tail = k; tail < K; ++tail) sum += to_float(w[r * K + tail]) * to_float(x[i * ldx + tail]);
      y[i * ldy + r] = from_float<T>(sum + (bias ? to_float(bias[r]) : 0.0f));
    }
  }
}

template <typename T, int R>
static void linear_rows(const T* x, int64_t ldx, const T* w, int64_t K, const T* bias, T* y, int64_t ldy,
                        int64_t M, const T* next) {
  for (int64_t m = 0; m < M; m += TILE_M, next = nullptr) {
    const T* xm = x + m * ldx;
    T* ym = y + m * ldy;
    switch (M - m >= TILE_M ? TILE_M : M - m) {
      case 8: linear_tile<T, R, 8>(xm, ldx, w, K, bias, ym, ldy, next); break;
      case 7: linear_tile<T, R, 7>(xm, ldx, w, K, bias, ym, ldy, next); break;
      case 6: linear_tile<T, R, 6>(xm, ldx, w, K, bias, ym, ldy, next); break;
      case 5: linear_tile<T, R, 5>(xm, ldx, w, K, bias, ym, ldy, next); break;
      case 4: linear_tile<T, R, 4>(xm, ldx, w, K, bias, ym, ldy, next); break;
      case 3: linear_tile<T, R, 3>(xm, ldx, w, K, bias, ym, ldy, next); break;
      case 2: linear_tile<T, R, 2>(xm, ldx, w, K, bias, ym, ldy, next); break;
      case 1: linear_tile<T, R, 1>(xm, ldx, w, K, bias, ym, ldy, next); break;
    }
  }
}

template <typename T>
static void linear(const T* x, int64_t ldx, const T* w, const T* bias, T* y, int64_t ldy, int64_t M,
                   int64_t N, int64_t K, int threads) {
#pragma omp parallel num_threads(threads)
  {
    int64_t begin, end;
    team_range(N, TILE_N * LANES, &begin, &end);
    if (M == 1) {
      gemv_rows(x, w, bias, y, begin, end, K);
    } else {
      int64_t n = begin;
      for (; n + TILE_N <= end; n += TILE_N) {
        const T* next = n + 2 * TILE_N <= end ? w + (n + TILE_N) * K : nullptr;
        linear_rows<T, TILE_N>(x, ldx, w + n * K, K, bias ? bias + n : nullptr, y + n, ldy, M, next);
      }
      for (; n < end; ++n) linear_rows<T, 1>(x, ldx, w + n * K, K, bias ? bias + n : nullptr, y + n, ldy, M, nullptr);
    }
  }
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
