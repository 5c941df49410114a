#!/usr/bin/env bash
# One lease on the H200 (device tool), in two back-to-back calls because the vLLM bundle travels in two parts:
#   stage "tests": carry .gpu-bundle/core -> unpack vLLM 0.26 into /tmp/vs, install dcp-triton, run `pytest -m gpu`
#   stage "bench": carry .gpu-bundle/extra -> vLLM's deps, then the kernel and DCP benchmarks (vLLM peers included)
# Logs and JSON/PNG land in $OUT; copy them into benchmarks/results/ afterwards.
set -uo pipefail
stage=${1:?usage: run_h200.sh tests|bench [benchmark args...]}
shift
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
install_dcp() {
  test -d /tmp/dcp/dcp_plugin && return 0
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/dcp . >"$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; return 1; }
}
export PYTHONPATH=/tmp/dcp${PYTHONPATH:+:$PYTHONPATH}
case "$stage" in
  tests)
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
    if test -f .gpu-bundle/core/vllm026.tar.xz; then mkdir -p /tmp/vs && tar xJf .gpu-bundle/core/vllm026.tar.xz -C /tmp/vs; fi
    install_dcp || exit 1
    repo=$PWD
    cd /tmp && PYTHONPATH=/tmp/dcp:$repo python3 -m pytest -q -m gpu -p no:cacheprovider "$repo/tests/gpu" "$@" 2>&1 \
      | tee "$OUT/gpu_tests.log"
    ;;
  bench)
    install_dcp || exit 1
    if test -f .gpu-bundle/extra/setup.sh && test -d /tmp/vs/vllm; then source .gpu-bundle/extra/setup.sh; fi
    export PYTHONPATH=/tmp/dcp:$PYTHONPATH
    for script in "$@"; do
      python3 benchmarks/$script 2>&1 | tee -a "$OUT/bench.log"
    done
    cp benchmarks/results/*.json benchmarks/results/*.png "$OUT"/ 2>/dev/null
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
