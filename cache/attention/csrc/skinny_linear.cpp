// float32 logits = x W^T for a few rows of x (a decode step's last hidden states): each weight row
// is streamed once and multiplied into every row of x while it is in registers.
//
// At decode time the LM head multiplies 1-16 rows by a large matrix (49,152 x 576 floats, 113 MB
// for the default model), so it is bound by reading the weight. MKL (F.linear) reaches that bound
// for one row (GEMV, 4.2 ms), but its GEMM path took 8.9 / 14.7 / 21.8 ms at 4 / 8 / 12 rows here,
// this kernel 6.0 / 8.2 / 10.4 ms (benchmarks/linear.py --dtype float32, Sapphire Rapids). With
// the weights prefetched into L2 (kPrefetchFloats), on a 2-core Zen 4 with the weight evicted
// before each call: 4.2 / 4.3 / 4.8 / 7.1 ms at 1 / 4 / 8 / 12 rows, from 8.0 / 8.8 / 12.9 / 16.3
// (oneDNN's packed linear: 6.3 / 5.0 / 5.9 / 6.7, MKL 10.7-35.8). This
// kernel keeps up to kRowTile x kWeightTile dot products in registers: each weight vector is
// loaded once per row tile and each x vector once per weight pair, and the lanes are summed as a
// tree at the end of a row.
//
// Not MKL's summation order: results agree with F.linear to float32 rounding, not bit for bit.
// engine/skinny_linear.py uses it for the LM head only, where nothing downstream but the argmax
// and the logprobs sees that difference.
#include "aten_ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "float_vectors.h"

namespace {

using pagedserve::kLanes;
using pagedserve::vfloat;

constexpr int kRowTile = 8;     // rows of x per pass over a weight pair
constexpr int kWeightTile = 2;  // weight rows per pass: kRowTile x kWeightTile accumulators
constexpr int64_t kMaxRows = 16;
// How far ahead of the loads each weight stream is prefetched into L2: 16 KB, seven rows of a
// 576-wide weight. The hardware prefetcher alone kept one thread at 8 GB/s where a plain read of
// the same memory ran at 22; with this, 18 GB/s (one row, a 318 MB weight, Zen 4; 25 against 32
// GB/s on two threads). 1 KB ahead reached 15 GB/s, 4 KB 18.
constexpr int64_t kPrefetchFloats = 4096;

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

typedef float vfloat8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vfloat4 __attribute__((vector_size(4 * sizeof(float))));

template <typename half_t, typename whole_t>
inline half_t fold(whole_t v) {  // the low half plus the high half: one extract and one add
  half_t low, high;
  std::memcpy(&low, &v, sizeof(low));
  std::memcpy(&high, reinterpret_cast<const char*>(&v) + sizeof(low), sizeof(high));
  return low + high;
}

inline float horizontal_sum(vfloat v) {  // a tree, as the attention kernel sums its lanes
#if defined(__AVX512F__) || !defined(__AVX2__)
  const vfloat4 four = fold<vfloat4>(fold<vfloat8>(v));
#else
  const vfloat4 four = fold<vfloat4>(v);
#endif
  return (four[0] + four[2]) + (four[1] + four[3]);
}

// out[r, n] for rows [0, num_rows) of x (num_rows <= kRowTile) and weight rows n, n + 1.
template <int kRows>
inline void dot_tile(const float* x, int64_t x_stride, const float* w0, const float* w1,
                     int64_t k, float* out, int64_t out_stride, bool second) {
  vfloat acc0[kRows] = {};
  vfloat acc1[kRows] = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    __builtin_prefetch(w0 + i + kPrefetchFloats, 0, 2);
    __builtin_prefetch(w1 + i + kPrefetchFloats, 0, 2);
    const vfloat a = load(w0 + i);
    const vfloat b = second ? load(w1 + i) : vfloat{};
    for (int r = 0; r < kRows; ++r) {
      const vfloat xv = load(x + r * x_stride + i);
      acc0[r] += a * xv;
      acc1[r] += b * xv;
    }
  }
  for (int r = 0; r < kRows; ++r) {
    float sum0 = horizontal_sum(acc0[r]);
    float sum1 = horizontal_sum(acc1[r]);
    for (int64_t j = i; j < k; ++j) {  // a K that ends in a partial vector
      sum0 += w0[j] * x[r * x_stride + j];
      if (second) sum1 += w1[j] * x[r * x_stride + j];
    }
    out[r * out_stride] = sum0;
    if (second) out[r * out_stride + 1] = sum1;
  }
}

template <int kRows>
void rows_times_weights(const float* x, const float* w, int64_t k, int64_t n_begin, int64_t n_end,
                        float* out, int64_t n) {
  for (int64_t j = n_begin; j < n_end; j += kWeightTile) {
    const bool second = j + 1 < n_end;
    dot_tile<kRows>(x, k, w + j * k, w + (second ? j + 1 : j) * k, k, out + j, n, second);
  }
}

using TileFn = void (*)(const float*, const float*, int64_t, int64_t, int64_t, float*, int64_t);
constexpr TileFn kTileFns[kRowTile] = {
    rows_times_weights<1>, rows_times_weights<2>, rows_times_weights<3>, rows_times_weights<4>,
    rows_times_weights<5>, rows_times_weights<6>, rows_times_weights<7>, rows_times_weights<8>,
};

}  // namespace

at::Tensor skinny_linear_fp32(const at::Tensor& input, const at::Tensor& weight) {
  RECORD_FUNCTION("pagedserve::skinny_linear_fp32", std::vector<c10::IValue>());
  TORCH_CHECK(input.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "skinny_linear_fp32 takes float32 input and weight");
  TORCH_CHECK(input.device().is_cpu() && weight.device().is_cpu(), "skinny_linear_fp32 is CPU-only");
  TORCH_CHECK(weight.dim() == 2, "weight must be [out_features, in_features]");
  const int64_t k = weight.size(1), n = weight.size(0);
  TORCH_CHECK(input.size(-1) == k, "input's last dimension must be ", k);
  const auto x = input.reshape({-1, k}).contiguous();
  const auto w = weight.contiguous();
  const int64_t num_rows = x.size(0);
  TORCH_CHECK(num_rows <= kMaxRows, "skinny_linear_fp32 takes at most ", kMaxRows, " rows");
  auto output_shape = input.sizes().vec();
  output_shape.back() = n;
  auto output = at::empty({num_rows, n}, x.options());
  const float* src = x.data_ptr<float>();
  const float* weights = w.data_ptr<float>();
  float* dst = output.data_ptr<float>();
  // Threads split the weight rows in blocks of 32; within a block, every row tile of x passes
  // over the block's weights while they are still in L2 (32 x 1,536 floats = 192 KB).
  constexpr int64_t kBlock = 32;
  at::parallel_for(0, (n + kBlock - 1) / kBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n_begin = block * kBlock, n_end = std::min(n, n_begin + kBlock);
      for (int64_t r = 0; r < num_rows; r += kRowTile) {
        const int64_t rows = std::min<int64_t>(kRowTile, num_rows - r);
        kTileFns[rows - 1](src + r * k, weights, k, n_begin, n_end, dst + r * n, n);
      }
    }
  });
  return output.view(output_shape);
}
