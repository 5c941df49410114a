#!/usr/bin/env bash
# vLLM 0.26's MoE extension (vllm/_moe_C_stable_libtorch.abi3.so, 47 MiB, from the 0.26 wheel) for the GPU machine:
# models with MoE layers (Qwen3-Next, benchmarks/vllm_e2e/vllm_hybrid_gpu.py) need it, and the offline bundle's core
# archive carries only vLLM's main extension. Written to .gpu-bundle/moe/moe.tar.gz (40 MiB: it does not compress),
# which travels alone: `bash scripts/device/run_h200.sh moe` carrying .gpu-bundle/moe keeps it in /tmp, and the next
# bench call of the warm machine unpacks it into /tmp/vs beside vLLM. With it travel compressed-tensors 0.17.0 (vLLM
# 0.26's pin) and its loguru, unpacked from their wheels the same way: vLLM's GDN layer imports them through its AWQ
# MoE path whatever the model (Qwen3-Next fails to load without them), and the offline bundle lacks them.
# Usage: scripts/device/make_moe_ext.sh [BUNDLE_DIR]   (default .gpu-bundle; a minute, most of it the download)
set -euo pipefail
dir=${1:-$(cd "$(dirname "$0")/../.." && pwd)/.gpu-bundle}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$work" vllm==0.26.0 compressed-tensors==0.17.0 loguru==0.7.3
unzip -q "$work"/vllm-0.26.0-*.whl 'vllm/_moe_C_stable_libtorch.abi3.so' -d "$work/x"
unzip -q "$work"/compressed_tensors-0.17.0-*.whl -d "$work/x"
unzip -q "$work"/loguru-0.7.3-*.whl -d "$work/x"
mkdir -p "$dir/moe"
tar cf - -C "$work/x" . | gzip -1 >"$dir/moe/moe.tar.gz"
du -sh "$dir/moe"
