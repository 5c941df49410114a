"""What the benchmarks share: timing helpers (cold-L2 medians, CUDA-graph replay, copy-bandwidth ceiling), the
results file with its provenance (which commit and Triton wrote it), repository-relative paths for what results
cite, and the random-weight Llama checkpoint builder. torch and transformers are imported inside the functions that
use them: the end-to-end runner (no torch) imports this module too.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for the annotations; imported where used, so the runner's processes load no torch
    import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
SWITCHES = ("DCP_TRITON_GLUON", "DCP_TRITON_KERNELS", "DCP_TRITON_FAST_LAUNCH", "DCP_TRITON_COMPILE_WORKERS",
            "DCP_TRITON_PDL", "DCP_TRITON_DCP_FULL_GRAPHS", "DCP_TRITON_FP8_DOT",
            "DCP_TRITON_FP8_PREFILL")  # recorded in provenance() when set
COMMIT_ENV = "DCP_TRITON_COMMIT"  # the commit, where the tree has no .git (the device machine's copy)
COLD_BYTES = 256 << 20  # disjoint data per timed graph until this many bytes (> 4x an H200's 60 MB L2)
MAX_COPIES = 32


def cold_copies(nbytes: int) -> int:
    """How many disjoint copies of ``nbytes`` of inputs a timed graph cycles through so replays miss the L2."""
    return max(1, min(MAX_COPIES, -(-COLD_BYTES // max(nbytes, 1))))


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"


def gpu_tag(name: str | None = None) -> str:
    """The card in a results file's name: ``h100``, ``h200``, ... (the first model number in ``gpu_name()``, lower
    case), else ``cpu``."""
    found = re.search(r"\b([A-Z]\d{2,4})\b", name if name is not None else gpu_name())
    return found.group(1).lower() if found else "cpu"


def median_ms(fn, *, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median time of ``fn`` with the L2 flushed before every call (triton's do_bench)."""
    import triton

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def graph_ms(fns: list, *, replays: int = 20, repeats: int = 5) -> float:
    """Median time per call of ``fns`` captured back to back in one CUDA graph (launch gaps removed).

    Give several calls over disjoint data whose total exceeds the L2 so replays do not run from cache.
    """
    return replay_ms(capture_graph(fns), len(fns), replays=replays, repeats=repeats)


def capture_graph(fns: list) -> torch.cuda.CUDAGraph:
    """``fns`` warmed up on a side stream (compilation, lazy communicator set-up), then captured in one graph."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, calls: int, *, replays: int = 20, repeats: int = 5) -> float:
    """Median time per call of a captured ``graph`` holding ``calls`` calls (one warm replay first)."""
    import torch

    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / (replays * calls))
    return statistics.median(times)


def events_ms(fn, *, iters: int = 10, repeats: int = 5, before=None) -> float:
    """Median time per call of ``fn`` run ``iters`` times back to back, host launch overhead included: CUDA events
    on a GPU, the wall clock on CPU. ``before()`` (e.g. a barrier) runs before each repeat, outside the timing."""
    import torch

    cuda = torch.cuda.is_initialized()
    fn()  # warm-up: compilation, lazy communicator set-up
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / iters)
        else:
            began = time.perf_counter()
            for _ in range(iters):
                fn()
            times.append((time.perf_counter() - began) * 1e3 / iters)
    return statistics.median(times)


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth counting bytes read plus written: the ceiling for memory-bound kernels."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), rep_ms=200)
    return 2 * nbytes / ms / 1e6


def save(name: str, payload: dict, *, results_dir: Path = RESULTS, origin: dict | None = None) -> Path:
    """``<results_dir>/<name><suffix>.json``: ``payload`` and its ``provenance`` (``origin``, else
    ``provenance()``). The suffix is $DCP_BENCH_NAME_SUFFIX (empty unless set): ``run_h200.sh ab`` names the base
    tree's results ``*_base``."""
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}{os.environ.get('DCP_BENCH_NAME_SUFFIX', '')}.json"
    path.write_text(json.dumps({**payload, "provenance": origin or provenance()}, indent=2))
    return path


def provenance() -> dict:
    """Which code wrote a result: this repository's ``commit`` (``git rev-parse HEAD``) and ``dirty`` (tracked
    files changed since it, benchmarks/results/ left out: runs rewrite their own results), and the ``triton``
    version.

    $DCP_TRITON_COMMIT, when set, names the commit and wins (``dirty`` is then None): the device machine's copy of
    the tree may carry a stale .git, so put the host's ``git rev-parse HEAD`` into the device call's command
    (``DCP_TRITON_COMMIT=<hash> bash scripts/device/run_h200.sh ...``). Without either, ``commit`` is None."""
    if os.environ.get(COMMIT_ENV):
        return {"commit": os.environ[COMMIT_ENV], "dirty": None, "triton": triton_version(), **_switches()}
    commit, dirty = _git("rev-parse", "HEAD"), None
    if commit is not None:
        status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results")
        dirty = None if status is None else bool(status)
    return {"commit": commit, "dirty": dirty, "triton": triton_version(), **_switches()}


def _switches() -> dict:
    """``{"env": {...}}``: the kernel switches (``SWITCHES``) set in this process's environment, which change what
    the same commit runs; ``{}`` when none is set."""
    env = {name: os.environ[name] for name in SWITCHES if name in os.environ}
    return {"env": env} if env else {}


def stamp(paths: list[Path], provenance: dict) -> None:
    """``provenance`` into the ``meta`` of each JSON summary among ``paths``: the end-to-end scripts build ``meta``
    from their jobs' results, which know nothing of the code. Rewritten atomically, with the writers' indent."""
    for path in (p for p in paths if p.suffix == ".json" and p.is_file()):
        data = json.loads(path.read_text())
        if isinstance(data.get("meta"), dict):
            data["meta"]["provenance"] = provenance
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(data, indent=1))
            tmp.replace(path)


def _git(*args: str) -> str | None:
    """``git -C <repo> ARGS``'s output, stripped; None without git, without the tree's .git, or on an error."""
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        return None
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def triton_version() -> str | None:
    """The version of the Triton this process imported, else of the installed one (not imported), else None."""
    version = getattr(sys.modules.get("triton"), "__version__", None)
    if version:
        return str(version)
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def merge_jobs(name: str, paths: list[str], summarise, *, results_dir: Path = RESULTS) -> Path:
    """``--merge``: the ``jobs`` of the results files ``paths``, with ``summarise(jobs)`` as their summary, saved as
    ``name``; prints and returns the path. The jobs ran elsewhere: each keeps its file's ``provenance``, and the
    merged file's is theirs when they share one (else ``commit`` None and every input's under ``inputs``)."""
    files = [json.loads(Path(path).read_text()) for path in paths]
    jobs = [{"provenance": f.get("provenance"), **job} for f in files for job in f["jobs"]]
    origins: list = []
    for f in files:  # a file merged before brings its inputs, not itself
        provenance = f.get("provenance") or {}
        for o in provenance.get("inputs", [provenance]) if provenance.get("commit") is None else [provenance]:
            if o not in origins:
                origins.append(o)
    origin = origins[0] if len(origins) == 1 else {"commit": None, "inputs": origins}
    path = save(name, dict(summary=summarise(jobs), jobs=jobs), results_dir=results_dir, origin=origin)
    print(f"wrote {repo_relative(path)}")
    return path


def summarise_by_gpu(doc: str, combine) -> None:
    """The command line of a script that summarises one card's results files (``hybrid_spec.py``, ``parity.py``):
    ``--gpu`` and ``--results-dir``, then ``combine(gpu, results_dir)`` -> the file it wrote, whose summary is
    printed."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--gpu", required=True, help="the card in the results' names: h100, h200")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    path = combine(args.gpu, args.results_dir)
    print(json.dumps(json.loads(path.read_text())["summary"], indent=1))
    print(f"wrote {repo_relative(path)}")


def repo_relative(path: str | Path) -> str:
    """``path`` relative to the repository root when it lies under it, else absolute: what committed results cite
    (``benchmarks/results/vllm_e2e_logs/x.log``), so they name no machine's folders."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


@contextlib.contextmanager
def working_dir(path: Path):
    """The block runs in ``path`` (``contextlib.chdir``, which Python 3.10 lacks)."""
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def module_command(module: str, *args: str) -> list[str]:
    """``python -m module args``: how a benchmark starts a process of its own code (a job, a child of itself), e.g.
    ``module_command("benchmarks.vllm_e2e.vllm_e2e_engine", spec)``; run it with ``child_env``'s environment."""
    return [sys.executable, "-m", module, *args]


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the folder that holds the ``benchmarks`` package last on PYTHONPATH, so
    a ``module_command`` process finds it from any working folder (jobs run in their work folder). Last: a
    dcp-triton install earlier on PYTHONPATH keeps its place before the repository root, whose ``dcp_plugin/`` folder
    lacks the ``kernels`` and ``adapters`` the install maps into it (the GPU machine's /tmp/dcp, scripts/device)."""
    env = dict(os.environ if env is None else env)
    root = str(Path(__file__).resolve().parents[1])  # where this file is (REPO may name a stand-in tree)
    parts = [part for part in env.get("PYTHONPATH", "").split(os.pathsep) if part]
    env["PYTHONPATH"] = os.pathsep.join(parts if root in parts else [*parts, root])
    return env


def save_random_llama(config: dict, target: str | Path, *, seed: int = 0) -> Path:
    """A random-weight ``LlamaForCausalLM(LlamaConfig(**config))``: ``save_random_model`` of a Llama config."""
    return save_random_model({"model_type": "llama", **config}, target, seed=seed)


def save_random_model(config: dict, target: str | Path, *, seed: int = 0) -> Path:
    """A random-weight causal LM of ``config`` (a config.json's dict: ``model_type`` picks transformers' class;
    transformers' initialisation after ``torch.manual_seed(seed)``) saved in float32 into ``target``, atomically:
    written under ``<target>.partial``, then renamed, so a killed build leaves no half checkpoint under the final
    name. A ``target`` holding a config.json is taken as built and left alone.

    A Qwen3-Next config with ``num_nextn_predict_layers`` also gets the multi-token-prediction weights vLLM's
    ``Qwen3NextMTP`` and SGLang's ``Qwen3NextForCausalLMMTP`` read (transformers has no MTP module): ``mtp.layers.{i}``
    copies the decoder layer of the last full-attention layer as saved (transformers 5 keeps experts fused in memory
    and saves them per expert, the names the engines load), ``mtp.fc`` is random, its norms are the final norm's.

    ``config["draftable"]`` (``DRAFTABLE``; not saved in config.json): a random model whose MTP drafts get accepted.
    A random MTP layer's drafts never are (none of 2,016 in vLLM), which leaves speculation's accepted path untimed
    and acceptance compared as 0 against 0. Here the token embedding is scaled up (``embed_scale``) and every layer's
    output projection down (``output_damp``: attention's and Gated-DeltaNet's ``o_proj`` / ``out_proj``, the MLPs'
    ``down_proj``), so the residual stream is mostly the current token's embedding and the next token mostly that
    embedding's own prediction, the layers (attention among them) deciding the rest; ``mtp.fc`` passes the next
    token's normalised embedding on, scaled by ``mtp_fc_scale`` (its first half ``mtp_fc_scale * I``, the hidden
    state's half zero), so the MTP layer drafts that embedding's prediction too.
    """
    target = Path(target)
    if (target / "config.json").exists():
        return target
    draftable = config.get("draftable")
    model = random_model(config, seed=seed)
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    if config.get("num_nextn_predict_layers"):
        from safetensors.torch import load_file, save_file

        (shard,) = partial.glob("*.safetensors")  # a tiny model: one shard
        saved = load_file(shard)
        save_file({**saved, **_mtp_weights(model.config, saved, seed, draftable)}, str(shard),
                  metadata={"format": "pt"})
    partial.rename(target)
    return target


def random_model(config: dict, *, seed: int = 0):
    """``save_random_model``'s model before it is saved: transformers' class for ``config``, initialised after
    ``torch.manual_seed(seed)``, in float32, made draftable where ``config["draftable"]`` says so."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(config)
    draftable = config.pop("draftable", None)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))
    model = model.to(torch.float32)  # saved with dtype float32
    if draftable:
        _make_draftable(model, draftable)
    return model


# save_random_model's draftable model: in the hybrid Qwen3-Next of vllm_e2e/vllm_hybrid_gpu.py (transformers, float32)
# the current token's embedding alone predicts the model's next token on 47 of 72 greedy positions of three prompts
# (0 of 72 without), the layers deciding the rest (tests/unit/test_vllm_hybrid_script.py).
DRAFTABLE = {"embed_scale": 100.0, "output_damp": 0.03, "mtp_fc_scale": 10.0}
_OUTPUT_PROJECTIONS = (".o_proj.", ".out_proj.", ".down_proj")


def _make_draftable(model, draftable: dict) -> None:
    """``save_random_model``'s draftable model: the embedding scaled up, every layer's output projection down."""
    import torch

    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(draftable["embed_scale"])
        for name, param in model.named_parameters():
            if name.startswith("model.layers.") and any(p in name for p in _OUTPUT_PROJECTIONS):
                param.mul_(draftable["output_damp"])


def _mtp_weights(config, saved: dict, seed: int, draftable: dict | None = None) -> dict:
    """Qwen3-Next's MTP weights (``save_random_model``) from the ``saved`` checkpoint's tensors, contiguous float32
    tensors by name; ``draftable``: ``mtp.fc`` passes the next token's embedding on (``save_random_model``)."""
    import torch

    if config.model_type != "qwen3_next":
        raise ValueError(f"num_nextn_predict_layers: MTP weights are built for qwen3_next only, not "
                         f"{config.model_type}")
    full = max(i for i, kind in enumerate(config.layer_types) if kind == "full_attention")
    prefix = f"model.layers.{full}."
    hidden = config.hidden_size
    gen = torch.Generator().manual_seed(seed + 1)
    out = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=gen) * config.initializer_range}
    if draftable:  # [inputs_embeds, hidden_states] in both engines' MTP layers: the embedding's half passed on
        out["mtp.fc.weight"] = torch.cat([torch.eye(hidden) * draftable["mtp_fc_scale"],
                                          torch.zeros(hidden, hidden)], dim=1)
    for name in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        out[f"mtp.{name}.weight"] = saved["model.norm.weight"].clone()
    for i in range(config.num_nextn_predict_layers):
        for name, t in saved.items():
            if name.startswith(prefix):
                out[f"mtp.layers.{i}." + name[len(prefix):]] = t.clone()
    return {name: t.to(torch.float32).contiguous() for name, t in out.items()}
