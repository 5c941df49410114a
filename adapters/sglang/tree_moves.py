"""Accepted draft-tree tokens under DCP: SGLang's KV move, done across the ranks of the group.

After a verify step whose drafts form a tree (EAGLE with ``topk > 1``, n-gram), SGLang keeps the accepted branch by
moving each accepted draft's K/V from its window slot to the window's leading slots:
``token_to_kv_pool_allocator.get_kvcache().move_kv_cache(tgt, src)`` with widened slot ids, a copy inside one
rank's pool. Under DCP a widened slot ``s`` is row ``s // N`` of rank ``s % N``, so a target and its source may lie
on different ranks, and the rows are not the ids. Every rank computes the whole window's K/V in the verify step (KV
heads are replicated in the DCP group), so each full-attention layer keeps a copy of it there (``keep``); the move
(``move``, put in place of the pool's own for this pool object only) then writes each target slot its rank owns
from that copy. Stream order makes it safe: the move runs after the verify step's layers and before the next step's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class TreeMoves:
    """The window copies of one rank's full-attention layers, and the move that reads them.

    ``cache_views(layer_id)``: the layer's ``[pages, page, kv_heads, D]`` K and V views of SGLang's pool (the
    backend's); ``layer_ids``: the model's full-attention layer ids; ``max_tokens``: the most draft tokens of a
    verify step (requests times draft tokens).
    """

    def __init__(self, *, dcp_size: int, dcp_rank: int, page_size: int, layer_ids: list[int], max_tokens: int,
                 kv_heads: int, head_dim: int, dtype: torch.dtype, device,
                 cache_views: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.dcp_size, self.dcp_rank, self.page_size = dcp_size, dcp_rank, page_size
        self.index = {layer_id: i for i, layer_id in enumerate(layer_ids)}
        self._shape, self._dtype, self._device = (len(layer_ids), kv_heads, head_dim), dtype, device
        self._cache_views = cache_views
        self.hold(max_tokens)

    def hold(self, max_tokens: int) -> None:
        """Room for verify steps of ``max_tokens`` tokens (made anew when larger: SGLang sizes its CUDA graphs
        before it serves or captures anything)."""
        if getattr(self, "window", None) is not None and self.window.shape[0] >= max_tokens:
            return
        layers, kv_heads, head_dim = self._shape
        self.keys = torch.zeros(layers, max_tokens, kv_heads, head_dim, dtype=self._dtype, device=self._device)
        self.values = torch.zeros_like(self.keys)
        # The verify window's widened slots, in the copies' row order (-1 past the step's tokens).
        self.window = torch.full((max_tokens,), -1, dtype=torch.int64, device=self._device)

    def set_window(self, out_cache_loc: torch.Tensor) -> None:
        """A verify step's slots (``ForwardBatch.out_cache_loc``), when its metadata is built."""
        n = out_cache_loc.shape[0]
        self.window[:n].copy_(out_cache_loc)
        self.window[n:].fill_(-1)

    def keep(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A verify step's K/V ``[T, kv_heads, D]`` of one layer (in its forward)."""
        i = self.index[layer_id]
        self.keys[i, :k.shape[0]].copy_(k)
        self.values[i, :v.shape[0]].copy_(v)

    def move(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """SGLang's ``move_kv_cache``: slot ``tgt_loc[i]`` gets the K/V of slot ``src_loc[i]`` of the last verify
        window, on the rank that owns ``tgt_loc[i]``, in every full-attention layer. A source outside the window (the
        unused tail SGLang passes as 0) moves nothing."""
        if tgt_loc.numel() == 0:
            return
        tgt, src = tgt_loc.reshape(-1).to(torch.int64), src_loc.reshape(-1).to(torch.int64)
        order = torch.argsort(self.window)
        ranked = self.window[order]
        at = torch.searchsorted(ranked, src).clamp_max(ranked.shape[0] - 1)
        found = (ranked[at] == src) & (src >= 0)
        mine = found & (tgt % self.dcp_size == self.dcp_rank)
        rows, tgt = order[at][mine], tgt[mine] // self.dcp_size
        page, offset = tgt // self.page_size, tgt % self.page_size
        for layer_id, i in self.index.items():
            key_cache, value_cache = self._cache_views(layer_id)
            key_cache[page, offset] = self.keys[i, rows].to(key_cache.dtype)
            value_cache[page, offset] = self.values[i, rows].to(value_cache.dtype)
