#!/usr/bin/env bash
# The GPU checks of the paged attention kernels, as one run on a lent CUDA machine:
#   1. every kernel test natively on CUDA (CI can only interpret the Triton kernels on the CPU),
#      then the engine on CUDA: tiny random models' greedy tokens against HF `generate`;
#   2. decode attention at 256 requests x 4,096 tokens of context on the default model's shapes:
#      the Triton paged kernel vs the gather reference vs torch SDPA on pre-made contiguous K/V
#      (torch's FlashAttention kernel on CUDA), with the memory and L2 roofline rows, for
#      bfloat16 and float16 caches and an fp8 cache under bfloat16 queries.
#
# The device image has torch and triton but not pydantic or xgrammar, which the tests import:
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
# The checkout is the package `pagedserve` (pyproject maps it onto the repository root), but nothing
# is installed there: a link named pagedserve makes it importable under its one name, whatever the
# checkout's folder is called; "." keeps the tests package importable too.
mkdir -p /tmp/gpu_check_src && ln -sfn "$PWD" /tmp/gpu_check_src/pagedserve
# The suite interprets Triton only where no GPU is visible; say explicitly that this run is native.
export PYTHONPATH="/tmp/gpu_check_src:.:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export PAGEDSERVE_CACHE=${PAGEDSERVE_CACHE:-/tmp/gpu_check_cache}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  grep -m1 "model name" /proc/cpuinfo
  echo "cpu: $(grep -m1 -o -w -E 'avx2|avx512f|avx512_bf16|avx512_fp16|amx_tile' /proc/cpuinfo \
    | sort -u | tr '\n' ' ')"
  gcc --version | head -n 1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$out/gpu.txt"

# One process per test file: a crash in one (a CPU kernel fault on the machine's own CPU) must not
# hide the others' results, the native Triton ones above all.
tests_status=0
for file in tests/kernels/test_*.py; do
  echo "== $file" >> "$out/kernel_tests.txt"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" -ra "$file" \
    2>&1 | tee -a "$out/kernel_tests.txt" | tail -n 3
  status=${PIPESTATUS[0]}
  echo "$file exit $status" | tee -a "$out/gpu.txt"
  (( status == 0 )) || tests_status=$status
done

timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" -ra tests/engine/test_cuda_engine.py \
  2>&1 | tee "$out/engine_tests.txt"
engine_status=${PIPESTATUS[0]}

timeout 180 python3 -m pagedserve.benchmarks.attention --device cuda --batch 256 --context 4096 \
  --dtype bfloat16 float16 --kv-cache-dtype auto fp8_e4m3 --repeats 20 \
  --output "$out/attention_cuda.json" 2>&1 | tee "$out/attention_cuda.txt"
bench_status=${PIPESTATUS[0]}

echo "kernel tests exit ${tests_status}, engine tests exit ${engine_status}," \
  "benchmark exit ${bench_status}" | tee -a "$out/gpu.txt"
exit $(( tests_status || engine_status || bench_status ))
