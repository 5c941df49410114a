"""CPU check that vLLM 0.26's OpenAI server finds every module it needs, short of starting an engine.

What the H200 runs for benchmarks/server/server_aborts.py, up to the engine: the CLI parse of that script's server
flags, the socket, ``build_app`` with the generate routers (and the SageMaker bootstrap), uvicorn's protocol load, the
lazily imported generate/scale-out state modules; then every module under the server's packages is imported and the
missing ones listed (information: optional tool/reasoning parsers and the gRPC server miss theirs on the H200 too).
Exits 1 if a step on the server's path fails.

Run it in a throwaway environment that holds what the H200 will hold and nothing else: the image's packages (a CPU
torch stands in for CUDA torch; vLLM's CPU platform class stands in for CUDA, set below), vLLM 0.26's Python files
(.gpu-bundle/core/vllm026.tar.xz unpacked), the wheels of .gpu-bundle/extra and .gpu-bundle/server (for this
interpreter's version where a wheel is binary), e.g.

    PYTHONPATH=/tmp/sv/vs:/tmp/sv/site:/tmp/sv/srv /tmp/sv/venv/bin/python scripts/device/server_import_check.py
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform

platforms._current_platform = CpuPlatform()  # no GPU here: the check stops short of the engine

SERVER_FLAGS = ("--model /tmp/m --port 0 --host 127.0.0.1 --served-model-name m --dtype float32 --attention-backend "
                "dcp-triton --seed 0 --max-model-len 2048 --block-size 16 --max-num-seqs 64 --max-num-batched-tokens "
                "256 --long-prefill-token-threshold 32 --kv-cache-memory-bytes 1073741824 --enable-prefix-caching "
                "--enable-prompt-tokens-details --enable-log-requests --max-log-len 0 -tp 1 -dcp 1 "
                "--skip-tokenizer-init")
PACKAGES = ("vllm.entrypoints", "vllm.v1.engine", "vllm.v1.metrics", "vllm.tracing", "vllm.renderers",
            "vllm.tool_parsers", "vllm.reasoning", "vllm.parser")


def server_path() -> None:
    import uvicorn

    import vllm.entrypoints.openai.api_server as api
    from vllm.entrypoints.generate.api_router import init_generate_state  # noqa: F401
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.scale_out.factories import init_scale_out_state  # noqa: F401
    from vllm.entrypoints.serve.utils.server_utils import get_uvicorn_log_config
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(SERVER_FLAGS.split())
    validate_parsed_serve_args(args)
    address, sock = api.setup_server(args, reuse_port=False)
    app = api.build_app(args, ("generate",), None)
    config = uvicorn.Config(app, log_config=get_uvicorn_log_config(args), log_level=args.uvicorn_log_level)
    config.load()
    sock.close()
    print(f"server path ok: {address}, {len(app.routes)} routes, HTTP {config.http_protocol_class.__name__}")


def missing_modules() -> dict[str, list[str]]:
    missing: dict[str, list[str]] = {}
    for name in PACKAGES:
        package = importlib.import_module(name)
        for info in pkgutil.walk_packages(package.__path__, name + "."):
            try:
                importlib.import_module(info.name)
            except ModuleNotFoundError as e:
                missing.setdefault(str(e.name), []).append(info.name)
            except Exception as e:  # noqa: BLE001  (an optional dependency's own ImportError message)
                missing.setdefault(f"<{type(e).__name__}: {str(e)[:80]}>", []).append(info.name)
    return missing


def main() -> None:
    try:
        server_path()
    except Exception as e:  # noqa: BLE001
        print(f"SERVER PATH FAILED: {type(e).__name__}: {e}")
        sys.exit(1)
    for name, modules in sorted(missing_modules().items()):
        print(f"not importable (optional): {name} <- {', '.join(modules[:3])}")


if __name__ == "__main__":
    main()
