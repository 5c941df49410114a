#!/usr/bin/env bash
# The version-independent vLLM adapter tests (tests/unit/test_vllm_adapter_matrix.py) against the Python packages
# of vLLM's CUDA builds, on a machine without GPU. Each version gets its own venv holding only that vLLM, installed
# without dependencies; every other package (the CPU torch, vLLM's dependencies, dcp-triton itself) comes from
# .venv, so run it after `make test` built .venv. A venv already installed against this .venv is reused.
# --install-only installs the venvs and runs nothing: it needs only .venv's interpreter, so it can run while .venv
# is still being installed (.ci/run does). The versions' tests run side by side (each ~20 s, most of it starting
# Python processes), each one's output printed whole, in order.
# Usage, from the repository root: scripts/test_vllm_matrix.sh [--install-only] 0.26.0 0.33.0
set -euo pipefail
install_only=false
if [ "${1:-}" = --install-only ]; then
    install_only=true
    shift
fi
py=.venv/bin/python
purelib='import sysconfig; print(sysconfig.get_path("purelib"))'
base=$("$py" -c "$purelib")
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
versions=()
pids=()
for version in "$@"; do
    venv=.venv-vllm/$version
    if [ "$(cat "$venv/.installed" 2>/dev/null)" != "$base" ]; then
        rm -rf "$venv"
        "$py" -m venv --without-pip "$venv"
        echo "import site; site.addsitedir('$base')" > "$("$venv/bin/python" -c "$purelib")/dcp_triton_base.pth"
        "$py" -m pip --python "$venv/bin/python" install -q --no-deps "vllm==$version"
        echo "$base" > "$venv/.installed"
    fi
    if $install_only; then
        continue
    fi
    DCP_TRITON_EXPECT_VLLM="vllm==$version" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
        tests/unit/test_vllm_adapter_matrix.py > "$logs/$version" 2>&1 &
    versions+=("$version")
    pids+=("$!")
done
failed=0
for i in "${!pids[@]}"; do
    status=0
    wait "${pids[$i]}" || status=$?
    echo "== vllm ${versions[$i]}"
    cat "$logs/${versions[$i]}"
    if [ "$status" != 0 ]; then
        failed=1
    fi
done
exit "$failed"
