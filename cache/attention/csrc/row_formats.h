// The element formats of the fused ops (rms_norm.cpp, silu_mul.cpp, rope.cpp): each op is written
// once over a Format, and rounds to it wherever Hugging Face's module rounds to the model's dtype.
//
//   Format::type       what a row holds (float, or a bfloat16's bits)
//   Format::widen(x)   that element as a float32, exactly
//   Format::narrow(v)  a float32 rounded to the format (to nearest even; the identity for float32)
//
// With Float32, `rounded(v)` is v itself, so an op computes float32 throughout, as the module does
// for a float32 model; with Bfloat16, every intermediate the module materialises as a bfloat16
// tensor is rounded here at the same place.
#pragma once

#include <cstdint>

#include "bfloat16_bits.h"

namespace pagedserve {

struct Float32 {
  using type = float;
  static float widen(float x) { return x; }
  static float narrow(float v) { return v; }
};

struct Bfloat16 {
  using type = uint16_t;
  static float widen(uint16_t x) { return bf16_to_float(x); }
  static uint16_t narrow(float v) { return float_to_bf16(v); }
};

// v as Format stores it, back in float32.
template <typename Format>
inline float rounded(float v) {
  return Format::widen(Format::narrow(v));
}

// A tensor's elements as Format's type (the tensor's dtype is checked by the caller).
template <typename Format, typename Tensor>
inline typename Format::type* elements(const Tensor& tensor) {
  return static_cast<typename Format::type*>(tensor.data_ptr());
}

}  // namespace pagedserve
