// Rotary position embedding of float32 or bfloat16 query and key heads, in place, rounding exactly
// where Hugging Face's apply_rotary_pos_emb does.
//
// apply_rotary_pos_emb computes `q * cos + rotate_half(q) * sin` with rotate_half(x) = cat(-x2,
// x1): a slice, a negation, a concatenation, two multiplies and an add, each a separate tensor,
// for q and for k, in every layer (in a profile of the float32 workload, 5.6 s of 60). The fused
// Q/K/V projection's output (engine/fused_attention.py) holds each token's q and k heads side by
// side, and this rotates them in place:
//   out[i]         = narrow(narrow(x1[i] * cos[i])         + narrow(-x2[i] * sin[i]))
//   out[i + D / 2] = narrow(narrow(x2[i] * cos[i + D / 2]) + narrow( x1[i] * sin[i + D / 2]))
// for i < D / 2 (narrow: to bfloat16 for a bfloat16 model, nothing for a float32 one;
// row_formats.h): each product and the sum in float32 then rounded, as ATen's multiply and add are
// (the negation is exact, and rounding is symmetric in sign), so the bits are the module's. For
// that the products must not be contracted into the sums (an FMA rounds once where ATen's separate
// ops round twice): this file is compiled without contraction.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#include "aten_ops.h"

#include <cstdint>

#include "row_formats.h"

namespace {

using pagedserve::rounded;

template <typename Format>
void rotate_rows(const at::Tensor& states, const at::Tensor& cos, const at::Tensor& sin,
                 int64_t num_heads, int64_t head_dim) {
  using T = typename Format::type;
  T* rows = pagedserve::elements<Format>(states);
  const T* cos_rows = pagedserve::elements<Format>(cos);
  const T* sin_rows = pagedserve::elements<Format>(sin);
  const int64_t half = head_dim / 2;
  at::parallel_for(0, states.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos_rows + t * cos.stride(0);
      const T* s = sin_rows + t * sin.stride(0);
      for (int64_t h = 0; h < num_heads; ++h) {
        T* x = rows + t * states.stride(0) + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = Format::widen(x[i]), x2 = Format::widen(x[i + half]);
          x[i] = Format::narrow(rounded<Format>(x1 * Format::widen(c[i])) +
                                rounded<Format>(-x2 * Format::widen(s[i])));
          x[i + half] = Format::narrow(rounded<Format>(x2 * Format::widen(c[i + half])) +
                                       rounded<Format>(x1 * Format::widen(s[i + half])));
        }
      }
    }
  });
}

}  // namespace

void rope_(const at::Tensor& states, const at::Tensor& cos, const at::Tensor& sin,
           int64_t num_heads, int64_t head_dim) {
  RECORD_FUNCTION("pagedserve::rope_", std::vector<c10::IValue>());
  const auto dtype = states.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "rope_ takes float32 or bfloat16");
  for (const auto* tensor : {&states, &cos, &sin}) {
    TORCH_CHECK(tensor->scalar_type() == dtype && tensor->device().is_cpu(),
                "rope_ takes CPU tensors of one dtype (states, cos and sin)");
    TORCH_CHECK(tensor->dim() == 2 && tensor->stride(1) == 1, "rope_ takes 2-D row tensors "
                "with contiguous rows");
  }
  const int64_t num_tokens = states.size(0);
  TORCH_CHECK(head_dim % 2 == 0 && num_heads * head_dim <= states.size(1),
              "rope_: ", num_heads, " heads of ", head_dim, " (even) exceed the row of ",
              states.size(1));
  TORCH_CHECK(cos.size(0) == num_tokens && sin.size(0) == num_tokens &&
                  cos.size(1) == head_dim && sin.size(1) == head_dim,
              "rope_: cos and sin must be [num_tokens, head_dim]");
  if (dtype == at::kBFloat16) {
    rotate_rows<pagedserve::Bfloat16>(states, cos, sin, num_heads, head_dim);
  } else {
    rotate_rows<pagedserve::Float32>(states, cos, sin, num_heads, head_dim);
  }
}
