// RMSNorm of bfloat16 rows in one pass, rounding exactly where Hugging Face's LlamaRMSNorm does.
//
// The model's module runs seven ops for it (upcast, square, mean, add eps, rsqrt, multiply,
// downcast, then the weight multiply), each a full pass over the activations with its own
// allocation; on a 2,048 x 576 bfloat16 prefill chunk that was ~1-3 ms, 61 times a forward pass.
// Here each row is read once for its sum of squares and once more to write the result:
//   normed = bf16(x * 1 / sqrt(mean(x^2) + eps))   computed in float32, as HF's .to(input_dtype)
//   out    = bf16(float(weight) * float(normed))    as HF's bfloat16 weight * bfloat16 tensor
// The sum of squares is float32 in another order than ATen's mean, so an element whose scaled
// value sits on a bfloat16 rounding boundary can round the other way: one bfloat16 ulp, in a few
// elements per 10,000. Over a whole bfloat16 model that is noise of the size bfloat16 itself adds
// (tests/engine/test_fused_norm.py: as close to the float32 model as the module is). Used for
// bfloat16 models only: float32 models keep Hugging Face's module, whose every bit the equality
// tests with `generate` check.
#include "aten_ops.h"

#include <cmath>
#include <cstdint>

#include "bfloat16_bits.h"

using pagedserve::bf16_to_float;
using pagedserve::float_to_bf16;

at::Tensor rms_norm_bf16(const at::Tensor& input, const at::Tensor& weight, double eps) {
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "rms_norm_bf16 takes bfloat16 input and weight");
  TORCH_CHECK(input.device().is_cpu() && weight.device().is_cpu(), "rms_norm_bf16 is CPU-only");
  const int64_t size = input.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == size, "weight must be [", size, "]");
  const auto x = input.contiguous();
  const auto w = weight.contiguous();
  auto output = at::empty_like(x);
  const int64_t num_rows = size == 0 ? 0 : x.numel() / size;
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* gamma = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(output.data_ptr<at::BFloat16>());
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, num_rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* row = src + r * size;
      float sum_of_squares = 0.0f;
#pragma omp simd reduction(+ : sum_of_squares)
      for (int64_t i = 0; i < size; ++i) {
        const float value = bf16_to_float(row[i]);
        sum_of_squares += value * value;
      }
      const float inverse_rms = 1.0f / std::sqrt(sum_of_squares / size + epsilon);
      uint16_t* out = dst + r * size;
#pragma omp simd
      for (int64_t i = 0; i < size; ++i) {
        const float scaled = bf16_to_float(row[i]) * inverse_rms;
        const float normed = bf16_to_float(float_to_bf16(scaled));  // HF: .to(bf16)
        out[i] = float_to_bf16(bf16_to_float(gamma[i]) * normed);
      }
    }
  });
  return output;
}
