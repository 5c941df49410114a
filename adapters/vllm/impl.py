"""The attention impl vLLM calls per layer: the cache write and DCP attention, both in ``forward``."""

from __future__ import annotations

import logging

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionImpl, AttentionType

from dcp_plugin.adapters.vllm import compat, registration, spec, support, topology
from dcp_plugin.adapters.vllm.builder import DcpTritonMetadata
from dcp_plugin.attention import DcpAttention
from dcp_plugin.kernel_choice import check_kernel_dtype, choose_kernel_impl, gluon_state, kernel_ops_for
from dcp_plugin.layout import TokenLayout, check_same_position
from dcp_plugin.warmup import timed_warm_up, warm_up_early, workers_ahead
from dcp_plugin.workspace import DcpWorkspace

logger = logging.getLogger("vllm.dcp_triton")
_logged_startup: set[tuple] = set()
# One scratch workspace per worker and layer kind (layers run one after another), and the kinds warmed up.
_workspaces: dict[tuple, DcpWorkspace] = {}
_warmed: set[tuple] = set()
_warmed_early: set[tuple] = set()  # the kinds whose compiles started in vLLM's profiling run (_warm_up_early)


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's layer cache, a logical ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` strided view (K then
    V on the last dim; any ``KVCacheLayout`` in 0.32+, the backend's ``get_kv_cache_shape`` permuted by its
    ``get_kv_cache_stride_order`` in 0.26), as two ``[num_blocks, block_size, num_kv_heads, head_size]`` views."""
    kv = kv_cache.transpose(1, 2)
    return kv[..., :head_size], kv[..., head_size:]


class DcpTritonImpl(AttentionImpl[DcpTritonMetadata]):
    """Decode-context-parallel attention over vLLM's paged KV cache.

    The topology, kernel path, option checks and scratch workspace are decided here at model construction (the
    workspace allocated now, so vLLM's memory profiling counts it); what waits for the first ``forward`` with a
    KV cache is what only that cache tells: its block size (``DcpAttention`` is built then, one per token layout,
    ``_bind``) and its K/V views (kept while the cache is the same). The backend declares
    ``forward_includes_kv_cache_update``: ``forward`` writes this step's K/V itself, which saves vLLM a separate op
    (and a graph break) per layer. The first ``forward`` that sees the real KV cache
    (vLLM's warm-up, before serving) compiles every kernel variant serving can need (``dcp_plugin.warmup``).
    """

    supports_dcp = True
    can_return_lse_for_decode = True  # vLLM asserts it for DCP > 1; the LSE never leaves DcpAttention
    lse_base_on_e = True
    # The current-chunk / cached-prefix split is exact for multi-token queries at any interleave.
    supports_mtp_with_cp_non_trivial_interleave_size = True

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra_impl_args,
    ) -> None:
        compat.check_supported_vllm()
        vllm_config = get_current_vllm_config()
        model_config = vllm_config.model_config
        model_dtype = model_config.dtype if model_config is not None else None
        support.check_layer(
            head_size=head_size, alibi_slopes=alibi_slopes, sliding_window=sliding_window,
            kv_cache_dtype=kv_cache_dtype, logits_soft_cap=logits_soft_cap, attn_type=attn_type,
            kv_sharing_target_layer_name=kv_sharing_target_layer_name, extra_impl_args=extra_impl_args,
            model_dtype=model_dtype, attention_chunk_size=getattr(model_config, "attention_chunk_size", None),
        )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        # vLLM allocates an fp8 cache as uint8 bytes; the kernels read it as this fp8 dtype, scaled by the layer's
        # per-tensor _k_scale / _v_scale.
        self._fp8_dtype = support.FP8_KV_CACHE_DTYPES.get(kv_cache_dtype)
        choice = choose_kernel_impl(engine="vLLM")
        check_kernel_dtype(choice, model_dtype, dtype_options="--dtype float32 (LLM(dtype='float32')) or float16",
                           fp8_cache=f"kv_cache_dtype={kv_cache_dtype!r}" if self._fp8_dtype else None)
        self.kernel_path, self.kernel_impl, self._compiled = choice.description, choice.impl, choice.compiled
        self._gluon = gluon_state(choice)
        # do_kv_cache_update's cache write, the workspace's split capacity
        self._kernel_ops = kernel_ops_for(choice.impl)
        self.topology = topology.from_vllm(
            num_heads=num_heads, num_kv_heads=self.num_kv_heads, dcp_size=self.dcp_world_size,
            dcp_rank=self.dcp_rank, vllm_config=vllm_config,
        )
        self._attention: dict[TokenLayout, DcpAttention] = {}
        self._kv_views: tuple | None = None  # (kv_cache, key view, value view) of the last cache seen
        self._warm = False  # this layer's kernel variants are compiled (checked once, not per call)
        # vLLM's cache settings, read at its profiling run (_warm_up_early), once vLLM has settled the block size
        self._early = None if model_config is None else getattr(vllm_config, "cache_config", None)
        # One workspace per worker, counted by vLLM's memory profiling; outside an engine (no model config, so no
        # dtype or step size to plan for) each layer sizes its own on its first step.
        self.workspace = None if model_config is None else \
            _shared_workspace(self.topology, head_size, model_dtype, self._kernel_ops, vllm_config)
        if self._early is not None and torch.cuda.is_available():  # an engine on a GPU: its warm-up will compile
            workers_ahead(torch.device("cuda"))
        self._log_startup()

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """Store the new K/V rows this rank owns; ``slot_mapping`` may be shorter than ``key`` (padding rows) and
        holds -1 for tokens another DCP rank owns. (``forward`` writes the step's K/V itself; this is for hosts
        that write the cache separately.)"""
        key_cache, value_cache = self._split(kv_cache)
        self._kernel_ops.write_kv_cache(key, value, key_cache, value_cache, slot_mapping, **self._scales(layer))

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: DcpTritonMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise ValueError("dcp-triton does not fuse output quantization (output_scale / output_block_scale)")
        if not self._warm and self._compiled and not torch.cuda.is_current_stream_capturing():
            if kv_cache.numel():
                self._warm_up_once(layer, query, key, value, kv_cache, output)
            elif self._early is not None:  # vLLM's profiling run: no KV cache yet
                self._warm_up_early(layer, query, key, value, output)
        if attn_metadata is None:  # profiling / dummy run
            return output.fill_(0)
        batch = attn_metadata.batch
        attention = self._attention.get(batch.tokens) or self._bind(batch.tokens, kv_cache)
        key_cache, value_cache = self._split(kv_cache)
        scales = self._scales(layer)
        n = batch.num_tokens
        if n == query.shape[0]:
            attention.forward(query, key, value, key_cache, value_cache, batch, out=output, **scales)
            return output
        attention.forward(query[:n], key[:n], value[:n], key_cache, value_cache, batch, out=output[:n], **scales)
        if attn_metadata.num_actual_tokens > n:
            output[n:attn_metadata.num_actual_tokens].zero_()
        return output

    def _split(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of the layer's cache (the same tensor every step: made once)."""
        views = self._kv_views
        if views is None or views[0] is not kv_cache:
            typed = kv_cache if self._fp8_dtype is None else kv_cache.view(self._fp8_dtype)
            views = self._kv_views = (kv_cache, *split_kv_cache(typed, self.head_size))
        return views[1], views[2]

    def _scales(self, layer) -> dict:
        """The layer's per-tensor K/V scales (vLLM's float32 buffers, set at load or calculated) for an fp8 cache."""
        if self._fp8_dtype is None:
            return {}
        return {"k_scale": layer._k_scale, "v_scale": layer._v_scale}

    def _warm_up_once(self, layer, query, key, value, kv_cache, output) -> None:
        """Compile every kernel variant now (once per worker and layer kind), not on a user's request. Every rank
        of a DCP group reaches this at the same layer of the same step, so the dummy steps' collectives pair up."""
        key_cache, value_cache = self._split(kv_cache)
        signature = self._kind(query, key, output, key_cache, value_cache)
        self._warm = True  # a layer's later calls share this signature: the same cache, dtypes and strides
        if signature in _warmed:
            return
        _warmed.add(signature)
        tokens = TokenLayout(dcp_size=self.topology.heads.dcp_size, dcp_rank=self.topology.heads.dcp_rank,
                             interleave=self.topology.interleave, block_size=key_cache.shape[1])
        attention = self._attention.get(tokens) or self._bind(tokens, kv_cache)
        logger.info(timed_warm_up(attention, dcp_size=tokens.dcp_size, query=query, key=key, value=value,
                                  key_cache=key_cache, value_cache=value_cache,
                                  output=output.view(output.shape[0], self.num_heads, -1), **self._scales(layer)))

    def _kind(self, query, key, output, key_cache, value_cache) -> tuple:
        """What a warm-up's kernel variants depend on: layers alike in it share one warm-up."""
        return (self.topology.heads, self.topology.interleave, self.topology.comm, query.dtype, query.stride(),
                key.stride(), output.stride(), key_cache.dtype, key_cache.shape[1:], key_cache.stride(),
                value_cache.stride())

    def _warm_up_early(self, layer, query, key, value, output) -> None:
        """vLLM's profiling run, before the KV cache exists: start compiling the warm-up's kernel variants in worker
        processes (``warm_up_early``) over a cache of two blocks laid out as vLLM will allocate the real one, so they
        compile while vLLM profiles and allocates; ``_warm_up_once`` waits for them. Once per worker and layer
        kind; every rank of a DCP group reaches it at the same layer of the same profiling step. A guess that misses
        (another block size or layout at the first real step) costs only the workers' time: the warm-up compiles
        what it finds missing."""
        block = _early_block_size(self._early)
        self._early = None  # once per layer
        if block is None:
            return
        try:
            self._start_early(layer, query, key, value, output, block)
        except Exception as error:  # only a head start: the warm-up proper compiles whatever this did not
            logger.warning("dcp-triton: the warm-up's compiles could not start in vLLM's profiling run (%s: %s); "
                           "they run in the warm-up", type(error).__name__, error)

    def _start_early(self, layer, query, key, value, output, block: int) -> None:
        heads = self.topology.heads
        shape = compat.kv_cache_shape(2, block, self.num_kv_heads, self.head_size)
        order = compat.kv_cache_stride_order()
        stored = torch.zeros([shape[i] for i in order], dtype=torch.uint8 if self._fp8_dtype else query.dtype,
                             device=query.device).permute([order.index(i) for i in range(len(order))])
        key_cache, value_cache = split_kv_cache(stored if self._fp8_dtype is None else stored.view(self._fp8_dtype),
                                                self.head_size)
        signature = self._kind(query, key, output, key_cache, value_cache)
        if signature in _warmed_early:
            return
        _warmed_early.add(signature)
        tokens = TokenLayout(dcp_size=heads.dcp_size, dcp_rank=heads.dcp_rank, interleave=self.topology.interleave,
                             block_size=block)
        attention = self._attention.get(tokens) or self._bind(tokens, stored)
        warm_up_early(attention, query=query, key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                      output=output.view(output.shape[0], self.num_heads, -1), **self._scales(layer))

    def _bind(self, tokens: TokenLayout, kv_cache: torch.Tensor) -> DcpAttention:
        """First step with this token layout (the KV-cache block size is known only then): build DcpAttention."""
        heads = self.topology.heads
        check_same_position(heads, tokens,
                            hint=" (the KV-cache group's sharding against this layer's model)" + spec.KV_SHARDING_HINT)
        if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * self.head_size:
            raise ValueError(
                f"KV cache view of shape {tuple(kv_cache.shape)}: dcp-triton needs [num_blocks, num_kv_heads, "
                f"block_size, 2 * head_size={2 * self.head_size}] (K and V of equal head size)"
            )
        workspace = self.workspace if self.workspace and self.workspace.heads == heads else None
        attention = DcpAttention(heads=heads, tokens=tokens, group=self.topology.group, scale=self.scale,
                                 comm=self.topology.comm, kernel_impl=self.kernel_impl, workspace=workspace)
        self._attention[tokens] = attention
        return attention

    def _log_startup(self) -> None:
        t = self.topology
        line = (
            "dcp-triton attention: backend=DCP_TRITON dcp_size=%d dcp_rank=%d tp_rank=%d/%d local_q_heads=%d "
            "(global %d..%d) stored_kv_heads=%d (global %d..%d) interleave=%d comm=%s kernels=%s gluon=%s "
            "fast_launch=%s cpu_attn_routed=%s"
        )
        args = (
            t.parallel.dcp_size, t.parallel.dcp_rank, t.parallel.tp_rank, t.parallel.tp_size, t.heads.num_q_heads,
            t.heads.q_head_start, t.heads.q_head_start + t.heads.num_q_heads - 1, t.heads.num_kv_heads,
            t.heads.kv_head_start, t.heads.kv_head_start + t.heads.num_kv_heads - 1, t.interleave, t.comm,
            self.kernel_path, self._gluon, "on" if getattr(self._kernel_ops, "FAST_LAUNCH", False) else "off",
            registration.cpu_route() or "no",
        )
        if args not in _logged_startup:  # once per worker (and once more for a draft with another topology)
            _logged_startup.add(args)
            logger.info(line, *args)


def _early_block_size(cache_config) -> int | None:
    """The block size the first forward with a KV cache will show (``_warm_up_early``'s): vLLM's cache block size
    as it stands at its profiling run, after vLLM settled it (the backend's preferred 64 on Hopper, a hybrid model's
    block grown to hold its state pages), which vLLM keeps as the kernels' block where they take it (any multiple
    of 16: vLLM's ``select_common_block_size``). None where it is not such a size yet: no early start."""
    block = getattr(cache_config, "block_size", None)
    return block if isinstance(block, int) and block > 0 and block % 16 == 0 else None


def _shared_workspace(topology, head_size: int, dtype, kernels, vllm_config) -> DcpWorkspace:
    """The worker's workspace for layers like this one, sized for vLLM's largest step (max_num_batched_tokens)."""
    device = torch.device(vllm_config.device_config.device) if vllm_config.device_config is not None else \
        torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
    key = (topology.heads, head_size, dtype, device, topology.comm, max_tokens)
    if key not in _workspaces:
        _workspaces[key] = DcpWorkspace(heads=topology.heads, head_dim=head_size, dtype=dtype, device=device,
                                        max_num_tokens=max_tokens, comm=topology.comm,
                                        split_elements=kernels.split_capacity(head_size, device))
        logger.info("dcp-triton: %.1f MiB of attention workspace for steps of up to %d tokens",
                    _workspaces[key].nbytes / 2**20, max_tokens)
    return _workspaces[key]
