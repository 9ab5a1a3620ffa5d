// Paged attention on the CPU for one mixed batch of decode tokens and prefill chunks.
//
// Work item = (request, tile of up to kQueryTile query tokens, or kTileQueryTile where prefill
// items take tile_attention.h); a task is an item with all its kv heads, or with one where a batch
// has too few items for the cores (run()). For each kv head, its
// rows are every query head of the group times every token of the tile, so each K/V row is read
// from memory once and reused from L1 for all rows (GQA without expanding K/V). Keys are visited in
// tiles of kKeyTile positions resolved through the block table, with an online (running max)
// softmax, so the kernel never gathers a request's history.
//
// A task with all kv heads reads each position's K/V rows as one contiguous span (the cache is
// [slot, kv_head, head_dim]). One head per task read a 256-byte row out of every 768 bytes (the
// default model): a plain read in that pattern ran at 12 GB/s where whole slots ran at 21 (two
// threads, 2-core Zen 3); the decode step (64 x 1,024), two rounds interleaved: 11.7 -> 11.2 and
// 10.7 -> 9.8 ms in float32, 10.7 -> 9.4 and 12.1 -> 10.6 ms over a bfloat16 cache.
//
// Each key tile takes three passes: scores (q . k) for every row, the softmax update of every
// row, then one value pass in which each value row is loaded once for several rows at a time
// (accumulate_tile; a key a row does not see has probability 0 there). They use explicit vectors
// of the ISA the file is compiled for (PAGEDSERVE_CPU_ISA in cpu.py): kLanes = 16 floats, one
// AVX-512 register, or 8 floats, one AVX2 register (GCC vector extensions, so each operation is
// one instruction of that ISA; elsewhere 16 lanes of generic vectors, e.g. four NEON registers).
// A row's query or accumulators stay in registers across the tile; the previous, auto-vectorised
// version of these loops (a scalar exp, a horizontal sum per key, the accumulator in memory) ran
// 1.6-2x slower (benchmarks/RESULTS.md).
//
// float32 rows of whole vectors are read in place. bfloat16 values are widened in registers as
// the value pass loads them, even and odd dims apart (load_widened_pairs); bfloat16 keys are read
// unwidened by AVX512_BF16 dot products where the build has them and the query is bfloat16
// (score_row_dpbf16), else widened in registers the same way (score_row_widened). fp8 rows are
// converted to bfloat16 rows a tile at a time by table lookups where the build has AVX512_VBMI
// (Fp8ToBf16) and then read as a bfloat16 cache's are; elsewhere they and float16 rows are
// widened into a small float32 buffer (zero-padded to whole vectors). On a 2-core
// AMD EPYC (Zen 4) these changes, the value pass over several rows and L2 prefetching took a
// 64 x 1,024 decode step from 2.1x to 1.4-1.7x the time of a plain read of its K/V in float32,
// and from 4.5x to 1.3x in bfloat16 (benchmarks/RESULTS.md, "Sixth session"). Where the build
// has AVX512_BF16, prefill items (>= kTileMinRows rows per kv head) of bfloat16 queries over a
// bfloat16 cache (or an fp8 one, converted as the tiles are packed, where the build has
// AVX512_VBMI) take tile products instead (tile_attention.h); every other prefill item (>= one
// vector of rows per kv head, any cache dtype, either query dtype) takes float_tiles.h's, on
// every build.
//
// The cache may hold float32, bfloat16, float16 or fp8 (e4m3) values; queries and outputs are
// float32 or bfloat16 (the output in the query's dtype), and the query may be a strided view (HF's
// [tokens, heads, head_dim] transpose). A bfloat16 query is widened and the output rounded (to
// nearest even, as torch's .to()) row by row here, rather than by two whole-tensor copies per
// layer around the call; the bits are the same. Every accumulation is float32.
#include "aten_ops.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__)
#include "amx_tiles.h"  // permission for the tile state, the tile shape (tile_attention.h)
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "bfloat16_bits.h"
#include "prefetch.h"

bool float_prefetch_by_head();  // defined at the end, with the build's other facts
bool prefetch_into_l1();
bool prefetch_blocks_interleaved();

namespace {

// The one place the vector width is chosen: everything below is written in kLanes.
#if defined(__AVX512F__) || !defined(__AVX2__)
#define PAGEDSERVE_LANES 16
#else
#define PAGEDSERVE_LANES 8
#endif
constexpr int kLanes = PAGEDSERVE_LANES;
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef float vhalf __attribute__((vector_size(kLanes / 2 * sizeof(float))));
typedef float vfloat4 __attribute__((vector_size(4 * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t vuint __attribute__((vector_size(kLanes * sizeof(uint32_t))));
// Vector registers of the ISA (AVX-512: 32, AVX2: 16): how many rows' accumulators fit at once.
#if PAGEDSERVE_LANES == 16
constexpr int kRegisters = 32;
#else
constexpr int kRegisters = 16;
#endif

constexpr int kKeyTile = 64;     // keys per tile: prefetched a tile ahead, scored, then one value pass
constexpr int kQueryTile = 16;   // prefill tokens per work item: enough items for every core
// Prefill tokens per work item where tile_attention.h takes them: each item packs the K/V tiles
// of every key it sees once per kv head, so longer items pack less per row. A 1,024-token
// bfloat16 chunk on AMX: 2.09 ms at 16 tokens, 1.95 at 64, 1.94 at 128 (2-core Sapphire Rapids).
constexpr int kTileQueryTile = 64;
constexpr int kMaxChunks = 512 / kLanes;  // head_dim <= 512
static_assert(kKeyTile % kLanes == 0, "a key tile's scores are whole vectors");

// fp8 e4m3 ("fn": no infinities, 0x7f/0xff are NaN) as stored by torch.float8_e4m3fn.
struct Fp8E4M3 {
  uint8_t bits;
};

// bfloat16 is the top half of a float32: a shift the compiler vectorises (c10's cast is scalar).
inline float widen(at::BFloat16 x) { return pagedserve::bf16_to_float(x.x); }
inline float widen(at::Half x) { return static_cast<float>(x); }  // rare on CPU: c10's exact cast

// kLanes bytes zero-extended to 32-bit lanes. A plain loop: GCC 12 compiles it to one vpmovzxbd,
// while __builtin_convertvector on a byte vector became one scalar insert per lane.
inline vuint zero_extend(const uint8_t* bytes) {
  vuint words;
  for (int i = 0; i < kLanes; ++i) words[i] = bytes[i];
  return words;
}

#if defined(__F16C__) && (PAGEDSERVE_LANES == 8 || defined(__AVX512F__))
typedef uint16_t vhalfwords __attribute__((vector_size(kLanes * sizeof(uint16_t))));

// kLanes fp8 values to float through float16. Shifted left by 7 in a 16-bit lane, e4m3's exponent
// and mantissa (eeee mmm) sit in float16's low exponent bits and top mantissa bits: the float16 is
// the fp8 value times 2^-8 (exponent bias 15 against 7), subnormals included, which F16C's
// conversion widens exactly in hardware; times 2^8 (exact) is the value. The sign, then at bit 14,
// moves to 15 by adding bit 14 to itself. 9 instructions per vector where the float32 route below
// takes 13: a 64 x 1,024 decode step over an fp8 cache ran 1.2x faster in the AVX-512 build and
// 1.35x in the AVX2 build (2-core Zen 4; benchmarks/RESULTS.md, twenty-eighth session).
inline vfloat widen(const Fp8E4M3* src) {
  vhalfwords word;
  for (int i = 0; i < kLanes; ++i) word[i] = src[i].bits;  // one vpmovzxbw (GCC 12)
  vhalfwords bits = word << 7;
  bits += bits & 0x4000;
  bits = (word & 0x7F) == 0x7F ? vhalfwords{} + 0x7E00 : bits;  // 0x7f / 0xff: NaN
  vfloat value;
#if PAGEDSERVE_LANES == 16
  __m256i halves;
  std::memcpy(&halves, &bits, sizeof(halves));
  const __m512 widened = _mm512_cvtph_ps(halves);
#else
  __m128i halves;
  std::memcpy(&halves, &bits, sizeof(halves));
  const __m256 widened = _mm256_cvtph_ps(halves);
#endif
  std::memcpy(&value, &widened, sizeof(value));
  return value * 256.0f;
}
#else
// kLanes fp8 values to float, explicitly vectorised (GCC left a scalar version's selects scalar, ~6x
// slower). Normal values: exponent and mantissa moved to float32's positions, exponent rebiased
// from 7 to 127 by integer addition. Subnormals (exponent 0) are mantissa * 2^-9. Both are exact,
// and neither multiplies a float32 subnormal (a ~100-cycle microcode assist on x86: 3x slower).
inline vfloat widen(const Fp8E4M3* src) {
  const vuint word = zero_extend(&src->bits);
  const vuint magnitude = word & 0x7Fu;
  const vuint normal_bits = (magnitude << 20) + ((127u - 7u) << 23);
  vfloat normal;
  std::memcpy(&normal, &normal_bits, sizeof(normal));
  const vfloat subnormal = __builtin_convertvector(magnitude, vfloat) * 0x1p-9f;
  const vfloat value = magnitude < 8u ? subnormal : normal;
  vuint bits;
  std::memcpy(&bits, &value, sizeof(bits));
  bits |= (word & 0x80u) << 24;  // the sign
  vfloat signed_value;
  std::memcpy(&signed_value, &bits, sizeof(signed_value));
  const vfloat nan = vfloat{} + std::numeric_limits<float>::quiet_NaN();
  return magnitude == 0x7Fu ? nan : signed_value;  // 0x7f / 0xff
}
#endif

template <typename cache_t>
inline void widen_row(const cache_t* src, float* dst, int n) {
  if constexpr (std::is_same_v<cache_t, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if constexpr (std::is_same_v<cache_t, Fp8E4M3>) {
    int i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      const vfloat values = widen(src + i);
      std::memcpy(dst + i, &values, sizeof(values));
    }
    if (i < n) {  // a head size that ends in a partial vector: widen a zero-padded copy
      Fp8E4M3 tail[kLanes] = {};
      std::memcpy(tail, src + i, n - i);
      const vfloat values = widen(tail);
      std::memcpy(dst + i, &values, (n - i) * sizeof(float));
    }
  } else {
#pragma omp simd
    for (int i = 0; i < n; ++i) dst[i] = widen(src[i]);
  }
}

#if defined(__AVX512VBMI__) && defined(__AVX512BW__) && PAGEDSERVE_LANES == 16
#define PAGEDSERVE_FP8_AS_BF16 1
// The bfloat16 bits of an fp8 e4m3 magnitude (its low 7 bits): every e4m3 value is exact in
// bfloat16, subnormals (m * 2^-9) as bfloat16 normals; 0x7f is NaN.
constexpr uint16_t fp8_magnitude_to_bf16(int magnitude) {
  const int exponent = magnitude >> 3, mantissa = magnitude & 7;
  if (magnitude == 0x7F) return 0x7FC0;
  if (exponent > 0) return static_cast<uint16_t>(((exponent + 120) << 7) | (mantissa << 4));
  if (mantissa == 0) return 0;
  int scaled = mantissa, power = -9;  // value = scaled * 2^power, normalised to scaled in [8, 16)
  while (scaled < 8) {
    scaled <<= 1;
    --power;
  }
  return static_cast<uint16_t>(((power + 3 + 127) << 7) | ((scaled - 8) << 4));
}

// fp8 rows to bfloat16 rows, 64 values at a time, by table lookups (AVX512_VBMI): the high and
// the low byte of each value's bfloat16 come from a 128-entry byte table each (vpermi2b, one
// instruction per 64 lookups), the sign is or-ed into the high byte, and two unpacks interleave
// the bytes into words: 9 instructions per 64 values, where widening them to float32 takes ~40.
// The rows are then read as a bfloat16 cache's are (dot products, widening in registers): a 64 x
// 1,024 decode step over an fp8 cache ran 1.8x faster with bfloat16 queries and 1.6x with float32
// ones than widened to float32 (2-core Zen 4; benchmarks/RESULTS.md, twenty-eighth session).
class Fp8ToBf16 {
 public:
  Fp8ToBf16() {
    alignas(64) uint8_t high[128], low[128], order[64];
    for (int i = 0; i < 128; ++i) {
      high[i] = static_cast<uint8_t>(fp8_magnitude_to_bf16(i) >> 8);
      low[i] = static_cast<uint8_t>(fp8_magnitude_to_bf16(i) & 0xFF);
    }
    // The unpacks work within 128-bit lanes: lane L of the low unpack takes input bytes 16L..16L+7
    // and of the high unpack 16L+8..16L+15. Reordered first, so that the words come out in order.
    for (int lane = 0; lane < 4; ++lane) {
      for (int j = 0; j < 8; ++j) {
        order[16 * lane + j] = static_cast<uint8_t>(8 * lane + j);
        order[16 * lane + 8 + j] = static_cast<uint8_t>(32 + 8 * lane + j);
      }
    }
    alignas(64) uint8_t interleave[64];  // word i = low byte i, high byte i (from the 2nd source)
    for (int i = 0; i < 32; ++i) {
      interleave[2 * i] = static_cast<uint8_t>(i);
      interleave[2 * i + 1] = static_cast<uint8_t>(64 + i);
    }
    high_[0] = _mm512_load_si512(high);
    high_[1] = _mm512_load_si512(high + 64);
    low_[0] = _mm512_load_si512(low);
    low_[1] = _mm512_load_si512(low + 64);
    order_ = _mm512_load_si512(order);
    interleave_ = _mm512_load_si512(interleave);
  }

  // 32 values as one vector of bfloat16, in order (the prefill tiles' packing reads 32 at a time).
  __m512i convert32(const Fp8E4M3* src) const {
    const __m512i bytes = _mm512_zextsi256_si512(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(src)));
    const __m512i magnitude_high = _mm512_permutex2var_epi8(high_[0], bytes, high_[1]);
    const __m512i low = _mm512_permutex2var_epi8(low_[0], bytes, low_[1]);
    const __m512i high =
        _mm512_ternarylogic_epi32(magnitude_high, bytes, _mm512_set1_epi8(-128), 0xF8);
    return _mm512_permutex2var_epi8(low, interleave_, high);
  }

  // n: a multiple of 64.
  void operator()(const Fp8E4M3* src, uint16_t* dst, int n) const {
    for (int i = 0; i < n; i += 64) {
      const __m512i bytes = _mm512_permutexvar_epi8(order_, _mm512_loadu_si512(src + i));
      const __m512i magnitude_high = _mm512_permutex2var_epi8(high_[0], bytes, high_[1]);
      const __m512i low = _mm512_permutex2var_epi8(low_[0], bytes, low_[1]);
      // high = magnitude_high | (bytes & 0x80): the sign (truth table A | (B & C) = 0xF8).
      const __m512i high =
          _mm512_ternarylogic_epi32(magnitude_high, bytes, _mm512_set1_epi8(-128), 0xF8);
      _mm512_storeu_si512(dst + i, _mm512_unpacklo_epi8(low, high));
      _mm512_storeu_si512(dst + i + 32, _mm512_unpackhi_epi8(low, high));
    }
  }

 private:
  __m512i high_[2], low_[2], order_, interleave_;
};

inline const Fp8ToBf16& fp8_to_bf16() {
  static const Fp8ToBf16 converter;
  return converter;
}
constexpr bool kFp8AsBf16Build = true;
#else
constexpr bool kFp8AsBf16Build = false;
#endif

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }

// The low and high halves of a vector (one register each, down to 4 lanes).
template <typename half_t, typename whole_t>
inline void split(whole_t v, half_t& low, half_t& high) {
  std::memcpy(&low, &v, sizeof(low));
  std::memcpy(&high, reinterpret_cast<const char*>(&v) + sizeof(low), sizeof(high));
}

inline vfloat4 fold_to_4(vfloat v, bool max) {  // lanes folded onto 4 by + (or max)
#if PAGEDSERVE_LANES == 16
  vhalf low, high;
  split(v, low, high);
  const vhalf eight = max ? (low > high ? low : high) : low + high;
#else
  const vfloat eight = v;
#endif
  vfloat4 a, b;
  split(eight, a, b);
  return max ? (a > b ? a : b) : a + b;
}

inline float horizontal_sum(vfloat v) {  // a tree, not kLanes dependent adds
  const vfloat4 sum4 = fold_to_4(v, false);
  return (sum4[0] + sum4[2]) + (sum4[1] + sum4[3]);
}

inline vfloat splat(float value) { return vfloat{} + value; }

inline vfloat bits_to_vfloat(vint bits) {
  vfloat value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline vint vfloat_to_bits(vfloat value) {
  vint bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// exp(x) for x <= 0, kLanes at a time (libm's expf is a scalar call, and the compiler left a
// scalar version of this unvectorised). Cody-Waite range reduction plus a degree-6 Taylor
// polynomial on |r| <= ln2/2: relative error ~1e-7, i.e. float rounding level. Lanes below -87
// (e^-87 is as good as 0 after normalising), -inf included, return exactly 0.
inline vfloat exp_nonpositive(vfloat x) {
  const vint in_range = x >= splat(-87.0f);
  x = in_range ? x : splat(-87.0f);  // keeps 2^n a normal float
  // Round to nearest by adding and subtracting 1.5 * 2^23 (exact for |x * log2(e)| < 2^22).
  const vfloat n = (x * 1.44269504088896341f + 0x1.8p23f) - 0x1.8p23f;
  const vfloat r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  vfloat p = splat(1.0f / 720.0f);
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const vfloat two_to_n = bits_to_vfloat((__builtin_convertvector(n, vint) + 127) << 23);
  return bits_to_vfloat(vfloat_to_bits(p * two_to_n) & in_range);
}

struct WorkItem {
  int request;
  int query_begin;  // tile = query rows [query_begin, query_end) of the request's chunk
  int query_end;
  int64_t cost;     // rows x keys, to hand out the longest items first
};

template <typename cache_t>
struct Problem {
  const void* query;            // [num_tokens, num_heads, head_dim], strided, float32 or bf16
  int64_t query_token_stride;   // elements between tokens, and between heads, of the query
  int64_t query_head_stride;
  bool bfloat16_io;             // query and output bfloat16 (else float32)
  const cache_t* key_cache;     // [num_blocks * block_size, num_kv_heads, head_dim]
  const cache_t* value_cache;   // [num_blocks * block_size, num_kv_heads, head_dim]
  void* output;                 // [num_tokens, num_heads, head_dim], contiguous, query's dtype
  const int32_t* block_tables;  // [num_reqs, max_num_blocks_per_req]
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  int64_t max_num_blocks_per_req;
  int block_size, num_heads, num_kv_heads, head_dim;
  float scale;
  // Per-layer options (see torch_ref.py): keys in (p - window, p] only (0: no window); scores
  // capped to softcap * tanh(s / softcap) (0: none); one sink logit per head (nullptr: none).
  int sliding_window;
  float softcap;
  const float* sinks;
};

// A task: one work item with kv heads [head_begin, head_end) (run()).
struct Task {
  const WorkItem* item;
  int head_begin, head_end;
};

// The keys an item's rows see, [first_key, num_keys): its last row sits at position
// first_position + query_end - 1 and sees up to it; with a window, its first row sees nothing
// before first_key (whose blocks may be released).
template <typename cache_t>
inline void key_range(const Problem<cache_t>& p, const WorkItem& item, int& first_key,
                      int& num_keys) {
  const int query_len = p.query_start_loc[item.request + 1] - p.query_start_loc[item.request];
  const int first_position = p.seq_lens[item.request] - query_len;  // of the chunk's row 0
  num_keys = first_position + item.query_end;
  first_key = p.sliding_window > 0
                  ? std::max(0, first_position + item.query_begin - p.sliding_window + 1)
                  : 0;
}

// The cache rows (element offsets, at the task's first kv head) of the first key tile of a task;
// returns how many keys it has. The same rows attend_item resolves for it.
template <typename cache_t>
int resolve_first_tile(const Problem<cache_t>& p, const Task& task, int64_t* rows);

// __builtin_shufflevector (clang, GCC >= 12) or its GCC spelling, for older compilers.
template <int... Lanes>
inline vfloat shuffle(vfloat a, vfloat b) {
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
  return __builtin_shufflevector(a, b, Lanes...);
#else
  return __builtin_shuffle(a, b, vint{Lanes...});
#endif
}

// The horizontal sums of kLanes vectors as one vector, in order: kLanes - 1 vector adds instead
// of kLanes separate horizontal sums, and one store instead of kLanes. Each level adds two
// shuffles of a pair of vectors (a, b), halving the partial sums each key has:
//   level 1 (32-bit unpacks): per 128-bit lane, (a, b, a, b), each the sum of two of the lane's
//     four partials;
//   level 2 (64-bit unpacks): per 128-bit lane of quads[j], keys 4j .. 4j + 3, one sum each;
//   level 3 (and 4 on AVX-512): 128-bit lanes added in pairs, a's then b's.
// Only the last levels move data across 128-bit lanes; then key k is in lane k. The previous
// order (halves first, single lanes last, as two-source permutes) ran a 64 x 1,024 bfloat16
// decode step 7-13% slower (2-core Zen 4, interleaved rounds; level in float32).
constexpr int kUnpack32 = 1, kUnpack64 = 2, kLanePairs = 3;
// Lane i of the level's first shuffle takes element level_source(i) of (a, b) concatenated; the
// second shuffle takes the element level_step() after it.
template <int LEVEL>
constexpr int level_source(int i) {
  const int lane128 = i / 4, e = i % 4;
  if constexpr (LEVEL == kUnpack32) return (e % 2) * kLanes + 4 * lane128 + e / 2;
  if constexpr (LEVEL == kUnpack64) return (e / 2) * kLanes + 4 * lane128 + e % 2;
  return (lane128 / (kLanes / 8)) * kLanes + (lane128 % (kLanes / 8)) * 8 + e;  // kLanePairs
}
template <int LEVEL>
constexpr int level_step() {
  return LEVEL == kLanePairs ? 4 : 2;
}
// How a level combines its two shuffles: + for sums (the scores here), max for maxima (the prefill
// tiles' softmax, tile_attention.h).
struct Plus {
  vfloat operator()(vfloat x, vfloat y) const { return x + y; }
};
struct Max {
  vfloat operator()(vfloat x, vfloat y) const { return x > y ? x : y; }
};
template <int LEVEL, typename Op, int... I>
inline vfloat combine_level(vfloat a, vfloat b, std::integer_sequence<int, I...>) {
  return Op{}(shuffle<level_source<LEVEL>(I)...>(a, b),
              shuffle<(level_source<LEVEL>(I) + level_step<LEVEL>())...>(a, b));
}
template <int LEVEL, typename Op>
inline vfloat combine_level(vfloat a, vfloat b) {
  return combine_level<LEVEL, Op>(a, b, std::make_integer_sequence<int, kLanes>{});
}

template <typename Op>
inline vfloat transposed_reduce(const vfloat* v) {
  vfloat pairs[kLanes / 2], quads[kLanes / 4];
  for (int i = 0; i < kLanes / 2; ++i) {
    pairs[i] = combine_level<kUnpack32, Op>(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < kLanes / 4; ++i) {
    quads[i] = combine_level<kUnpack64, Op>(pairs[2 * i], pairs[2 * i + 1]);
  }
#if PAGEDSERVE_LANES == 16
  return combine_level<kLanePairs, Op>(combine_level<kLanePairs, Op>(quads[0], quads[1]),
                                       combine_level<kLanePairs, Op>(quads[2], quads[3]));
#else
  return combine_level<kLanePairs, Op>(quads[0], quads[1]);
#endif
}
inline vfloat transposed_sum(const vfloat* v) { return transposed_reduce<Plus>(v); }
// Lane r the maximum of v[r]'s lanes.
inline vfloat transposed_max(const vfloat* v) { return transposed_reduce<Max>(v); }

// scores[t] = q . k[t] for keys [0, num_keys). A row's query chunks stay in registers.
// `offset`: where this kv head starts in each key row (rows may span several heads).
// `before_group()` runs before each whole group of kLanes keys (attend_item prefetches there).
// score_row_widened and score_row_dpbf16 repeat this group loop with their own dot products on
// purpose: one shared template taking the dot product as a lambda gave the same bits but made a
// 64 x 1,024 decode step 5-7% slower in float32 and 5% in bfloat16 (native build, 2-core Zen 4,
// 60 rounds in random order; AVX2 build unchanged), from how GCC 12 laid out attend_item.
template <int CHUNKS, typename Hook>
inline void score_row(const float* q, const float* const* keys, int64_t offset, int chunks,
                      int num_keys, float* scores, Hook&& before_group) {
  vfloat query[CHUNKS > 0 ? CHUNKS : kMaxChunks];
  for (int c = 0; c < chunks; ++c) query[c] = load(q + c * kLanes);
  int t = 0;
  for (; t + kLanes <= num_keys; t += kLanes) {
    before_group();
    vfloat sums[kLanes];
    for (int k = 0; k < kLanes; ++k) {
      const float* key = keys[t + k] + offset;
      vfloat sum = query[0] * load(key);
      for (int c = 1; c < chunks; ++c) sum += query[c] * load(key + c * kLanes);
      sums[k] = sum;
    }
    store(scores + t, transposed_sum(sums));
  }
  for (; t < num_keys; ++t) {
    const float* key = keys[t] + offset;
    vfloat sum = query[0] * load(key);
    for (int c = 1; c < chunks; ++c) sum += query[c] * load(key + c * kLanes);
    scores[t] = horizontal_sum(sum);
  }
}

// acc += sum_t probs[t] * v[t]. The accumulator stays in registers across the tile.
template <int CHUNKS>
inline void accumulate_values(const float* probs, const float* const* values, int64_t offset,
                              int chunks, int num_keys, float* acc) {
  vfloat sum[CHUNKS > 0 ? CHUNKS : kMaxChunks];
  for (int c = 0; c < chunks; ++c) sum[c] = load(acc + c * kLanes);
  for (int t = 0; t < num_keys; ++t) {
    const float p = probs[t];
    const float* value = values[t] + offset;
    for (int c = 0; c < chunks; ++c) sum[c] += p * load(value + c * kLanes);
  }
  for (int c = 0; c < chunks; ++c) store(acc + c * kLanes, sum[c]);
}

// 2 * kLanes bfloat16 values widened to float in registers as two vectors: the even-indexed
// elements and the odd ones. A bfloat16 is the top half of a float32, and a 32-bit lane holds
// elements 2i (low half) and 2i + 1 (high half): one shift and one mask, where widening elements
// in order (zero-extend 16 to 32 bits, then shift) took six instructions per 16 values on AVX-512
// (GCC splits the zero-extension into 128-bit halves). The value pass accumulates bfloat16 rows
// in this even/odd order ("pair order", pair_order_index) and puts dims back in place at the end.
inline void load_widened_pairs(const uint16_t* p, vfloat& even, vfloat& odd) {
  vuint pairs;
  std::memcpy(&pairs, p, sizeof(pairs));
  even = bits_to_vfloat(reinterpret_cast<vint>(pairs << 16));
  odd = bits_to_vfloat(reinterpret_cast<vint>(pairs & 0xffff0000u));
}

// Where dim d of a bfloat16 value row sits in an accumulator row in pair order: each 2 * kLanes
// dims are one vector of their even dims followed by one of their odd dims.
inline int pair_order_index(int d) {
  const int base = d / (2 * kLanes) * (2 * kLanes), within = d % (2 * kLanes);
  return base + (within % 2) * kLanes + within / 2;
}

// score_row over bfloat16 keys read in place, widened in registers as they are loaded
// (load_widened_pairs): `q` is the query row in pair order (pair_order_index), so even and odd
// dims meet their own. Where there are no AVX512_BF16 dot products, or the query is float32 (a
// bfloat16 cache under a float32 model). Widening each tile into a float32 buffer first, as
// float16 and fp8 rows are, took 12-18% longer with K/V in L2 and 6-17% longer at 64 x 384 (the
// AVX-512 and AVX2 builds, and native with float32 queries; from memory at 64 x 1,024 0-15%;
// 2-core Zen 4, interleaved rounds).
template <int CHUNKS, typename Hook>
inline void score_row_widened(const float* q, const uint16_t* const* keys, int64_t offset,
                              int num_keys, float* scores, Hook&& before_group) {
  static_assert(CHUNKS % 2 == 0, "bfloat16 rows are widened two vectors at a time");
  vfloat query[CHUNKS];
  for (int c = 0; c < CHUNKS; ++c) query[c] = load(q + c * kLanes);
  auto dot = [&](const uint16_t* key) {
    vfloat even, odd;
    load_widened_pairs(key, even, odd);
    vfloat sum = query[0] * even + query[1] * odd;
    for (int c = 2; c < CHUNKS; c += 2) {
      load_widened_pairs(key + c * kLanes, even, odd);
      sum += query[c] * even + query[c + 1] * odd;
    }
    return sum;
  };
  int t = 0;
  for (; t + kLanes <= num_keys; t += kLanes) {
    before_group();
    vfloat sums[kLanes];
    for (int k = 0; k < kLanes; ++k) sums[k] = dot(keys[t + k] + offset);
    store(scores + t, transposed_sum(sums));
  }
  for (; t < num_keys; ++t) scores[t] = horizontal_sum(dot(keys[t] + offset));
}

// acc[r] += sum_t probs[r][t] * v[t] for ROWS rows at once: each value row is loaded (and, for
// bfloat16, widened) once for all of them instead of once per row. probs[r][t] is at
// probs[r * row_step + t * key_step]: rows kKeyTile apart by default, or key-major (float_tiles.h).
// Only the CHUNKS vectors from `column` (an element offset into each accumulator, and into each
// value row past `offset`, where this kv head starts in the row).
// `before_group(work)` runs before each kLanes keys, with the work they hold (ROWS x CHUNKS: rows
// times vectors of a value row), for attend_item's prefetch shares.
struct NoHook {
  void operator()(int) const {}
};
template <int CHUNKS, int ROWS, typename value_t, typename Hook = NoHook>
inline void accumulate_rows(const float* probs, const value_t* const* values, int64_t offset,
                            int column, int num_keys, float* acc, int stride,
                            int row_step = kKeyTile, int key_step = 1,
                            Hook&& before_group = Hook()) {
  acc += column;
  vfloat sum[ROWS][CHUNKS];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CHUNKS; ++c) sum[r][c] = load(acc + r * stride + c * kLanes);
  for (int t = 0; t < num_keys; ++t) {
    if (t % kLanes == 0) before_group(ROWS * CHUNKS);
    vfloat value[CHUNKS];
    if constexpr (std::is_same_v<value_t, uint16_t>) {  // in pair order
      static_assert(CHUNKS % 2 == 0, "bfloat16 rows are widened two vectors at a time");
      for (int c = 0; c < CHUNKS; c += 2) {
        load_widened_pairs(values[t] + offset + column + c * kLanes, value[c], value[c + 1]);
      }
    } else {
      for (int c = 0; c < CHUNKS; ++c) value[c] = load(values[t] + offset + column + c * kLanes);
    }
    for (int r = 0; r < ROWS; ++r) {
      const float p = probs[r * row_step + t * key_step];
      for (int c = 0; c < CHUNKS; ++c) sum[r][c] += p * value[c];
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CHUNKS; ++c) store(acc + r * stride + c * kLanes, sum[r][c]);
}

// Rows whose accumulators fit in registers beside one value row, at most 4.
constexpr int rows_per_pass(int chunks) {
  return std::max(1, std::min(4, (kRegisters / 2) / chunks));
}

// The columns (in vectors) of a head that one value pass covers. float32 rows: the whole head.
// bfloat16 rows are widened as they are loaded, so the pass covers a half, a quarter... of the
// head, until four rows' accumulators fit in registers beside it: a decode item's GQA rows (3 for
// the default model) then share each widened vector. With AVX2's 16 registers and a 64-wide head
// whole rows went one at a time, each value widened three times: 1.28x slower (4.77 against
// 3.72 ms for a 64 x 1,024 step, Zen 4). float32 rows lost 1.23x that way: four slices of a
// few accumulators each are too few independent FMA chains to hide their latency.
template <int CHUNKS, typename value_t>
constexpr int slice_chunks() {
  int chunks = CHUNKS;
  if constexpr (std::is_same_v<value_t, uint16_t>) {
    while (chunks % 4 == 0 && rows_per_pass(chunks) < 4) chunks /= 2;  // stays even: pairs
  }
  return chunks;
}

// The value pass of one tile for every row of a work item, rows_per_pass rows at a time, one
// slice of columns after the other.
// `offset`: where this kv head starts in each value row; `before_group`: accumulate_rows'.
template <int CHUNKS, typename value_t, typename Hook>
inline void accumulate_tile(const float* probs, const value_t* const* values, int64_t offset,
                            int num_keys, float* acc, int stride, int num_rows,
                            Hook&& before_group) {
  constexpr int kSlice = slice_chunks<CHUNKS, value_t>();
  constexpr int kRows = rows_per_pass(kSlice);
  for (int column = 0; column < CHUNKS * kLanes; column += kSlice * kLanes) {
    int m = 0;
    for (; m + kRows <= num_rows; m += kRows) {
      accumulate_rows<kSlice, kRows>(probs + m * kKeyTile, values, offset, column, num_keys,
                                     acc + m * stride, stride, kKeyTile, 1, before_group);
    }
    // The remaining rows (fewer than kRows) in one pass too: a decode item has group_size rows.
    const float* rest_probs = probs + m * kKeyTile;
    float* rest_acc = acc + m * stride;
    switch (num_rows - m) {
      case 3:
        if constexpr (kRows > 3)
          accumulate_rows<kSlice, 3>(rest_probs, values, offset, column, num_keys, rest_acc,
                                     stride, kKeyTile, 1, before_group);
        break;
      case 2:
        if constexpr (kRows > 2)
          accumulate_rows<kSlice, 2>(rest_probs, values, offset, column, num_keys, rest_acc,
                                     stride, kKeyTile, 1, before_group);
        break;
      case 1:
        accumulate_rows<kSlice, 1>(rest_probs, values, offset, column, num_keys, rest_acc, stride,
                                   kKeyTile, 1, before_group);
        break;
    }
  }
}

#if defined(__AVX512BF16__) && PAGEDSERVE_LANES == 16
#define PAGEDSERVE_DPBF16 1
// scores[t] = scale * (q . k[t]) for bfloat16 q and k by AVX512_BF16 dot products (vdpbf16ps:
// each product of two bfloat16 values is exact in float32, pairs summed in float32), read straight
// from the cache: no widening of K. 32 values per instruction; CHUNKS (of 16 floats) is even.
// `before_group()` as in score_row.
template <int CHUNKS, typename Hook>
inline void score_row_dpbf16(const uint16_t* q, const uint16_t* const* keys, int64_t offset,
                             int num_keys, float scale, float* scores, Hook&& before_group) {
  constexpr int kPairs = CHUNKS / 2;
  __m512bh query[kPairs];
  for (int c = 0; c < kPairs; ++c) query[c] = (__m512bh)_mm512_loadu_si512(q + c * 2 * kLanes);
  auto dot = [&](const uint16_t* key) {
    key += offset;
    __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), query[0],
                                  (__m512bh)_mm512_loadu_si512(key));
    for (int c = 1; c < kPairs; ++c)
      sum = _mm512_dpbf16_ps(sum, query[c], (__m512bh)_mm512_loadu_si512(key + c * 2 * kLanes));
    return (vfloat)sum;
  };
  int t = 0;
  for (; t + kLanes <= num_keys; t += kLanes) {
    before_group();
    vfloat sums[kLanes];
    for (int k = 0; k < kLanes; ++k) sums[k] = dot(keys[t + k]);
    store(scores + t, transposed_sum(sums) * scale);
  }
  for (; t < num_keys; ++t) scores[t] = horizontal_sum(dot(keys[t])) * scale;
}
#endif

inline float horizontal_max(vfloat v) {
  const vfloat4 max4 = fold_to_4(v, true);
  return std::max(std::max(max4[0], max4[1]), std::max(max4[2], max4[3]));
}

// Turns a row's raw scores for this tile (`num_keys` of kKeyTile) into probabilities under the
// running maximum, rescaling what was accumulated under the previous maximum (online softmax).
// Scores past num_keys become -inf, so whole vectors can be processed and give probability 0.
inline void softmax_update(float* scores, int num_keys, int stride, float* acc, float& row_max,
                           float& row_sum) {
  for (int t = num_keys; t < kKeyTile; ++t) scores[t] = -std::numeric_limits<float>::infinity();
  vfloat tile_max_lanes = load(scores);
  for (int t = kLanes; t < kKeyTile; t += kLanes) {
    const vfloat next = load(scores + t);
    tile_max_lanes = next > tile_max_lanes ? next : tile_max_lanes;
  }
  const float tile_max = std::max(row_max, horizontal_max(tile_max_lanes));
  vfloat tile_sum = splat(0.0f);
  for (int t = 0; t < kKeyTile; t += kLanes) {
    const vfloat probs = exp_nonpositive(load(scores + t) - tile_max);
    store(scores + t, probs);
    tile_sum += probs;
  }
  if (tile_max > row_max) {
    const float correction = std::exp(row_max - tile_max);  // exp(-inf) = 0 on the first tile
    row_sum *= correction;
    for (int d = 0; d < stride; d += kLanes) store(acc + d, load(acc + d) * correction);
    row_max = tile_max;
  }
  row_sum += horizontal_sum(tile_sum);
}

#include "transpose.h"
#include "float_tiles.h"

// Items of at least this many rows per kv head (tokens x group size) take float_tiles.h's path
// (unless tile_attention.h's took them; decode tokens only over a float32 cache with float32
// queries, attend_item): its rows fill the lanes of a vector.
constexpr int kFloatTileMinRows = kLanes;

#ifdef PAGEDSERVE_DPBF16
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGEDSERVE_AMX 1
#endif
#include "tile_attention.h"

// Items of at least this many rows per kv head (tokens x group size) take the tile path: its
// products run on groups of 16 rows, and a decode token's few rows would leave most of them empty.
constexpr int kTileMinRows = 8;

// Whether this problem's prefill items (of at least kTileMinRows rows per kv head) take the tile
// products: a bfloat16 cache (or an fp8 one where the build has PAGEDSERVE_FP8_AS_BF16) under
// bfloat16 queries, blocks of whole 16-key groups, a head size with a compile-time path (64, 128).
// attend_item routes items by it and make_work_items sizes them by it (kTileQueryTile).
template <typename cache_t>
constexpr bool kTileCache =
    std::is_same_v<cache_t, at::BFloat16> ||
    (kFp8AsBf16Build && std::is_same_v<cache_t, Fp8E4M3>);
template <typename cache_t>
inline bool takes_tile_products(const Problem<cache_t>& p) {
  return kTileCache<cache_t> && p.bfloat16_io && p.block_size % 16 == 0 &&
         (p.head_dim == 64 || p.head_dim == 128);
}

// A prefill item over a bfloat16 cache (or an fp8 one, converted as the tiles are packed, where
// the build has PAGEDSERVE_FP8_AS_BF16) with bfloat16 queries as tile products
// (tile_attention.h), one kv head after the other: on AMX where the build has it and Linux grants
// the tile state, else by AVX512_BF16 dot products. Same rows, keys and options as attend_item.
template <int HEAD_DIM, typename cache_t>
void attend_item_tiles(const Problem<cache_t>& p, const WorkItem& item, int head_begin,
                     int head_end) {
  const int group_size = p.num_heads / p.num_kv_heads;
  const int query_start = p.query_start_loc[item.request];
  const int query_len = p.query_start_loc[item.request + 1] - query_start;
  const int chunk_position = p.seq_lens[item.request] - query_len;  // of the chunk's row 0
  const int num_rows = (item.query_end - item.query_begin) * group_size;
  std::vector<const uint16_t*> query_rows(num_rows);
  std::vector<uint16_t*> output_rows(num_rows);
  std::vector<float> row_sinks(p.sinks != nullptr ? num_rows : 0);
  tiles::HeadTask task{query_rows.data(), output_rows.data(),
                     p.sinks != nullptr ? row_sinks.data() : nullptr, num_rows, group_size,
                     chunk_position + item.query_begin};
  task.slot_stride = static_cast<int64_t>(p.num_kv_heads) * HEAD_DIM;
  task.block_table = p.block_tables + item.request * p.max_num_blocks_per_req;
  task.block_size = p.block_size;
  task.num_keys = chunk_position + item.query_end;
  task.first_key = p.sliding_window > 0
                       ? std::max(0, task.first_position - p.sliding_window + 1)
                       : 0;
  task.sliding_window = p.sliding_window;
  task.scale = p.scale;
  task.softcap = p.softcap;
  for (int kv_head = head_begin; kv_head < head_end; ++kv_head) {
    for (int m = 0; m < num_rows; ++m) {
      const int64_t token = query_start + item.query_begin + m / group_size;
      const int head = kv_head * group_size + m % group_size;
      query_rows[m] = static_cast<const uint16_t*>(p.query) + token * p.query_token_stride +
                      head * p.query_head_stride;
      output_rows[m] = static_cast<uint16_t*>(p.output) + (token * p.num_heads + head) * HEAD_DIM;
      if (p.sinks != nullptr) row_sinks[m] = p.sinks[head];
    }
    task.key_cache = p.key_cache + kv_head * HEAD_DIM;
    task.value_cache = p.value_cache + kv_head * HEAD_DIM;
    constexpr bool kFp8 = std::is_same_v<cache_t, Fp8E4M3>;
#ifdef PAGEDSERVE_AMX
    if (amx::tiles_permitted()) {
      tiles::attend_head<HEAD_DIM, tiles::AmxProducts, kFp8>(task);
      continue;
    }
#endif
    tiles::attend_head<HEAD_DIM, tiles::VectorProducts, kFp8>(task);
  }
}
#endif

// CHUNKS > 0 fixes head_dim / kLanes at compile time (64 and 128 are the common sizes); 0 reads
// it from the problem, including head sizes that end in a partial vector (zero padding).
//
// `next`: the task this thread runs after this one (nullptr: none), whose first key tile this
// one's last tile prefetches, so that a thread's stream of K/V requests does not stop between
// tasks; returns whether it did. `first_tile_prefetched`: the previous task did so for this one.
template <typename cache_t, int CHUNKS>
bool attend_item(const Problem<cache_t>& p, const Task& task, const Task* next,
                 bool first_tile_prefetched) {
  const WorkItem& item = *task.item;
  const int head_begin = task.head_begin, head_end = task.head_end;
#ifdef PAGEDSERVE_DPBF16
  if constexpr (kTileCache<cache_t> && CHUNKS > 0 && CHUNKS * kLanes % 32 == 0) {
    if (takes_tile_products(p) &&
        (item.query_end - item.query_begin) * (p.num_heads / p.num_kv_heads) >= kTileMinRows) {
      attend_item_tiles<CHUNKS * kLanes>(p, item, head_begin, head_end);
      return false;
    }
  }
#endif
  if constexpr (CHUNKS > 0) {
    // A decode token of a wide GQA group fills the lanes too: over a float32 cache with float32
    // queries it takes the tiles as before; others keep the vector path, whose prefetching a
    // decode item's K/V (read from memory, not just stored) needs and which the widening path's
    // measurements did not cover.
    const int tokens = item.query_end - item.query_begin;
    const bool widened = !std::is_same_v<cache_t, float> || p.bfloat16_io;
    if (tokens * (p.num_heads / p.num_kv_heads) >= kFloatTileMinRows && (tokens > 1 || !widened)) {
      float_tiles::attend_item<CHUNKS * kLanes>(p, item, head_begin, head_end);
      return false;
    }
  }
  const int group_size = p.num_heads / p.num_kv_heads;
  const int head_dim = p.head_dim;
  const int chunks = CHUNKS > 0 ? CHUNKS : (head_dim + kLanes - 1) / kLanes;
  const int stride = chunks * kLanes;  // padded row length in the float buffers
  const int query_start = p.query_start_loc[item.request];
  const int query_len = p.query_start_loc[item.request + 1] - query_start;
  const int first_position = p.seq_lens[item.request] - query_len;  // of the chunk's row 0
  const int head_rows = (item.query_end - item.query_begin) * group_size;  // per kv head
  const int num_rows = (head_end - head_begin) * head_rows;
  const int32_t* block_table = p.block_tables + item.request * p.max_num_blocks_per_req;

  // Row m = kv head head_begin + m / head_rows; within that head's rows, r = m % head_rows is
  // token query_begin + r / group_size and the group's query head r % group_size.
  auto token_of = [&](int m) {
    return query_start + item.query_begin + m % head_rows / group_size;
  };
  auto head_of = [&](int m) {
    return (head_begin + m / head_rows) * group_size + m % head_rows % group_size;
  };
  // Zero padding past head_dim keeps the padded lanes out of every dot product.
  std::vector<float> q(static_cast<size_t>(num_rows) * stride, 0.0f);  // pre-scaled
  std::vector<float> acc(static_cast<size_t>(num_rows) * stride, 0.0f);
  std::vector<float> row_max(num_rows, -std::numeric_limits<float>::infinity());
  std::vector<float> row_sum(num_rows, 0.0f);
  if (p.sinks != nullptr) {  // as if one key of logit sinks[head] and value 0 had been seen
    for (int m = 0; m < num_rows; ++m) {
      row_max[m] = p.sinks[head_of(m)];
      row_sum[m] = 1.0f;
    }
  }
  // One tile's scores, then probabilities, for every row (kKeyTile apart): the value pass reads
  // each value row once for several rows (accumulate_tile).
  std::vector<float> probs(static_cast<size_t>(num_rows) * kKeyTile);
  const float* key_rows[kKeyTile];  // into the cache (float32) or the widened tiles
  const float* value_rows[kKeyTile];
  const uint16_t* bf16_key_rows[kKeyTile];  // into a bfloat16 cache, read as they are
  const uint16_t* bf16_value_rows[kKeyTile];
  // float32 rows of whole vectors are read in place; bfloat16 values are widened in registers
  // (whole vectors, compile-time head sizes); anything else is widened (and zero-padded) first.
  constexpr bool kBf16Cache = std::is_same_v<cache_t, at::BFloat16>;
  // fp8 rows converted to bfloat16 rows a tile at a time (Fp8ToBf16), then read as a bfloat16
  // cache's are; elsewhere fp8 rows are widened to float32 like float16's.
#ifdef PAGEDSERVE_FP8_AS_BF16
  constexpr bool kFp8AsBf16 =
      std::is_same_v<cache_t, Fp8E4M3> && CHUNKS > 0 && CHUNKS * kLanes % 64 == 0;
#else
  constexpr bool kFp8AsBf16 = false;
#endif
  const bool read_in_place = std::is_same_v<cache_t, float> && head_dim % kLanes == 0;
  const bool bf16_values = (kBf16Cache || kFp8AsBf16) && CHUNKS > 0;  // read as bfloat16 rows
#ifdef PAGEDSERVE_DPBF16
  // bfloat16 queries over bfloat16 rows: q . k by AVX512_BF16 dot products, keys unwidened.
  const bool dpbf16_scores =
      (kBf16Cache || kFp8AsBf16) && CHUNKS > 0 && CHUNKS % 2 == 0 && p.bfloat16_io;
#else
  const bool dpbf16_scores = false;
#endif

  // Other bfloat16 keys under a few rows per kv head (a decode token's GQA group) are widened in
  // registers as they are scored (score_row_widened); under a prefill chunk's many rows, widening
  // each key once into the float32 tile is cheaper than once per row (one 1,024-token chunk took
  // 15-21% longer widened per row, AVX-512 and AVX2 builds).
  const bool widened_scores = bf16_values && !dpbf16_scores && head_rows <= 8;
  const bool bf16_keys = dpbf16_scores || widened_scores;  // keys read as bfloat16 rows
  const bool keys_in_place = read_in_place || (kBf16Cache && bf16_keys);
  const bool values_in_place = read_in_place || (kBf16Cache && bf16_values);
  // Widened rows, zero-padded to `stride` (only where rows are not read in place).
  const bool float_keys = !keys_in_place && !(kFp8AsBf16 && bf16_keys);
  std::vector<float> key_tile(float_keys ? static_cast<size_t>(kKeyTile) * stride : 0, 0.0f);
  std::vector<float> value_tile(
      values_in_place || kFp8AsBf16 ? 0 : static_cast<size_t>(kKeyTile) * stride, 0.0f);
  // fp8 rows converted to bfloat16 (kFp8AsBf16), `stride` apart.
  std::vector<uint16_t> bf16_key_tile(kFp8AsBf16 && bf16_keys ? kKeyTile * stride : 0);
  std::vector<uint16_t> bf16_value_tile(kFp8AsBf16 ? kKeyTile * stride : 0);

  // The query rows as dpbf16_scores reads them: bfloat16, unscaled, zero-padded to `stride`.
  std::vector<uint16_t> q_bf16(dpbf16_scores ? static_cast<size_t>(num_rows) * stride : 0, 0);
  for (int m = 0; m < num_rows; ++m) {
    const int64_t offset = token_of(m) * p.query_token_stride + head_of(m) * p.query_head_stride;
    float* row = q.data() + static_cast<size_t>(m) * stride;
    if (dpbf16_scores) {  // scored from the bfloat16 row as it is; the float32 row goes unused
      const uint16_t* src = static_cast<const uint16_t*>(p.query) + offset;
      std::memcpy(q_bf16.data() + m * stride, src, head_dim * sizeof(uint16_t));
    } else if (p.bfloat16_io) {  // in pair order where the keys are widened that way
      const uint16_t* src = static_cast<const uint16_t*>(p.query) + offset;
      for (int d = 0; d < head_dim; ++d) {
        row[widened_scores ? pair_order_index(d) : d] = pagedserve::bf16_to_float(src[d]) * p.scale;
      }
    } else {
      const float* src = static_cast<const float*>(p.query) + offset;
      for (int d = 0; d < head_dim; ++d) {
        row[widened_scores ? pair_order_index(d) : d] = src[d] * p.scale;
      }
    }
  }

  int first_key, num_keys;
  key_range(p, item, first_key, num_keys);
  // Cache rows of one key tile: block = table[pos / block_size], offset = pos % block_size,
  // stepped rather than divided per key. Each tile's rows are resolved and prefetched while the
  // previous tile is computed: the block table scatters a request's history, so the hardware
  // prefetcher cannot run ahead across blocks. Prefetched into L2, not L1 (but on Zen 5:
  // prefetch_into_l1), and spread over the tile's work rather than all at once: on an AMD EPYC
  // (Zen 4) a whole tile's lines requested into L1 in one burst stalled on L1's few miss
  // buffers, and the decode step ran 1.5-1.7x slower than with the same requests into L2. A
  // share before each row's scores gained another 3-18%; a share before each group of kLanes
  // keys of a row (num_rows x tile_keys / kLanes shares, ~43 lines each for a float32 decode
  // item of the default model, against ~170 per row) took a float32 64 x 384 decode step from
  // 1.41-1.64x to 1.12-1.34x the time of a plain read of its K/V (1.40-1.51x to 1.21-1.36x at
  // 1,024; bfloat16 0-7% faster), with the same loads: a pass that only gathers K/V through the
  // block tables, prefetching a few keys ahead, runs at the read pass's speed, so the bursts, not
  // the scattered blocks, had kept loads and arithmetic apart. Finer still (every 4 keys, a branch
  // inside the score loop) was slower again.
  int64_t tile_rows[2][kKeyTile];
  int next_block_index = first_key / p.block_size, next_offset = first_key % p.block_size;
  // The item's kv heads are adjacent in a slot: one contiguous span per position.
  const int row_bytes = (head_end - head_begin) * head_dim * static_cast<int>(sizeof(cache_t));
  auto resolve_tile = [&](int key_begin, int64_t* rows) {
    const int tile_keys = std::min(kKeyTile, num_keys - key_begin);
    for (int t = 0; t < tile_keys; ++t) {
      const int64_t slot =
          static_cast<int64_t>(block_table[next_block_index]) * p.block_size + next_offset;
      rows[t] = (slot * p.num_kv_heads + head_begin) * head_dim;  // + (kv head - head_begin) * D
      if (++next_offset == p.block_size) {
        next_offset = 0;
        ++next_block_index;
      }
    }
  };
  // Into L2 (prefetcht1), or into L1 (prefetcht0) on the cores where that measured faster.
  const bool into_l1 = prefetch_into_l1();
  auto prefetch_line = [into_l1](const char* line) { pagedserve::prefetch_line(line, into_l1); };
  // The order a full tile's keys are requested in: by position, or a block apart where
  // prefetch_blocks_interleaved (key 0 of each of the tile's blocks, then key 1 of each, ...), so
  // that the requests run down all of the tile's blocks at once. The i-th key requested is
  // (i mod B) x block_size + i div B for B blocks a tile, by shifts (no division per key): block
  // sizes that are powers of two below kKeyTile; other sizes and partial tiles (a task's last) go
  // by position.
  int block_shift = 0, blocks_shift = 0;  // log2(block_size), log2(B); B = 1: by position
  if (prefetch_blocks_interleaved() && p.block_size < kKeyTile &&
      (p.block_size & (p.block_size - 1)) == 0) {
    block_shift = __builtin_ctz(p.block_size);
    blocks_shift = __builtin_ctz(kKeyTile) - block_shift;
  }
  const int blocks_mask = (1 << blocks_shift) - 1;
  auto key_at = [=](int i, int keys) {
    return keys == kKeyTile ? ((i & blocks_mask) << block_shift) + (i >> blocks_shift) : i;
  };
  // Requests the keys key_at([begin, end)) of a tile of `keys` keys.
  auto prefetch_rows = [&](const int64_t* rows, int keys, int begin, int end) {
    for (int i = begin; i < end; ++i) {
      const int64_t row = rows[key_at(i, keys)];
      const char* key = reinterpret_cast<const char*>(p.key_cache + row);
      const char* value = reinterpret_cast<const char*>(p.value_cache + row);
      for (int byte = 0; byte < row_bytes; byte += 64) {
        prefetch_line(key + byte);
        prefetch_line(value + byte);
      }
    }
  };
  // prefetch_share(share, shares) requests the next tile up to share / shares of it (a share may
  // hold none, or several rows), key by key: every head's K row of a key, then its V row, each
  // one contiguous span (keys a block apart where prefetch_blocks_interleaved: key_at). On AMD's
  // cores float32 tiles go in the order attend_head reads them instead (float_prefetch_by_head):
  // kv head by kv head, that head's K row of every key, then its V rows (units of one head's row
  // of one key, `next_part` = 2 x head + 1 for V, `next_key`). Requested key by key there, the
  // last keys' head-0 rows arrived late, while the first row was scoring them: a float32 decode
  // step 64 x 1,024 took 1.39x the time of a plain read of its K/V that way and 1.19x by head
  // (AVX-512 build 1.22x -> 1.10x, AVX2 1.53x -> 1.35x; 2-core Zen 4, 40 interleaved repeats;
  // on huge pages the workload's step 1.13x). Over a bfloat16 cache, whose steps are bound by
  // arithmetic rather than memory, the head order was 1.07-1.29x slower, so those keep the key
  // order everywhere.
  const bool by_head = std::is_same_v<cache_t, float> && float_prefetch_by_head();
  const int head_bytes = head_dim * static_cast<int>(sizeof(cache_t));
  int next_requested = 0, next_part = 0, next_key = 0;  // units (by_head) or keys requested
  auto prefetch_share = [&](const int64_t* rows, int next_keys, int share, int shares) {
    const int units = by_head ? (head_end - head_begin) * 2 * next_keys : next_keys;
    const int until = static_cast<int>(static_cast<int64_t>(share) * units / shares);
    if (until <= next_requested) return;
    if (!by_head) {
      prefetch_rows(rows, next_keys, next_requested, until);
      next_requested = until;
      return;
    }
    for (; next_requested < until; ++next_requested) {
      const cache_t* cache = (next_part % 2 ? p.value_cache : p.key_cache) + rows[next_key];
      const char* row = reinterpret_cast<const char*>(cache + (next_part / 2) * head_dim);
      for (int byte = 0; byte < head_bytes; byte += 64) prefetch_line(row + byte);
      if (++next_key == next_keys) {
        next_key = 0;
        ++next_part;
      }
    }
  };
  resolve_tile(first_key, tile_rows[0]);
  if (!first_tile_prefetched) {
    const int keys = std::min(kKeyTile, num_keys - first_key);
    prefetch_rows(tile_rows[0], keys, 0, keys);
  }
  // Rows read in place are pointed at once per tile, at the task's first kv head; scoring and the
  // value pass add each head's offset (the heads of a slot are adjacent). Rows widened into
  // key_tile / value_tile (other cache dtypes) are widened per head and read at offset 0.
  auto point_at_tile = [&](int tile, int tile_keys) {
    for (int t = 0; t < tile_keys; ++t) {
      const int64_t row = tile_rows[tile][t];
      if constexpr (std::is_same_v<cache_t, float>) {
        key_rows[t] = p.key_cache + row;
        value_rows[t] = p.value_cache + row;
      } else if constexpr (kBf16Cache) {
        bf16_key_rows[t] = reinterpret_cast<const uint16_t*>(p.key_cache + row);
        bf16_value_rows[t] = reinterpret_cast<const uint16_t*>(p.value_cache + row);
      }
    }
  };
  // One key tile for one kv head of the task: score its rows, update their softmax, then one value
  // pass over the tile for all of them. `next_keys` of the next tile are prefetched meanwhile.
  auto attend_head = [&](int head, int tile, int key_begin, int tile_keys, int next_keys) {
    const int64_t head_offset = static_cast<int64_t>(head - head_begin) * head_dim;
    const int row0 = (head - head_begin) * head_rows;  // this kv head's first row
    const int64_t key_offset = keys_in_place ? head_offset : 0;
    const int64_t value_offset = values_in_place ? head_offset : 0;
    if constexpr (kFp8AsBf16) {
#ifdef PAGEDSERVE_FP8_AS_BF16
      const Fp8ToBf16& to_bf16 = fp8_to_bf16();
      for (int t = 0; t < tile_keys; ++t) {
        const int64_t row = tile_rows[tile][t] + head_offset;
        if (bf16_keys) {
          uint16_t* key = bf16_key_tile.data() + t * stride;
          to_bf16(p.key_cache + row, key, head_dim);
          bf16_key_rows[t] = key;
        } else {
          float* key = key_tile.data() + t * stride;
          widen_row(p.key_cache + row, key, head_dim);
          key_rows[t] = key;
        }
        uint16_t* value = bf16_value_tile.data() + t * stride;
        to_bf16(p.value_cache + row, value, head_dim);
        bf16_value_rows[t] = value;
      }
#endif
    } else if (!keys_in_place) {
      for (int t = 0; t < tile_keys; ++t) {
        const int64_t row = tile_rows[tile][t] + head_offset;
        float* key = key_tile.data() + t * stride;
        widen_row(p.key_cache + row, key, head_dim);
        key_rows[t] = key;
        if (!values_in_place) {
          float* value = value_tile.data() + t * stride;
          widen_row(p.value_cache + row, value, head_dim);
          value_rows[t] = value;
        }
      }
    }
    // The next tile is requested in shares, each the part of it that matches the part of this
    // tile's work done so far: the unit is one row's kLanes keys of one vector of a head (C
    // units a group of keys in score_row, as many per row of accumulate_tile's value pass), so
    // a share goes out before each group of kLanes keys of either product, and a row's scores
    // (or a head's value pass) start where the work before them ends. float32 tiles by head are
    // requested every 16 keys: with AVX2's 8 lanes, every 8 keys ran a float32 64 x 1,024
    // decode step 4-6% slower (1.22-1.23x against 1.26-1.31x its read; 1.5% at 384 keys), while
    // bfloat16 ran 5% faster every 8 (2-core Zen 4, interleaved rounds). AVX-512's 16 lanes are
    // 16 keys either way. Shares during the value pass too, not only the scores, took a 64 x
    // 1,024 decode step from 1.48x to 1.42x the time of a contiguous read of its K/V (bfloat16,
    // native build), 1.65x to 1.50x (bfloat16, AVX2 build) and 1.40x to 1.37x (float32, AVX2;
    // Sapphire Rapids, interleaved rounds): with half of the tile's work issuing no requests,
    // the requests went out in bursts that the value pass then waited on.
    const int groups_per_request = by_head ? std::max(1, 16 / kLanes) : 1;
    const int groups = std::max(1, tile_keys / kLanes);
    constexpr int C = CHUNKS > 0 ? CHUNKS : 1;  // units per group of keys (a vector each)
    constexpr int kProducts = CHUNKS > 0 ? 2 : 1;  // accumulate_values (any head size) has no hook
    const int row_work = groups * C;             // one row's scores of the tile (or its values)
    const int shares = num_rows * row_work * kProducts;
    const int head_work = head_rows * row_work * kProducts;
    const int head_start = (head - head_begin) * head_work;
    int groups_seen = 0;  // by groups_per_request
    auto request = [&](int share) {
      if ((++groups_seen & (groups_per_request - 1)) == 0) {  // 1 or 2: a mask, not a division
        prefetch_share(tile_rows[tile ^ 1], next_keys, std::min(share, shares), shares);
      }
    };
    for (int m = row0; m < row0 + head_rows; ++m) {
      int share = head_start + (m - row0) * row_work;
      prefetch_share(tile_rows[tile ^ 1], next_keys, share, shares);  // what earlier rows left
      auto before_group = [&] { request(share += C); };
      float* scores = probs.data() + static_cast<size_t>(m) * kKeyTile;
      // Causal: the row at position first_position + token sees keys up to that position.
      const int row_position = first_position + item.query_begin + (m - row0) / group_size;
      const int visible = std::min(tile_keys, row_position + 1 - key_begin);
      // The row's oldest visible key, within this tile (0 without a window).
      const int hidden =
          p.sliding_window > 0 ? std::max(0, row_position - p.sliding_window + 1 - key_begin) : 0;
      if (visible <= hidden) {  // nothing of this tile: probability 0 for every key
        std::fill(scores, scores + kKeyTile, 0.0f);
        continue;
      }
#ifdef PAGEDSERVE_DPBF16
      if (dpbf16_scores) {
        score_row_dpbf16<CHUNKS>(q_bf16.data() + static_cast<size_t>(m) * stride, bf16_key_rows,
                                 key_offset, visible, p.scale, scores, before_group);
      } else
#endif
      if (widened_scores) {
        if constexpr ((kBf16Cache || kFp8AsBf16) && CHUNKS > 0) {  // as widened_scores implies
          score_row_widened<CHUNKS>(q.data() + static_cast<size_t>(m) * stride, bf16_key_rows,
                                    key_offset, visible, scores, before_group);
        }
      } else {
        score_row<CHUNKS>(q.data() + static_cast<size_t>(m) * stride, key_rows, key_offset, chunks,
                          visible, scores, before_group);
      }
      if (p.softcap > 0.0f) {
        for (int t = 0; t < visible; ++t) scores[t] = p.softcap * std::tanh(scores[t] / p.softcap);
      }
      for (int t = 0; t < hidden; ++t) scores[t] = -std::numeric_limits<float>::infinity();
      softmax_update(scores, visible, stride, acc.data() + static_cast<size_t>(m) * stride,
                     row_max[m], row_sum[m]);
    }
    // Keys a row does not see have probability 0 there: one value pass over the tile serves all
    // of this kv head's rows. Its shares follow the scores' (head_work's second half).
    int value_share = head_start + head_rows * row_work;
    prefetch_share(tile_rows[tile ^ 1], next_keys, value_share, shares);
    auto value_group = [&](int work) { request(value_share += work); };
    const float* head_probs = probs.data() + static_cast<size_t>(row0) * kKeyTile;
    float* head_acc = acc.data() + static_cast<size_t>(row0) * stride;
    if constexpr (CHUNKS > 0) {
      if (bf16_values) {
        accumulate_tile<CHUNKS>(head_probs, bf16_value_rows, value_offset, tile_keys, head_acc,
                                stride, head_rows, value_group);
      } else {
        accumulate_tile<CHUNKS>(head_probs, value_rows, value_offset, tile_keys, head_acc, stride,
                                head_rows, value_group);
      }
    } else {
      for (int m = 0; m < head_rows; ++m) {
        accumulate_values<CHUNKS>(head_probs + static_cast<size_t>(m) * kKeyTile, value_rows,
                                  value_offset, chunks, tile_keys,
                                  head_acc + static_cast<size_t>(m) * stride);
      }
    }
  };
  bool handed_over = false;
  for (int key_begin = first_key, tile = 0; key_begin < num_keys;
       key_begin += kKeyTile, tile ^= 1) {
    const int tile_keys = std::min(kKeyTile, num_keys - key_begin);
    int next_keys = std::max(0, std::min(kKeyTile, num_keys - key_begin - kKeyTile));
    if (next_keys > 0) {
      resolve_tile(key_begin + kKeyTile, tile_rows[tile ^ 1]);
    } else if (next != nullptr) {  // the last tile: the next task's first one is prefetched
      next_keys = resolve_first_tile(p, *next, tile_rows[tile ^ 1]);
      next = nullptr;
      handed_over = true;
    }
    if (keys_in_place || values_in_place) point_at_tile(tile, tile_keys);
    next_requested = next_part = next_key = 0;
    for (int head = head_begin; head < head_end; ++head) {
      attend_head(head, tile, key_begin, tile_keys, next_keys);
    }
    prefetch_share(tile_rows[tile ^ 1], next_keys, 1, 1);  // any share no row's groups reached
  }

  for (int m = 0; m < num_rows; ++m) {
    const float inverse_sum = 1.0f / row_sum[m];  // > 0: every row sees at least its own key
    const float* row = acc.data() + static_cast<size_t>(m) * stride;
    const int64_t offset = (token_of(m) * p.num_heads + head_of(m)) * head_dim;
    // bfloat16 value rows were accumulated in pair order (load_widened_pairs): dims back in place.
    auto at = [&](int d) { return bf16_values ? row[pair_order_index(d)] : row[d]; };
    if (p.bfloat16_io) {
      uint16_t* out = static_cast<uint16_t*>(p.output) + offset;
      for (int d = 0; d < head_dim; ++d) out[d] = pagedserve::float_to_bf16(at(d) * inverse_sum);
    } else {
      float* out = static_cast<float*>(p.output) + offset;
      for (int d = 0; d < head_dim; ++d) out[d] = at(d) * inverse_sum;
    }
  }
  return handed_over;
}

template <typename cache_t>
int resolve_first_tile(const Problem<cache_t>& p, const Task& task, int64_t* rows) {
  int first_key, num_keys;
  key_range(p, *task.item, first_key, num_keys);
  const int32_t* block_table = p.block_tables + task.item->request * p.max_num_blocks_per_req;
  const int tile_keys = std::min(kKeyTile, num_keys - first_key);
  for (int t = 0; t < tile_keys; ++t) {
    const int position = first_key + t;
    const int64_t slot = static_cast<int64_t>(block_table[position / p.block_size]) * p.block_size +
                         position % p.block_size;
    rows[t] = (slot * p.num_kv_heads + task.head_begin) * p.head_dim;
  }
  return tile_keys;
}

std::vector<WorkItem> make_work_items(const int32_t* query_start_loc, const int32_t* seq_lens,
                                      int num_reqs, int64_t max_seq_len, int query_tile) {
  std::vector<WorkItem> items;
  for (int r = 0; r < num_reqs; ++r) {
    const int query_len = query_start_loc[r + 1] - query_start_loc[r];
    TORCH_CHECK(query_len >= 1 && query_len <= seq_lens[r], "request ", r, ": query length ",
                query_len, " must be in [1, seq_len=", seq_lens[r], "]");
    TORCH_CHECK(seq_lens[r] <= max_seq_len, "request ", r, ": seq_len ", seq_lens[r],
                " exceeds its block table (", max_seq_len, " slots)");
    for (int begin = 0; begin < query_len; begin += query_tile) {
      const int end = std::min(query_len, begin + query_tile);
      const int64_t num_keys = seq_lens[r] - query_len + end;
      items.push_back({r, begin, end, static_cast<int64_t>(end - begin) * num_keys});
    }
  }
  // Longest first, so dynamic scheduling does not end with one core on a long prefill tile.
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

template <typename cache_t, int CHUNKS>
void run(const Problem<cache_t>& problem, const std::vector<WorkItem>& items) {
  // A task is an item with all its kv heads where there are enough items to keep every thread
  // busy (a decode batch, a long prefill): a position's K/V rows of all heads are adjacent in the
  // cache, so the task reads one contiguous span per position. One kv head per task otherwise
  // (a single request's decode token), so that a small batch still spreads over the cores.
  const int num_threads = at::get_num_threads();
  const int num_kv_heads = problem.num_kv_heads;
  const int heads_per_task =
      static_cast<int64_t>(items.size()) >= 2 * num_threads ? num_kv_heads : 1;
  const int64_t tasks_per_item = num_kv_heads / heads_per_task;
  const int64_t num_tasks = static_cast<int64_t>(items.size()) * tasks_per_item;
  auto task_at = [&](int64_t index) {
    const int head_begin = static_cast<int>(index % tasks_per_item) * heads_per_task;
    return Task{&items[index / tasks_per_item], head_begin, head_begin + heads_per_task};
  };
  // Tasks are handed out one at a time, longest first, from a shared counter (dynamic
  // scheduling). With several tasks per thread, a thread claims its next task when it starts one,
  // so that the one's last key tile can prefetch the next's first (attend_item); with fewer, that
  // claim could leave a thread idle, and tasks are claimed as each one ends.
  const bool claim_ahead = num_tasks >= 4 * static_cast<int64_t>(num_threads);
  std::atomic<int64_t> claimed{0};
#pragma omp parallel num_threads(num_threads)
  {
    int64_t current = claimed.fetch_add(1, std::memory_order_relaxed);
    bool prefetched = false;
    while (current < num_tasks) {
      const int64_t following = claim_ahead ? claimed.fetch_add(1, std::memory_order_relaxed) : -1;
      const bool has_next = 0 <= following && following < num_tasks;
      const Task next = has_next ? task_at(following) : Task{};
      prefetched = attend_item<cache_t, CHUNKS>(problem, task_at(current),
                                                has_next ? &next : nullptr, prefetched);
      current = claim_ahead ? following : claimed.fetch_add(1, std::memory_order_relaxed);
    }
  }
}

template <typename cache_t>
void launch(const at::Tensor& query, const at::Tensor& key_cache,
            const at::Tensor& value_cache, at::Tensor& output,
            const at::Tensor& block_tables, const at::Tensor& query_start_loc,
            const at::Tensor& seq_lens, double scale, int64_t sliding_window, double softcap,
            const c10::optional<at::Tensor>& sinks) {
  const Problem<cache_t> problem{
      query.data_ptr(), query.stride(0), query.stride(1),
      query.scalar_type() == at::kBFloat16,
      static_cast<const cache_t*>(key_cache.data_ptr()),
      static_cast<const cache_t*>(value_cache.data_ptr()), output.data_ptr(),
      block_tables.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(),
      seq_lens.data_ptr<int32_t>(), block_tables.size(1), static_cast<int>(key_cache.size(1)),
      static_cast<int>(query.size(1)), static_cast<int>(key_cache.size(2)),
      static_cast<int>(query.size(2)), static_cast<float>(scale),
      static_cast<int>(sliding_window), static_cast<float>(softcap),
      sinks.has_value() ? sinks->data_ptr<float>() : nullptr};
  bool tile_prefill = false;
#ifdef PAGEDSERVE_DPBF16
  tile_prefill = takes_tile_products(problem);
#endif
  // Block ids themselves are trusted (the block manager owns them); lengths are checked.
  const auto items = make_work_items(problem.query_start_loc, problem.seq_lens, seq_lens.size(0),
                                     problem.max_num_blocks_per_req * problem.block_size,
                                     tile_prefill ? kTileQueryTile : kQueryTile);
  // The common head sizes get compile-time vector counts; any other size takes the generic path.
  switch (problem.head_dim) {
    case 64: return run<cache_t, 64 / kLanes>(problem, items);
    case 128: return run<cache_t, 128 / kLanes>(problem, items);
    default: return run<cache_t, 0>(problem, items);
  }
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache,
                              const at::Tensor& value_cache, const at::Tensor& block_tables,
                              const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                              double scale, int64_t sliding_window, double softcap,
                              const c10::optional<at::Tensor>& sinks) {
  RECORD_FUNCTION("pagedserve::paged_attention", std::vector<c10::IValue>());
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query must be [num_tokens, num_heads, "
              "head_dim] and key_cache [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() &&
                  key_cache.scalar_type() == value_cache.scalar_type(),
              "key and value caches differ in shape or dtype");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "query must be float32 or bfloat16 (got ", query.scalar_type(),
              "); the caller converts");
  TORCH_CHECK(query.stride(2) == 1, "the query's head_dim must be contiguous (any token and "
              "head strides)");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "the caches must be contiguous");
  for (const auto* tensor : {&query, &key_cache, &value_cache, &block_tables, &query_start_loc,
                             &seq_lens}) {
    TORCH_CHECK(tensor->device().is_cpu(), "the CPU kernel needs CPU tensors, got ",
                tensor->device());
  }
  for (const auto* index : {&block_tables, &query_start_loc, &seq_lens}) {
    TORCH_CHECK(index->scalar_type() == at::kInt && index->is_contiguous(),
                "block_tables, query_start_loc and seq_lens must be contiguous int32");
  }
  const int num_heads = query.size(1), num_kv_heads = key_cache.size(2);
  const int head_dim = query.size(2), num_reqs = seq_lens.size(0);
  TORCH_CHECK(key_cache.size(3) == head_dim, "head_dim differs between query and cache");
  TORCH_CHECK(head_dim <= kMaxChunks * kLanes, "head_dim ", head_dim, " exceeds ",
              kMaxChunks * kLanes);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads ", num_heads,
              " is not a multiple of num_kv_heads ", num_kv_heads);
  TORCH_CHECK(query_start_loc.size(0) == num_reqs + 1 && block_tables.size(0) == num_reqs,
              "metadata sizes disagree with seq_lens");
  TORCH_CHECK(sliding_window >= 0 && softcap >= 0.0, "sliding_window and softcap must be >= 0");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat &&
                                     sinks->is_contiguous() && sinks->numel() == num_heads),
              "sinks must be a contiguous float32 tensor of num_heads logits");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  TORCH_CHECK(qsl[num_reqs] == query.size(0), "query_start_loc[-1] != num_tokens");

  auto output = at::empty({query.size(0), num_heads, head_dim}, query.options());
  auto run_for = [&](auto cache_type_tag) {
    using cache_t = decltype(cache_type_tag);
    launch<cache_t>(query, key_cache, value_cache, output, block_tables, query_start_loc,
                    seq_lens, scale, sliding_window, softcap, sinks);
  };
  switch (key_cache.scalar_type()) {
    case at::kFloat: run_for(float{}); break;
    case at::kBFloat16: run_for(at::BFloat16{}); break;
    case at::kHalf: run_for(at::Half{}); break;
    case at::kFloat8_e4m3fn: run_for(Fp8E4M3{}); break;
    default:
      TORCH_CHECK(false, "the KV cache must be float32, bfloat16, float16 or float8_e4m3fn, not ",
                  key_cache.scalar_type());
  }
  return output;
}

// What the build targets, for the module's attributes (bindings.cpp).
int vector_lanes() { return kLanes; }  // 16 (AVX-512) or 8 (AVX2)

// bfloat16 q . k on AVX512_BF16 (score_row_dpbf16), bfloat16 prefill items as tile products
// (tile_attention.h).
bool bf16_dot_products() {
#ifdef PAGEDSERVE_DPBF16
  return true;
#else
  return false;
#endif
}

// fp8 rows converted to bfloat16 by table lookups (Fp8ToBf16, AVX512_VBMI) rather than widened to
// float32.
bool fp8_as_bf16() {
#ifdef PAGEDSERVE_FP8_AS_BF16
  return true;
#else
  return false;
#endif
}

bool amx_tiles() {  // bfloat16 prefill items on AMX (tile_attention.h), where Linux grants them
#ifdef PAGEDSERVE_AMX
  return amx::tiles_permitted();
#else
  return false;
#endif
}

#if defined(__x86_64__)
namespace {
// The CPUID vendor's first word: "Auth"enticAMD, "Hygo"nGenuine (the same design), "Genu"ineIntel.
unsigned int cpu_vendor_word() {
  unsigned int eax, ebx, ecx, edx;
  return __get_cpuid(0, &eax, &ebx, &ecx, &edx) ? ebx : 0;
}
constexpr unsigned int kAuth = 0x68747541, kHygo = 0x6f677948;

// AMD's Zen 5 (family 1Ah) or a later core, where the decode prefetch below takes another plan.
bool amd_zen5_or_later() {
  static const bool zen5 = [] {
    unsigned int eax, ebx, ecx, edx;
    if (cpu_vendor_word() != kAuth || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
    const unsigned int base_family = (eax >> 8) & 0xf, extended_family = (eax >> 20) & 0xff;
    return (base_family == 0xf ? base_family + extended_family : base_family) >= 0x1a;
  }();
  return zen5;
}
}  // namespace
#endif

// Whether float32 tiles' prefetches go out kv head by kv head (attend_item's prefetch_share): on
// AMD's cores (and Hygon's, the same design), where that order made a float32 decode step 1.13-
// 1.17x faster than key by key (2-core Zen 4). Key by key everywhere else: on Intel's Sapphire
// Rapids the head order was the slower one, a 64 x 1,024 float32 decode step from memory (2 MiB
// pages, 3 interleaved runs) taking 1.43-1.47x the time of a plain read of its K/V against
// 1.29-1.30x key by key (AVX-512 builds; AVX2 1.61-1.63x against 1.42-1.47x); key order also
// issues fewer instructions (1.15-1.30 ms with K/V in L2, against 1.50-1.66 by head). On Zen 5,
// key order with the blocks interleaved (prefetch_blocks_interleaved) measured 7% faster than by
// head in three runs and level or 4% slower in three others: by head it stays.
bool float_prefetch_by_head() {
#if defined(__x86_64__)
  static const bool by_head = [] {
    const unsigned int vendor = cpu_vendor_word();
    return vendor == kAuth || vendor == kHygo;
  }();
  return by_head;
#else
  return false;
#endif
}

// Whether decode tiles are prefetched into L1 (prefetcht0) instead of L2 (prefetcht1): on AMD's
// Zen 5 and later. There, in interleaved rounds of a 64 x 1,024 decode step from memory (2-core
// EPYC 9005 VM), L1 was faster in every build and cache dtype: float32 2.5-10% (native 3.21 ->
// 3.13, AVX-512 3.34 -> 3.11, AVX2 3.47 -> 3.14 ms), bfloat16 4-7% (1.70 -> 1.58, 1.66 -> 1.58,
// 1.60 -> 1.54 ms); the plain paged read pass too (1.27x against 1.33x the time of a contiguous
// read). On Zen 4 an L1 prefetch of the same tiles ran 1.66x slower, on Sapphire Rapids 3% slower
// (2.85 against 2.77 ms), so every other CPU keeps L2.
bool prefetch_into_l1() {
#if defined(__x86_64__)
  return amd_zen5_or_later();
#else
  return false;
#endif
}

// Whether the next tile's keys, where they are requested key by key, go a block apart (key 0 of
// each of its blocks, then key 1 of each, ...: attend_item's key_at) rather than in position
// order, one block after another: on Zen 5 and later. There the requests of a tile's four 16-key
// blocks, interleaved, made a bfloat16 64 x 1,024 decode step 6-17% faster (native 1.30 -> 1.08,
// 1.20 -> 1.06, 1.16 -> 1.09 ms, AVX-512 1.39 -> 1.21, 1.41 -> 1.30, 1.26 -> 1.17; AVX2, bound by
// its arithmetic, level: 1.41 -> 1.41, 1.31 -> 1.31); the same bits, only the requests move. Not
// measured on other CPUs, which keep position order. (float32 tiles go by head on AMD's cores.)
bool prefetch_blocks_interleaved() {
#if defined(__x86_64__)
  return amd_zen5_or_later();
#else
  return false;
#endif
}
