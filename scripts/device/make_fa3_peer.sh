#!/usr/bin/env bash
# FlashAttention-3 as vLLM 0.26 ships it, alone, for kernel benchmarks on the GPU machine in ONE device call: vLLM's
# whole core archive (58 MiB) does not fit beside the repository, this does (~11 MiB). It holds vLLM's
# vllm/vllm_flash_attn Python files and its FA3 extension (_vllm_fa3_C.abi3.so, from the vLLM bundle's fa3.tar.xz)
# under a stand-in `vllm` package whose only module, vllm.platforms, answers the two capability questions FA3's
# interface asks (compute capability 9.x). benchmarks/kernels/kernel_peers.py imports FA3 from it unchanged; vLLM's own
# Triton kernels are not in it (those peers need the full bundle and run_h200.sh's unpack/bench calls).
# Usage: scripts/device/make_fa3_peer.sh [BUNDLE_DIR]   (default .gpu-bundle: reads core/vllm026.tar.xz and
#        extra/fa3.tar.xz, writes fa3peer/fa3peer.tar.xz); on the device: tar xJf .gpu-bundle/fa3peer/fa3peer.tar.xz
#        -C /tmp/fa3peer and put /tmp/fa3peer on PYTHONPATH.
set -euo pipefail
dir=${1:-$(cd "$(dirname "$0")/../.." && pwd)/.gpu-bundle}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar xJf "$dir/core/vllm026.tar.xz" -C "$work" vllm/vllm_flash_attn/__init__.py vllm/vllm_flash_attn/flash_attn_interface.py
tar xJf "$dir/extra/fa3.tar.xz" -C "$work"
mkdir -p "$work/vllm/platforms"
echo '"""Stand-in vLLM package: FlashAttention-3 alone (scripts/device/make_fa3_peer.sh)."""' >"$work/vllm/__init__.py"
cat >"$work/vllm/platforms/__init__.py" <<'PY'
"""The two capability questions vllm.vllm_flash_attn asks of vLLM's platform, answered from torch."""
import torch


class _Platform:
    @staticmethod
    def has_device_capability(capability: int) -> bool:
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor >= capability

    @staticmethod
    def is_device_capability_family(capability: int) -> bool:
        return torch.cuda.get_device_capability()[0] == capability // 10


current_platform = _Platform()
PY
mkdir -p "$dir/fa3peer"
(cd "$work" && tar cf - vllm | xz -T0 -6 >"$dir/fa3peer/fa3peer.tar.xz")
du -sh "$dir/fa3peer"
