// y[M, N] = x[M, K] @ W^T straight from GGUF weight blocks, W being one or more segments of rows, each
// of its own type (a fused q/k/v or gate/up projection whose parts llama-quantize typed differently).
// x (float32 or bfloat16) is quantized once per call, per block (gguf_acts.h); each thread then streams
// its share of the weight rows, R rows at a time against up to MT rows of x (gguf_dot.h).
#include <vector>

#include "gguf_dot.h"

namespace pd::gguf {

struct Segment {  // the int64 words the Python side passes, four per segment
  int64_t type, rows;
  const uint8_t* data;  // rows x row_bytes, blocks in file order
  int64_t row_bytes;
};

#ifndef PD_GGUF_MT
#define PD_GGUF_MT 4
#endif
#ifndef PD_GGUF_R_MANY
#if defined(__AVX512VL__)
#define PD_GGUF_R_MANY 4  // 32 vector registers hold 4 x 4 accumulators
#else
#define PD_GGUF_R_MANY 2
#endif
#endif
constexpr int MT = PD_GGUF_MT;  // rows of x per tile
constexpr int R_ONE = 4;  // weight rows per tile against one row of x
constexpr int R_MANY = PD_GGUF_R_MANY;

template <typename Y> inline void put(Y* y, int64_t at, float v) { y[at] = from_float<Y>(v); }

// y[m, column + i] for rows [first, last) of segment `s`, every row m of x.
template <Type T, int R, typename Y>
static void segment_rows(const Segment& s, int64_t first, int64_t last, const ActRows& a, int64_t M, Y* y,
                         int64_t N, int64_t column) {
  const int64_t blocks = a.K / layout(T).block;
  float out[MT * R];
  int64_t n = first;
  auto run = [&](auto rows_c, auto mt_c, int64_t m0) {
    constexpr int RR = decltype(rows_c)::value, MM = decltype(mt_c)::value;
    const uint8_t* rows[RR];
    for (int r = 0; r < RR; ++r) rows[r] = s.data + (n + r) * s.row_bytes;
    tile<T, RR, MM>(rows, blocks, a, m0, out);
    for (int m = 0; m < MM; ++m)
      for (int r = 0; r < RR; ++r) put(y, (m0 + m) * N + column + n + r, out[m * RR + r]);
  };
  auto all_m = [&](auto rows_c) {
    int64_t m0 = 0;
    for (; m0 + MT <= M; m0 += MT) run(rows_c, std::integral_constant<int, MT>{}, m0);
    switch (M - m0) {
      case 3: run(rows_c, std::integral_constant<int, 3>{}, m0); break;
      case 2: run(rows_c, std::integral_constant<int, 2>{}, m0); break;
      case 1: run(rows_c, std::integral_constant<int, 1>{}, m0); break;
      default: break;
    }
  };
  for (; n + R <= last; n += R) all_m(std::integral_constant<int, R>{});
  for (; n < last; ++n) all_m(std::integral_constant<int, 1>{});
}

template <typename Y>
static void dense_rows(const Segment& s, int64_t first, int64_t last, const ActRows& a, int64_t M, Y* y,
                       int64_t N, int64_t column) {
  float out[1];
  for (int64_t n = first; n < last; ++n)
    for (int64_t m = 0; m < M; ++m) {
      dense_tile(s.type, s.data + n * s.row_bytes, a, m, 1, out);
      put(y, m * N + column + n, out[0]);
    }
}

template <typename Y>
static bool rows_of(const Segment& s, int64_t first, int64_t last, const ActRows& a, int64_t M, Y* y, int64_t N,
                    int64_t column) {
  const bool one = M == 1;
  switch (s.type) {
#define PD_GGUF_CASE(T)                                                                           \
  case T:                                                                                         \
    one ? segment_rows<T, R_ONE>(s, first, last, a, M, y, N, column)                              \
        : segment_rows<T, R_MANY>(s, first, last, a, M, y, N, column);                            \
    return true;
    PD_GGUF_CASE(Q4_0) PD_GGUF_CASE(Q4_1) PD_GGUF_CASE(Q5_0) PD_GGUF_CASE(Q5_1) PD_GGUF_CASE(Q8_0)
    PD_GGUF_CASE(IQ4_NL) PD_GGUF_CASE(Q4_K) PD_GGUF_CASE(Q5_K) PD_GGUF_CASE(Q6_K) PD_GGUF_CASE(IQ4_XS)
#undef PD_GGUF_CASE
    case F32: case F16: case BF16:
      dense_rows(s, first, last, a, M, y, N, column);
      return true;
    default:
      return false;
  }
}

static bool valid(const Segment* segs, int64_t count, int64_t K) {
  for (int64_t i = 0; i < count; ++i) {
    const Layout l = layout(segs[i].type);
    if (!l.block || K % l.block || segs[i].row_bytes != K / l.block * l.bytes || segs[i].rows < 0) return false;
  }
  return count > 0 && K > 0;
}

constexpr int64_t OWN_ROWS = 4;  // up to this many rows of x, each thread quantizes them all (no barrier)

template <typename X>
static ActRows quantized(const X* x, int64_t M, int64_t K, bool need32, bool need256) {
  thread_local std::vector<uint8_t> scratch;
  scratch.resize(size_t(ActRows::bytes(M, K)));
  const ActRows a = ActRows::carve(scratch.data(), M, K);
  for (int64_t m = 0; m < M; ++m) quantize_row(x, m, a, need32, need256);
  return a;
}

template <typename X>
static int linear(const Segment* segs, int64_t count, int64_t K, const X* x, int64_t M, X* y, int threads) {
  if (!valid(segs, count, K)) return -1;
  bool need32 = false, need256 = false;
  int64_t N = 0;
  for (int64_t i = 0; i < count; ++i) {
    need32 |= !is_dense(segs[i].type) && !is_k_type(segs[i].type);
    need256 |= is_k_type(segs[i].type);
    N += segs[i].rows;
  }
  std::vector<uint8_t> shared(M > OWN_ROWS ? size_t(ActRows::bytes(M, K)) : 0);
  const ActRows common = ActRows::carve(shared.data(), M, K);
  const int64_t align = M == 1 ? R_ONE : R_MANY;
#pragma omp parallel num_threads(threads)
  {
    ActRows a = common;
    if (M <= OWN_ROWS) {
      a = quantized(x, M, K, need32, need256);
    } else {
#pragma omp for schedule(static)
      for (int64_t m = 0; m < M; ++m) quantize_row(x, m, common, need32, need256);
    }
    int64_t begin, end;
    team_range(N, align, &begin, &end);
    for (int64_t i = 0, column = 0; i < count; column += segs[i].rows, ++i) {
      const int64_t first = begin > column ? begin - column : 0;
      const int64_t last = end - column < segs[i].rows ? end - column : segs[i].rows;
      if (first < last) rows_of(segs[i], first, last, a, M, y, N, column);
    }
  }
  return 0;
}

}  // namespace pd::gguf

using pd::gguf::Segment;

// Returns 0, or -1 for a segment of a type without a kernel or rows that do not hold K weights.
extern "C" int pd_gguf_linear(const int64_t* segments, int64_t count, int64_t K, const void* x, int bf16, int64_t M,
                              void* y, int threads) {
  const auto* segs = reinterpret_cast<const Segment*>(segments);
  static_assert(sizeof(Segment) == 4 * sizeof(int64_t), "four words a segment (kernels/gguf_linear.py)");
  if (bf16)
    return pd::gguf::linear(segs, count, K, static_cast<const pd::bf16*>(x), M, static_cast<pd::bf16*>(y), threads);
  return pd::gguf::linear(segs, count, K, static_cast<const float*>(x), M, static_cast<float*>(y), threads);
}

// The activation quantizers on their own (tests compare them with gguf.quants and ggml's reference).
extern "C" void pd_gguf_quantize_q8(const float* x, int64_t K, int8_t* q, float* d, float* dsum) {
  std::vector<int32_t> sum(size_t(K / 32));
  pd::gguf::quantize_q8(x, K, q, d, dsum, sum.data());
}

extern "C" void pd_gguf_quantize_q8_k(const float* x, int64_t K, int8_t* q, float* d, int16_t* bsum16) {
  pd::gguf::quantize_q8_k(x, K, q, d, bsum16);
}
