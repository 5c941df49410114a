"""The peers ``bench_kernels.py`` measures beside dcp-triton, each as vLLM launches it: its Triton kernels (unified
attention as TRITON_ATTN runs it, the split-KV decode kernel, ``merge_attn_states``) and FlashAttention-3
(``vllm.vllm_flash_attn.flash_attn_varlen_func`` with ``fa_version=3``; paged calls get the scheduler metadata
vLLM's FLASH_ATTN backend computes per step, outside the timed call as there).

Each builder returns ``{name: fn(i)}`` where ``i`` picks one of the cold copies of the inputs, or ``{}`` when the
peer does not import; a peer that fails is recorded by the caller, never allowed to lose dcp-triton's numbers.
"""

from __future__ import annotations

import torch


def fa3():
    """``(flash_attn_varlen_func, get_scheduler_metadata)`` or None when vLLM's FA3 build is not importable."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata
        from vllm.vllm_flash_attn.flash_attn_interface import is_fa_version_supported
    except Exception:
        return None
    return (flash_attn_varlen_func, get_scheduler_metadata) if is_fa_version_supported(3) else None


def fa3_paged(q, kc, vc, tables, lens, qsl, *, max_query_len: int, max_kv_len: int, causal: bool) -> dict:
    """FA3 over a paged cache: ``q [T, Hq, D]`` rows of request ``b`` at ``qsl[b]:qsl[b + 1]`` attend to its
    ``lens[b]`` cached tokens (``tables[i]`` per cold copy). Non-causal is the DCP prefix pass."""
    fns = fa3()
    if fns is None:
        return {}
    varlen, scheduler = fns
    batch, (_, hq, d), hk, page = lens.shape[0], q.shape, kc.shape[2], kc.shape[1]
    meta = scheduler(batch_size=batch, max_seqlen_q=max_query_len, max_seqlen_k=max_kv_len, num_heads_q=hq,
                     num_heads_kv=hk, headdim=d, cache_seqlens=lens, qkv_dtype=q.dtype, cu_seqlens_q=qsl,
                     page_size=page, causal=causal)
    out = torch.empty_like(q)

    def call(i=0):
        varlen(q, kc, vc, max_seqlen_q=max_query_len, cu_seqlens_q=qsl, max_seqlen_k=max_kv_len, seqused_k=lens,
               softmax_scale=d ** -0.5, causal=causal, block_table=tables[i], return_softmax_lse=True, out=out,
               scheduler_metadata=meta, fa_version=3)

    return {"fa3": call}


def fa3_prefill(q, k, v, cu, seq_len: int) -> dict:
    """FA3 causal varlen prefill over dense ``q``/``k``/``v`` (the current-chunk pass)."""
    fns = fa3()
    if fns is None:
        return {}
    varlen, _ = fns
    out = torch.empty_like(q)

    def call(i=0):
        varlen(q, k, v, max_seqlen_q=seq_len, cu_seqlens_q=cu, max_seqlen_k=seq_len, cu_seqlens_k=cu,
               softmax_scale=q.shape[-1] ** -0.5, causal=True, return_softmax_lse=True, out=out, fa_version=3)

    return {"fa3": call}


def vllm_triton_decode(q, kc, vc, tables, lens, qsl, ctx: int) -> dict:
    """vLLM's Triton unified attention (as its TRITON_ATTN backend launches it) and split-KV decode kernel."""
    try:
        import triton
        from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    except Exception:
        return {}
    batch, hq, d = q.shape
    hk, page = kc.shape[2], kc.shape[1]
    scale = d ** -0.5
    out = torch.empty_like(q)
    threshold = 128 // hk  # TRITON_ATTN: MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads
    segs = 16
    segm_out = torch.empty(threshold, hq, segs, triton.next_power_of_2(d), dtype=torch.float32, device=q.device)
    segm_max = torch.empty(threshold, hq, segs, dtype=torch.float32, device=q.device)
    segm_sum = torch.empty_like(segm_max)

    def unified(i=0):
        unified_attention(q, kc, vc, out, qsl, 1, lens, ctx, scale, True, (-1, -1), tables[i], 0, None, None, None,
                          seq_threshold_3D=threshold, num_par_softmax_segments=segs, softmax_segm_output=segm_out,
                          softmax_segm_max=segm_max, softmax_segm_expsum=segm_sum)

    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    splits = min(triton.next_power_of_2(max(1, ctx // 512)), 2 * sms)  # TritonMLA's choice
    logits = torch.empty(batch, hq, splits, d + 1, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, hq, dtype=torch.float32, device=q.device)
    one = torch.ones((), dtype=torch.float32, device=q.device)  # its default scales are built per call, on the host

    def split_kv(i=0):
        decode_attention_fwd(q, kc, vc, out, lse, tables[i], lens, logits, splits, scale, page_size=page,
                             k_scale=one, v_scale=one)

    return {"vllm_unified": unified, "vllm_decode": split_kv}


def vllm_merge(out, oa, la, ob, lb) -> dict:
    """vLLM's Triton ``merge_attn_states`` (LSEs head-major, ``[H, T]``)."""
    try:
        from vllm.v1.attention.ops.triton_merge_attn_states import merge_attn_states
    except Exception:
        return {}
    la_t, lb_t = la.t().contiguous(), lb.t().contiguous()
    lo_t = torch.empty_like(la_t)
    return {"vllm": lambda i=0: merge_attn_states(out, oa, la_t, ob, lb_t, lo_t)}
