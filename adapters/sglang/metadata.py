"""Per-step metadata: SGLang's ``ForwardBatch`` -> one ``DcpBatch`` that every layer of the step reads.

Token placement under DCP is SGLang's own (docs/design.md, "SGLang's token placement"): with ``N`` ranks and page
size ``P``, the allocator hands out pages of ``P * N`` widened slots, page-aligned with the positions, and the
token at position ``p`` with widened slot ``s`` is stored by rank ``p % N`` at row ``s // N`` of its cache. That is
``TokenLayout(dcp_size=N, interleave=1, block_size=P)`` with the allocator's page ids as block-table entries:
column ``j`` of a request's table is ``req_to_token[req, j * P * N] // (P * N)``, the same page on every rank.
"""

from __future__ import annotations

import torch

from dcp_plugin.batch import DcpBatch, DcpBatchBuffers
from dcp_plugin.layout import TokenLayout


class StepBuilder:
    """Builds each step's ``DcpBatch`` from a ``ForwardBatch``, on the host, once per step.

    ``req_to_token``: SGLang's ``[max_reqs, max_context_len]`` map from (request slot, position) to widened slot.
    After ``init_decode_graphs`` the decode steps SGLang replays from CUDA graphs are built over persistent
    buffers (fixed addresses, refreshed in place) with host bounds at the table's capacity, so the launches a graph
    captured serve every later decode step of the same batch size.
    """

    def __init__(self, *, tokens: TokenLayout, req_to_token: torch.Tensor) -> None:
        self.tokens = tokens
        self.req_to_token = req_to_token
        self.span = tokens.block_size * tokens.dcp_size  # positions per allocator page
        self.max_context_len = req_to_token.shape[1]
        self.width = -(-self.max_context_len // self.span)  # block-table columns that cover any request
        self.graph: dict[str, torch.Tensor] | None = None
        self.graph_buffers: DcpBatchBuffers | None = None

    def init_decode_graphs(self, max_bs: int) -> None:
        """Persistent inputs for decode steps of up to ``max_bs`` requests (SGLang's ``init_cuda_graph_state``)."""
        device = self.req_to_token.device
        self.graph = {
            "query_start_loc": torch.arange(max_bs + 1, dtype=torch.int32, device=device),
            "seq_lens": torch.zeros(max_bs, dtype=torch.int32, device=device),
            "block_table": torch.zeros(max_bs, self.width, dtype=torch.int32, device=device),
            "slot_mapping": torch.full((max_bs,), -1, dtype=torch.int64, device=device),
        }
        self.graph_buffers = DcpBatchBuffers(max_bs, device)

    def build(self, fb) -> DcpBatch:
        """An eager step: decode, extend (prefill chunks, a cached prefix) or mixed."""
        bs = fb.batch_size
        seq_lens = fb.seq_lens[:bs].to(torch.int32)
        if fb.forward_mode.is_decode():
            query_start_loc = torch.arange(bs + 1, dtype=torch.int32, device=seq_lens.device)
            max_seq = int(fb.seq_lens_cpu[:bs].max()) if fb.seq_lens_cpu is not None and bs else None
            hints = dict(max_query_len=1 if bs else 0, max_seq_len=max_seq,
                         max_context_len=None if max_seq is None else max(max_seq - 1, 0))
            num_tokens = bs
        else:
            extend = fb.extend_seq_lens[:bs].to(torch.int32)
            query_start_loc = torch.nn.functional.pad(torch.cumsum(extend, 0, dtype=torch.int32), (1, 0))
            hints = _extend_hints(fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu)
            num_tokens = fb.extend_num_tokens if fb.extend_num_tokens is not None else int(query_start_loc[-1])
        width = self._width(hints["max_seq_len"])
        return DcpBatch.build(
            query_start_loc=query_start_loc, seq_lens=seq_lens,
            block_table=self.block_table(fb.req_pool_indices[:bs], width),
            slot_mapping=self.slot_mapping(fb.out_cache_loc[:num_tokens], seq_lens, query_start_loc, num_tokens),
            tokens=self.tokens, **hints,
        )

    def build_decode_graph(self, fb) -> DcpBatch:
        """A decode step over the persistent buffers (capture and every replay of a CUDA graph of this size)."""
        bs, g = fb.batch_size, self.graph
        seq_lens = fb.seq_lens[:bs]
        g["seq_lens"][:bs].copy_(seq_lens)
        g["block_table"][:bs].copy_(self.block_table(fb.req_pool_indices[:bs], self.width))
        g["slot_mapping"][:bs].copy_(self.slot_mapping(fb.out_cache_loc[:bs], g["seq_lens"][:bs],
                                                       g["query_start_loc"][:bs + 1], bs))
        # Host bounds at the table's capacity: the split-KV count a graph freezes suits any later context.
        return DcpBatch.build(
            query_start_loc=g["query_start_loc"][:bs + 1], seq_lens=g["seq_lens"][:bs],
            block_table=g["block_table"][:bs], slot_mapping=g["slot_mapping"][:bs], tokens=self.tokens,
            max_query_len=1, max_seq_len=self.max_context_len, max_context_len=self.max_context_len - 1,
            num_decodes=0, buffers=self.graph_buffers,
        )

    def block_table(self, req_pool_indices: torch.Tensor, width: int) -> torch.Tensor:
        """``[reqs, width]`` int32: the allocator page of each ``P * N`` positions of each request."""
        columns = torch.arange(width, device=req_pool_indices.device) * self.span
        columns = columns.clamp_max(self.max_context_len - 1)  # past a request's end: any page (never read)
        pages = self.req_to_token[req_pool_indices.long()[:, None], columns[None, :]] // self.span
        return pages.to(torch.int32)

    def slot_mapping(self, out_cache_loc: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                     num_tokens: int) -> torch.Tensor:
        """This rank's cache row of each new token (``out_cache_loc // N``), -1 where another rank owns it. The
        token's position is its index in the request's KV (what placement is defined on), from the lengths."""
        tokens = self.tokens
        if tokens.dcp_size == 1:
            return out_cache_loc.to(torch.int64)
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        first = seq_lens - query_lens  # position of each request's first new token
        rows = torch.arange(num_tokens, device=out_cache_loc.device)
        req = torch.repeat_interleave(torch.arange(seq_lens.shape[0], device=rows.device), query_lens,
                                      output_size=num_tokens)
        positions = first[req] + rows - query_start_loc[:-1][req]
        mine = tokens.owner(positions) == tokens.dcp_rank
        return torch.where(mine, out_cache_loc.to(torch.int64) // tokens.dcp_size, -1)

    def _width(self, max_seq_len: int | None) -> int:
        if max_seq_len is None:
            return self.width
        return max(1, min(self.width, -(-max_seq_len // self.span)))


def _extend_hints(extend_cpu, prefix_cpu) -> dict:
    """Rank-invariant host maxima of an extend step from SGLang's host lists (None: DcpBatch computes them)."""
    if extend_cpu is None or prefix_cpu is None or not len(extend_cpu):
        return dict(max_query_len=None, max_seq_len=None, max_context_len=None)
    return dict(max_query_len=max(extend_cpu), max_context_len=max(prefix_cpu),
                max_seq_len=max(e + p for e, p in zip(extend_cpu, prefix_cpu)))
