#!/usr/bin/env bash
# Everything the one-GPU device calls carry (scripts/device/run_h200.sh, run_h200_sglang.sh), built into .gpu-bundle
# (git-ignored) on a machine with the package registries: vLLM 0.26's offline bundle (core/ and extra/, made by the
# workplace's offline-vLLM bundle script, whose path is the one argument), split for the unpack and bench calls
# (split_bundle026.sh), vLLM's MoE extension with compressed-tensors (make_moe_ext.sh), and SGLang 0.5.17's parts
# (make_sglang_bundle.sh). About ten minutes on two cores, most of it SGLang's FA3 extension compressed once (kept in
# .gpu-bundle/sglang-wheels for the next time). What is already there is kept: remove a folder to rebuild it.
# Usage: scripts/device/make_all_bundles.sh OFFLINE_VLLM_MAKE_BUNDLE_SH
set -euo pipefail
bundler=${1:?usage: make_all_bundles.sh PATH/TO/offline-vllm/make_bundle.sh}
here=$(cd "$(dirname "$0")" && pwd)
dir=$(cd "$here/../.." && pwd)/.gpu-bundle
test -f "$dir/core/vllm026.tar.xz" && test -d "$dir/extra" || bash "$bundler" "$dir"
test -f "$dir/core-rest/SHA256SUMS" || bash "$here/split_bundle026.sh" "$dir"
test -f "$dir/moe/moe.tar.gz" || bash "$here/make_moe_ext.sh" "$dir"
compgen -G "$dir/sglang-part-*" >/dev/null || bash "$here/make_sglang_bundle.sh" "$dir"
du -sh "$dir"/*/ | grep -v sglang-wheels
