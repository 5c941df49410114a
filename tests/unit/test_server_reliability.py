"""The parts of ``benchmarks/server/server_reliability.py`` that need no server: the bad-request table, the soak's
seeded request mix, how an answer is judged, and the summary and checks on synthetic records."""

from __future__ import annotations

import copy
import itertools
import json

import pytest

from benchmarks.server import server_reliability as rel

VOCAB, MAX_LEN = 512, 2048


def test_bad_requests_cover_the_issue_and_are_what_they_say():
    table = rel.bad_requests(max_model_len=MAX_LEN, vocab=VOCAB)
    cases = {b.case: b for b in table}
    assert len(cases) == len(table)  # names are unique
    assert {"prompt_longer_than_model", "empty_token_prompt", "empty_text_prompt", "max_tokens_0",
            "max_tokens_negative", "logprobs_absurd", "malformed_json", "close_right_after_send",
            "close_while_waiting"} <= set(cases)
    with pytest.raises(json.JSONDecodeError):
        json.loads(cases["malformed_json"].payload)
    sent = {b.case: json.loads(b.payload) for b in table if b.case != "malformed_json"}
    assert len(sent["prompt_longer_than_model"]["prompt"]) == MAX_LEN + 1
    assert len(sent["no_room_for_output"]["prompt"]) == MAX_LEN and sent["no_room_for_output"]["max_tokens"] == 1
    assert sent["empty_token_prompt"]["prompt"] == [] and sent["empty_text_prompt"]["prompt"] == ""
    assert sent["max_tokens_0"]["max_tokens"] == 0 and sent["max_tokens_negative"]["max_tokens"] < 0
    assert max(sent["token_outside_vocab"]["prompt"]) >= VOCAB
    for case, request in sent.items():
        assert request["request_id"] == f"rel-bad-{case}"  # the server log names it
        if case != "token_outside_vocab":
            assert all(3 <= t < VOCAB for t in request["prompt"]), case
    for b in table:
        assert (b.expect == "close") == (b.close_after_s is not None), b.case
        assert b.expect in ("error", "close") and b.sent, b.case
    assert not any(b.skip for b in table)
    close = sent["close_while_waiting"]
    assert "stream" not in close and len(close["prompt"]) + close["max_tokens"] == MAX_LEN  # runs long unless aborted
    assert sent["close_right_after_send"]["stream"] is True


def test_without_a_tokenizer_no_out_of_vocabulary_id_is_sent():
    # vLLM checks prompt ids against the tokenizer only: without one, such an id would stop the engine
    table = rel.bad_requests(max_model_len=MAX_LEN, vocab=VOCAB, tokenizer=False)
    assert [b.case for b in table if b.skip] == ["token_outside_vocab"]
    assert [b.case for b in table] == [b.case for b in rel.bad_requests(max_model_len=MAX_LEN, vocab=VOCAB)]


@pytest.mark.parametrize(("expect", "got", "ok"), [
    ("error", {"status": 400, "message": "max_tokens must be at least 1"}, True),
    ("error", {"status": 404, "message": "The model `x` does not exist."}, True),
    ("error", {"status": 400, "message": None}, False),  # an error needs vLLM's message
    ("error", {"status": 500, "message": "EngineCore died"}, False),
    ("error", {"status": 200, "message": None}, False),
    ("error", {"status": "ReadError: ", "message": None}, False),
    ("close", {"status": rel.CLOSED, "message": None}, True),
    ("close", {"status": "response began before the close", "message": None}, False)])
def test_answered(expect, got, ok):
    bad = rel.BadRequest(case="c", sent="s", payload=b"{}", expect=expect, close_after_s=0.0 if expect == "close"
                         else None)
    assert rel.answered(bad, got) is ok


@pytest.mark.parametrize(("data", "message"), [
    ({"error": {"message": "too long", "code": 400}}, "too long"), ({"object": "error", "message": "old"}, "old"),
    ({"detail": "bad json"}, "bad json"), ([1], None), ({"choices": []}, None)])
def test_error_message(data, message):
    assert rel.error_message(data) == message


def soak(seed=7, **kw):
    return rel.soak_requests(seed, **{"vocab": VOCAB, "max_prompt": 600, "max_tokens": 20, "abort_fraction": 0.3,
                                      **kw})


def test_soak_mix_is_seeded():
    first = list(itertools.islice(soak(), 50))
    assert first == list(itertools.islice(soak(), 50))
    assert first != list(itertools.islice(soak(seed=8), 50))
    assert len({r["id"] for r in first}) == 50


def test_soak_mix_stays_within_its_limits_and_mixes():
    reqs = list(itertools.islice(soak(), 2000))
    lengths = [len(r["prompt"]) for r in reqs]
    assert min(lengths) >= 1 and max(lengths) <= 600
    assert min(lengths) < 20 and max(lengths) > 400  # short and long prompts both
    assert all(3 <= t < VOCAB for r in reqs for t in r["prompt"])
    assert all(1 <= r["max_tokens"] <= 20 for r in reqs)
    kinds = [r["kind"] for r in reqs]
    assert 0.25 < (len(kinds) - kinds.count("complete")) / len(kinds) < 0.35
    for r in reqs:
        if r["kind"] == "complete":
            assert r["stop_after"] is None and r["abort_after_s"] is None
        elif r["kind"] == "decode":
            assert 1 <= r["stop_after"] < r["max_tokens"] and r["abort_after_s"] is None
        else:
            assert r["stop_after"] == 1 and 0 <= r["abort_after_s"] < 0.5
    shared = [r for r in reqs if r["shared_prefix"] >= 16]
    assert 0.3 < sum(r["shared_prefix"] > 0 for r in reqs) / len(reqs) < 0.7
    heads = {tuple(r["prompt"][:16]) for r in shared}
    assert len(heads) <= 4  # every shared prefix opens with one of the 4 fixed prompts: cache hits
    assert all(r["kind"] == "complete" for r in itertools.islice(soak(abort_fraction=0.0), 200))


def records(**change) -> dict:
    phase = {"server_alive": True, "num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0.0}
    result = {
        "totals": {"request_errors": 0, "bad_logprobs": 0, "corrupted_requests": 0, "aborted_mid_prefill": 2,
                   "aborted_mid_decode": 3, "mismatches_vs_solo": 0},
        "checks": {"server_alive": True}, "hung_requests": [],
        "phases": [{**phase, "phase": p, "gpu_memory_mib": m} for p, m in (
            ("start", 900.0), ("round 0", 1200.0), ("round 1", 1210.0), ("rounds", 1210.0), ("bad_requests", 1210.0),
            ("soak", 1250.0))],
        "bad_requests": [{"case": "max_tokens_0", "status": 400, "answered": True, "served_after": True,
                          "idle_after": True, "after_error": None, "after_bad_logprobs": 0, "log_errors": []}],
        "soak": {"requests": 40, "completed": 30, "aborted": 9, "errors": 0, "nan": 0, "mismatches": 0, "replays": 4,
                 "cached_tokens": 800, "longest_prompt": 590, "wall_s": 30.0, "server_errors": []}}
    for path, value in change.items():
        *keys, last = path.split("__")
        target = result
        for key in keys:
            target = target[int(key)] if isinstance(target, list) else target[key]
        target[int(last) if isinstance(target, list) else last] = value
    return result


def test_summary_of_a_clean_run():
    out = rel.summarize(records(), memory_slack_mib=128)
    s = out["summary"]
    assert out["passed"] and all(out["checks"].values())
    assert s["errors"] == 0 and s["nan"] == 0 and s["mismatches"] == 0
    assert s["aborted"] == 2 + 3 + 9 and s["memory_growth_mib"] == 50.0  # from round 0 on, not from the start
    assert s["kv_usage_after"]["soak"] == 0.0 and s["bad_requests"] == [
        {"case": "max_tokens_0", "status": 400, "served_after": True}]
    assert s["soak"]["requests"] == 40 and "no_gpu_memory_growth" in out["checks"]


@pytest.mark.parametrize(("change", "check"), [
    ({"soak__errors": 1}, "soak_no_errors"), ({"soak__nan": 2}, "soak_no_nan"),
    ({"soak__mismatches": 1}, "soak_replays_equal_solo"), ({"soak__replays": 0}, "soak_replays_equal_solo"),
    ({"soak__aborted": 0}, "soak_ran"), ({"soak__server_errors": ["ERROR x"]}, "no_server_errors_in_soak"),
    ({"bad_requests__0__answered": False}, "bad_requests_answered"),
    ({"bad_requests__0__served_after": False}, "served_after_every_bad_request"),
    ({"bad_requests__0__idle_after": False}, "closed_requests_left_the_engine"),
    ({"bad_requests__0__log_errors": ["(Worker) ERROR ..."]}, "no_server_errors_in_bad_requests"),
    ({"phases__4__kv_cache_usage_perc": 0.02}, "engine_idle_after_every_phase"),
    ({"phases__5__server_alive": False}, "engine_idle_after_every_phase"),
    ({"phases__5__gpu_memory_mib": 1400.0}, "no_gpu_memory_growth"),
    ({"checks__server_alive": False}, "server_alive")])
def test_a_failure_fails_its_check_and_the_run(change, check):
    out = rel.summarize(records(**change), memory_slack_mib=128)
    assert not out["checks"][check] and not out["passed"]
    assert sum(not v for v in out["checks"].values()) == 1, out["checks"]


def test_a_case_not_sent_is_listed_and_judged_by_nobody():
    result = records()
    result["bad_requests"].append({"case": "token_outside_vocab", "sent": "s", "expect": "error",
                                   "status": rel.NO_TOKENIZER})
    out = rel.summarize(result, memory_slack_mib=128)
    assert out["passed"] and out["summary"]["bad_requests"][-1] == {
        "case": "token_outside_vocab", "status": rel.NO_TOKENIZER, "served_after": None}


def test_no_gpu_no_memory_check():
    result = records()
    for p in result["phases"]:
        p["gpu_memory_mib"] = None
    out = rel.summarize(copy.deepcopy(result), memory_slack_mib=128)
    assert out["summary"]["memory_growth_mib"] is None and "no_gpu_memory_growth" not in out["checks"]
    assert out["passed"]


def test_error_counts_add_up():
    out = rel.summarize(records(totals__request_errors=2, soak__errors=1, bad_requests__0__after_error="HTTP 500",
                                totals__corrupted_requests=1, soak__nan=3), memory_slack_mib=128)
    assert out["summary"]["errors"] == 4 and out["summary"]["nan"] == 4


@pytest.mark.parametrize(("device", "tag"), [("nvidia-h200", "h200"), ("cpu", "cpu"),
                                             ("nvidia-a100-sxm4-80gb", "a100"), ("nvidia-h100-80gb-hbm3", "h100")])
def test_device_tag(device, tag):
    assert rel.device_tag(device) == tag


def test_quick_mode_and_bad_options(capsys):
    args = rel.parse_args(["--quick"])
    assert args.streams == 8 and args.soak_s == 30 and args.max_prompt == 512 and args.max_model_len == 2048
    assert args.out.name == f"reliability_{rel.device_tag(args.device)}.json"
    assert rel.parse_args(["--quick", "--soak-s", "5"]).soak_s == 5  # an explicit option beats --quick
    full = rel.parse_args([])
    assert (full.rounds, full.streams, full.prompt_max, full.max_prompt) == (5, 64, 16384, 32768)
    for argv, option in ((["--quick", "--max-prompt", "4000"], "--max-prompt"),
                         (["--quick", "--soak-abort-fraction", "2"], "--soak-abort-fraction"),
                         (["--quick", "--soak-streams", "0"], "--soak-streams")):
        with pytest.raises(SystemExit) as exc:
            rel.parse_args(argv)
        assert exc.value.code == 2 and f"error: {option}" in capsys.readouterr().err
