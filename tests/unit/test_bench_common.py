"""benchmarks/common.py on CPU: results provenance (with and without git), the files it stamps, repository-relative
paths, and the random-Llama checkpoint builder the benchmarks and the vLLM tests share."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import common

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_hidden_layers=1, vocab_size=97)


def test_provenance_names_this_checkout(monkeypatch):
    monkeypatch.delenv(common.COMMIT_ENV, raising=False)
    if not (common.REPO / ".git").exists():
        pytest.skip("this tree has no .git")
    head = subprocess.run(["git", "-C", str(common.REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    got = common.provenance()
    assert got["commit"] == head.stdout.strip() and isinstance(got["dirty"], bool)
    assert got["triton"] == common.triton_version()


def test_provenance_without_git_or_its_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(common.COMMIT_ENV, raising=False)
    monkeypatch.setattr(common, "REPO", tmp_path)  # a copy of the tree without .git (the device machine's)
    assert common.provenance() == {"commit": None, "dirty": None, "triton": common.triton_version()}
    monkeypatch.setenv(common.COMMIT_ENV, "0123abc")
    assert common.provenance()["commit"] == "0123abc" and common.provenance()["dirty"] is None
    (tmp_path / ".git").write_text("gitdir: /nowhere\n")  # a broken .git: git fails, nothing raises
    assert common.provenance()["commit"] == "0123abc"
    monkeypatch.setattr(common.shutil, "which", lambda name: None)  # no git at all
    assert common.provenance()["dirty"] is None


def test_the_named_commit_wins_over_a_stale_git(monkeypatch):
    """The device machine's copy of the tree carried the .git of the session's start: the host's word wins."""
    monkeypatch.setenv(common.COMMIT_ENV, "0123abc")
    assert common.provenance() == {"commit": "0123abc", "dirty": None, "triton": common.triton_version()}


def test_provenance_records_the_kernel_switches_set(monkeypatch):
    monkeypatch.setenv(common.COMMIT_ENV, "0123abc")
    for name in common.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert "env" not in common.provenance()
    monkeypatch.setenv("DCP_TRITON_GLUON", "0")
    assert common.provenance()["env"] == {"DCP_TRITON_GLUON": "0"}


def test_triton_version_prefers_the_imported_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", SimpleNamespace(__version__="9.9.9"))
    assert common.triton_version() == "9.9.9"
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setattr(common.importlib.metadata, "version", lambda name: (_ for _ in ()).throw(
        common.importlib.metadata.PackageNotFoundError(name)))
    assert common.triton_version() is None


def test_save_adds_provenance_and_stamp_adds_it_to_meta(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "provenance", lambda: {"commit": "c", "dirty": False, "triton": "t"})
    payload = {"gpu": "cpu", "rows": [1, 2]}
    path = common.save("x", payload, results_dir=tmp_path)
    assert json.loads(path.read_text()) == {**payload, "provenance": common.provenance()}
    assert "provenance" not in payload  # the caller's dict is left as it was
    summary, other, md = tmp_path / "s.json", tmp_path / "o.json", tmp_path / "s.md"
    summary.write_text(json.dumps({"meta": {"gpu": "cpu"}, "rows": [0.5]}, indent=1))
    other.write_text('{"summary": {}}')
    md.write_text("# table\n")
    common.stamp([summary, other, md, tmp_path / "missing.json"], {"commit": "c"})
    data = json.loads(summary.read_text())
    assert data == {"meta": {"gpu": "cpu", "provenance": {"commit": "c"}}, "rows": [0.5]}
    assert summary.read_text() == json.dumps(data, indent=1)  # as the summary writers indent
    assert other.read_text() == '{"summary": {}}' and md.read_text() == "# table\n"
    assert not list(tmp_path.glob("*.tmp"))


def test_repo_relative_and_working_dir(tmp_path, monkeypatch):
    assert common.repo_relative(common.REPO / "benchmarks/results/x.log") == "benchmarks/results/x.log"
    assert common.repo_relative(tmp_path / "x.log") == str((tmp_path / "x.log").resolve())
    before = Path.cwd()
    with pytest.raises(RuntimeError), common.working_dir(tmp_path):
        assert Path.cwd() == tmp_path.resolve()
        raise RuntimeError
    assert Path.cwd() == before


def test_save_random_llama_is_seeded_float32_and_atomic(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    target = common.save_random_llama(TINY, tmp_path / "m", seed=3)
    assert target == tmp_path / "m" and sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no .partial left
    saved = load_file(target / "model.safetensors")
    torch.manual_seed(3)
    expect = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).state_dict()
    assert saved and all(t.dtype == torch.float32 and torch.equal(t, expect[name]) for name, t in saved.items())
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    common.save_random_llama(TINY, target, seed=4)  # built: left alone
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp


def test_merge_jobs_saves_every_files_jobs_with_their_summary(tmp_path, capsys):
    for name, jobs in (("a", [{"name": "j1"}]), ("b", [{"name": "j2"}, {"name": "j3"}])):
        (tmp_path / f"{name}.json").write_text(json.dumps({"summary": {}, "jobs": jobs}))
    path = common.merge_jobs("merged", [str(tmp_path / "a.json"), str(tmp_path / "b.json")],
                             lambda jobs: {"count": len(jobs)}, results_dir=tmp_path)
    saved = json.loads(path.read_text())
    assert [j["name"] for j in saved["jobs"]] == ["j1", "j2", "j3"] and saved["summary"] == {"count": 3}
    assert "wrote" in capsys.readouterr().out


def test_merged_results_keep_the_provenance_of_the_runs_not_of_the_merging_machine(tmp_path):
    runs = {"a": {"commit": "7cc862f", "dirty": None, "triton": "3.6.0"},
            "b": {"commit": "7cc862f", "dirty": None, "triton": "3.6.0"},
            "c": {"commit": "378aff3", "dirty": None, "triton": "3.6.0"}}
    for name, origin in runs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({"summary": {}, "jobs": [{"name": name}],
                                                           "provenance": origin}))
    same = json.loads(common.merge_jobs("same", [str(tmp_path / "a.json"), str(tmp_path / "b.json")],
                                        lambda jobs: {}, results_dir=tmp_path).read_text())
    assert same["provenance"] == runs["a"]
    assert [j["provenance"] for j in same["jobs"]] == [runs["a"], runs["b"]]
    mixed = json.loads(common.merge_jobs("mixed", [str(tmp_path / "a.json"), str(tmp_path / "c.json")],
                                         lambda jobs: {}, results_dir=tmp_path).read_text())
    assert mixed["provenance"] == {"commit": None, "inputs": [runs["a"], runs["c"]]}
    assert mixed["jobs"][1]["provenance"]["commit"] == "378aff3"
    (tmp_path / "d.json").write_text(json.dumps({"summary": {}, "jobs": [{"name": "d"}], "provenance": {
        "commit": "8c3a8c4", "dirty": None, "triton": "3.6.0"}}))
    again = json.loads(common.merge_jobs("again", [str(tmp_path / "mixed.json"), str(tmp_path / "d.json")],
                                         lambda jobs: {}, results_dir=tmp_path).read_text())
    assert again["provenance"]["inputs"] == [runs["a"], runs["c"], {"commit": "8c3a8c4", "dirty": None,
                                                                    "triton": "3.6.0"}]  # flat, not nested
    assert [j["provenance"]["commit"] for j in again["jobs"]] == ["7cc862f", "378aff3", "8c3a8c4"]
