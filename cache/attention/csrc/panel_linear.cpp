// x W^T for decode-sized batches (a row per running request) of float32 or bfloat16 rows, from a
// weight packed once into column panels: the register-blocked GEMM of every BLAS, small enough to
// read.
//
// Why not oneDNN's packed linear, which the loader uses for prefill-sized batches: at the rows of a
// decode step it runs well below its own large-batch rate. Timed over the default model's 120
// decoder linears with cold weights (two threads, 2-core AMD EPYC Zen 4, AVX-512 with AVX512_BF16;
// python -m pagedserve.benchmarks.decode_linears), oneDNN against this kernel: bfloat16 17.1 /
// 21.0 / 50.7 ms at 1 / 16 / 64 rows against 10.5 / 15.5 / 45.3; float32 28.3 / 33.0 / 100.4
// against 16.3 / 28.8 / 79.2 (benchmarks/RESULTS.md, "Seventeenth session"). The AVX2 build was
// level with oneDNN at 64 rows (0.98x, a /tmp harness), so the loader
// uses the kernel on AVX-512 builds only (engine/panel_linear.py).
//
// Layout. The weight [N, K] is cut into panels of kPanel output columns; a panel is stored
// k-major, so the kPanel weights that multiply x[r, k] are one contiguous run of kNV vectors:
//   float32:  panels[p][k][j]      = W[p * kPanel + j][k]
//   bfloat16: panels[p][k / 2][j][k % 2]   (pairs of k side by side: what vdpbf16ps multiplies;
//             K must be even, as every model's hidden sizes are)
// Columns past N are zeros.
//
// Microkernel: kMR rows of x times one panel, kMR x kNV vector accumulators in registers for the
// whole K (AVX-512: 12 x 2 of its 32 registers). Each step loads kNV weight vectors once and
// broadcasts one x value (float32) or pair (bfloat16) per row, so every loaded weight serves kMR
// rows and every broadcast kNV vectors. A thread takes a contiguous range of panels; within a
// panel, the rows go in groups of at most kMR (sized evenly: 64 rows are 6 groups of 11 or 10, not
// 5 of 12 and one of 4), the panel staying in L2 between them. While the groups run, the next
// panel is prefetched into L2, a share per group (PrefetchShare), so the weight streams from memory
// behind the arithmetic.
//
// AMX (Sapphire Rapids and later, where Linux grants the tile state): bfloat16 panels are also
// AMX's layout for the right operand of a tile product, so the same panels are multiplied on tiles
// there, 32 rows x one panel per pass (panel_linear_amx). 1.3-1.4x oneDNN's AMX linear at 1-32
// rows, 1.0-1.1x at 64 (engine/panel_linear.py). Like oneDNN's, the tile products read a bfloat16
// denormal as zero.
//
// Sums: float32 products summed in k order (one FMA chain per output), bfloat16 pairs summed by
// vdpbf16ps into float32 and rounded to bfloat16 once, as oneDNN does; only the order of the sums
// differs from oneDNN's or MKL's (float32 rounding; in bfloat16 an output on a rounding boundary
// may round the other way).
#include "aten_ops.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__)
#include "amx_tiles.h"  // permission for the tile state, the tile shape
#endif

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "bfloat16_bits.h"

namespace {

#if defined(__AVX512F__) || !defined(__AVX2__)
constexpr int kLanes = 16;
constexpr int kMR = 12;  // 24 accumulators + 2 weight vectors + 1 broadcast of 32 registers
#else
constexpr int kLanes = 8;
constexpr int kMR = 6;   // 12 accumulators + 2 + 1 of AVX2's 16
#endif
constexpr int kNV = 2;                  // weight vectors per panel row
constexpr int kPanel = kNV * kLanes;    // output columns per panel
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }

// Each k step consumes kPanel * 4 bytes of a panel in either format (float32 values or bfloat16
// pairs): two 64-byte lines on AVX-512, one on AVX2. `next` is the same step in the next panel.
inline void prefetch_step(const char* next, int64_t step) {
  if (next == nullptr) return;
  for (int byte = 0; byte < kPanel * 4; byte += 64) {
    __builtin_prefetch(next + step * kPanel * 4 + byte, 0, 2);
  }
}

// The next panel's share one pass over the current panel prefetches: pass `part` of `parts` (the
// row groups, or AMX's row tiles) requests steps [first, last), one step every `parts` of its own.
// Requesting the whole next panel during the first pass, as this kernel did, left memory idle
// during the others, so a step cost the weight's stream plus most of the arithmetic rather than
// the larger of the two: float32 at 32 / 64 rows ran 1.15-1.16x / 1.11-1.22x oneDNN that way and
// 1.30-1.35x / 1.27-1.29x with the shares, the fixed workload's float32 run 35.9-36.6 ->
// 33.8-35.3 s (2-core Sapphire Rapids, native build; AMX's bfloat16 passes level, 1.21-1.25x
// either way).
struct PrefetchShare {
  const char* next;  // the next panel, or nullptr
  int64_t first, last;
  int parts;
  int countdown = 0;  // steps of the pass until the next request
  PrefetchShare(const char* next_panel, int64_t steps, int part, int num_parts)
      : next(next_panel),
        first(steps * part / num_parts),
        last(steps * (part + 1) / num_parts),
        parts(num_parts) {}
  // Called once per step of the pass.
  inline void on_step() {
    if (next == nullptr || countdown-- > 0) return;
    countdown = parts - 1;
    if (first < last) prefetch_step(next, first++);
  }
};

// out[r, 0:cols] = x[r, :] . panel, for ROWS rows of x.
template <int ROWS>
void panel_rows_f32(const float* x, int64_t ldx, const float* panel, int64_t k, float* out,
                    int64_t ldo, int cols, PrefetchShare ahead) {
  vfloat acc[ROWS][kNV] = {};
  for (int64_t i = 0; i < k; ++i) {
    ahead.on_step();
    vfloat w[kNV];
    for (int v = 0; v < kNV; ++v) w[v] = load(panel + i * kPanel + v * kLanes);
    for (int r = 0; r < ROWS; ++r) {
      const float a = x[r * ldx + i];
      for (int v = 0; v < kNV; ++v) acc[r][v] += a * w[v];
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    float row[kPanel];
    for (int v = 0; v < kNV; ++v) store(row + v * kLanes, acc[r][v]);
    std::memcpy(out + r * ldo, row, cols * sizeof(float));
  }
}

using PanelF32 = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int,
                          PrefetchShare);
template <int... R>
constexpr std::array<PanelF32, sizeof...(R)> f32_table(std::integer_sequence<int, R...>) {
  return {panel_rows_f32<R + 1>...};
}
constexpr auto kPanelF32 = f32_table(std::make_integer_sequence<int, kMR>{});

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PAGEDSERVE_PANEL_BF16 1
// The same for bfloat16: `panel` holds pairs of k, `x` rows of `pairs` pairs.
template <int ROWS>
void panel_rows_bf16(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t pairs,
                     uint16_t* out, int64_t ldo, int cols, PrefetchShare ahead) {
  __m512 acc[ROWS][kNV];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < kNV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    ahead.on_step();
    __m512bh w[kNV];
    for (int v = 0; v < kNV; ++v)
      w[v] = (__m512bh)_mm512_loadu_si512(panel + (i * kPanel + v * kLanes) * 2);
    for (int r = 0; r < ROWS; ++r) {
      uint32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * i, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int v = 0; v < kNV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, w[v]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    float sums[kPanel];
    for (int v = 0; v < kNV; ++v) _mm512_storeu_ps(sums + v * kLanes, acc[r][v]);
    uint16_t row[kPanel];
#pragma omp simd
    for (int j = 0; j < kPanel; ++j) row[j] = pagedserve::float_to_bf16(sums[j]);
    std::memcpy(out + r * ldo, row, cols * sizeof(uint16_t));
  }
}

using PanelBf16 = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, uint16_t*, int64_t,
                           int, PrefetchShare);
template <int... R>
constexpr std::array<PanelBf16, sizeof...(R)> bf16_table(std::integer_sequence<int, R...>) {
  return {panel_rows_bf16<R + 1>...};
}
constexpr auto kPanelBf16 = bf16_table(std::make_integer_sequence<int, kMR>{});
#endif

#if defined(PAGEDSERVE_PANEL_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGEDSERVE_PANEL_AMX 1
// The same bfloat16 panels on AMX tiles. A tile product multiplies 16 rows x 32 k of x by 32 k x 16
// columns of the weight, the right operand as pairs of k: exactly a panel's layout, 16 pairs of one
// half of a panel at a stride of one panel row (kPanel pairs, 128 bytes). So a panel is 2 tile
// columns, and a pass over it takes 32 rows of x as 2 tile rows: 4 tiles of float32 sums, 2 of x,
// 2 of weights (AMX's 8). Every weight tile serves 2 row tiles and every x tile 2 weight tiles;
// rows past 32 take another pass over the panel, from L2.
#define PANEL_SUMS00 0  // rows 0-15 x columns 0-15 of the panel
#define PANEL_SUMS01 1  // rows 0-15 x columns 16-31
#define PANEL_SUMS10 2  // rows 16-31 x columns 0-15
#define PANEL_SUMS11 3  // rows 16-31 x columns 16-31
#define PANEL_X0 4      // rows 0-15, 32 k
#define PANEL_X1 5      // rows 16-31, 32 k
#define PANEL_W0 6      // 32 k of columns 0-15
#define PANEL_W1 7      // 32 k of columns 16-31
constexpr int kTileRows = 16;
constexpr int kTilePairs = 16;  // pairs of k per tile product

// sums[32][kPanel] = (x0 rows; x1 rows) . panel, x0 and x1 16 rows each at `ldx_bytes`; TWO = false
// computes x0's only. `ahead`: this pass's share of the next panel, prefetched into L2 on the way.
// The weights are streaming tile loads (a hint that they are used once), which measured ~5% faster
// than plain ones at 2-64 rows.
template <bool TWO>
void panel_tiles(const uint16_t* x0, const uint16_t* x1, int64_t ldx_bytes, const uint16_t* panel,
                 int64_t pairs, float (*sums)[kPanel], PrefetchShare ahead) {
  _tile_zero(PANEL_SUMS00);
  _tile_zero(PANEL_SUMS01);
  if (TWO) {
    _tile_zero(PANEL_SUMS10);
    _tile_zero(PANEL_SUMS11);
  }
  constexpr int64_t kRowBytes = kPanel * 4;  // one pair of k for every column of the panel
  for (int64_t i = 0; i < pairs; i += kTilePairs) {
    for (int step = 0; step < kTilePairs; ++step) ahead.on_step();  // a step: one pair of k
    const uint16_t* w = panel + i * kPanel * 2;
    _tile_stream_loadd(PANEL_W0, w, kRowBytes);
    _tile_stream_loadd(PANEL_W1, w + kLanes * 2, kRowBytes);
    _tile_loadd(PANEL_X0, x0 + 2 * i, ldx_bytes);
    _tile_dpbf16ps(PANEL_SUMS00, PANEL_X0, PANEL_W0);
    _tile_dpbf16ps(PANEL_SUMS01, PANEL_X0, PANEL_W1);
    if (TWO) {
      _tile_loadd(PANEL_X1, x1 + 2 * i, ldx_bytes);
      _tile_dpbf16ps(PANEL_SUMS10, PANEL_X1, PANEL_W0);
      _tile_dpbf16ps(PANEL_SUMS11, PANEL_X1, PANEL_W1);
    }
  }
  constexpr int64_t kSumsBytes = kPanel * sizeof(float);
  _tile_stored(PANEL_SUMS00, &sums[0][0], kSumsBytes);
  _tile_stored(PANEL_SUMS01, &sums[0][kLanes], kSumsBytes);
  if (TWO) {
    _tile_stored(PANEL_SUMS10, &sums[kTileRows][0], kSumsBytes);
    _tile_stored(PANEL_SUMS11, &sums[kTileRows][kLanes], kSumsBytes);
  }
}
#undef PANEL_SUMS00
#undef PANEL_SUMS01
#undef PANEL_SUMS10
#undef PANEL_SUMS11
#undef PANEL_X0
#undef PANEL_X1
#undef PANEL_W0
#undef PANEL_W1

// out[m, n] = x . panels for bfloat16 x of `pairs` pairs (a multiple of kTilePairs). Rows go in
// tiles of 16, two per pass over a panel; a last, partial tile is read from a zero-padded copy of
// those rows. As in for_each_panel, a thread takes a contiguous range of panels and prefetches the
// next one into L2 over its passes over the current one (PrefetchShare).
void panel_linear_amx(const uint16_t* x, int64_t m, int64_t pairs, const uint16_t* weights,
                      int64_t n, int64_t num_panels, uint16_t* out) {
  const int64_t k = 2 * pairs, ldx_bytes = k * sizeof(uint16_t);
  const int64_t panel_elems = pairs * kPanel * 2;
  const int64_t full_rows = m / kTileRows * kTileRows;
  std::vector<uint16_t> tail(m > full_rows ? kTileRows * k : 0, 0);
  if (!tail.empty()) std::memcpy(tail.data(), x + full_rows * k, (m - full_rows) * ldx_bytes);
  auto row_tile = [&](int64_t r) { return r < full_rows ? x + r * k : tail.data(); };
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    const amx::TileConfig config;
    _tile_loadconfig(&config);
    alignas(64) float sums[2 * kTileRows][kPanel];
    for (int64_t p = begin; p < end; ++p) {
      const uint16_t* panel = weights + p * panel_elems;
      const char* next = p + 1 < end ? reinterpret_cast<const char*>(panel + panel_elems) : nullptr;
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - p * kPanel));
      const __mmask32 columns = cols == kPanel ? ~__mmask32{0} : (__mmask32{1} << cols) - 1;
      const int passes = static_cast<int>((m + 2 * kTileRows - 1) / (2 * kTileRows));
      for (int64_t r = 0; r < m; r += 2 * kTileRows) {
        const int64_t rows = std::min<int64_t>(2 * kTileRows, m - r);
        const PrefetchShare ahead(next, pairs, static_cast<int>(r / (2 * kTileRows)), passes);
        if (rows > kTileRows) {
          panel_tiles<true>(row_tile(r), row_tile(r + kTileRows), ldx_bytes, panel, pairs, sums,
                            ahead);
        } else {
          panel_tiles<false>(row_tile(r), nullptr, ldx_bytes, panel, pairs, sums, ahead);
        }
        // Rounded to bfloat16 (to nearest even) by the AVX512_BF16 conversion, 32 sums at a time;
        // like the tile products, it reads a float32 denormal as zero.
        for (int64_t i = 0; i < rows; ++i) {
          const __m512bh row =
              _mm512_cvtne2ps_pbh(_mm512_load_ps(&sums[i][kLanes]), _mm512_load_ps(&sums[i][0]));
          _mm512_mask_storeu_epi16(out + (r + i) * n + p * kPanel, columns, (__m512i)row);
        }
      }
    }
    _tile_release();
  });
}
#endif  // AMX

// Every panel of `out` for `m` rows: threads split the panels, rows go in even groups of at most
// kMR. `rows_fn(rows, x_row, panel, cols, group, groups, prefetch_next)` runs group `group` of
// `groups` over one panel; prefetch_next: the thread's next panel follows (PrefetchShare).
template <typename RowsFn>
void for_each_panel(int64_t m, int64_t n, int64_t num_panels, RowsFn rows_fn) {
  const int64_t groups = (m + kMR - 1) / kMR;
  const int64_t group_rows = (m + groups - 1) / groups;
  const int num_groups = static_cast<int>((m + group_rows - 1) / group_rows);
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - p * kPanel));
      const bool prefetch_next = p + 1 < end;
      for (int64_t r = 0, group = 0; r < m; r += group_rows, ++group) {
        const int rows = static_cast<int>(std::min(group_rows, m - r));
        rows_fn(rows, r, p, cols, static_cast<int>(group), num_groups, prefetch_next);
      }
    }
  });
}

}  // namespace

int panel_width() { return kPanel; }

bool panel_bf16() {
#ifdef PAGEDSERVE_PANEL_BF16
  return true;
#else
  return false;
#endif
}

bool panel_amx() {
#ifdef PAGEDSERVE_PANEL_AMX
  return amx::tiles_permitted();
#else
  return false;
#endif
}

at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be [out_features, in_features]");
  TORCH_CHECK(weight.device().is_cpu(), "pack_panels is CPU-only");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || (dtype == at::kBFloat16 && panel_bf16()),
              "pack_panels takes float32 weights, or bfloat16 ones on a build with AVX512_BF16");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t num_panels = (n + kPanel - 1) / kPanel;
  const auto w = weight.contiguous();
  if (dtype == at::kFloat) {
    auto panels = at::empty({num_panels, k, kPanel}, w.options());
    std::memset(panels.data_ptr(), 0, panels.nbytes());
    const float* src = w.data_ptr<float>();
    float* dst = panels.data_ptr<float>();
    at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p)
        for (int64_t j = 0; j < std::min<int64_t>(kPanel, n - p * kPanel); ++j)
          for (int64_t i = 0; i < k; ++i) {
            dst[(p * k + i) * kPanel + j] = src[(p * kPanel + j) * k + i];
          }
    });
    return panels;
  }
  TORCH_CHECK(k % 2 == 0, "bfloat16 panels take an even in_features (pairs of k)");
  const int64_t pairs = k / 2;
  auto panels = at::empty({num_panels, pairs, kPanel, 2}, w.options());
  std::memset(panels.data_ptr(), 0, panels.nbytes());
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(panels.data_ptr());
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < std::min<int64_t>(kPanel, n - p * kPanel); ++j)
        for (int64_t i = 0; i < k; ++i)
          dst[((p * pairs + i / 2) * kPanel + j) * 2 + i % 2] = src[(p * kPanel + j) * k + i];
  });
  return panels;
}

at::Tensor panel_linear(const at::Tensor& input, const at::Tensor& panels, int64_t out_features) {
  RECORD_FUNCTION("pagedserve::panel_linear", std::vector<c10::IValue>());
  const auto dtype = input.scalar_type();
  TORCH_CHECK(input.device().is_cpu() && panels.device().is_cpu(), "panel_linear is CPU-only");
  TORCH_CHECK(panels.scalar_type() == dtype, "input and panels must have the same dtype");
  TORCH_CHECK(dtype == at::kFloat || (dtype == at::kBFloat16 && panel_bf16()),
              "panel_linear takes float32 rows, or bfloat16 ones on a build with AVX512_BF16");
  const bool bf16 = dtype == at::kBFloat16;
  TORCH_CHECK(panels.dim() == (bf16 ? 4 : 3) && panels.size(2) == kPanel &&
                  (!bf16 || panels.size(3) == 2) && panels.is_contiguous(),
              "panels must come from this build's pack_panels");
  const int64_t n = out_features, num_panels = panels.size(0);
  TORCH_CHECK(n > (num_panels - 1) * kPanel && n <= num_panels * kPanel,
              "out_features does not match the panels");
  const int64_t k = input.size(-1);
  TORCH_CHECK(panels.size(1) * (bf16 ? 2 : 1) == k,
              "input's last dimension must be the weight's in_features");
  auto x = input.reshape({-1, k}).contiguous();
  const int64_t m = x.size(0);
  auto output_shape = input.sizes().vec();
  output_shape.back() = n;
  auto output = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return output.view(output_shape);
  if (!bf16) {
    const float* src = x.data_ptr<float>();
    const float* weights = panels.data_ptr<float>();
    float* dst = output.data_ptr<float>();
    for_each_panel(m, n, num_panels, [&](int rows, int64_t r, int64_t p, int cols, int group,
                                         int groups, bool ahead) {
      const float* panel = weights + p * k * kPanel;
      const char* next = ahead ? reinterpret_cast<const char*>(panel + k * kPanel) : nullptr;
      kPanelF32[rows - 1](src + r * k, k, panel, k, dst + r * n + p * kPanel, n, cols,
                          PrefetchShare(next, k, group, groups));
    });
    return output.view(output_shape);
  }
#ifdef PAGEDSERVE_PANEL_BF16
  const int64_t pairs = panels.size(1);
  const int64_t ldx = x.size(1);
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* weights = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(output.data_ptr());
#ifdef PAGEDSERVE_PANEL_AMX
  if (pairs % kTilePairs == 0 && amx::tiles_permitted()) {
    panel_linear_amx(src, m, pairs, weights, n, num_panels, dst);
    return output.view(output_shape);
  }
#endif
  for_each_panel(m, n, num_panels, [&](int rows, int64_t r, int64_t p, int cols, int group,
                                       int groups, bool ahead) {
    const uint16_t* panel = weights + p * pairs * kPanel * 2;
    const char* next = ahead ? reinterpret_cast<const char*>(panel + pairs * kPanel * 2) : nullptr;
    kPanelBf16[rows - 1](src + r * ldx, ldx, panel, pairs, dst + r * n + p * kPanel, n, cols,
                         PrefetchShare(next, pairs, group, groups));
  });
#endif
  return output.view(output_shape);
}
