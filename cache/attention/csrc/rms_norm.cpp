// RMSNorm of float32 or bfloat16 rows in one pass, rounding exactly where Hugging Face's
// LlamaRMSNorm does.
//
// The model's module runs seven ops for it (upcast, square, mean, add eps, rsqrt, multiply,
// downcast, then the weight multiply), each a full pass over the activations with its own
// allocation; on a 2,048 x 576 bfloat16 prefill chunk that was ~1-3 ms, 61 times a forward pass,
// and in a float32 workload's 512-row prefill steps 0.38 ms a call where this takes ~0.05.
// Here each row is read once for its sum of squares and once more to write the result:
//   normed = narrow(x * 1 / sqrt(mean(x^2) + eps))   in float32, as HF's .to(input_dtype)
//   out    = narrow(float(weight) * float(normed))    as HF's weight * normed in the model's dtype
// (narrow: to bfloat16 for a bfloat16 model, nothing for a float32 one; row_formats.h). The sum of
// squares is taken in double, nearly exact, where ATen's mean sums float32 in its own order, so
// 1 / rms can differ in its last bits: in float32 the elements of such a row move by a few ulps
// (at most 3 on random rows); in bfloat16 an element whose scaled value sits on a rounding
// boundary rounds the other way (one bfloat16 ulp, a few per 10,000). A float32 sum would drift
// with the row's length (one accumulator per vector lane): double keeps wide rows as close.
#include "aten_ops.h"

#include <cmath>
#include <cstdint>

#include "row_formats.h"

namespace {

using pagedserve::rounded;

template <typename Format>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& w, at::Tensor& output, float epsilon) {
  using T = typename Format::type;
  const int64_t size = x.size(-1);
  const int64_t num_rows = size == 0 ? 0 : x.numel() / size;
  const T* src = pagedserve::elements<Format>(x);
  const T* gamma = pagedserve::elements<Format>(w);
  T* dst = pagedserve::elements<Format>(output);
  at::parallel_for(0, num_rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = src + r * size;
      double sum_of_squares = 0.0;
#pragma omp simd reduction(+ : sum_of_squares)
      for (int64_t i = 0; i < size; ++i) {
        const double value = Format::widen(row[i]);
        sum_of_squares += value * value;
      }
      const float mean_square = static_cast<float>(sum_of_squares / size);
      const float inverse_rms = 1.0f / std::sqrt(mean_square + epsilon);
      T* out = dst + r * size;
#pragma omp simd
      for (int64_t i = 0; i < size; ++i) {
        const float normed = rounded<Format>(Format::widen(row[i]) * inverse_rms);  // .to(dtype)
        out[i] = Format::narrow(Format::widen(gamma[i]) * normed);
      }
    }
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  RECORD_FUNCTION("pagedserve::rms_norm", std::vector<c10::IValue>());
  const auto dtype = input.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && weight.scalar_type() == dtype,
              "rms_norm takes float32 or bfloat16 input and a weight of the same dtype");
  TORCH_CHECK(input.device().is_cpu() && weight.device().is_cpu(), "rms_norm is CPU-only");
  const int64_t size = input.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == size, "weight must be [", size, "]");
  const auto x = input.contiguous();
  const auto w = weight.contiguous();
  auto output = at::empty_like(x);
  if (dtype == at::kBFloat16) {
    rms_norm_rows<pagedserve::Bfloat16>(x, w, output, static_cast<float>(eps));
  } else {
    rms_norm_rows<pagedserve::Float32>(x, w, output, static_cast<float>(eps));
  }
  return output;
}
