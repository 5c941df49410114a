"""scripts/device/, which runs on the GPU machine only: from /tmp, dcp-triton installed into /tmp/dcp. A call names a
benchmark by its path from the repository root; the script runs its module (``_device.sh``'s ``script_argv`` and
``module_of``; an example by its path, as a user runs it) with the repository root last on PYTHONPATH (``repo_last``),
so ``benchmarks`` comes from the tree and ``dcp_plugin`` from the install, and pytest appends the root rather than
putting it first (``PYTEST``: the root's ``dcp_plugin/`` folder lacks the kernels the install maps into it). Checked
here from the scripts' text and their shared functions in bash."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEVICE = ROOT / "scripts" / "device"
SCRIPTS = sorted(DEVICE.glob("*.sh"))

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def shared(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in bash after sourcing _device.sh (which sets ``repo`` to this tree's root)."""
    return subprocess.run(["bash", "-c", f'source "{DEVICE / "_device.sh"}"; {code}'], capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", **env})


@needs_bash
@pytest.mark.parametrize(("path", "module"), [
    ("benchmarks/vllm_e2e/vllm_hybrid_gpu.py", "benchmarks.vllm_e2e.vllm_hybrid_gpu"),
    ("./benchmarks/kernels/bench_oneshot.py", "benchmarks.kernels.bench_oneshot"),
    (f"{ROOT}/benchmarks/hybrid_spec.py", "benchmarks.hybrid_spec"),
    ("benchmarks/server/server_aborts.py", "benchmarks.server.server_aborts"),
])
def test_a_script_path_names_its_module(path, module):
    done = shared(f'module_of "{path}"')
    assert done.returncode == 0 and done.stdout.strip() == module, done.stderr
    assert (ROOT / (module.replace(".", "/") + ".py")).is_file()


@needs_bash
@pytest.mark.parametrize("path", ["tests/gpu/test_gpu_tier.sh", "/etc/x.py", "benchmarks/../x.py", ""])
def test_what_is_no_script_of_the_tree_is_refused(path):
    done = shared(f'module_of "{path}"')
    assert done.returncode != 0 and not done.stdout and "not a script of the repository" in done.stderr


@needs_bash
@pytest.mark.parametrize(("words", "argv"), [
    ("benchmarks/vllm_e2e/vllm_hybrid_gpu.py --budget-s 330",
     "python3 -m benchmarks.vllm_e2e.vllm_hybrid_gpu --budget-s 330"),
    ("scripts/compile_for_hopper.py --json x", "python3 -m scripts.compile_for_hopper --json x"),
    ("examples/sglang_generate.py --plan-only", "python3 {repo}/examples/sglang_generate.py --plan-only"),
])
def test_a_call_runs_a_benchmark_as_its_module_and_an_example_by_its_path(words, argv):
    done = shared(f'script_argv {words} && printf "%s " "${{ARGV[@]}}"')
    assert done.returncode == 0 and done.stdout.strip() == argv.format(repo=ROOT), done.stderr


@needs_bash
@pytest.mark.parametrize(("before", "after"), [
    ("", "{repo}"), ("/tmp/dcp", "/tmp/dcp:{repo}"), ("/tmp/dcp:/tmp/sgl", "/tmp/dcp:/tmp/sgl:{repo}"),
    ("/tmp/dcp:{repo}", "/tmp/dcp:{repo}"), ("/tmp/dcp:{repo}:/tmp/vs", "/tmp/dcp:{repo}:/tmp/vs"),
])
def test_the_repository_root_comes_last_on_pythonpath_once(before, after):
    env = {"PYTHONPATH": before.format(repo=ROOT)} if before else {}
    done = shared("repo_last", **env)
    assert done.returncode == 0 and done.stdout.strip() == after.format(repo=ROOT), done.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_no_repository_python_file_runs_by_its_path(script):
    """Run by path, a benchmark would find neither ``benchmarks`` nor its siblings (it runs from /tmp)."""
    code = [line.strip() for line in script.read_text().splitlines() if not line.lstrip().startswith("#")]
    by_path = [line for line in code if (re.search(r'python3?\s+"?\$\{?(repo|OLDPWD)\b', line)
               or re.search(r'\$\{?repo\}?"?/(benchmarks|scripts)/[^"\s]*\.py', line)) and "examples/" not in line]
    assert not by_path, f"{script.name} runs repository files by path: {by_path}; use python3 -m \"$(module_of ...)\""


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_pytest_runs_through_the_shared_command(script):
    calls = [line.strip() for line in script.read_text().splitlines() if re.search(r"-m pytest\b", line)
             and not line.lstrip().startswith("#") and not line.startswith("PYTEST=(")]
    assert not calls, f"{script.name} calls pytest itself: {calls}; use \"${{PYTEST[@]}}\" (_device.sh)"
