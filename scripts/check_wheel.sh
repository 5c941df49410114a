#!/usr/bin/env bash
# Build dcp-triton's sdist and wheel (`python -m build`, as a release would) and check their metadata renders on
# PyPI (`twine check --strict`), then install the wheel (not editable) into a fresh venv with its declared
# dependencies (torch linked from .venv, every other one installed by pip), and check what an installed copy must
# provide: the vllm.general_plugins entry point dcp_triton -> dcp_plugin.adapters.vllm:register (which, with no vLLM
# installed there, logs one warning and registers nothing) and the `dcp-triton plan` command.
# Run from the repository root once .venv has torch (`make check-wheel`; a venv of its own builds, .venv's pip
# installs into the fresh venv). The wheel is built from a copy of the checkout's tracked files, so nothing here is
# written to (an editable install of .venv may be building beside it, .ci/run does that) and no build folder leaks
# into the wheel.
set -euo pipefail
py=$PWD/.venv/bin/python
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

mkdir "$tmp/src"
# The tracked files only, listed by git: archiving "." itself failed CI once ("tar: .: file changed as we read
# it") while .ci/run's parallel installs created folders beside it. Without git, the tree minus what builds make.
if git rev-parse --git-dir >/dev/null 2>&1; then
  git ls-files -z | tar --null -T - -cf -
else
  tar -cf - --exclude=./.git --exclude='./.venv*' --exclude=./.cache --exclude=./build --exclude=./dist \
    --exclude='*.egg-info' --exclude=__pycache__ .
fi | tar -xf - -C "$tmp/src"
"$py" -m venv "$tmp/tools"
"$tmp/tools/bin/python" -m pip install -q build==1.6.1 twine==7.0.0
"$tmp/tools/bin/python" -m build --sdist --wheel --outdir "$tmp/dist" "$tmp/src" > "$tmp/build.log" 2>&1 ||
    { cat "$tmp/build.log"; echo "check_wheel: python -m build failed"; exit 1; }
"$tmp/tools/bin/python" -m twine check --strict "$tmp"/dist/*
wheel=$(echo "$tmp"/dist/dcp_triton-*.whl)
"$py" -m venv --without-pip "$tmp/venv"
venv_py=$tmp/venv/bin/python
# .venv's CPU torch, and nothing else of .venv, is reachable from the venv: a folder of links to torch's top-level
# entries (its dist-info included, so pip counts torch as installed) on the venv's path. Installing torch afresh
# unpacks 1.9 GB; every other dependency, declared or not, must come from installing the wheel.
"$py" - "$tmp/torch" <<'PY'
import sys
from importlib import metadata
from pathlib import Path

dist = metadata.distribution("torch")
links = Path(sys.argv[1])
links.mkdir()
for top in sorted({f.parts[0] for f in dist.files if f.parts[0] != ".."}):
    (links / top).symlink_to(dist.locate_file(top))
PY
echo "$tmp/torch" > "$("$venv_py" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/torch_from_dotvenv.pth"
"$py" -m pip --python "$venv_py" install -q "$wheel"

cd "$tmp"  # nothing of the repository on the path: -I drops the current folder and PYTHON* variables too
"$venv_py" -I - <<'PY'
import logging
import sysconfig
from importlib import metadata

import dcp_plugin
import dcp_plugin.adapters.vllm.compat
import dcp_plugin.kernels
import dcp_plugin.adapters.vllm

site = sysconfig.get_path("purelib")
for module in (dcp_plugin, dcp_plugin.adapters.vllm.compat, dcp_plugin.kernels):
    assert module.__file__.startswith(site), f"{module.__name__} imported from {module.__file__}, not from {site}"
(point,) = [p for p in metadata.entry_points(group="vllm.general_plugins") if p.name == "dcp_triton"]
assert point.value == "dcp_plugin.adapters.vllm:register", point.value
assert point.load() is dcp_plugin.adapters.vllm.register

records = []
handler = logging.Handler()
handler.emit = records.append
dcp_plugin.adapters.vllm.logger.addHandler(handler)
point.load()()  # no vLLM in this venv: one warning, no exception
assert len(records) == 1 and records[0].getMessage().startswith("dcp-triton: no vLLM is installed"), records
print(f"check_wheel: entry point {point.name} = {point.value}, dcp_plugin from {site}")

import dcp_plugin.adapters.sglang as sglang_plugin

(point,) = [p for p in metadata.entry_points(group="sglang.srt.plugins") if p.name == "dcp_triton"]
assert point.load() is sglang_plugin.register, point.value
records.clear()
sglang_plugin.logger.addHandler(handler)
point.load()()  # no SGLang in this venv: one warning, no exception
assert len(records) == 1 and records[0].getMessage().startswith("dcp-triton: no SGLang is installed"), records
print(f"check_wheel: entry point sglang.srt.plugins {point.name} = {point.value}")
PY
echo '{"num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "num_hidden_layers": 4}' > config.json
"$tmp/venv/bin/dcp-triton" plan --config config.json --tp 8 --dcp 4 --kv-budget-gib 40 > plan.txt
grep -q "^legend:" plan.txt || { cat plan.txt; echo "check_wheel: dcp-triton plan printed no comparison"; exit 1; }
echo "check_wheel: $(basename "$wheel") installs; dcp-triton plan runs"
