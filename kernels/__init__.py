"""Triton kernels of DCP attention; ``dcp_plugin.kernels.reference`` holds torch versions with the same signatures.

With no CUDA GPU present, ``TRITON_INTERPRET=1`` is set (``_mode``, imported first, before any kernel is defined)
so the kernels run on CPU tensors through the Triton interpreter. Set ``TRITON_INTERPRET`` yourself to override.

Each public function checks its inputs and launches. Each also has a ``plan_*`` twin that checks nothing and
returns a prepared launch (``Launch``) for tensors shaped like the ones given: the DCP core prepares its launches
once per step and replays them for every layer. What the core also takes from here, by these names only: which
kernel paths a process asks for (``gluon_asked``, ``gluon_enabled``, ``pdl_asked``) and how it compiles its
variants before serving (``compile_ahead``, ``compile_workers``, ``every_variant``, ``every_variant_wanted``,
``launches_run``).
"""

from dcp_plugin.kernels._mode import INTERPRET  # first: decides the interpreter before triton is imported
from dcp_plugin.kernels._launch import FAST_LAUNCH, every_variant, every_variant_wanted, launches_run
from dcp_plugin.kernels._compile_ahead import compile_ahead, compile_workers
from dcp_plugin.kernels._gluon import gluon_asked, gluon_enabled
from dcp_plugin.kernels._pdl import pdl_asked
from dcp_plugin.kernels.combine import combine_partials, merge_states, plan_combine, rescale_partial
from dcp_plugin.kernels.extend_attention import SUPPORTED_HEAD_DIMS, extend_attention, plan_extend
from dcp_plugin.kernels.paged_attention import paged_attention, plan_paged, split_capacity
from dcp_plugin.kernels.write_kv_cache import plan_write_kv, write_kv_cache

__all__ = [
    "FAST_LAUNCH",
    "INTERPRET",
    "SUPPORTED_HEAD_DIMS",
    "combine_partials",
    "compile_ahead",
    "compile_workers",
    "every_variant",
    "every_variant_wanted",
    "extend_attention",
    "gluon_asked",
    "gluon_enabled",
    "launches_run",
    "merge_states",
    "paged_attention",
    "pdl_asked",
    "plan_combine",
    "plan_extend",
    "plan_paged",
    "plan_write_kv",
    "rescale_partial",
    "split_capacity",
    "write_kv_cache",
]
