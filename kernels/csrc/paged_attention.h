// Online-softmax attention of query heads over K/V read in place from the paged pool, one block of
// tokens at a time. A block's K rows of every KV head form one contiguous range, and so do its V
// rows: a work item walks whole blocks (all KV heads) and prefetches the next block while it works.
#pragma once
#include "common.h"

namespace pd {

constexpr int MAX_BLOCK = 256;  // tokens per KV block
constexpr int MAX_GROUP = 16;   // query heads per KV head
constexpr int MAX_VECS = 16;    // head_dim / 16

template <typename T>
struct PagedLayer {
  const T* pool;  // block 0's K of this layer
  int64_t block_stride, kv_stride, slot_stride, head_stride, block_size, kv_heads;
  const T* key(int64_t block, int64_t slot) const { return pool + block * block_stride + slot * slot_stride; }
};

// The running softmax of `heads` query heads: max m, sum l, unnormalised output acc [heads][vecs].
struct SoftmaxState {
  float* m;
  float* l;
  vf* acc;
};

template <int V> struct Vecs { static constexpr int n = V; int get() const { return V; } };
struct RuntimeVecs { int n; int get() const { return n; } };

template <typename T>
static inline void prefetch_block(const PagedLayer<T>& pages, int64_t block, int64_t count) {
  const char* k = reinterpret_cast<const char*>(pages.key(block, 0));
  const int64_t bytes = count * pages.slot_stride * int64_t(sizeof(T));
  for (int64_t at = 0; at < bytes; at += 64) {
    __builtin_prefetch(k + at);
    __builtin_prefetch(k + pages.kv_stride * int64_t(sizeof(T)) + at);
  }
}

// Fold slots [first, first + count) of one block into query head `head`'s state (q: its
// pre-scaled query, kv_head: the K/V head it reads); scores, softmax and output in one pass.
template <typename T, typename VC>
static inline void attend_head(const vf* q, const PagedLayer<T>& pages, int64_t block, int64_t first,
                               int64_t count, int64_t kv_head, int64_t head, VC vc, SoftmaxState st) {
  const int vecs = vc.get();
  float s[MAX_BLOCK] __attribute__((aligned(64)));
  const T* keys = pages.key(block, first) + kv_head * pages.head_stride;
  float block_max = -INFINITY;
  for (int64_t t = 0; t < count; ++t) {
    const T* k = keys + t * pages.slot_stride;
    vf dot = q[0] * load(k);
    for (int j = 1; j < vecs; ++j) dot += q[j] * load(k + j * LANES);
    s[t] = hsum(dot);
    block_max = s[t] > block_max ? s[t] : block_max;
  }
  const int64_t padded = (count + LANES - 1) / LANES * LANES;
  for (int64_t t = count; t < padded; ++t) s[t] = -INFINITY;
  const float m_new = block_max > st.m[head] ? block_max : st.m[head];
  const float alpha = std::exp(st.m[head] - m_new);
  vf sum = splat(0.0f);
  for (int64_t t = 0; t < padded; t += LANES) {
    const vf p = vexp(load(s + t) - m_new);
    std::memcpy(s + t, &p, sizeof p);
    sum += p;
  }
  st.l[head] = st.l[head] * alpha + hsum(sum);
  st.m[head] = m_new;
  vf a[MAX_VECS];  // NOTE: the head's output stays in registers across the block
  for (int j = 0; j < vecs; ++j) a[j] = st.acc[head * vecs + j] * alpha;
  const T* values = keys + pages.kv_stride;
  for (int64_t t = 0; t < count; ++t) {
    const T* v = values + t * pages.slot_stride;
    const vf p = splat(s[t]);
    for (int j = 0; j < vecs; ++j) a[j] += p * load(v + j * LANES);
  }
  for (int j = 0; j < vecs; ++j) st.acc[head * vecs + j] = a[j];
}

// Fold slots [first, first + count) of one block into every query head's state; q is
// [q_heads][vecs], pre-scaled; KV head h serves query heads h*group .. h*group + group - 1.
template <typename T, typename VC>
static inline void attend_block(const vf* q, const PagedLayer<T>& pages, int64_t block, int64_t first,
                                int64_t count, int group, VC vc, SoftmaxState st) {
  for (int64_t h = 0; h < pages.kv_heads; ++h)
    for (int g = 0; g < group; ++g) {
      const int64_t head = h * group + g;
      attend_head(q + head * vc.get(), pages, block, first, count, h, head, vc, st);
    }
}

// Fold context tokens [begin, end) of one sequence (its block table) into the state.
template <typename T, typename VC>
static inline void attend_range(const vf* q, const PagedLayer<T>& pages, const int32_t* table, int64_t begin,
                                int64_t end, int group, VC vc, SoftmaxState st) {
  const int64_t bs = pages.block_size;
  for (int64_t pos = begin; pos < end;) {
    const int64_t slot = pos % bs, count = bs - slot < end - pos ? bs - slot : end - pos;
    const int64_t next = pos + count;
    if (next < end) prefetch_block(pages, int64_t(table[next / bs]), bs < end - next ? bs : end - next);
    attend_block(q, pages, int64_t(table[pos / bs]), slot, count, group, vc, st);
    pos = next;
  }
}

inline void reset(SoftmaxState st, int64_t heads, int vecs) {
  for (int64_t h = 0; h < heads; ++h) {
    st.m[h] = -INFINITY, st.l[h] = 0.0f;
    for (int j = 0; j < vecs; ++j) st.acc[h * vecs + j] = splat(0.0f);
  }
}

// Scaled float32 copy of `heads` query heads of one token: out [heads][vecs].
template <typename T>
static inline void load_queries(const T* q, int64_t head_stride, int64_t heads, int vecs, float scale, vf* out) {
  for (int64_t h = 0; h < heads; ++h)
    for (int j = 0; j < vecs; ++j) out[h * vecs + j] = load(q + h * head_stride + j * LANES) * scale;
}

}  // namespace pd
