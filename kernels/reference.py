"""Slow, obviously correct torch versions of every kernel, with the kernels' signatures.

Conventions (docs/design.md section 2): LSE is the natural log of the sum of exp of the *scaled* scores, shape
``[tokens, heads]``; an empty key set gives O = 0 and LSE = -inf. Local Q head ``i`` of a tensor whose first head
has global index ``q_head_start`` reads stored KV head ``(q_head_start + i) // q_per_kv - kv_head_start``.

The references compute in float64 when given float64 inputs (tests do that) and in float32 otherwise; LSE comes
back in float64 for float64 queries and float32 otherwise. They sync with the host freely: tests and the CPU
fallback only.
"""

from __future__ import annotations

import functools

import torch

from dcp_plugin.kernels.checks import FP8_DTYPES


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _kv_index(num_q_heads: int, q_head_start: int, q_per_kv: int, kv_head_start: int, device) -> torch.Tensor:
    heads = torch.arange(q_head_start, q_head_start + num_q_heads, device=device)
    return heads // q_per_kv - kv_head_start


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None):
    """q [Tq, H, D], k/v [Tk, H, D] (already one KV row per Q head) -> (out [Tq, H, D], lse [Tq, H])."""
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, Tq]
    # Empty rows get 0, not exp(-inf - -inf) = NaN; a NaN score (NaN input) stays NaN.
    probs = torch.exp(scores - lse.unsqueeze(-1)).masked_fill(torch.isneginf(lse).unsqueeze(-1), 0.0)
    out = torch.einsum("hqk,khd->qhd", probs, v)
    return out, lse.transpose(0, 1)


def _finish(out_acc, lse_acc, q, out, lse):
    if out is None:
        out = torch.empty(q.shape[0], q.shape[1], out_acc.shape[-1], dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(q.shape[0], q.shape[1], dtype=_acc_dtype(q), device=q.device)
    _store_heads(out, out_acc)
    _store_heads(lse, lse_acc)
    return out, lse


def _store_heads(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` for a ``[T, H, ...]`` ``src``; ``dst`` is either that shape or its rank-major split
    ``[R, T, H / R, ...]`` (head ``h`` at ``[h // (H / R), t, h % (H / R)]``)."""
    if dst.dim() == src.dim():
        dst.copy_(src)
        return
    ranks = dst.shape[0]
    dst.copy_(src.reshape(src.shape[0], ranks, src.shape[1] // ranks, *src.shape[2:]).transpose(0, 1))


def write_kv_cache(k, v, key_cache, value_cache, slot_mapping, *, k_scale=None, v_scale=None) -> None:
    """Store ``k[t], v[t]`` at slot ``slot_mapping[t]`` (page ``slot // block_size``, row ``slot % block_size``).

    ``k``/``v``: ``[T, H, D]`` with ``T >= len(slot_mapping)`` (rows past it are padding); caches
    ``[num_blocks, block_size, H, D]`` (any strides). Slots < 0 belong to another rank and are skipped. An fp8 cache
    stores ``clamp(value / scale)`` to the format's finite range (``k_scale``, ``v_scale``: one-element tensors).
    """
    block_size = key_cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    tokens = torch.nonzero(slots >= 0).flatten()
    mine = slots[tokens]
    key_cache[mine // block_size, mine % block_size] = _to_cache(k[tokens], key_cache.dtype, k_scale)
    value_cache[mine // block_size, mine % block_size] = _to_cache(v[tokens], value_cache.dtype, v_scale)


def _to_cache(values: torch.Tensor, dtype: torch.dtype, scale) -> torch.Tensor:
    if dtype not in FP8_DTYPES:
        return values.to(dtype)
    limit = torch.finfo(dtype).max
    return (values.to(torch.float32) / scale.to(torch.float32)).clamp(-limit, limit).to(dtype)


def _from_cache(values: torch.Tensor, acc: torch.dtype, scale) -> torch.Tensor:
    """A cache's values in ``acc``, dequantized (times ``scale``) when the cache is fp8."""
    return values.to(acc) * scale.to(acc) if values.dtype in FP8_DTYPES else values.to(acc)


def chunk_attention(q, k, v, query_start_loc, max_query_len, *, scale, q_head_start, q_per_kv, kv_head_start,
                    out=None, lse=None, chunk_mask=None):
    """Causal attention of each sequence's queries to that sequence's own new keys.

    ``q [T, Hq, D]``, ``k/v [T, Hk, D]``, ``query_start_loc [B + 1]``: sequence
    ``b`` is rows ``query_start_loc[b]:query_start_loc[b + 1]``; query row ``i`` of it sees key rows ``0..i`` of it,
    or, given ``chunk_mask`` (``[>= B, M, M]``), the key rows ``j`` where ``chunk_mask[b, i, j]`` is true.
    Returns ``(out [T, Hq, D], lse [T, Hq])``.
    """
    acc = _acc_dtype(q)
    kv = _kv_index(q.shape[1], q_head_start, q_per_kv, kv_head_start, q.device)
    out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse_acc = torch.full(q.shape[:2], float("-inf"), dtype=acc, device=q.device)
    bounds = query_start_loc.tolist()
    for b, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end == start:
            continue
        n = end - start
        if chunk_mask is None:
            mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        else:
            mask = chunk_mask[b, :n, :n].bool()
        o, l = _attend(q[start:end].to(acc), k[start:end, kv].to(acc), v[start:end, kv].to(acc), scale, mask)
        out_acc[start:end], lse_acc[start:end] = o, l
    return _finish(out_acc, lse_acc, q, out, lse)


def prefix_attention(q, key_cache, value_cache, block_table, kv_lens, query_start_loc, *, scale, q_head_start,
                     q_per_kv, kv_head_start, max_kv_len, max_query_len=None, num_splits=None, out=None, lse=None,
                     k_scale=None, v_scale=None):
    """Every query row of request ``b`` attends, non-causally, to its cached tokens ``[0, kv_lens[b])``.

    Cached token ``j`` of request ``b`` is ``key_cache[block_table[b, j // block_size], j % block_size]``.
    ``q [T, Hq, D]`` (request ``b`` is rows ``query_start_loc[b]:query_start_loc[b + 1]``), caches
    ``[num_blocks, block_size, Hk, D]``. ``max_kv_len`` bounds
    ``kv_lens`` and ``max_query_len`` the query rows of a request; with ``num_splits`` they only tune the
    kernel. Returns ``(out [T, Hq, D], lse [T, Hq])``; a request with no cached tokens gets (0, -inf). An fp8 cache
    is read as ``value * k_scale`` / ``value * v_scale``.
    """
    acc = _acc_dtype(q)
    block_size = key_cache.shape[1]
    kv = _kv_index(q.shape[1], q_head_start, q_per_kv, kv_head_start, q.device)
    out_acc = torch.zeros(q.shape[0], q.shape[1], value_cache.shape[-1], dtype=acc, device=q.device)
    lse_acc = torch.full(q.shape[:2], float("-inf"), dtype=acc, device=q.device)
    bounds = query_start_loc.tolist()
    for b, ctx in enumerate(kv_lens.tolist()):
        start, end = bounds[b], bounds[b + 1]
        if end == start or ctx == 0:
            continue
        pos = torch.arange(ctx, device=q.device)
        pages = block_table[b, pos // block_size].to(torch.int64)
        keys = _from_cache(key_cache[pages, pos % block_size][:, kv], acc, k_scale)
        values = _from_cache(value_cache[pages, pos % block_size][:, kv], acc, v_scale)
        out_acc[start:end], lse_acc[start:end] = _attend(q[start:end].to(acc), keys, values, scale, None)
    first = bounds[0]  # rows before the first request (tables that start mid-batch) are not this call's
    if first and out is not None and lse is not None:
        rank_major = out.dim() == 4
        _finish(out_acc[first:], lse_acc[first:], q[first:], out[:, first:] if rank_major else out[first:],
                lse[:, first:] if rank_major else lse[first:])
        return out, lse
    return _finish(out_acc, lse_acc, q, out, lse)


def _empty_if_inf(lses: torch.Tensor) -> torch.Tensor:
    """+inf LSE counts as empty (FA2's convention); NaN stays NaN (docs/design.md section 2)."""
    return lses.masked_fill(lses == float("inf"), float("-inf"))


def _weights(lses: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``exp(lses - total)``, exactly 0 where every partial is empty (no ``-inf - -inf``); NaN where total is."""
    return torch.exp(lses - total).masked_fill(torch.isneginf(total), 0.0)


def merge_partials(parts_out, parts_lse, *, out=None, lse=None, extra_out=None, extra_lse=None):
    """Exact LSE-weighted merge of ``N`` partial results over disjoint key sets.

    ``parts_out [N, T, H, D]``, ``parts_lse [N, T, H]`` (any strides, e.g. views of one packed buffer).
    ``extra_out [T, H, D]`` / ``extra_lse [T, H]``, when given, join as one more partial (the current chunk).
    Partials with LSE -inf (empty) weigh exactly 0, whatever their O holds. Returns ``(out [T, H, D], lse [T, H])``,
    ``out`` in ``parts_out``'s dtype by default.
    """
    acc = _acc_dtype(parts_lse)
    if extra_out is not None:
        acc = torch.promote_types(acc, _acc_dtype(extra_lse))
        if out is None:
            out = torch.empty(parts_out.shape[1:], dtype=parts_out.dtype, device=parts_out.device)
        parts_out = torch.cat([parts_out.to(acc), extra_out.unsqueeze(0).to(acc)])
        parts_lse = torch.cat([parts_lse.to(acc), extra_lse.unsqueeze(0).to(acc)])
    lses = _empty_if_inf(parts_lse.to(acc))
    total = torch.logsumexp(lses, dim=0)  # -inf when every partial is empty, NaN when one LSE is NaN
    weights = _weights(lses, total)  # [N, T, H]
    values = torch.where(weights.unsqueeze(-1) > 0, parts_out.to(acc), 0.0)
    out_acc = (weights.unsqueeze(-1) * values).sum(0)
    if out is None:
        out = torch.empty(parts_out.shape[1:], dtype=parts_out.dtype, device=parts_out.device)
    if lse is None:
        lse = torch.empty(parts_lse.shape[1:], dtype=acc, device=parts_lse.device)
    out.copy_(out_acc)
    lse.copy_(total)
    return out, lse


def merge_states(out_a, lse_a, out_b, lse_b, *, out=None, lse=None):
    """Merge two partial results over disjoint key sets: ``out [T, H, D]`` (dtype of ``out_b`` by default)."""
    if out is None:
        out = torch.empty(out_b.shape, dtype=out_b.dtype, device=out_b.device)
    acc = torch.promote_types(_acc_dtype(lse_a), _acc_dtype(lse_b))
    return merge_partials(
        torch.stack([out_a.to(acc), out_b.to(acc)]), torch.stack([lse_a.to(acc), lse_b.to(acc)]), out=out, lse=lse
    )


def rescale_partial(part_out, lse_all, rank, *, out=None, lse=None):
    """The ``ag_rs`` merge's local step: scale this rank's partial by its share of the global softmax mass.

    ``part_out [T, H, D]`` is rank ``rank``'s partial, ``lse_all [N, T, H]`` every rank's LSE (all-gathered).
    Returns ``(scaled [T, H, D] float32 by default, lse [T, H])``, where summing ``scaled`` over ranks (the
    reduce-scatter) gives the merged output and ``lse`` is the merged LSE.
    """
    acc = _acc_dtype(lse_all)
    lses = _empty_if_inf(lse_all.to(acc))
    total = torch.logsumexp(lses, dim=0)
    weight = _weights(lses[rank], total)
    scaled = torch.where(weight.unsqueeze(-1) > 0, part_out.to(acc), 0.0) * weight.unsqueeze(-1)
    if out is None:
        out = torch.empty(part_out.shape, dtype=torch.float32 if acc != torch.float64 else acc,
                          device=part_out.device)
    if lse is None:
        lse = torch.empty(total.shape, dtype=acc, device=total.device)
    _store_heads(out, scaled)
    lse.copy_(total)
    return out, lse


# The prepared-launch twins of the kernels (``dcp_plugin.kernels.plan_*``): here they only bind the keyword
# arguments; the tensors of each call are passed as the kernels' plans take them.

def plan_write_kv(k, v, key_cache, value_cache, slot_mapping):
    return _write_launch


def _write_launch(k, v, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None):
    write_kv_cache(k, v, key_cache, value_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


def plan_chunk(q, k, v, out, lse, query_start_loc, max_query_len, *, scale, q_head_start, q_per_kv, kv_head_start,
               chunk_mask=None, config=None):
    def launch(q, k, v, out, lse, query_start_loc):
        chunk_attention(q, k, v, query_start_loc, max_query_len, scale=scale, q_head_start=q_head_start,
                        q_per_kv=q_per_kv, kv_head_start=kv_head_start, out=out, lse=lse, chunk_mask=chunk_mask)
    return launch


def plan_prefix(q, key_cache, value_cache, block_table, kv_lens, query_start_loc, out, lse, *, scale,
                q_head_start, q_per_kv, kv_head_start, max_kv_len, max_query_len=None, num_splits=None,
                split_buffer=None, config=None, split_sync=None):
    return functools.partial(_prefix_launch, dict(scale=scale, q_head_start=q_head_start, q_per_kv=q_per_kv,
                                                  kv_head_start=kv_head_start, max_kv_len=max_kv_len,
                                                  max_query_len=max_query_len))


def _prefix_launch(kwargs, q, key_cache, value_cache, block_table, kv_lens, query_start_loc, out, lse,
                   k_scale=None, v_scale=None):
    prefix_attention(q, key_cache, value_cache, block_table, kv_lens, query_start_loc, out=out, lse=lse,
                     k_scale=k_scale, v_scale=v_scale, **kwargs)


def plan_merge(parts_out, parts_lse, extra_out, extra_lse, out, lse, *, o_part_start=0, num_o_parts=None):
    if num_o_parts is not None and (o_part_start, num_o_parts) != (0, parts_out.shape[0]):
        if num_o_parts != 1:
            raise ValueError("the reference merge reads one partial's O (rescale) or all of them")
        return functools.partial(_rescale_launch, o_part_start)
    return _merge_launch


def _merge_launch(parts_out, parts_lse, extra_out, extra_lse, out, lse):
    merge_partials(parts_out, parts_lse, extra_out=extra_out, extra_lse=extra_lse, out=out, lse=lse)


def _rescale_launch(rank, parts_out, parts_lse, extra_out, extra_lse, out, lse):
    rescale_partial(parts_out[rank], parts_lse, rank, out=out, lse=lse)


def split_capacity(head_dim: int, device) -> int:
    return 0


# The former names of the public API (``dcp_plugin.kernels``' ``_FORMER``).
extend_attention = chunk_attention
paged_attention = prefix_attention
