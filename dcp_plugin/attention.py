"""DCP attention for one layer: steps 1-5 of the algorithm (docs/design.md) over a DcpGroup, prepared once per
step as a step plan (``dcp_plugin.step_plan``) and replayed by every layer."""

from __future__ import annotations

import logging
import sys
from typing import Literal

import torch

from dcp_plugin.batch import DcpBatch
from dcp_plugin.group import DcpGroup, buffered
from dcp_plugin.kernel_choice import KernelImpl, kernel_ops_for
from dcp_plugin.kernels import every_variant_wanted
from dcp_plugin.kernels.checks import FLOAT_DTYPES, FP8_DTYPES, check_kv_scales, check_scale
from dcp_plugin.layout import HeadLayout, TokenLayout, check_same_position
from dcp_plugin.step_plan import StepInputs, StepPlan, decode_signature, plan_step
from dcp_plugin.workspace import DcpWorkspace

CommMode = Literal["ag_rs", "a2a"]
logger = logging.getLogger("dcp_plugin")


class DcpAttention:
    """Attention of one layer on one rank of a DCP group (the rank's KV cache holds its shard of every request).

    Args:
        heads: this rank's ``HeadLayout``; tokens: its ``TokenLayout`` (the batch must be built with the same).
        group: the DCP group (``world_size == heads.dcp_size``); ``None`` only when ``dcp_size == 1``.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        comm: cross-rank merge, ``"ag_rs"`` (all-gather LSE, rescale, reduce-scatter O) or ``"a2a"`` (one
            all-to-all of packed (O, LSE) and one merge kernel that also takes the current chunk). Partial
            outputs cross ranks in the model dtype, LSEs in float32.
        kernel_impl: ``"triton"`` (``dcp_plugin.kernels``, the default) or ``"reference"`` (their torch
            references, ``dcp_plugin.kernels.reference``).
        workspace: a ``DcpWorkspace`` shared with the other layers of this rank (default: one of this layer's own,
            grown to the largest step seen).

    A step's launches are prepared once (a step plan, ``dcp_plugin.step_plan``, cached on the batch) and replayed by
    every layer with the same tensor shapes; inputs are checked when a plan is made, so the per-layer cost is the
    launches alone. A decode step over the same batch buffers as the last decode step, its shards within the same
    bound (``step_plan.decode_signature``), replays that step's plan: steady decoding prepares nothing.

    Example::

        attn = DcpAttention(heads=heads, tokens=tokens, group=TorchDcpGroup(), scale=64 ** -0.5)
        out = attn.forward(q, k, v, key_cache, value_cache, batch)   # [T, heads.num_q_heads, D]
    """

    def __init__(
        self,
        *,
        heads: HeadLayout,
        tokens: TokenLayout,
        group: DcpGroup | None,
        scale: float,
        comm: CommMode = "ag_rs",
        kernel_impl: KernelImpl = "triton",
        workspace: DcpWorkspace | None = None,
    ) -> None:
        if not isinstance(heads, HeadLayout):
            raise ValueError(f"heads must be a HeadLayout, got {type(heads).__name__}")
        if not isinstance(tokens, TokenLayout):
            raise ValueError(f"tokens must be a TokenLayout, got {type(tokens).__name__}")
        check_same_position(heads, tokens)
        if group is None:
            if heads.dcp_size != 1:
                raise ValueError(f"group is None but dcp_size={heads.dcp_size}; pass a DcpGroup of that size")
        elif (group.world_size, group.rank_in_group) != (heads.dcp_size, heads.dcp_rank):
            raise ValueError(
                f"group has world_size={group.world_size}, rank_in_group={group.rank_in_group}, but the layouts "
                f"say dcp_size={heads.dcp_size}, dcp_rank={heads.dcp_rank}"
            )
        check_scale("scale", scale)
        if comm not in ("ag_rs", "a2a"):
            raise ValueError(f"comm must be 'ag_rs' or 'a2a', got {comm!r}")
        self._kernel_ops = kernel_ops_for(kernel_impl)  # the module whose plan_* functions prepare a step's launches
        if workspace is not None and not isinstance(workspace, DcpWorkspace):
            raise ValueError(f"workspace must be a DcpWorkspace, got {type(workspace).__name__}")
        if workspace is not None and (workspace.heads != heads or workspace.comm != comm):
            raise ValueError(f"workspace was made for {workspace.heads} with comm={workspace.comm!r}, but this "
                             f"layer has {heads} with comm={comm!r}")
        self.heads, self.tokens, self.scale, self.comm = heads, tokens, float(scale), comm
        self.kernel_impl = kernel_impl
        self.group = group
        self._collectives = buffered(group) if group is not None and heads.dcp_size > 1 else None
        self.workspace = workspace
        self._own_workspace = workspace is None
        # Workspaces for steps the shared one cannot hold. Never freed: a CUDA graph captured on one keeps writing
        # to its addresses.
        self._overflow: list[DcpWorkspace] = []
        # Everything a step plan depends on besides the tensors, as one interned string: layers with equal settings
        # (and one shared workspace) hold the same string object, so they share plans, and the per-layer plan key
        # hashes and compares it as cheaply as an int.
        self._plan_key = sys.intern(f"{heads!r} {tokens!r} scale={self.scale!r} comm={comm} kernel_impl={kernel_impl} "
                                    f"workspace={id(workspace) if workspace else id(self)}")
        self._last_decode: tuple | None = None  # (key, decode_signature, plan) of the last decode step planned

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: DcpBatch,
        *,
        out: torch.Tensor | None = None,
        write_kv: bool = True,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's owned K/V into the local cache and return the attention output of the local Q heads.

        ``q``: ``[num_tokens, heads.num_q_heads, D]``; ``k``, ``v``: ``[num_tokens, heads.num_kv_heads, D]``
        (all the step's new tokens, whichever rank owns them); ``key_cache``/``value_cache``:
        ``[num_blocks, block_size, heads.num_kv_heads, D]`` (strided views allowed), updated in place;
        one dtype (fp16/bf16/fp32) and one device for all, except that the caches may be fp8 (e4m3fn / e5m2) holding
        value / scale, with ``k_scale``/``v_scale`` (one-element float32 tensors) then required: written values are
        quantized, cached ones dequantized in registers; the current chunk stays in q's dtype.
        ``out`` (default: new) is ``q``-shaped, ``q.dtype``.
        ``write_kv=False`` when the host already stored this step's K/V through ``batch.slot_mapping`` (vLLM's
        ``do_kv_cache_update``), so the cache is written once.
        No host synchronisation; every rank of the group must call it with the same batch shape.
        """
        if out is None:
            out = torch.empty_like(q)
        key = (self._plan_key, write_kv, q.shape, q.stride(), k.stride(), v.stride(), key_cache.shape,
               key_cache.stride(), value_cache.stride(), out.stride(), q.dtype, out.dtype, key_cache.dtype,
               k_scale is None)
        plan: StepPlan | None = batch.plans.get(key) if isinstance(batch, DcpBatch) else None
        if plan is None:
            self._check_inputs(q, k, v, key_cache, value_cache, batch, out, k_scale, v_scale)
            plan = batch.plans[key] = self._step_plan(key, q, k, v, key_cache, value_cache, batch, out, write_kv)
        plan.run(q, k, v, key_cache, value_cache, out, k_scale, v_scale)
        return out

    def _step_plan(self, key: tuple, q, k, v, key_cache, value_cache, batch, out, write_kv: bool) -> StepPlan:
        """The step's plan: a decode step like the last one planned here (the same key, the same batch buffers, its
        shards within the same bound: ``decode_signature``) replays that plan, launches prepared and kernels bound;
        any other step gets a new one."""
        signature = decode_signature(batch) if batch.max_query_len == 1 else None
        warm_up = every_variant_wanted()  # its plans hold and run extra variants: planned afresh, not kept
        last = self._last_decode
        if signature is not None and last is not None and last[0] == key and last[1] == signature and not warm_up:
            return last[2]
        plan = self._plan(q, k, v, key_cache, value_cache, batch, out, write_kv)
        if signature is not None and not warm_up:
            self._last_decode = (key, signature, plan)
        return plan

    def _plan(self, q, k, v, key_cache, value_cache, batch, out, write_kv: bool) -> StepPlan:
        """Prepare the step's launches (first layer of a step with these shapes, inputs checked)."""
        views = self._workspace_for(batch.num_tokens, q).views(batch.num_tokens)
        step = StepInputs(kernel_ops=self._kernel_ops, heads=self.heads, scale=self.scale, group=self._collectives,
                          batch=batch, q=q, k=k, v=v, key_cache=key_cache, value_cache=value_cache, out=out,
                          write_kv=write_kv)
        return plan_step(step, views)

    def _workspace_for(self, num_tokens: int, q: torch.Tensor) -> DcpWorkspace:
        def serves(ws: DcpWorkspace | None) -> bool:
            return ws is not None and ws.fits(num_tokens) and ws.dtype == q.dtype and ws.head_dim == q.shape[-1] \
                and ws.device == q.device

        for ws in (self.workspace, *self._overflow):
            if serves(ws):
                return ws
        made = DcpWorkspace(heads=self.heads, head_dim=q.shape[-1], dtype=q.dtype, device=q.device,
                            max_num_tokens=max(num_tokens, 1), comm=self.comm,
                            split_elements=self._kernel_ops.split_capacity(q.shape[-1], q.device))
        if self._own_workspace:
            self.workspace = made
            return made
        # Correct, but outside the memory the engine planned for: kept for later steps, said each time one is made.
        ws = self.workspace
        logger.warning("dcp-triton: a step of %d tokens (%s, head size %d) does not fit the shared workspace "
                       "(%d tokens, %s, head size %d); this layer keeps a workspace of its own for such steps",
                       num_tokens, q.dtype, q.shape[-1], ws.max_num_tokens, ws.dtype, ws.head_dim)
        self._overflow.append(made)
        return made

    def _check_inputs(self, q, k, v, key_cache, value_cache, batch, out, k_scale, v_scale) -> None:
        heads = self.heads
        for name, t, ndim in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("key_cache", key_cache, 4),
                              ("value_cache", value_cache, 4)):
            if not isinstance(t, torch.Tensor) or t.dim() != ndim:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be a {ndim}-D tensor, got {shape}")
        if not isinstance(batch, DcpBatch):
            raise ValueError(f"batch must be a DcpBatch (DcpBatch.build), got {type(batch).__name__}")
        if batch.tokens != self.tokens:
            raise ValueError(f"batch was built for {batch.tokens}, but this layer uses {self.tokens}")
        if q.dtype not in FLOAT_DTYPES:
            raise ValueError(f"q has dtype {q.dtype}; supported: float16, bfloat16, float32")
        num_tokens, head_dim = batch.num_tokens, q.shape[-1]
        expected = {
            "q": (q, (num_tokens, heads.num_q_heads, head_dim)),
            "k": (k, (num_tokens, heads.num_kv_heads, head_dim)),
            "v": (v, (num_tokens, heads.num_kv_heads, head_dim)),
            "key_cache": (key_cache, (key_cache.shape[0], self.tokens.block_size, heads.num_kv_heads, head_dim)),
            "value_cache": (value_cache, tuple(key_cache.shape)),
            "out": (out, tuple(q.shape)),
        }
        for name, (t, shape) in expected.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}, expected {shape} (num_tokens={num_tokens} from the batch, "
                    f"{heads.num_q_heads} local Q / {heads.num_kv_heads} stored KV heads, "
                    f"block_size={self.tokens.block_size}, head_dim={head_dim} from q)"
                )
            cache = name.endswith("_cache") and t.dtype == key_cache.dtype and t.dtype in FP8_DTYPES
            if t.dtype != q.dtype and not cache:
                raise ValueError(f"{name} has dtype {t.dtype} but q has {q.dtype}; all inputs must share one dtype "
                                 "(the KV caches may be fp8: float8_e4m3fn or float8_e5m2, with k_scale, v_scale)")
            if t.device != batch.device:
                raise ValueError(f"{name} is on {t.device} but the batch tensors are on {batch.device}")
        check_kv_scales(key_cache.dtype, k_scale, v_scale, batch.device)
