#!/usr/bin/env bash
# The dcp-triton tree of commit REV, for an A/B on the GPU machine (scripts/device/run_h200.sh ab): its files as
# .gpu-bundle/base/tree.tar.gz (a few MB) and the commit's hash in .gpu-bundle/base/REV. Carry .gpu-bundle/base.
# Usage, from the repository root: bash scripts/device/make_base_tree.sh REV
set -euo pipefail
rev=$(git rev-parse --verify "${1:?usage: make_base_tree.sh REV}^{commit}")
mkdir -p .gpu-bundle/base
git archive --format=tar.gz -o .gpu-bundle/base/tree.tar.gz "$rev" -- . ':(exclude)benchmarks/results'
echo "$rev" > .gpu-bundle/base/REV
ls -l .gpu-bundle/base/tree.tar.gz
