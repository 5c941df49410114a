"""Every command the README shows works: make targets, install lines, `vllm serve` flags, `dcp-triton plan`, `LLM(...)`."""

import ast
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
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
    ci = (ROOT / ".ci" / "run").read_text()
    shown = {c[1] for c in commands("make ")}
    assert {"demo", "test"} <= shown
    for target in shown | set(re.findall(r"`make ([\w-]+)`", README)) | set(re.findall(r"^make ([\w-]+)$", ci, re.M)):
        assert re.search(rf"^{target}:", makefile, flags=re.M), target
    assert "make test" in ci.splitlines()  # CI runs exactly the README's test command


def test_install_lines_need_no_published_package():
    """dcp-triton is not on PyPI: every install is of the clone (`.[extra]`) or of the wheel built from it."""
    extras = PROJECT["optional-dependencies"]
    wheel = f"dist/{PROJECT['name'].replace('-', '_')}-{PROJECT['version']}-py3-none-any.whl"  # pure Python
    targets = [cmd[-1] for cmd in commands("pip install")]
    for target in targets:
        match = re.fullmatch(r"(\.|dist/[^\[]+)\[(\w+)\]", target)
        assert match and match[1] in (".", wheel) and match[2] in extras, f"{target}: not the clone or {wheel}"
    assert wheel in {t.split("[")[0] for t in targets}
    (build,) = commands("pip wheel")
    assert build[2] == "." and "--no-deps" in build and build[build.index("-w") + 1] == "dist"


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


def test_vllm_extra_admits_exactly_the_supported_release_lines():
    """``pip install ".[vllm]"`` never picks a vLLM that the plugin would decline to register with."""
    from packaging.requirements import Requirement

    from dcp_plugin.adapters.vllm.compat import SUPPORTED_VLLM

    (requirement,) = [Requirement(r) for r in PROJECT["optional-dependencies"]["vllm"]]
    assert requirement.name == "vllm"
    for version in (f"0.{minor}.{patch}" for minor in range(24, 37) for patch in (0, 1, 4)):
        supported = any(spec.contains(version) for spec, _ in SUPPORTED_VLLM["vllm"])
        assert requirement.specifier.contains(version) == supported, version
