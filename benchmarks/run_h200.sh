#!/usr/bin/env bash
# One lease on the H200 (device tool), in two back-to-back calls because the vLLM bundle travels in two parts:
#   stage "tests": carry .gpu-bundle/core -> unpack vLLM 0.26 into /tmp/vs, install dcp-triton, run `pytest -m gpu`
#                  (extra arguments: test files relative to the repo, or pytest options)
#   stage "unpack": carry .gpu-bundle/core -> unpack vLLM 0.26 into /tmp/vs and nothing else (~40 s: a first call
#                  before a bench call that runs no GPU tests). The repository (~12 MiB) no longer fits beside core's
#                  58 MiB: carry .gpu-bundle/core-part instead (scripts/split_bundle026.sh), whose part stays in /tmp
#                  until the bench call, which then also carries .gpu-bundle/core-rest, joins and unpacks it.
#   stage "bench": carry .gpu-bundle/extra -> vLLM's deps, then each benchmark script given (with its arguments);
#                  an argument naming tests/... runs those tests with pytest (the ones that need vLLM importable).
#                  Also carry .gpu-bundle/server (the OpenAI server's wheels: uvicorn, watchfiles, ...) for
#                  server_aborts.py; BENCH_TIMEOUT_S=N stops each script with SIGINT after N s (SIGKILL 75 s later:
#                  server_aborts.py stops its server first), so what it wrote comes back inside the 10-minute limit.
# Everything runs from /tmp: in the repository root, its dcp_plugin/ folder (without the kernels/ and adapters/
# packages that the install maps into it) would shadow the installed package for any child Python process.
# Logs land in $OUT, and every file the benchmarks wrote under benchmarks/results/ in $OUT/results_new.tar.gz.
set -uo pipefail
stage=${1:?usage: run_h200.sh tests|unpack|bench [arguments...]}
shift
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
install_dcp() {  # fresh each call: a warm machine may hold an older install
  rm -rf /tmp/dcp
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/dcp "$repo" \
    >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; return 1; }
}
unpack_core() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
  if test -f "$repo/.gpu-bundle/core/vllm026.tar.xz"; then
    mkdir -p /tmp/vs && tar xJf "$repo/.gpu-bundle/core/vllm026.tar.xz" -C /tmp/vs
  elif test -f "$repo/.gpu-bundle/core-part/vllm026.tar.xz.00"; then  # split archive: the bench call joins it
    cp "$repo/.gpu-bundle/core-part/vllm026.tar.xz.00" /tmp/
  fi
}
join_core() {  # the split archive's rest, carried in core-rest, joined to the part an unpack call left in /tmp
  local rest=$repo/.gpu-bundle/core-rest
  if test -d /tmp/vs/vllm || ! test -f "$rest/vllm026.tar.xz.01"; then return 0; fi
  test -f /tmp/vllm026.tar.xz.00 || { echo "no /tmp/vllm026.tar.xz.00: first an unpack call carrying" \
    ".gpu-bundle/core-part (the machine must still be warm)" >&2; return 1; }
  cat /tmp/vllm026.tar.xz.00 "$rest/vllm026.tar.xz.01" >/tmp/vllm026.tar.xz
  (cd /tmp && sha256sum -c --quiet "$rest/SHA256SUMS") || return 1
  mkdir -p /tmp/vs && tar xJf /tmp/vllm026.tar.xz -C /tmp/vs && rm -f /tmp/vllm026.tar.xz /tmp/vllm026.tar.xz.00
}
case "$stage" in
  unpack)
    unpack_core
    if test -d /tmp/vs/vllm; then echo "vLLM unpacked into /tmp/vs"
    elif test -f /tmp/vllm026.tar.xz.00; then echo "first part of vLLM's archive kept in /tmp (bench joins it)"
    else echo "neither .gpu-bundle/core nor .gpu-bundle/core-part was carried" >&2; exit 1; fi
    echo "next: a bench call within the machine's 30 s warm time"
    ;;
  tests)
    unpack_core
    install_dcp || exit 1
    targets=()
    for arg in "$@"; do [[ $arg == tests/* ]] && targets+=("$repo/$arg") || targets+=("$arg"); done
    [[ ${#targets[@]} -gt 0 && ${targets[0]} == "$repo"/tests/* ]] || targets=("$repo/tests/gpu" "${targets[@]}")
    cd /tmp && PYTHONPATH=/tmp/dcp:$repo python3 -m pytest -q -m gpu -p no:cacheprovider "${targets[@]}" 2>&1 \
      | tee "$OUT/gpu_tests.log"
    ;;
  bench)
    install_dcp || exit 1
    join_core || exit 1
    if test -f "$repo/.gpu-bundle/extra/setup.sh" && test -d /tmp/vs/vllm; then source "$repo/.gpu-bundle/extra/setup.sh"; fi
    rm -rf /tmp/site-server
    if compgen -G "$repo/.gpu-bundle/server/*.whl" >/dev/null; then  # the OpenAI server's wheels, when carried
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-server \
        "$repo"/.gpu-bundle/server/*.whl >"$OUT/install_server.log" 2>&1 || { cat "$OUT/install_server.log"; exit 1; }
      export PYTHONPATH=/tmp/site-server${PYTHONPATH:+:$PYTHONPATH}
    fi
    export PYTHONPATH=/tmp/dcp${PYTHONPATH:+:$PYTHONPATH}
    cd /tmp
    for script in "$@"; do
      if [[ $script == tests/* ]]; then
        PYTHONPATH=$PYTHONPATH:$repo python3 -m pytest -q -m gpu -p no:cacheprovider "$repo/$script" 2>&1 \
          | tee -a "$OUT/gpu_tests_vllm.log"
        continue
      fi
      # shellcheck disable=SC2086  # "name.py --flag value": word splitting is wanted
      timeout -s INT -k 75 "${BENCH_TIMEOUT_S:-0}" python3 "$repo"/benchmarks/$script 2>&1 | tee -a "$OUT/bench.log"
    done
    # What the scripts wrote, as one archive (the device returns a limited number of files; copying every result
    # file once lost a run's own): unpack it into benchmarks/results/ here.
    (cd "$repo/benchmarks/results" && find . -type f -newer "$OUT/install.log" -print0 \
      | tar czf "$OUT/results_new.tar.gz" --null -T -)
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
