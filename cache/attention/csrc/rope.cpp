// Rotary position embedding of bfloat16 query and key heads, in place, rounding exactly where
// Hugging Face's apply_rotary_pos_emb does.
//
// apply_rotary_pos_emb computes `q * cos + rotate_half(q) * sin` with rotate_half(x) = cat(-x2,
// x1): a slice, a negation, a concatenation, two multiplies and an add, each a separate bfloat16
// tensor, for q and for k, in every layer. engine/fused_attention.py runs this instead, on the
// fused Q/K/V projection's output, whose q and k heads sit side by side in each token's row:
//   out[i]         = bf16(bf16(x1[i] * cos[i])         + bf16(-x2[i] * sin[i]))
//   out[i + D / 2] = bf16(bf16(x2[i] * cos[i + D / 2]) + bf16( x1[i] * sin[i + D / 2]))
// for i < D / 2, each product and the sum in float32 then rounded, as ATen's bfloat16 multiply and
// add are (the negation is exact, and rounding is symmetric in sign), so the bits are the module's.
#include "aten_ops.h"

#include <cstdint>

#include "bfloat16_bits.h"

namespace {

using pagedserve::bf16_to_float;
using pagedserve::float_to_bf16;

inline float rounded(float value) { return bf16_to_float(float_to_bf16(value)); }

}  // namespace

void rope_bf16_(const at::Tensor& states, const at::Tensor& cos, const at::Tensor& sin,
                int64_t num_heads, int64_t head_dim) {
  for (const auto* tensor : {&states, &cos, &sin}) {
    TORCH_CHECK(tensor->scalar_type() == at::kBFloat16 && tensor->device().is_cpu(),
                "rope_bf16_ takes bfloat16 CPU tensors");
    TORCH_CHECK(tensor->dim() == 2 && tensor->stride(1) == 1, "rope_bf16_ takes 2-D row tensors "
                "with contiguous rows");
  }
  const int64_t num_tokens = states.size(0);
  TORCH_CHECK(head_dim % 2 == 0 && num_heads * head_dim <= states.size(1),
              "rope_bf16_: ", num_heads, " heads of ", head_dim, " (even) exceed the row of ",
              states.size(1));
  TORCH_CHECK(cos.size(0) == num_tokens && sin.size(0) == num_tokens &&
                  cos.size(1) == head_dim && sin.size(1) == head_dim,
              "rope_bf16_: cos and sin must be [num_tokens, head_dim]");
  auto* rows = reinterpret_cast<uint16_t*>(states.data_ptr<at::BFloat16>());
  const auto* cos_rows = reinterpret_cast<const uint16_t*>(cos.data_ptr<at::BFloat16>());
  const auto* sin_rows = reinterpret_cast<const uint16_t*>(sin.data_ptr<at::BFloat16>());
  const int64_t half = head_dim / 2;
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* c = cos_rows + t * cos.stride(0);
      const uint16_t* s = sin_rows + t * sin.stride(0);
      for (int64_t h = 0; h < num_heads; ++h) {
        uint16_t* x = rows + t * states.stride(0) + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = bf16_to_float(x[i]), x2 = bf16_to_float(x[i + half]);
          x[i] = float_to_bf16(rounded(x1 * bf16_to_float(c[i])) +
                               rounded(-x2 * bf16_to_float(s[i])));
          x[i + half] = float_to_bf16(rounded(x2 * bf16_to_float(c[i + half])) +
                                      rounded(x1 * bf16_to_float(s[i + half])));
        }
      }
    }
  });
}
