"""Compile-ahead in worker processes (``dcp_plugin.kernels._compile_ahead``), on CPU: a driver that answers as an
H100/H200 (sm_90) would lets Triton's own dispatch run its specialization and cache look-up without a GPU. Checked:
variants recorded inside ``compile_ahead`` are compiled by the workers into Triton's cache under the key Triton's
dispatch later looks up (every one a cache hit, while a variant compiled without it is built); a hook set before
still hears compiles that are not recorded and is back afterwards; a failing worker is reported, not raised; the
worker count comes from one variable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from dcp_plugin.kernels import _compile_ahead
from dcp_plugin.kernels._compile_ahead import compile_workers

SCRIPT = textwrap.dedent("""
    import json, logging, os, sys, tempfile
    os.environ["TRITON_INTERPRET"] = "0"  # the kernels defined for the compiler (no GPU would pick the interpreter)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class Sm90:
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 0
        def get_current_target(self): return GPUTarget("cuda", 90, 32)
        def get_active_torch_device(self): return torch.device("cpu")

    driver.set_active(Sm90())
    from dcp_plugin.kernels import _compile_ahead, _launch
    from dcp_plugin.kernels.write_kv_cache import plan_write_kv

    def write_kv(dtype, heads):
        k = torch.zeros(4, heads, 128, dtype=dtype)
        cache = torch.zeros(3, 16, heads, 128, dtype=dtype)
        slots = torch.zeros(4, dtype=torch.int64)
        return plan_write_kv(k, k, cache, cache, slots), (k, k, cache, cache, slots, None, None)

    launches = [write_kv(torch.float16, 8), write_kv(torch.float32, 8), write_kv(torch.float16, 2)]
    hits, heard, out = [], [], {}
    triton.knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])

    def before(*, fn, is_manual_warmup, **kw):
        heard.append(fn.name)
        return None

    triton.knobs.runtime.jit_cache_hook = before
    report = {}
    with _compile_ahead.compile_ahead(2, launchers=False, report=report):
        for launch, args in launches[:2]:
            launch(*args)
            launch(*args)  # the same variant again: recorded once
        with _launch.launches_run():  # a compile asked for outside compile-only mode: not recorded, compiled here
            launch, args = launches[2]
            launch.kernel.warmup(*launch.kernel_tensors(args), *launch.scalars, grid=launch.grid,
                                 **launch.constexprs, **launch.options)
    out["report"], out["heard"], out["hook_back"] = report, list(heard), triton.knobs.runtime.jit_cache_hook is before
    out["compiled_during"] = list(hits)
    hits.clear()
    for launch, args in launches:  # now Triton's dispatch compiles each (compile-only: no launch on this CPU)
        launch.kernel.device_caches[0][0].clear()
    token = _launch.set_compile_only(True)
    for launch, args in launches:
        launch(*args)
    out["hits_after"] = list(hits)
    launch, args = write_kv(torch.float16, 4)  # recorded nowhere: Triton builds it
    hits.clear()
    launch(*args)
    out["control"] = list(hits)
    _launch.reset_compile_only(token)

    failing = {}
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    with _compile_ahead.compile_ahead(1, launchers=False, report=failing):
        class Missing:
            module, name = "no_such_module_here", "kernel"
        triton.knobs.runtime.jit_cache_hook(fn=Missing, compile={"specialization_data": "{}"}, is_manual_warmup=True)
    out["failing"] = failing
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def run():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(line[0][len("RESULT "):]), done.stderr


def test_recorded_variants_are_compiled_by_the_workers_under_the_key_triton_looks_up(run):
    out, _ = run
    assert out["report"] == {"variants": 2, "workers": 2, "failed": 0}
    assert out["compiled_during"] == [False]  # only the variant asked for in launches_run compiled in the parent
    assert out["hits_after"] == [True, True, True]  # the workers' two and the parent's one, all from Triton's cache
    assert out["control"] == [False]  # a variant nobody compiled ahead is built: the check above can fail


def test_a_hook_set_before_hears_what_is_not_recorded_and_is_back_afterwards(run):
    out, _ = run
    assert out["heard"] == ["write_kv_cache_kernel"]
    assert out["hook_back"] is True


def test_a_failing_worker_is_reported_in_one_warning_and_nothing_raises(run):
    out, stderr = run
    assert out["failing"] == {"variants": 1, "workers": 1, "failed": 1}
    warning = [x for x in stderr.splitlines() if "compile-ahead workers failed" in x]
    assert len(warning) == 1 and "no_such_module_here" in warning[0], stderr[-2000:]


@pytest.mark.parametrize(("value", "want"), [("0", 0), ("6", 6), (" 3 ", 3)])
def test_worker_count_from_the_environment(monkeypatch, value, want):
    monkeypatch.setattr(_compile_ahead, "INTERPRET", False)
    monkeypatch.setenv(_compile_ahead.WORKERS_ENV, value)
    assert compile_workers() == want


def test_default_worker_count_is_one_per_cpu_up_to_eight_and_none_with_one(monkeypatch):
    monkeypatch.setattr(_compile_ahead, "INTERPRET", False)
    monkeypatch.delenv(_compile_ahead.WORKERS_ENV, raising=False)
    for cpus, want in ((1, 0), (2, 2), (16, 8)):
        monkeypatch.setattr(_compile_ahead.os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)))
        assert compile_workers() == want


def test_worker_count_refuses_what_is_not_a_count_and_is_off_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(_compile_ahead, "INTERPRET", False)
    monkeypatch.setenv(_compile_ahead.WORKERS_ENV, "many")
    with pytest.raises(ValueError, match="DCP_TRITON_COMPILE_WORKERS must be a whole number of worker processes"):
        compile_workers()
    monkeypatch.setenv(_compile_ahead.WORKERS_ENV, "4")
    monkeypatch.setattr(_compile_ahead, "INTERPRET", True)
    assert compile_workers() == 0
