"""One step's batch as DCP attention needs it: built once per step, read by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dcp_plugin.kernels.checks import check_chunk_mask, check_int, check_tensor
from dcp_plugin.layout import TokenLayout


@dataclass(frozen=True, slots=True, kw_only=True)
class DcpBatch:
    """Engine-agnostic description of one step's batch on one DCP rank.

    Request ``b`` has ``query_lens[b]`` new tokens (rows ``query_start_loc[b]:query_start_loc[b + 1]`` of q/k/v)
    and ``context_lens[b] = seq_lens[b] - query_lens[b]`` tokens cached before this step, of which this rank stores
    ``local_context_lens[b]`` in the pages ``block_table[b]`` (``local_seq_lens[b]`` once this step's tokens are
    written). The derived device tensors are int32 ``[num_reqs]``.
    The host ints are rank-invariant: ``max_context_len`` is the global maximum context (0 means no request has a
    cached prefix, so DCP attention skips its collectives) and ``max_local_context_len`` bounds
    ``local_context_lens`` (``max_local_seq_len`` bounds ``local_seq_lens``) on every rank of the group.
    ``num_decodes``: how many leading requests have exactly one new token (0 when unknown); a mixed step runs their
    prefix pass apart, with the decode kernel. ``chunk_mask``: which of its own new tokens each new token sees (a
    speculative verify step's tree), ``None`` for causal. Build it with ``DcpBatch.build``.
    """

    tokens: TokenLayout
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens: torch.Tensor
    context_lens: torch.Tensor
    local_context_lens: torch.Tensor
    local_seq_lens: torch.Tensor
    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    max_context_len: int
    max_local_context_len: int
    max_local_seq_len: int
    num_decodes: int = 0
    chunk_mask: torch.Tensor | None = None
    # Prepared launches of this step (DcpAttention.forward), shared by the layers with equal settings and shapes.
    plans: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def device(self) -> torch.device:
        return self.query_start_loc.device

    @classmethod
    def build(
        cls,
        *,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        tokens: TokenLayout,
        max_query_len: int | None = None,
        max_seq_len: int | None = None,
        max_context_len: int | None = None,
        num_decodes: int | None = None,
        buffers: DcpBatchBuffers | None = None,
        chunk_mask: torch.Tensor | None = None,
    ) -> DcpBatch:
        """Derive every per-step quantity once.

        Args:
            query_start_loc: ``[num_reqs + 1]`` int32, cumulative new-token counts (starts at 0).
            seq_lens: ``[num_reqs]`` int32, global sequence lengths INCLUDING this step's tokens.
            block_table: ``[>= num_reqs, max_pages]`` int32, this rank's local pages of each request.
            slot_mapping: ``[num_tokens]`` int32/int64, local cache slot of each new token, -1 where another rank
                owns it.
            tokens: this rank's ``TokenLayout``.
            max_query_len, max_seq_len, max_context_len: host ints (global maxima over the batch, identical on
                every rank) when the engine knows them. Any that is missing is computed here with one device->host
                copy, which also validates the tensors' values; when all three are given for device tensors,
                nothing is synchronised and only shapes are checked.
            num_decodes: host int, how many leading requests have exactly one new token (the engine orders decodes
                first); computed here when the tensors are read anyway, else 0 (the step then runs as one pass).
            buffers: persistent buffers for the derived tensors (``DcpBatchBuffers``): every batch built with
                them keeps the same device addresses, so a CUDA graph captured over one step replays on the next.
            chunk_mask: bool or uint8 ``[>= num_reqs, M, M]`` (``M >= max_query_len``): new token ``i`` of request
                ``b`` sees new token ``j`` of it where ``chunk_mask[b, i, j]`` is true (a speculative verify step's
                tree: a draft token sees its ancestors and itself); ``None``: where ``j <= i``. It applies to the
                current chunk only: every new token sees the request's whole cached context.

        Example::

            batch = DcpBatch.build(query_start_loc=qsl, seq_lens=seq_lens, block_table=table,
                                   slot_mapping=slots, tokens=TokenLayout(dcp_size=2, dcp_rank=0))
        """
        if not isinstance(tokens, TokenLayout):
            raise ValueError(f"tokens must be a TokenLayout, got {type(tokens).__name__}")
        check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,))
        device = query_start_loc.device
        if query_start_loc.shape[0] < 1:
            raise ValueError("query_start_loc must have num_reqs + 1 >= 1 entries, got an empty tensor")
        num_reqs = query_start_loc.shape[0] - 1
        check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=device)
        if seq_lens.shape[0] != num_reqs:
            raise ValueError(
                f"seq_lens has {seq_lens.shape[0]} entries but query_start_loc describes {num_reqs} requests "
                f"(it must have num_reqs + 1 = {seq_lens.shape[0] + 1} entries)"
            )
        check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), device=device)
        if block_table.shape[0] < num_reqs:
            raise ValueError(f"block_table has {block_table.shape[0]} rows but the batch has {num_reqs} requests")
        check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int32, torch.int64), device=device)
        hints = {"max_query_len": max_query_len, "max_seq_len": max_seq_len, "max_context_len": max_context_len}
        for name, value in {**hints, "num_decodes": num_decodes}.items():
            if value is not None:
                check_int(name, value, low=0, kind="a host int", note=" (or None to compute it)")
        if num_decodes is not None and num_decodes > num_reqs:
            raise ValueError(f"num_decodes={num_decodes} is more than the batch's {num_reqs} requests")

        if buffers is not None:
            buffers.check(num_reqs, device)
            derived = buffers.derive(query_start_loc, seq_lens, tokens, num_reqs)
        else:
            derived = _derive(query_start_loc, seq_lens, tokens)
        num_tokens = slot_mapping.shape[0]

        if device.type == "cpu" or any(value is None for value in hints.values()):
            actual = _host_stats(query_start_loc, derived["query_lens"], seq_lens, derived["context_lens"], num_reqs)
            _check_values(actual, num_tokens)
            for name, value in hints.items():
                if value is not None and value < actual[name]:
                    raise ValueError(f"{name}={value} is smaller than the batch's actual {name}={actual[name]}")
                hints[name] = actual[name] if value is None else value
            if num_decodes is None:
                num_decodes = leading_decodes(query_start_loc.cpu())
            elif num_decodes > leading_decodes(query_start_loc.cpu()):
                raise ValueError(f"num_decodes={num_decodes}, but the batch starts with only "
                                 f"{leading_decodes(query_start_loc.cpu())} single-token requests")

        if chunk_mask is not None:
            check_chunk_mask(chunk_mask, num_reqs, hints["max_query_len"], device)
        max_local_context_len = tokens.max_local_len(hints["max_context_len"])
        max_local_seq_len = tokens.max_local_len(hints["max_seq_len"])
        pages_needed = -(-max_local_seq_len // tokens.block_size)
        if block_table.shape[1] < pages_needed:
            raise ValueError(
                f"block_table has {block_table.shape[1]} columns, but a local shard of up to "
                f"{max_local_seq_len} tokens needs {pages_needed} pages of block_size={tokens.block_size}"
            )
        return cls(
            tokens=tokens,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=slot_mapping,
            **derived,
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            max_query_len=hints["max_query_len"],
            max_seq_len=hints["max_seq_len"],
            max_context_len=hints["max_context_len"],
            max_local_context_len=max_local_context_len,
            max_local_seq_len=max_local_seq_len,
            num_decodes=num_decodes or 0,
            chunk_mask=chunk_mask,
        )


class DcpBatchBuffers:
    """Persistent int32 buffers for the per-request tensors ``DcpBatch.build`` derives (``query_lens``,
    ``context_lens``, ``local_context_lens``, ``local_seq_lens``), for batches of up to ``max_num_reqs`` requests.

    A batch built with them reads and writes only these buffers and the tensors it was given, so when the
    engine also keeps those in persistent buffers (vLLM does), a CUDA graph captured over one step's attention
    replays correctly on any later step: each build refreshes the values in place. One per engine metadata
    builder; a batch is valid until the next build with the same buffers.
    """

    NAMES = ("query_lens", "context_lens", "local_context_lens", "local_seq_lens")

    def __init__(self, max_num_reqs: int, device: torch.device | str) -> None:
        check_int("max_num_reqs", max_num_reqs, low=1, note=" (the engine's most requests per step)")
        self.max_num_reqs = max_num_reqs
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())  # batch tensors carry an index
        self.buffers = {name: torch.zeros(max_num_reqs, dtype=torch.int32, device=self.device)
                        for name in self.NAMES}
        self._launches: dict[tuple, object] = {}  # (num_reqs, dcp_size, dcp_rank, interleave) -> prepared launch
        self._views: dict[int, dict[str, torch.Tensor]] = {}  # num_reqs -> the buffers' first num_reqs entries

    def derive(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, tokens: TokenLayout,
               num_reqs: int) -> dict[str, torch.Tensor]:
        """The four per-request tensors of a batch of ``num_reqs`` requests, written into these buffers: on a GPU
        by one kernel launch (kept per batch size and layout, so a step of a size seen before replays it), on CPU
        by torch ops."""
        views = self._views.get(num_reqs)
        if views is None:  # made once per batch size: slicing a tensor costs microseconds of host time
            views = self._views[num_reqs] = {name: self.buffers[name][:num_reqs] for name in self.NAMES}
        if self.device.type != "cuda":
            for name, t in _derive(query_start_loc, seq_lens, tokens).items():
                views[name].copy_(t)
            return dict(views)  # the caller's own dict: the cached one stays as it is
        key = (num_reqs, tokens.dcp_size, tokens.dcp_rank, tokens.interleave)
        launch = self._launches.get(key)
        if launch is None:
            from dcp_plugin.kernels.batch_lengths import plan_batch_lengths

            launch = self._launches[key] = plan_batch_lengths(num_reqs, dcp_size=tokens.dcp_size,
                                                              dcp_rank=tokens.dcp_rank, interleave=tokens.interleave)
        launch(query_start_loc, seq_lens, *views.values())
        return dict(views)

    def check(self, num_reqs: int, device: torch.device) -> None:
        if num_reqs > self.max_num_reqs:
            raise ValueError(f"the batch has {num_reqs} requests but the buffers hold max_num_reqs="
                             f"{self.max_num_reqs}; size it for the engine's most requests per step")
        if device != self.device:
            raise ValueError(f"the batch tensors are on {device} but the buffers are on {self.device}")


def _derive(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, tokens: TokenLayout) -> dict[str, torch.Tensor]:
    """The per-request tensors by torch ops (CPU, or a batch built without buffers)."""
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    context_lens = seq_lens - query_lens
    return dict(query_lens=query_lens, context_lens=context_lens,
                local_context_lens=tokens.local_len(context_lens).to(torch.int32),
                local_seq_lens=tokens.local_len(seq_lens).to(torch.int32))


def leading_decodes(query_start_loc_cpu) -> int:
    """How many leading requests have exactly one new token (host ``[num_reqs + 1]``: a CPU tensor or an array)."""
    others = np.flatnonzero(np.diff(np.asarray(query_start_loc_cpu)) != 1)
    return int(others[0]) if others.size else len(query_start_loc_cpu) - 1


def _host_stats(query_start_loc, query_lens, seq_lens, context_lens, num_reqs: int) -> dict[str, int]:
    """Every statistic build needs, in one device->host copy."""
    if num_reqs == 0:
        (first,) = query_start_loc.tolist()
        return dict(first=first, last=first, min_query_len=0, min_context_len=0,
                    max_query_len=0, max_seq_len=0, max_context_len=0)
    stats = torch.stack([
        query_start_loc[0], query_start_loc[-1], query_lens.min(), context_lens.min(),
        query_lens.max(), seq_lens.max(), context_lens.max(),
    ]).tolist()
    names = ("first", "last", "min_query_len", "min_context_len", "max_query_len", "max_seq_len", "max_context_len")
    return dict(zip(names, stats))


def _check_values(actual: dict[str, int], num_tokens: int) -> None:
    if actual["first"] != 0:
        raise ValueError(f"query_start_loc must start at 0, got {actual['first']}")
    if actual["min_query_len"] < 0:
        raise ValueError("query_start_loc must be non-decreasing (a request has a negative query length)")
    if actual["min_context_len"] < 0:
        raise ValueError(
            "seq_lens must be >= the query lengths (seq_lens include this step's tokens); "
            f"some request has seq_len - query_len = {actual['min_context_len']}"
        )
    if actual["last"] != num_tokens:
        raise ValueError(
            f"slot_mapping has {num_tokens} entries but query_start_loc[-1] = {actual['last']} new tokens; "
            "it needs one slot (or -1) per new token"
        )
