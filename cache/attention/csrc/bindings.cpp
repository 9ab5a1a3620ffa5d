// The Python module: every kernel of the extension, bound with pybind11.
//
// The only file that sees pybind11, through torch's own binding header (its casters turn Python
// tensors into at::Tensor); the kernels include ATen's headers only (aten_ops.h). Each file is
// parsed on its own, and <torch/extension.h> (pybind11 plus autograd and all of torch::nn) was
// most of each one's compile time: a first build per ISA took 131 s on two cores (219 s of CPU),
// now 35 s (58 s), on a 2-core Zen 4. A clean checkout (CI, a container build) pays it for each
// ISA it builds.
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;

#include <cstdint>

// paged_attention.cpp
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                           double scale, int64_t sliding_window, double softcap,
                           const c10::optional<at::Tensor>& sinks);
int vector_lanes();
bool bf16_dot_products();
bool fp8_as_bf16();
bool amx_tiles();
bool float_prefetch_by_head();
bool prefetch_into_l1();
bool prefetch_blocks_interleaved();
// rms_norm.cpp, silu_mul.cpp, rope.cpp, skinny_linear.cpp, panel_linear.cpp, store_kv.cpp and
// greedy.cpp
at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
void rope_(const at::Tensor& states, const at::Tensor& cos, const at::Tensor& sin,
           int64_t num_heads, int64_t head_dim);
at::Tensor skinny_linear_fp32(const at::Tensor& input, const at::Tensor& weight);
int panel_width();
bool panel_bf16();
bool panel_amx();
at::Tensor pack_panels(const at::Tensor& weight);
at::Tensor panel_linear(const at::Tensor& input, const at::Tensor& panels, int64_t out_features);
void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
              at::Tensor& value_cache, const at::Tensor& slot_mapping);
at::Tensor argmax_rows(const at::Tensor& logits);

// Every entry point releases the GIL while it runs (arguments are converted before, the result
// after): a long prefill's attention would otherwise hold the server's event loop, and /health,
// for as long as it computes. torch's own operators release it the same way.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.attr("vector_lanes") = vector_lanes();  // what the build targets: 16 (AVX-512) or 8 (AVX2)
  m.attr("bf16_dot_products") = bf16_dot_products();  // AVX512_BF16 scores and prefill tiles
  m.attr("fp8_as_bf16") = fp8_as_bf16();  // fp8 rows read as bfloat16 rows (AVX512_VBMI)
  m.attr("amx_tiles") = amx_tiles();  // bfloat16 prefill items on AMX tiles
  // float32 decode tiles prefetched kv head by kv head (AMD), else key by key
  m.attr("float_prefetch_by_head") = float_prefetch_by_head();
  // decode tiles prefetched into L1 (AMD Zen 5 and later), else into L2
  m.attr("prefetch_into_l1") = prefetch_into_l1();
  // the next tile's keys requested a block apart (Zen 5 and later), else by position
  m.attr("prefetch_blocks_interleaved") = prefetch_blocks_interleaved();
  m.def("paged_attention", &paged_attention, py::arg("query"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("block_tables"), py::arg("query_start_loc"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("sliding_window") = 0,
        py::arg("softcap") = 0.0, py::arg("sinks") = py::none(), no_gil,
        "Paged attention over a mixed batch (float32 or bfloat16 query, strided, any supported "
        "cache dtype); returns [num_tokens, num_heads, head_dim] in the query's dtype");
  m.def("rms_norm", &rms_norm, py::arg("input"), py::arg("weight"), py::arg("eps"), no_gil,
        "Hugging Face's LlamaRMSNorm of float32 or bfloat16 rows in one pass (rms_norm.cpp)");
  m.def("silu_mul", &silu_mul, py::arg("gate_up"), no_gil,
        "SiLU(gate) * up of float32 or bfloat16 [..., 2 * I] rows, as LlamaMLP rounds it "
        "(silu_mul.cpp)");
  m.def("rope_", &rope_, py::arg("states"), py::arg("cos"), py::arg("sin"),
        py::arg("num_heads"), py::arg("head_dim"), no_gil,
        "Hugging Face's apply_rotary_pos_emb, in place, on the first num_heads heads of each "
        "float32 or bfloat16 row (rope.cpp)");
  m.def("skinny_linear_fp32", &skinny_linear_fp32, py::arg("input"), py::arg("weight"), no_gil,
        "float32 input @ weight.T for at most 16 rows, weights streamed once (skinny_linear.cpp)");
  m.attr("panel_width") = panel_width();  // output columns per panel of pack_panels
  m.attr("panel_bf16") = panel_bf16();    // bfloat16 panels (AVX512_BF16 builds)
  m.attr("panel_amx") = panel_amx();      // bfloat16 panels of 2+ rows on AMX tiles
  m.def("pack_panels", &pack_panels, py::arg("weight"), no_gil,
        "A float32 (or, with AVX512_BF16, bfloat16) [N, K] weight as panel_linear's column "
        "panels (panel_linear.cpp)");
  m.def("panel_linear", &panel_linear, py::arg("input"), py::arg("panels"),
        py::arg("out_features"), no_gil,
        "input @ weight.T from pack_panels(weight), for decode-sized batches (panel_linear.cpp)");
  m.def("store_kv", &store_kv, py::arg("key"), py::arg("value"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("slot_mapping"), no_gil,
        "Write each token's K/V rows (strided [tokens, kv_heads, head_dim], the cache's dtype) "
        "into flat slot slot_mapping[i] of the caches, in place (store_kv.cpp)");
  m.def("argmax_rows", &argmax_rows, py::arg("logits"), no_gil,
        "Each row's first index of its maximum (its first NaN if it has one), as torch's "
        "max(dim=-1).indices, for contiguous float32 or bfloat16 [rows, vocab] (greedy.cpp)");
}
