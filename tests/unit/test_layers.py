"""The layers' import rules, read from the source (every import statement, at any depth): the engine-neutral core
(``dcp_plugin/``) imports neither vLLM nor SGLang, and the core and the adapters take the kernels through
``dcp_plugin.kernels``' public names and public modules, never its private ``_*`` modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "dcp_plugin"
ADAPTERS = ROOT / "adapters"


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every import in ``path``: ``import a.b`` gives ``a.b``; ``from a import b, c`` gives
    ``a``, ``a.b`` and ``a.c`` (a name may be a module). The tree imports absolutely: a relative import fails."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}:{node.lineno}: a relative import; the tree imports absolutely"
            found += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def sources(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_rules_see_every_kind_of_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import vllm.config\nfrom dcp_plugin.kernels import _launch\ndef f():\n"
                     "    from sglang.srt import server_args\n")
    assert [m for _, m in imported_modules(probe)] == [
        "vllm.config", "dcp_plugin.kernels", "dcp_plugin.kernels._launch", "sglang.srt", "sglang.srt.server_args"]


@pytest.mark.parametrize("path", sources(CORE), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_core_imports_no_engine(path):
    engines = [f"line {line}: {module}" for line, module in imported_modules(path)
               if module.split(".")[0] in ("vllm", "sglang")]
    assert not engines, f"{path.relative_to(ROOT)} imports an engine: {engines}"


@pytest.mark.parametrize("path", sources(CORE) + sources(ADAPTERS), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_core_and_adapters_use_only_the_kernels_public_names(path):
    private = [f"line {line}: {module}" for line, module in imported_modules(path)
               if module.startswith("dcp_plugin.kernels.") and module.split(".")[2].startswith("_")]
    assert not private, (f"{path.relative_to(ROOT)} imports the kernels' private modules: {private}; add a public "
                         "name to dcp_plugin.kernels (kernels/__init__.py) instead")
