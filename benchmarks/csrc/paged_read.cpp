// A read pass through the block tables: the paged roofline of benchmarks/attention.py.
//
// Every K/V byte a decode step's requests hold (each request's blocks up to its seq_len, all kv
// heads of a slot), block by block in table order, K and V line by line, reduced by an int32
// maximum so that nothing is written. Lines are requested kAheadLines ahead with the same
// software prefetch the attention kernel issues for its next key tile (cache/attention/csrc/
// paged_attention.cpp; into L2, or into L1 where the kernel's prefetch_into_l1 says so): the
// hardware prefetchers do not follow a table from block to block.
//
// The plain read pass (torch's amax over the whole cache) streams one contiguous region; this one
// reads what a paged kernel must, scattered runs of one block each (6 KiB for the default model's
// 16-token bfloat16 blocks, 12 KiB in float32). On a Sapphire Rapids VM (64 x 1,024 decode step,
// huge pages) it ran at 89-92% of the plain pass over a bfloat16 cache and 93-98% over a float32
// one: the layout's own cost, and the bound a paged kernel reading this way can approach. On an
// AMD EPYC Zen 5 VM it ran at 63-82% (float32, prefetching into L1). There, in a standalone
// harness, the same blocks read two at a time with no software prefetch (four streams, K and V of
// each) came at 92-100% of the plain pass; in benchmarks/attention.py's own rounds four at a time
// (blocks_at_once) was at first only 5% faster than block by block, 1.20-1.21x the plain pass'
// time, while its loop read every block of a group with the same load instructions; unrolled
// (below) it reads at the plain pass' rate there too (1.00x float32, 0.93x bfloat16).

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "../../cache/attention/csrc/prefetch.h"

namespace {

typedef int32_t line_t __attribute__((vector_size(64)));  // one cache line of int32s
constexpr int64_t kLineBytes = sizeof(line_t);
constexpr int kAheadLines = 256;  // 16 KiB ahead, K and V lines together

// The largest int32 among the bytes read (a value to return, so the reads cannot be dropped).
// blocks_at_once 1: block by block with software prefetch, as above; 2, 4 or 8: that many of a
// request's blocks at a time, line by line across them (2n streams, K and V of each), with no
// software prefetch, to show what the hardware prefetchers alone make of the scattered blocks.
int64_t read_paged_kv(const at::Tensor& key_cache, const at::Tensor& value_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, bool into_l1,
                      int64_t blocks_at_once) {
  TORCH_CHECK(blocks_at_once == 1 || blocks_at_once == 2 || blocks_at_once == 4 ||
                  blocks_at_once == 8,
              "blocks_at_once must be 1, 2, 4 or 8 (got ", blocks_at_once, ")");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "contiguous caches");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.dim() >= 2 &&
                  key_cache.dtype() == value_cache.dtype(),
              "K and V caches of one shape [num_blocks, block_size, ...] and dtype");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt &&
                  block_tables.is_contiguous(),
              "block_tables: contiguous int32 [num_requests, max_blocks]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kInt &&
                  seq_lens.size(0) == block_tables.size(0),
              "seq_lens: int32 [num_requests]");
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t block_bytes = key_cache.stride(0) * key_cache.element_size();
  TORCH_CHECK(block_bytes % kLineBytes == 0, "blocks of whole cache lines");
  const int64_t lines = block_bytes / kLineBytes;
  const char* keys = static_cast<const char*>(key_cache.data_ptr());
  const char* values = static_cast<const char*>(value_cache.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t num_requests = block_tables.size(0), max_blocks = block_tables.size(1);
  for (int64_t r = 0; r < num_requests; ++r) {
    TORCH_CHECK(lens[r] >= 0 && lens[r] <= max_blocks * block_size, "request ", r, ": seq_len ",
                lens[r], " exceeds its block table");
    for (int64_t b = 0; b < (lens[r] + block_size - 1) / block_size; ++b) {
      const int32_t block = tables[r * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "request ", r, ": block ", block,
                  " is not in the cache");
    }
  }
  int32_t result = std::numeric_limits<int32_t>::min();
#pragma omp parallel for schedule(dynamic, 1) reduction(max : result)
  for (int64_t r = 0; r < num_requests; ++r) {
    const int32_t* table = tables + r * max_blocks;
    const int64_t blocks = (lens[r] + block_size - 1) / block_size;
    // The request's lines in reading order: block b's line l of K, then of V.
    auto line = [&](int64_t b, int64_t l, bool value) {
      return (value ? values : keys) + table[b] * block_bytes + l * kLineBytes;
    };
    // The prefetch cursor runs kAheadLines (K and V lines together) ahead of the reads.
    int64_t ahead_block = 0, ahead_line = 0;
    auto request_ahead = [&](int count) {
      for (; count > 0 && ahead_block < blocks; count -= 2) {
        pagedserve::prefetch_line(line(ahead_block, ahead_line, false), into_l1);
        pagedserve::prefetch_line(line(ahead_block, ahead_line, true), into_l1);
        if (++ahead_line == lines) {
          ahead_line = 0;
          ++ahead_block;
        }
      }
    };
    line_t maximum = line_t{} + std::numeric_limits<int32_t>::min();
    auto read = [&](int64_t b, int64_t l) {
      line_t key, value;
      std::memcpy(&key, line(b, l, false), kLineBytes);
      std::memcpy(&value, line(b, l, true), kLineBytes);
      maximum = maximum > key ? maximum : key;
      maximum = maximum > value ? maximum : value;
    };
    if (blocks_at_once == 1) {
      request_ahead(kAheadLines);
      for (int64_t b = 0; b < blocks; ++b) {
        for (int64_t l = 0; l < lines; ++l) {
          request_ahead(2);
          read(b, l);
        }
      }
    } else {
      // Each of the group's blocks is read by load instructions of its own (the loop over the
      // group unrolled): the prefetchers that learn a stride per instruction then follow every
      // block. With one loop's loads cycling through the blocks, four at a time read at 1.12x
      // the plain pass instead of 0.98x (Zen 5, /tmp harness, float32 64 x 1,024).
      auto read_group = [&]<int kGroup>(int64_t first) {
        for (int64_t l = 0; l < lines; ++l) {
#pragma GCC unroll 8
          for (int g = 0; g < kGroup; ++g) read(first + g, l);
        }
      };
      int64_t first = 0;
      for (; first + blocks_at_once <= blocks; first += blocks_at_once) {
        switch (blocks_at_once) {
          case 2: read_group.template operator()<2>(first); break;
          case 4: read_group.template operator()<4>(first); break;
          default: read_group.template operator()<8>(first); break;
        }
      }
      for (; first < blocks; ++first) read_group.template operator()<1>(first);  // the rest
    }
    for (int i = 0; i < static_cast<int>(kLineBytes / sizeof(int32_t)); ++i) {
      result = std::max(result, maximum[i]);
    }
  }
  return result;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("read_paged_kv", &read_paged_kv, py::arg("key_cache"), py::arg("value_cache"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("into_l1"),
        py::arg("blocks_at_once"),
        "The largest int32 among every K/V byte the requests' blocks hold, read through the "
        "block tables (benchmarks/attention.py's paged roofline)");
}
