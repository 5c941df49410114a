#!/usr/bin/env bash
# One lease on a machine with two H200s (device kind nvidia-h200-x2), in back-to-back calls (files in /tmp survive
# while the machine stays warm); each call's output lands in $OUT (at most 8 files come back: logs are packed into
# one tarball). vLLM 0.26's core archive travels in two parts (split_bundle026.sh; _device.sh says why):
#   unpack: carry .gpu-bundle/core-part. Its part stays in /tmp (an unsplit .gpu-bundle/core, where it fits beside
#          the tree, is unpacked into /tmp/vs instead). Only needed before an e2e or spec call.
#   check: carry .gpu-bundle/core-rest after an unpack call (or nothing: the checks need no vLLM). Join the part an
#          unpack call left in /tmp with it, check the whole archive's sha256 and unpack vLLM 0.26 into /tmp/vs
#          (for later calls, in the background), install dcp-triton into /tmp/dcp, then, each under its own time
#          limit: the GPU tests (tests/gpu, most telling first), the two-GPU NCCL check and timing
#          (multi_gpu_dcp.py: every case vs float64, decode replayed from a captured graph), and the host-overhead
#          benchmark.
#   e2e:   carry .gpu-bundle/extra (and .gpu-bundle/core-rest unless a check call joined it). vLLM's dependencies,
#          then benchmarks/vllm_e2e/vllm_dcp_e2e.py with the arguments given (resumable: a later call continues where
#          the last stopped while the machine is warm).
#   spec:  like e2e (after it, on the same warm machine), for benchmarks/vllm_e2e/vllm_spec_dcp.py: speculative
#          decoding.
#   moe:   carry .gpu-bundle/moe (scripts/device/make_moe_ext.sh: vLLM's MoE extension) -> kept in /tmp for a hybrid
#          call, which unpacks it beside vLLM.
#   hybrid: like e2e, for benchmarks/vllm_e2e/vllm_hybrid_gpu.py --tp 2 (a hybrid GDN model at DCP = 2; a moe call
#          first).
#   e.g.  bash scripts/device/run_2xh200.sh unpack       carry .gpu-bundle/core-part, then
#         bash scripts/device/run_2xh200.sh check        carry .gpu-bundle/core-rest, then
#         bash scripts/device/run_2xh200.sh e2e --budget-s 540    carry .gpu-bundle/extra
# Everything runs from /tmp: in the repository root, its dcp_plugin/ folder (the checkout's code) would come before the
# installed package in child processes. The benchmarks run
# as modules (python3 -m / torchrun -m), the repository root last on PYTHONPATH (run_h200.sh says how).
set -uo pipefail
stage=${1:?usage: run_2xh200.sh unpack|check|e2e|spec|moe|hybrid [arguments...]}
shift
source "$(dirname "$0")/_device.sh"
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT" /tmp/logs
limit() {  # limit SECONDS NAME COMMAND...: run with a time limit, log to /tmp/logs/NAME.log, print its tail
  local seconds=$1 name=$2
  shift 2
  echo "=== $name (limit ${seconds}s) $(date +%T)"
  timeout "$seconds" "$@" >"/tmp/logs/$name.log" 2>&1
  echo "=== $name exit $? $(date +%T)"
  tail -n 25 "/tmp/logs/$name.log"
}
case "$stage" in
  unpack)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    unpack_core
    core_status || exit 1
    ;;
  check)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    { unpack_core && join_core; } &
    install_dcp /tmp/logs/install.log || exit 1
    export PYTHONPATH=/tmp/dcp:$repo
    cd /tmp
    tests=(tests/gpu/test_launch_gpu.py tests/gpu/test_warmup_gpu.py tests/gpu/test_kernel_prefix_attention_gpu.py
           tests/gpu/test_kernel_chunk_attention_merge_gpu.py tests/gpu/test_decode_graph_gpu.py
           tests/gpu/test_jit_variants_gpu.py tests/gpu/test_gpu_tier.py)
    limit "${GPU_TESTS_S:-260}" gpu_tests "${PYTEST[@]}" -q -m gpu -x "${tests[@]/#/$repo/}"
    limit "${MULTI_GPU_S:-170}" multi_gpu torchrun --standalone --nproc-per-node 2 \
      -m "$(module_of benchmarks/dcp/multi_gpu_dcp.py)" --quick --results-dir "$OUT"
    limit "${HOST_S:-100}" host_overhead python3 -m "$(module_of benchmarks/dcp/bench_host_overhead.py)" --quick \
      --out "$OUT/host_overhead_h200.json"
    wait
    ;;
  moe)
    cp "$repo/.gpu-bundle/moe/moe.tar.gz" /tmp/ || exit 1
    echo "vLLM's MoE extension kept in /tmp: a hybrid call unpacks it"
    ;;
  e2e|spec|hybrid)
    install_dcp /tmp/logs/install.log || exit 1
    join_core || exit 1
    vllm_unpacked || { echo "vLLM is not unpacked in /tmp/vs: first an unpack call carrying" \
      ".gpu-bundle/core-part, then carry .gpu-bundle/core-rest with this one (or a check call)" >&2; exit 1; }
    if test -f /tmp/moe.tar.gz; then tar xzf /tmp/moe.tar.gz -C /tmp/vs || exit 1; fi
    source "$repo/.gpu-bundle/extra/setup.sh"
    export PYTHONPATH=/tmp/dcp:$PYTHONPATH
    PYTHONPATH=$(repo_last)  # the benchmarks from the repository, dcp_plugin from /tmp/dcp
    cd /tmp
    case "$stage" in
      e2e) script=(vllm_dcp_e2e.py) ;;
      spec) script=(vllm_spec_dcp.py) ;;
      hybrid) script=(vllm_hybrid_gpu.py --tp 2) ;;
    esac
    python3 -m "$(module_of "benchmarks/vllm_e2e/${script[0]}")" "${script[@]:1}" --mirror "$OUT" "$@" 2>&1 \
      | tee "/tmp/logs/$stage.log" | tail -n 60
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
tar czf "$OUT/logs_$stage.tar.gz" -C /tmp logs
