"""Speculative decoding under DCP in SGLang, attention by dcp-triton: an offline ``sglang.Engine`` with
--tp-size --tp and --dcp-size --dcp, the target's verify steps over the sharded KV cache, the draft at DCP = 1.

Prints the `dcp-triton plan --engine sglang` table of the model at --tp (KV heads per rank, what each DCP size buys,
a hybrid model's full-attention layers, the MTP draft's own cache), then generates greedily and prints each
completion with its tokens per verify step. Without --model it builds (once, in ~/.cache/dcp-triton) a
random-initialised Llama with 16 Q heads and --kv-heads KV heads (default tp / dcp) and no tokenizer, which
drafts for itself (STANDALONE); prompts then go in as their UTF-8 bytes, one token id each.

    python examples/sglang_generate.py --plan-only --tp 4 --dcp 4        # no GPU needed
    python examples/sglang_generate.py --tp 1 --dcp 1                    # one GPU
    python examples/sglang_generate.py --model /path/to/qwen3.5-checkpoint --tp 4 --dcp 4 --speculative-algorithm NEXTN
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path

import _shared  # this script's folder is first on the path: python examples/NAME.py

ALGORITHMS = ("STANDALONE", "EAGLE", "EAGLE3", "NEXTN", "NGRAM", "none")
PROMPTS = ["The capital of France is", "Decode context parallelism shards the KV cache along tokens, so"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a Hugging Face checkpoint directory (default: a random Llama)")
    p.add_argument("--kv-heads", type=int, help="KV heads of the default random Llama (default: tp / dcp)")
    p.add_argument("--prompt", action="append", dest="prompts", metavar="TEXT",
                   help=f"a prompt; repeat for several (default: {PROMPTS})")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size = GPUs used (default 1)")
    p.add_argument("--dcp", type=int, default=1, help="decode-context-parallel size, divides --tp (default 1)")
    spec = p.add_argument_group("speculative decoding (SGLang's --speculative-* options)")
    spec.add_argument("--speculative-algorithm", choices=ALGORITHMS, default="STANDALONE",
                      help="default STANDALONE: --draft-model drafts (default: the model itself); NEXTN: the "
                           "checkpoint's MTP layers; EAGLE/EAGLE3: an EAGLE head as --draft-model; NGRAM: no draft "
                           "model; none: plain decoding")
    spec.add_argument("--draft-model", type=Path, help="the draft checkpoint (STANDALONE, EAGLE, EAGLE3)")
    spec.add_argument("--num-steps", type=int, default=3, help="draft steps per verify step (default 3; not NGRAM)")
    spec.add_argument("--topk", type=int, default=1, help="candidates per draft step: 1 drafts a chain, more a tree "
                                                          "(default 1; not NGRAM)")
    spec.add_argument("--draft-tokens", type=int, default=4, help="draft tokens verified per step (default 4)")
    p.add_argument("--plan-only", action="store_true", help="print the plan table and exit (no GPU needed)")
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One line naming the flag and what works, before any model or engine is built."""
    _shared.check_sizes(parser, args, ("max_tokens", "tp", "dcp", "kv_heads", "num_steps", "topk", "draft_tokens"))
    if args.model is not None and args.kv_heads is not None:
        parser.error("--kv-heads shapes the default random model; it cannot be combined with --model")
    _shared.check_checkpoint(parser, "--model", args.model)
    _shared.check_checkpoint(parser, "--draft-model", args.draft_model)
    algorithm = args.speculative_algorithm
    if args.draft_model is not None and algorithm in ("NEXTN", "NGRAM", "none"):
        parser.error(f"--draft-model: --speculative-algorithm {algorithm} takes no draft model; use STANDALONE, "
                     "EAGLE or EAGLE3 with it")
    if args.draft_model is None and algorithm in ("EAGLE", "EAGLE3"):
        parser.error(f"--speculative-algorithm {algorithm} needs --draft-model (an EAGLE head trained for --model)")


def print_plan(parser: argparse.ArgumentParser, model: Path, args: argparse.Namespace) -> None:
    """`dcp-triton plan --engine sglang` of the model; its refusal as this script's one error line."""
    from dcp_plugin import cli

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            cli.main(["plan", "--config", str(model), "--tp", str(args.tp), "--dcp", str(args.dcp),
                      "--engine", "sglang", *(["--dtype", "bfloat16"] if args.model is None else [])])
    except SystemExit:
        parser.error(err.getvalue().strip().splitlines()[-1].split(": error: ", 1)[-1])
    print()


def engine_kwargs(model: Path, args: argparse.Namespace) -> dict:
    """``sglang.Engine(**kwargs)``: dcp-triton's backend, the topology, the speculative options."""
    tokenizer = any((model / name).is_file() for name in ("tokenizer.json", "tokenizer.model"))
    kwargs = dict(model_path=str(model), attention_backend="dcp-triton", tp_size=args.tp, random_seed=0,
                  skip_tokenizer_init=not tokenizer, context_length=4096, mem_fraction_static=0.8, log_level="warning")
    if args.model is None:
        kwargs["dtype"] = "bfloat16"  # the random Llama is saved in float32
    if args.dcp > 1:
        kwargs["dcp_size"] = args.dcp
    if args.speculative_algorithm != "none":
        kwargs.update(speculative_algorithm=args.speculative_algorithm, speculative_num_draft_tokens=args.draft_tokens)
    if args.speculative_algorithm not in ("none", "NGRAM"):  # n-gram trees take their own options (SGLang's defaults)
        kwargs.update(speculative_num_steps=args.num_steps, speculative_eagle_topk=args.topk)
        draft = args.draft_model or (model if args.speculative_algorithm == "STANDALONE" else None)
        if draft is not None:
            kwargs["speculative_draft_model_path"] = str(draft)
    return kwargs


def generate(model: Path, args: argparse.Namespace) -> int:
    import sglang

    kwargs = engine_kwargs(model, args)
    texts = args.prompts or PROMPTS
    engine = sglang.Engine(**kwargs)
    try:
        info = engine.get_server_info()
        print(f"SGLang: attention_backend={info.get('attention_backend')} tp_size={info.get('tp_size')} "
              f"dcp_size={info.get('dcp_size', 1)} speculative_algorithm={info.get('speculative_algorithm')}")
        params = dict(max_new_tokens=args.max_tokens, temperature=0.0)
        if kwargs["skip_tokenizer_init"]:
            outs = engine.generate(input_ids=[list(text.encode()) for text in texts], sampling_params=params)
        else:
            outs = engine.generate(prompt=texts, sampling_params=params)
    finally:
        engine.shutdown()
    for text, out in zip(texts, outs):
        steps = out["meta_info"].get("spec_verify_ct") or 0
        completion = out["output_ids"] if kwargs["skip_tokenizer_init"] else out["text"]
        per_step = f", {out['meta_info']['completion_tokens'] / steps:.2f} tokens per verify step" if steps else ""
        print(f"prompt: {text!r}\ncompletion: {completion!r}{per_step}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    if not args.plan_only:
        import torch

        gpus = torch.cuda.device_count()
        if gpus < args.tp:
            print(f"sglang_generate: --tp {args.tp} needs {args.tp} CUDA GPU{'s' * (args.tp > 1)}; "
                  f"this machine has {gpus}: use "
                  f"{f'--tp <= {gpus}, ' if gpus else ''}--plan-only to see the plan", file=sys.stderr)
            return 2
    model = args.model
    if model is None:
        from dcp_plugin.models.embedded import random_llama_checkpoint

        model = random_llama_checkpoint(num_kv_heads=args.kv_heads or max(1, args.tp // args.dcp))
    print_plan(parser, model, args)
    return 0 if args.plan_only else generate(model, args)


if __name__ == "__main__":
    sys.exit(main())
