"""Probes of vLLM 0.33 on the H200 under its torch 2.11, the steps of ``run_h200_v033.sh``.

Each subcommand is one process (a crash in one probe stops only that step) and ends with a line ``RESULT {json}``:

    probe-c          load vllm._C_stable_libtorch (stable ABI, built against torch 2.14) and count its ops
    probe-fa3        load FlashAttention-3's extension alone, then what vLLM's wrapper concluded
    imports          the modules a dense-Llama engine start imports, and dcp-triton's plugin registration
    build DIR        a random-initialised small Llama checkpoint (vllm_e2e_engine.py's builder, saved float32)
    generate DIR BACKEND DTYPE   greedy tokens of 4 prompts (7..1200 tokens), eager
    summary LOGDIR OUT.json      the steps' statuses and exact errors (read from LOGDIR/<step>.log/.rc), and the
                                 checks of the vllm_gpu_e2e.py runs found under LOGDIR/e2e-*/
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import time


def result(**data) -> None:
    print("RESULT " + json.dumps(data), flush=True)


def probe_c() -> None:
    import torch

    began = time.perf_counter()
    import vllm._C_stable_libtorch as ext  # noqa: F401

    ops = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("_C::"))
    result(file=ext.__file__, ops=len(ops), sample=ops[:8], load_s=round(time.perf_counter() - began, 2),
           has_rms_norm="_C::rms_norm" in ops)


def probe_fa3(root: str = "/tmp/vs33") -> None:
    """The extension loaded on its own (the exact loader error; vLLM's wrapper keeps only a summary and its package
    raises ImportError when neither FA2 nor FA3 loads). A crash here (a signal) would also take an engine down:
    the driver then moves the extension aside."""
    import importlib.util

    import torch

    path = os.path.join(root, "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so")
    if not os.path.exists(path):
        return result(loaded=False, error=f"{path} not found")
    try:
        spec = importlib.util.spec_from_file_location("vllm.vllm_flash_attn._vllm_fa3_C", path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except ImportError as exc:
        print(f"FA3 extension: {type(exc).__name__}: {exc}", file=sys.stderr)
        raise
    ops = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("_vllm_fa3_C::"))
    result(loaded=True, ops=len(ops), sample=ops[:6])


ENGINE_MODULES = (
    "vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner",
    "vllm.model_executor.models.llama", "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.attention.backends.flash_attn", "vllm.v1.sample.sampler", "vllm.compilation.backends",
    "vllm.platforms.cuda", "dcp_plugin.adapters.vllm",
)


def imports() -> None:
    import importlib

    failed = {}
    for name in ENGINE_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # every failure, not only the first
            failed[name] = f"{type(exc).__name__}: {exc}"
    registered = None
    if "dcp_plugin.adapters.vllm" not in failed:
        try:
            importlib.import_module("dcp_plugin.adapters.vllm").register()
            registered = True
        except Exception as exc:
            failed["dcp_plugin.adapters.vllm.register()"] = f"{type(exc).__name__}: {exc}"
    from vllm.platforms import current_platform

    result(ok=not failed, failed=failed, platform=type(current_platform).__name__, plugin_registered=registered)


def build(path: str) -> None:
    """The e2e engine's random-initialised Llama builder (transformers' default init), on a small GQA config."""
    from benchmarks.vllm_e2e import vllm_e2e_engine

    config = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                  num_hidden_layers=4, vocab_size=4096, max_position_embeddings=4096, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    vllm_e2e_engine.build({"model_dir": path, "seed": 0, "config": config})
    result(path=path)


def generate(path: str, backend: str, dtype: str) -> None:
    import torch
    from vllm import LLM, SamplingParams

    began = time.perf_counter()
    llm = LLM(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype=dtype, max_model_len=2048, seed=0,
              kv_cache_memory_bytes=2 << 30, gpu_memory_utilization=0.1, attention_backend=backend)
    init_s = time.perf_counter() - began
    params = SamplingParams(max_tokens=24, temperature=0.0, detokenize=False, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 4000, (n,), generator=gen).tolist()} for n in (7, 60, 500, 1200)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    result(backend=backend, dtype=dtype, init_s=round(init_s, 1), tokens=[list(o.outputs[0].token_ids) for o in outs])


# --- summary (no torch, no vLLM) ---------------------------------------------------------------------------------
ERROR_LINE = re.compile(r"^(\S*(Error|Exception|Interrupt)\b.*|.*\b(error|Error|ERROR)\b.*|Segmentation fault.*)$")


def _error_text(log: str) -> str:
    """The exception line of the last traceback (with the 6 lines above it), else the last error-looking lines."""
    lines = [ln.rstrip() for ln in log.splitlines() if ln.strip()]
    tb = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")]
    if tb:
        tail = lines[tb[-1]:]
        last = next((i for i in range(len(tail) - 1, 0, -1) if not tail[i].startswith((" ", "\t"))), len(tail) - 1)
        return "\n".join(tail[max(0, last - 6):last + 3])[-3000:]
    errs = [ln for ln in lines if ERROR_LINE.match(ln)]
    return "\n".join(errs[-8:] or lines[-8:])[-3000:]


def _step(logdir: str, name: str) -> dict:
    rc_file, log_file = os.path.join(logdir, f"{name}.rc"), os.path.join(logdir, f"{name}.log")
    if not os.path.exists(rc_file):
        return {"status": "not run"}
    rc, seconds = (open(rc_file).read().split() + ["", ""])[:2]
    log = open(log_file, errors="replace").read() if os.path.exists(log_file) else ""
    out = {"rc": int(rc) if rc.lstrip("-").isdigit() else rc, "seconds": int(seconds) if seconds.isdigit() else None}
    found = [ln[len("RESULT "):] for ln in log.splitlines() if ln.startswith("RESULT ")]
    if found:
        out["result"] = json.loads(found[-1])
    out["status"] = ("skipped" if rc == "skipped" else "timeout" if rc in ("124", "137") else
                     "ok" if rc == "0" and found else "fail")
    if out["status"] == "ok" and out["result"].get("ok") is False:  # imports: a report of every failure
        out["status"], out["error"] = "fail", json.dumps(out["result"].get("failed"))
    elif out["status"] in ("fail", "timeout"):
        out["error"] = _error_text(log)
    if "generate" in name:
        out["model_runner"] = runner_of(log)
    return out


def runner_of(log_text: str) -> str:
    """Which model runner an engine log shows: V2 logs "Using V2 Model Runner" (gpu_worker.py); V1 loads the model
    from gpu_model_runner.py; "unknown" when the log shows neither."""
    if "Using V2 Model Runner" in log_text:
        return "V2"
    return "V1" if "gpu_model_runner.py" in log_text else "unknown"


def summary(logdir: str, path: str) -> None:
    order = [os.path.basename(f)[:-3] for f in sorted(glob.glob(os.path.join(logdir, "*.rc")),
                                                       key=os.path.getmtime)]
    steps = {name: _step(logdir, name) for name in order}
    gens = {n: s["result"]["tokens"] for n, s in steps.items() if "-generate-" in n and "result" in s}
    if len(gens) == 2:  # informative: float32 and bf16 greedy tokens before the first divergence, per prompt
        a, b = gens.values()
        steps["generate-f32-vs-bf16"] = {"status": "info", "common_prefix": [
            next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for p, q in zip(a, b)]}
    e2e = {}
    for run in sorted(glob.glob(os.path.join(logdir, "e2e-*", ""))):
        report = glob.glob(os.path.join(run, "results", "*.json"))
        entry = {}
        if report:
            data = json.load(open(report[0]))
            entry["checks"] = data.get("checks", [])
            entry["jobs"] = {k: v.get("status") for k, v in data.get("jobs", {}).items()}
            entry["agreement"] = [{k: r.get(k) for k in ("dtype", "case", "task", "ours", "ref", "text")}
                                  for r in data.get("agreement", [])]
        for log in sorted(glob.glob(os.path.join(run, "results", "vllm_e2e_logs", "*.log"))):
            text = open(log, errors="replace").read()
            job = os.path.basename(log)[:-4]
            entry.setdefault("job_runner", {})[job] = runner_of(text)
            if entry.get("jobs", {}).get(job) not in ("ok", "cached"):
                entry.setdefault("job_errors", {})[job] = _error_text(text)
        e2e[os.path.basename(os.path.normpath(run))] = entry
    versions = steps.get("a-versions", {})
    data = {"versions": versions.get("result") or versions.get("error"), "steps": steps, "e2e": e2e,
            "written": time.strftime("%Y-%m-%d %H:%M:%S")}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    for name, s in steps.items():
        print(f"{name:34s} {s.get('status')}  {' '.join(str(s.get('error', '')).splitlines()[-1:])}")
    for name, entry in e2e.items():
        for check in entry.get("checks", []):
            print(f"{name:17s} {'PASS' if check.get('pass') else 'FAIL'} {check.get('name')}: {check.get('detail')}")


def main() -> None:
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "versions":
        import torch
        import triton
        import vllm

        return result(vllm=vllm.__version__, torch=torch.__version__, triton=triton.__version__,
                      cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    handlers = {"probe-c": probe_c, "probe-fa3": probe_fa3, "imports": imports, "build": build,
                "generate": generate, "summary": summary}
    handlers[cmd](*args)


if __name__ == "__main__":
    main()
