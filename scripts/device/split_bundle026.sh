#!/usr/bin/env bash
# Splits the vLLM 0.26 bundle's core archive (.gpu-bundle/core/vllm026.tar.xz, 58 MiB: vLLM's Python files and its
# stable-ABI extension, from the 0.26 wheel; the workplace's offline-vLLM bundle script makes it) in two, because
# the repository no longer fits beside it in one device call (64 MiB with the working tree, which is ~12 MiB now):
#   .gpu-bundle/core-part/vllm026.tar.xz.00   the first PART_MIB MiB (default 44): the `unpack` call of
#                                             run_h200.sh or run_2xh200.sh keeps it in /tmp
#   .gpu-bundle/core-rest/vllm026.tar.xz.01   the rest (~14 MiB) and SHA256SUMS of the whole archive: the next call
#                                             that carries it (run_h200.sh's `bench` beside .gpu-bundle/extra;
#                                             run_2xh200.sh's `check`, or `e2e` / `spec` beside .gpu-bundle/extra)
#                                             joins, checks and unpacks both (_device.sh: join_core)
# Usage: scripts/device/split_bundle026.sh [BUNDLE_DIR]   (default .gpu-bundle; seconds)
set -euo pipefail
dir=${1:-$(cd "$(dirname "$0")/../.." && pwd)/.gpu-bundle}
src=$dir/core/vllm026.tar.xz
part=$((${PART_MIB:-44} << 20))
test -f "$src" || { echo "no $src: build the vLLM 0.26 bundle into $dir first" >&2; exit 1; }
mkdir -p "$dir/core-part" "$dir/core-rest"
head -c "$part" "$src" >"$dir/core-part/vllm026.tar.xz.00"
tail -c +$((part + 1)) "$src" >"$dir/core-rest/vllm026.tar.xz.01"
(cd "$dir/core" && sha256sum vllm026.tar.xz) >"$dir/core-rest/SHA256SUMS"
joined=$(cat "$dir/core-part/vllm026.tar.xz.00" "$dir/core-rest/vllm026.tar.xz.01" | sha256sum | cut -d' ' -f1)
[[ $joined == "$(cut -d' ' -f1 "$dir/core-rest/SHA256SUMS")" ]] || { echo "the parts do not join to $src" >&2; exit 1; }
du -sh "$dir/core-part" "$dir/core-rest"
