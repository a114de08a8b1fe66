// Online-softmax attention of query heads over K/V read in place from the paged pool, one block of
// tokens at a time. A block's K rows of every KV head form one contiguous range, and so do its V
// rows: a work item walks whole blocks (all KV heads) and prefetches the next block while it works.
#pragma once
#include "common.h"

namespace pd {

constexpr int MAX_BLOCK = 256;  // tokens per KV block
constexpr int MAX_GROUP = 16;   // query heads per KV head
constexpr int MAX_VECS = 16;    // head_dim / 16: up to 256
constexpr int WIDE_VECS = 32;   // up to 512 (Gemma 4's full layers), a wider chunk of its own

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

// Vectors a head: known when compiled, or read at run time; `max` sizes the chunk and accumulator they use.
template <int V> struct Vecs {
  static constexpr int n = V, max = MAX_VECS;
  int get() const { return V; }
};
template <int Max> struct RuntimeVecs { int n; static constexpr int max = Max; int get() const { return n; } };

template <typename T>
static inline void prefetch_block(const PagedLayer<T>& pages, int64_t block, int64_t count) {
  const char* k = reinterpret_cast<const char*>(pages.key(block, 0));
  const int64_t bytes = count * pages.slot_stride * int64_t(sizeof(T));
  for (int64_t at = 0; at < bytes; at += 64) {
    __builtin_prefetch(k + at);
    __builtin_prefetch(k + pages.kv_stride * int64_t(sizeof(T)) + at);
  }
}

constexpr int CHUNK = 16;  // slots one KV head's group folds at a time, from float32 copies in L1

// One KV head's K and V for up to CHUNK slots, converted to float32 once for every query head of its group.
template <int MaxVecs>
struct SlotChunk {
  vf k[CHUNK * MaxVecs], v[CHUNK * MaxVecs];
  int64_t count;
};

template <typename T, typename Chunk>
static inline void load_chunk(const T* keys, const T* values, int64_t slot_stride, int64_t count, int vecs,
                              Chunk& c) {
  c.count = count;
  for (int64_t t = 0; t < count; ++t)
    for (int j = 0; j < vecs; ++j) {
      c.k[t * vecs + j] = load(keys + t * slot_stride + j * LANES);
      c.v[t * vecs + j] = load(values + t * slot_stride + j * LANES);
    }
}

// q . k of slot t, lane by lane (not yet summed across lanes).
template <typename Chunk>
static inline vf lane_dot(const vf* q, const Chunk& c, int64_t t, int vecs) {
  vf acc = q[0] * c.k[t * vecs];
  for (int j = 1; j < vecs; ++j) acc += q[j] * c.k[t * vecs + j];
  return acc;
}

// Fold the chunk's slots [first, count) into query head `head`'s state (q: its pre-scaled query); scores, softmax
// and output in one pass, eight slots' dot products summed across lanes at once (hsum8). A `softcap` above 0
// caps each score at softcap * tanh(score / softcap) (Gemma 2).
template <typename VC, typename Chunk>
static inline void attend_head(const vf* q, const Chunk& c, int64_t first, int64_t count, int64_t head,
                               float softcap, VC vc, SoftmaxState st) {
  const int vecs = vc.get();
  float s[CHUNK] __attribute__((aligned(64)));
  int64_t t = 0;
  for (; t + 8 <= count; t += 8) {
    vf dots[8];
    for (int i = 0; i < 8; ++i) dots[i] = lane_dot(q, c, t + i, vecs);
    const v8f sums = hsum8(dots);
    std::memcpy(s + t, &sums, sizeof sums);
  }
  for (; t < count; ++t) s[t] = hsum(lane_dot(q, c, t, vecs));
  for (; t < CHUNK; ++t) s[t] = -INFINITY;
  if (softcap > 0.0f)
    for (t = first; t < count; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
  for (t = 0; t < first; ++t) s[t] = -INFINITY;  // NOTE: before the sliding window
  const vf scores = load(s);
  const float block_max = hmax(scores);
  const float m_new = block_max > st.m[head] ? block_max : st.m[head];
  const float alpha = std::exp(st.m[head] - m_new);
  const vf p = vexp(scores - m_new);
  std::memcpy(s, &p, sizeof p);
  st.l[head] = st.l[head] * alpha + hsum(p);
  st.m[head] = m_new;
  vf a[VC::max];  // NOTE: the head's output stays in registers across the chunk
  for (int j = 0; j < vecs; ++j) a[j] = st.acc[head * vecs + j] * alpha;
  for (t = 0; t < count; ++t) {
    const vf w = splat(s[t]);
    for (int j = 0; j < vecs; ++j) a[j] += w * c.v[t * vecs + j];
  }
  for (int j = 0; j < vecs; ++j) st.acc[head * vecs + j] = a[j];
}

// The query rows one pass over a sequence's context serves: `rows` rows with the same block table (a
// verifying sequence's input token and drafts), row r attending to positions [lens[r] - window, lens[r])
// (from 0 without a window: window 0). q holds each row's pre-scaled query heads, [rows][q_heads][vecs];
// states[r] is row r's softmax state.
struct QueryRows {
  const vf* q;
  const SoftmaxState* states;
  const int32_t* lens;
  int64_t rows, q_heads, window;
  float softcap;
  int64_t first_seen(int64_t r) const { return window > 0 && lens[r] > window ? lens[r] - window : 0; }
};

// Fold slots [first, first + count) of one block, at context positions from `pos`, into every row's query
// heads; KV head h serves query heads h*group .. h*group + group - 1. Each chunk of a KV head's slots is
// read from the pool once for every row and head it serves.
template <typename T, typename VC>
static inline void attend_block(const QueryRows& rows, const PagedLayer<T>& pages, int64_t block, int64_t first,
                                int64_t count, int64_t pos, int group, VC vc) {
  const int vecs = vc.get();
  SlotChunk<VC::max> chunk;
  for (int64_t h = 0; h < pages.kv_heads; ++h) {
    const T* keys = pages.key(block, first) + h * pages.head_stride;
    for (int64_t t = 0; t < count; t += CHUNK) {
      const T* at = keys + t * pages.slot_stride;
      load_chunk(at, at + pages.kv_stride, pages.slot_stride, count - t < CHUNK ? count - t : CHUNK, vecs, chunk);
      for (int64_t r = 0; r < rows.rows; ++r) {
        const int64_t visible = rows.lens[r] - (pos + t), n = visible < chunk.count ? visible : chunk.count;
        const int64_t skipped = rows.first_seen(r) - (pos + t), from = skipped > 0 ? skipped : 0;
        if (n <= from) continue;
        for (int g = 0; g < group; ++g) {
          const int64_t head = h * group + g;
          attend_head(rows.q + (r * rows.q_heads + head) * vecs, chunk, from, n, head, rows.softcap, vc,
                      rows.states[r]);
        }
      }
    }
  }
}

// Fold context positions [begin, end) of one sequence (its block table) into every row's state.
template <typename T, typename VC>
static inline void attend_range(const QueryRows& rows, const PagedLayer<T>& pages, const int32_t* table,
                                int64_t begin, int64_t end, int group, VC vc) {
  const int64_t bs = pages.block_size;
  for (int64_t pos = begin; pos < end;) {
    const int64_t slot = pos % bs, count = bs - slot < end - pos ? bs - slot : end - pos;
    const int64_t next = pos + count;
    if (next < end) prefetch_block(pages, int64_t(table[next / bs]), bs < end - next ? bs : end - next);
    attend_block(rows, pages, int64_t(table[pos / bs]), slot, count, pos, group, vc);
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
