// What the kernels take from ATen: tensors, TORCH_CHECK, parallel_for and the two allocators.
//
// Not <torch/extension.h>, which brings pybind11, autograd and all of torch::nn into every file
// that includes it: only bindings.cpp needs pybind11 (build times there).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
