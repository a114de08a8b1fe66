// Paged decode attention: one query token per row, GQA, K/V read where they lie in the pool.
// Consecutive rows with the same block table (a verifying sequence's input token and drafts, each
// seeing the positions before it) are served by one pass over their context, up to MAX_ROWS at a time.
// Work items are (such a run of rows, context split), each over every KV head; with more than one
// split, each writes normalised partial outputs and their log-sum-exp, and a second pass merges them.
#include <cstring>
#include <memory>
#include <vector>

#include "paged_attention.h"

namespace pd {

struct DecodeShape {
  int64_t seqs, q_heads, kv_heads, head_dim, splits;
  int64_t q_seq_stride, q_head_stride, out_seq_stride, out_head_stride, table_stride, window;
  float scale, softcap;
  const float* sinks;  // [q_heads] logits in every row's softmax denominator (gpt-oss), or null
};

// Head h's output: normalised, with its sink's share of the denominator when it has one (out), or a split's
// partial output and its log-sum-exp, whose merge adds the sink (partial, lse).
template <typename T>
static void store_head(const SoftmaxState& st, int64_t h, int vecs, T* out, float* partial, float* lse,
                       const float* sinks) {
  const float l = sinks && !partial ? st.l[h] + std::exp(sinks[h] - st.m[h]) : st.l[h];
  const float inv = l > 0.0f && st.l[h] > 0.0f ? 1.0f / l : 0.0f;
  for (int j = 0; j < vecs; ++j) {
    const vf o = st.acc[h * vecs + j] * inv;
    if (partial) store(partial + j * LANES, o);
    else store(out + j * LANES, o);
  }
  if (lse) *lse = st.l[h] > 0.0f ? st.m[h] + std::log(st.l[h]) : -INFINITY;
}

constexpr int64_t MAX_ROWS = 8;  // rows one pass over a context serves

// The first row of each run of consecutive rows with the same block table (at most MAX_ROWS long), then `seqs`.
static std::vector<int64_t> table_runs(const int32_t* tables, int64_t seqs, int64_t table_stride) {
  std::vector<int64_t> starts{0};
  for (int64_t s = 1; s < seqs; ++s)
    if (s - starts.back() >= MAX_ROWS ||
        std::memcmp(tables + s * table_stride, tables + (s - 1) * table_stride, table_stride * sizeof(int32_t)))
      starts.push_back(s);
  starts.push_back(seqs);
  return starts;
}

// Per-thread room for one run's queries and softmax states.
struct RunScratch {
  std::unique_ptr<vf[]> qs, acc;
  std::unique_ptr<float[]> m, l;
  SoftmaxState states[MAX_ROWS];
  RunScratch(int64_t q_heads, int vecs)
      : qs(new vf[MAX_ROWS * q_heads * vecs]), acc(new vf[MAX_ROWS * q_heads * vecs]),
        m(new float[MAX_ROWS * q_heads]), l(new float[MAX_ROWS * q_heads]) {
    for (int64_t r = 0; r < MAX_ROWS; ++r)
      states[r] = SoftmaxState{m.get() + r * q_heads, l.get() + r * q_heads, acc.get() + r * q_heads * vecs};
  }
};

template <typename T, typename VC>
static void decode_item(const T* q, const PagedLayer<T>& pages, const int32_t* tables, const int32_t* lens, T* out,
                        float* partials, float* lses, const DecodeShape& sh, const std::vector<int64_t>& runs,
                        int64_t item, VC vc, RunScratch& scratch) {
  const int64_t split = item % sh.splits, run = item / sh.splits, bs = pages.block_size;
  const int64_t first = runs[run], rows = runs[run + 1] - first;
  const int group = int(sh.q_heads / sh.kv_heads), vecs = vc.get();
  const QueryRows query_rows{scratch.qs.get(), scratch.states, lens + first, rows, sh.q_heads, sh.window,
                             sh.softcap};
  int64_t len = 0, seen = INT64_MAX;  // the run's context: [seen, len), whole blocks from seen's
  for (int64_t r = 0; r < rows; ++r) {
    len = lens[first + r] > len ? lens[first + r] : len;
    seen = query_rows.first_seen(r) < seen ? query_rows.first_seen(r) : seen;
  }
  seen = seen / bs * bs;
  const int64_t per_split = ((len - seen + sh.splits - 1) / sh.splits + bs - 1) / bs * bs;
  const int64_t begin = seen + split * per_split, end = begin + per_split < len ? begin + per_split : len;
  for (int64_t r = 0; r < rows; ++r) {
    load_queries(q + (first + r) * sh.q_seq_stride, sh.q_head_stride, sh.q_heads, vecs, sh.scale,
                 scratch.qs.get() + r * sh.q_heads * vecs);
    reset(scratch.states[r], sh.q_heads, vecs);
  }
  if (begin < end) attend_range(query_rows, pages, tables + first * sh.table_stride, begin, end, group, vc);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t seq = first + r;
    for (int64_t h = 0; h < sh.q_heads; ++h) {
      const int64_t at = (seq * sh.q_heads + h) * sh.splits + split;
      const bool split_up = sh.splits > 1;
      store_head(scratch.states[r], h, vecs, out + seq * sh.out_seq_stride + h * sh.out_head_stride,
                 split_up ? partials + at * sh.head_dim : nullptr, split_up ? lses + at : nullptr, sh.sinks);
    }
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
  if (sh.sinks && m != -INFINITY) total += std::exp(sh.sinks[head] - m);
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
  const std::vector<int64_t> runs = table_runs(tables, sh.seqs, sh.table_stride);
  const int64_t items = int64_t(runs.size() - 1) * sh.splits;
#pragma omp parallel num_threads(threads)
  {
    RunScratch scratch(sh.q_heads, vc.get());
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item)
      decode_item(q, pages, tables, lens, out, partials, lses, sh, runs, item, vc, scratch);
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
      if (sh.head_dim / LANES > MAX_VECS)
        return decode_attention(q, pages, tables, lens, out, partials, lses, sh,
                                RuntimeVecs<WIDE_VECS>{int(sh.head_dim / LANES)}, threads);
      return decode_attention(q, pages, tables, lens, out, partials, lses, sh,
                              RuntimeVecs<MAX_VECS>{int(sh.head_dim / LANES)}, threads);
  }
}

}  // namespace pd

// shape: seqs, q_heads, kv_heads, head_dim, splits, q and out strides (seq, head), table stride, window (0:
// none); softcap 0: none; sinks: null or [q_heads] float32.
#define PD_DECODE_ATTENTION(SUFFIX, T)                                                                        \
  extern "C" void pd_decode_attention_##SUFFIX(                                                               \
      const T* q, const T* layer_pool, const int64_t* pool_strides, int64_t block_size, const int32_t* tables, \
      const int32_t* lens, T* out, float* partials, float* lses, const int64_t* shape, float scale,           \
      float softcap, const float* sinks, int threads) {                                                       \
    const pd::PagedLayer<T> pages{layer_pool, pool_strides[0], pool_strides[1], pool_strides[2],              \
                                  pool_strides[3], block_size, shape[2]};                                     \
    const pd::DecodeShape sh{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5], shape[6], shape[7],  \
                             shape[8], shape[9], shape[10], scale, softcap, sinks};                           \
    pd::decode_attention_any(q, pages, tables, lens, out, partials, lses, sh, threads);                       \
  }

PD_DECODE_ATTENTION(f32, float)
PD_DECODE_ATTENTION(bf16, pd::bf16)
