"""What the server scripts share (``server_aborts.py``, ``server_reliability.py``): the default model, one vLLM
OpenAI server on dcp-triton from start to shutdown, streamed requests and their records, vLLM's gauges on /metrics,
the GPU's memory, and the result and log files (paths scrubbed)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import REPO, provenance, save_random_llama

TINY_LLAMA = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, head_dim=64,
                  num_hidden_layers=2, vocab_size=512, max_position_embeddings=2048, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, initializer_range=0.2)  # 0.2: peaked attention, distinct tokens
IDLE = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")  # all 0: nothing left in the engine
ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL)\b|^Traceback")
HUNG: list[str] = []  # requests that timed out: no more are sent after one


def idle(state: dict) -> bool:
    return all(state.get(k) == 0 for k in IDLE)


def write_tiny_llama(path: Path, kv_heads: int, max_len: int = 2048) -> Path:
    """The default model: ``TINY_LLAMA`` with ``kv_heads`` KV heads, random weights (seed 0), float32; positions up
    to ``max_len`` (at least 2048; plain RoPE, so the weights do not depend on it)."""
    config = {**TINY_LLAMA, "num_key_value_heads": kv_heads, "max_position_embeddings": max(2048, max_len)}
    return save_random_llama(config, path, seed=0)


def device_name() -> str:
    import torch

    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()) if torch.cuda.is_available() else "cpu"


def device_tag(device: str) -> str:
    """``device_name()`` short, as result files name it: "h200" for "nvidia-h200"; else unchanged."""
    found = re.search(r"(?<![a-z])[a-z]{1,3}\d{2,4}", device)
    return found.group(0) if found else device


def gpu_memory_mib() -> float | None:
    """GPU memory in use, all processes, summed over the machine's GPUs (nvidia-smi, asked from a subprocess so
    this client holds no CUDA context); None without a GPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(map(float, done.stdout.split())) if done.returncode == 0 and done.stdout.strip() else None


def has_tokenizer(model: str | Path) -> bool:
    """Whether the server loads a tokenizer (else ``--skip-tokenizer-init``: token-id prompts only)."""
    return any((Path(model) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))


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
           "--kv-cache-memory-bytes", str(int(args.kv_cache_gib * (1 << 30))), "--enable-prefix-caching",
           "--enable-prompt-tokens-details", "--enable-log-requests", "--max-log-len", "0", "-tp", str(args.tp),
           "-dcp", str(args.dcp)]
    if not has_tokenizer(args.model):
        cmd.append("--skip-tokenizer-init")
    cmd += ["--enforce-eager"] * args.eager + shlex.split(args.server_args)
    env = {**os.environ, "DCP_TRITON_KERNELS": args.kernels, "VLLM_COMPUTE_NANS_IN_LOGITS": "1", "HF_HUB_OFFLINE": "1",
           "TRITON_F32_DEFAULT": "ieee", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    with open(log, "w") as sink:
        return subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True), port


@dataclass(slots=True)
class Server:
    """A running server: its process, port and client; ``info`` collects what the run learns about it
    (``server_start_s``; at the shutdown ``server_alive_at_end``, ``wall_s``, ``shutdown_errors``), ``served``
    is its log up to the shutdown."""

    proc: subprocess.Popen
    port: int
    client: object  # httpx.AsyncClient
    log: Path
    info: dict = field(default_factory=dict)
    served: str = ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_size(self) -> int:
        return self.log.stat().st_size


@contextlib.asynccontextmanager
async def serving(args, log: Path):
    """The server started and healthy (its log in ``log``), as a ``Server``; stopped at the exit: SIGINT (it stops
    its engine), then its process group. What it logs after the SIGINT is kept apart (``shutdown_errors``): vllm-cpu
    0.32 logs an EngineDeadError at every SIGINT shutdown, with its own CPU_ATTN backend as well."""
    import httpx

    started = time.monotonic()
    proc, port = start_server(args, log)
    limits = httpx.Limits(max_connections=args.streams + 8, max_keepalive_connections=args.streams + 8)
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=args.timeout_s, limits=limits)
    server = Server(proc, port, client, log)
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
        server.info["server_start_s"] = round(time.monotonic() - started, 1)
        yield server
    finally:
        await client.aclose()
        server.info["server_alive_at_end"] = server.alive()
        server.served = log.read_text(errors="replace")
        if server.alive():
            proc.send_signal(2)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever of the group this script started is left
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
    server.info["wall_s"] = round(time.monotonic() - started, 1)
    server.info["shutdown_errors"] = [line for line in log.read_text(errors="replace")[len(server.served):]
                                      .splitlines() if ERROR_LINE.search(line)]


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


def cached_tokens(rec: dict) -> int | None:
    return ((rec.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")


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


def execute(args, load) -> dict:
    """``load(args, log)`` (a coroutine function: one server's life, returning the result) against ``args.model``
    or, without one, the tiny Llama written to a temporary folder; writes ``args.out`` and the server log beside it
    (``.log``), naming no path outside the checkout."""
    config = {k: str(v) for k, v in vars(args).items() if k not in ("model", "out")}
    HUNG.clear()
    log = args.out.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="server-bench-") as tmp:
        kv_heads = 1 if args.dcp > 1 else 2  # vLLM's DCP needs more TP ranks than KV heads
        label = args.model or f"tiny random Llama, 4 Q / {kv_heads} KV heads"
        args.model = args.model or str(write_tiny_llama(Path(tmp) / "m", kv_heads, args.max_model_len))
        result = {"device": args.device, "model": label, "config": config, **asyncio.run(load(args, log)),
                  "provenance": provenance()}
        paths = ((args.model, f"<{label}>"), (sys.prefix, "<venv>"), (str(REPO), "."), (sys.base_prefix, "<python>"),
                 (tempfile.gettempdir(), "<tmp>"))

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
