// Rows of GGUF weight blocks as float32 or bfloat16 values: the embedding's gather (rows by token id) and
// the dequantized tile a prefill-sized matmul multiplies (consecutive rows). float32 values are bit-equal
// to gguf.quants.dequantize; bfloat16 ones are those rounded to nearest even.
#include "gguf_blocks.h"

namespace pd::gguf {

template <typename Y>
static void dequantize_row(int64_t type, const uint8_t* row, int64_t K, Y* out) {
  if (is_dense(type)) {
    for (int64_t k = 0; k < K; ++k) out[k] = from_float<Y>(dense_at(type, row, k));
    return;
  }
  const Layout l = layout(type);
  alignas(64) float values[256];
  for (int64_t b = 0; b < K / l.block; ++b) {
    dequantize_block(type, row + b * l.bytes, values);
    for (int i = 0; i < l.block; ++i) out[b * l.block + i] = from_float<Y>(values[i]);
  }
}

template <typename Y>
static void dequantize_rows(int64_t type, const uint8_t* data, int64_t row_bytes, const int64_t* ids, int64_t first,
                            int64_t count, int64_t K, Y* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (count * K >= (1 << 16))
  for (int64_t i = 0; i < count; ++i)
    dequantize_row(type, data + (ids ? ids[i] : first + i) * row_bytes, K, out + i * K);
}

}  // namespace pd::gguf

// out[i, :] = row ids[i] (or first + i where ids is null) of the blocks at `data`; returns -1 for a type
// these kernels do not take or rows that do not hold K weights.
extern "C" int pd_gguf_dequantize(int64_t type, const uint8_t* data, int64_t row_bytes, const int64_t* ids,
                                  int64_t first, int64_t count, int64_t K, void* out, int bf16, int threads) {
  const pd::gguf::Layout l = pd::gguf::layout(type);
  if (!l.block || K % l.block || row_bytes != K / l.block * l.bytes) return -1;
  if (bf16)
    pd::gguf::dequantize_rows(type, data, row_bytes, ids, first, count, K, static_cast<pd::bf16*>(out), threads);
  else
    pd::gguf::dequantize_rows(type, data, row_bytes, ids, first, count, K, static_cast<float*>(out), threads);
  return 0;
}
