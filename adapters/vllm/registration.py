"""Make ``--attention-backend dcp-triton`` select the DCP-Triton backend in every vLLM process.

Three things, all re-entrant:
1. the enum member ``AttentionBackendEnum.DCP_TRITON`` (value: the backend's class path) and the key
   ``"DCP-TRITON"``, because vLLM parses the flag as ``AttentionBackendEnum[value.upper()]``; on a vLLM without
   dynamic members (0.26) the member is vLLM's ``CUSTOM`` slot, reachable under both keys;
2. pickling: the member pickles as a call to ``selected_backend()``, so a spawned engine-core or worker process,
   which unpickles the engine config before it loads plugins, registers the backend while unpickling;
3. CPU routing: vLLM's CPU platform always returns ``CPU_ATTN``; a process that unpickles a config selecting
   dcp-triton (or that runs with ``DCP_TRITON_CPU=1``) routes ``CPU_ATTN`` to this backend.
"""

from __future__ import annotations

import logging
import os

from dcp_plugin.adapters.vllm import compat, support
from dcp_plugin.kernels.checks import env_switch

BACKEND_NAME = "DCP_TRITON"
BACKEND_ALIAS = "DCP-TRITON"
BACKEND_PATH = "dcp_plugin.adapters.vllm.backend.DcpTritonBackend"
CPU_OPT_IN_ENV = "DCP_TRITON_CPU"

# Under vLLM's logger, so its handler, format and VLLM_LOGGING_LEVEL apply.
logger = logging.getLogger("vllm.dcp_triton")
# Why CPU_ATTN resolves to this backend in this process (None: it does not); read it through cpu_route().
_cpu_route: dict[str, str | None] = {"reason": None}


def cpu_route() -> str | None:
    """Why vLLM's ``CPU_ATTN`` resolves to this backend in this process, or ``None`` when it does not. Routing can
    happen while a spawned process unpickles its config, before vLLM configures logging there, so the impl's
    startup line repeats it."""
    return _cpu_route["reason"]


def cpu_opt_in() -> bool:
    """``$DCP_TRITON_CPU``: 1 routes vLLM's CPU_ATTN here; 0 or unset does not; any other value is refused."""
    return env_switch(CPU_OPT_IN_ENV, on="vLLM's CPU_ATTN runs dcp-triton", off="only an engine that selects it",
                      default=False)


def register() -> None:
    """Register the backend with vLLM (any number of times, in any process). Imports vLLM. A bad
    ``$DCP_TRITON_CPU`` is refused before anything is registered."""
    route_cpu = cpu_opt_in()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    member = AttentionBackendEnum._member_map_.get(BACKEND_NAME)
    if not compat.has_dynamic_backend_members(AttentionBackendEnum):
        member = _claim_custom_slot(AttentionBackendEnum, register_backend)
    elif member is None:
        # Always with the class path: a member registered with the value "" would take over TORCH_SDPA's value.
        register_backend(BACKEND_NAME, BACKEND_PATH)
        member = AttentionBackendEnum._member_map_[BACKEND_NAME]
    if compat.BACKEND_ALIAS_NEEDED:
        AttentionBackendEnum._member_map_.setdefault(BACKEND_ALIAS, member)
    if compat.SPAWN_UNPICKLES_CONFIG_BEFORE_PLUGINS:
        # Instance attribute: only this member pickles differently; every built-in member keeps vLLM's pickling.
        member.__reduce_ex__ = _reduce_member
    support.prepare_interpreter_env()
    if route_cpu:
        route_cpu_attn(reason=f"{CPU_OPT_IN_ENV}=1")


def selected_backend():
    """Unpickling hook of ``AttentionBackendEnum.DCP_TRITON``: register, route CPU_ATTN on CPU, return the member.

    Unpickling the member means this process received an engine config in which the user selected dcp-triton.
    """
    register()
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if compat.CPU_PLATFORM_IGNORES_SELECTED_BACKEND and current_platform.is_cpu():
        route_cpu_attn(reason="the engine config selects dcp-triton")
    return AttentionBackendEnum[BACKEND_NAME]


def route_cpu_attn(*, reason: str) -> None:
    """Make vLLM's ``CPU_ATTN`` (the only backend its CPU platform returns) resolve to this backend here."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if AttentionBackendEnum.CPU_ATTN.get_path() == BACKEND_PATH:
        return
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    logging.getLogger("vllm.platforms.cpu").addFilter(_drop_cannot_use_notice)
    _cpu_route["reason"] = reason
    logger.info("dcp-triton: CPU_ATTN now resolves to %s in process %d (%s)", BACKEND_PATH, os.getpid(), reason)


def _drop_cannot_use_notice(record: logging.LogRecord) -> bool:
    """vLLM's CPU platform logs "Cannot use <selected backend> backend on CPU." and returns ``CPU_ATTN``, which this
    process routes to dcp-triton: for dcp-triton that line says the opposite of what happens, so it is dropped."""
    message = record.getMessage()
    return not (cpu_route() and message.startswith("Cannot use ") and BACKEND_NAME in message)


def _claim_custom_slot(enum_cls, register_backend):
    """vLLM without dynamic enum members (0.26): route its one ``CUSTOM`` slot here, key it ``DCP_TRITON`` too (what
    ``get_name()`` returns and ``Attention.__init__`` looks up), unless another plugin holds the slot."""
    custom = enum_cls._member_map_["CUSTOM"]
    if custom.is_overridden() and custom.get_path() != BACKEND_PATH:
        raise ValueError(
            f"vLLM's CUSTOM attention backend slot already resolves to {custom.get_path()}; this vLLM has only that "
            "one slot for out-of-tree backends, so dcp-triton cannot register. Load one backend plugin, or use "
            "vLLM 0.33 (one enum member per plugin)"
        )
    register_backend(custom, BACKEND_PATH)
    enum_cls._member_map_.setdefault(BACKEND_NAME, custom)
    return custom


def _reduce_member(protocol: int):
    return selected_backend, ()
