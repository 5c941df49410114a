"""The reliability run's one results file: the engine jobs' memory and repeatability figures folded into the server
run's ``benchmarks/results/reliability_<device>.json``.

The server run (``server_reliability.py``) writes that file with the abort rounds, the bad requests and the soak in
its ``summary``. The engine jobs are ``vllm_gpu_e2e.py``'s ``oom-burst-*`` (16 prompts of 24-32K tokens at once),
``mix128k-*`` (one 128K-token prompt beside 64 short ones) and ``repeat-*`` (the same greedy batch on two fresh
engines, bf16 and float32), run under their own name. This script adds to the server file:

- ``summary.memory``: per burst case and backend, whether every request was served, torch's peak reserved and
  allocated memory against vLLM's budget (gpu_memory_utilization x device memory) and its growth over the burst;
- ``summary.repeatability``: per dtype set and backend, the prompts whose tokens were identical on both engines;
- the engine report's burst checks and one check per repeatability set (dcp-triton identical in every prompt),
  appended to ``checks``; ``passed`` is recomputed over all checks.

    python -m benchmarks.vllm_e2e.vllm_gpu_e2e --only 'oom-*,mix128k-*,repeat-*' --name vllm_e2e_reliability_h200
    python -m benchmarks.server.reliability_report     # --server reliability_h200 --engine vllm_e2e_reliability_h200
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.common import RESULTS
from benchmarks.vllm_e2e.vllm_e2e_bursts import CASES, OURS

MEMORY_KEYS = ("status", "served", "requests", "completed", "prompt_tokens", "peak_reserved_bytes",
               "peak_allocated_bytes", "budget_bytes", "growth_bytes")
REPEAT_KEYS = ("prompts", "identical", "tokens", "earliest_divergence", "max_abs_dlogprob", "bitwise")


def fold(server: dict, engine: dict, engine_file: str) -> dict:
    """``server`` (a server run's results, or ``{}``) with the ``engine`` report's memory and repeatability."""
    out = dict(server)
    summary = dict(out.get("summary") or {})
    memory: dict = {}
    for row in engine.get("bursts") or []:
        memory.setdefault(CASES[row["case"]], {})[row["backend"]] = {k: row.get(k) for k in MEMORY_KEYS}
    repeat: dict = {}
    for row in engine.get("repeatability") or []:
        repeat.setdefault(row["set"], {})[row["backend"]] = {k: row.get(k) for k in REPEAT_KEYS}
    summary["memory"], summary["repeatability"] = memory, repeat
    out["summary"] = summary
    labels = tuple(CASES.values())
    checks = out.get("checks") or []
    if isinstance(checks, dict):  # the server run's own form, {name: passed}
        checks = [{"name": name, "pass": bool(ok)} for name, ok in checks.items()]
    checks = [c for c in checks if c.get("source") != engine_file]
    checks += [{**c, "source": engine_file} for c in engine.get("checks") or [] if c["name"].startswith(labels)]
    for name, by_backend in sorted(repeat.items()):
        ours = by_backend.get(OURS)
        if ours is not None:
            checks.append({"name": f"repeatability, {name}: dcp-triton gave the same tokens on both engines",
                           "pass": ours["identical"] == ours["prompts"], "source": engine_file,
                           "detail": f"{ours['identical']}/{ours['prompts']} prompts identical"})
    out["checks"] = checks
    out["passed"] = bool(checks) and all(c["pass"] for c in checks)
    out.setdefault("provenance", {})["engine_results"] = engine_file
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default="reliability_h200", help="server run's results stem (rewritten)")
    parser.add_argument("--engine", default="vllm_e2e_reliability_h200", help="engine jobs' results stem")
    args = parser.parse_args(argv)
    server_path, engine_path = RESULTS / f"{args.server}.json", RESULTS / f"{args.engine}.json"
    if not engine_path.exists():
        print(f"no {engine_path.name} under {RESULTS}: run vllm_gpu_e2e.py --name {args.engine} first")
        return 1
    server = json.loads(server_path.read_text()) if server_path.exists() else {}
    out = fold(server, json.loads(engine_path.read_text()), engine_path.name)
    server_path.write_text(json.dumps(out, indent=1))
    for check in out["checks"]:
        print(f"{'PASS' if check['pass'] else 'FAIL'} {check['name']}: {check.get('detail', '')}")
    print(f"wrote {server_path.name}: passed={out['passed']}")
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
