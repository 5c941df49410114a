"""Compile-ahead in worker processes (``dcp_plugin.kernels._compile_ahead``), on CPU: a driver that answers as an
H100/H200 (sm_90) would lets Triton's own dispatch run its specialization and cache look-up without a GPU. Checked:
variants recorded inside ``compile_ahead`` are compiled by the workers into Triton's cache under the key Triton's
dispatch later looks up (every one a cache hit, while a variant compiled without it is built); a hook set before
still hears compiles that are not recorded and is back afterwards; a failing worker is reported, not raised; the
worker count comes from one variable."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from dcp_plugin.kernels import _compile_ahead
from dcp_plugin.kernels._compile_ahead import compile_workers

SCRIPT = textwrap.dedent("""
    import json, logging, os, stat, sys, tempfile
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

    def ask(launch, args):  # what Launch does in compile-only mode, outside it too
        launch.kernel.warmup(*launch.kernel_tensors(args), *launch.scalars, grid=launch.grid, **launch.constexprs,
                             **launch.options)

    # A ptxas that names another (older, still working) version: what this process's Triton keys compiles on (the
    # version it read first) is not what a new process reads once TRITON_PTXAS_PATH points there (as torch.compile
    # points it at torch's ptxas).
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(90).path  # the ptxas Triton runs for sm_90 (which of its two depends on the release)
    other = os.path.join(tempfile.mkdtemp(), "ptxas")
    with open(other, "w") as f:
        f.write('#!/bin/sh\\nif [ "$1" = --version ]; then echo "Cuda compilation tools, release 12.8, V12.8.93"; '
                f'exit 0; fi\\nexec {ptxas} "$@"\\n')
    os.chmod(other, stat.S_IRWXU)

    launches = [write_kv(torch.float16, 8), write_kv(torch.float32, 8), write_kv(torch.float16, 2)]
    hits, heard, out = [], [], {"times": {}}

    def timed(name, report):  # a report without its seconds (checked apart: they differ run to run)
        out["times"][name] = {key: report.pop(key) for key in ("times", "waited_s") if key in report}
        return report

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
            ask(*launches[2])
        os.environ["TRITON_PTXAS_PATH"] = os.environ["TRITON_PTXAS_BLACKWELL_PATH"] = other
    out["report"], out["heard"], out["hook_back"] = timed("report", report), list(heard), triton.knobs.runtime.jit_cache_hook is before
    out["compiled_during"] = list(hits)
    hits.clear()
    for launch, args in launches:  # now Triton's dispatch compiles each (no launch on this CPU)
        launch.kernel.device_caches[0][0].clear()
        ask(launch, args)
    out["hits_after"] = list(hits)
    hits.clear()
    ask(*write_kv(torch.float16, 4))  # recorded nowhere: Triton builds it
    out["control"] = list(hits)

    again = {}
    with _compile_ahead.compile_ahead(2, launchers=False, report=again):  # all in Triton's cache: no worker starts
        for launch, args in launches[:2]:
            launch.kernel.device_caches[0][0].clear()
            launch(*args)
    out["again"] = again

    # Kernels of another package: compiled here as usual, even in compile-only mode, never recorded.
    probe_dir = tempfile.mkdtemp()
    probe = ("import triton\\nimport triton.language as tl\\n\\n\\n"
             "@triton.jit\\ndef probe_kernel(x, N: tl.constexpr):\\n")
    with open(os.path.join(probe_dir, "ahead_probe.py"), "w") as f:
        f.write(probe + "    tl.store(x + tl.arange(0, N), tl.zeros([N], tl.float32))\\n"
                "\\n\\ndef make():\\n    @triton.jit\\n    def nested(x):\\n        tl.store(x, 1.0)\\n"
                "    return nested\\n")
    sys.path.insert(0, probe_dir)
    import ahead_probe
    nested = ahead_probe.make()  # before the module's file changes below
    foreign = {}
    hits.clear()
    with _compile_ahead.compile_ahead(1, launchers=False, report=foreign):
        _launch.Launch(ahead_probe.probe_kernel, (1,), (), {"N": 8}, num_warps=1)(torch.zeros(8))
    out["foreign"], out["foreign_hits"] = foreign, list(hits)

    # With the probe's module recorded too: its source changes between the recording and the worker's import. The
    # worker compiles nothing where this process would not look, names the part of the key that differs, and still
    # compiles the rest of its share.
    _compile_ahead._RECORDED_PACKAGES = ("dcp_plugin.", "ahead_probe")
    moved = {}
    with _compile_ahead.compile_ahead(1, launchers=False, report=moved):
        _launch.Launch(ahead_probe.probe_kernel, (1,), (), {"N": 16}, num_warps=1)(torch.zeros(16))
        write_kv(torch.float16, 32)[0](*write_kv(torch.float16, 32)[1])
        with open(os.path.join(probe_dir, "ahead_probe.py"), "w") as f:
            f.write(probe + "    tl.store(x + tl.arange(0, N), tl.zeros([N], tl.float32) + 1.0)\\n")
    out["moved"] = timed("moved", moved)

    # A kernel this process cannot name for a worker (defined inside a function): planning fails, nothing raises.
    unnamed = {}
    with _compile_ahead.compile_ahead(1, launchers=False, report=unnamed):
        _launch.Launch(nested, (1,), (), {}, num_warps=1)(torch.zeros(1))
    out["unnamed"] = unnamed

    # An error inside the block: it propagates, the hook before is back, compile-only mode is off.
    try:
        with _compile_ahead.compile_ahead(2, launchers=False):
            raise KeyError("inside")
    except KeyError:
        out["raised"] = [triton.knobs.runtime.jit_cache_hook is before, _launch.compile_only()]

    # Two threads recording at once (ranks as threads): each its own variants, the hook before back afterwards.
    import threading
    reports = [{}, {}]

    def rank(i):
        with _compile_ahead.compile_ahead(1, launchers=False, report=reports[i]):
            launch, args = write_kv((torch.float16, torch.float32)[i], 24)  # variants no step above compiled
            launch(*args)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    out["threads"] = [timed(f"thread{i}", r) for i, r in enumerate(reports)] + [triton.knobs.runtime.jit_cache_hook is before]

    # Started without waiting (an engine's profiling run): the worker compiles while this process goes on, and
    # join_early waits for it and reports; Triton's dispatch then finds the variant in its cache.
    early = {}
    with _compile_ahead.compile_ahead(2, launchers=False, report=early, wait=False):
        launch, args = write_kv(torch.bfloat16, 8)  # a dtype no block above compiled
        launch(*args)
    out["early_started"] = dict(early)
    out["early_joined"] = timed("early_joined", _compile_ahead.join_early())
    out["early_report"] = timed("early_report", early)
    hits.clear()
    launch.kernel.device_caches[0][0].clear()
    ask(launch, args)
    out["early_hits"] = list(hits)
    out["early_again"] = _compile_ahead.join_early()

    # Workers started ahead (an engine building its model) wait; the next compile-ahead hands its list to them, and
    # what changed in between (the cache folder, a cache-invalidating variable) is the engine's at the hand-over.
    from dcp_plugin.kernels import _compile_workers
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # nothing remembered there: they start
    out["ahead_started"] = _compile_workers.stand_by(2)
    waiting = list(_compile_workers._standby["procs"])
    out["ahead_again"] = _compile_workers.stand_by(2)  # two wait already: none more
    spawn, _compile_workers._spawn = _compile_workers._spawn, None  # a worker started now would fail the block
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
    os.environ["TRITON_DISABLE_LINE_INFO"] = "1"
    ahead = {}
    with _compile_ahead.compile_ahead(2, launchers=False, report=ahead):
        launches_ahead = [write_kv(torch.float16, 40), write_kv(torch.float32, 40)]
        for launch, args in launches_ahead:
            launch(*args)
    out["ahead"] = timed("ahead", ahead)
    out["ahead_exits"] = [p.wait(timeout=60) for p in waiting]
    hits.clear()
    for launch, args in launches_ahead:
        launch.kernel.device_caches[0][0].clear()
        ask(launch, args)
    out["ahead_hits"] = list(hits)
    _compile_workers._spawn = spawn
    out["ahead_warm"] = _compile_workers.stand_by(2)  # what the last compile-ahead recorded is cached: none start
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
    out["ahead_cold"] = _compile_workers.stand_by(1)
    released = list(_compile_workers._standby["procs"])
    _compile_workers.release()
    out["released_exits"] = [p.wait(timeout=60) for p in released]
    del os.environ["TRITON_DISABLE_LINE_INFO"]

    failing = {}
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    sys.executable = "/bin/false"  # a worker that exits at once, with status 1
    with _compile_ahead.compile_ahead(1, launchers=False, report=failing):
        launch, args = write_kv(torch.float16, 16)
        launch(*args)
    out["failing"] = timed("failing", failing)
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The script in a working directory whose json.py would shadow the standard library's in a process that puts
    the directory first on its path (the script itself runs with -P, which does not; so must the workers)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cwd = tmp_path_factory.mktemp("engine_cwd")
    (cwd / "json.py").write_text("raise ImportError('the working directory shadowed the standard library')\n")
    done = subprocess.run([sys.executable, "-P", "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600,
                          cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(line[0][len("RESULT "):]), done.stderr


def test_recorded_variants_are_compiled_by_the_workers_under_the_key_triton_looks_up(run):
    out, _ = run
    assert out["report"] == {"variants": 2, "missing": 2, "compiled": 2, "workers": 2, "failed": 0}
    assert out["compiled_during"] == [False]  # only the variant asked for in launches_run compiled in the parent
    # the workers' two from Triton's cache, although a new process's ptxas names another version than this process
    # keyed its compiles on (the third, the parent's own, from the cache too)
    assert out["hits_after"] == [True, True, True]
    assert out["control"] == [False]  # a variant nobody compiled ahead is built: the check above can fail


def test_the_workers_say_where_their_seconds_went(run):
    out, _ = run
    times = out["times"]
    for name in ("report", "moved", "thread0", "thread1", "early_report"):
        t = times[name]["times"]
        assert set(t) == {"start_s", "imports_s", "compile_s", "launcher_s", "end_s"}, name
        assert 0 < t["start_s"] < t["end_s"] and t["compile_s"] > 0 and t["imports_s"] >= 0, (name, t)
        assert t["launcher_s"] == 0  # launchers=False: none built
        assert t["start_s"] + t["imports_s"] + t["compile_s"] <= t["end_s"] + 0.02, (name, t)  # rounding
    assert "waited_s" not in times["report"]  # waited for inside the block: no head start to account for
    early, joined = times["early_report"], times["early_joined"]
    assert early["times"] == joined["times"] and 0 <= early["waited_s"] <= joined["waited_s"]
    assert times["failing"] == {}  # a worker that wrote nothing has no seconds to tell


def test_variants_already_in_tritons_cache_start_no_worker(run):
    out, _ = run
    assert out["again"] == {"variants": 2, "missing": 0, "compiled": 0, "workers": 0, "failed": 0}


def test_a_hook_set_before_hears_what_is_not_recorded_and_is_back_afterwards(run):
    out, _ = run
    assert out["heard"] == ["write_kv_cache_kernel"]
    assert out["hook_back"] is True


def test_another_packages_kernel_compiles_as_usual_and_is_not_recorded(run):
    out, _ = run
    assert out["foreign"] == {"variants": 0, "missing": 0, "compiled": 0, "workers": 0, "failed": 0}
    assert out["foreign_hits"] == [False]


def test_a_variant_whose_key_would_differ_is_not_compiled_and_the_rest_of_the_share_is(run):
    out, _ = run
    assert out["moved"] == {"variants": 2, "missing": 2, "compiled": 1, "workers": 1, "failed": 1, "reason": (
        "RuntimeError: probe_kernel: the cache key's source part differs from the engine process's")}


def test_a_variant_this_process_cannot_name_fails_the_compile_ahead_not_the_warm_up(run):
    out, _ = run
    unnamed = out["unnamed"]
    assert (unnamed["variants"], unnamed["workers"], unnamed["failed"]) == (1, 0, 1)
    assert unnamed["reason"].startswith("AttributeError"), unnamed


def test_an_error_inside_the_block_propagates_and_leaves_nothing_behind(run):
    out, _ = run
    assert out["raised"] == [True, False]


def test_ranks_as_threads_record_their_own_variants(run):
    out, _ = run
    assert out["threads"] == [{"variants": 1, "missing": 1, "compiled": 1, "workers": 1, "failed": 0}] * 2 + [True]


def test_workers_started_without_waiting_compile_while_the_process_goes_on_and_are_joined(run):
    out, _ = run
    started = {"variants": 1, "missing": 1, "compiled": 0, "workers": 1, "failed": 0}
    assert out["early_started"] == started  # nothing compiled yet when the block ends
    assert out["early_joined"] == out["early_report"] == dict(started, compiled=1)
    assert out["early_hits"] == [True]  # the worker's compile is where Triton's dispatch looks
    assert out["early_again"] is None  # joined once: nothing left to wait for


def test_workers_started_ahead_take_the_next_list_under_the_engines_cache_and_environment(run):
    out, _ = run
    assert (out["ahead_started"], out["ahead_again"]) == (2, 2)
    # the two waiting workers compiled both variants (none could be started then) and exited cleanly
    assert out["ahead"] == {"variants": 2, "missing": 2, "compiled": 2, "workers": 2, "failed": 0}
    assert out["ahead_exits"] == [0, 0]
    # in the cache folder and under the variable set after they started: where Triton's dispatch looks
    assert out["ahead_hits"] == [True, True]
    assert 0 < out["times"]["ahead"]["times"]["start_s"] < out["times"]["ahead"]["times"]["end_s"]


def test_no_worker_starts_ahead_over_a_warm_cache_and_waiting_ones_can_be_released(run):
    out, _ = run
    assert out["ahead_warm"] == 0  # every variant the last compile-ahead recorded is in the cache
    assert out["ahead_cold"] == 1  # another (empty) cache folder: one starts
    assert out["released_exits"] == [0]


def test_a_failing_worker_is_reported_in_one_warning_and_nothing_raises(run):
    out, stderr = run
    assert out["failing"] == {"variants": 1, "missing": 1, "compiled": 0, "workers": 1, "failed": 1,
                              "reason": "exit status 1"}
    warnings = [x for x in stderr.splitlines() if "compile-ahead compiled" in x]
    assert any(x.endswith("(the rest compile at their first launch): exit status 1") for x in warnings), stderr
    assert len(warnings) == 3  # one each for the failures above


@pytest.mark.parametrize(("value", "want"), [(None, 5), ("", 5), ("0", 0), ("6", 6), (" 3 ", 3), ("12", 12)])
def test_worker_count_from_the_environment_eight_at_most_by_default(monkeypatch, value, want):
    monkeypatch.setattr(_compile_ahead, "INTERPRET", False)
    monkeypatch.setattr(_compile_ahead.os, "sched_getaffinity", lambda pid: set(range(5)))  # five CPUs
    monkeypatch.setattr(_compile_ahead.torch.cuda, "device_count", lambda: 1)
    if value is None:
        monkeypatch.delenv(_compile_ahead.WORKERS_ENV, raising=False)
    else:
        monkeypatch.setenv(_compile_ahead.WORKERS_ENV, value)
    assert compile_workers() == want
    monkeypatch.setattr(_compile_ahead.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert compile_workers() == (8 if not (value or "").strip() else want)
    monkeypatch.setattr(_compile_ahead.torch.cuda, "device_count", lambda: 8)  # eight ranks on 64 CPUs, then on 12
    assert compile_workers() == (8 if not (value or "").strip() else want)
    monkeypatch.setattr(_compile_ahead.os, "sched_getaffinity", lambda pid: set(range(12)))
    assert compile_workers() == (1 if not (value or "").strip() else want)


def test_a_bad_worker_count_is_refused_when_the_engine_starts(monkeypatch):
    from dcp_plugin.kernel_choice import choose_kernel_impl

    monkeypatch.setenv(_compile_ahead.WORKERS_ENV, "-2")
    with pytest.raises(ValueError, match="DCP_TRITON_COMPILE_WORKERS must be a whole number of worker processes "
                                         r"\(0: off\), got '-2'"):
        choose_kernel_impl(engine="vLLM")


def test_worker_count_refuses_what_is_not_a_count_and_is_off_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(_compile_ahead, "INTERPRET", False)
    monkeypatch.setenv(_compile_ahead.WORKERS_ENV, "many")
    with pytest.raises(ValueError, match="DCP_TRITON_COMPILE_WORKERS must be a whole number of worker processes"):
        compile_workers()
    monkeypatch.setenv(_compile_ahead.WORKERS_ENV, "4")
    monkeypatch.setattr(_compile_ahead, "INTERPRET", True)
    assert compile_workers() == 0


def test_an_asked_worker_count_that_cannot_start_says_why_once(monkeypatch, caplog):
    monkeypatch.setattr(_compile_ahead, "INTERPRET", False)
    monkeypatch.setattr(_compile_ahead, "hook_supported", lambda: False)
    monkeypatch.setattr(_compile_ahead, "_said_off", [])
    monkeypatch.setenv(_compile_ahead.WORKERS_ENV, "0")
    with caplog.at_level(logging.WARNING, logger="dcp_plugin"):
        assert compile_workers() == 0  # asked for none: nothing to say
        assert not caplog.records
        monkeypatch.setenv(_compile_ahead.WORKERS_ENV, "4")
        assert compile_workers() == 0 and compile_workers() == 0
    assert [r.getMessage() for r in caplog.records] == [
        "dcp-triton: DCP_TRITON_COMPILE_WORKERS=4 starts no worker processes: this Triton cannot hand a compile over; "
        "each kernel variant compiles at its first launch"]
