#!/usr/bin/env bash
# One lease on the H200 (device tool), in back-to-back calls (files in /tmp survive while the machine stays warm).
# vLLM 0.26's core archive travels in two parts (split_bundle026.sh; _device.sh says why):
#   stage "unpack": carry .gpu-bundle/core-part -> its part stays in /tmp for the bench call (an unsplit
#                  .gpu-bundle/core, where it fits beside the tree, is unpacked into /tmp/vs instead: ~40 s)
#   stage "tests":  carry what "unpack" would (optional) -> the same, then install dcp-triton and run `pytest -m gpu`
#                  (extra arguments: test files relative to the repo, or pytest options); the GPU tests that need
#                  vLLM skip unless it was unpacked. The whole tier (no files given) no longer fits one call in one
#                  process (216 of 332 tests in 575 s at 44f170a, most of it compiling): its correctness files run
#                  on TEST_WORKERS pytest-xdist processes (default 4) sharing the GPU, then SERIAL_TESTS (the files
#                  that watch compiles, launches or the allocator's peak) in one process
#   stage "bench":  carry .gpu-bundle/extra and .gpu-bundle/core-rest -> join the part an unpack call left in /tmp,
#                  check the whole archive's sha256 and unpack vLLM into /tmp/vs, vLLM's deps (a later bench call of
#                  the same warm machine may carry nothing: it takes what the first installed), then each benchmark
#                  script given (its path from the repository root, with its arguments); an argument naming tests/...
#                  runs those tests with pytest (the ones that need vLLM importable). Also carry .gpu-bundle/server
#                  (the OpenAI server's wheels: uvicorn, watchfiles, ...) for server_aborts.py; BENCH_TIMEOUT_S=N
#                  stops each script with SIGINT after N s (SIGKILL 75 s later: server_aborts.py stops its server
#                  first), so what it wrote comes back inside the 10-minute limit. Scripts that need no vLLM
#                  (benchmarks/probes/probe_*.py) need no unpack call and carry nothing (bench_kernels.py then
#                  measures no vLLM / FA3 peers).
#   stage "moe":    carry .gpu-bundle/moe (scripts/device/make_moe_ext.sh: MoE extension, compressed-tensors) -> kept in
#                  /tmp; the next bench call unpacks it beside vLLM (MoE models: vllm_e2e/vllm_hybrid_gpu.py)
#   stage "ab":     carry .gpu-bundle/base (scripts/device/make_base_tree.sh REV) -> each benchmark script given runs
#                  twice in this call, first over REV's dcp-triton (results named *_base, provenance REV), then over
#                  this tree's: an A/B of two commits on one machine. Scripts that need vLLM need it unpacked and
#                  on PYTHONPATH already (a warm machine after a bench call).
#   e.g.  bash scripts/device/run_h200.sh unpack     carry .gpu-bundle/core-part, then
#         bash scripts/device/run_h200.sh bench "benchmarks/vllm_e2e/vllm_gpu_e2e.py --quick"
#                                                     carry .gpu-bundle/extra, .gpu-bundle/core-rest
# Everything runs from /tmp: in the repository root, its dcp_plugin/ folder (the checkout's code) would come before the
# installed package in any child Python process. A script
# named by its path runs as its module (python3 -m benchmarks.x.y; an example by its path: _device.sh's script_argv),
# with the repository root last on PYTHONPATH (repo_last): benchmarks from the repository, dcp_plugin from /tmp/dcp.
# Logs land in $OUT, and every file the benchmarks wrote under benchmarks/results/ in $OUT/results_new.tar.gz.
set -uo pipefail
stage=${1:?usage: run_h200.sh unpack|tests|bench|moe|ab [arguments...]}
shift
source "$(dirname "$0")/_device.sh"
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
# The tier's files that watch compiles (Triton's per-process caches), prepared launches or the allocator's peak: in
# one process of their own, never beside another test on the GPU.
SERIAL_TESTS=${SERIAL_TESTS:-"test_memory_gpu.py test_warmup_gpu.py test_jit_variants_gpu.py test_launch_gpu.py"}
mkdir -p "$OUT"
case "$stage" in
  unpack)
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
    unpack_core
    core_status || exit 1
    echo "next: a bench call within the machine's 30 s warm time"
    ;;
  tests)
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
    unpack_core
    install_dcp "$OUT/install.log" || exit 1
    targets=()
    for arg in "$@"; do [[ $arg == tests/* ]] && targets+=("$repo/$arg") || targets+=("$arg"); done
    cd /tmp
    if [[ ${#targets[@]} -gt 0 && ${targets[0]} == "$repo"/tests/* ]]; then
      PYTHONPATH=/tmp/dcp:$repo "${PYTEST[@]}" -q -m gpu --durations=25 \
        "${targets[@]}" 2>&1 | from_repo | tee "$OUT/gpu_tests.log"
    else  # the whole tier: the correctness files on xdist workers, then the serial ones
      serial=() parallel=()
      for f in "$repo"/tests/gpu/test_*.py; do
        if [[ " $SERIAL_TESTS " == *" $(basename "$f") "* ]]; then serial+=("$f"); else parallel+=("$f"); fi
      done
      { PYTHONPATH=/tmp/dcp:$repo "${PYTEST[@]}" -q -m gpu --durations=25 \
          -n "${TEST_WORKERS:-4}" "${parallel[@]}" "${targets[@]}" 2>&1
        PYTHONPATH=/tmp/dcp:$repo "${PYTEST[@]}" -q -m gpu --durations=10 \
          "${serial[@]}" "${targets[@]}" 2>&1; } | from_repo | tee "$OUT/gpu_tests.log"
    fi
    ;;
  moe)
    cp "$repo/.gpu-bundle/moe/moe.tar.gz" /tmp/ || exit 1
    echo "vLLM's MoE extension kept in /tmp: the next bench call unpacks it"
    ;;
  bench)
    install_dcp "$OUT/install.log" || exit 1
    join_core || exit 1
    if test -f /tmp/moe.tar.gz && vllm_unpacked; then tar xzf /tmp/moe.tar.gz -C /tmp/vs || exit 1; fi
    if test -f "$repo/.gpu-bundle/extra/setup.sh" && vllm_unpacked; then source "$repo/.gpu-bundle/extra/setup.sh"
    elif vllm_unpacked && test -d /tmp/site; then  # vLLM's deps from an earlier bench call of this warm machine
      export PYTHONPATH=/tmp/vs:/tmp/site${PYTHONPATH:+:$PYTHONPATH} VLLM_USE_FLASHINFER_SAMPLER=0
    fi
    rm -rf /tmp/site-server
    if compgen -G "$repo/.gpu-bundle/server/*.whl" >/dev/null; then  # the OpenAI server's wheels, when carried
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-server \
        "$repo"/.gpu-bundle/server/*.whl >"$OUT/install_server.log" 2>&1 || { cat "$OUT/install_server.log"; exit 1; }
      export PYTHONPATH=/tmp/site-server${PYTHONPATH:+:$PYTHONPATH}
    fi
    export PYTHONPATH=/tmp/dcp${PYTHONPATH:+:$PYTHONPATH}
    PYTHONPATH=$(repo_last)  # benchmarks and tests from the repository, dcp_plugin from /tmp/dcp
    cd /tmp
    results_here
    for script in "$@"; do
      if [[ $script == tests/* ]]; then
        DCP_TRITON_REQUIRE_VLLM=1 "${PYTEST[@]}" -q -m gpu "$repo/$script" 2>&1 \
          | from_repo | tee -a "$OUT/gpu_tests_vllm.log"
        continue
      fi
      # shellcheck disable=SC2086  # "name.py --flag value": word splitting is wanted
      script_argv $script || continue
      timeout -s INT -k 75 "${BENCH_TIMEOUT_S:-0}" "${ARGV[@]}" 2>&1 | tee -a "$OUT/bench.log"
    done
    pack_results "$OUT/install.log" "$OUT/results_new.tar.gz"  # what the scripts wrote
    ;;
  ab)
    base=$repo/.gpu-bundle/base
    test -f "$base/tree.tar.gz" || { echo "carry .gpu-bundle/base (scripts/device/make_base_tree.sh REV)" >&2; exit 1; }
    install_dcp "$OUT/install.log" || exit 1
    rm -rf /tmp/dcp_base_src /tmp/dcp_base && mkdir -p /tmp/dcp_base_src && tar xzf "$base/tree.tar.gz" -C /tmp/dcp_base_src
    python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/dcp_base /tmp/dcp_base_src \
      >"$OUT/install_base.log" 2>&1 || { cat "$OUT/install_base.log"; exit 1; }
    # this tree's benchmarks over each dcp-triton: its install first, the repository root last
    base_path=$(PYTHONPATH=/tmp/dcp_base${PYTHONPATH:+:$PYTHONPATH} repo_last)
    ours_path=$(PYTHONPATH=/tmp/dcp${PYTHONPATH:+:$PYTHONPATH} repo_last)
    cd /tmp
    results_here
    for script in "$@"; do
      # shellcheck disable=SC2086  # "name.py --flag value": word splitting is wanted
      script_argv $script || continue
      PYTHONPATH=$base_path DCP_TRITON_COMMIT=$(cat "$base/REV") DCP_BENCH_NAME_SUFFIX=_base "${ARGV[@]}" 2>&1 \
        | tee -a "$OUT/bench_base.log"
      PYTHONPATH=$ours_path "${ARGV[@]}" 2>&1 | tee -a "$OUT/bench.log"
    done
    pack_results "$OUT/install.log" "$OUT/results_new.tar.gz"
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
