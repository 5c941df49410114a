"""The README's CPU server command, as written, serves the demo model on dcp-triton: one start of vLLM's
OpenAI-compatible server (its flags read from README.md, the model path pointed at the test's converted copy and a
free port added), a completion and a chat request through the ``openai`` client, the answers checked, the server
stopped. Under a minute on 2 cores (eager, as the README says), most of it the server's start-up."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
DEMO_MODEL = "~/.cache/dcp-triton/smollm2-135m-instruct"  # where `make demo` converts the model, as the README says
START_TIMEOUT_S = 600


def readme_cpu_server_command() -> list[str]:
    """The README's one ``python -m vllm.entrypoints.openai.api_server`` command (a shell line of a code block)."""
    readme = (ROOT / "README.md").read_text()
    blocks = [body for lang, body in re.findall(r"```(\w*)\n(.*?)```", readme, flags=re.S) if lang == ""]
    lines = [line.split(" #")[0].strip() for block in blocks for line in block.splitlines()]
    (line,) = [line for line in lines if line.startswith("python -m vllm.entrypoints.openai.api_server")]
    return shlex.split(line)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    cmd = readme_cpu_server_command()
    assert DEMO_MODEL in cmd, cmd
    port = free_port()
    cmd = [sys.executable if arg == "python" else str(smollm2_dir) if arg == DEMO_MODEL else arg for arg in cmd]
    env = {k: v for k, v in os.environ.items() if k not in ("DCP_TRITON_KERNELS", "DCP_TRITON_CPU")}
    log = tmp_path_factory.mktemp("cpu_server") / "server.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=sink, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120, max_retries=0)
    deadline = time.monotonic() + START_TIMEOUT_S
    started = time.monotonic()
    try:
        while True:
            assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"not ready after {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}"
            try:
                (served,) = [m.id for m in client.models.list().data]
                break
            except openai.APIConnectionError:
                time.sleep(1)
        yield client, served, log, time.monotonic() - started
    finally:
        proc.send_signal(signal.SIGINT)  # what Ctrl-C does: vLLM shuts its engine processes down
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this test started for the server
            proc.wait()


def test_completion_and_chat_answer(server):
    client, model, log, startup_s = server
    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=3,
                                           temperature=0)
    assert completion.choices[0].text.startswith(" Paris"), completion
    chat = client.chat.completions.create(model=model, max_tokens=16, temperature=0, messages=[
        {"role": "user", "content": "What is the capital of France? Answer in one word."}])
    assert "Paris" in chat.choices[0].message.content, chat
    text = log.read_text()
    (startup,) = set(re.findall(r"dcp-triton attention: backend=DCP_TRITON .*", text))
    assert "kernels=reference (torch" in startup, startup  # the fastest exact path is the CPU default
    assert "cpu_attn_routed=the engine config selects dcp-triton" in startup, startup
    assert "Cannot use AttentionBackendEnum.DCP_TRITON" not in text  # vLLM's notice that says the opposite
    print(f"server ready after {startup_s:.0f} s")
