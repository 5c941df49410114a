"""Triton kernels of DCP attention; ``dcp_plugin.kernels.reference`` holds torch versions with the same signatures.

With no CUDA GPU present, ``TRITON_INTERPRET=1`` is set (``_mode``, which every kernel module imports before
triton) so the kernels run on CPU tensors through the Triton interpreter. Set ``TRITON_INTERPRET`` yourself to
override.

Each public function checks its inputs and launches. Each also has a ``plan_*`` twin that checks nothing and returns
a prepared launch (``Launch``) for tensors shaped like the ones given: the DCP core prepares its launches once per
step and replays them for every layer. What the core also takes from here, by these names only: which kernel paths a
process asks for (``gluon_asked``, ``gluon_enabled``, ``pdl_asked``, ``fp8_dot_asked``, ``fp8_copy_asked``) and how
it compiles its variants before serving (``compile_ahead``, ``compile_workers``, ``join_early``, ``stand_by``,
``every_variant``, ``every_variant_wanted``, ``launches_run``). The argument checks the core shares with the kernels
are ``dcp_plugin.kernels.checks``.

The names below are imported on first use, so ``dcp_plugin.kernels.checks`` and ``dcp_plugin.kernels.reference``
load without triton and without asking torch about CUDA (an engine's plugin loading imports the checks).
"""

from __future__ import annotations

import importlib
import sys
import types

# Public name -> the module that defines it.
_EXPORTS = {
    "INTERPRET": "dcp_plugin.kernels._mode",
    "FAST_LAUNCH": "dcp_plugin.kernels._launch",
    "every_variant": "dcp_plugin.kernels._launch",
    "every_variant_wanted": "dcp_plugin.kernels._launch",
    "launches_run": "dcp_plugin.kernels._launch",
    "compile_ahead": "dcp_plugin.kernels._compile_ahead",
    "compile_workers": "dcp_plugin.kernels._compile_ahead",
    "join_early": "dcp_plugin.kernels._compile_ahead",
    "stand_by": "dcp_plugin.kernels._compile_workers",
    "gluon_asked": "dcp_plugin.kernels._gluon",
    "gluon_enabled": "dcp_plugin.kernels._gluon",
    "pdl_asked": "dcp_plugin.kernels._pdl",
    "fp8_dot_asked": "dcp_plugin.kernels._prefix_config",
    "fp8_copy_asked": "dcp_plugin.kernels.fp8_prefill",
    "merge_partials": "dcp_plugin.kernels.merge",
    "merge_states": "dcp_plugin.kernels.merge",
    "plan_merge": "dcp_plugin.kernels.merge",
    "rescale_partial": "dcp_plugin.kernels.merge",
    "SUPPORTED_HEAD_DIMS": "dcp_plugin.kernels.chunk_attention",
    "chunk_attention": "dcp_plugin.kernels.chunk_attention",
    "plan_chunk": "dcp_plugin.kernels.chunk_attention",
    "prefix_attention": "dcp_plugin.kernels.prefix_attention",
    "plan_prefix": "dcp_plugin.kernels.prefix_attention",
    "split_capacity": "dcp_plugin.kernels.split_kv",
    "plan_write_kv": "dcp_plugin.kernels.write_kv_cache",
    "write_kv_cache": "dcp_plugin.kernels.write_kv_cache",
}
# The names the public API had before the current chunk and the prefix pass named their kernels: kept for code
# outside this repository, each the same function as its new name.
_FORMER = {"extend_attention": "chunk_attention", "paged_attention": "prefix_attention"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _FORMER:
        value = globals()[name] = __getattr__(_FORMER[name])
        return value
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    if not name.startswith("__"):  # a submodule not imported yet: dcp_plugin.kernels.reference, ._launch, ...
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        # Importing the submodule prefix_attention (chunk_attention, write_kv_cache) binds it on this package under
        # the name of its public function: the function keeps the name, as when this package imported it eagerly.
        if not (name in _EXPORTS and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
