"""The layers' import rules, read from the source (every import statement, at any depth): the kernels (``kernels/``, the
bottom layer) import nothing else of dcp_plugin, the engine-neutral core (``dcp_plugin/``) imports neither vLLM nor
SGLang, and the core and the adapters take the kernels through ``dcp_plugin.kernels``' public names and public modules,
never its private ``_*`` modules; no module of the core imports ``dcp_plugin.testing`` (beside it, for the tests and the
benchmarks' checks). And, in a fresh process: what an engine's plugin loading imports (the shared checks, the adapters'
registration) loads neither triton nor the kernels."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "dcp_plugin"
ADAPTERS = ROOT / "adapters"
KERNELS = ROOT / "kernels"


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


@pytest.mark.parametrize("path", sources(CORE), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_core_imports_no_adapter(path):
    adapters = [f"line {line}: {module}" for line, module in imported_modules(path)
                if module.startswith("dcp_plugin.adapters")]
    assert not adapters, f"{path.relative_to(ROOT)} imports an adapter: {adapters}; the adapters sit above the core"


@pytest.mark.parametrize("path", sources(CORE), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_core_never_imports_its_testing_module_nor_the_tests(path):
    """``dcp_plugin.testing`` (float64 references and DCP cases, for the tests and the benchmarks' checks) stands
    beside the core: it imports the core, never the other way round; and nothing of the package imports ``tests``."""
    found = [f"line {line}: {module}" for line, module in imported_modules(path) if module.split(".")[0] == "tests"
             or (module == "dcp_plugin.testing" and path != CORE / "testing.py")]
    assert not found, f"{path.relative_to(ROOT)} imports the testing module or the tests: {found}"


def test_each_engine_enters_through_its_adapter_packages_register():
    import tomllib

    points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert points["vllm.general_plugins"] == {"dcp_triton": "dcp_plugin.adapters.vllm:register"}
    assert points["sglang.srt.plugins"] == {"dcp_triton": "dcp_plugin.adapters.sglang:register"}


@pytest.mark.parametrize("path", sources(CORE) + sources(ADAPTERS), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_core_and_adapters_use_only_the_kernels_public_names(path):
    private = [f"line {line}: {module}" for line, module in imported_modules(path)
               if module.startswith("dcp_plugin.kernels.") and module.split(".")[2].startswith("_")]
    assert not private, (f"{path.relative_to(ROOT)} imports the kernels' private modules: {private}; add a public "
                         "name to dcp_plugin.kernels (kernels/__init__.py) instead")


def top_level_imports(path: Path) -> list[tuple[int, str]]:
    """``imported_modules`` of the module's own body (not inside functions or classes)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, node.module))
    return found


@pytest.mark.parametrize("path", sources(CORE) + sources(ADAPTERS), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_kernels_import_triton_at_the_top(path):
    """Triton comes through the kernels' package, which decides the interpreter (``_mode``) before triton loads; a
    module above it that imported triton first would load it undecided."""
    early = [f"line {line}" for line, module in top_level_imports(path) if module.split(".")[0] == "triton"]
    assert not early, f"{path.relative_to(ROOT)} imports triton at the top ({early}): import it where it is used"


@pytest.mark.parametrize("path", sources(KERNELS), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_kernels_import_nothing_above_them(path):
    above = [f"line {line}: {module}" for line, module in imported_modules(path)
             if module.split(".")[0] == "dcp_plugin" and module.split(".")[:2] != ["dcp_plugin", "kernels"]]
    assert not above, (f"{path.relative_to(ROOT)} imports from above the kernels: {above}; what the kernels and the "
                       "core share lives in dcp_plugin.kernels (checks.py)")


def loaded_by(*modules: str, code: str = "") -> dict:
    """In a fresh process: import ``modules``, run ``code``; whether triton is loaded, and the kernels' modules."""
    script = "\n".join([*(f"import {m}" for m in modules), code, "import json, sys",
                        "print(json.dumps({'triton': 'triton' in sys.modules, 'kernels': sorted(m for m in sys.modules "
                        "if m.startswith('dcp_plugin.kernels'))}))"])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("module", ["dcp_plugin.kernels.checks", "dcp_plugin.adapters.vllm",
                                    "dcp_plugin.adapters.sglang", "dcp_plugin.adapters.vllm.registration",
                                    "dcp_plugin.adapters.vllm.support", "dcp_plugin.adapters.sglang.registration",
                                    "dcp_plugin.adapters.sglang.support"])
def test_plugin_loading_imports_neither_triton_nor_the_kernels(module):
    # An engine imports these while it loads plugins; _mode would ask torch about CUDA, triton takes seconds.
    loaded = loaded_by(module)
    assert not loaded["triton"] and set(loaded["kernels"]) <= {"dcp_plugin.kernels", "dcp_plugin.kernels.checks"}, \
        loaded


def test_the_kernels_public_names_stay_functions_after_their_modules_load():
    # prefix_attention, chunk_attention and write_kv_cache name a function and the submodule that defines it.
    names = loaded_by("dcp_plugin.kernels.prefix_attention", "dcp_plugin.kernels.chunk_attention",
                      "dcp_plugin.kernels.write_kv_cache", code=(
                          "import types; from dcp_plugin import kernels\n"
                          "assert not [n for n in kernels.__all__ if isinstance(getattr(kernels, n), types.ModuleType)]"
                          "\nassert kernels.reference.prefix_attention.__module__ == 'dcp_plugin.kernels.reference'"))
    assert names["triton"] and "dcp_plugin.kernels._mode" in names["kernels"]
