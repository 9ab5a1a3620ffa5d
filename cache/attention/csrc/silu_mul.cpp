// SiLU(gate) * up of float32 or bfloat16 rows in one pass, rounding exactly where Hugging Face's
// LlamaMLP does.
//
// The model's MLP computes `act_fn(gate_proj(x)) * up_proj(x)`: two matrix multiplies, a SiLU pass
// and a multiply pass, each with its own allocation. engine/fused_mlp.py runs one matrix multiply
// on the concatenated [gate; up] weight instead, and this op reads its [rows, 2 * I] output once:
//   act = narrow(g / (1 + exp(-g)))       in float32, as ATen's SiLU
//   out = narrow(float(act) * float(up))  as ATen's multiply
// (narrow: to bfloat16 for a bfloat16 model, nothing for a float32 one; row_formats.h). exp is a
// Cody-Waite reduction with a degree-7 polynomial (relative error ~1e-7, its roundings), written
// as branch-free scalar code the compiler vectorises. After the rounding to bfloat16 it agrees
// with ATen's SiLU for every one of the 65,282 non-NaN bfloat16 gates (tests/engine/
// test_fused_mlp.py checks them all), so the bfloat16 op is bit-identical to the module's. In
// float32, ATen's exp (SLEEF's) and this one can differ in the last bit, so SiLU can too: both
// are within 1.5 ulps of the exact value, within 4 of each other (the tests check gates 0.001
// apart from -100 to 100 on every ISA build).
#include "aten_ops.h"

#include <cstdint>
#include <limits>

#include "row_formats.h"

namespace {

using pagedserve::bits_to_float;
using pagedserve::rounded;

// e^x as ATen's SiLU needs it: a Cody-Waite reduction x = n ln2 + r and a degree-7 polynomial for
// e^r (Taylor's: its truncation error, 5e-9 at |r| = ln2 / 2, is under a tenth of an ulp), scaled
// by 2^n as two normal factors 2^(n/2) * 2^(n - n/2) (|n| <= 128). Above ln(FLT_MAX) it is inf, as
// ATen's is; below -ln(FLT_MAX) it is 0 where ATen's may be a subnormal, which 1 + e^x rounds away
// all the same.
inline float exp_bounded(float x) {
  constexpr float kLimit = 88.72283f;  // ln(FLT_MAX)
  const bool overflow = x > kLimit, underflow = x < -kLimit;
  // Clamped by compare-and-select, which vectorises (min/max instructions); std::fmin/fmax do not
  // (their NaN rule), and made this op ten times slower. A NaN fails `x < kLimit` and becomes
  // kLimit, so n stays defined; the NaN gate still gives NaN (g / (1 + e^-g)).
  x = x < kLimit ? x : kLimit;
  x = x > -kLimit ? x : -kLimit;
  const float n = (x * 1.44269504088896341f + 0x1.8p23f) - 0x1.8p23f;  // round(x * log2(e))
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t half = static_cast<int32_t>(n) / 2;
  const float first = bits_to_float(static_cast<uint32_t>(half + 127) << 23);
  const int32_t rest = static_cast<int32_t>(n) - half;
  const float second = bits_to_float(static_cast<uint32_t>(rest + 127) << 23);
  const float value = (p * first) * second;
  return overflow ? std::numeric_limits<float>::infinity() : (underflow ? 0.0f : value);
}

// ATen's formula, g / (1 + e^-g): inf / inf gives silu(-inf) = NaN as there, a gate below -88.7
// gives -0, and a NaN gate NaN.
inline float silu(float g) { return g / (1.0f + exp_bounded(-g)); }

template <typename Format>
void silu_mul_rows(const at::Tensor& x, at::Tensor& output) {
  using T = typename Format::type;
  const int64_t width = x.size(-1), size = width / 2;
  const int64_t num_rows = size == 0 ? 0 : x.numel() / width;
  const T* src = pagedserve::elements<Format>(x);
  T* dst = pagedserve::elements<Format>(output);
  at::parallel_for(0, num_rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = src + r * width;
      const T* up = gate + size;
      T* out = dst + r * size;
#pragma omp simd
      for (int64_t i = 0; i < size; ++i) {
        const float act = rounded<Format>(silu(Format::widen(gate[i])));
        out[i] = Format::narrow(act * Format::widen(up[i]));
      }
    }
  });
}

}  // namespace

at::Tensor silu_mul(const at::Tensor& gate_up) {
  const auto dtype = gate_up.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "silu_mul takes float32 or bfloat16 input");
  TORCH_CHECK(gate_up.device().is_cpu(), "silu_mul is CPU-only");
  const int64_t width = gate_up.size(-1);
  TORCH_CHECK(width % 2 == 0, "the last dimension must be [gate; up], even; got ", width);
  const auto x = gate_up.contiguous();
  auto output_shape = x.sizes().vec();
  output_shape.back() = width / 2;
  auto output = at::empty(output_shape, x.options());
  if (dtype == at::kBFloat16) {
    silu_mul_rows<pagedserve::Bfloat16>(x, output);
  } else {
    silu_mul_rows<pagedserve::Float32>(x, output);
  }
  return output;
}
