#!/usr/bin/env bash
# Packs vLLM 0.33.0 for the offline H200 machine (torch 2.11, Python 3.12, no vLLM, no network, at most 64 MiB of
# working tree per device call) as two parts that travel in two consecutive calls (run_h200_v033.sh):
#   OUTDIR/core/vllm033.tar.xz.00   the first CORE_MIB MiB of one xz archive of vLLM's Python files + the stable-ABI
#                                   extensions (_C_stable_libtorch and the small cumem_allocator/spinloop/fs_io_C)
#   OUTDIR/extra/vllm033.tar.xz.01  the rest of that archive (cat .00 .01 | tar xJ)
#   OUTDIR/extra/fa3.tar.xz         FlashAttention-3's extension alone (vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so):
#                                   vLLM imports it inside try/except ImportError, so TRITON_ATTN runs without it
#   OUTDIR/extra/wheels/*.whl       what vLLM imports for a dense Llama that the machine's image lacks (cp312)
#   OUTDIR/extra/setup.sh           `source` it there: joins and unpacks the parts, installs the wheels
#   OUTDIR/extra/SHA256SUMS         of the whole archive and of fa3.tar.xz (setup.sh checks them)
# Left out: FA2 (308 MB; Hopper uses FA3), the MoE/FlashMLA/QuTLASS/DeepSelect/FlashKDA extensions, DeepGEMM's
# extension and the CUTLASS headers under third_party/ (third_party's .py files stay), the vllm-rs binary: a dense
# Llama on TRITON_ATTN/FLASH_ATTN imports none of them (vLLM imports each inside try/except or only on its own path).
# The full archive is ~70 MB, more than one call carries beside the repository, hence the split.
# Usage: scripts/device/make_bundle_v033.sh OUTDIR     (about 3 minutes on 2 cores; needs pip, unzip, xz)
set -euo pipefail
out=${1:?usage: make_bundle_v033.sh OUTDIR}
version=0.33.0
core_mib=${CORE_MIB:-46}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d /tmp/vllm033-bundle.XXXXXX)
trap 'rm -rf "$work"' EXIT

fetch() {  # cp312 wheels for manylinux x86-64, no dependencies
  local dest=$1
  shift
  local plats=() n
  for n in 1 2014 _2_17 _2_24 _2_26 _2_27 _2_28 _2_31; do plats+=(--platform "manylinux${n}_x86_64"); done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plats[@]}" -d "$dest" "$@" 2>&1 | grep -v 'is ignored' || true
}

fetch "$work/dl" "vllm==$version"
whl=$(ls "$work"/dl/vllm-"$version"-*.whl)
mkdir -p "$work/tree" "$work/fa3/vllm/vllm_flash_attn"
unzip -q "$whl" -d "$work/tree"
cd "$work/tree/vllm"
mv vllm_flash_attn/_vllm_fa3_C.abi3.so "$work/fa3/vllm/vllm_flash_attn/"
keep_so=" ./_C_stable_libtorch.abi3.so ./cumem_allocator.abi3.so ./spinloop.abi3.so ./fs_io_C.abi3.so "
while IFS= read -r -d '' so; do
  [[ $keep_so == *" $so "* ]] || rm -f "$so"
done < <(find . -name '*.so' -print0)
rm -f vllm-rs
find third_party -type f ! -name '*.py' -delete
find third_party -type d -empty -delete
cd "$work/tree"
test -f vllm/_C_stable_libtorch.abi3.so && test -f vllm/platforms/cuda.py  # the trimming kept what it must

rm -rf "$out/core" "$out/extra"
mkdir -p "$out/core" "$out/extra/wheels"
tar cf - vllm "vllm-$version.dist-info" | xz -T2 -9 > "$work/vllm033.tar.xz"
(cd "$work/fa3" && tar cf - vllm | xz -T2 -9 > "$out/extra/fa3.tar.xz")
(cd "$work" && sha256sum vllm033.tar.xz > "$out/extra/SHA256SUMS")
(cd "$out/extra" && sha256sum fa3.tar.xz >> SHA256SUMS)
head -c $((core_mib << 20)) "$work/vllm033.tar.xz" > "$out/core/vllm033.tar.xz.00"
tail -c +$(((core_mib << 20) + 1)) "$work/vllm033.tar.xz" > "$out/extra/vllm033.tar.xz.01"

# vLLM 0.33's engine-start imports that the image lacks (its 'cuda' image has transformers 5.17, huggingface_hub
# 1.33, tokenizers 0.23.2, numpy, aiohttp, httpx, pillow, ... but no pydantic, fastapi, openai, zmq, msgspec).
# Versions inside vLLM 0.33's pins: apache-tvm-ffi==0.1.11 and xgrammar==0.2.8 exactly; openai_harmony now comes
# from the oss-harmony distribution. compressed-tensors==0.17.0 (pinned; its loguru too): 0.33's model loader
# imports it for every model (model_loader/base_loader.py, online quantization), first seen on the H200.
fetch "$out/extra/wheels" annotated-types==0.8.0 apache-tvm-ffi==0.1.11 blake3==1.0.11 cachetools==8.0.2 \
  cbor2==6.3.0 distro==1.9.0 fastapi==0.136.3 jiter==0.19.0 llguidance==1.7.6 msgspec==0.22.0 openai==2.54.0 \
  oss-harmony==0.0.11 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4 pydantic-core==2.50.5 \
  pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 typing-inspection==0.4.5 xgrammar==0.2.8 \
  compressed-tensors==0.17.0 loguru==0.7.3
test "$(ls "$out"/extra/wheels/*.whl | wc -l)" -eq 23

cat > "$out/extra/setup.sh" <<'SH'
# Source on the GPU machine once core/vllm033.tar.xz.00 was copied to /tmp/vs33.parts/ (run_h200_v033.sh core).
# Unpacks vLLM 0.33 into /tmp/vs33 (FA3 included), the wheels into /tmp/site33; exports PYTHONPATH.
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if ! test -f /tmp/vs33/.complete; then
  test -f /tmp/vs33.parts/vllm033.tar.xz.00 || { echo "no /tmp/vs33.parts/vllm033.tar.xz.00: run the core stage first" >&2; return 1; }
  cat /tmp/vs33.parts/vllm033.tar.xz.00 "$here/vllm033.tar.xz.01" > /tmp/vs33.parts/vllm033.tar.xz
  (cd /tmp/vs33.parts && grep vllm033.tar.xz "$here/SHA256SUMS" | sha256sum -c --quiet -) || return 1
  rm -rf /tmp/vs33 && mkdir -p /tmp/vs33 && tar xJf /tmp/vs33.parts/vllm033.tar.xz -C /tmp/vs33 || return 1
  (cd "$here" && grep fa3.tar.xz SHA256SUMS | sha256sum -c --quiet -) && tar xJf "$here/fa3.tar.xz" -C /tmp/vs33 || return 1
  touch /tmp/vs33/.complete
fi
rm -rf /tmp/site33 && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site33 \
  "$here"/wheels/*.whl || return 1
export PYTHONPATH=/tmp/vs33:/tmp/site33${PYTHONPATH:+:$PYTHONPATH} VLLM_USE_FLASHINFER_SAMPLER=0
SH
du -b "$out"/core/* "$out"/extra/*.* "$out"/extra/wheels | awk '{printf "%6.1f MiB  %s\n", $1 / 1048576, $2}'
du -sb "$out/core" "$out/extra" | awk '{printf "%6.1f MiB  %s (this call carries it)\n", $1 / 1048576, $2}'
