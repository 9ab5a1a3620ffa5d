// bfloat16 <-> float32 by bit operations, for the CPU extension's bfloat16 paths (row_formats.h,
// the attention kernel, greedy.cpp).
//
// A bfloat16 is the high half of a float32, so widening is a shift and narrowing is a rounding of
// the low half (to nearest, ties to even; NaN stays a quiet NaN). c10's BFloat16 conversions are
// the same arithmetic, but GCC leaves loops of them scalar (4-5x slower here); these vectorise
// under `#pragma omp simd`.
#pragma once

#include <cstdint>
#include <cstring>

namespace pagedserve {

inline float bits_to_float(uint32_t word) {
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

inline uint32_t float_to_bits(float value) {
  uint32_t word;
  std::memcpy(&word, &value, sizeof(word));
  return word;
}

inline float bf16_to_float(uint16_t bits) { return bits_to_float(static_cast<uint32_t>(bits) << 16); }

inline uint16_t float_to_bf16(float value) {
  const uint32_t word = float_to_bits(value);
  const uint32_t rounded = (word + 0x7FFF + ((word >> 16) & 1)) >> 16;
  return value != value ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
}

}  // namespace pagedserve
