#!/usr/bin/env bash
# vLLM 0.33 on the H200 under its torch 2.11: two back-to-back device calls, because the bundle that
# make_bundle_v033.sh writes into .gpu-bundle-033/ travels in two parts (files in /tmp survive between
# calls while the machine stays warm):
#   stage "core" (carry .gpu-bundle-033/core):  keeps the archive's first part in /tmp/vs33.parts
#   stage "run"  (carry .gpu-bundle-033/extra): unpacks vLLM 0.33 into /tmp/vs33 and its missing wheels into
#     /tmp/site33 (extra/setup.sh), installs dcp-triton into /tmp/dcp, then each step under a timeout, all within
#     BUDGET_S (default 510 s):
#     a  versions; loading vllm._C_stable_libtorch; FA3's extension (moved aside if it crashes the process, so the
#        TRITON_ATTN steps cannot depend on it); the engine-start imports and dcp-triton's plugin registration
#     b  greedy generation with TRITON_ATTN on a random-initialised small Llama, float32 and bf16, eager
#     c  (if b generated) vllm_gpu_e2e.py's float32 prompt-logprob agreement, dcp-triton vs TRITON_ATTN (bound 1e-3,
#        TRITON_F32_DEFAULT=ieee), eager (quick-gqa5-fp32-*) and with CUDA graphs (agree-gqa5-fp32-graphs-*:
#        FULL_AND_PIECEWISE, capture sizes 1..256), under Model Runner V2 (0.33's default) and V1
#        (VLLM_USE_V2_MODEL_RUNNER=1 / =0), the two runs side by side
#   $OUT gets v033_summary.json (each step's status, rc, seconds, exact error; the e2e checks) and
#   v033_logs.tar.gz (every step's log, the e2e reports and per-job vLLM logs).
#   e.g.  bash scripts/device/run_h200_v033.sh core   carry .gpu-bundle-033/core, then
#         bash scripts/device/run_h200_v033.sh run    carry .gpu-bundle-033/extra
# Everything runs from /tmp: the repository root's dcp_plugin/ would shadow the installed package; the benchmarks run
# as modules, the repository root last on PYTHONPATH (run_h200.sh says how).
# _device.sh (sourced) sets $repo and installs dcp-triton.
set -uo pipefail
stage=${1:?usage: run_h200_v033.sh core|run}
source "$(dirname "$0")/_device.sh"
bundle=${BUNDLE33:-$repo/.gpu-bundle-033}
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out33} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$OUT"
case $stage in
  core)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c 'import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)'
    mkdir -p /tmp/vs33.parts && cp "$bundle/core/vllm033.tar.xz.00" /tmp/vs33.parts/ && rm -f /tmp/vs33/.complete \
      && ls -l /tmp/vs33.parts
    ;;
  run)
    start=$SECONDS budget=${BUDGET_S:-510} L=/tmp/v033-logs
    rm -rf "$L" && mkdir -p "$L"
    smoke=(python3 -m "$(module_of benchmarks/vllm_e2e/v033_smoke.py)")
    finish() {
      PYTHONPATH=$(repo_last) "${smoke[@]}" summary "$L" "$OUT/v033_summary.json"
      tar czf "$OUT/v033_logs.tar.gz" --exclude=mirror -C "$L" .
    }
    trap finish EXIT
    step() {  # step NAME LIMIT_S COMMAND...: output to $L/NAME.log, "rc seconds" to $L/NAME.rc
      local name=$1 limit=$2 t0=$SECONDS rc left=$((budget - (SECONDS - start)))
      shift 2
      ((left < limit)) && limit=$left
      if ((limit < 20)); then echo "skipped 0" > "$L/$name.rc"; echo "$name: skipped (budget)"; return 1; fi
      timeout -k 10 "$limit" "$@" > "$L/$name.log" 2>&1
      rc=$?
      echo "$rc $((SECONDS - t0))" > "$L/$name.rc"
      echo "[$((SECONDS - start)) s] $name rc=$rc"
      return $rc
    }
    ok() { grep -q '^RESULT ' "$L/$1.log" 2>/dev/null; }
    skip() { local n; for n in "$@"; do echo "skipped 0" > "$L/$n.rc"; done; }
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv > "$L/gpu.txt" 2>&1
    t0=$SECONDS
    { source "$bundle/extra/setup.sh" && install_dcp "$L/install.log"; } > "$L/setup.log" 2>&1
    rc=$?
    echo "$rc $((SECONDS - t0))" > "$L/setup.rc"
    ((rc == 0)) || { echo "setup failed"; tail -20 "$L/setup.log"; exit 1; }
    echo "RESULT {}" >> "$L/setup.log"
    export PYTHONPATH=/tmp/dcp:$PYTHONPATH
    PYTHONPATH=$(repo_last)  # the benchmarks from the repository, dcp_plugin from /tmp/dcp
    cd /tmp
    step a-versions 120 "${smoke[@]}" versions
    step a-probe-c 120 "${smoke[@]}" probe-c &
    step a-probe-fa3 120 "${smoke[@]}" probe-fa3 &
    step a-imports 150 "${smoke[@]}" imports &
    wait
    fa3_rc=$(cut -d' ' -f1 "$L/a-probe-fa3.rc")
    if [[ $fa3_rc =~ ^[0-9]+$ ]] && ((fa3_rc > 128 || fa3_rc == 124)); then  # a signal or a hang: keep it out
      mv /tmp/vs33/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so{,.disabled}
      echo "FA3 extension moved aside after probe rc=$fa3_rc" | tee "$L/fa3-disabled.txt"
    fi
    if ok a-versions; then
      step b-build 120 "${smoke[@]}" build /tmp/rand-llama33
      for dtype in float32 bfloat16; do
        step "b-generate-TRITON_ATTN-$dtype" 200 "${smoke[@]}" generate /tmp/rand-llama33 TRITON_ATTN "$dtype" &
      done
      wait
    else
      skip b-build b-generate-TRITON_ATTN-float32 b-generate-TRITON_ATTN-bfloat16
    fi
    if ok b-generate-TRITON_ATTN-float32 || ok b-generate-TRITON_ATTN-bfloat16; then
      e2e=(python3 -m "$(module_of benchmarks/vllm_e2e/vllm_gpu_e2e.py)" --triton-f32 ieee)
      step c-build-model 150 "${e2e[@]}" --work-dir /tmp/e33 --only build-gqa5-d64 --results-dir "$L/c-build" --mirror "$L/c-build"
      echo "RESULT {}" >> "$L/c-build-model.log"  # the runner prints no RESULT line: its rc tells
      left=$((budget - (SECONDS - start) - 30))
      for runner in 1 0; do  # 1: Model Runner V2 (0.33's default for this model), 0: V1
        name=e2e-runner-v$((runner + 1)) work=/tmp/e33-mr$runner  # own job specs and compile cache, one model
        mkdir -p "$L/$name" "$work" && ln -sfn /tmp/e33/models "$work/models"
        step "$name" "$left" env VLLM_USE_V2_MODEL_RUNNER=$runner VLLM_CACHE_ROOT="$work/cache" \
          "${e2e[@]}" --work-dir "$work" --jobs 4 --budget-s $((left - 15)) \
          --only 'quick-gqa5-fp32-*,agree-gqa5-fp32-graphs-*' --name "v033_mr$runner" \
          --results-dir "$L/$name/results" --mirror "$L/$name/mirror" &
        sleep 5
      done
      wait
      for runner in 1 0; do  # a run that wrote its report counts as run (its checks say the rest)
        test -f "$L/e2e-runner-v$((runner + 1))/results/v033_mr$runner.json" \
          && echo "RESULT {}" >> "$L/e2e-runner-v$((runner + 1)).log"
      done
    else
      skip c-build-model e2e-runner-v2 e2e-runner-v1
    fi
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
