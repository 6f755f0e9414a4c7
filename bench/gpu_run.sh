#!/bin/bash
# Device-side driver for the GPU tests and benchmark (run on a CUDA machine with Python 3.12 and torch; no
# registry needed there). Wheels it lacks travel in the git-ignored .whl/ (bench/fetch-gpu-wheels.sh fills it).
#   bash bench/gpu_run.sh tests bench        # CUDA IPC + VRAM conformance tests, then `kvlifecycle bench gpu`
#   bash bench/gpu_run.sh driver             # bench/driver_costs.py: one post's driver calls, and alternatives
#   bash bench/gpu_run.sh layerwise          # kvlifecycle bench gpu-layerwise: streaming vs post-prefill, T_visible
#   bash bench/gpu_run.sh sglang-paths       # bench/sglang_gpu_paths.py: SGLang's layout, NIXL alone vs the split path
#   bash bench/gpu_run.sh ablation           # bench/digest_ablation.py: the 16-block fused copy + digest in stages
# Env: BENCH_ARGS (e.g. "--json --reps 30"), LAYERWISE_ARGS, TESTS (replaces the two CUDA IPC test files), TEST_TIMEOUT,
#      BENCH_TIMEOUT, LAYERWISE_TIMEOUT, OUT (where logs go; default /tmp/out).
R=$(pwd)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
# assemble the package as pyproject's package-dir mapping does (transports/ and adapters/ live under kvlifecycle)
rm -rf /tmp/kvl && mkdir -p /tmp/kvl && cp -r kvlifecycle /tmp/kvl/ && cp -r transports /tmp/kvl/kvlifecycle/transports \
  && cp -r adapters /tmp/kvl/kvlifecycle/adapters || exit 8
export PYTHONPATH=/tmp/kvl:/tmp/site
cd /tmp  # outside the checkout, whose kvlifecycle/ (without transports/) would shadow the assembled package
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, nixl._api, zmq, msgspec; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
for step in "$@"; do
  case $step in
    tests) timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -c "$R/pyproject.toml" -p no:cacheprovider -q -rs --timeout 120 \
             ${TESTS:-"$R/tests/transports/test_cuda_ipc.py" "$R/tests/transports/test_native_post.py"} ${EXTRA_TESTS} 2>&1 | tee "$OUT/pytest.log" | tail -40 ;;
    bench) timeout "${BENCH_TIMEOUT:-240}" python3 -m kvlifecycle bench gpu ${BENCH_ARGS} --out "$OUT/bench.json" 2>&1 \
             | tee "$OUT/bench.txt" ;;
    layerwise) timeout "${LAYERWISE_TIMEOUT:-240}" python3 -m kvlifecycle bench gpu-layerwise ${LAYERWISE_ARGS} \
             --out "$OUT/layerwise.json" 2>&1 | tee "$OUT/layerwise.txt" ;;
    sglang-paths) timeout "${PATHS_TIMEOUT:-180}" python3 "$R/bench/sglang_gpu_paths.py" ${PATHS_ARGS} 2>&1 \
             | tee "$OUT/sglang_paths.txt" ;;
    ablation) timeout "${ABLATION_TIMEOUT:-150}" python3 "$R/bench/digest_ablation.py" 2>&1 | tee "$OUT/ablation.txt" ;;
    driver) timeout "${DRIVER_TIMEOUT:-180}" python3 "$R/bench/driver_costs.py" ${DRIVER_ARGS} 2>&1 | tee "$OUT/driver.txt" ;;
    *) echo "unknown step $step" ;;
  esac
done
