// Transposes of kLanes x kLanes blocks of 32-bit values in registers: part of paged_attention.cpp,
// included inside its namespace after kLanes, vfloat, load and store. tile_attention.h transposes
// bfloat16 pairs of keys with the AVX-512 network; float_tiles.h packs Q^T a block at a time.
#pragma once

#if defined(__AVX512F__)
// In-register transpose of 16 rows of 16 32-bit lanes (the standard unpack/shuffle network).
inline void transpose_16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // Each 128-bit lane now holds a transposed 4 x 4 block; move the blocks into place.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
// The same for 8 rows of 8 floats (AVX2).
inline void transpose_8x8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // each 128-bit lane: a transposed 4 x 4 block
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
    t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
  }
  for (int i = 0; i < 8; ++i) r[i] = t[i];
}
#endif

// dst[i * dst_stride + r] = rows[r][column + i] for r, i < kLanes: one block of a transpose.
inline void transpose_block(const float* const* rows, int column, float* dst,
                            int64_t dst_stride) {
#if defined(__AVX512F__) && PAGEDSERVE_LANES == 16
  __m512i block[16];
  for (int r = 0; r < 16; ++r) block[r] = _mm512_loadu_si512(rows[r] + column);
  transpose_16x16(block);
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * dst_stride, block[i]);
#elif defined(__AVX2__) && PAGEDSERVE_LANES == 8
  __m256 block[8];
  for (int r = 0; r < 8; ++r) block[r] = _mm256_loadu_ps(rows[r] + column);
  transpose_8x8(block);
  for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + i * dst_stride, block[i]);
#else
  for (int i = 0; i < kLanes; ++i)
    for (int r = 0; r < kLanes; ++r) dst[i * dst_stride + r] = rows[r][column + i];
#endif
}
