#!/usr/bin/env bash
# SGLang 0.5.17 for the GPU machine (run_h200_sglang.sh): the wheels that SGLang's offline Engine imports on one GPU
# and the device image lacks (or holds at another version), as one tar archive split into parts of at most PART_MIB
# MiB (default 50), each carried by its own device call:
#   .gpu-bundle/sglang-part-NN/sglang-bundle.tar.NN   part NN (00, 01, ...)
#   .gpu-bundle/sglang-part-NN/SHA256SUMS             in every part: the whole archive's sha256 and each part's
# The image already has torch 2.11.0 (SGLang 0.5.17's pin), triton 3.6, numpy, huggingface-hub 1.33, safetensors,
# einops, psutil, requests, aiohttp, anyio, tqdm, pillow, sentencepiece, tiktoken, msgpack, xxhash, uvloop,
# prometheus-client, cuda-bindings (flashinfer.comm), nvidia-ml-py (flashinfer.utils), ninja and nvcc (SGLang's JIT
# kernels): none of those travel. The list was found by importing the Engine's modules (entrypoints.engine, the
# scheduler and tokenizer/detokenizer managers, the model runner and its graph runners, models.llama, the triton
# backend, the sampler, the loaders) under a simulated CUDA with only the image's packages and these wheels
# importable, then reading the function-level imports of every module that loaded. Two wheels are trimmed (files
# removed, RECORD rewritten, names and versions kept):
#   sglang-kernel  keeps sgl_kernel's Python files, sm90/common_ops (what an H100/H200 loads) and spatial_ops; drops
#                  sm100/common_ops (other GPUs), flashmla_ops (MLA) and infllm_ops (InfLLM-V2), loaded only by
#                  those backends, and flash_ops (FlashAttention 3 for SGLang's fa3 backend, 1.1 GB unpacked, 326 MB
#                  of the 383 MB wheel), which travels beside the wheels as fa3/flash_ops.abi3.so.xz (xz -9: about
#                  185 MB; made once, a few minutes, kept in BUNDLE_DIR/sglang-wheels) and is installed into
#                  sgl_kernel/ by run_h200_sglang.sh's install stage; FA3=0 leaves it out (two part calls fewer)
#   xgrammar       drops lib/libxgrammar.a (31 MB compressed), the static library for C++ builds
# Usage: scripts/device/make_sglang_bundle.sh [BUNDLE_DIR]   (default .gpu-bundle, git-ignored; a minute; the wheels
#        are kept in BUNDLE_DIR/sglang-wheels and not downloaded again)
set -euo pipefail
dir=${1:-$(cd "$(dirname "$0")/../.." && pwd)/.gpu-bundle}
part_mib=${PART_MIB:-50}
# name==version                       why (where SGLang imports it; "pin": SGLang 0.5.17's own pin)
wheels=(
  sglang==0.5.17                      # the engine
  sglang-kernel==0.4.5                # pin; sgl_kernel: RMSNorm, fused add-RMSNorm, SiLU-and-mul (trimmed, above)
  flashinfer-python==0.6.15.post1     # pin; layers/sampler.py imports flashinfer.sampling on CUDA (greedy = argmax)
  apache-tvm-ffi==0.1.11              # pin; sglang.kernels.jit builds RoPE and KV-store kernels through it; xgrammar
  transformers==5.12.1                # pin (the image has 5.17.0)
  tokenizers==0.22.2                  # transformers 5.12.1 takes <= 0.23.0 (the image has 0.23.2)
  typing-extensions==4.16.0           # pydantic 2.14 takes >= 4.16
  xgrammar==0.2.1                     # pin; function_call parsers (tokenizer_manager); trimmed, above
  orjson==3.13.0                      # srt/utils/common.py
  pybase64==1.5.1                     # srt/utils/common.py
  starlette==1.10.0                   # srt/utils/common.py, fastapi
  fastapi==0.165.0                    # managers/tokenizer_manager.py, entrypoints/engine_info_bootstrap_server.py
  opentelemetry-api==1.45.2           # fastapi/telemetry
  uvicorn==0.54.0                     # entrypoints/engine_info_bootstrap_server.py
  ipython==9.18.1                     # sglang/utils.py (IPython.display)
  traitlets==5.16.1                   # IPython
  pydantic==2.14.4                    # sglang/utils.py, managers/io_struct.py, entrypoints/openai/protocol.py
  pydantic-core==2.50.5               # pydantic
  typing-inspection==0.4.5            # pydantic
  annotated-types==0.8.0              # pydantic
  pyzmq==27.3.0                       # entrypoints/engine.py: the engine <-> scheduler sockets
  dill==0.4.1                         # sampling/custom_logit_processor.py
  msgspec==0.23.0                     # sglang/kernels/fused_op.py
  openai==2.6.1                       # pin; entrypoints/openai/protocol.py
  distro==1.9.0                       # openai
  jiter==0.19.0                       # openai
  sniffio==1.3.1                      # openai
  partial-json-parser==0.2.1.1.post7  # function_call/base_format_detector.py
  compressed-tensors==0.20.1          # layers/quantization (imported at start-up whatever the model)
  loguru==0.7.3                       # compressed-tensors
  gguf==0.19.0                        # layers/quantization/gguf.py
  setproctitle==1.3.8                 # managers/scheduler.py, managers/data_parallel_controller.py
  sgl-deep-gemm==0.1.5.post1          # pin; the speculative workers' graph capture imports dsa_backend, which
                                      # imports deep_gemm on CUDA (eagle_worker_v2.py)
)
plats=()
for n in 1 2014 _2_17 _2_24 _2_26 _2_27 _2_28 _2_31 _2_34; do plats+=(--platform "manylinux${n}_x86_64"); done
mkdir -p "$dir/sglang-wheels"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plats[@]}" \
  -d "$dir/sglang-wheels" "${wheels[@]}"

work=$(mktemp -d "${TMPDIR:-/tmp}/sglang_bundle.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir "$work/wheels"
for spec in "${wheels[@]}"; do  # exactly the listed versions, even where the cache holds others
  name=${spec%%==*} version=${spec#*==}
  found=$(find "$dir/sglang-wheels" -maxdepth 1 -iname "${name//-/_}-${version}-*.whl")
  [[ -n $found && $(wc -l <<<"$found") == 1 ]] || { echo "no single wheel for $spec in $dir/sglang-wheels" >&2
    exit 1; }
  cp "$found" "$work/wheels/"
done
python3 - "$work/wheels" <<'PY'
"""Repack two wheels without the members named below (their RECORD lines too)."""
import pathlib
import re
import sys
import zipfile

DROP = {
    "sglang_kernel-": r"sgl_kernel/(flash_ops\.abi3\.so|sm100/.*|flashmla_ops\.abi3\.so|infllm_ops\..*\.so)",
    "xgrammar-": r"xgrammar/lib/libxgrammar\.a",
}
for prefix, pattern in DROP.items():
    (path,) = pathlib.Path(sys.argv[1]).glob(prefix + "*.whl")
    drop = re.compile(pattern)
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        gone = [i.filename for i in src.infolist() if drop.fullmatch(i.filename)]
        assert gone, f"{path.name}: nothing matches {pattern}"
        for info in src.infolist():
            if info.filename in gone:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True)
                                if line.split(b",", 1)[0].decode() not in gone)
            dst.writestr(info, data)
    tmp.replace(path)
    print(f"{path.name}: dropped {', '.join(gone)}")
PY

members=(wheels)
if [[ ${FA3:-1} == 1 ]]; then  # SGLang's fa3 backend: the FlashAttention-3 extension dropped from the wheel above
  fa3=$dir/sglang-wheels/flash_ops.abi3.so.xz
  if ! test -f "$fa3"; then
    kernel=$(find "$dir/sglang-wheels" -maxdepth 1 -name 'sglang_kernel-0.4.5-*.whl')
    unzip -p "$kernel" sgl_kernel/flash_ops.abi3.so | xz -9 -T0 >"$fa3.partial" && mv "$fa3.partial" "$fa3"
  fi
  mkdir -p "$work/fa3" && cp "$fa3" "$work/fa3/" && members+=(fa3)
fi
tar cf "$work/sglang-bundle.tar" -C "$work" "${members[@]}"
rm -rf "$dir"/sglang-part-*
(cd "$work" && split -b "${part_mib}M" -d -a 2 sglang-bundle.tar sglang-bundle.tar. \
  && sha256sum sglang-bundle.tar sglang-bundle.tar.[0-9][0-9] >SHA256SUMS)
parts=0
for part in "$work"/sglang-bundle.tar.[0-9][0-9]; do
  nn=${part##*.}
  mkdir -p "$dir/sglang-part-$nn"
  mv "$part" "$dir/sglang-part-$nn/"
  cp "$work/SHA256SUMS" "$dir/sglang-part-$nn/"
  parts=$((parts + 1))
done
find "$work/wheels" -name '*.whl' -printf '%10s  %f\n' | sort -k2
du -sh "$dir"/sglang-part-*
total=$(stat -c %s "$work/sglang-bundle.tar")
echo "bundle: $(numfmt --to=iec-i --suffix=B "$total") in $parts parts of <= ${part_mib} MiB:" \
  "$parts device calls ($((parts - 1)) x run_h200_sglang.sh part, then install carrying the last part)," \
  "then one bench call"
