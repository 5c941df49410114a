"""Greedy generation with vLLM on CPU, one engine per attention backend, results as JSON (used by test_vllm_e2e).

    python tests/integration/vllm_generate.py MODEL_DIR OUT.json --backends CPU_ATTN,dcp-triton [--kernels triton]
        [--scenarios batch,chunked,prefix] [--speculative-config '{"method": "ngram", ...}'] [--cpu N]
        [--dtype bfloat16] [--no-prefix-caching]

Per backend, one engine (enforce_eager, float32 unless --dtype, prefix caching on unless --no-prefix-caching,
max_num_batched_tokens=64) runs the scenarios
in order (default the first three): ``batch`` (4 prompts of 5..130 tokens, 16 tokens each, prefill and decode
mixed across steps), ``chunked`` (one 300-token prompt: 5 prefill chunks, each attending to the cached earlier
chunks), ``prefix`` (two prompts sharing 3 blocks + 5 tokens, the second served from the prefix cache) and
``repeats`` (4 prompts repeating a random unit, one of 155 tokens prefilled in 3 chunks, 32 tokens each).
``--speculative-config`` (JSON) is vLLM's ``speculative_config`` for every engine; the result then also holds
vLLM's speculative-decoding counters (``spec_decode``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

MAX_BATCHED_TOKENS = 64


def prompts(block_size: int, vocab: int) -> dict[str, list[list[int]]]:
    import torch

    gen = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    shared = ids(3 * block_size + 5)
    return {
        "batch": [ids(n) for n in (5, 17, 40, 130)],
        "chunked": [ids(300)],
        "prefix": [shared + ids(7), shared + ids(11)],
        "repeats": repeat_prompts(vocab),
    }


def repeat_prompts(vocab: int) -> list[list[int]]:
    """Prompts repeating a random unit of token ids (where n-gram speculation finds its proposals), each ending
    halfway through the unit; the last is long enough to take three prefill chunks."""
    import torch

    gen = torch.Generator().manual_seed(2)
    made = []
    for unit_len, times in ((4, 6), (7, 4), (12, 3), (10, 15)):
        unit = torch.randint(3, vocab, (unit_len,), generator=gen).tolist()
        made.append(unit * times + unit[:unit_len // 2])
    return made


def spec_decode_counters(llm) -> dict:
    """vLLM's speculative-decoding counters of the engine so far (drafts, draft tokens, accepted tokens, accepted
    tokens per draft position)."""
    return {m.name: getattr(m, "values", None) or getattr(m, "value", None) for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode")}


def run_backend(args, backend: str) -> dict:
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    extra = {}
    if args.speculative_config:  # the counters need vLLM's stats on
        extra = dict(speculative_config=json.loads(args.speculative_config), disable_log_stats=False)
    llm = LLM(
        model=args.model, skip_tokenizer_init=True, enforce_eager=True, dtype=args.dtype, seed=0,
        max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=MAX_BATCHED_TOKENS, enable_prefix_caching=not args.no_prefix_caching,
        block_size=args.block_size, kv_cache_memory_bytes=128 << 20, attention_backend=backend, **extra,
    )
    init_s = time.perf_counter() - started
    config = llm.llm_engine.vllm_config
    block_size, vocab = config.cache_config.block_size, config.model_config.get_vocab_size()
    work = prompts(block_size, vocab)
    result = {"block_size": block_size, "init_s": round(init_s, 1)}
    for name in args.scenarios.split(","):
        token_lists = work[name]
        max_tokens = {"batch": 16, "repeats": 32}.get(name, 8)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        started = time.perf_counter()
        if name == "prefix":  # one after the other: the second request must find the first one's blocks cached
            outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in token_lists]
        else:
            outs = llm.generate([{"prompt_token_ids": p} for p in token_lists], params, use_tqdm=False)
        result[name] = [list(o.outputs[0].token_ids) for o in outs]
        result[f"{name}_cached_tokens"] = [o.num_cached_tokens or 0 for o in outs]
        result[f"{name}_s"] = round(time.perf_counter() - started, 1)
    if args.speculative_config:
        result["spec_decode"] = spec_decode_counters(llm)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--backends", default="CPU_ATTN,dcp-triton")
    parser.add_argument("--kernels", choices=("triton", "reference"), default="triton")
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--dtype", default="float32", help="the model dtype (vLLM's CPU GDN layers take bfloat16 "
                        "only)")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--scenarios", default="batch,chunked,prefix", help="comma-separated, in run order; also: "
                        "repeats")
    parser.add_argument("--speculative-config", default=None, help="vLLM's speculative_config as JSON")
    parser.add_argument("--cpu", type=int, default=None, help="run on this one CPU (the engine's processes inherit "
                        "it): for engines run side by side, see tests.helpers.vllm_checks.cpu_args")
    args = parser.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    os.environ["DCP_TRITON_KERNELS"] = args.kernels  # inherited by the spawned engine-core and worker processes
    results = {backend: run_backend(args, backend) for backend in args.backends.split(",")}
    with open(args.out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
