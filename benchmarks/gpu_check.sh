#!/usr/bin/env bash
# The GPU checks of the paged attention kernels, as one run on a lent CUDA machine:
#   1. every kernel test natively on CUDA (CI can only interpret the Triton kernels on the CPU);
#   2. decode attention at 256 requests x 4,096 tokens of context on the default model's shapes:
#      the Triton paged kernel vs the gather reference vs torch SDPA on pre-made contiguous K/V
#      (torch's FlashAttention kernel on CUDA), with the memory and L2 roofline rows, for
#      bfloat16 and float16 caches and an fp8 cache under bfloat16 queries.
#
# The device image has torch and triton but not pydantic, which the test suite's conftest needs:
#   here, once per checkout:   make gpu-wheels            (downloads them into .whl/, git-ignored)
#   then:                      device run: command "bash benchmarks/gpu_check.sh", carry [".whl"]
# Results land in $OUT (the device tool brings them back) or /tmp/gpu_check. FlashInfer's wheel
# (~100 MB) exceeds what a device run can carry, and flash-attn has no wheel for the device's
# torch, so torch's own FlashAttention (SDPA) is the comparison.
set -uo pipefail
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
# The suite interprets Triton only where no GPU is visible; say explicitly that this run is native.
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$out/gpu.txt"

timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" -ra tests/kernels \
  2>&1 | tee "$out/kernel_tests.txt"
tests_status=${PIPESTATUS[0]}

timeout 240 python3 -m pagedserve.benchmarks.attention --device cuda --batch 256 --context 4096 \
  --dtype bfloat16 float16 --kv-cache-dtype auto fp8_e4m3 --repeats 20 \
  --output "$out/attention_cuda.json" 2>&1 | tee "$out/attention_cuda.txt"
bench_status=${PIPESTATUS[0]}

echo "kernel tests exit ${tests_status}, benchmark exit ${bench_status}" | tee -a "$out/gpu.txt"
exit $(( tests_status || bench_status ))
