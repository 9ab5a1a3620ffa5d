// SiLU(gate) * up of bfloat16 rows in one pass, rounding exactly where Hugging Face's LlamaMLP does.
//
// The model's MLP computes `act_fn(gate_proj(x)) * up_proj(x)`: two matrix multiplies, a SiLU pass
// and a multiply pass, each with its own allocation. engine/fused_mlp.py runs one matrix multiply
// on the concatenated [gate; up] weight instead, and this op reads its [rows, 2 * I] output once:
//   act = bf16(g / (1 + exp(-g)))        in float32, as ATen's bfloat16 SiLU
//   out = bf16(float(act) * float(up))   as ATen's bfloat16 multiply
// exp is a Cody-Waite reduction with a degree-6 polynomial (relative error ~1e-7), written as
// branch-free scalar code the compiler vectorises. After the rounding to bfloat16 it agrees with
// ATen's SiLU for every one of the 65,282 non-NaN bfloat16 gates (tests/engine/test_fused_mlp.py
// checks them all), so the op is bit-identical to the module's act_fn(gate) * up. bfloat16 only.
#include "aten_ops.h"

#include <cmath>
#include <cstdint>

#include "bfloat16_bits.h"

namespace {

using pagedserve::bf16_to_float;
using pagedserve::bits_to_float;
using pagedserve::float_to_bf16;

// e^x for x <= 0: the attention kernel's exp_nonpositive, one lane, extended into the subnormals
// as ATen's SiLU, x / (1 + e^-x), is: it keeps tiny values down to x = -ln(FLT_MAX) = -88.72,
// where e^-x overflows and the quotient becomes 0. So this returns 0 below that, -inf included,
// and applies 2^n as two normal factors, 2^(n/2) * 2^(n - n/2), so that e^x may be subnormal.
inline float exp_nonpositive(float x) {
  const bool in_range = x >= -88.72283f;
  x = in_range ? x : -88.72283f;
  const float n = (x * 1.44269504088896341f + 0x1.8p23f) - 0x1.8p23f;  // round(x * log2(e))
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t half = static_cast<int32_t>(n) / 2;  // both factors >= 2^-64: normal floats
  const float first = bits_to_float(static_cast<uint32_t>(half + 127) << 23);
  const float second = bits_to_float(static_cast<uint32_t>(static_cast<int32_t>(n) - half + 127) << 23);
  return in_range ? (p * first) * second : 0.0f;
}

// g / (1 + e^-g) without overflow: e = e^-|g| <= 1, and for g < 0, g * e / (1 + e) is the same.
inline float silu(float g) {
  const float e = exp_nonpositive(-std::fabs(g));
  return (g >= 0.0f ? g : g * e) / (1.0f + e);
}

}  // namespace

at::Tensor silu_mul_bf16(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, "silu_mul_bf16 takes bfloat16 input");
  TORCH_CHECK(gate_up.device().is_cpu(), "silu_mul_bf16 is CPU-only");
  const int64_t width = gate_up.size(-1);
  TORCH_CHECK(width % 2 == 0, "the last dimension must be [gate; up], even; got ", width);
  const int64_t size = width / 2;
  const auto x = gate_up.contiguous();
  auto output_shape = x.sizes().vec();
  output_shape.back() = size;
  auto output = at::empty(output_shape, x.options());
  const int64_t num_rows = size == 0 ? 0 : x.numel() / width;
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(output.data_ptr<at::BFloat16>());
  at::parallel_for(0, num_rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* gate = src + r * width;
      const uint16_t* up = gate + size;
      uint16_t* out = dst + r * size;
#pragma omp simd
      for (int64_t i = 0; i < size; ++i) {
        const float act = bf16_to_float(float_to_bf16(silu(bf16_to_float(gate[i]))));
        out[i] = float_to_bf16(act * bf16_to_float(up[i]));
      }
    }
  });
  return output;
}
