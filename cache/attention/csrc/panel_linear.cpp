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
// 5 of 12 and one of 4), the panel staying in L2 between them. While the first group runs, the
// next panel is prefetched into L2, so the weight streams from memory behind the arithmetic.
//
// Sums: float32 products summed in k order (one FMA chain per output), bfloat16 pairs summed by
// vdpbf16ps into float32 and rounded to bfloat16 once, as oneDNN does; only the order of the sums
// differs from oneDNN's or MKL's (float32 rounding; in bfloat16 an output on a rounding boundary
// may round the other way).
#include "aten_ops.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

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

// out[r, 0:cols] = x[r, :] . panel, for ROWS rows of x.
template <int ROWS>
void panel_rows_f32(const float* x, int64_t ldx, const float* panel, int64_t k, float* out,
                    int64_t ldo, int cols, const char* next) {
  vfloat acc[ROWS][kNV] = {};
  for (int64_t i = 0; i < k; ++i) {
    prefetch_step(next, i);
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
                          const char*);
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
                     uint16_t* out, int64_t ldo, int cols, const char* next) {
  __m512 acc[ROWS][kNV];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < kNV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    prefetch_step(next, i);
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
                           int, const char*);
template <int... R>
constexpr std::array<PanelBf16, sizeof...(R)> bf16_table(std::integer_sequence<int, R...>) {
  return {panel_rows_bf16<R + 1>...};
}
constexpr auto kPanelBf16 = bf16_table(std::make_integer_sequence<int, kMR>{});
#endif

// Every panel of `out` for `m` rows: threads split the panels, rows go in even groups of at most
// kMR. `rows_fn(rows, x_row, panel, out_row, cols, next)` runs one group over one panel.
template <typename RowsFn>
void for_each_panel(int64_t m, int64_t n, int64_t num_panels, RowsFn rows_fn) {
  const int64_t groups = (m + kMR - 1) / kMR;
  const int64_t group_rows = (m + groups - 1) / groups;
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - p * kPanel));
      const bool prefetch_next = p + 1 < end;
      for (int64_t r = 0; r < m; r += group_rows) {
        const int rows = static_cast<int>(std::min(group_rows, m - r));
        rows_fn(rows, r, p, cols, prefetch_next && r == 0);
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
    for_each_panel(m, n, num_panels, [&](int rows, int64_t r, int64_t p, int cols, bool ahead) {
      const float* panel = weights + p * k * kPanel;
      const char* next = ahead ? reinterpret_cast<const char*>(panel + k * kPanel) : nullptr;
      kPanelF32[rows - 1](src + r * k, k, panel, k, dst + r * n + p * kPanel, n, cols, next);
    });
    return output.view(output_shape);
  }
#ifdef PAGEDSERVE_PANEL_BF16
  const int64_t pairs = panels.size(1);
  const int64_t ldx = x.size(1);
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* weights = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(output.data_ptr());
  for_each_panel(m, n, num_panels, [&](int rows, int64_t r, int64_t p, int cols, bool ahead) {
    const uint16_t* panel = weights + p * pairs * kPanel * 2;
    const char* next = ahead ? reinterpret_cast<const char*>(panel + pairs * kPanel * 2) : nullptr;
    kPanelBf16[rows - 1](src + r * ldx, ldx, panel, pairs, dst + r * n + p * kPanel, n, cols, next);
  });
#endif
  return output.view(output_shape);
}
