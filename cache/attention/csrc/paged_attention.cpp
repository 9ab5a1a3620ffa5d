// Paged attention on the CPU for one mixed batch of decode tokens and prefill chunks.
//
// Work item = (request, kv head, tile of up to kQueryTile query tokens). Its rows are every query
// head of the kv-head group times every token of the tile, so each K/V row is read from memory
// once and reused from L1 for all rows (GQA without expanding K/V). Keys are visited in tiles of
// kKeyTile positions resolved through the block table, with an online (running max) softmax, so
// the kernel never gathers a request's history. Inputs may be float32, bfloat16 or float16;
// every accumulation is float32. Head sizes 64 and 128 get compile-time specialisations, which
// measured ~1.4x faster than runtime-length loops; register-blocking rows with explicit vector
// types measured no further gain (decode is bound by reading K/V), so the loops stay plain.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int kKeyTile = 32;    // K and V tiles (2 x 32 x head_dim floats) stay in L1
constexpr int kQueryTile = 16;  // prefill tokens per work item: enough items for every core

// exp(x) for x <= 0 as straight-line arithmetic so `omp simd` vectorises it (libm's expf is a
// call). Cody-Waite range reduction plus a degree-6 Taylor polynomial on |r| <= ln2/2: relative
// error ~1e-7, i.e. float rounding level.
#pragma omp declare simd
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // keeps 2^n a normal float; e^-87 is as good as 0 after normalising
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_to_n;
  std::memcpy(&two_to_n, &bits, sizeof(float));
  return p * two_to_n;
}

inline float dot(const float* a, const float* b, int n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// bfloat16 is the top half of a float32: a shift the compiler vectorises (c10's cast is scalar).
inline void to_float(const at::BFloat16* src, float* dst, int n) {
  const auto* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int i = 0; i < n; ++i) {
    const uint32_t word = static_cast<uint32_t>(bits[i]) << 16;
    float value;
    std::memcpy(&value, &word, sizeof(float));
    dst[i] = value;
  }
}

inline void to_float(const at::Half* src, float* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// A float row of the cache: float32 is read in place, reduced types are widened into `buffer`.
template <typename scalar_t>
inline const float* float_row(const scalar_t* src, float* buffer, int n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return src;
  } else {
    to_float(src, buffer, n);
    return buffer;
  }
}

struct WorkItem {
  int request;
  int query_begin;  // tile = query rows [query_begin, query_end) of the request's chunk
  int query_end;
  int64_t cost;     // rows x keys, to hand out the longest items first
};

template <typename scalar_t>
struct Problem {
  const scalar_t* query;        // [num_tokens, num_heads, head_dim]
  const scalar_t* key_cache;    // [num_blocks * block_size, num_kv_heads, head_dim]
  const scalar_t* value_cache;  // [num_blocks * block_size, num_kv_heads, head_dim]
  scalar_t* output;             // [num_tokens, num_heads, head_dim]
  const int32_t* block_tables;  // [num_reqs, max_num_blocks_per_req]
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  int64_t max_num_blocks_per_req;
  int block_size, num_heads, num_kv_heads, head_dim;
  float scale;
};

// Online softmax of one row against keys [0, num_keys) of the current key tile. A compile-time
// HEAD_DIM turns the row loops into fixed-length vector code; 0 uses runtime_head_dim.
template <int HEAD_DIM>
inline void accumulate_row(const float* q, const float* const* k_rows, const float* const* v_rows,
                           int num_keys, int runtime_head_dim, float* scores, float* acc,
                           float& row_max, float& row_sum) {
  const int head_dim = HEAD_DIM > 0 ? HEAD_DIM : runtime_head_dim;
  float tile_max = row_max;
  for (int t = 0; t < num_keys; ++t) {
    scores[t] = dot(q, k_rows[t], head_dim);
    tile_max = std::max(tile_max, scores[t]);
  }
  float tile_sum = 0.0f;
#pragma omp simd reduction(+ : tile_sum)
  for (int t = 0; t < num_keys; ++t) {
    scores[t] = exp_nonpositive(scores[t] - tile_max);
    tile_sum += scores[t];
  }
  if (tile_max > row_max) {  // rescale what was accumulated under the old maximum
    const float correction = std::exp(row_max - tile_max);  // exp(-inf) = 0 on the first tile
    row_sum *= correction;
#pragma omp simd
    for (int d = 0; d < head_dim; ++d) acc[d] *= correction;
    row_max = tile_max;
  }
  row_sum += tile_sum;
  for (int t = 0; t < num_keys; ++t) {
    const float p = scores[t];
    const float* v = v_rows[t];
#pragma omp simd
    for (int d = 0; d < head_dim; ++d) acc[d] += p * v[d];
  }
}

// HEAD_DIM > 0 fixes the head size at compile time (fully unrolled, remainder-free row loops);
// 0 reads it from the problem.
template <typename scalar_t, int HEAD_DIM>
void attend_item(const Problem<scalar_t>& p, const WorkItem& item, int kv_head) {
  const int group_size = p.num_heads / p.num_kv_heads;
  const int head_dim = HEAD_DIM > 0 ? HEAD_DIM : p.head_dim;
  const int query_start = p.query_start_loc[item.request];
  const int query_len = p.query_start_loc[item.request + 1] - query_start;
  const int first_position = p.seq_lens[item.request] - query_len;  // of the chunk's row 0
  const int num_rows = (item.query_end - item.query_begin) * group_size;
  const int32_t* block_table = p.block_tables + item.request * p.max_num_blocks_per_req;

  // Row m = (token query_begin + m / group_size, query head kv_head * group_size + m % group_size).
  std::vector<float> q(static_cast<size_t>(num_rows) * head_dim);    // pre-scaled
  std::vector<float> acc(static_cast<size_t>(num_rows) * head_dim, 0.0f);
  std::vector<float> row_max(num_rows, -std::numeric_limits<float>::infinity());
  std::vector<float> row_sum(num_rows, 0.0f);
  std::vector<float> scores(kKeyTile);
  std::vector<float> kv_buffer(std::is_same_v<scalar_t, float> ? 0 : 2 * kKeyTile * head_dim);
  const float* k_rows[kKeyTile];
  const float* v_rows[kKeyTile];

  auto query_offset = [&](int m) {
    const int64_t token = query_start + item.query_begin + m / group_size;
    return (token * p.num_heads + kv_head * group_size + m % group_size) * head_dim;
  };
  for (int m = 0; m < num_rows; ++m) {
    float* row = q.data() + static_cast<size_t>(m) * head_dim;
    const float* src = float_row(p.query + query_offset(m), row, head_dim);
#pragma omp simd
    for (int d = 0; d < head_dim; ++d) row[d] = src[d] * p.scale;
  }

  // The tile's last row sits at position first_position + query_end - 1 and sees up to it.
  const int num_keys = first_position + item.query_end;
  for (int key_begin = 0; key_begin < num_keys; key_begin += kKeyTile) {
    const int tile_keys = std::min(kKeyTile, num_keys - key_begin);
    // Resolve positions to cache rows, stepping (block, offset) rather than dividing per key.
    int block_index = key_begin / p.block_size;
    int offset = key_begin % p.block_size;
    for (int t = 0; t < tile_keys; ++t) {
      const int64_t slot = static_cast<int64_t>(block_table[block_index]) * p.block_size + offset;
      const int64_t row_offset = (slot * p.num_kv_heads + kv_head) * head_dim;
      float* k_buffer = kv_buffer.data() + static_cast<size_t>(t) * head_dim;
      float* v_buffer = k_buffer + static_cast<size_t>(kKeyTile) * head_dim;
      k_rows[t] = float_row(p.key_cache + row_offset, k_buffer, head_dim);
      v_rows[t] = float_row(p.value_cache + row_offset, v_buffer, head_dim);
      if (++offset == p.block_size) {
        offset = 0;
        ++block_index;
      }
    }
    for (int m = 0; m < num_rows; ++m) {
      // Causal: the row at position first_position + token sees keys up to that position.
      const int row_position = first_position + item.query_begin + m / group_size;
      const int visible = std::min(tile_keys, row_position + 1 - key_begin);
      if (visible <= 0) continue;
      const size_t row_offset = static_cast<size_t>(m) * head_dim;
      accumulate_row<HEAD_DIM>(q.data() + row_offset, k_rows, v_rows, visible, head_dim,
                               scores.data(), acc.data() + row_offset, row_max[m], row_sum[m]);
    }
  }

  for (int m = 0; m < num_rows; ++m) {
    const float inverse_sum = 1.0f / row_sum[m];  // > 0: every row sees at least key 0
    const float* row = acc.data() + static_cast<size_t>(m) * head_dim;
    scalar_t* out = p.output + query_offset(m);
    for (int d = 0; d < head_dim; ++d) out[d] = static_cast<scalar_t>(row[d] * inverse_sum);
  }
}

std::vector<WorkItem> make_work_items(const int32_t* query_start_loc, const int32_t* seq_lens,
                                      int num_reqs, int64_t max_seq_len) {
  std::vector<WorkItem> items;
  for (int r = 0; r < num_reqs; ++r) {
    const int query_len = query_start_loc[r + 1] - query_start_loc[r];
    TORCH_CHECK(query_len >= 1 && query_len <= seq_lens[r], "request ", r, ": query length ",
                query_len, " must be in [1, seq_len=", seq_lens[r], "]");
    TORCH_CHECK(seq_lens[r] <= max_seq_len, "request ", r, ": seq_len ", seq_lens[r],
                " exceeds its block table (", max_seq_len, " slots)");
    for (int begin = 0; begin < query_len; begin += kQueryTile) {
      const int end = std::min(query_len, begin + kQueryTile);
      const int64_t num_keys = seq_lens[r] - query_len + end;
      items.push_back({r, begin, end, static_cast<int64_t>(end - begin) * num_keys});
    }
  }
  // Longest first, so dynamic scheduling does not end with one core on a long prefill tile.
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

template <typename scalar_t, int HEAD_DIM>
void run(const Problem<scalar_t>& problem, const std::vector<WorkItem>& items) {
  const int64_t num_kv_heads = problem.num_kv_heads;
  const int64_t num_tasks = static_cast<int64_t>(items.size()) * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t task = 0; task < num_tasks; ++task) {
    attend_item<scalar_t, HEAD_DIM>(problem, items[task / num_kv_heads],
                                    static_cast<int>(task % num_kv_heads));
  }
}

// The common head sizes get compile-time specialisations; any other size takes the generic path.
template <typename scalar_t>
void dispatch_head_dim(const Problem<scalar_t>& problem, const std::vector<WorkItem>& items) {
  switch (problem.head_dim) {
    case 64: return run<scalar_t, 64>(problem, items);
    case 128: return run<scalar_t, 128>(problem, items);
    default: return run<scalar_t, 0>(problem, items);
  }
}

template <typename scalar_t>
void launch(const torch::Tensor& query, const torch::Tensor& key_cache,
            const torch::Tensor& value_cache, torch::Tensor& output,
            const torch::Tensor& block_tables, const torch::Tensor& query_start_loc,
            const torch::Tensor& seq_lens, double scale, const std::vector<WorkItem>& items) {
  const Problem<scalar_t> problem{
      query.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
      value_cache.data_ptr<scalar_t>(), output.data_ptr<scalar_t>(),
      block_tables.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(),
      seq_lens.data_ptr<int32_t>(), block_tables.size(1), static_cast<int>(key_cache.size(1)),
      static_cast<int>(query.size(1)), static_cast<int>(key_cache.size(2)),
      static_cast<int>(query.size(2)), static_cast<float>(scale)};
  dispatch_head_dim(problem, items);
}

}  // namespace

torch::Tensor paged_attention(const torch::Tensor& query, const torch::Tensor& key_cache,
                              const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                              const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens,
                              double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query must be [num_tokens, num_heads, "
              "head_dim] and key_cache [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key and value caches differ in shape");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() &&
                  query.scalar_type() == value_cache.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "query and caches must be contiguous");
  for (const auto* tensor : {&query, &key_cache, &value_cache, &block_tables, &query_start_loc,
                             &seq_lens}) {
    TORCH_CHECK(tensor->device().is_cpu(), "the CPU kernel needs CPU tensors, got ",
                tensor->device());
  }
  for (const auto* index : {&block_tables, &query_start_loc, &seq_lens}) {
    TORCH_CHECK(index->scalar_type() == torch::kInt32 && index->is_contiguous(),
                "block_tables, query_start_loc and seq_lens must be contiguous int32");
  }
  const int num_heads = query.size(1), num_kv_heads = key_cache.size(2);
  const int head_dim = query.size(2), num_reqs = seq_lens.size(0);
  TORCH_CHECK(key_cache.size(3) == head_dim, "head_dim differs between query and cache");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads ", num_heads,
              " is not a multiple of num_kv_heads ", num_kv_heads);
  TORCH_CHECK(query_start_loc.size(0) == num_reqs + 1 && block_tables.size(0) == num_reqs,
              "metadata sizes disagree with seq_lens");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  TORCH_CHECK(qsl[num_reqs] == query.size(0), "query_start_loc[-1] != num_tokens");

  auto output = torch::empty_like(query);
  // Block ids themselves are trusted (the block manager owns them); lengths are checked.
  const auto items = make_work_items(qsl, seq_lens.data_ptr<int32_t>(), num_reqs,
                                     block_tables.size(1) * key_cache.size(1));
  switch (query.scalar_type()) {
    case torch::kFloat32: launch<float>(query, key_cache, value_cache, output, block_tables,
                                        query_start_loc, seq_lens, scale, items); break;
    case torch::kBFloat16: launch<at::BFloat16>(query, key_cache, value_cache, output, block_tables,
                                                query_start_loc, seq_lens, scale, items); break;
    case torch::kFloat16: launch<at::Half>(query, key_cache, value_cache, output, block_tables,
                                           query_start_loc, seq_lens, scale, items); break;
    default: TORCH_CHECK(false, "paged_attention supports float32, bfloat16 and float16, not ",
                         query.scalar_type());
  }
  return output;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "Paged attention over a mixed batch; returns [num_tokens, num_heads, head_dim]");
}
