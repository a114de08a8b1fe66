// Paged decode attention: one query token per sequence, GQA, K/V read where they lie in the pool.
// Work items are (sequence, context split), each over every KV head; with more than one split,
// each writes normalised partial outputs and their log-sum-exp, and a second pass merges them.
#include <memory>

#include "paged_attention.h"

namespace pd {

struct DecodeShape {
  int64_t seqs, q_heads, kv_heads, head_dim, splits;
  int64_t q_seq_stride, q_head_stride, out_seq_stride, out_head_stride, table_stride;
  float scale;
};

template <typename T>
static void store_head(const SoftmaxState& st, int64_t h, int vecs, T* out, float* partial, float* lse) {
  const float inv = st.l[h] > 0.0f ? 1.0f / st.l[h] : 0.0f;
  for (int j = 0; j < vecs; ++j) {
    const vf o = st.acc[h * vecs + j] * inv;
    if (partial) store(partial + j * LANES, o);
    else store(out + j * LANES, o);
  }
  if (lse) *lse = st.l[h] > 0.0f ? st.m[h] + std::log(st.l[h]) : -INFINITY;
}

template <typename T, typename VC>
static void decode_item(const T* q, const PagedLayer<T>& pages, const int32_t* tables, const int32_t* lens, T* out,
                        float* partials, float* lses, const DecodeShape& sh, int64_t item, VC vc, vf* qs,
                        SoftmaxState st) {
  const int64_t split = item % sh.splits, seq = item / sh.splits, bs = pages.block_size;
  const int group = int(sh.q_heads / sh.kv_heads), vecs = vc.get();
  const int64_t len = lens[seq];
  const int64_t per_split = ((len + sh.splits - 1) / sh.splits + bs - 1) / bs * bs;
  const int64_t begin = split * per_split, end = begin + per_split < len ? begin + per_split : len;
  load_queries(q + seq * sh.q_seq_stride, sh.q_head_stride, sh.q_heads, vecs, sh.scale, qs);
  reset(st, sh.q_heads, vecs);
  if (begin < end) attend_range(qs, pages, tables + seq * sh.table_stride, begin, end, group, vc, st);
  for (int64_t h = 0; h < sh.q_heads; ++h) {
    const int64_t at = (seq * sh.q_heads + h) * sh.splits + split;
    const bool split_up = sh.splits > 1;
    store_head(st, h, vecs, out + seq * sh.out_seq_stride + h * sh.out_head_stride,
               split_up ? partials + at * sh.head_dim : nullptr, split_up ? lses + at : nullptr);
  }
}

template <typename T>
static void merge_splits(const float* partials, const float* lses, T* out, const DecodeShape& sh, int64_t row) {
  const int64_t seq = row / sh.q_heads, head = row % sh.q_heads;
  const float* lse = lses + row * sh.splits;
  float m = -INFINITY;
  for (int64_t s = 0; s < sh.splits; ++s) m = lse[s] > m ? lse[s] : m;
  float weights[64], total = 0.0f;
  for (int64_t s = 0; s < sh.splits; ++s) total += weights[s] = m == -INFINITY ? 0.0f : std::exp(lse[s] - m);
  T* o = out + seq * sh.out_seq_stride + head * sh.out_head_stride;
  for (int64_t d = 0; d < sh.head_dim; ++d) {
    float acc = 0.0f;
    for (int64_t s = 0; s < sh.splits; ++s)
      if (weights[s] > 0.0f) acc += weights[s] * partials[(row * sh.splits + s) * sh.head_dim + d];
    o[d] = from_float<T>(total > 0.0f ? acc / total : 0.0f);
  }
}

template <typename T, typename VC>
static void decode_attention(const T* q, const PagedLayer<T>& pages, const int32_t* tables, const int32_t* lens,
                             T* out, float* partials, float* lses, const DecodeShape& sh, VC vc, int threads) {
  const int64_t items = sh.seqs * sh.splits, vecs = vc.get();
#pragma omp parallel num_threads(threads)
  {
    std::unique_ptr<vf[]> qs(new vf[sh.q_heads * vecs]), acc(new vf[sh.q_heads * vecs]);
    std::unique_ptr<float[]> m(new float[sh.q_heads]), l(new float[sh.q_heads]);
    const SoftmaxState st{m.get(), l.get(), acc.get()};
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item)
      decode_item(q, pages, tables, lens, out, partials, lses, sh, item, vc, qs.get(), st);
    if (sh.splits > 1) {
#pragma omp for schedule(static)
      for (int64_t row = 0; row < sh.seqs * sh.q_heads; ++row) merge_splits(partials, lses, out, sh, row);
    }
  }
}

template <typename T>
static void decode_attention_any(const T* q, const PagedLayer<T>& pages, const int32_t* tables, const int32_t* lens,
                                 T* out, float* partials, float* lses, const DecodeShape& sh, int threads) {
  switch (sh.head_dim / LANES) {
    case 4: return decode_attention(q, pages, tables, lens, out, partials, lses, sh, Vecs<4>{}, threads);
    case 8: return decode_attention(q, pages, tables, lens, out, partials, lses, sh, Vecs<8>{}, threads);
    default:
      return decode_attention(q, pages, tables, lens, out, partials, lses, sh, RuntimeVecs{int(sh.head_dim / LANES)},
                              threads);
  }
}

}  // namespace pd

#define PD_DECODE_ATTENTION(SUFFIX, T)                                                                        \
  extern "C" void pd_decode_attention_##SUFFIX(                                                               \
      const T* q, const T* layer_pool, const int64_t* pool_strides, int64_t block_size, const int32_t* tables, \
      const int32_t* lens, T* out, float* partials, float* lses, const int64_t* shape, float scale,           \
      int threads) {                                                                                          \
    const pd::PagedLayer<T> pages{layer_pool, pool_strides[0], pool_strides[1], pool_strides[2],              \
                                  pool_strides[3], block_size, shape[2]};                                     \
    const pd::DecodeShape sh{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5], shape[6], shape[7],  \
                             shape[8], shape[9], scale};                                                      \
    pd::decode_attention_any(q, pages, tables, lens, out, partials, lses, sh, threads);                       \
  }

PD_DECODE_ATTENTION(f32, float)
PD_DECODE_ATTENTION(bf16, pd::bf16)
