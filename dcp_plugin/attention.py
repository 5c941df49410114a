"""DCP attention for one layer: steps 1-5 of DESIGN.md section 1 over a DcpGroup and a kernel namespace."""

from __future__ import annotations

import math
from types import ModuleType, SimpleNamespace
from typing import Literal

import torch

from dcp_plugin.batch import DcpBatch
from dcp_plugin.group import DcpGroup
from dcp_plugin.layout import HeadLayout, TokenLayout

CommMode = Literal["ag_rs", "a2a"]
_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_COMMON_OPS = ("write_kv_cache", "extend_attention", "paged_attention", "merge_states")
_COMBINE_OPS = {"ag_rs": ("rescale_partial",), "a2a": ("combine_partials",)}


class DcpAttention:
    """Attention of one layer on one rank of a DCP group (the rank's KV cache holds its shard of every request).

    Args:
        heads: this rank's ``HeadLayout``; tokens: its ``TokenLayout`` (the batch must be built with the same).
        group: the DCP group (``world_size == heads.dcp_size``); ``None`` only when ``dcp_size == 1``.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        comm: cross-rank combine, ``"ag_rs"`` (all-gather LSE, rescale, reduce-scatter O in float32) or ``"a2a"``
            (one all-to-all of packed float32 (O, LSE) and one combine kernel that also merges the current chunk).
        ops: kernel namespace with the signatures of ``dcp_plugin.kernels.reference``; default
            ``dcp_plugin.kernels`` (Triton). ``dcp_plugin.kernels.reference`` runs the torch path.

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
        ops: ModuleType | SimpleNamespace | None = None,
    ) -> None:
        if not isinstance(heads, HeadLayout):
            raise ValueError(f"heads must be a HeadLayout, got {type(heads).__name__}")
        if not isinstance(tokens, TokenLayout):
            raise ValueError(f"tokens must be a TokenLayout, got {type(tokens).__name__}")
        if (tokens.dcp_size, tokens.dcp_rank) != (heads.dcp_size, heads.dcp_rank):
            raise ValueError(
                f"tokens (dcp_size={tokens.dcp_size}, dcp_rank={tokens.dcp_rank}) and heads (dcp_size="
                f"{heads.dcp_size}, dcp_rank={heads.dcp_rank}) describe different DCP positions"
            )
        if group is None:
            if heads.dcp_size != 1:
                raise ValueError(f"group is None but dcp_size={heads.dcp_size}; pass a DcpGroup of that size")
        elif (group.world_size, group.rank_in_group) != (heads.dcp_size, heads.dcp_rank):
            raise ValueError(
                f"group has world_size={group.world_size}, rank_in_group={group.rank_in_group}, but the layouts "
                f"say dcp_size={heads.dcp_size}, dcp_rank={heads.dcp_rank}"
            )
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale must be a finite float > 0 (usually head_dim ** -0.5), got {scale!r}")
        if comm not in _COMBINE_OPS:
            raise ValueError(f"comm must be 'ag_rs' or 'a2a', got {comm!r}")
        if ops is None:
            from dcp_plugin import kernels as ops
        needed = _COMMON_OPS + (_COMBINE_OPS[comm] if heads.dcp_size > 1 else ())
        missing = [name for name in needed if not callable(getattr(ops, name, None))]
        if missing:
            raise ValueError(
                f"ops={getattr(ops, '__name__', ops)!r} lacks {', '.join(missing)}; pass a namespace with the "
                "signatures of dcp_plugin.kernels.reference (ops=dcp_plugin.kernels.reference runs the torch path)"
            )
        self.heads, self.tokens, self.group, self.scale, self.comm, self.ops = heads, tokens, group, scale, comm, ops
        self._head_map = dict(scale=scale, q_per_kv=heads.q_per_kv, kv_head_start=heads.kv_head_start)

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
    ) -> torch.Tensor:
        """Write this step's owned K/V into the local cache and return the attention output of the local Q heads.

        ``q``: ``[num_tokens, heads.num_q_heads, D]``; ``k``, ``v``: ``[num_tokens, heads.num_kv_heads, D]``
        (all the step's new tokens, whichever rank owns them); ``key_cache``/``value_cache``:
        ``[num_blocks, block_size, heads.num_kv_heads, D]`` (strided views allowed), updated in place;
        one dtype (fp16/bf16/fp32) and one device for all. ``out`` (default: new) is ``q``-shaped, ``q.dtype``.
        ``write_kv=False`` when the host already stored this step's K/V through ``batch.slot_mapping`` (vLLM's
        ``do_kv_cache_update``), so the cache is written once.
        No host synchronisation; every rank of the group must call it with the same batch shape.
        """
        self._check_inputs(q, k, v, key_cache, value_cache, batch, out)
        heads, ops = self.heads, self.ops
        if out is None:
            out = torch.empty_like(q)
        if write_kv:
            ops.write_kv_cache(k, v, key_cache, value_cache, batch.slot_mapping)
        if batch.max_query_len == 1:
            # Decode: each new token is already in its owner's shard, so attending non-causally to every rank's
            # whole shard IS causal attention: no current-chunk pass, no merge. Steps with more query tokens (spec
            # decode, prefill) take the split below, which needs no position-aware mask over the sharded cache.
            self._shards(q, key_cache, value_cache, batch, batch.local_seq_lens, batch.max_local_seq_len, None, out)
            return out
        # The current chunk: local Q heads against the step's own K/V, no communication, no K/V slicing.
        cur_args = (q, k, v, batch.query_start_loc, batch.max_query_len)
        if batch.max_context_len == 0:  # rank-invariant: no rank has a prefix, so no rank enters a collective
            ops.extend_attention(*cur_args, q_head_start=heads.q_head_start, out=out, **self._head_map)
            return out
        current = ops.extend_attention(*cur_args, q_head_start=heads.q_head_start, **self._head_map)
        self._shards(q, key_cache, value_cache, batch, batch.local_context_lens, batch.max_local_context_len,
                     current, out)
        return out

    def _shards(self, q, key_cache, value_cache, batch, lens, max_len, current, out) -> None:
        """Attention of the local Q heads to every rank's shard (``lens`` cached tokens per request here, at most
        ``max_len`` on any rank), combined across the group by LSE and merged with the ``current`` (out, lse)
        partial when there is one, into ``out``."""
        heads, ops = self.heads, self.ops
        if heads.dcp_size == 1:
            if current is None:
                self._paged(q, key_cache, value_cache, batch, lens, max_len, heads.q_head_start, out=out)
            else:
                prefix = self._paged(q, key_cache, value_cache, batch, lens, max_len, heads.q_head_start)
                ops.merge_states(*prefix, *current, out=out)
            return
        q_group = self.group.all_gather(q, dim=1)
        combine = self._combine_ag_rs if self.comm == "ag_rs" else self._combine_a2a
        combine(q_group, key_cache, value_cache, batch, lens, max_len, current, out)

    def _paged(self, q, key_cache, value_cache, batch, lens, max_len, q_head_start, *, out=None, lse=None):
        """Non-causal attention of ``q`` to this rank's shard: float32 partials unless ``out`` says otherwise."""
        if out is None:
            out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        return self.ops.paged_attention(
            q, key_cache, value_cache, batch.block_table, lens, batch.query_start_loc, q_head_start=q_head_start,
            max_context_len=max_len, max_query_len=batch.max_query_len, out=out, lse=lse, **self._head_map,
        )

    def _combine_ag_rs(self, q_group, key_cache, value_cache, batch, lens, max_len, current, out) -> None:
        group, heads, ops = self.group, self.heads, self.ops
        part_out, part_lse = self._paged(q_group, key_cache, value_cache, batch, lens, max_len,
                                         heads.group_q_head_start)
        lse_all = group.all_gather(part_lse.unsqueeze(0), dim=0)  # [N, T, H_group]
        # [T, H_group, D] stored head-major, so the reduce-scatter along heads needs no transposing copy.
        num_tokens, num_heads, head_dim = part_out.shape
        scaled = torch.empty(num_heads, num_tokens, head_dim, dtype=torch.float32, device=part_out.device)
        scaled, lse_total = ops.rescale_partial(part_out, lse_all, group.rank_in_group, out=scaled.transpose(0, 1))
        mine = group.reduce_scatter(scaled, dim=1)  # [T, H_local, D] float32: the combined shards of my heads
        if current is None:
            out.copy_(mine)
            return
        first = group.rank_in_group * heads.num_q_heads
        ops.merge_states(mine, lse_total[:, first:first + heads.num_q_heads], *current, out=out)

    def _combine_a2a(self, q_group, key_cache, value_cache, batch, lens, max_len, current, out) -> None:
        group, heads, ops = self.group, self.heads, self.ops
        num_tokens, _, head_dim = q_group.shape
        n, h_local = group.world_size, heads.num_q_heads
        # Packed (O, LSE) per (token, destination rank, head): the kernel writes straight into it.
        packed = torch.empty(num_tokens, n, h_local, head_dim + 1, dtype=torch.float32, device=q_group.device)
        self._paged(q_group, key_cache, value_cache, batch, lens, max_len, heads.group_q_head_start,
                    out=packed[..., :head_dim].view(num_tokens, n * h_local, head_dim),
                    lse=packed[..., head_dim].view(num_tokens, n * h_local))
        received = group.all_to_all(packed.transpose(0, 1))  # [N source ranks, T, H_local, D + 1]
        # One kernel: the N partials (and the current chunk, if any), straight into out.
        extra_out, extra_lse = current if current is not None else (None, None)
        ops.combine_partials(received[..., :head_dim], received[..., head_dim], extra_out=extra_out,
                             extra_lse=extra_lse, out=out)

    def _check_inputs(self, q, k, v, key_cache, value_cache, batch, out) -> None:
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
        if q.dtype not in _INPUT_DTYPES:
            raise ValueError(f"q has dtype {q.dtype}; supported: float16, bfloat16, float32")
        num_tokens, head_dim = batch.num_tokens, q.shape[-1]
        expected = {
            "q": (q, (num_tokens, heads.num_q_heads, head_dim)),
            "k": (k, (num_tokens, heads.num_kv_heads, head_dim)),
            "v": (v, (num_tokens, heads.num_kv_heads, head_dim)),
            "key_cache": (key_cache, (key_cache.shape[0], self.tokens.block_size, heads.num_kv_heads, head_dim)),
            "value_cache": (value_cache, tuple(key_cache.shape)),
        }
        if out is not None:
            expected["out"] = (out, tuple(q.shape))
        for name, (t, shape) in expected.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}, expected {shape} (num_tokens={num_tokens} from the batch, "
                    f"{heads.num_q_heads} local Q / {heads.num_kv_heads} stored KV heads, "
                    f"block_size={self.tokens.block_size}, head_dim={head_dim} from q)"
                )
            if t.dtype != q.dtype:
                raise ValueError(f"{name} has dtype {t.dtype} but q has {q.dtype}; all inputs must share one dtype")
            if t.device != batch.device:
                raise ValueError(f"{name} is on {t.device} but the batch tensors are on {batch.device}")

