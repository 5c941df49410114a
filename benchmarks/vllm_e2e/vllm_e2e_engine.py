"""One job of ``vllm_gpu_e2e.py`` / ``vllm_dcp_e2e.py`` in its own process: build a random Llama checkpoint, or run
one vLLM engine.

    python -m benchmarks.vllm_e2e.vllm_e2e_engine SPEC.json

``SPEC["kind"]``: ``build`` (the config's model, a Llama by default, with transformers' init, saved in float32) or
``engine`` (one ``vllm.LLM`` with ``SPEC["engine"]`` as its arguments, then ``SPEC["tasks"]`` in order). The result
(gzipped JSON at ``SPEC["out"]``) is rewritten after every task, so a job cut short keeps what it finished.
``SPEC["log"]`` (the runner sets it) is this job's own log, which the engine's workers write too: the KV-cache
capacity vLLM logs at start-up and the JIT compiles its monitor reports are read back from it.
"""

from __future__ import annotations

import gzip
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks import common
from benchmarks.vllm_e2e import e2e_runner as runner
from benchmarks.vllm_e2e import vllm_e2e_report as report


def build(spec: dict) -> None:
    """The job's checkpoint (``common.save_random_model``: float32, atomic; kept when already built): a Llama, or the
    model its config's ``model_type`` names."""
    common.save_random_model({"model_type": "llama", **spec["config"]}, spec["model_dir"], seed=spec.get("seed", 0))


def run_engine(spec: dict) -> None:
    from vllm import LLM

    started = time.perf_counter()
    llm = LLM(**spec["engine"])
    result = {"init_s": round(time.perf_counter() - started, 1), "tasks": {}, "complete": False}
    result.update(_versions())
    if spec.get("log"):
        result["kv_cache_tokens"] = runner.kv_cache_tokens(_read_from(spec["log"], 0)[0])
    save(spec["out"], result)
    for task in spec["tasks"]:
        began = time.perf_counter()
        data = TASKS[task["type"]](llm, {**task, "log": spec.get("log")}, spec["vocab"])
        if task["type"] == "throughput":
            result.setdefault("throughput", []).extend(data)
        else:
            result["tasks"][task["name"]] = {**data, "elapsed_s": round(time.perf_counter() - began, 2)}
        save(spec["out"], result)
    result["complete"] = True
    save(spec["out"], result)
    llm.llm_engine.engine_core.shutdown()


def logprobs_task(llm, task: dict, vocab: int) -> dict:
    """Teacher-forced: the logprob of every prompt token after the first (or of the last ``task["last"]`` ones),
    and the top-1 token there."""
    from vllm import SamplingParams

    prompts = report.make_prompts(vocab=vocab, **task["prompts"])
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    token_lp, top1_ids, top1_lp, firsts = [], [], [], []
    for prompt, out in zip(prompts, outs):
        first = max(1, len(prompt) - task.get("last", len(prompt)))  # [0] is None: nothing predicts token 0
        firsts.append(first)
        positions = out.prompt_logprobs[first:]
        token_lp.append([pos[tok].logprob for tok, pos in zip(prompt[first:], positions)])
        best = [_ranked(pos, 1) for pos in positions]
        top1_ids.append([b[0] for b in best])
        top1_lp.append([b[1] for b in best])
    return {"prompt_lens": [len(p) for p in prompts], "first_positions": firsts, "token_logprobs": token_lp,
            "top1_ids": top1_ids, "top1_logprobs": top1_lp}


def greedy_task(llm, task: dict, vocab: int) -> dict:
    """Greedy tokens with the top-2 logprobs of every step (to tell near ties from real disagreements)."""
    prompts = report.make_prompts(vocab=vocab, **task["prompts"])
    return {"prompt_lens": [len(p) for p in prompts], **_greedy(llm, prompts, task["max_tokens"], 2)}


def prefix_task(llm, task: dict, vocab: int) -> dict:
    """One prompt alone (fills the prefix cache), then prompts sharing its prefix in one batch (read it)."""
    prompts = report.make_prefix_prompts(vocab=vocab, **task["prompts"])
    first = _greedy(llm, prompts[:1], task["max_tokens"], 5)
    rest = _greedy(llm, prompts[1:], task["max_tokens"], 5)
    return {"prompt_lens": [len(p) for p in prompts], **{k: first[k] + rest[k] for k in first}}


def throughput_task(llm, task: dict, vocab: int) -> list[dict]:
    """Output tokens per second of each workload, after a warm-up with other prompts of the same shapes (so the
    prefix cache holds nothing the timed run can reuse). Warm-up ``all`` (default): every request, 8 output tokens,
    which compiles whatever each backend compiles per shape (steady state). ``quarter``: a quarter of the requests
    with the full output length, so compiles at larger batches fall inside the timed run (serving as it starts);
    the warm-up's own time is recorded either way. TTFT / TPOT medians when vLLM attached request metrics."""
    from vllm import SamplingParams

    quarter = task.get("warmup", "all") == "quarter"
    rows = []
    for w in task["workloads"]:
        shape = dict(min_len=w["prompt_len"], max_len=w["prompt_len"], vocab=vocab)
        prompts = report.make_prompts(count=w["requests"], seed=11, **shape)
        warm_prompts = report.make_prompts(count=max(1, w["requests"] // 4) if quarter else w["requests"], seed=12,
                                           **shape)
        warm = SamplingParams(max_tokens=w["output_len"] if quarter else 8, temperature=0.0, ignore_eos=True,
                              detokenize=False)
        began = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in warm_prompts], warm, use_tqdm=False)
        warmup_s = time.perf_counter() - began
        params = SamplingParams(max_tokens=w["output_len"], temperature=0.0, ignore_eos=True, detokenize=False)
        began = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - began
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({**w, "elapsed_s": elapsed, "output_tokens": generated, "output_tok_s": generated / elapsed,
                     "total_tok_s": (generated + w["requests"] * w["prompt_len"]) / elapsed,
                     "warmup_s": warmup_s, "warmup_requests": len(warm_prompts), **request_timing(outs)})
    return rows


def request_timing(outs) -> dict:
    """Medians of time to first token and time per output token after the first, from ``RequestOutput.metrics``
    (vLLM's RequestStateStats; present only when the engine runs with ``disable_log_stats=False``). Offline, every
    request arrives at once, so TTFT includes the queueing behind earlier requests."""
    stats = [o.metrics for o in outs if getattr(o, "metrics", None) is not None]
    if not stats:
        return {"ttft_median_s": None, "tpot_median_s": None, "request_metrics": False}
    ttft = [m.first_token_latency for m in stats]
    tpot = [(m.last_token_ts - m.first_token_ts) / (m.num_generation_tokens - 1) for m in stats
            if m.num_generation_tokens > 1]
    return {"ttft_median_s": statistics.median(ttft), "tpot_median_s": statistics.median(tpot) if tpot else None,
            "request_metrics": True}


def compile_check_task(llm, task: dict, vocab: int) -> dict:
    """Batches in order (``task["batches"]``: name, prompts, max_tokens); after each, the JIT compiles that vLLM's
    JIT monitor logged meanwhile (kernel names, read from this job's log, which the workers write too)."""
    from vllm import SamplingParams

    log = task.get("log")
    offset = Path(log).stat().st_size if log and Path(log).exists() else 0
    batches = []
    for batch in task["batches"]:
        prompts = report.make_prompts(vocab=vocab, **batch["prompts"])
        params = SamplingParams(max_tokens=batch["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
        began = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - began
        time.sleep(task.get("settle_s", 1.0))  # workers log before generate() returns; a margin all the same
        text, offset = _read_from(log, offset) if log else ("", 0)
        batches.append({"name": batch["name"], "prompt_lens": [len(p) for p in prompts],
                        "max_tokens": batch["max_tokens"], "elapsed_s": round(elapsed, 2),
                        "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs),
                        "jit_compiles": runner.jit_compiles(text)})
    return {"batches": batches, "log_read": bool(log)}


def spec_decode_task(llm, task: dict, vocab: int) -> dict:
    """Greedy tokens (with the top-2 logprobs of every step) of ``task["prompt_ids"]``, all at once, timed, and
    vLLM's speculative-decoding counters over that run (empty without speculation). ``task["warmup_ids"]`` (other
    prompts) run first, outside the timing and the counters: compiles and CUDA graphs. ``task["repeats"]`` (default
    1): the same prompts again, timed alone; ``output_tok_s`` is the best run's (a first run of new prompt lengths
    may still compile Triton specialisations; engines here run without prefix caching, and each run's cached tokens
    are recorded)."""
    from vllm import SamplingParams

    warm = SamplingParams(max_tokens=task["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": p} for p in task["warmup_ids"]], warm, use_tqdm=False)
    before = _spec_counters(llm)
    began = time.perf_counter()
    data = _greedy(llm, task["prompt_ids"], task["max_tokens"], 2)
    timed_s = time.perf_counter() - began
    after = _spec_counters(llm)
    delta = {name: [a - b for a, b in zip(value, before.get(name, [0] * len(value)))] if isinstance(value, list)
             else value - before.get(name, 0) for name, value in after.items()}
    generated = sum(len(tokens) for tokens in data["tokens"])
    runs_s, cached = [timed_s], [sum(data["cached_tokens"])]
    for _ in range(task.get("repeats", 1) - 1):
        began = time.perf_counter()
        again = _greedy(llm, task["prompt_ids"], task["max_tokens"], 2)
        runs_s.append(time.perf_counter() - began)
        cached.append(sum(again["cached_tokens"]))
    return {"prompt_lens": [len(p) for p in task["prompt_ids"]], **data, "timed_s": min(runs_s),
            "timed_runs_s": runs_s, "cached_tokens_per_run": cached, "output_tok_s": generated / min(runs_s),
            "spec_decode": delta}


def _spec_counters(llm) -> dict:
    """vLLM's ``vllm:spec_decode_*`` counters so far (a number each, a list per draft position for the vector)."""
    return {m.name: list(m.values) if hasattr(m, "values") else m.value for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode")}


def burst_task(llm, task: dict, vocab: int) -> dict:
    """The OOM test: every prompt at once (the scheduler packs their prefills into steps of max_num_batched_tokens),
    greedy, then torch's reserved memory before the burst and its peak over it, and the device's memory. The
    figures are the engine's only when it runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); else None.
    ``task["prompts"]``: one prompt set (``make_prompts``' arguments) or a list of them, sent together."""
    import torch
    from vllm import SamplingParams

    sets = task["prompts"] if isinstance(task["prompts"], list) else [task["prompts"]]
    prompts = [p for shape in sets for p in report.make_prompts(vocab=vocab, **shape)]
    params = SamplingParams(max_tokens=task["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
    in_process = torch.cuda.is_available() and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    if in_process:
        torch.cuda.reset_peak_memory_stats()
    reserved_before = torch.cuda.memory_reserved() if in_process else None
    began = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - began
    free, total = torch.cuda.mem_get_info() if torch.cuda.is_available() else (None, None)
    return {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "timed_s": round(elapsed, 2),
            "completed": sum(len(o.outputs[0].token_ids) == task["max_tokens"] for o in outs),
            "reserved_before_bytes": reserved_before,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved() if in_process else None,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated() if in_process else None,
            "device_used_bytes": total and total - free, "device_total_bytes": total}


TASKS = {"logprobs": logprobs_task, "greedy": greedy_task, "prefix": prefix_task, "throughput": throughput_task,
         "compile_check": compile_check_task, "spec_decode": spec_decode_task, "burst": burst_task}


def _greedy(llm, prompts: list[list[int]], max_tokens: int, top: int) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=top, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens, top2_ids, top2_lp, first_topk = [], [], [], []
    for out in outs:
        steps = out.outputs[0].logprobs
        tokens.append(list(out.outputs[0].token_ids))
        ranked = [[_ranked(step, r) for r in (1, 2)] for step in steps]
        top2_ids.append([[t for t, _ in pair] for pair in ranked])
        top2_lp.append([[lp for _, lp in pair] for pair in ranked])
        first_topk.append({str(t): lp.logprob for t, lp in steps[0].items()})
    return {"tokens": tokens, "top2_ids": top2_ids, "top2_logprobs": top2_lp, "first_topk": first_topk,
            "cached_tokens": [o.num_cached_tokens or 0 for o in outs]}


def _ranked(position: dict, rank: int) -> tuple[int, float]:
    for token, lp in position.items():
        if lp.rank == rank:
            return token, lp.logprob
    raise ValueError(f"no rank-{rank} entry among {len(position)} logprobs")


def _versions() -> dict:
    import torch
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "triton_f32_default": os.environ.get("TRITON_F32_DEFAULT"),
            "commit": common.provenance()["commit"]}  # per result: a summary may join runs of several commits


def _read_from(path: str, offset: int) -> tuple[str, int]:
    """The log's text from ``offset`` on, and the offset after it."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    return data.decode(errors="replace"), offset + len(data)


def save(path: str, result: dict) -> None:
    tmp = Path(path + ".tmp")
    with gzip.open(tmp, "wt") as f:
        json.dump(result, f)
    tmp.replace(path)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    for key, value in spec.get("env", {}).items():
        os.environ[key] = value  # before vLLM is imported: its engine core and workers inherit them
    (build if spec["kind"] == "build" else run_engine)(spec)


if __name__ == "__main__":
    main()
