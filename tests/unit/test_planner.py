import json

import pytest

from dcp_plugin.cli import main
from dcp_plugin.planner import ModelShape, make_plan

SEEDS = ["--q-heads", "32", "--kv-heads", "2", "--head-dim", "128", "--layers", "60", "--tp", "4", "--dcp", "4",
         "--layout", "group"]


def test_plan_table_for_the_seeds_topology(capsys):
    assert main(["plan", *SEEDS, "--kv-budget-gib", "10"]) == 0
    text = capsys.readouterr().out
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    # tp, dcp, Q heads, stored KV heads, cur-chunk KV as "[a," "b)", bytes/stored token, bytes/context token, max
    assert [r[:4] for r in rows] == [["0", "0", "0-7", "0-1"], ["1", "1", "8-15", "0-1"],
                                     ["2", "2", "16-23", "0-1"], ["3", "3", "24-31", "0-1"]]
    assert [" ".join(r[4:6]) for r in rows] == ["[0, 1)", "[0, 1)", "[1, 2)", "[1, 2)"]
    per_stored = 2 * 128 * 2 * 60 * 2  # K+V, head_dim, bf16 bytes, layers, 2 stored KV heads
    assert all(r[6] == f"{per_stored:,}" for r in rows)
    assert all(r[7] == f"{per_stored // 4:,}" for r in rows)  # each rank stores a quarter of the tokens
    assert all(r[8] == f"{10 * 2**30 // (per_stored // 4):,}" for r in rows)
    assert "max(1, tp / kv_heads) = 2x" in text
    assert "KV capacity gain over dcp_size=1: 2x" in text


def test_plan_json_and_config_file(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
                                  "num_hidden_layers": 30, "torch_dtype": "bfloat16"}))
    assert main(["plan", "--config", str(config), "--tp", "3", "--dcp", "3", "--layout", "group", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"] == {"num_q_heads": 9, "num_kv_heads": 3, "head_dim": 64, "num_layers": 30,
                             "dtype": "bfloat16"}
    assert [r["stored_kv_heads"] for r in plan["ranks"]] == [[0, 3]] * 3
    assert [r["current_chunk_kv"] for r in plan["ranks"]] == [[0, 1], [1, 2], [2, 3]]
    assert plan["capacity_gain"] == 1.0 and plan["capacity_ceiling"] == 1.0
    assert any("buys no KV capacity" in note for note in plan["notes"])


def test_capacity_gain_never_exceeds_the_duplication_ceiling():
    for kv_heads, tp in [(1, 8), (2, 8), (8, 8), (4, 16)]:
        for dcp in [d for d in range(1, tp + 1) if tp % d == 0]:
            model = ModelShape(num_q_heads=64, num_kv_heads=kv_heads, head_dim=128, num_layers=1)
            plan = make_plan(model, tp_size=tp, dcp_size=dcp, layout="group")
            assert plan.capacity_gain <= plan.capacity_ceiling + 1e-9
            assert plan.capacity_ceiling == max(1, tp / kv_heads)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--q-heads", "32", "--kv-heads", "2"], "missing.*--head-dim.*--layers"),
        (SEEDS[:-2] + ["--layout", "tp"], "kv_replication='group'"),
        (["--q-heads", "32", "--kv-heads", "8", "--head-dim", "128", "--layers", "1", "--tp", "4", "--dcp", "3"],
         "attn_dcp_size=3 must divide tp_size=4"),
        (SEEDS + ["--interleave", "3"], "interleave=3 must divide block_size=16"),
        (SEEDS + ["--kv-budget-gib", "-1"], "kv_budget_gib must be > 0"),
    ],
)
def test_plan_errors_are_clear(argv, match, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dcp-triton plan: error:")
    import re

    assert re.search(match, err), err


def test_config_dtype_from_either_key(tmp_path):
    config = tmp_path / "config.json"
    shape = {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 2}
    config.write_text(json.dumps({**shape, "dtype": "float32"}))  # transformers 5 spelling
    assert ModelShape.from_hf_config(config).dtype == "float32"
    config.write_text(json.dumps({**shape, "torch_dtype": "float16"}))
    assert ModelShape.from_hf_config(config).dtype == "float16"


def test_config_without_heads_is_refused(tmp_path):
    config = tmp_path / "config.json"
    config.write_text("{}")
    with pytest.raises(ValueError, match="num_attention_heads"):
        ModelShape.from_hf_config(config)
