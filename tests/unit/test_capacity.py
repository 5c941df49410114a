import json
import subprocess
import sys
import time

import pytest

from dcp_plugin.cli import main
from dcp_plugin.capacity import ModelShape, capacity_report

# 32 Q / 4 KV heads at tp 8: TP stores each KV head on 2 ranks, so DCP 2 halves the KV per rank, DCP 4 and 8 split
# a DCP group over two KV heads (refused).
GQA4 = ["--q-heads", "32", "--kv-heads", "4", "--head-dim", "128", "--layers", "60", "--tp", "8"]


def table_rows(text: str) -> list[list[str]]:
    """The comparison table's rows (the chosen one's * dropped), split on runs of two or more spaces."""
    import re

    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["dcp"])
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows.append(re.split(r" {2,}", line.replace("*", " ").strip()))
    return rows


def test_plan_compares_the_dcp_sizes_vllm_runs(capsys):
    assert main(["plan", *GQA4, "--dcp", "2", "--kv-budget-gib", "10"]) == 0
    text = capsys.readouterr().out
    per_token = 2 * 128 * 2 * 60  # K+V, head_dim, bf16 bytes, layers: one stored KV head per rank
    # dcp, KV heads/rank, prefix Q heads, KV B/token, capacity, max tokens, per layer
    assert table_rows(text) == [
        ["1", "1", "4", f"{per_token:,}", "1x", f"{10 * 2**30 // per_token:,}", "no collectives"],
        ["2", "1", "8", f"{per_token // 2:,}", "2x", f"{10 * 2**30 // (per_token // 2):,}",
         "Q all-gather + LSE merge"]]
    assert "*    2" in text  # the --dcp asked for is marked
    assert "dcp 4, 8: not runnable" not in text  # each refused size names its own number
    assert "dcp 4: not runnable (tp / KV heads = 2 ranks share each KV head, which is not a multiple of 4)" in text
    assert "max(1, tp / KV heads) = 2x" in text
    assert "legend:" in text and "layout" not in text  # no advice the vLLM adapter cannot follow


def test_plan_says_when_dcp_buys_nothing(capsys):
    assert main(["plan", "--q-heads", "32", "--kv-heads", "8", "--head-dim", "128", "--layers", "32", "--tp",
                 "8"]) == 0
    text = capsys.readouterr().out
    assert [row[0] for row in table_rows(text)] == ["1"]
    assert "DCP buys nothing at tp 8 for this model" in text
    assert "dcp 2, 4, 8: not runnable (tp 8 is not more than the 8 KV heads" in text


def test_plan_json_lists_every_runnable_size(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_attention_heads": 16, "num_key_value_heads": 1, "hidden_size": 1024,
                                  "num_hidden_layers": 4, "torch_dtype": "bfloat16"}))
    assert main(["plan", "--config", str(config), "--tp", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"] == {"num_q_heads": 16, "num_kv_heads": 1, "head_dim": 64, "num_layers": 4,
                             "dtype": "bfloat16", "linear_layers": 0, "draft_layers": 0}
    assert [(o["dcp_size"], o["prefix_q_heads"], o["capacity"]) for o in plan["options"]] == [
        (1, 4, 1.0), (2, 8, 2.0), (4, 16, 4.0)]
    assert plan["not_runnable"] == {} and plan["engine"] == "vllm"


def test_capacity_gain_never_exceeds_the_duplication_ceiling():
    for kv_heads, tp in [(1, 8), (2, 8), (8, 8), (4, 16)]:
        for dcp in [d for d in range(1, tp + 1) if tp % d == 0]:
            model = ModelShape(num_q_heads=64, num_kv_heads=kv_heads, head_dim=128, num_layers=1)
            report = capacity_report(model, tp_size=tp, dcp_size=dcp, layout="replicated")
            assert report.capacity_gain <= report.capacity_ceiling + 1e-9
            assert report.capacity_ceiling == max(1, tp / kv_heads)


@pytest.mark.parametrize(
    "config, error",
    [
        # DeepSeek-V3's attention keys: MLA, whose 128 "KV heads" of size 56 are not what its cache holds
        ({"hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128, "num_hidden_layers": 61,
          "kv_lora_rank": 512, "q_lora_rank": 1536},
         "kv_lora_rank=512: multi-head latent attention (MLA) is not supported"),
        ({"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 100, "num_hidden_layers": 2},
         "head_dim=100: supported head sizes are 64, 80, 96, 128, 256"),
        ({"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 2,
          "sliding_window": 4096}, "sliding_window=4096: sliding-window attention is not supported"),
        ({"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "num_hidden_layers": 2,
          "sliding_window": 4096, "layer_types": ["sliding_attention", "full_attention"]},
         "sliding_window=4096: sliding-window attention is not supported; layer_types has sliding_attention"),
    ],
)
def test_plan_refuses_what_the_backend_refuses(config, error, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    line = refusal(["--config", str(path), "--tp", "8"], capsys)
    assert line.startswith(f"--config {path}: dcp-triton cannot run this model: "), line
    assert error in line, line


def test_a_disabled_sliding_window_is_not_refused(tmp_path, capsys):
    path = tmp_path / "config.json"  # Qwen2's configs carry a window they do not use
    path.write_text(json.dumps({"num_attention_heads": 40, "num_key_value_heads": 8, "hidden_size": 5120,
                                "num_hidden_layers": 2, "sliding_window": 131072, "use_sliding_window": False}))
    assert main(["plan", "--config", str(path), "--tp", "8"]) == 0, capsys.readouterr().err


def test_version_and_help_are_instant_and_import_no_torch():
    code = ("import sys, dcp_plugin.cli as c\n"
            "try:\n    c.main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    for argv in (["--version"], ["--help"], ["plan", "--help"]):
        started = time.perf_counter()
        result = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert time.perf_counter() - started < 3, argv  # torch alone takes seconds to import
    assert result.stdout.startswith("usage: dcp-triton plan")
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    version = subprocess.run([sys.executable, "-c", code, "--version"], capture_output=True, text=True).stdout
    assert version.strip() == f"dcp-triton {project['version']}"


SHAPE = ["--q-heads", "32", "--kv-heads", "8", "--head-dim", "128", "--layers", "1"]
# What a CLI user must never see: the library's field names, which are not flags.
INTERNAL_NAMES = ("TokenLayout", "ParallelState", "kv_replication", "num_q_heads", "kv_budget_gib", "tp_size",
                  "dcp_size", "block_size", "Traceback")


def refusal(argv: list[str], capsys) -> str:
    """The error of a ``dcp-triton plan`` refused (exit 2): one line, no usage block."""
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *argv])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("dcp-triton plan: error: "), captured
    (line,) = captured.err.splitlines()
    assert not any(name in captured.err for name in INTERNAL_NAMES), captured.err
    return line.removeprefix("dcp-triton plan: error: ")


@pytest.mark.parametrize("flag", ["--tp", "--dcp", "--q-heads", "--kv-heads", "--head-dim", "--layers"])
def test_non_positive_sizes_are_refused_by_flag(flag, capsys):
    assert refusal([*SHAPE, flag, "0"], capsys) == f"{flag} must be >= 1, got 0"


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--q-heads", "32", "--kv-heads", "2"],
         "give --config or all of --q-heads --kv-heads --head-dim --layers (missing --head-dim --layers)"),
        (GQA4 + ["--dcp", "4"],
         "--dcp 4 at --tp 8: tp / KV heads = 2 ranks share each KV head, which is not a multiple of 4; use --dcp in "
         "[1, 2]"),
        (["--q-heads", "32", "--kv-heads", "8", "--head-dim", "128", "--layers", "1", "--tp", "8", "--dcp", "2"],
         "--dcp 2 at --tp 8: tp 8 is not more than the 8 KV heads: every rank already stores KV heads of its own, "
         "so there is no duplicate to remove; use --dcp in [1]"),
        (["--q-heads", "8", "--kv-heads", "1", "--head-dim", "64", "--layers", "1", "--tp", "16"],
         "--tp 16: it must divide the 8 Q heads; use one of [1, 2, 4, 8]"),
        (["--q-heads", "32", "--kv-heads", "8", "--head-dim", "100", "--layers", "1"],
         "--head-dim 100: dcp-triton supports head sizes 64, 80, 96, 128, 256"),
        (SHAPE + ["--tp", "4", "--dcp", "3"],
         "--dcp 3 must divide --tp 4 (DCP groups are carved out of the TP ranks); use --dcp in [1, 2, 4]"),
        (GQA4 + ["--kv-budget-gib", "-1"],
         "--kv-budget-gib must be a number > 0 (GiB of KV cache per rank), got -1.0"),
        (GQA4 + ["--kv-budget-gib", "inf"],
         "--kv-budget-gib must be a number > 0 (GiB of KV cache per rank), got inf"),
        (SHAPE + ["--tp", "3"], "--tp 3: it must divide the 32 Q heads; use one of [1, 2, 4, 8, 16, 32]"),
        (["--q-heads", "9", "--kv-heads", "4", "--head-dim", "64", "--layers", "1"],
         "--q-heads 9 is not a multiple of --kv-heads 4: every KV head serves the same number of Q heads"),
        (["--q-heads", "24", "--kv-heads", "4", "--head-dim", "64", "--layers", "1", "--tp", "6"],
         "--tp 6: vLLM gives each rank whole KV heads, so it must divide the 4 KV heads or be a multiple of them; "
         "use one of [1, 2, 4, 8, 12, 24]"),
    ],
)
def test_plan_errors_name_the_flag_and_what_works(argv, error, capsys):
    assert refusal(argv, capsys) == error


def test_tp_zero_is_refused_not_divided_by(capsys):
    assert refusal(["--tp", "0", *GQA4[:-2]], capsys) == "--tp must be >= 1, got 0"  # was a ZeroDivisionError


@pytest.mark.parametrize(
    "config, argv, error",
    [
        ({}, [], "has no num_attention_heads (pass --q-heads), head_dim or hidden_size (pass --head-dim), "
                 "num_hidden_layers (pass --layers)"),
        ({"num_attention_heads": 8, "num_hidden_layers": 2}, [], "has no head_dim or hidden_size (pass --head-dim)"),
        ({"hidden_size": 512, "num_hidden_layers": 2}, [], "has no num_attention_heads (pass --q-heads)"),
        ({"num_attention_heads": 0, "hidden_size": 64, "num_hidden_layers": 2}, [],
         ": num_attention_heads is 0, not a positive int; override it with --q-heads"),
        ({"num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "num_hidden_layers": 2}, ["--tp", "4"],
         "--tp 4: it must divide the 9 Q heads; use one of [1, 3, 9]"),
        ("not json", [], ": not a JSON file (Expecting value"),
        ([1, 2], [], ": a config.json holds a JSON object, this one holds a list"),
    ],
)
def test_config_errors_name_the_flag_that_fixes_them(config, argv, error, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    line = refusal(["--config", str(path), *argv], capsys)
    assert line.startswith("--config ") or line.startswith("--tp "), line
    assert error in line, line


def test_missing_config_file_is_refused(tmp_path, capsys):
    path = tmp_path / "nowhere.json"
    assert refusal(["--config", str(path)], capsys) == (
        f"--config {path}: No such file or directory (a local checkpoint directory or config.json; a hub model's: "
        "`hf download MODEL config.json --local-dir DIR`, then --config DIR)")


@pytest.mark.parametrize(
    "config, argv, model",
    [
        # the advice of the errors above, followed: the flags supply what the config lacks
        ({"num_attention_heads": 8, "num_hidden_layers": 2}, ["--head-dim", "64"], (8, 8, 64, 2)),
        ({"hidden_size": 512, "num_key_value_heads": 2}, ["--q-heads", "8", "--layers", "3"], (8, 2, 64, 3)),
        # and override what it says
        ({"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 30},
         ["--layers", "4", "--kv-heads", "4"], (8, 4, 64, 4)),
    ],
)
def test_shape_flags_complete_and_override_the_config(config, argv, model, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["plan", "--config", str(path), *argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["model"]
    assert (got["num_q_heads"], got["num_kv_heads"], got["head_dim"], got["num_layers"]) == model


def test_dtype_defaults_to_the_configs_then_bfloat16(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_attention_heads": 8, "head_dim": 64, "num_hidden_layers": 2,
                                "torch_dtype": "float32"}))
    assert main(["plan", "--config", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["dtype"] == "float32"
    assert main(["plan", *SHAPE, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["dtype"] == "bfloat16"
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "(default: bfloat16; with --config, the config's dtype if it is float16 or float32, else bfloat16)" in \
        " ".join(capsys.readouterr().out.split())


def test_library_errors_name_keyword_arguments():
    model = ModelShape(num_q_heads=8, num_kv_heads=2, head_dim=64, num_layers=1)
    with pytest.raises(ValueError, match=r"tp_size must be an int >= 1, got 0"):
        capacity_report(model, tp_size=0, dcp_size=1)
    with pytest.raises(ValueError, match=r"dcp_size=3 must divide tp_size=4.*allowed: \[1, 2, 4\]"):
        capacity_report(model, tp_size=4, dcp_size=3)
    with pytest.raises(ValueError, match="kv_budget_gib must be a finite number > 0, got inf"):
        capacity_report(model, tp_size=1, dcp_size=1, kv_budget_gib=float("inf"))


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


def test_config_without_head_dim_or_hidden_size_is_a_value_error(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_attention_heads": 8, "num_hidden_layers": 2}))  # was a KeyError
    with pytest.raises(ValueError, match="config has no head_dim or hidden_size; pass head_dim= to give it"):
        ModelShape.from_hf_config(config)
    assert ModelShape.from_hf_config(config, head_dim=64).head_dim == 64


@pytest.mark.parametrize("text_config", [None, "x", {"num_attention_heads": 16, "num_key_value_heads": 4,
                                                    "head_dim": 128, "num_hidden_layers": 3}])
def test_text_config_is_read_only_when_it_is_an_object(tmp_path, text_config):
    config = tmp_path / "config.json"
    top = {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 2}
    config.write_text(json.dumps({**top, "text_config": text_config}))  # null or junk used to raise AttributeError
    shape = ModelShape.from_hf_config(config)
    want = text_config if isinstance(text_config, dict) else top
    assert (shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.num_layers) == (
        want["num_attention_heads"], want["num_key_value_heads"], want["head_dim"], want["num_hidden_layers"])
