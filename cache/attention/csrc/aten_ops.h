// What the kernels take from ATen: tensors, TORCH_CHECK, parallel_for, the two allocators, and
// RECORD_FUNCTION, which names each entry point in torch.profiler traces (engine/profiling.py):
// a thread-local check when no profiler runs, as every ATen operator pays.
//
// Not <torch/extension.h>, which brings pybind11, autograd and all of torch::nn into every file
// that includes it: only bindings.cpp needs pybind11 (build times there).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
