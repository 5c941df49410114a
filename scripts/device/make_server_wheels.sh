#!/usr/bin/env bash
# The wheels vLLM 0.26's OpenAI server (python -m vllm.entrypoints.openai.api_server) imports beyond what the offline
# bundle's extra/ part and the H200 image hold (the device image lists its packages):
#   uvicorn                            vllm/entrypoints/launcher.py (HTTP over h11, which the image has)
#   watchfiles                         vllm/entrypoints/serve/utils/ssl.py (imported by the launcher)
#   model-hosting-container-standards  vllm/entrypoints/serve/sagemaker/api_router.py (imported by api_server.py)
#   jmespath                           needed by model-hosting-container-standards
#   prometheus-fastapi-instrumentator  /metrics (vLLM's metrics router)
#   python-multipart                   FastAPI form/file routes
# The image has click, h11, anyio, httpx, uvloop, prometheus-client, pyyaml. httptools and websockets are left out
# (uvicorn then serves HTTP with h11, the protocol vLLM sets its header limits for, and no websocket routes).
# Checked on CPU with server_import_check.py (its docstring says how).
# Usage: scripts/device/make_server_wheels.sh [OUTDIR]   (default .gpu-bundle/server, git-ignored; ~0.6 MB, seconds)
# On the H200: carry it beside .gpu-bundle/extra in run_h200.sh's bench call; the stage installs it.
set -euo pipefail
out=${1:-$(cd "$(dirname "$0")/../.." && pwd)/.gpu-bundle/server}
mkdir -p "$out"
plats=()
for n in 1 2014 _2_17 _2_24 _2_26 _2_27 _2_28 _2_31; do plats+=(--platform "manylinux${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plats[@]}" \
  -d "$out" uvicorn==0.54.0 watchfiles==1.3.0 model-hosting-container-standards==0.1.16 jmespath==1.1.0 \
  prometheus-fastapi-instrumentator==8.1.0 python-multipart==0.0.34
du -sh "$out"
ls "$out"
