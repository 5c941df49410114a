"""How the tree's code finds its code: by package name, never by editing ``sys.path``. Benchmarks, examples and tools
run as the pages say (``python -m benchmarks.x.y`` from the repository root, ``python examples/x.py``), the tests as
the packages ``tests`` and ``tests.helpers``; nothing outside ``tests/`` imports the tests, and no test imports or loads
the probes (``benchmarks/probes/``: not maintained, benchmarks/README.md). Read from the source of every Python file of
the repository (the strings included: a script a test writes and runs is code too)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()
# An edit of the import path: sys.path.insert / append / extend / remove / pop, an assignment to it or to a slice.
SYS_PATH_EDIT = re.compile(r"\bsys\.path\s*(?:\.\s*(?:insert|append|extend|remove|pop)\s*\(|\[[^\]]*\]\s*=(?!=)|\+=|="
                           r"(?!=))")
# The edits that stay, and why (each must still be there: a stale exception hides nothing).
ALLOWED_SYS_PATH_EDITS = {
    "kernels/_compile_workers.py": "a compile-ahead worker drops its own sys.path[0] (the engine's folder) for isolation",
    "tests/unit/test_compile_ahead.py": "checks that a worker finds a module where the engine found it on sys.path",
}
OUTSIDE_TESTS = ("benchmarks", "examples", "scripts", "dcp_plugin", "kernels", "adapters")
PROBES = re.compile(r"benchmarks[./]probes\b")


def python_files() -> list[Path]:
    """The repository's Python files: what git tracks or would add (untracked, not ignored); without git, every file
    outside virtual environments and build output."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard", "--",
                             "*.py"], capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout.strip():
        return sorted(ROOT / line for line in listed.stdout.splitlines() if (ROOT / line).is_file())
    def outside_the_tree(part: str) -> bool:  # .git, .venv*, build output
        return part.startswith(".") or part in ("build", "dist", "__pycache__") or part.endswith(".egg-info")

    return sorted(path for path in ROOT.rglob("*.py") if not any(map(outside_the_tree, path.relative_to(ROOT).parts)))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``path`` (``from a import b`` gives ``a`` and ``a.b``), and of every
    ``importlib.import_module("...")`` with a literal name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


def test_the_rules_see_each_kind_of_edit_and_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import sys\nsys.path.insert(0, 'a')\nsys.path[:0] = ['b']\nsys.path.append('c')\n"
                     "sys.path += ['d']\nsys.path = ['e']\nx = sys.path[0]\nok = sys.path == []\n"
                     "SCRIPT = 'import sys; sys.path.extend([1])'\n"
                     "def f():\n    from tests.helpers import kernel_checks\n    import importlib\n"
                     "    importlib.import_module('tests.x')\n")
    text = probe.read_text()
    assert [text[:m.start()].count("\n") + 1 for m in SYS_PATH_EDIT.finditer(text)] == [2, 3, 4, 5, 6, 9]
    assert [m for _, m in imported_modules(probe)] == ["sys", "tests.helpers", "tests.helpers.kernel_checks",
                                                        "importlib", "tests.x"]


def test_no_file_edits_sys_path():
    edits = {}
    for path in python_files():
        if path.resolve() == THIS:
            continue
        text = path.read_text(errors="replace")
        lines = [text[:m.start()].count("\n") + 1 for m in SYS_PATH_EDIT.finditer(text)]
        if lines:
            edits[rel(path)] = lines
    unexpected = {name: lines for name, lines in edits.items() if name not in ALLOWED_SYS_PATH_EDITS}
    assert not unexpected, (f"sys.path edited at {unexpected}: import by package name instead (run a benchmark as "
                            "python -m benchmarks.<folder>.<script> from the repository root; a test imports "
                            "benchmarks.* and tests.helpers.*)")
    stale = sorted(set(ALLOWED_SYS_PATH_EDITS) - set(edits))
    assert not stale, f"exceptions that no longer edit sys.path (drop them from ALLOWED_SYS_PATH_EDITS): {stale}"


@pytest.mark.parametrize("folder", OUTSIDE_TESTS)
def test_nothing_outside_the_tests_imports_them(folder):
    found = [f"{rel(path)}:{line}: {module}" for path in python_files() if rel(path).startswith(f"{folder}/")
             for line, module in imported_modules(path) if module.split(".")[0] == "tests"]
    assert not found, (f"{folder}/ imports the tests: {found}; what both need lives outside tests/ "
                       "(dcp_plugin.testing: float64 references and DCP cases)")


def test_no_test_imports_or_loads_the_probes():
    found = [f"{rel(path)}:{line}: {module}" for path in python_files() if rel(path).startswith("tests/")
             for line, module in imported_modules(path) if module.startswith("benchmarks.probes")]
    found += [f"{rel(path)}:{text[:m.start()].count(chr(10)) + 1}: {m[0]}" for path in python_files()
              if rel(path).startswith("tests/") and path.resolve() != THIS
              for text in [path.read_text(errors="replace")] for m in PROBES.finditer(text)]
    assert not found, f"tests that import, load or name the probes (benchmarks/probes/, not maintained): {found}"


def test_plain_pytest_imports_the_tests_and_the_benchmarks_by_package(tmp_path):
    """``pytest`` from any folder, not only ``python -m pytest`` from the root (which puts the root on the path): the
    package ``tests`` puts the repository root on the path, so ``tests.helpers`` and ``benchmarks`` import."""
    code = "import sys, pytest; sys.exit(pytest.main(sys.argv[1:]))"  # no root on the path: run in tmp_path
    targets = [str(ROOT / "tests" / "unit" / name) for name in ("test_bench_common.py", "test_kernel_merge.py")]
    done = subprocess.run([sys.executable, "-c", code, "--collect-only", "-q", "-p", "no:cacheprovider", *targets],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "test_bench_common.py::" in done.stdout and "test_kernel_merge.py::" in done.stdout, done.stdout[-2000:]


FIND = ("import importlib.util, json, dcp_plugin; print(json.dumps([dcp_plugin.__path__] + [getattr("
        "importlib.util.find_spec(name), 'origin', None) for name in ('dcp_plugin.kernels', 'dcp_plugin.adapters')]))")


def test_the_checkout_root_finds_the_kernels_and_adapters_without_an_editable_install():
    """A process started in the checkout's root imports its ``dcp_plugin/`` ahead of any install: the kernels and
    adapters beside it are found (``python -S``: no site-packages, so no editable install's finder maps them)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-S", "-c", FIND], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    path, kernels, adapters = json.loads(done.stdout)
    assert path == [str(ROOT / "dcp_plugin"), str(ROOT)]
    assert (kernels, adapters) == (str(ROOT / "kernels" / "__init__.py"), str(ROOT / "adapters" / "__init__.py"))


def test_an_installed_package_keeps_its_own_path(tmp_path):
    """Installed, the package holds ``kernels/`` and ``adapters/`` itself: nothing beside it joins its path, even where
    folders of those names lie next to it."""
    site = tmp_path / "site"
    for name in ("dcp_plugin/kernels", "dcp_plugin/adapters", "kernels", "adapters"):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text("")
    (site / "dcp_plugin" / "__init__.py").write_text((ROOT / "dcp_plugin" / "__init__.py").read_text())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-S", "-c", FIND], capture_output=True, text=True, cwd=site, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    path, kernels, _ = json.loads(done.stdout)
    assert path == [str(site / "dcp_plugin")] and kernels == str(site / "dcp_plugin" / "kernels" / "__init__.py")
