// Prefill attention with the rows in the vector lanes: part of
// paged_attention.cpp, included inside its namespace after the vector helpers it uses (vfloat,
// load, store, splat, exp_nonpositive, accumulate_rows, transpose_block), on every ISA build.
//
// The vector path (attend_item) scores one row against one key at a time: head_dim / kLanes FMAs,
// each with its own load of the key, then a transposed sum per kLanes keys, so loads and shuffles
// bound it. Here the rows of one kv head of an item (its tokens x the GQA group) are the lanes of
// the vectors, and attention's first product is a GEMM:
//
//   S^T (keys x rows)    = K (keys x head_dim) . Q^T (head_dim x rows)
//   O   (rows x head_dim) += P (rows x keys) . V (keys x head_dim)
//
// Q^T is packed once per item and kv head (transposed in registers, a kLanes x kLanes block at a
// time, then pre-scaled; rows padded to whole vectors with copies of the last). A score block
// keeps kb keys x RV row vectors of sums in registers; each step over the head's dims loads RV
// vectors of Q^T and broadcasts kb elements of the keys, read through the block table (in place
// from a float32 cache), so every load feeds several FMAs, as in a BLAS microkernel. The online softmax
// then runs across the lanes: a row's running maximum and sum are lanes of vectors, and a tile's
// maximum is an elementwise max over its keys, with no horizontal reductions. The value pass
// keeps 6 rows x 4 vectors of sums (AVX-512) beside a value row's 4 vectors, reading P^T.
//
// Measured on the fixed workload's prefill steps (64 prompts of 32-512 tokens in 2,048-token
// steps; one layer's attention, HEAD against this, 11 interleaved rounds; 2-core AMD EPYC Zen 4):
// native build 81.0 -> 72.8 ms (0.90x; 102 -> 113 GFLOP/s), AVX-512 0.95x, AVX2 level (1.00x).
// score_tile, softmax_tile and ValuePass::run stay out of line: inlined into one function, GCC
// laid the three out worse (0.95x instead of 0.90x).
//
// Other caches and queries take the same path where tile_attention.h does not take them (it takes
// bfloat16 queries over a bfloat16 cache, or an fp8 one with AVX512_VBMI, on builds with
// AVX512_BF16 and blocks of a multiple of 16 tokens), prefill items only (attend_item): the
// tile's key and value rows widened into float32 buffers once per tile and kv head, for every row
// of the item, the queries widened once, the output rounded to bfloat16 as the vector path rounds
// it. They had taken the vector path, which widens keys once per tile too but scores row by row:
// one 1,024-token chunk (default model's heads, 2-core Sapphire Rapids, /tmp harness, 9
// interleaved rounds) took 6.7 instead of 8.4 ms (bfloat16 over bfloat16) and 6.8 instead of 8.6
// (float32 over bfloat16) on the AVX-512 build, 6.8 instead of 8.6-8.7 (float32 over bfloat16 or
// fp8) on the native one; the AVX2 build within 2% either way.
//
// Sums and their order: a score is one FMA chain over the dims in order (the vector path sums
// kLanes partial chains, then adds them), so the two paths differ in float32 rounding only.
#pragma once

namespace float_tiles {

constexpr int kKeys = 64;  // keys per tile (32 measured 2% slower: more per-tile softmax work)
// Row vectors per score block, and keys per block for RV row vectors: kb x RV sums beside RV
// vectors of Q^T and one broadcast (AVX-512: at most 28 of 32 registers; AVX2: at most 11 of 16).
constexpr int kMaxRowVectors = kRegisters == 32 ? 3 : 2;
constexpr int keys_per_block(int row_vectors) {
  return kRegisters == 32 ? (row_vectors == 1 ? 16 : 8) : (row_vectors == 1 ? 8 : 4);
}
static_assert(kKeys % keys_per_block(1) == 0 && kKeys % keys_per_block(2) == 0,
              "a full tile is whole score blocks");

// scores[t * lanes + r] = sum_d keys[t][d] * qt[d * lanes + r] for the keys [t0, t0 + kb) and the
// RV row vectors from row vector v0; `lanes`: the padded row count.
template <int HEAD_DIM, int RV>
inline void score_block(const float* qt, int lanes, const float* const* keys, int t0, int v0,
                        float* scores) {
  constexpr int kb = keys_per_block(RV);
  vfloat sums[kb][RV] = {};
  const float* key[kb];
  for (int k = 0; k < kb; ++k) key[k] = keys[t0 + k];
  const float* q = qt + v0 * kLanes;
  for (int d = 0; d < HEAD_DIM; ++d, q += lanes) {
    vfloat query[RV];
    for (int v = 0; v < RV; ++v) query[v] = load(q + v * kLanes);
    for (int k = 0; k < kb; ++k) {
      const vfloat x = splat(key[k][d]);
      for (int v = 0; v < RV; ++v) sums[k][v] += x * query[v];
    }
  }
  for (int k = 0; k < kb; ++k)
    for (int v = 0; v < RV; ++v) store(scores + (t0 + k) * lanes + (v0 + v) * kLanes, sums[k][v]);
}

// Every score of a tile: `keys` holds a multiple of keys_per_block valid rows (the tile's keys,
// then repeats of its first, whose scores go unused).
template <int HEAD_DIM, int RV>
inline void score_row_vectors(const float* qt, int lanes, const float* const* keys, int tile_keys,
                              int v0, float* scores) {
  for (int t0 = 0; t0 < tile_keys; t0 += keys_per_block(RV))
    score_block<HEAD_DIM, RV>(qt, lanes, keys, t0, v0, scores);
}

template <int HEAD_DIM>
__attribute__((noinline)) void score_tile(const float* qt, int lanes, const float* const* keys, int tile_keys,
                float* scores) {
  const int row_vectors = lanes / kLanes;
  for (int v0 = 0; v0 < row_vectors; v0 += kMaxRowVectors) {
    switch (std::min(kMaxRowVectors, row_vectors - v0)) {
      case 3:
        if constexpr (kMaxRowVectors >= 3)
          score_row_vectors<HEAD_DIM, 3>(qt, lanes, keys, tile_keys, v0, scores);
        break;
      case 2: score_row_vectors<HEAD_DIM, 2>(qt, lanes, keys, tile_keys, v0, scores); break;
      default: score_row_vectors<HEAD_DIM, 1>(qt, lanes, keys, tile_keys, v0, scores); break;
    }
  }
}

// One kv head of an item, its state per row (padded to `lanes`): Q^T, running maxima and sums,
// accumulators (rows of HEAD_DIM), each row's position (which keys it sees) and query. Where the
// query is bfloat16 its rows are widened into `widened_queries` first; where the cache holds
// anything but float32, a tile's key and value rows are widened into `key_tile` / `value_tile`
// (once per tile, for every row of the item).
struct HeadRows {
  int num_rows, lanes;
  std::vector<float> qt, row_max, row_sum, acc, scores;
  std::vector<int32_t> position;
  std::vector<const float*> query_rows;
  std::vector<float> widened_queries, key_tile, value_tile;
  HeadRows(int rows, int head_dim, bool widen_queries, bool widen_cache)
      : num_rows(rows), lanes((rows + kLanes - 1) / kLanes * kLanes),
        qt(static_cast<size_t>(lanes) * head_dim), row_max(lanes), row_sum(lanes),
        acc(static_cast<size_t>(lanes) * head_dim), scores(static_cast<size_t>(kKeys) * lanes),
        position(lanes), query_rows(lanes),
        widened_queries(widen_queries ? static_cast<size_t>(rows) * head_dim : 0),
        key_tile(widen_cache ? static_cast<size_t>(kKeys) * head_dim : 0),
        value_tile(widen_cache ? static_cast<size_t>(kKeys) * head_dim : 0) {}
};

// The online softmax of one tile's scores (key-major, `lanes` apart), a row vector at a time:
// scores of keys a row does not see (after its position, or before its window) become -inf, then
// every score its probability under the row's new running maximum; accumulators of rows whose
// maximum grew are rescaled. `masked`: whether any row of the tile misses any of its keys.
template <int HEAD_DIM>
__attribute__((noinline)) void softmax_tile(HeadRows& rows, int key_begin, int tile_keys, int sliding_window, bool masked) {
  const vfloat minus_inf = splat(-std::numeric_limits<float>::infinity());
  for (int v = 0; v < rows.lanes / kLanes; ++v) {
    float* scores = rows.scores.data() + v * kLanes;
    vint position;
    std::memcpy(&position, rows.position.data() + v * kLanes, sizeof(position));
    const vfloat previous = load(rows.row_max.data() + v * kLanes);
    vfloat new_max = previous;
    for (int t = 0; t < tile_keys; ++t) {
      vfloat s = load(scores + t * rows.lanes);
      if (masked) {
        const vint key = vint{} + (key_begin + t);
        vint visible = key <= position;
        if (sliding_window > 0) visible &= key > position - sliding_window;
        s = visible ? s : minus_inf;
        store(scores + t * rows.lanes, s);
      }
      new_max = s > new_max ? s : new_max;
    }
    // Rows that have seen no key yet keep -inf: subtract 0 there, so every probability is 0.
    const vfloat base = new_max == minus_inf ? splat(0.0f) : new_max;
    vfloat total = splat(0.0f);
    for (int t = 0; t < tile_keys; ++t) {
      const vfloat probability = exp_nonpositive(load(scores + t * rows.lanes) - base);
      store(scores + t * rows.lanes, probability);
      total += probability;
    }
    const vfloat correction = exp_nonpositive(previous - base);  // 1 where the maximum held
    float* row_sum = rows.row_sum.data() + v * kLanes;
    store(row_sum, load(row_sum) * correction + total);
    store(rows.row_max.data() + v * kLanes, new_max);
    for (int lane = 0; lane < kLanes; ++lane) {
      if (correction[lane] == 1.0f) continue;
      float* acc = rows.acc.data() + static_cast<size_t>(v * kLanes + lane) * HEAD_DIM;
      for (int d = 0; d < HEAD_DIM; d += kLanes) store(acc + d, load(acc + d) * correction[lane]);
    }
  }
}

// The value pass: acc[r] += sum_t P^T[t][r] v[t], kRows rows x kSlice vectors of sums at a
// time beside the slice of a value row (AVX-512: 6 x 4 of 32 registers; AVX2: 2 x 4 of 16), so
// each loaded value vector feeds kRows FMAs.
template <int HEAD_DIM>
struct ValuePass {
  static constexpr int kSlice = std::min(HEAD_DIM / kLanes, 4);
  static constexpr int kRows = std::min(6, (kRegisters - kSlice - 1) / kSlice);
  template <int ROWS>
  static void rows_at(const HeadRows& rows, const float* const* values, int tile_keys, int m,
                      int column, float* acc) {
    accumulate_rows<kSlice, ROWS>(rows.scores.data() + m, values, 0, column, tile_keys,
                                  acc + static_cast<size_t>(m) * HEAD_DIM, HEAD_DIM, 1, rows.lanes);
  }
  template <int... R>
  static void rest(const HeadRows& rows, const float* const* values, int tile_keys, int m,
                   int column, float* acc, std::integer_sequence<int, R...>) {
    const int left = rows.num_rows - m;  // fewer than kRows
    ((left == R + 1 ? rows_at<R + 1>(rows, values, tile_keys, m, column, acc) : void()), ...);
  }
  __attribute__((noinline)) static void run(HeadRows& rows, const float* const* values,
                                            int tile_keys) {
    float* acc = rows.acc.data();
    for (int column = 0; column < HEAD_DIM; column += kSlice * kLanes) {
      int m = 0;
      for (; m + kRows <= rows.num_rows; m += kRows)
        rows_at<kRows>(rows, values, tile_keys, m, column, acc);
      rest(rows, values, tile_keys, m, column, acc, std::make_integer_sequence<int, kRows - 1>{});
    }
  }
};

// One kv head of an item: same rows, keys and options as attend_item. float32 cache rows are
// read in place; others are widened a tile at a time.
template <int HEAD_DIM, typename cache_t>
void attend_head(const Problem<cache_t>& p, const WorkItem& item, int kv_head, HeadRows& rows) {
  constexpr bool kInPlace = std::is_same_v<cache_t, float>;
  const int group_size = p.num_heads / p.num_kv_heads;
  const int query_start = p.query_start_loc[item.request];
  const int query_len = p.query_start_loc[item.request + 1] - query_start;
  const int chunk_position = p.seq_lens[item.request] - query_len;  // of the chunk's row 0
  auto token_of = [&](int r) { return query_start + item.query_begin + r / group_size; };
  auto head_of = [&](int r) { return kv_head * group_size + r % group_size; };
  const float minus_inf = -std::numeric_limits<float>::infinity();
  std::fill(rows.acc.begin(), rows.acc.end(), 0.0f);
  for (int r = 0; r < rows.lanes; ++r) {
    const int real = std::min(r, rows.num_rows - 1);  // padding rows: the last row's position
    rows.position[r] = chunk_position + item.query_begin + real / group_size;
    const bool sink = p.sinks != nullptr && r < rows.num_rows;  // a key of logit sink, value 0
    rows.row_max[r] = sink ? p.sinks[head_of(r)] : minus_inf;
    rows.row_sum[r] = sink ? 1.0f : 0.0f;
    const int64_t offset = token_of(real) * p.query_token_stride + head_of(real) * p.query_head_stride;
    if (!p.bfloat16_io) {
      rows.query_rows[r] = static_cast<const float*>(p.query) + offset;
      continue;
    }
    float* widened = rows.widened_queries.data() + static_cast<size_t>(real) * HEAD_DIM;
    if (r == real) {  // padding rows point at the last row, widened before them
      const uint16_t* src = static_cast<const uint16_t*>(p.query) + offset;
      for (int d = 0; d < HEAD_DIM; ++d) widened[d] = pagedserve::bf16_to_float(src[d]);
    }
    rows.query_rows[r] = widened;
  }
  // Q^T a block of kLanes rows x kLanes dims at a time, in registers: packed row by row, each
  // store went to another cache line, a fifth of the item's time. Padding rows repeat the last.
  for (int r = 0; r < rows.lanes; r += kLanes)
    for (int d = 0; d < HEAD_DIM; d += kLanes)
      transpose_block(rows.query_rows.data() + r, d, rows.qt.data() + d * rows.lanes + r,
                      rows.lanes);
  const vfloat scale = splat(p.scale);
  for (size_t i = 0; i < rows.qt.size(); i += kLanes) store(&rows.qt[i], load(&rows.qt[i]) * scale);
  int first_key, num_keys;
  key_range(p, item, first_key, num_keys);
  const int32_t* block_table = p.block_tables + item.request * p.max_num_blocks_per_req;
  const int first_row_position = rows.position[0];
  // A tile's key and value rows, stepped through the block table (block = table[pos / size],
  // offset = pos % size). No software prefetch: the item's K/V were just stored or read by its
  // previous items, and prefetching each next tile into L1 measured the same (0.998x).
  // float32 rows are read in place; other rows are widened into the tile buffers first.
  const float* key_rows[kKeys];
  const float* value_rows[kKeys];
  int block_index = first_key / p.block_size, offset = first_key % p.block_size;
  for (int key_begin = first_key; key_begin < num_keys; key_begin += kKeys) {
    const int tile_keys = std::min(kKeys, num_keys - key_begin);
    for (int t = 0; t < tile_keys; ++t) {
      const int64_t slot = static_cast<int64_t>(block_table[block_index]) * p.block_size + offset;
      const int64_t row = (slot * p.num_kv_heads + kv_head) * HEAD_DIM;
      if constexpr (kInPlace) {
        key_rows[t] = p.key_cache + row;
        value_rows[t] = p.value_cache + row;
      } else {
        float* key = rows.key_tile.data() + t * HEAD_DIM;
        float* value = rows.value_tile.data() + t * HEAD_DIM;
        widen_row(p.key_cache + row, key, HEAD_DIM);
        widen_row(p.value_cache + row, value, HEAD_DIM);
        key_rows[t] = key;
        value_rows[t] = value;
      }
      if (++offset == p.block_size) {
        offset = 0;
        ++block_index;
      }
    }
    for (int t = tile_keys; t < kKeys; ++t) {  // whole score blocks: repeats, scored but unused
      key_rows[t] = key_rows[0];
      value_rows[t] = value_rows[0];
    }
    score_tile<HEAD_DIM>(rows.qt.data(), rows.lanes, key_rows, tile_keys, rows.scores.data());
    if (p.softcap > 0.0f) {
      for (int i = 0; i < tile_keys * rows.lanes; ++i)
        rows.scores[i] = p.softcap * std::tanh(rows.scores[i] / p.softcap);
    }
    const bool masked = key_begin + tile_keys - 1 > first_row_position || p.sliding_window > 0;
    softmax_tile<HEAD_DIM>(rows, key_begin, tile_keys, p.sliding_window, masked);
    ValuePass<HEAD_DIM>::run(rows, value_rows, tile_keys);
  }
  for (int r = 0; r < rows.num_rows; ++r) {
    const float inverse_sum = 1.0f / rows.row_sum[r];  // > 0: every row sees its own key
    const float* acc = rows.acc.data() + static_cast<size_t>(r) * HEAD_DIM;
    const int64_t offset = (token_of(r) * p.num_heads + head_of(r)) * HEAD_DIM;
    if (p.bfloat16_io) {  // rounded to nearest even, as the vector path and torch's .to()
      uint16_t* out = static_cast<uint16_t*>(p.output) + offset;
      for (int d = 0; d < HEAD_DIM; ++d) out[d] = pagedserve::float_to_bf16(acc[d] * inverse_sum);
    } else {
      float* out = static_cast<float*>(p.output) + offset;
      for (int d = 0; d < HEAD_DIM; ++d) out[d] = acc[d] * inverse_sum;
    }
  }
}

// A prefill item's kv heads [head_begin, head_end), one after the other.
template <int HEAD_DIM, typename cache_t>
void attend_item(const Problem<cache_t>& p, const WorkItem& item, int head_begin, int head_end) {
  HeadRows rows((item.query_end - item.query_begin) * (p.num_heads / p.num_kv_heads), HEAD_DIM,
                p.bfloat16_io, !std::is_same_v<cache_t, float>);
  for (int kv_head = head_begin; kv_head < head_end; ++kv_head)
    attend_head<HEAD_DIM>(p, item, kv_head, rows);
}

}  // namespace float_tiles
