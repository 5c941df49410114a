"""``DcpTritonAttnBackend``: the SGLang attention backend ``--attention-backend dcp-triton`` builds."""

from __future__ import annotations

import copy
import logging

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from dcp_plugin.adapters.sglang import compat, metadata, speculative, support, topology as topology_mod
from dcp_plugin.adapters.sglang.tree_moves import TreeMoves
from dcp_plugin.attention import DcpAttention
from dcp_plugin.kernel_choice import check_kernel_dtype, choose_kernel_impl, gluon_state, kernel_ops_for
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
    Decode steps, and a speculative run's verify steps, replay from SGLang's CUDA graphs (``init_cuda_graph_state``
    / ``init_forward_metadata_out_graph``); so do a draft model's extend steps (``DcpTritonDraftExtendBackend``).

    Hybrid models (Qwen3.5, Qwen3-Next: linear-attention layers beside full attention): SGLang wraps this backend in
    its ``HybridLinearAttnBackend``, which hands it the full-attention layers only and reads ``token_to_kv_pool`` /
    ``req_to_token_pool`` off it; the KV pool is SGLang's ``HybridLinearKVPool``, which maps a layer's model index to
    its buffers. Speculative decoding: the target's ``verify_mask`` is a draft-tree buffer (``speculative``).
    ``topology`` overrides what SGLang's parallel context says (tests running ranks as gloo processes).
    """

    # No step reads SGLang's host copy of seq_lens (``metadata.longest_on_host``): with this False on every backend
    # of a run, SGLang's overlap scheduler skips that copy, which waits each step for the step before to finish.
    needs_cpu_seq_lens = False

    def __init__(self, model_runner, *, topology: topology_mod.Topology | None = None) -> None:
        super().__init__()
        compat.check_supported_sglang()
        support.check(support.runner_problems(model_runner))
        choice = choose_kernel_impl(engine="SGLang")
        check_kernel_dtype(choice, model_runner.dtype, dtype_options="--dtype float32 or float16")
        self.kernel_path, self.kernel_impl, self._compiled = choice.description, choice.impl, choice.compiled
        self._gluon = gluon_state(choice)
        self.topology = topology or topology_mod.from_sglang(model_runner)
        heads = self.topology.heads
        layers = attention_layers(model_runner.model)
        support.check([problem for layer in layers for problem in support.layer_problems(layer, heads)])
        # What SGLang's hybrid wrapper and speculative workers read off a full-attention backend.
        self.token_to_kv_pool = self.pool = model_runner.token_to_kv_pool
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.kv_index_translator = getattr(model_runner, "kv_index_translator", None)
        self.max_context_len = self.req_to_token_pool.req_to_token.shape[1]
        self.tokens = TokenLayout(dcp_size=heads.dcp_size, dcp_rank=heads.dcp_rank, interleave=1,
                                  block_size=self.pool.page_size)
        self.steps = metadata.StepBuilder(tokens=self.tokens, req_to_token=self.req_to_token_pool.req_to_token)
        self.speculation = speculative.from_runner(model_runner)
        self._trees = speculative.VerifyTrees(self.speculation.draft_tokens, self.req_to_token_pool.size,
                                              self.pool.device) if self.speculation.verifies else None
        self._moves = None
        if self.speculation.trees and heads.dcp_size > 1:  # accepted branches move across the group's ranks
            # One per pool: every target backend SGLang builds over it (0.5.23's adaptive runtime builds several)
            # keeps its verify windows there, and the pool's move (this pool object's only) reads them.
            mha = getattr(self.pool, "full_kv_pool", self.pool)
            self._moves = getattr(mha, "dcp_triton_tree_moves", None)
            if self._moves is None:
                self._moves = mha.dcp_triton_tree_moves = TreeMoves(
                    dcp_size=heads.dcp_size, dcp_rank=heads.dcp_rank, page_size=self.tokens.block_size,
                    layer_ids=[layer.layer_id for layer in layers],
                    max_tokens=self.req_to_token_pool.size * self.speculation.draft_tokens,
                    kv_heads=heads.num_kv_heads, head_dim=model_runner.model_config.head_dim,
                    dtype=model_runner.dtype, device=self.pool.device, cache_views=self._cache_views)
                mha.move_kv_cache = self._moves.move
        head_dim = model_runner.model_config.head_dim
        max_tokens = max(compat.resolved_server_arg(model_runner, name) or 0
                         for name in ("max_prefill_tokens", "chunked_prefill_size", "cuda_graph_max_bs")) or 8192
        self.workspace = DcpWorkspace(heads=heads, head_dim=head_dim, dtype=model_runner.dtype,
                                      device=self.pool.device, max_num_tokens=max_tokens, comm=self.topology.comm,
                                      split_elements=kernel_ops_for(self.kernel_impl).split_capacity(
                                          head_dim, torch.device(self.pool.device)))
        self._attention: dict[float, DcpAttention] = {}
        self._caches: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._warmed = [False]  # shared by step_view()s
        self.forward_metadata = None
        t = self.topology
        logger.info(
            "dcp-triton attention: backend=dcp-triton dcp_size=%d dcp_rank=%d attn_tp_rank=%d/%d local_q_heads=%d "
            "stored_kv_heads=%d (global %d..%d) page_size=%d comm=%s kernels=%s gluon=%s "
            "workspace=%.1f MiB (%d tokens)",
            t.parallel.dcp_size, t.parallel.dcp_rank, t.parallel.tp_rank, t.parallel.tp_size, heads.num_q_heads,
            heads.num_kv_heads, heads.kv_head_start, heads.kv_head_start + heads.num_kv_heads - 1,
            self.tokens.block_size, t.comm, self.kernel_path, self._gluon, self.workspace.nbytes / 2**20, max_tokens)

    # Per step.
    def init_forward_metadata(self, forward_batch) -> None:
        self.forward_metadata = self.steps.build(forward_batch)
        self._verify_window(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if self._trees is not None:
            self._trees = self._trees.grown(max_bs)
        if self._moves is not None:
            self._moves.hold(max_bs * self.speculation.draft_tokens)
        self.steps.init_graphs(max_bs, max_num_tokens, verify_tokens=self.speculation.draft_tokens,
                               trees=None if self._trees is None else self._trees.buffer)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        if self.steps.graph is not None and metadata.graphed(forward_batch.forward_mode):
            self.forward_metadata = self.steps.build_graph(forward_batch)
        else:
            self.forward_metadata = self.steps.build(forward_batch)
        self._verify_window(forward_batch)

    def _verify_window(self, forward_batch) -> None:
        if self._moves is not None and forward_batch.forward_mode.is_target_verify():
            self._moves.set_window(forward_batch.out_cache_loc)

    @property
    def verify_mask(self):
        """SGLang's ``VerifyMask`` over this backend's draft-tree buffer (speculative targets), else None."""
        return None if self._trees is None else self._trees.verify_mask

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs) -> None:
        """Nothing to redo: a verify step's metadata reads the draft trees when it is built."""

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1  # a padded request reads one cached token (slot 0's page), never an empty shard

    # Per layer.
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def _forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool, extra: dict) -> torch.Tensor:
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
        if not self._warmed[0] and self._compiled and not torch.cuda.is_current_stream_capturing():
            self._warm_up(attention, q3, k3, v3, key_cache, value_cache, out)
        n = batch.num_tokens
        if self._moves is not None and forward_batch.forward_mode.is_target_verify():
            self._moves.keep(layer.layer_id, k3[:n], v3[:n])
        attention.forward(q3[:n], k3[:n], v3[:n], key_cache, value_cache, batch, out=out[:n], write_kv=save_kv_cache)
        if n < out.shape[0]:
            out[n:].zero_()
        return out.view(-1, heads.num_q_heads * head_dim)

    def step_view(self) -> DcpTritonAttnBackend:
        """This backend with a ``forward_metadata`` of its own, everything else shared (its workspace, layers'
        launches, warm-up): one per draft decode step (``draft.DcpTritonDraftSteps``)."""
        view = copy.copy(self)
        view.forward_metadata = None
        return view

    def _output_like(self, q: torch.Tensor) -> torch.Tensor:
        return q.new_empty(q.shape)

    def _bind(self, scale: float) -> DcpAttention:
        attention = DcpAttention(heads=self.topology.heads, tokens=self.tokens, group=self.topology.group,
                                 scale=scale, comm=self.topology.comm, kernel_impl=self.kernel_impl,
                                 workspace=self.workspace)
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
        self._warmed[0] = True
        logger.info(timed_warm_up(attention, dcp_size=self.tokens.dcp_size, trees=self.speculation.trees, query=q,
                                  key=k, value=v, key_cache=key_cache, value_cache=value_cache, output=out))


class DcpTritonDraftExtendBackend(DcpTritonAttnBackend):
    """A draft model's extend backend (built by SGLang's ``DraftBackendFactory``, ``draft.py``). After each verify
    step the draft extends every request by a causal window of the draft tokens, which SGLang replays from a CUDA
    graph of its own; its ``init_cuda_graph_state(max_bs, max_bs * width)`` gives the window's width.

    SGLang captures that graph only for a fixed list of its backend classes (``EAGLEWorkerV2._capture_cuda_graphs``,
    ``TritonAttnBackend`` among them), so ``draft.draft_extend_backend`` makes this class a virtual subclass of
    ``TritonAttnBackend`` (``ABC.register``): ``isinstance`` answers yes for this class only, and nothing of
    SGLang's Triton backend is inherited."""

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.steps.init_graphs(max_bs, max_num_tokens, verify_tokens=max_num_tokens // max_bs)


def attention_layers(model) -> list:
    """The model's ``RadixAttention`` layers (every attention layer SGLang will hand this backend)."""
    from sglang.srt.layers.radix_attention import RadixAttention

    return [module for module in model.modules() if isinstance(module, RadixAttention)] if model is not None else []
