"""What the example scripts share: vLLM's process environment, the engine arguments, the report of the attention
backend each worker actually built, and a timed greedy run."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

KERNEL_ENV = "DCP_TRITON_KERNELS"  # read by the vLLM adapter in every worker: "triton" or "reference"
CPU_KV_CACHE_BYTES = 256 << 20  # SmolLM2 in float32 stores 46 KiB per token: ~5,800 tokens
GPU_KV_CACHE_BYTES = 4 << 30


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def add_engine_args(parser: argparse.ArgumentParser, *, prompts: list[str], max_tokens: int | None,
                    max_tokens_help: str, tp: int, tp_help: str, dcp: int, kernels_help: str) -> None:
    """--prompt, --max-tokens, --tp, --dcp, --interleave and --kernels, in that order (each script adds its own
    --model first: its help differs); the defaults and help that differ between the scripts are arguments."""
    parser.add_argument("--prompt", action="append", dest="prompts", metavar="TEXT",
                        help=f"a prompt; repeat for several (default: {prompts})")
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help=max_tokens_help)
    parser.add_argument("--tp", type=int, default=tp, help=tp_help)
    parser.add_argument("--dcp", type=int, default=dcp,
                        help=f"decode-context-parallel size, divides --tp (default {dcp})")
    parser.add_argument("--interleave", type=int, default=1,
                        help="DCP KV-cache interleave size in tokens (default 1)")
    parser.add_argument("--kernels", choices=("triton", "reference"), help=kernels_help)


def check_engine_args(parser: argparse.ArgumentParser, args: argparse.Namespace, *,
                      sizes: tuple[str, ...] = ()) -> None:
    """Refuse (argparse's exit 2) a size below 1, the script's own ``sizes`` first, and a --model directory
    without a config.json, before any engine is built."""
    for name in (*sizes, "max_tokens", "tp", "dcp", "interleave"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there; give a Hugging Face checkpoint directory")


def set_env_defaults(*, tp: int, gpu: bool, kernels: str | None) -> None:
    """Environment for vLLM and its spawned processes (they inherit it); a value the user set wins."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every model here is a local directory
    # Only for the examples' backend report (report_backends): it sends a function to the workers through
    # collective_rpc, which vLLM pickles only with this; the examples' inference itself does not need it.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if kernels is not None:
        os.environ[KERNEL_ENV] = kernels
    if not gpu and tp > 1:  # vLLM's "auto" binding wants one NUMA node per rank
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind_lists(tp))


def cpu_bind_lists(tp: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` value giving each of ``tp`` ranks its own share of this process's cores."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        return "nobind"
    per_rank = len(cpus) // tp
    return "|".join(",".join(map(str, cpus[r * per_rank:(r + 1) * per_rank])) for r in range(tp))


def engine_kwargs(model: Path, *, tp: int, dcp: int, interleave: int, gpu: bool, tokenizer: bool = True) -> dict:
    """Arguments of ``vllm.LLM`` for the dcp-triton backend on this machine."""
    from vllm.engine.arg_utils import EngineArgs

    kwargs = dict(
        model=str(model), attention_backend="dcp-triton", tensor_parallel_size=tp,
        decode_context_parallel_size=dcp, enforce_eager=True, max_model_len=2048, seed=0,
        # CPU: float32, since the Triton interpreter computes bf16 matrix products wrongly. GPU: the checkpoint's
        # dtype, or bf16 for a float32 checkpoint (vLLM's choice).
        dtype="auto" if gpu else "float32",
        kv_cache_memory_bytes=GPU_KV_CACHE_BYTES if gpu else CPU_KV_CACHE_BYTES,
        skip_tokenizer_init=not tokenizer,
    )
    if interleave != 1:
        fields = EngineArgs.__dataclass_fields__
        name = "cp_kv_cache_interleave_size" if "cp_kv_cache_interleave_size" in fields else \
            "dcp_kv_cache_interleave_size"  # the older name
        kwargs[name] = interleave
    return kwargs


def has_tokenizer(model: Path) -> bool:
    return any((model / name).is_file() for name in ("tokenizer.json", "tokenizer.model"))


def as_prompts(texts: list[str], *, tokenizer: bool) -> list:
    """The texts, or for a model without a tokenizer, each text's UTF-8 bytes as token ids."""
    return texts if tokenizer else [{"prompt_token_ids": list(text.encode())} for text in texts]


def _layer_backends(worker) -> dict:
    """Runs inside each worker: backend, impl and kernel path of every attention layer its model runner built."""
    counts: dict[tuple, int] = {}
    for layer in worker.vllm_config.compilation_config.static_forward_context.values():
        backend, impl = getattr(layer, "attn_backend", None), getattr(layer, "impl", None)
        if backend is None or impl is None:
            continue
        key = (backend.get_name(), type(impl).__name__, str(getattr(impl, "kernel_path", "-")),
               int(getattr(impl, "dcp_world_size", 1)))
        counts[key] = counts.get(key, 0) + 1
    return {"rank": int(worker.rank), "layers": [[*key, n] for key, n in counts.items()]}


def report_backends(llm) -> set[str]:
    """Print, per worker, the attention backend its layers use (asked of the workers, not assumed); return the
    set of backend names."""
    names = set()
    for worker in sorted(llm.collective_rpc(_layer_backends), key=lambda w: w["rank"]):
        for backend, impl, kernels, dcp, n in worker["layers"]:
            names.add(backend)
            print(f"attention, rank {worker['rank']}: backend={backend} impl={impl} layers={n} dcp_size={dcp} "
                  f"kernels={kernels}")
    return names


def generate(llm, prompts: list, max_tokens: int) -> None:
    """Greedy-decode ``prompts`` (strings, or ``{"prompt_token_ids": [...]}`` without a tokenizer); print each
    prompt with its completion, then the throughput."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=isinstance(prompts[0], str))
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    for out in outputs:
        completion = out.outputs[0]
        if isinstance(prompts[0], str):
            print(f"prompt: {out.prompt!r}\ncompletion: {completion.text!r}")
        else:
            print(f"prompt token ids: {list(out.prompt_token_ids)}\ncompletion token ids: {list(completion.token_ids)}")
    tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    print(f"generated {tokens} tokens for {len(prompts)} prompts in {elapsed:.1f} s: {tokens / elapsed:.2f} tokens/s "
          "(prefill included)")


def run(model: Path, args, *, prompts: list[str], max_tokens: int, gpu: bool) -> int:
    """Build the engine, report the backend every attention layer runs, generate; 1 if any layer is not ours."""
    import sys

    from vllm import LLM

    tokenizer = has_tokenizer(model)
    llm = LLM(**engine_kwargs(model, tp=args.tp, dcp=args.dcp, interleave=args.interleave, gpu=gpu,
                              tokenizer=tokenizer))
    backends = report_backends(llm)
    generate(llm, as_prompts(prompts, tokenizer=tokenizer), max_tokens)
    if backends != {"DCP_TRITON"}:
        print(f"error: asked for dcp-triton, but the attention layers ran {sorted(backends)}", file=sys.stderr)
        return 1
    return 0
