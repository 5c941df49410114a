"""Every command the README shows parses: make targets, pip extras, `vllm serve` flags, `dcp-triton plan`, `LLM(...)`."""

import ast
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, flags=re.S)
SHELL = [line.split("#")[0].strip() for lang, body in BLOCKS if lang == "" for line in body.splitlines()]
SHELL = [line for line in SHELL if line]


def commands(prefix: str) -> list[list[str]]:
    found = [shlex.split(line) for line in SHELL if line.startswith(prefix)]
    assert found, f"the README shows no `{prefix}` command"
    return found


def test_make_targets_exist():
    makefile = (ROOT / "Makefile").read_text()
    assert {tuple(c) for c in commands("make ")} == {("make", "demo"), ("make", "test")}
    for target in ("demo", "test"):
        assert re.search(rf"^{target}:", makefile, flags=re.M), target
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("make test")


def test_pip_extras_exist():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for cmd in commands("pip install"):
        name, extra = re.fullmatch(r"(dcp-triton)\[(\w+)\]", cmd[-1]).groups()
        assert extra in extras, extra


def test_vllm_serve_flags_parse_with_vllm():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    for cmd in commands("vllm serve"):
        assert cmd[:3] == ["vllm", "serve", "MODEL"]
        args = parser.parse_args(["--model", "MODEL", *cmd[3:]])
        assert args.attention_backend == "dcp-triton"
        assert (args.tensor_parallel_size, args.decode_context_parallel_size) == (8, 4)


def test_api_server_flags_parse_with_vllm():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    for cmd in commands("python -m vllm.entrypoints.openai.api_server"):
        args = parser.parse_args(cmd[3:])
        assert (args.model, args.attention_backend) == ("MODEL", "dcp-triton")


def test_dcp_triton_plan_runs(tmp_path, capsys):
    from dcp_plugin.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
                                  "num_hidden_layers": 4}))
    for cmd in commands("dcp-triton plan"):
        argv = [str(config) if arg == "MODEL/config.json" else arg for arg in cmd[1:]]
        assert main(argv) == 0, capsys.readouterr().err
        assert "capacity gain" in capsys.readouterr().out


def test_llm_snippet_keywords_are_engine_args():
    from vllm.engine.arg_utils import EngineArgs

    (code,) = [body for lang, body in BLOCKS if lang == "python" and "LLM(" in body]
    call = next(node for node in ast.walk(ast.parse(code)) if isinstance(node, ast.Call)
                and getattr(node.func, "id", "") == "LLM")
    kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    args = EngineArgs(**kwargs)
    assert args.attention_backend == "dcp-triton" and args.decode_context_parallel_size == 4


@pytest.mark.parametrize("script", ["offline_generate.py", "dcp_generate.py"])
def test_examples_named_in_the_readme_exist(script):
    assert f"examples/{script}" in README
    assert (ROOT / "examples" / script).is_file()
