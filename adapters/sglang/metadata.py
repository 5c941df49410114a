"""Per-step metadata: SGLang's ``ForwardBatch`` -> one ``DcpBatch`` that every layer of the step reads.

Token placement under DCP is SGLang's own (docs/design.md, "SGLang's token placement"): with ``N`` ranks and page
size ``P``, the allocator hands out pages of ``P * N`` widened slots, page-aligned with the positions, and the
token at position ``p`` with widened slot ``s`` is stored by rank ``p % N`` at row ``s // N`` of its cache. That is
``TokenLayout(dcp_size=N, interleave=1, block_size=P)`` with the allocator's page ids as block-table entries:
column ``j`` of a request's table is ``req_to_token[req, j * P * N] // (P * N)``, the same page on every rank.

A speculative verify step (``TARGET_VERIFY``) gives each request its ``d`` draft tokens after ``seq_lens`` cached
ones, in the slots ``req_to_token[req, seq_len:seq_len + d]``: the token at index ``i`` of the window is placed as
position ``seq_len + i`` (where it stays when accepted in order), whatever its depth in the draft tree. A tree
(EAGLE with ``topk > 1``, n-gram) comes as the step's ``custom_mask``; a chain (``topk == 1``) is causal. The draft
model's extend after a verify step (``DRAFT_EXTEND_V2``) is a causal window of the same width per request, counted
in its ``seq_lens`` already.
"""

from __future__ import annotations

import torch

from dcp_plugin.batch import DcpBatch, DcpBatchBuffers
from dcp_plugin.layout import TokenLayout


class StepBuilder:
    """Builds each step's ``DcpBatch`` from a ``ForwardBatch``, on the host, once per step.

    ``req_to_token``: SGLang's ``[max_reqs, max_context_len]`` map from (request slot, position) to widened slot.
    After ``init_graphs`` the steps SGLang replays from CUDA graphs (decode, or verify under speculation) are built
    over persistent buffers (fixed addresses, refreshed in place) with host bounds at the table's capacity, so the
    launches a graph captured serve every later step of the same batch size. SGLang pads a replayed batch to the
    captured size: the padded requests' tokens write nothing (slot -1).
    """

    def __init__(self, *, tokens: TokenLayout, req_to_token: torch.Tensor) -> None:
        self.tokens = tokens
        self.req_to_token = req_to_token
        self.span = tokens.block_size * tokens.dcp_size  # positions per allocator page
        self.max_context_len = req_to_token.shape[1]
        self.width = -(-self.max_context_len // self.span)  # block-table columns that cover any request
        self.graph: dict[str, torch.Tensor] | None = None
        self.graph_buffers: DcpBatchBuffers | None = None

    def init_graphs(self, max_bs: int, max_num_tokens: int, *, verify_tokens: int = 0,
                    trees: torch.Tensor | None = None) -> None:
        """Persistent inputs for graph steps of up to ``max_bs`` requests and ``max_num_tokens`` tokens (SGLang's
        ``init_cuda_graph_state``); ``verify_tokens``: the draft tokens per request of a speculative run's verify
        steps (0: none), whose draft trees a graph reads from ``trees`` (``[>= max_bs, d, d]`` bool; default a
        buffer of its own)."""
        device = self.req_to_token.device
        d = max(verify_tokens, 1)
        if trees is None:
            trees = torch.ones(max_bs, d, d, dtype=torch.bool, device=device).tril()
        self.graph = {
            "query_start_loc": torch.arange(max_bs + 1, dtype=torch.int32, device=device) * d,
            "seq_lens": torch.zeros(max_bs, dtype=torch.int32, device=device),
            "block_table": torch.zeros(max_bs, self.width, dtype=torch.int32, device=device),
            "slot_mapping": torch.full((max(max_num_tokens, max_bs * d),), -1, dtype=torch.int64, device=device),
            "tree": trees,
        }
        self.graph_buffers = DcpBatchBuffers(max_bs, device)

    def build(self, fb) -> DcpBatch:
        """An eager step: decode, extend (prefill chunks, a cached prefix; a draft model's extend), mixed, or a
        speculative verify step."""
        bs = fb.batch_size
        if fb.forward_mode.is_target_verify():
            return self._build_verify(fb, bs)
        seq_lens = fb.seq_lens[:bs].to(torch.int32)
        if fb.forward_mode.is_decode_or_idle():  # an IDLE batch (a DP-attention rank without requests, padded) too
            query_start_loc = torch.arange(bs + 1, dtype=torch.int32, device=seq_lens.device)
            max_seq = longest_on_host(fb, bs, self.max_context_len)
            hints = dict(max_query_len=1 if bs else 0, max_seq_len=max_seq, max_context_len=max(max_seq - 1, 0))
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

    def _build_verify(self, fb, bs: int) -> DcpBatch:
        d = fb.spec_info.draft_token_num
        seq_lens = (fb.seq_lens[:bs] + d).to(torch.int32)  # SGLang's seq_lens leave out the draft tokens
        query_start_loc = torch.arange(bs + 1, dtype=torch.int32, device=seq_lens.device) * d
        longest = longest_on_host(fb, bs, self.max_context_len - d)
        hints = dict(max_query_len=d, max_seq_len=longest + d, max_context_len=longest)
        return DcpBatch.build(
            query_start_loc=query_start_loc, seq_lens=seq_lens,
            block_table=self.block_table(fb.req_pool_indices[:bs], self._width(hints["max_seq_len"])),
            slot_mapping=self.slot_mapping(fb.out_cache_loc[:bs * d], seq_lens, query_start_loc, bs * d),
            tokens=self.tokens, chunk_mask=draft_tree(fb.spec_info, fb.seq_lens[:bs], bs), **hints,
        )

    def build_graph(self, fb) -> DcpBatch:
        """A decode, verify or draft-extend step over the persistent buffers (capture and every replay of a CUDA
        graph of this size). ``fb`` may be SGLang's replay view: ``batch_size`` and the per-request tensors padded to
        the captured size, ``out_cache_loc`` (and the draft tree) the real requests' only."""
        bs, g = fb.batch_size, self.graph
        verify, extend = fb.forward_mode.is_target_verify(), is_draft_extend_window(fb.forward_mode)
        d = g["tree"].shape[1] if extend else fb.spec_info.draft_token_num if verify else 1
        if g["tree"].shape[1] != d:
            raise ValueError(f"a graph step of {d} tokens per request, but the graphs were prepared for "
                             f"{g['tree'].shape[1]} (init_cuda_graph_state)")
        real = fb.out_cache_loc.shape[0] // d  # the real requests, before SGLang's padding
        query_start_loc = g["query_start_loc"][:bs + 1]
        if extend:  # the window is in seq_lens; a padded request (seq_len 1) reads no cached token
            g["seq_lens"][:bs].copy_(fb.seq_lens[:bs].clamp_min(d))
        else:
            g["seq_lens"][:bs].copy_(fb.seq_lens[:bs] + (d if verify else 0))
        g["block_table"][:bs].copy_(self.block_table(fb.req_pool_indices[:bs], self.width))
        slots = g["slot_mapping"]
        slots[:real * d].copy_(self.slot_mapping(fb.out_cache_loc, g["seq_lens"][:real], query_start_loc[:real + 1],
                                                 real * d))
        slots[real * d:bs * d].fill_(-1)  # padded requests write nothing
        tree = None
        live = draft_tree(fb.spec_info, fb.seq_lens[:real], real) if verify else None
        if live is not None:
            tree = g["tree"][:bs]
            if live.data_ptr() != tree.data_ptr():  # EAGLE writes into the verify_mask buffer, which is this one
                tree[:real].copy_(live)
        # Host bounds at the table's capacity: the split-KV count a graph freezes suits any later context.
        return DcpBatch.build(
            query_start_loc=query_start_loc, seq_lens=g["seq_lens"][:bs], block_table=g["block_table"][:bs],
            slot_mapping=slots[:bs * d], tokens=self.tokens, max_query_len=d, max_seq_len=self.max_context_len,
            max_context_len=self.max_context_len - d, num_decodes=0, buffers=self.graph_buffers, chunk_mask=tree,
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


def longest_on_host(fb, bs: int, capacity: int) -> int:
    """The longest of the batch's ``seq_lens`` as a host int, never read from the GPU: SGLang's host copy
    (``seq_lens_cpu``) where the step has one, else ``capacity`` (what the slot table holds). SGLang's overlap
    scheduler leaves that copy out when every backend of the run declares ``needs_cpu_seq_lens = False``, as
    dcp-triton's do: copying it would wait, each step, for the step before to finish on the GPU."""
    if not bs:
        return 0
    cpu = getattr(fb, "seq_lens_cpu", None)
    return int(cpu[:bs].max()) if cpu is not None else capacity


def graphed(forward_mode) -> bool:
    """Whether ``StepBuilder.build_graph`` builds a step of ``forward_mode`` (the modes SGLang replays from graphs)."""
    return forward_mode.is_decode_or_idle() or forward_mode.is_target_verify() or is_draft_extend_window(forward_mode)


def is_draft_extend_window(forward_mode) -> bool:
    """SGLang's ``DRAFT_EXTEND_V2``: the draft's extend over a fixed window per request (absent before 0.5.17's)."""
    return bool(getattr(forward_mode, "is_draft_extend_v2", lambda: False)())


def draft_tree(spec_info, seq_lens: torch.Tensor, bs: int) -> torch.Tensor | None:
    """A verify step's draft trees as ``[bs, d, d]`` bool (draft token ``i`` of request ``b`` sees draft token ``j``
    where ``[b, i, j]``), or ``None`` for chains (EAGLE with ``topk == 1``: causal). ``spec_info.custom_mask`` holds
    them in one of SGLang's two layouts: per request ``[d, d]`` (``QLEN_ONLY``: EAGLE with this backend's
    ``verify_mask``; n-gram on CPU), or ``[d, seq_len + d]`` whose leading ``seq_len`` columns are the cached prefix
    (``FULL_MASK``: n-gram on a GPU)."""
    if getattr(spec_info, "topk", None) == 1:
        return None
    d, mask = spec_info.draft_token_num, spec_info.custom_mask
    if getattr(spec_info, "topk", None) is not None or mask.numel() == bs * d * d:  # EAGLE's, or n-gram's QLEN_ONLY
        return mask[:bs * d * d].view(bs, d, d)
    rows = seq_lens.to(torch.int64) + d  # FULL_MASK: request b's d rows of seq_len + d columns, one after another
    starts = torch.cumsum(rows * d, 0) - rows * d + seq_lens
    i = torch.arange(d, device=mask.device)
    return mask[starts[:, None, None] + i[None, :, None] * rows[:, None, None] + i[None, None, :]]


def _extend_hints(extend_cpu, prefix_cpu) -> dict:
    """Rank-invariant host maxima of an extend step from SGLang's host lists (None: DcpBatch computes them)."""
    if extend_cpu is None or prefix_cpu is None or not len(extend_cpu):
        return dict(max_query_len=None, max_seq_len=None, max_context_len=None)
    return dict(max_query_len=max(extend_cpu), max_context_len=max(prefix_cpu),
                max_seq_len=max(e + p for e, p in zip(extend_cpu, prefix_cpu)))
