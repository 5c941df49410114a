"""Which kernels run, the kernel implementation chosen by name (``kernel_impl``): ``"triton"``
(``dcp_plugin.kernels``) or ``"reference"`` (their torch references with the same signatures,
``dcp_plugin.kernels.reference``); the module it stands for is the layer's ``kernel_ops``.

``DcpAttention(kernel_impl=...)`` takes the name. An engine adapter chooses it once, at start-up, from
``DCP_TRITON_KERNELS`` (``choose_kernel_impl``), and refuses what the Triton interpreter computes wrongly
(``check_kernel_dtype``), each message naming the engine's own options.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import torch

KernelImpl = Literal["triton", "reference"]
KERNEL_IMPLS = ("triton", "reference")
KERNELS_ENV = "DCP_TRITON_KERNELS"


def kernel_ops_for(impl: str) -> ModuleType:
    """The kernel ops ``impl`` stands for: a module whose ``plan_*`` functions prepare a step's launches."""
    if impl == "triton":
        from dcp_plugin import kernels

        return kernels
    if impl == "reference":
        from dcp_plugin.kernels import reference

        return reference
    raise ValueError(f"kernel_impl={impl!r}: use one of {list(KERNEL_IMPLS)}")


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """The kernels an engine's workers run: ``impl`` (``DcpAttention``'s ``kernel_impl``), ``description`` (what the
    start-up log says ran, and why), ``interpreted`` (the Triton kernels under the interpreter: no GPU)."""

    impl: KernelImpl
    description: str
    interpreted: bool = False

    @property
    def compiled(self) -> bool:
        """The Triton kernels compiled for a GPU: the path whose kernels a warm-up compiles before serving."""
        return self.impl == "triton" and not self.interpreted


def choose_kernel_impl(*, engine: str) -> KernelChoice:
    """The kernels ``DCP_TRITON_KERNELS`` names, by default the fastest exact ones: the Triton kernels on a GPU,
    the torch references (exact, and far faster than Triton's interpreter) without one.
    ``DCP_TRITON_KERNELS=triton`` runs the Triton kernels interpreted on CPU. ``engine``: the host's name, for the
    messages."""
    from dcp_plugin import kernels
    from dcp_plugin.kernels import compile_workers, fp8_copy_asked, fp8_dot_asked, gluon_asked, pdl_asked

    gluon_asked()  # DCP_TRITON_GLUON: refused here, at the engine's start, when it is neither 0 nor 1
    pdl_asked()  # DCP_TRITON_PDL likewise
    fp8_dot_asked()  # DCP_TRITON_FP8_DOT likewise, when it is not 0, 1 or 2
    fp8_copy_asked()  # DCP_TRITON_FP8_PREFILL likewise, when it is neither tiles nor copy
    compile_workers()  # DCP_TRITON_COMPILE_WORKERS likewise, when it is not a whole number
    asked = os.environ.get(KERNELS_ENV, "").strip().lower()
    name = asked or ("reference" if kernels.INTERPRET else "triton")
    if name == "reference":
        why = f"{KERNELS_ENV}=reference" if asked else f"the default without a GPU; {KERNELS_ENV}=triton interprets " \
            "the Triton kernels"
        return KernelChoice("reference", f"reference (torch, dcp_plugin.kernels.reference; {why})")
    if name != "triton":
        raise ValueError(f"{KERNELS_ENV}={name!r} is not a kernel path; use one of {list(KERNEL_IMPLS)}")
    if not kernels.INTERPRET:
        return KernelChoice("triton", "triton")
    if not triton_imported_interpreted():
        raise ValueError(
            "the Triton interpreter is needed (no GPU), but triton was imported in this process before "
            "TRITON_INTERPRET=1 was set, so its own jit helpers cannot run interpreted. Export TRITON_INTERPRET=1 "
            f"before starting {engine}, or unset {KERNELS_ENV} (the torch references)"
        )
    return KernelChoice("triton", "triton (interpreter, TRITON_INTERPRET=1)", interpreted=True)


def triton_imported_interpreted() -> bool:
    """Whether triton's own jit helpers were defined for the interpreter (triton fixes that when imported)."""
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.zeros, InterpretedFunction)


def check_kernel_dtype(choice: KernelChoice, dtype: torch.dtype | None, *, dtype_options: str,
                       fp8_cache: str | None = None) -> None:
    """Refuse what the Triton interpreter computes wrongly: bf16 matrix products and float32-to-fp8 rounding.
    ``dtype_options``: how the engine's user picks float32 or float16; ``fp8_cache``: the engine's KV-cache option
    when it asks for an fp8 cache (None otherwise)."""
    if not choice.interpreted:
        return
    if dtype == torch.bfloat16:
        raise ValueError(
            "dtype=bfloat16 with the Triton interpreter (no GPU): the interpreter computes bf16 matrix products "
            f"wrongly; serve with {dtype_options}, or unset {KERNELS_ENV} (the torch references)"
        )
    if fp8_cache is not None:
        raise ValueError(
            f"{fp8_cache} with the Triton interpreter (no GPU): the interpreter rounds float32 to fp8 wrongly; use "
            f"--kv-cache-dtype auto, or unset {KERNELS_ENV} (the torch references)"
        )


def gluon_state(choice: KernelChoice) -> str:
    """The startup lines' ``gluon=``: ``on`` where this process's compiled Triton kernels include the Gluon ones
    (sm_90, Triton 3.6, ``DCP_TRITON_GLUON`` not 0; they then serve head sizes 64 and 128 in fp16/bf16), ``off``
    elsewhere."""
    if not choice.compiled or not torch.cuda.is_available():
        return "off"
    from dcp_plugin.kernels import gluon_enabled

    return "on" if gluon_enabled(torch.device("cuda", torch.cuda.current_device())) else "off"
