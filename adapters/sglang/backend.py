"""``DcpTritonAttnBackend``: the SGLang attention backend ``--attention-backend dcp-triton`` builds."""

from __future__ import annotations

import logging

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from dcp_plugin.adapters.sglang import compat, metadata, support, topology as topology_mod
from dcp_plugin.attention import DcpAttention
from dcp_plugin.kernel_choice import check_kernel_dtype, choose_kernels, gluon_state, kernels_named
from dcp_plugin.layout import TokenLayout
from dcp_plugin.warmup import timed_warm_up
from dcp_plugin.workspace import DcpWorkspace

logger = logging.getLogger("sglang.dcp_triton")


class DcpTritonAttnBackend(AttentionBackend):
    """Decode-context-parallel attention with Triton kernels (``dcp_plugin``) for one SGLang model runner.

    Built once per runner (target, or a draft at DCP = 1): the topology comes from SGLang's parallel context, every
    attention layer of the model is checked, and the scratch workspace is allocated, all before serving; an
    unsupported setting raises one ``ValueError`` naming its option. Per step ``init_forward_metadata`` turns the
    ``ForwardBatch`` into a ``DcpBatch`` (``metadata.StepBuilder``); per layer ``forward_extend`` /
    ``forward_decode`` write the step's K/V this rank owns into SGLang's KV pool and run ``DcpAttention``.
    Decode steps replay from SGLang's CUDA graphs (``init_cuda_graph_state`` / ``init_forward_metadata_out_graph``).
    ``topology`` overrides what SGLang's parallel context says (tests running ranks as gloo processes).
    """

    def __init__(self, model_runner, *, topology: topology_mod.Topology | None = None) -> None:
        super().__init__()
        compat.check_supported_sglang()
        support.check(support.runner_problems(model_runner))
        choice = choose_kernels(engine="SGLang")
        check_kernel_dtype(choice, model_runner.dtype, dtype_options="--dtype float32 or float16")
        self.kernel_path, self.kernels, self._compiled = choice.description, choice.name, choice.compiled
        self._gluon = gluon_state(choice)
        self.topology = topology or topology_mod.from_sglang(model_runner)
        heads = self.topology.heads
        support.check([problem for layer in attention_layers(model_runner.model)
                       for problem in support.layer_problems(layer, heads)])
        self.pool = model_runner.token_to_kv_pool
        self.tokens = TokenLayout(dcp_size=heads.dcp_size, dcp_rank=heads.dcp_rank, interleave=1,
                                  block_size=self.pool.page_size)
        self.steps = metadata.StepBuilder(tokens=self.tokens, req_to_token=model_runner.req_to_token_pool.req_to_token)
        head_dim = model_runner.model_config.head_dim
        max_tokens = max(compat.resolved_server_arg(model_runner, name) or 0
                         for name in ("max_prefill_tokens", "chunked_prefill_size", "cuda_graph_max_bs")) or 8192
        self.workspace = DcpWorkspace(heads=heads, head_dim=head_dim, dtype=model_runner.dtype,
                                      device=self.pool.device, max_num_tokens=max_tokens, comm=self.topology.comm,
                                      split_elements=kernels_named(self.kernels).split_capacity(
                                          head_dim, torch.device(self.pool.device)))
        self._attention: dict[float, DcpAttention] = {}
        self._caches: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._warmed = False
        self.forward_metadata = None
        t = self.topology
        logger.info(
            "dcp-triton attention: backend=dcp-triton dcp_size=%d dcp_rank=%d attn_tp_rank=%d/%d local_q_heads=%d "
            "stored_kv_heads=%d (global %d..%d) page_size=%d comm=%s kernels=%s gluon=%s "
            "workspace=%.1f MiB (%d tokens)",
            t.ps.attn_dcp_size, t.ps.attn_dcp_rank, t.ps.tp_rank, t.ps.tp_size, heads.num_q_heads,
            heads.num_kv_heads, heads.kv_head_start, heads.kv_head_start + heads.num_kv_heads - 1,
            self.tokens.block_size, t.comm, self.kernel_path, self._gluon, self.workspace.nbytes / 2**20, max_tokens)

    # Per step.
    def init_forward_metadata(self, forward_batch) -> None:
        self.forward_metadata = self.steps.build(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.steps.init_decode_graphs(max_bs)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        if self.steps.graph is not None and forward_batch.forward_mode.is_decode():
            self.forward_metadata = self.steps.build_decode_graph(forward_batch)
        else:
            self.forward_metadata = self.steps.build(forward_batch)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1  # a padded request reads one cached token (slot 0's page), never an empty shard

    # Per layer.
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._forward(q, k, v, layer, save_kv_cache, kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._forward(q, k, v, layer, save_kv_cache, kwargs)

    def _forward(self, q, k, v, layer, save_kv_cache: bool, extra: dict) -> torch.Tensor:
        used = sorted(name for name, value in extra.items() if value is not None)
        if used:
            raise ValueError(f"layer {layer.layer_id}: {', '.join(used)} (attention sinks, score mods): not supported "
                             "by dcp-triton; supported: plain causal attention")
        if k is None or v is None:
            raise ValueError(f"layer {layer.layer_id}: K/V read back from the cache (k=v=None): not supported by "
                             "dcp-triton; supported: the step's K/V passed in")
        batch = self.forward_metadata
        heads, head_dim = self.topology.heads, layer.head_dim
        q3 = q.view(-1, heads.num_q_heads, head_dim)
        k3, v3 = k.view(-1, heads.num_kv_heads, head_dim), v.view(-1, heads.num_kv_heads, head_dim)
        out = self._output_like(q3)
        key_cache, value_cache = self._cache_views(layer.layer_id)
        attention = self._attention.get(layer.scaling) or self._bind(layer.scaling)
        if not self._warmed and self._compiled and not torch.cuda.is_current_stream_capturing():
            self._warm_up(attention, q3, k3, v3, key_cache, value_cache, out)
        n = batch.num_tokens
        attention.forward(q3[:n], k3[:n], v3[:n], key_cache, value_cache, batch, out=out[:n], write_kv=save_kv_cache)
        if n < out.shape[0]:
            out[n:].zero_()
        return out.view(-1, heads.num_q_heads * head_dim)

    def _output_like(self, q: torch.Tensor) -> torch.Tensor:
        return q.new_empty(q.shape)

    def _bind(self, scale: float) -> DcpAttention:
        attention = DcpAttention(heads=self.topology.heads, tokens=self.tokens, group=self.topology.group,
                                 scale=scale, comm=self.topology.comm, kernels=self.kernels, workspace=self.workspace)
        self._attention[scale] = attention
        return attention

    def _cache_views(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """SGLang's K/V buffers of a layer as ``[pages, page_size, kv_heads, head_dim]`` views (made once per
        buffer): NHD ``[slots, heads, dim]`` pages by rows, HND ``[pages, heads, page_size, dim]`` transposed."""
        k_buffer = self.pool.get_key_buffer(layer_id)
        views = self._caches.get(layer_id)
        if views is None or views[0] is not k_buffer:
            v_buffer, page = self.pool.get_value_buffer(layer_id), self.tokens.block_size
            if k_buffer.dim() == 3:
                views = (k_buffer, *(b[:b.shape[0] // page * page].unflatten(0, (-1, page)) for b in (k_buffer, v_buffer)))
            elif k_buffer.dim() == 4:
                views = (k_buffer, k_buffer.transpose(1, 2), v_buffer.transpose(1, 2))
            else:
                raise ValueError(f"KV buffer of shape {tuple(k_buffer.shape)}: dcp-triton reads SGLang's NHD and HND "
                                 "layouts only")
            self._caches[layer_id] = views
        return views[1], views[2]

    def _warm_up(self, attention, q, k, v, key_cache, value_cache, out) -> None:
        """Compile every kernel variant before serving (SGLang's warm-up forward reaches here first)."""
        self._warmed = True
        logger.info(timed_warm_up(attention, dcp_size=self.tokens.dcp_size, query=q, key=k, value=v,
                                  key_cache=key_cache, value_cache=value_cache, output=out))


def attention_layers(model) -> list:
    """The model's ``RadixAttention`` layers (every attention layer SGLang will hand this backend)."""
    from sglang.srt.layers.radix_attention import RadixAttention

    return [module for module in model.modules() if isinstance(module, RadixAttention)] if model is not None else []
