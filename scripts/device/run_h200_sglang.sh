#!/usr/bin/env bash
# SGLang 0.5.17 on one H100 or H200 (device tool), in back-to-back calls of one lease (files in /tmp survive while the
# machine stays warm: start each call within ~30 s of the last). SGLang's wheels, DeepGEMM and SGLang's FA3 extension
# travel as parts of <= 50 MiB (scripts/device/make_sglang_bundle.sh), one part a call:
#   stage "part":     carry .gpu-bundle/sglang-part-NN -> that part stays in /tmp/sglang-bundle (one call for each part
#                     but the last)
#   stage "install":  carry the last part -> kept the same way; then, with every part that SHA256SUMS lists in /tmp,
#                     joins them, checks each part's and the whole archive's sha256, installs the wheels into /tmp/sgl
#                     (pip --no-index --no-deps --target) and SGLang's FA3 extension into its sgl_kernel (where the
#                     bundle has it) and dcp-triton into /tmp/dcp, and checks the install: versions, sgl_kernel's
#                     sm90 ops, DeepGEMM, FA3, FlashInfer's sampling module, dcp-triton in SGLang's attention
#                     backends after SGLang's own plugin loading, and one JIT build of SGLang's RoPE kernel (nvcc,
#                     cached in /tmp/sgl-jit for the bench call) -> $OUT/install_check.log
#                     Arguments after "install" (a benchmark script and its arguments, as for bench) run that
#                     benchmark in the same call, once the install checks passed.
#   stage "bench":    carry nothing -> dcp-triton installed afresh, then benchmarks/sglang_e2e/sglang_one_h200.py with the
#                     given arguments (or the script a first argument ending in .py names, from the repository root:
#                     benchmarks/sglang_e2e/sglang_spec_gpu.py), SGLang from /tmp/sgl; BENCH_TIMEOUT_S=N stops it with
#                     SIGINT after N s (its job processes end with it; what it saved stays)
#   e.g.  bash scripts/device/run_h200_sglang.sh part       carry .gpu-bundle/sglang-part-00
#         bash scripts/device/run_h200_sglang.sh install    carry .gpu-bundle/sglang-part-01
#         BENCH_TIMEOUT_S=540 bash scripts/device/run_h200_sglang.sh bench --budget-s 400
# Logs land in $OUT, the jobs' logs in $OUT/sglang_job_logs.tar.gz, and every file the benchmark wrote under
# benchmarks/results/ in $OUT/results_new.tar.gz. Everything runs from /tmp, the script as its module (run_h200.sh
# says why and how).
set -uo pipefail
stage=${1:?usage: run_h200_sglang.sh part|install|bench [benchmark arguments...]}
shift
# shellcheck source-path=SCRIPTDIR source=_device.sh
source "$(dirname "$0")/_device.sh"
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} TVM_FFI_CACHE_DIR=/tmp/sgl-jit DCP_BENCH_WORK=/tmp/dcp_sglang_one_h200
mkdir -p "$OUT"
bundle=/tmp/sglang-bundle
sgl=/tmp/sgl

missing_parts() {  # the parts SHA256SUMS lists that are not in $bundle yet, one a line
  local name
  awk '$2 ~ /\.[0-9][0-9]$/ {print $2}' "$bundle/SHA256SUMS" | while read -r name; do
    test -f "$bundle/$name" || echo "$name"
  done
}

keep_parts() {  # every carried part, with its SHA256SUMS, into $bundle; then what is still missing
  local part kept=0
  mkdir -p "$bundle"
  for part in "$repo"/.gpu-bundle/sglang-part-*/sglang-bundle.tar.[0-9][0-9]; do
    test -f "$part" || continue
    cp "$part" "$(dirname "$part")/SHA256SUMS" "$bundle/" && kept=1 && echo "kept ${part##*/} in $bundle"
  done
  [[ $kept == 1 ]] || { echo "no .gpu-bundle/sglang-part-NN was carried" >&2; return 1; }
  local missing
  missing=$(missing_parts | tr '\n' ' ')
  if [[ -n $missing ]]; then echo "still missing: ${missing}(a part call each)"; else echo "all parts here"; fi
}

check_install() {  # what the benchmark relies on, in one process; also builds (and caches) the RoPE JIT kernel
  python3 - <<'PY'
import importlib.metadata as md

import torch

print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
for dist in ("sglang", "sglang-kernel", "flashinfer-python", "apache-tvm-ffi", "transformers", "tokenizers",
             "triton", "dcp-triton"):
    print(f"{dist}=={md.version(dist)}")
import sgl_kernel  # loads sm90/common_ops on an H200

print("sgl_kernel ops:", sgl_kernel.common_ops.__file__)
import deep_gemm  # noqa: F401,E402 - the speculative workers' graph capture imports it

try:
    from sgl_kernel.flash_attn import is_fa3_supported
except ImportError as error:
    print("no fa3 backend:", error)
else:
    print("fa3 (sgl_kernel.flash_ops) loads; supported here:", is_fa3_supported())
import flashinfer.sampling  # noqa: F401,E402 - what SGLang's sampler imports on CUDA
from sglang.srt.entrypoints.engine import Engine  # noqa: F401,E402
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402

load_plugins()
assert "dcp-triton" in ATTENTION_BACKENDS and "triton" in ATTENTION_BACKENDS, sorted(ATTENTION_BACKENDS)
print("attention backends: dcp-triton and triton registered")
from sglang.kernels.ops.attention.rope import apply_rope_inplace  # noqa: E402

q, k = (torch.randn(4, h, 128, device="cuda", dtype=torch.bfloat16) for h in (32, 8))
cos_sin = torch.randn(64, 128, device="cuda", dtype=torch.float32)
apply_rope_inplace(q, k, cos_sin, torch.arange(4, device="cuda"), is_neox=True)
torch.cuda.synchronize()
print("SGLang's JIT RoPE kernel built and ran")
PY
}

bench() {  # bench [SCRIPT.py] [ARGS...]: one benchmark script over SGLang in /tmp/sgl, its logs and results to $OUT
  local script=benchmarks/sglang_e2e/sglang_one_h200.py
  if [[ ${1:-} == *.py ]]; then script=$1; shift; fi
  script_argv "$script" "$@" || return 1
  (cd /tmp && PYTHONPATH=$(PYTHONPATH=/tmp/dcp:$sgl repo_last) timeout -s INT -k 75 "${BENCH_TIMEOUT_S:-0}" \
    "${ARGV[@]}" 2>&1 | tee "$OUT/bench.log")
  if compgen -G "$DCP_BENCH_WORK/*.log" >/dev/null; then
    (cd "$DCP_BENCH_WORK" && tar czf "$OUT/sglang_job_logs.tar.gz" -- *.log)
  fi
  pack_results "$OUT/install.log" "$OUT/results_new.tar.gz"  # what the benchmark wrote
}

case "$stage" in
  part)
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
    keep_parts || exit 1
    echo "next: the next part (or install, with the last) within the machine's 30 s warm time"
    ;;
  install)
    keep_parts || exit 1
    [[ -z $(missing_parts) ]] || exit 1
    join_checked "$bundle/sglang-bundle.tar" "$bundle/SHA256SUMS" "$bundle"/sglang-bundle.tar.[0-9][0-9] || exit 1
    rm -rf "$bundle/wheels" "$bundle/fa3" "$sgl" && tar xf "$bundle/sglang-bundle.tar" -C "$bundle" || exit 1
    rm "$bundle/sglang-bundle.tar"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$sgl" "$bundle"/wheels/*.whl \
      >"$OUT/install_sglang.log" 2>&1 || { cat "$OUT/install_sglang.log"; exit 1; }
    if test -f "$bundle/fa3/flash_ops.abi3.so.xz"; then  # SGLang's fa3 backend (make_sglang_bundle.sh)
      xz -dc -T0 "$bundle/fa3/flash_ops.abi3.so.xz" >"$sgl/sgl_kernel/flash_ops.abi3.so" || exit 1
    fi
    install_dcp "$OUT/install.log" || exit 1
    which nvcc && nvcc --version | tail -2
    cd /tmp || exit 1
    PYTHONPATH=/tmp/dcp:$sgl check_install 2>&1 | tee "$OUT/install_check.log"
    [[ ${PIPESTATUS[0]} == 0 ]] || exit 1
    touch "$sgl/.installed"
    if [[ $# -gt 0 ]]; then bench "$@"; else echo "next: a bench call within the machine's 30 s warm time"; fi
    ;;
  bench)
    test -f "$sgl/.installed" || { echo "SGLang is not installed in $sgl: part and install calls first" >&2; exit 1; }
    install_dcp "$OUT/install.log" || exit 1
    bench "$@"
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
