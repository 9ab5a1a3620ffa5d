// The float32 vector type of the files whose loops are written with GCC's vector extensions
// (skinny_linear.cpp, silu_mul.cpp): one register of the ISA the build targets, 16 lanes on
// AVX-512 and 8 on AVX2 (elsewhere 16 lanes of generic vectors). paged_attention.cpp and
// panel_linear.cpp choose the same width beside constants of their own.
#pragma once

#include <cstdint>

namespace pagedserve {

#if defined(__AVX512F__) || !defined(__AVX2__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));

}  // namespace pagedserve
