"""The verdict of benchmarks/server/server_aborts.py: what its run's records and server log say about each request and
about the server, as the ``checks`` its docstring lists."""

from __future__ import annotations

import re
from collections import Counter

from benchmarks.server._server import ERROR_LINE, idle


def judge(args, result: dict, requests: list[dict], text: str, *, hung: list[str]) -> dict:
    """Fill ``result`` with per-request rows, totals, the ``checks`` (see server_aborts.py) and ``passed``, from the
    load, solo and probe records of ``requests`` and the server log ``text``; ``hung``: requests that timed out."""
    lines = text.splitlines()
    main_ids = r"cmpl-(sa-r\d+-\d{3})-(?!probe|solo)"
    added = set(re.findall("Added request " + main_ids, text))
    aborted = {i for line in lines if "Aborted request" in line for i in re.findall(main_ids, line)}
    attention = re.search(r"dcp-triton attention: .*kernels=(\S+).*", text)
    result.update(attention_line=attention and attention.group(0), kernels=attention and attention.group(1),
                  server_errors=[line for line in lines if ERROR_LINE.search(line)],
                  warning_tracebacks=[lines[i - 1] for i, line in enumerate(lines)  # the message before each
                                      if "WARNING" in line and "Traceback (most recent call last)" in line])
    rows, mismatches = [], []
    for req in requests:
        load, solo, probe = req["load"], req["solo"], req.get("probe")
        row = {"id": req["id"], "round": req["round"], "kind": req["kind"], "prompt_len": len(req["prompt"]),
               "streamed_tokens": len(load["tokens"]), "finish": load["finish"],
               "abort_after_s": req["abort_after_s"],
               "errors": [x["error"] for x in (load, solo, probe) if x and x["error"]],
               "bad_logprobs": sum(x["bad_logprobs"] for x in (load, solo, probe) if x),
               "matches_solo": load["tokens"] == solo["tokens"][: len(load["tokens"])] and (
                   req["kind"] != "complete" or len(load["tokens"]) == args.max_tokens == len(solo["tokens"]))}
        if req["kind"] != "complete":
            cached = ((probe or {}).get("usage") or {}).get("prompt_tokens_details", {}).get("cached_tokens")
            full = (len(req["prompt"]) - 1) // args.block_size * args.block_size
            row.update(reached_engine=req["id"] in added, abort_in_log=req["id"] in aborted, cached_at_probe=cached,
                       prefill_state="not received" if req["id"] not in added else None if cached is None else
                       "none" if cached == 0 else "partial" if cached < full else "complete",
                       probe_matches_solo=bool(solo["tokens"]) and probe["tokens"][:1] == solo["tokens"][:1])
        if not row["matches_solo"]:
            k = next((k for k, (a, b) in enumerate(zip(load["tokens"], solo["tokens"])) if a != b), None)
            mismatches.append({"id": req["id"], "first_divergence": k, "streamed": load["tokens"], "solo": solo[
                "tokens"], "top2_gap_streamed": None if k is None else load["gaps"][k],
                "top2_gap_solo": None if k is None else solo["gaps"][k]})
        rows.append(row)
    kinds = {k: [row for row in rows if row["kind"] == k] for k in ("complete", "prefill", "decode")}
    for info in result["rounds"]:
        mine = [row for row in rows if row["round"] == info["round"]]
        info.update({k: sum(row["kind"] == k for row in mine) for k in kinds},
                    partial_prefill_aborts=sum(row.get("prefill_state") == "partial" for row in mine))
    aborts = kinds["prefill"] + kinds["decode"]
    result["totals"] = totals = {
        "sent": len(rows), "completed": len(kinds["complete"]), "aborted_mid_prefill": len(kinds["prefill"]),
        "aborted_mid_decode": len(kinds["decode"]),
        "prefill_aborts_by_state": dict(Counter(str(row["prefill_state"]) for row in kinds["prefill"])),
        "distinct_completions": len({tuple(q["load"]["tokens"]) for q in requests if q["kind"] == "complete"}),
        "min_top2_gap_completed": min((g for q in requests if q["kind"] == "complete" for g in q["load"]["gaps"]
                                       if g is not None), default=None),
        "mismatches_vs_solo": len(mismatches), "bad_logprobs": sum(row["bad_logprobs"] for row in rows),
        "corrupted_requests": (result.get("end_state") or {}).get("corrupted_requests_total"),
        "request_errors": sum(len(row["errors"]) for row in rows), "server_errors": len(result["server_errors"]),
        "wall_s": result["wall_s"]}
    states = [info["idle_after"] for info in result["rounds"]] + [result.get("end_state") or {}]
    result["checks"] = checks = {
        "dcp_triton_active": result["kernels"] is not None,
        "server_alive": result["server_alive_at_end"] and all(info["server_alive"] for info in result["rounds"]),
        "no_request_errors_or_timeouts": totals["request_errors"] == 0 and not hung,
        "engine_idle_after_each_round": all(idle(s) for s in states),
        "completed_equal_solo": all(row["matches_solo"] for row in kinds["complete"]),
        "aborted_streams_equal_solo_prefix": all(row["matches_solo"] for row in kinds["decode"]),
        "probes_after_aborts_equal_solo": all(row["probe_matches_solo"] for row in aborts),
        "every_received_abort_in_log": all(row["abort_in_log"] for row in aborts if row["reached_engine"]),
        "mid_prefill_and_decode_aborts_every_round": all(i["partial_prefill_aborts"] and i["decode"] and i[
            "targets_in_engine_after_s"] is not None for i in result["rounds"]),
        "no_nan": totals["bad_logprobs"] == 0 and totals["corrupted_requests"] in (0, None),
        "no_server_errors": not result["server_errors"],
        "final_request_served": result.get("final") == {"tokens": args.max_tokens, "finish": "length", "error": None,
                                                        "bad_logprobs": 0}}
    result.update(passed=all(checks.values()), hung_requests=list(hung), mismatches=mismatches, requests=rows)
    return result
