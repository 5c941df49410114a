"""The warm-up started early (``dcp_plugin.warmup.warm_up_early``): an engine's profiling run records the warm-up's
steps under compile-ahead without waiting for its workers, and the warm-up proper waits for them before it looks
anything up. Compile-ahead itself (workers, cache keys, ``wait=False``) is checked in ``test_compile_ahead.py``."""

from __future__ import annotations

import contextlib

import torch

from dcp_plugin import warmup


def _fake_compile_ahead(events: list):
    @contextlib.contextmanager
    def compile_ahead(workers, *, report=None, wait=True):
        events.append(("compile_ahead", workers, wait))
        yield
        if report is not None:
            report.update(variants=3, missing=0, compiled=0, workers=0, failed=0)

    return compile_ahead


def _steps_recorded(events: list):
    def run_steps(attention, steps, buffers, **tensors):
        events.append(("steps", steps, sorted(tensors)))
        return len(steps)

    return run_steps


def _patched(monkeypatch, events: list, workers: int, early: dict | None):
    monkeypatch.setattr(warmup, "_workers_for", lambda device: workers)
    monkeypatch.setattr(warmup, "compile_ahead", _fake_compile_ahead(events))
    monkeypatch.setattr(warmup, "_run_steps", _steps_recorded(events))
    monkeypatch.setattr(warmup, "join_early", lambda: events.append(("join",)) or early)
    monkeypatch.setattr(warmup, "DcpBatchBuffers", lambda *a: None)
    monkeypatch.setattr(warmup, "steps_for", lambda attention, trees, **_: warmup.STEPS + ((warmup.TREE_VERIFY,)
                                                                                       if trees else ()))


TENSORS = dict.fromkeys(("query", "key", "value", "key_cache", "value_cache", "output"), torch.zeros(2, 2, 4))


def test_early_warm_up_records_the_warm_ups_steps_and_does_not_wait(monkeypatch):
    events: list = []
    _patched(monkeypatch, events, workers=3, early=None)
    assert warmup.warm_up_early(None, trees=True, **TENSORS) is True
    steps = warmup.STEPS + (warmup.TREE_VERIFY,)
    names = sorted([*TENSORS, "k_scale", "v_scale"])
    assert events == [("compile_ahead", 3, False), ("steps", steps, names)]
    events.clear()
    report: dict = {}
    assert warmup.warm_up(None, trees=True, report=report, **TENSORS) == len(steps)
    # the warm-up proper waits for the early workers before its own compile-ahead looks anything up, then runs
    assert events == [("join",), ("compile_ahead", 3, True), ("steps", steps, names), ("steps", steps, names)]
    assert "early" not in report  # nothing was started early in this warm-up's view (join_early gave None)


def test_the_warm_up_reports_what_the_early_workers_compiled(monkeypatch):
    events: list = []
    early = dict(variants=14, missing=14, compiled=14, workers=8, failed=0)
    _patched(monkeypatch, events, workers=8, early=early)
    report: dict = {}
    warmup.warm_up(None, report=report, **TENSORS)
    assert report["early"] == early and report["variants"] == 3
    line = warmup.warmed_up_line(10, 1.25, 1, torch.bfloat16, None, report)
    assert line == ("dcp-triton: compiled the kernels of 10 step kinds before serving in 1.2 s (dcp_size=1, "
                    "torch.bfloat16; compile-ahead started early: 14 variants, 14 not in Triton's cache, 14 compiled "
                    "by 8 worker processes; compile-ahead: 3 variants, 0 not in Triton's cache, 0 compiled by 0 "
                    "worker processes)")
    # where the early workers' seconds went, and what of them the warm-up still waited for
    report["early"] = dict(early, times=dict(start_s=2.25, imports_s=0.5, compile_s=4.0, launcher_s=1.5, end_s=8.5),
                           waited_s=0.75)
    line = warmup.warmed_up_line(10, 1.25, 1, torch.bfloat16, None, report)
    assert ("compile-ahead started early: 14 variants, 14 not in Triton's cache, 14 compiled by 8 worker processes "
            "in 8.5 s (the last: started in 2.2 s, imports 0.5 s, compiles 4.0 s, launchers 1.5 s), waited for "
            "0.8 s; compile-ahead: 3 variants") in line


def test_no_early_warm_up_without_compile_ahead(monkeypatch):
    events: list = []
    _patched(monkeypatch, events, workers=0, early=None)
    assert warmup.warm_up_early(None, **TENSORS) is False
    assert events == []


def test_off_the_gpu_there_are_no_workers():
    assert warmup._workers_for(torch.device("cpu")) == 0


def test_workers_start_ahead_on_a_gpu_only_and_a_failure_to_start_is_one_warning(monkeypatch, caplog):
    asked = []
    monkeypatch.setattr(warmup, "stand_by", lambda count: asked.append(count) or count)
    assert warmup.workers_ahead(torch.device("cpu")) == 0 and asked == []  # off the GPU: nothing starts
    monkeypatch.setattr(warmup, "_workers_for", lambda device: 6)
    assert warmup.workers_ahead(torch.device("cuda")) == 6 and asked == [6]
    monkeypatch.setattr(warmup, "_workers_for", lambda device: 0)  # compile-ahead off
    assert warmup.workers_ahead(torch.device("cuda")) == 0 and asked == [6]

    def broken(count):
        raise OSError("no processes left")

    monkeypatch.setattr(warmup, "_workers_for", lambda device: 6)
    monkeypatch.setattr(warmup, "stand_by", broken)
    assert warmup.workers_ahead(torch.device("cuda")) == 0
    assert [r.getMessage() for r in caplog.records] == [
        "dcp-triton: compile workers could not start ahead (OSError: no processes left); they start when there is "
        "work"]
