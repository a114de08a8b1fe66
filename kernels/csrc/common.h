// Shared by the native CPU kernels: 16-lane float vectors (GCC vector extensions: AVX-512 where the
// compiling CPU has it, split into AVX2/SSE otherwise) and float32/bfloat16 element access.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>

namespace pd {

constexpr int LANES = 16;
typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint16_t bf16;  // bfloat16 bits

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T> inline T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline bf16 from_float<bf16>(float x) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16((u >> 16) | 0x40);  // NaN stays NaN
  return bf16((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Round a float32 value to T's precision and back (bf16 models round between ops like torch does).
template <typename T> inline float round_to(float x) { return to_float(from_float<T>(x)); }

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf load(const bf16* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline vf splat(float x) { return vf{} + x; }

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline void store(bf16* p, vf v) {  // round to nearest even; NaN stays NaN
  vu u;
  std::memcpy(&u, &v, sizeof u);
  vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  rounded = (u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded;
  vh h = __builtin_convertvector(rounded, vh);
  std::memcpy(p, &h, sizeof h);
}

// Round 16 float32 lanes to T's precision and back.
template <typename T> inline vf vround(vf v) {
  T tmp[LANES];
  store(tmp, v);
  return load(tmp);
}

inline float hsum(vf v) {  // in registers: a stored zmm reloaded as halves would stall store forwarding
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  v8 s8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
          __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

typedef float v8f __attribute__((vector_size(32)));

// The sums of 8 vectors at once (a transposing add tree: 24 shuffles and adds instead of 8 hsums).
inline v8f hsum8(const vf* v) {
  vf u[4], w[2];
  for (int i = 0; i < 4; ++i)
    u[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    w[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(u[2 * i], u[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  vf x = __builtin_shufflevector(w[0], w[1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         __builtin_shufflevector(w[0], w[1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(x, x, 0, 2, 4, 6, 8, 10, 12, 14) + __builtin_shufflevector(x, x, 1, 3, 5, 7, 9, 11, 13, 15);
}

inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < LANES; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// Rows [begin, end) of `total`, split evenly over the team in multiples of `align`.
inline void team_range(int64_t total, int64_t align, int64_t* begin, int64_t* end) {
  int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
  int64_t units = (total + align - 1) / align;
  int64_t per = units / team, extra = units % team;
  int64_t first = me * per + (me < extra ? me : extra);
  int64_t count = per + (me < extra ? 1 : 0);
  *begin = first * align < total ? first * align : total;
  *end = (first + count) * align < total ? (first + count) * align : total;
}

}  // namespace pd

namespace pd {

typedef int32_t vi __attribute__((vector_size(64)));

// e^x for 16 lanes (Cephes' expf: 2^n * p(r), relative error < 2e-7); lanes at -inf give 0.
inline vf vexp(vf x) {
  vf clamped = x < splat(-87.0f) ? splat(-87.0f) : x;
  clamped = clamped > splat(88.0f) ? splat(88.0f) : clamped;
  vf y = clamped * 1.44269504088896341f + 0.5f;
  vi n = __builtin_convertvector(y, vi);
  n = __builtin_convertvector(n, vf) > y ? n - 1 : n;  // floor
  vf fn = __builtin_convertvector(n, vf);
  vf r = clamped - fn * 0.693359375f + fn * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vi bits = (n + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  p = p * scale;
  return x == splat(-INFINITY) ? splat(0.0f) : p;
}

}  // namespace pd
