"""`dcp-triton plan` for SGLang's head layouts, hybrid models and MTP drafts; --config as a directory; a closed pipe.
(The KV heads per rank against SGLang's own ModelConfig: tests/unit/test_sglang_adapter_matrix.py.)"""

import json
import subprocess
import sys

import pytest

from dcp_plugin.capacity import ModelShape
from dcp_plugin.cli import main
from dcp_plugin.dcp_sizes import compare_dcp_sizes, dcp_refusal, kv_heads_per_rank
from dcp_plugin.layout import HeadLayout
from dcp_plugin.parallel_state import ParallelState
from tests.unit.test_capacity import refusal, table_rows

# The seeds' workload: Qwen3.5 (32 Q / 2 KV heads, head_dim 256, Gated-DeltaNet layers beside full attention, an MTP
# layer) at TP 4. Eight layers, the 4th and 8th full attention.
QWEN35 = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
          "text_config": {"num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 256, "hidden_size": 4096,
                          "num_hidden_layers": 8, "mtp_num_hidden_layers": 1, "torch_dtype": "bfloat16",
                          "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2}}


def write(tmp_path, config: dict, name: str = "model"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def plan_json(argv: list[str], capsys) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_seeds_topology_runs_in_sglang_and_is_refused_by_vllm(tmp_path, capsys):
    model = write(tmp_path, QWEN35)
    per_head = 2 * 256 * 2 * 2  # K + V, head_dim, bf16 bytes, the 2 full-attention layers
    sglang = plan_json(["--config", str(model), "--tp", "4", "--engine", "sglang"], capsys)
    assert sglang["kv_layout"] == "replicated"  # read from the architecture
    # DCP 1: TP splits 2 KV heads over 4 ranks (1 each); DCP 2: over tp / dcp = 2 ranks (1 each, tokens halved);
    # DCP 4: every rank stores both, a quarter of the tokens.
    assert [(o["dcp_size"], o["kv_heads_per_rank"], o["kv_bytes_per_token"], o["capacity"])
            for o in sglang["options"]] == [(1, 1, per_head, 1.0), (2, 1, per_head / 2, 2.0),
                                            (4, 2, 2 * per_head / 4, 2.0)]
    assert sglang["model"]["num_layers"] == 2 and sglang["model"]["linear_layers"] == 6
    assert sglang["model"]["draft_layers"] == 1
    vllm = plan_json(["--config", str(model), "--tp", "4"], capsys)
    assert [o["dcp_size"] for o in vllm["options"]] == [1, 2] and list(vllm["not_runnable"]) == ["4"]
    assert refusal(["--config", str(model), "--tp", "4", "--dcp", "4"], capsys).startswith(
        "--dcp 4 at --tp 4: tp / KV heads = 2 ranks share each KV head")
    # SGLang 0.5.17 (and its models other than Qwen3.5) split the KV heads by TP, as vLLM does
    tp_split = plan_json(["--config", str(model), "--tp", "4", "--engine", "sglang", "--kv-layout", "tp"], capsys)
    assert tp_split["options"] == vllm["options"] and tp_split["not_runnable"] == vllm["not_runnable"]


def test_the_table_says_what_the_hybrid_state_and_the_draft_cost(tmp_path, capsys):
    model = write(tmp_path, QWEN35)
    assert main(["plan", "--config", str(model), "--tp", "4", "--engine", "sglang", "--dcp", "4"]) == 0
    text = capsys.readouterr().out
    assert table_rows(text)[-1][:5] == ["4", "2", "32", "1,024", "2x"]
    assert "2 of 8 layers hold a KV cache (the table); the other 6 (linear attention or Mamba) keep a per-request " \
           "state that DCP does not shard" in text
    # the draft runs at DCP 1 with TP's split: 1 KV head per rank, one layer of every token
    assert "MTP draft (1 layer): SGLang runs it at DCP 1 with a KV cache of its own, not sharded: 1 KV head and " \
           f"{2 * 256 * 2:,} B/token per rank at every DCP size" in text
    assert "(--dcp-size)" in text and "--decode-context-parallel-size" not in text


@pytest.mark.parametrize("config, layers", [
    ({"num_hidden_layers": 48, "full_attention_interval": 4}, (12, 36)),  # Qwen3-Next
    ({"num_hidden_layers": 4, "layer_types": ["mamba", "attention", "mamba", "attention"]}, (2, 2)),  # Granite 4
    ({"num_hidden_layers": 6, "hybrid_override_pattern": "M-M*-*"}, (2, 2)),  # Nemotron-H (- is an MLP layer)
    ({"num_hidden_layers": 16, "attn_layer_period": 8, "attn_layer_offset": 4}, (2, 14)),  # Jamba
    ({"num_hidden_layers": 3, "layer_types": ["full_attention"] * 3}, (3, 0)),  # Qwen3
    ({"num_hidden_layers": 5}, (5, 0)),
])
def test_only_layers_with_a_kv_cache_are_counted(config, layers, tmp_path, capsys):
    heads = {"num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128}
    model = plan_json(["--config", str(write(tmp_path, {**heads, **config}))], capsys)["model"]
    assert (model["num_layers"], model["linear_layers"]) == layers


def test_a_model_without_a_kv_layer_is_refused(tmp_path, capsys):
    model = write(tmp_path, {"num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128,
                             "num_hidden_layers": 2, "layer_types": ["mamba", "mamba"]})
    assert refusal(["--config", str(model)], capsys) == (
        f"--config {model / 'config.json'}: every layer is linear attention or Mamba (no KV cache for dcp-triton to "
        "shard); DCP buys nothing for this model")


def test_replicated_layout_refusal_follows_sglangs_kv_split():
    # 12 Q / 3 KV heads at TP 6: tp / dcp = 3 ranks hold one KV head each (DCP 2), 2 ranks would split 3 heads (DCP 3)
    assert dcp_refusal(num_q_heads=12, num_kv_heads=3, tp_size=6, dcp_size=2, kv_layout="replicated") is None
    assert dcp_refusal(num_q_heads=12, num_kv_heads=3, tp_size=6, dcp_size=3, kv_layout="replicated") == (
        "SGLang splits the 3 KV heads over tp / dcp = 2 ranks, a count that neither divides them nor is a multiple "
        "of them")


@pytest.mark.parametrize("q, kv, tp", [(32, 2, 4), (32, 8, 8), (16, 1, 8), (12, 3, 6), (64, 4, 16)])
def test_the_plans_replicated_heads_are_the_backends(q, kv, tp):
    """Where the plan runs a DCP size under SGLang's replicated layout, every rank's backend head layout
    (dcp-triton's own, built from the rank's parallel state) stores the heads the plan counts; where the plan runs
    it under TP's split, the group's Q heads read one KV head, the one TP gave each rank."""
    model = ModelShape(num_q_heads=q, num_kv_heads=kv, head_dim=128, num_layers=1)
    for layout in ("replicated", "tp"):
        options, _ = compare_dcp_sizes(model, tp_size=tp, kv_layout=layout)
        for option in options:
            for rank in range(tp):
                parallel = ParallelState.from_tp(tp_rank=rank, tp_size=tp, dcp_size=option.dcp_size)
                heads = HeadLayout.create(total_q_heads=q, total_kv_heads=kv, parallel=parallel,
                                          kv_replication="replicated")
                assert heads.num_kv_heads == option.kv_heads_per_rank, (layout, option.dcp_size, rank)
                if layout == "tp":
                    tp_heads = HeadLayout.create(total_q_heads=q, total_kv_heads=kv, parallel=parallel,
                                                 kv_replication="tp")
                    assert (heads.kv_head_start, heads.num_kv_heads) == (tp_heads.kv_head_start, tp_heads.num_kv_heads)
    assert kv_heads_per_rank(model, tp_size=tp, dcp_size=1) == max(1, kv // tp)


def test_kv_layout_is_sglangs_option(capsys):
    shape = ["--q-heads", "32", "--kv-heads", "2", "--head-dim", "128", "--layers", "4", "--tp", "4"]
    assert refusal([*shape, "--kv-layout", "replicated"], capsys).startswith(
        "--kv-layout replicated: vLLM stores the KV heads tensor parallelism gives each rank")
    # without --config, SGLang's default is TP's split; the seeds' layout is asked for by name
    assert [o["dcp_size"] for o in plan_json([*shape, "--engine", "sglang"], capsys)["options"]] == [1, 2]
    replicated = plan_json([*shape, "--engine", "sglang", "--kv-layout", "replicated"], capsys)
    assert [o["dcp_size"] for o in replicated["options"]] == [1, 2, 4]


def test_config_takes_a_checkpoint_directory(tmp_path, capsys):
    model = write(tmp_path, {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                             "num_hidden_layers": 3})
    assert plan_json(["--config", str(model)], capsys)["model"]["num_layers"] == 3
    empty = tmp_path / "empty"
    empty.mkdir()
    assert refusal(["--config", str(empty)], capsys) == (
        f"--config {empty}: a directory without config.json; give a Hugging Face checkpoint directory or its "
        "config.json")


def test_a_closed_pipe_ends_the_plan_quietly():
    argv = ["plan", "--q-heads", "32", "--kv-heads", "2", "--head-dim", "128", "--layers", "4", "--tp", "4"]
    proc = subprocess.Popen([sys.executable, "-m", "dcp_plugin.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the table is written (as `| head -0` leaves)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and err == b"", err.decode()
