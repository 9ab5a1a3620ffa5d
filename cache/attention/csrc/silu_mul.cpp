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
// once, over a float or a vector of floats (float32 rows run the vectors: GCC left a loop of the
// scalar version scalar on AVX2 builds). After the rounding to bfloat16 it agrees
// with ATen's SiLU for every one of the 65,282 non-NaN bfloat16 gates (tests/engine/
// test_fused_mlp.py checks them all), so the bfloat16 op is bit-identical to the module's (it
// looks each gate's value up in a table of them: bfloat16_silu_table). In float32, ATen's exp
// (SLEEF's) and this one can differ in the last bit, so SiLU can too: both are within 1.5 ulps of
// the exact value, within 4 of each other (the tests check gates 0.001 apart from -100 to 100 on
// every ISA build).
#include "aten_ops.h"

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "float_vectors.h"
#include "row_formats.h"

namespace {

using pagedserve::bits_to_float;
using pagedserve::rounded;

constexpr float kExpLimit = 88.72283f;  // ln(FLT_MAX)

// The float32 loop (silu_mul_rows) runs on explicit vectors of kLanes floats, one AVX-512 or AVX2
// register (float_vectors.h; GCC's vector extensions: each select below is a blend). GCC 12 left
// the loop scalar on AVX2 builds (-march=x86-64-v3, and native builds on AVX2-only CPUs such as
// -march=znver2/3) when it was written over scalar silu(): jump threading copied the division into
// the branches of the range selects, where it may trap, and under -ftrapping-math such branches are
// not turned into vector selects (AVX-512 builds mask them instead). On vectors there are no
// branches: every lane computes the division, whose operands are normal for every gate but those
// beyond the clamps (selected away). The functions below are templates over float (the bfloat16
// table's lanes) and vfloat, so both take the same operations in the same order: the same bits as
// the scalar loop's builds (checked on 300,000 gates, specials included). The default model's MLP
// in the AVX2 build on Sapphire Rapids: 207 -> 43 us at 64 rows, 1,521 -> 375 us at 512 (the
// AVX-512 builds, unchanged: 29-32 and 288-301).
using pagedserve::kLanes;  // float_vectors.h
using pagedserve::vfloat;
using pagedserve::vint;

// What exp_in_range needs beyond arithmetic, for one float or a vector of them: truncation to
// integers, and 2^e for -126 <= e <= 127 from its exponent bits.
inline int32_t truncated(float v) { return static_cast<int32_t>(v); }
inline vint truncated(vfloat v) { return __builtin_convertvector(v, vint); }
inline float power_of_two(int32_t e) { return bits_to_float(static_cast<uint32_t>(e + 127) << 23); }
inline vfloat power_of_two(vint e) { return reinterpret_cast<vfloat>((e + 127) << 23); }

// e^x for |x| <= kExpLimit (silu clamps x there): a Cody-Waite reduction x = n ln2 + r and a
// degree-7 polynomial for e^r (Taylor's: its truncation error, 5e-9 at |r| = ln2 / 2, is under a
// tenth of an ulp), scaled by 2^n as two normal factors 2^(n/2) * 2^(n - n/2) (|n| <= 128).
template <typename V>
inline V exp_in_range(V x) {
  const V n = (x * 1.44269504088896341f + 0x1.8p23f) - 0x1.8p23f;  // round(x * log2(e))
  const V r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  V p = V{} + 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const auto whole = truncated(n);
  const auto half = whole / 2;
  return (p * power_of_two(half)) * power_of_two(whole - half);
}

// ATen's formula, g / (1 + e^-g), with one division. Where e^-g leaves float's range ATen's exp
// gives inf (g < -ln(FLT_MAX)) or 0 or a subnormal (g > ln(FLT_MAX)), and the formula then gives
// g * 0 (-0, or NaN for g = -inf: inf / inf) or g / 1; those cases are selected after the one
// division of the clamped value. Selecting e^-g first (inf, 0 or the polynomial), then dividing,
// reads the same, but GCC divided under each of the three masks: same bits, 1.07x (float32) and
// 1.2x (bfloat16) the time per call at 64 and 2,048 rows of the default model's MLP (2-core Zen
// 4, native build, 40 shuffled rounds). At 2,048 rows the op moves ~42 GB/s: memory-bound
// now. A NaN gate fails both compares and gives NaN from the division.
template <typename V>
inline V silu(V g) {
  // Clamped by compare-and-select (min/max instructions, or blends); std::fmin/fmax do not
  // vectorise (their NaN rule), and made this op ten times slower. A NaN becomes kExpLimit, so n
  // stays defined.
  V x = -g < kExpLimit ? -g : kExpLimit;
  x = x > -kExpLimit ? x : -kExpLimit;
  const V in_range = g / (1.0f + exp_in_range(x));
  return g > kExpLimit ? g : (g < -kExpLimit ? g * 0.0f : in_range);
}

// A bfloat16 gate has 65,536 possible values, so its SiLU, rounded to bfloat16, is looked up rather
// than computed: the table holds this file's own silu() of every one (built once, 256 KiB of
// float32), so the op's bits are unchanged, NaNs included. In the vector loop GCC 12 reads the
// table with one scalar load per lane (no hardware gather in the native, AVX-512 or AVX2 build,
// nor when tuned for AMD's cores, whose gathers are slow), which still beats the polynomial and
// its division: the default model's SiLU-and-multiply took 51.7 -> 29.1 us at 64 rows and 1.69 ->
// 1.09 ms at 2,048 (2-core Sapphire Rapids, native build, interleaved calls).
const float* bfloat16_silu_table() {
  static const std::vector<float> table = [] {
    std::vector<float> values(1 << 16);
    for (uint32_t bits = 0; bits < values.size(); ++bits) {
      const float gate = pagedserve::Bfloat16::widen(static_cast<uint16_t>(bits));
      values[bits] = rounded<pagedserve::Bfloat16>(silu(gate));
    }
    return values;
  }();
  return table.data();
}

template <typename Format>
void silu_mul_rows(const at::Tensor& x, at::Tensor& output) {
  using T = typename Format::type;
  const int64_t width = x.size(-1), size = width / 2;
  const int64_t num_rows = size == 0 ? 0 : x.numel() / width;
  const T* src = pagedserve::elements<Format>(x);
  T* dst = pagedserve::elements<Format>(output);
  constexpr bool kBfloat16 = std::is_same_v<Format, pagedserve::Bfloat16>;
  const float* silu_of = kBfloat16 ? bfloat16_silu_table() : nullptr;  // before the threads
  at::parallel_for(0, num_rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = src + r * width;
      const T* up = gate + size;
      T* out = dst + r * size;
      if constexpr (kBfloat16) {
#pragma omp simd
        for (int64_t i = 0; i < size; ++i) {
          out[i] = Format::narrow(silu_of[gate[i]] * Format::widen(up[i]));
        }
      } else {  // float32: rounded() and narrow() are the identity
        int64_t i = 0;
        for (; i + kLanes <= size; i += kLanes) {
          vfloat g, u;
          std::memcpy(&g, gate + i, sizeof(g));
          std::memcpy(&u, up + i, sizeof(u));
          const vfloat product = silu(g) * u;
          std::memcpy(out + i, &product, sizeof(product));
        }
        for (; i < size; ++i) out[i] = silu(gate[i]) * up[i];
      }
    }
  });
}

}  // namespace

at::Tensor silu_mul(const at::Tensor& gate_up) {
  RECORD_FUNCTION("pagedserve::silu_mul", std::vector<c10::IValue>());
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
