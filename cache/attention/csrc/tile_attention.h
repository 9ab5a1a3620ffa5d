// Prefill attention over a bfloat16 cache as tile products: part of paged_attention.cpp, included
// inside its namespace after the vector helpers it uses (exp_nonpositive, vfloat), where the build
// targets AVX512_BF16 (-march=native on Zen 4, Cooper Lake, Sapphire Rapids and later).
//
// The vector path scores a row against a key with one dot product at a time (and a horizontal sum
// per key) and accumulates values with one FMA per value vector. Here both products of attention
// run per span of 32 keys on operands packed once per span and shared by every row of the item
// (up to 64 tokens x the GQA group), in groups of 16 rows:
//
//   S (rows x 32 keys) = Q (rows x head_dim) . K^T
//   O (rows x head_dim) += P (rows x 32 keys) . V
//
// The right operands hold pairs of values along the summed dimension ("VNNI" layout): for K^T, row
// r is the dims (2r, 2r+1) of each of 16 keys, a 16 x 16 transpose of 32-bit pairs of the cached
// rows; for V, row r is keys (2r, 2r+1) interleaved for each of 16 dims. Both are packed once per
// 32 keys from the cache (through the block table: block_size is a multiple of 16, so 16
// consecutive keys are 16 equally spaced slots of one block). Two engines multiply them:
//   - AMX (Sapphire Rapids and later, where Linux grants the tile state): one instruction
//     multiplies a 16 x 32 bfloat16 tile by a 32 x 16 one into 16 x 16 float32 sums. A 1,024-token
//     chunk went from 30-45 GFLOP/s on the vector path to 120 (benchmarks/RESULTS.md, "Eleventh
//     session").
//   - AVX512_BF16 (vdpbf16ps): one instruction multiplies a 32-bit pair of a row (Q's dims, or P's
//     keys), broadcast, into 16 keys' (or 16 dims') pairs: 16 rows' worth of register blocking
//     replaces the vector path's per-key horizontal sums.
// Between the two products each row's online softmax (running maximum, rescaled sums) runs on its
// 32 scores as two AVX-512 vectors, 16 rows at a time (softmax_group), and its probabilities are
// rounded to bfloat16 for the second product (as SDPA's bfloat16 kernel does); sums, maxima and
// accumulators stay float32. A row's accumulators are rescaled only when its maximum passes the
// reference by a margin (kRescaleMargin), which lets AMX keep them in tile registers.
//
// attend_head packs a block of 8 spans, then runs each group of rows over all of them before the
// next group: at head_dim 64 the group's Q and O stay in AMX tiles for the block. With the
// 64-token items, the margin and shorter exponentials (exp2_lanes), a 1,024-token chunk on AMX
// took 1.59-1.65 ms against 2.02-2.29 before (1.27-1.42x; 2-core Sapphire Rapids, both builds in
// one process, interleaved rounds); software-pipelining the next span's scores ahead of the
// softmax gained nothing.
//
// Keys outside [first_key, num_keys) never reach a sum: their scores are masked to -inf (so their
// probability is 0) and their packed values are zeros, since 0 * a stale slot's NaN would be NaN.
//
// The AMX part needs amx_tiles.h (permission, tile shape), included at the top of
// paged_attention.cpp.
#pragma once

namespace tiles {

#ifdef PAGEDSERVE_AMX
// The tiles by role. Macros, not constants: GCC's AMX intrinsics paste the tile number into the
// instruction's text, so it must be a literal by the time they see it.
#define AMX_SCORES0 0  // S for keys 0-15 of the span
#define AMX_SCORES1 1  // S for keys 16-31
#define AMX_QUERY 2    // a 32-dim slice of Q
#define AMX_KEYS 3     // the same 32 dims of K^T
#define AMX_OUTPUT 4   // 16 dims of O
#define AMX_PROBS 5    // P
#define AMX_VALUES 6   // the same 16 dims of V
// At head_dim 64, where a group's Q and O stay in tiles (AmxProducts):
#define AMX_HELD_OUTPUT0 0  // O, dims 0-15
#define AMX_HELD_OUTPUT1 1  // dims 16-31
#define AMX_HELD_OUTPUT2 2  // dims 32-47
#define AMX_HELD_OUTPUT3 3  // dims 48-63
#define AMX_HELD_QUERY0 4   // Q, dims 0-31
#define AMX_HELD_QUERY1 5   // dims 32-63
#define AMX_HELD_SCORES 6   // S for 16 keys; then P
#define AMX_HELD_PROBS 6
#define AMX_HELD_KEYS 7     // 32 dims of K^T for 16 keys; then 16 dims of V
#define AMX_HELD_VALUES 7

#endif  // PAGEDSERVE_AMX

// One kv head of one work item: `num_rows` query rows (row m is token m / group_size of the item,
// at position first_position + m / group_size) against keys [first_key, num_keys) of the request.
struct HeadTask {
  const uint16_t* const* query_rows;  // bfloat16 [head_dim] each
  uint16_t* const* output_rows;       // bfloat16 [head_dim] each
  const float* row_sinks;             // one sink logit per row, or nullptr
  int num_rows, group_size, first_position;
  // At this kv head: key of slot s at key_cache + s * slot_stride elements, bfloat16 or fp8
  // (attend_head's FP8: converted to bfloat16 by Fp8ToBf16 as the tiles are packed).
  const void* key_cache;
  const void* value_cache;
  int64_t slot_stride;
  const int32_t* block_table;
  int block_size, first_key, num_keys, sliding_window;
  float scale, softcap;
};

// Packs 16 consecutive keys (slots slot0.. of one block) as K^T tiles (keys_t: head_dim/32 tiles
// of 16 x 16 pairs) and their values as rows [8 * half, 8 * half + 8) of the V tiles (values_vnni:
// head_dim/16 tiles of 16 key pairs x 16 dims); values of keys outside [valid_begin, valid_end)
// are packed as zeros (their keys are masked by softmax_group).
// 32 values of a cache row from element `offset`, as bfloat16.
template <bool FP8>
inline __m512i load_32(const void* cache, int64_t offset) {
#ifdef PAGEDSERVE_FP8_AS_BF16
  if constexpr (FP8) return fp8_to_bf16().convert32(static_cast<const Fp8E4M3*>(cache) + offset);
#else
  static_assert(!FP8, "fp8 tiles need PAGEDSERVE_FP8_AS_BF16");
#endif
  return _mm512_loadu_si512(static_cast<const uint16_t*>(cache) + offset);
}

template <int HEAD_DIM, bool FP8>
inline void pack_16_keys(const HeadTask& task, int64_t slot0, int half, int valid_begin,
                         int valid_end, uint32_t (*keys_t)[16][16],
                         uint16_t (*values_vnni)[16][32]) {
  for (int c = 0; c < HEAD_DIM / 32; ++c) {
    __m512i rows[16];
    for (int n = 0; n < 16; ++n)
      rows[n] = load_32<FP8>(task.key_cache, (slot0 + n) * task.slot_stride + c * 32);
    transpose_16x16(rows);
    for (int r = 0; r < 16; ++r) _mm512_store_si512(keys_t[c][r], rows[r]);
  }
  // Interleaving indices: dims 0-15 (low) or 16-31 (high) of two keys' 32-dim slices.
  alignas(64) static const uint16_t kLow[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                 53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
  for (int pair = 0; pair < 8; ++pair) {
    const int a = 2 * pair, b = a + 1;
    const bool a_valid = a >= valid_begin && a < valid_end;
    const bool b_valid = b >= valid_begin && b < valid_end;
    const int64_t value_a = (slot0 + a) * task.slot_stride;
    const int64_t value_b = (slot0 + b) * task.slot_stride;
    for (int c = 0; c < HEAD_DIM / 32; ++c) {
      const __m512i zero = _mm512_setzero_si512();
      const __m512i va = a_valid ? load_32<FP8>(task.value_cache, value_a + c * 32) : zero;
      const __m512i vb = b_valid ? load_32<FP8>(task.value_cache, value_b + c * 32) : zero;
      const int row = 8 * half + pair;
      _mm512_store_si512(values_vnni[2 * c][row], _mm512_permutex2var_epi16(va, low, vb));
      _mm512_store_si512(values_vnni[2 * c + 1][row], _mm512_permutex2var_epi16(va, high, vb));
    }
  }
}

// Packs the keys [key_base, key_base + 32) of the task, as zeros past num_keys.
template <int HEAD_DIM, bool FP8>
inline void pack_span(const HeadTask& task, int key_base,
                      uint32_t (*keys_t)[HEAD_DIM / 32][16][16],
                      uint16_t (*values_vnni)[16][32]) {
  for (int half = 0; half < 2; ++half) {
    const int begin = key_base + 16 * half;
    if (begin >= task.num_keys) {  // past the request's keys: no block to read
      std::memset(keys_t[half], 0, sizeof(keys_t[half]));
      for (int g = 0; g < HEAD_DIM / 16; ++g) std::memset(values_vnni[g][8 * half], 0, 8 * 64);
      continue;
    }
    const int64_t slot0 = static_cast<int64_t>(task.block_table[begin / task.block_size]) *
                              task.block_size + begin % task.block_size;
    pack_16_keys<HEAD_DIM, FP8>(task, slot0, half, task.first_key - begin, task.num_keys - begin,
                           keys_t[half], values_vnni);
  }
}

// 2^t, 16 lanes, for t <= 8 (the probabilities below: at most the rescaling margin's 256). t = n + f
// with n an integer and |f| <= 1/2; 2^f by a degree-5 polynomial (a relative minimax fit: error
// ~2e-7 in float32, rounding level), times 2^n by vscalefps. Lanes below -125 (near float32's
// subnormals, which cost microcode assists, and as good as 0 after normalising), -inf and NaN
// included, give exactly 0. 10 instructions where exp_nonpositive's portable version takes ~17:
// the softmax is bound by the vector units' throughput, and this took a 1,024-token bfloat16
// chunk from 1.93 to 1.75 ms on AMX (2-core Sapphire Rapids, interleaved rounds).
inline __m512 exp2_lanes(__m512 t) {
  const __mmask16 in_range = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-125.0f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3264563167467713e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.671463631093502e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550733581185341e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022242426872253e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931470036506653e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(in_range, p, n);
}

constexpr float kLog2e = 1.44269504088896341f;
// How far (in logits) a row's maximum may pass the reference its probabilities are taken against
// before the reference moves: ln 256, so a probability is at most 256, which float32 sums and
// bfloat16 probabilities hold with their usual relative precision. Moving the reference means
// rescaling what the row accumulated (online softmax); with the margin that happens a few times a
// row, not on every span whose maximum grew by a little.
constexpr float kRescaleMargin = 5.545177444479562f;

// The online softmax of one group's 16 rows over one span's 32 scores (scores: 16 x 32 float32,
// raw q . k, or scaled and masked in place): probabilities into probs (bfloat16, the P tile's
// rows) under each row's reference maximum (group_max), and the rows' sums (group_sum) carried to
// that reference. Returns the rows whose accumulators must be multiplied by factors[r] because
// their reference moved (rows that had accumulated nothing need not be). Rows past the item's
// last are padding: probability 0 everywhere.
//
// The 16 rows' maxima and sums are each one vector, reduced across lanes for all rows at once
// (transposed_max, transposed_sum: 15 operations and 30 shuffles for 16 rows), and the rescaling
// factors one vector exponential. Row by row (a horizontal maximum and sum per row, and libm's
// exp for each row whose maximum grew) the softmax was 56% of a 1,024-token bfloat16 chunk on
// AMX (2.55 ms, against 1.12 ms with it replaced by a plain conversion); 16 rows at a time the
// chunk takes 1.94-2.04 ms against 2.90-3.08 (1.5x; 393-416 -> 592-622 GFLOP/s), and 7.61 against
// 8.21 ms on the AVX512_BF16 products without AMX (interleaved rounds, 2-core Sapphire Rapids).
// Masks are built only for spans on the causal diagonal or a window's edge.
template <int HEAD_DIM>
inline __mmask16 softmax_group(const HeadTask& task, int group, int key_base, float (*scores)[32],
                               uint16_t (*probs)[32], float* group_max, float* group_sum,
                               float* factors) {
  const int m0 = group * 16;
  const int last_row = std::min(task.num_rows, m0 + 16) - 1;
  const int low_position = task.first_position + m0 / task.group_size;
  const int high_position = task.first_position + last_row / task.group_size;
  // Every row of the group sees all 32 keys: the first row's position is past the span, and the
  // last real row's window (if any) starts before it. (Padding rows are -inf either way.)
  const bool unmasked =
      key_base + 31 <= low_position &&
      (task.sliding_window <= 0 || key_base >= high_position - task.sliding_window + 1);
  // Unmasked spans without a softcap keep their raw scores: the maxima are taken raw (scaling by
  // a positive number keeps the order) and the scale is folded into the exponent below. Other
  // spans are scaled, capped and masked in place first.
  const bool raw = unmasked && task.softcap <= 0.0f;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scale = _mm512_set1_ps(task.scale);
  vfloat row_maxima[16];
  for (int r = 0; r < 16; ++r) {
    const int m = m0 + r;
    __m512 x[2];
    if (m > last_row) {
      x[0] = x[1] = minus_inf;
    } else if (raw) {
      for (int h = 0; h < 2; ++h) x[h] = _mm512_load_ps(scores[r] + 16 * h);
    } else {
      for (int h = 0; h < 2; ++h) x[h] = _mm512_mul_ps(_mm512_load_ps(scores[r] + 16 * h), scale);
      if (task.softcap > 0.0f) {
        alignas(64) float s[32];
        _mm512_store_ps(s, x[0]);
        _mm512_store_ps(s + 16, x[1]);
        for (float& v : s) v = task.softcap * std::tanh(v / task.softcap);
        x[0] = _mm512_load_ps(s);
        x[1] = _mm512_load_ps(s + 16);
      }
      if (!unmasked) {
        const int position = task.first_position + m / task.group_size;
        const int oldest = task.sliding_window > 0 ? position - task.sliding_window + 1 : 0;
        for (int h = 0; h < 2; ++h) {
          const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(key_base + 16 * h));
          const __mmask16 visible = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(position)) &
                                    _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(oldest));
          x[h] = _mm512_mask_mov_ps(minus_inf, visible, x[h]);
        }
      }
    }
    if (m > last_row || !raw) {
      _mm512_store_ps(scores[r], x[0]);
      _mm512_store_ps(scores[r] + 16, x[1]);
    }
    row_maxima[r] = (vfloat)_mm512_max_ps(x[0], x[1]);
  }
  __m512 span_max = (__m512)transposed_max(row_maxima);
  if (raw) span_max = _mm512_mul_ps(span_max, scale);
  // A row's reference moves to the span's maximum only past the margin (from -inf: at its first
  // visible key).
  const __m512 old_max = _mm512_loadu_ps(group_max);
  const __mmask16 moved = _mm512_cmp_ps_mask(
      span_max, _mm512_add_ps(old_max, _mm512_set1_ps(kRescaleMargin)), _CMP_GT_OQ);
  const __m512 new_max = _mm512_mask_mov_ps(old_max, moved, span_max);
  // Rows that have seen no key yet, here or before, subtract 0: their -inf scores give 0.
  const __mmask16 seen = _mm512_cmp_ps_mask(new_max, minus_inf, _CMP_NEQ_OQ);
  // p = e^(score * scale - reference) = 2^(score * c - reference * log2(e)), c = scale * log2(e)
  // for raw scores and log2(e) for scaled ones: one fused multiply-subtract per vector.
  const __m512 c = _mm512_set1_ps(raw ? task.scale * kLog2e : kLog2e);
  alignas(64) float base[16];
  _mm512_store_ps(base, _mm512_mul_ps(_mm512_maskz_mov_ps(seen, new_max), _mm512_set1_ps(kLog2e)));
  vfloat row_sums[16];
  for (int r = 0; r < 16; ++r) {
    const __m512 b = _mm512_set1_ps(base[r]);
    const __m512 p0 = exp2_lanes(_mm512_fmsub_ps(_mm512_load_ps(scores[r]), c, b));
    const __m512 p1 = exp2_lanes(_mm512_fmsub_ps(_mm512_load_ps(scores[r] + 16), c, b));
    row_sums[r] = (vfloat)_mm512_add_ps(p0, p1);
    _mm512_store_si512(probs[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));  // keys 0-15, then 16-31
  }
  // e^(old - new) for rows whose reference moved (0 from -inf: nothing accumulated yet), e^0 = 1
  // for the others.
  const __m512 correction = exp2_lanes(_mm512_maskz_mul_ps(
      moved, _mm512_sub_ps(old_max, new_max), _mm512_set1_ps(kLog2e)));
  _mm512_storeu_ps(group_sum, _mm512_fmadd_ps(_mm512_loadu_ps(group_sum), correction,
                                              (__m512)transposed_sum(row_sums)));
  _mm512_storeu_ps(group_max, new_max);
  const __mmask16 rescale = moved & _mm512_cmp_ps_mask(old_max, minus_inf, _CMP_NEQ_OQ);
  if (rescale != 0) _mm512_storeu_ps(factors, correction);
  return rescale;
}

// Each row r in `rows` of a group's accumulators (16 x head_dim float32) times factors[r].
template <int HEAD_DIM>
inline void scale_rows(float* group_acc, __mmask16 rows, const float* factors) {
  for (unsigned left = rows; left != 0; left &= left - 1) {
    const int r = __builtin_ctz(left);
    const __m512 factor = _mm512_set1_ps(factors[r]);
    float* acc = group_acc + r * HEAD_DIM;
    for (int d = 0; d < HEAD_DIM; d += 16)
      _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), factor));
  }
}

// One span's K^T and V tiles, packed for the products (pack_span).
template <int HEAD_DIM>
struct SpanTiles {
  alignas(64) uint32_t keys_t[2][HEAD_DIM / 32][16][16];
  alignas(64) uint16_t values_vnni[HEAD_DIM / 16][16][32];
};

// The products of attention for one group of 16 rows, span after span: scores (16 x 32 float32)
// = Q . K^T, with group_query 16 rows of head_dim bfloat16; then group_acc (16 rows of head_dim
// float32) += P . V. Padding rows past an item's last are zeros in Q and P. begin_group and
// end_group bracket a group's spans; rescale multiplies accumulator rows (softmax_group).
#ifdef PAGEDSERVE_AMX
// At head_dim 64 a group's Q (2 tiles) and O (4 tiles) stay in tile registers across its spans,
// leaving two for the operands: a span then takes 9 tile loads and 2 stores where loading and
// storing O and Q each span took 21 (tile loads and stores, not the products, bound this path).
// At head_dim 128, O alone would fill all 8 tiles: O is loaded and stored each span.
class AmxProducts {
 public:
  AmxProducts() {
    const amx::TileConfig config;
    _tile_loadconfig(&config);
  }
  ~AmxProducts() { _tile_release(); }
  AmxProducts(const AmxProducts&) = delete;
  AmxProducts& operator=(const AmxProducts&) = delete;

  template <int HEAD_DIM>
  void begin_group(const uint16_t* group_query, const float* group_acc) const {
    if constexpr (HEAD_DIM == 64) {
      _tile_loadd(AMX_HELD_QUERY0, group_query, 64 * sizeof(uint16_t));
      _tile_loadd(AMX_HELD_QUERY1, group_query + 32, 64 * sizeof(uint16_t));
      load_held_output(group_acc);
    }
  }

  template <int HEAD_DIM>
  void end_group(float* group_acc) const {
    if constexpr (HEAD_DIM == 64) store_held_output(group_acc);
  }

  template <int HEAD_DIM>
  void rescale(float* group_acc, __mmask16 rows, const float* factors) const {
    if constexpr (HEAD_DIM == 64) store_held_output(group_acc);
    scale_rows<HEAD_DIM>(group_acc, rows, factors);
    if constexpr (HEAD_DIM == 64) load_held_output(group_acc);
  }

  template <int HEAD_DIM>
  void scores(const uint16_t* group_query, const SpanTiles<HEAD_DIM>& span,
              float (*scores)[32]) const {
    if constexpr (HEAD_DIM == 64) {
      for (int half = 0; half < 2; ++half) {
        _tile_zero(AMX_HELD_SCORES);
        _tile_loadd(AMX_HELD_KEYS, span.keys_t[half][0], 64);
        _tile_dpbf16ps(AMX_HELD_SCORES, AMX_HELD_QUERY0, AMX_HELD_KEYS);
        _tile_loadd(AMX_HELD_KEYS, span.keys_t[half][1], 64);
        _tile_dpbf16ps(AMX_HELD_SCORES, AMX_HELD_QUERY1, AMX_HELD_KEYS);
        _tile_stored(AMX_HELD_SCORES, &scores[0][16 * half], 32 * sizeof(float));
      }
    } else {
      _tile_zero(AMX_SCORES0);
      _tile_zero(AMX_SCORES1);
      for (int c = 0; c < HEAD_DIM / 32; ++c) {
        _tile_loadd(AMX_QUERY, group_query + c * 32, HEAD_DIM * sizeof(uint16_t));
        _tile_loadd(AMX_KEYS, span.keys_t[0][c], 64);
        _tile_dpbf16ps(AMX_SCORES0, AMX_QUERY, AMX_KEYS);
        _tile_loadd(AMX_KEYS, span.keys_t[1][c], 64);
        _tile_dpbf16ps(AMX_SCORES1, AMX_QUERY, AMX_KEYS);
      }
      _tile_stored(AMX_SCORES0, &scores[0][0], 32 * sizeof(float));
      _tile_stored(AMX_SCORES1, &scores[0][16], 32 * sizeof(float));
    }
  }

  template <int HEAD_DIM>
  void values(const uint16_t (*probs)[32], const SpanTiles<HEAD_DIM>& span,
              float* group_acc) const {
    if constexpr (HEAD_DIM == 64) {
      _tile_loadd(AMX_HELD_PROBS, probs, 32 * sizeof(uint16_t));
      _tile_loadd(AMX_HELD_VALUES, span.values_vnni[0], 64);
      _tile_dpbf16ps(AMX_HELD_OUTPUT0, AMX_HELD_PROBS, AMX_HELD_VALUES);
      _tile_loadd(AMX_HELD_VALUES, span.values_vnni[1], 64);
      _tile_dpbf16ps(AMX_HELD_OUTPUT1, AMX_HELD_PROBS, AMX_HELD_VALUES);
      _tile_loadd(AMX_HELD_VALUES, span.values_vnni[2], 64);
      _tile_dpbf16ps(AMX_HELD_OUTPUT2, AMX_HELD_PROBS, AMX_HELD_VALUES);
      _tile_loadd(AMX_HELD_VALUES, span.values_vnni[3], 64);
      _tile_dpbf16ps(AMX_HELD_OUTPUT3, AMX_HELD_PROBS, AMX_HELD_VALUES);
    } else {
      _tile_loadd(AMX_PROBS, probs, 32 * sizeof(uint16_t));
      for (int g = 0; g < HEAD_DIM / 16; ++g) {
        _tile_loadd(AMX_OUTPUT, group_acc + g * 16, HEAD_DIM * sizeof(float));
        _tile_loadd(AMX_VALUES, span.values_vnni[g], 64);
        _tile_dpbf16ps(AMX_OUTPUT, AMX_PROBS, AMX_VALUES);
        _tile_stored(AMX_OUTPUT, group_acc + g * 16, HEAD_DIM * sizeof(float));
      }
    }
  }

 private:
  static void load_held_output(const float* group_acc) {
    constexpr int kStride = 64 * sizeof(float);
    _tile_loadd(AMX_HELD_OUTPUT0, group_acc, kStride);
    _tile_loadd(AMX_HELD_OUTPUT1, group_acc + 16, kStride);
    _tile_loadd(AMX_HELD_OUTPUT2, group_acc + 32, kStride);
    _tile_loadd(AMX_HELD_OUTPUT3, group_acc + 48, kStride);
  }
  static void store_held_output(float* group_acc) {
    constexpr int kStride = 64 * sizeof(float);
    _tile_stored(AMX_HELD_OUTPUT0, group_acc, kStride);
    _tile_stored(AMX_HELD_OUTPUT1, group_acc + 16, kStride);
    _tile_stored(AMX_HELD_OUTPUT2, group_acc + 32, kStride);
    _tile_stored(AMX_HELD_OUTPUT3, group_acc + 48, kStride);
  }
};
#endif  // PAGEDSERVE_AMX

// The same products by vdpbf16ps, each row's 32-bit pair (two dims of Q, two keys of P) broadcast
// against 16 keys' or 16 dims' pairs; sums in 16 zmm registers per block of rows. The accumulators
// stay in memory (L1: 4-8 KiB a group).
class VectorProducts {
 public:
  template <int HEAD_DIM>
  void begin_group(const uint16_t*, const float*) const {}
  template <int HEAD_DIM>
  void end_group(float*) const {}
  template <int HEAD_DIM>
  void rescale(float* group_acc, __mmask16 rows, const float* factors) const {
    scale_rows<HEAD_DIM>(group_acc, rows, factors);
  }

  template <int HEAD_DIM>
  void scores(const uint16_t* group_query, const SpanTiles<HEAD_DIM>& span,
              float (*scores)[32]) const {
    constexpr int kRows = 8;  // x 2 halves of 16 keys
    for (int r0 = 0; r0 < 16; r0 += kRows) {
      __m512 sums[kRows][2];
      for (auto& row : sums) row[0] = row[1] = _mm512_setzero_ps();
      for (int c = 0; c < HEAD_DIM / 32; ++c) {
        for (int pair = 0; pair < 16; ++pair) {
          const __m512bh keys0 = (__m512bh)_mm512_load_si512(span.keys_t[0][c][pair]);
          const __m512bh keys1 = (__m512bh)_mm512_load_si512(span.keys_t[1][c][pair]);
          const uint16_t* query_pairs = group_query + c * 32 + 2 * pair;
          for (int r = 0; r < kRows; ++r) {
            const __m512bh q = broadcast_pair(query_pairs + (r0 + r) * HEAD_DIM);
            sums[r][0] = _mm512_dpbf16_ps(sums[r][0], q, keys0);
            sums[r][1] = _mm512_dpbf16_ps(sums[r][1], q, keys1);
          }
        }
      }
      for (int r = 0; r < kRows; ++r) {
        _mm512_store_ps(scores[r0 + r], sums[r][0]);
        _mm512_store_ps(scores[r0 + r] + 16, sums[r][1]);
      }
    }
  }

  template <int HEAD_DIM>
  void values(const uint16_t (*probs)[32], const SpanTiles<HEAD_DIM>& span,
              float* group_acc) const {
    constexpr int kGroups = HEAD_DIM / 16;  // of 16 dims
    constexpr int kRows = 16 / kGroups;     // 4 rows at head_dim 64, 2 at 128
    for (int r0 = 0; r0 < 16; r0 += kRows) {
      __m512 out[kRows][kGroups];
      for (int r = 0; r < kRows; ++r)
        for (int g = 0; g < kGroups; ++g)
          out[r][g] = _mm512_loadu_ps(group_acc + (r0 + r) * HEAD_DIM + g * 16);
      for (int pair = 0; pair < 16; ++pair) {
        __m512bh values[kGroups];
        for (int g = 0; g < kGroups; ++g)
          values[g] = (__m512bh)_mm512_load_si512(span.values_vnni[g][pair]);
        for (int r = 0; r < kRows; ++r) {
          const __m512bh p = broadcast_pair(probs[r0 + r] + 2 * pair);
          for (int g = 0; g < kGroups; ++g) out[r][g] = _mm512_dpbf16_ps(out[r][g], p, values[g]);
        }
      }
      for (int r = 0; r < kRows; ++r)
        for (int g = 0; g < kGroups; ++g)
          _mm512_storeu_ps(group_acc + (r0 + r) * HEAD_DIM + g * 16, out[r][g]);
    }
  }

 private:
  static __m512bh broadcast_pair(const uint16_t* pair) {
    uint32_t bits;
    std::memcpy(&bits, pair, sizeof(bits));
    return (__m512bh)_mm512_set1_epi32(static_cast<int>(bits));
  }
};

// Whether no row of a group of 16 sees any of the keys [key_base, key_end): its last row (causal)
// sits before them, or its first row's window starts after them. Its softmax would leave the
// group's maxima, sums and accumulators exactly as they were; skipping saves the products too.
inline bool group_sees_nothing(const HeadTask& task, int group, int key_base, int key_end) {
  const int m0 = group * 16;
  const int last_row = std::min(task.num_rows, m0 + 16) - 1;
  const int low_position = task.first_position + m0 / task.group_size;
  const int high_position = task.first_position + last_row / task.group_size;
  return key_base > high_position ||
         (task.sliding_window > 0 && key_end <= low_position - task.sliding_window + 1);
}

// Spans packed at a time (256 keys: 64 KiB of tiles at head_dim 64, in L2), each group of rows
// then running over all of them: what stays in tiles across a group's spans (AmxProducts) is
// loaded and stored once per block rather than once per span.
constexpr int kBlockSpans = 8;

// One kv head of a work item, on whichever Products the build and the OS allow.
// Out of line: inlined into an fp8 attend_item (whose decode items never come here), it made that
// function's decode path 1.2x slower.
template <int HEAD_DIM, typename Products, bool FP8 = false>
__attribute__((noinline)) void attend_head(const HeadTask& task) {
  const int num_groups = (task.num_rows + 15) / 16;  // of 16 rows, the last zero-padded
  const int padded_rows = num_groups * 16;
  std::vector<uint16_t> query(static_cast<size_t>(padded_rows) * HEAD_DIM, 0);
  std::vector<float> acc(static_cast<size_t>(padded_rows) * HEAD_DIM, 0.0f);
  std::vector<float> row_max(padded_rows, -std::numeric_limits<float>::infinity());
  std::vector<float> row_sum(padded_rows, 0.0f);
  for (int m = 0; m < task.num_rows; ++m) {
    std::memcpy(query.data() + m * HEAD_DIM, task.query_rows[m], HEAD_DIM * sizeof(uint16_t));
    if (task.row_sinks != nullptr) {  // as if one key of logit sink and value 0 had been seen
      row_max[m] = task.row_sinks[m];
      row_sum[m] = 1.0f;
    }
  }
  // 64-128 KiB: kept per thread rather than allocated (and page-faulted) per call.
  static thread_local std::vector<SpanTiles<HEAD_DIM>> spans(kBlockSpans);
  alignas(64) float scores[16][32];
  alignas(64) uint16_t probs[16][32];
  alignas(64) float factors[16];
  const Products products;
  constexpr int kBlockKeys = 32 * kBlockSpans;
  for (int block_base = task.first_key / 16 * 16; block_base < task.num_keys;
       block_base += kBlockKeys) {
    const int block_end = std::min(task.num_keys, block_base + kBlockKeys);
    const int num_spans = (block_end - block_base + 31) / 32;
    for (int s = 0; s < num_spans; ++s) {
      pack_span<HEAD_DIM, FP8>(task, block_base + 32 * s, spans[s].keys_t,
                               spans[s].values_vnni);
    }
    for (int group = 0; group < num_groups; ++group) {
      if (group_sees_nothing(task, group, block_base, block_end)) continue;
      const uint16_t* group_query = query.data() + group * 16 * HEAD_DIM;
      float* group_acc = acc.data() + group * 16 * HEAD_DIM;
      float* group_max = row_max.data() + group * 16;
      float* group_sum = row_sum.data() + group * 16;
      products.template begin_group<HEAD_DIM>(group_query, group_acc);
      for (int s = 0; s < num_spans; ++s) {
        const int key_base = block_base + 32 * s;
        if (group_sees_nothing(task, group, key_base, key_base + 32)) continue;
        products.template scores<HEAD_DIM>(group_query, spans[s], scores);
        const __mmask16 rescale = softmax_group<HEAD_DIM>(task, group, key_base, scores, probs,
                                                          group_max, group_sum, factors);
        if (rescale != 0) products.template rescale<HEAD_DIM>(group_acc, rescale, factors);
        products.template values<HEAD_DIM>(probs, spans[s], group_acc);
      }
      products.template end_group<HEAD_DIM>(group_acc);
    }
  }
  for (int m = 0; m < task.num_rows; ++m) {
    const float inverse_sum = 1.0f / row_sum[m];  // > 0: every row sees at least its own key
    const float* row = acc.data() + static_cast<size_t>(m) * HEAD_DIM;
    for (int d = 0; d < HEAD_DIM; ++d)
      task.output_rows[m][d] = pagedserve::float_to_bf16(row[d] * inverse_sum);
  }
}

#ifdef PAGEDSERVE_AMX
#undef AMX_SCORES0
#undef AMX_SCORES1
#undef AMX_QUERY
#undef AMX_KEYS
#undef AMX_OUTPUT
#undef AMX_PROBS
#undef AMX_VALUES
#undef AMX_HELD_OUTPUT0
#undef AMX_HELD_OUTPUT1
#undef AMX_HELD_OUTPUT2
#undef AMX_HELD_OUTPUT3
#undef AMX_HELD_QUERY0
#undef AMX_HELD_QUERY1
#undef AMX_HELD_SCORES
#undef AMX_HELD_PROBS
#undef AMX_HELD_KEYS
#undef AMX_HELD_VALUES
#endif  // PAGEDSERVE_AMX

}  // namespace tiles
