"""The seeds' workload on one GPU in both engines: a hybrid Qwen3-Next with its MTP draft, dcp-triton against each
engine's own attention backends, summarised from the two engines' results files.

Reads ``<results>/sglang_hybrid_spec_<gpu>.json`` (``sglang_e2e/sglang_hybrid_spec.py``: NEXTN against SGLang's
``triton`` and ``fa3``; ``..._<gpu>_p64.json`` too where its 64-token-page jobs ran apart) and
``<results>/vllm_hybrid_<gpu>.json`` (``vllm_e2e/vllm_hybrid_gpu.py``: with and without MTP against ``FLASH_ATTN``,
and ``TRITON_ATTN`` beside it; ``..._<gpu>_mtp.json`` too where its two MTP jobs ran apart, on one machine) and writes ``<results>/hybrid_spec_<gpu>.json`` whose ``summary`` holds, per engine:

  greedy_identical  float32 greedy tokens (with speculation) of dcp-triton equal to the peer's: true / false; null
                    where no float32 pair ran (vLLM's GDN kernels take no float32), with ``greedy_bf16``: how many
                    bf16 sequences agree, ours against each peer and two of the engine's own backends against each
                    other (bf16 rounding makes greedy tokens of a random model part at near-ties)
  acceptance_ratio  per peer: dcp-triton's mean accepted length (tokens per verify step) over the peer's
  tok_s_ratio       per load and peer: dcp-triton's output tokens/s over the peer's (best runs); vLLM's only where
                    its greedy batch was timed more than once (a first run compiles for its prompt lengths); SGLang's
                    on 64-token pages, all backends alike, in ``tok_s_ratio_p64``
  missing           each comparison that could not be made, and why

    python -m benchmarks.hybrid_spec --gpu h100
"""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path

from benchmarks import common
from benchmarks.sglang_e2e import sglang_one_h200 as sglang_one

SGLANG_PEERS = ("fa3", "triton")
VLLM_PEER = "FLASH_ATTN"
ERROR_LINE = re.compile(r"^\w+(Error|Exception): ")


def sglang_part(result: dict, pages64: dict | None = None) -> dict:
    """SGLang's summary; ``pages64``: a run of the 64-token-page jobs alone (``--only '*-p64'``, its own file),
    whose comparisons stand for the main file's."""
    summary, jobs = result["summary"], {j["name"]: j for j in result["jobs"] if "error" not in j}
    fp32 = summary.get("fp32_vs_triton")
    part: dict = dict(engine="SGLang", speculation="NEXTN (MTP): 3 steps, topk 1, 4 draft tokens",
                      greedy_identical=None if fp32 is None else fp32["greedy_identical"], greedy_bf16={},
                      acceptance_ratio={}, tok_s_ratio={}, missing=[])
    if fp32 is None:
        part["missing"].append("float32 greedy: " + _failures(result, "q3n-fp32-"))
    else:
        part["acceptance_ratio"]["triton (float32)"] = fp32["acceptance_ratio"]
    for peer in SGLANG_PEERS:
        versus = summary.get("bf16_vs", {}).get(peer)
        if versus is None:
            part["missing"].append(f"bf16 against {peer}: " + _failures(result, f"q3n-bf16-{peer}"))
            continue
        part["greedy_bf16"][f"dcp-triton vs {peer}"] = _equal(versus["greedy"])
        part["acceptance_ratio"][peer] = versus["acceptance_ratio"]
        for load, ratio in versus["tok_s_ratio"].items():
            part["tok_s_ratio"].setdefault(load, {})[peer] = ratio
    for peer, versus in (pages64 or result)["summary"].get("bf16_p64_vs", {}).items():  # all on 64-token pages
        for load, ratio in versus["tok_s_ratio"].items():
            part.setdefault("tok_s_ratio_p64", {}).setdefault(load, {})[peer] = ratio
    a, b = (jobs.get(f"q3n-bf16-{peer}") for peer in SGLANG_PEERS)
    if a and b:
        part["greedy_bf16"][" vs ".join(SGLANG_PEERS)] = _equal(sglang_one.greedy_agreement(a["greedy"], b["greedy"]))
    return part


def vllm_part(result: dict, mtp: dict | None = None) -> dict:
    """vLLM's summary; ``mtp``: a run of the MTP jobs alone (``--only 'q3n-mtp-*'``, its own file), whose MTP rows
    stand for the main file's."""
    rows = dict(result["summary"]["jobs"])
    if mtp is not None:
        rows = {name: row for name, row in rows.items() if not name.startswith("q3n-mtp-")}
        rows.update({name: row for name, row in mtp["summary"]["jobs"].items() if name.startswith("q3n-mtp-")})
    part: dict = dict(engine="vLLM", speculation=f"MTP ({result['meta'].get('mtp')})", greedy_identical=None,
                      greedy_bf16={}, acceptance_ratio={}, tok_s_ratio={}, missing=[
                          "float32 greedy: vLLM's GDN kernels take no float32 (bf16 only)"])
    for name, row in rows.items():
        greedy = row.get("greedy")
        if greedy is not None and row.get("method") is None:
            label = f"{row['backend']} vs {rows[row['versus']]['backend']}"
            part["greedy_bf16"][label] = f"{greedy['identical']}/{greedy['prompts']}"
            if row.get("logprobs"):
                part.setdefault("prompt_logprobs_median_abs_diff", {})[label] = row["logprobs"]["median_abs"]
    ours, theirs = rows.get("q3n-mtp-dcp-triton", {}), rows.get(f"q3n-mtp-{VLLM_PEER}", {})
    if ours.get("mean_acceptance_length") and theirs.get("mean_acceptance_length"):
        part["acceptance_ratio"][VLLM_PEER] = round(ours["mean_acceptance_length"] /
                                                    theirs["mean_acceptance_length"], 3)
    else:
        part["missing"].append(f"MTP acceptance against {VLLM_PEER}: " + ", ".join(
            f"{name} {rows.get(name, {}).get('status', 'not run')}" for name in ("q3n-mtp-dcp-triton",
                                                                                 f"q3n-mtp-{VLLM_PEER}")))
    for kind, prefix in (("plain", "q3n-"), ("mtp", "q3n-mtp-")):
        ours, theirs = rows.get(f"{prefix}dcp-triton", {}), rows.get(f"{prefix}{VLLM_PEER}", {})
        if min(ours.get("timed_runs", 1), theirs.get("timed_runs", 1)) > 1 and ours.get("output_tok_s") \
                and theirs.get("output_tok_s"):
            part["tok_s_ratio"].setdefault(kind, {})[VLLM_PEER] = round(ours["output_tok_s"] /
                                                                        theirs["output_tok_s"], 3)
        else:
            part["missing"].append(f"tokens/s {kind} against {VLLM_PEER}: needs both jobs with their greedy batch "
                                   "timed more than once (a first run compiles for its prompt lengths)")
    return part


def _equal(agreement: dict) -> str:
    return f"{agreement['equal']}/{agreement['sequences']}"


def _failures(result: dict, prefix: str) -> str:
    failed = [j for j in result["jobs"] if j["name"].startswith(prefix) and "error" in j]
    logs = result.get("job_logs", {})
    return "; ".join(f"{j['name']} failed ({logs.get(j['name']) or 'exit ' + j['error']})" for j in failed) \
        or "not run"


def job_errors(jobs_tarball: Path) -> dict[str, str]:
    """Each job log's last exception line (``<name>.log`` members of an SGLang run's ``*_jobs.tar.gz``)."""
    found = {}
    if jobs_tarball.exists():
        with tarfile.open(jobs_tarball) as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.endswith(".log"):
                    text = tar.extractfile(member).read().decode(errors="replace")
                    lines = [line for line in text.splitlines() if ERROR_LINE.match(line)]
                    if lines:
                        found[Path(member.name).name[:-len(".log")]] = lines[-1][:240]
    return found


def combine(gpu: str, results_dir: Path = common.RESULTS) -> Path:
    sources = {"sglang": results_dir / f"sglang_hybrid_spec_{gpu}.json",
               "sglang_p64": results_dir / f"sglang_hybrid_spec_{gpu}_p64.json",
               "vllm": results_dir / f"vllm_hybrid_{gpu}.json",
               "vllm_mtp": results_dir / f"vllm_hybrid_{gpu}_mtp.json"}
    loaded = {engine: json.loads(path.read_text()) for engine, path in sources.items() if path.exists()}
    if "sglang" in loaded:  # why a job failed: its log's exception, from the jobs' logs beside the results
        loaded["sglang"]["job_logs"] = job_errors(results_dir / f"sglang_hybrid_spec_{gpu}_jobs.tar.gz")
    summary = {"gpu": next((r.get("gpu") or r.get("meta", {}).get("gpu") for r in loaded.values()), None)}
    if "sglang" in loaded:
        summary["sglang"] = sglang_part(loaded["sglang"], loaded.get("sglang_p64"))
    if "vllm" in loaded:
        summary["vllm"] = vllm_part(loaded["vllm"], loaded.get("vllm_mtp"))
    origin = {engine: r.get("provenance") or r.get("meta", {}).get("provenance") for engine, r in loaded.items()}
    return common.save(f"hybrid_spec_{gpu}", dict(summary=summary, sources={e: p.name for e, p in sources.items()
                                                                             if e in loaded}),
                       results_dir=results_dir, origin=origin)


if __name__ == "__main__":
    common.summarise_by_gpu(__doc__, combine)
