"""What the SGLang adapter tests share: one rank's SGLang objects (its own ``ReqToTokenPool``, ``MHATokenToKVPool``,
``PagedTokenToKVPoolAllocator``, ``RadixAttention`` layers, ``ForwardBatch`` per step, ``ServerArgs``) around the
dcp-triton backend, fed with a case's random sequences and checked against float64 causal attention.

A hybrid case (``hybrid=True``) builds a hybrid model's objects instead: SGLang's ``HybridReqToTokenPool`` (with its
``MambaPool``) and ``HybridLinearKVPool``, full-attention layers at model layer ids 1 and 3 (linear attention at 0
and 2), and the backend inside SGLang's ``HybridLinearAttnBackend``, through which every layer runs.

The model runner is the one stand-in (``runner``): SGLang's ``ModelRunner`` loads weights and initialises CUDA
and sgl-kernel, none of which exists here; the stand-in carries the attributes the backend reads, each set from
the SGLang objects above. In a hybrid case the wrapper's linear-attention backend is a stand-in too (SGLang's GDN
backend needs CUDA's runtime context); no linear layer runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from dcp_plugin.adapters.sglang import topology
from dcp_plugin.testing import World
from tests.helpers.kernel_checks import assert_matches

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
          "intermediate_size": 512, "vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}
HYBRID_FULL_LAYERS = (1, 3)  # model layer ids of a hybrid case's full-attention layers (0 and 2: linear attention)


@dataclass(frozen=True)
class SgCase:
    """One configuration: ``requests`` are ``(cached context, new tokens)``; the context is prefilled first (an extend
    step of its own), then the new tokens extend it (a cached prefix), then ``decode_steps`` decode steps.
    ``speculative`` (``tests.helpers.sglang_spec_checks.SPECULATION``) replaces the decode steps by ``verify_steps``
    verify steps of ``draft_tokens`` tokens per request, chains or trees, accepting some of each request's drafts."""

    name: str
    q_heads: int
    kv_heads: int
    page_size: int = 1
    tp: int = 0  # 0: tp = dcp size
    head_dim: int = 64
    requests: tuple[tuple[int, int], ...] = ((5, 3), (0, 4), (9, 1))
    decode_steps: int = 2
    dtype: str = "float32"
    comm: str = "ag_rs"
    kernel_impl: str = "reference"  # the backend's kernels, whatever DCP_TRITON_KERNELS says
    seed: int = 0
    device: str = "cpu"
    hybrid: bool = False
    speculative: str = ""
    draft_tokens: int = 4
    verify_steps: int = 0
    host_lengths: bool = True  # steps carry SGLang's host copy of seq_lens (its overlap scheduler's speculative don't)


def server_args(argv: list[str]):
    """SGLang's own parsing and resolution of ``argv``, after SGLang loaded its plugins (dcp-triton's included)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()

    args = prepare_server_args(argv)
    if hasattr(args, "resolve_once"):  # 0.5.23 resolves on request; 0.5.17 while it builds the object
        args.resolve_once()
    return args


class SglangRank:
    """One DCP rank of ``case``: SGLang's pools and allocator, the backend, the requests' progress."""

    def __init__(self, case: SgCase, n: int, rank: int, group, args) -> None:
        from sglang.srt.layers.radix_attention import RadixAttention
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

        from dcp_plugin.adapters.sglang.backend import DcpTritonAttnBackend

        room = case.decode_steps + case.verify_steps * case.draft_tokens
        self.case, self.n, self.world = case, n, World(dataclasses.replace(case, decode_steps=room))
        tp = case.tp or n
        topo = topology.build(total_q_heads=case.q_heads, total_kv_heads=case.kv_heads, tp_rank=rank, tp_size=tp,
                              dcp_size=n, group=group, comm=case.comm)
        self.heads = topo.heads
        dtype = getattr(torch, case.dtype)
        # Room for every token and a verify window's over-allocation, in whole widened pages per request.
        capacity = 8 * n * case.page_size * -(-sum(sum(r) + room + case.draft_tokens for r in case.requests) // n)
        layer_ids = HYBRID_FULL_LAYERS if case.hybrid else (0, 1)
        self.req_pool, self.pool = _pools(case, capacity, dtype, self.heads.num_kv_heads, layer_ids)
        for buffer in (*self.kv_pool.k_buffer, *self.kv_pool.v_buffer):
            buffer.fill_(float("nan"))  # a row read but never written turns the output NaN
        # SGLang's choice: pages of page_size * dcp widened slots, or single slots at page size 1 without DCP.
        if case.page_size * n > 1:
            self.allocator = PagedTokenToKVPoolAllocator(capacity * n, page_size=case.page_size * n, dtype=dtype,
                                                         device="cpu", kvcache=self.pool, need_sort=False)
        else:
            self.allocator = TokenToKVPoolAllocator(capacity, dtype=dtype, device="cpu", kvcache=self.pool,
                                                    need_sort=False)
        self.layers = torch.nn.ModuleList(
            RadixAttention(self.heads.num_q_heads, case.head_dim, self.world.scale, self.heads.num_kv_heads,
                           layer_id=i) for i in layer_ids)
        self.runner = SimpleNamespace(
            model_config=SimpleNamespace(num_attention_heads=case.q_heads, get_total_num_kv_heads=lambda: case.kv_heads,
                                         head_dim=case.head_dim, v_head_dim=case.head_dim, attention_chunk_size=None,
                                         is_encoder_decoder=False, hf_config=None, hf_text_config=None),
            dtype=dtype, kv_cache_dtype=dtype, token_to_kv_pool=self.pool, req_to_token_pool=self.req_pool,
            model=self.layers, is_draft_worker=False, use_mla_backend=False, sliding_window_size=None,
            server_args=args, page_size=case.page_size,
        )
        self.backend = DcpTritonAttnBackend(self.runner, topology=topo)
        self.backend._output_like = lambda q: torch.full_like(q, float("nan"))  # unwritten rows fail
        self.backend.kernel_impl = case.kernel_impl  # before the first layer binds its DcpAttention
        # What runs every layer: the backend itself, or SGLang's hybrid wrapper around it.
        self.attn = _hybrid_wrapper(self.backend, layer_ids) if case.hybrid else self.backend
        self.lens = [0] * len(case.requests)  # committed tokens of each request
        self.slots = [[] for _ in case.requests]  # widened slot of each allocated position (past lens: a window)

    @property
    def kv_pool(self):
        """The MHA pool holding the full-attention layers' buffers (a hybrid pool's inner one)."""
        return getattr(self.pool, "full_kv_pool", self.pool)

    def _qkv(self, b: int, positions: torch.Tensor):
        h, dtype = self.heads, getattr(torch, self.case.dtype)
        q = self.world.queries[b][positions][:, h.q_head_start:h.q_head_start + h.num_q_heads]
        kv = slice(h.kv_head_start, h.kv_head_start + h.num_kv_heads)
        return q.to(dtype), self.world.keys[b][positions][:, kv].to(dtype), self.world.values[b][positions][:, kv].to(dtype)

    def reserve(self, want: dict[int, int]) -> torch.Tensor:
        """Slots of each request ``b`` up to position ``want[b]`` from SGLang's allocator (those not allocated yet),
        recorded in its request table; returns the new ones."""
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

        reqs = [b for b in sorted(want) if want[b] > len(self.slots[b])]
        if not reqs:
            return torch.zeros(0, dtype=torch.int64)
        have = torch.tensor([len(self.slots[b]) for b in reqs])
        upto = torch.tensor([want[b] for b in reqs])
        last = torch.tensor([self.slots[b][-1] if self.slots[b] else -1 for b in reqs])
        if not isinstance(self.allocator, PagedTokenToKVPoolAllocator):
            loc = self.allocator.alloc(int((upto - have).sum()))
        elif bool(((upto - have) == 1).all()) and bool((have > 0).all()):
            loc = self.allocator.alloc_decode(upto, upto, last)
        else:
            loc = self.allocator.alloc_extend(have, have, upto, upto, last, int((upto - have).sum()))
        assert loc is not None, "the allocator ran out of pages"
        start = 0
        for b, lo, hi in zip(reqs, have.tolist(), upto.tolist()):
            self.req_pool.req_to_token[b, lo:hi] = loc[start:start + hi - lo].to(torch.int32)
            self.slots[b] += loc[start:start + hi - lo].tolist()
            start += hi - lo
        return loc

    def allocate(self, new: dict[int, int]):
        """Allocate this step's slots with SGLang's allocator, record them in its request table and describe the step
        as SGLang's ``ForwardBatch`` (decode when every request adds one token to a cached prefix)."""
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        reqs = sorted(new)
        prefix = torch.tensor([self.lens[b] for b in reqs])
        counts = torch.tensor([new[b] for b in reqs])
        seq = prefix + counts
        decode = all(new[b] == 1 and self.lens[b] > 0 for b in reqs)
        self.reserve({b: self.lens[b] + new[b] for b in reqs})
        loc = torch.cat([torch.tensor(self.slots[b][self.lens[b]:self.lens[b] + new[b]], dtype=torch.int64)
                         for b in reqs])
        positions = [torch.arange(self.lens[b], self.lens[b] + new[b]) for b in reqs]
        for b in reqs:
            self.lens[b] += new[b]
        fields = dict(seq_lens_cpu=seq if self.case.host_lengths else None, positions=torch.cat(positions))
        if not decode:
            fields.update(extend_num_tokens=int(counts.sum()), extend_seq_lens=counts, extend_prefix_lens=prefix,
                          extend_start_loc=torch.cumsum(counts, 0) - counts, extend_prefix_lens_cpu=prefix.tolist(),
                          extend_seq_lens_cpu=counts.tolist())
        fb = ForwardBatch(forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND, batch_size=len(reqs),
                          input_ids=torch.zeros(int(counts.sum()), dtype=torch.int64),
                          req_pool_indices=torch.tensor(reqs, dtype=torch.int64), seq_lens=seq, out_cache_loc=loc,
                          seq_lens_sum=int(seq.sum()), **fields)
        return fb, dict(zip(reqs, positions))

    def forward(self, fb, positions: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """Every layer's output ``[T, H, D]`` of the step ``fb`` (its metadata already built)."""
        outs = []
        for layer in self.layers:
            q, k, v = (torch.cat(t) for t in zip(*(self._qkv(b, p) for b, p in positions.items())))
            outs.append(self.attn.forward(q.flatten(1), k, v, layer, fb).view(q.shape))
        return outs

    def step(self, new: dict[int, int]):
        """One eager step adding ``new[b]`` tokens to request ``b``: ``(outputs per layer, positions per request)``."""
        fb, positions = self.allocate(new)
        self.attn.init_forward_metadata(fb)
        return self.forward(fb, positions), positions

    def check_cache(self) -> None:
        """Each committed token this rank owns sits at row ``widened slot // N`` of SGLang's pool (SGLang's
        placement), in every full-attention layer."""
        h, n = self.heads, self.n
        kv = slice(h.kv_head_start, h.kv_head_start + h.num_kv_heads)
        for layer in self.layers:
            for b, slots in enumerate(self.slots):
                for pos, slot in enumerate(slots[:self.lens[b]]):
                    if pos % n == h.dcp_rank:
                        row = self.pool.get_key_buffer(layer.layer_id)[slot // n]
                        want = self.world.keys[b][pos][kv].to(row.dtype)
                        assert torch.equal(row, want), f"request {b} position {pos}: not at row {slot // n}"


def _pools(case: SgCase, capacity: int, dtype: torch.dtype, kv_heads: int, layer_ids: tuple[int, ...]):
    """SGLang's request and KV pools of a case: ``(ReqToTokenPool, MHATokenToKVPool)``, or a hybrid model's
    ``(HybridReqToTokenPool, HybridLinearKVPool)`` whose Mamba state serves the layers between ``layer_ids``; the
    KV pool copies KV rows (SGLang's ``move_kv_cache``) when the case speculates, as SGLang builds it then."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    reqs = len(case.requests)
    if not case.hybrid:
        return (ReqToTokenPool(size=reqs, max_context_len=256, device="cpu", enable_memory_saver=False),
                MHATokenToKVPool(size=capacity, page_size=case.page_size, dtype=dtype, head_num=kv_heads,
                                 head_dim=case.head_dim, layer_num=len(layer_ids), device="cpu",
                                 enable_memory_saver=False, enable_kv_cache_copy=bool(case.speculative)))
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool

    linear = [i for i in range(max(layer_ids) + 1) if i not in layer_ids]
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=64, n_groups=2, num_heads=8, head_dim=8,
                                    state_size=8, conv_kernel=4)
    params = Mamba2CacheParams(shape=shape, layers=linear, dtype=Mamba2StateDType(conv=dtype, temporal=dtype))
    req_pool = HybridReqToTokenPool(size=reqs, mamba_size=reqs, mamba_spec_state_size=reqs, max_context_len=256,
                                    device="cpu", enable_memory_saver=False, cache_params=params,
                                    mamba_layer_ids=linear, enable_mamba_extra_buffer=False,
                                    enable_overlap_schedule=False)
    pool = HybridLinearKVPool(size=capacity, dtype=dtype, page_size=case.page_size, head_num=kv_heads,
                              head_dim=case.head_dim, full_attention_layer_ids=list(layer_ids), device="cpu",
                              mamba_pool=req_pool.mamba_pool, enable_memory_saver=False,
                              enable_kv_cache_copy=bool(case.speculative))
    return req_pool, pool


def _hybrid_wrapper(backend, layer_ids: tuple[int, ...]):
    """SGLang's ``HybridLinearAttnBackend`` around ``backend``, its linear-attention side a stand-in that refuses to
    run (no linear layer runs here)."""
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend

    class LinearStandIn(AttentionBackend):
        needs_cpu_seq_lens = False

        def init_forward_metadata(self, forward_batch) -> None:
            pass

        def forward_decode(self, *args, **kwargs):
            raise AssertionError("a full-attention layer reached the linear-attention backend")

        forward_extend = forward_decode

    return HybridLinearAttnBackend(backend, LinearStandIn(), list(layer_ids))


def schedule(case: SgCase) -> list[dict[int, int]]:
    """The steps of a case: prefill of the cached contexts, the new tokens over them, then decode steps."""
    steps = [{b: ctx for b, (ctx, _) in enumerate(case.requests) if ctx}]
    steps.append({b: new for b, (_, new) in enumerate(case.requests)})
    steps += [{b: 1 for b in range(len(case.requests))}] * case.decode_steps
    return [s for s in steps if s]


def run_sglang_case(case: SgCase, n: int, rank: int, group, gather_heads, *, args=None) -> int:
    """Run ``case`` on this rank through the SGLang backend and check every layer's gathered output of every step
    against float64 attention (the same verdict on every rank). Returns the number of checked steps."""
    from tests.helpers import sglang_spec_checks

    if args is None:
        key = (n, case.speculative)
        if key not in _ARGS:
            _ARGS[key] = server_args(config_argv(n) + sglang_spec_checks.argv(case))
        args = _ARGS[key]
    state = SglangRank(case, n, rank, group if n > 1 else None, args)
    group_heads = range(state.heads.group_q_head_start, state.heads.group_q_head_start + state.heads.num_group_q_heads)
    steps = schedule(case)
    for index, new in enumerate(steps):
        outs, positions = state.step(new)
        want = torch.cat([state.world.causal_attention_f64(b, p, group_heads) for b, p in positions.items()])
        for layer_id, out in enumerate(outs):
            assert_matches(gather_heads(out), want, out.dtype, f"{case.name} (N={n}) step {index} layer {layer_id}")
    checked = len(steps) + sglang_spec_checks.run_verify_steps(state, gather_heads, group_heads)
    state.check_cache()
    return checked


_CONFIG_DIRS: dict[int, str] = {}
_ARGS: dict[tuple, object] = {}


def config_argv(n: int) -> list[str]:
    """Arguments for a config-only Llama (no weights) at --tp-size = --dcp-size = n on the CPU."""
    import json
    import tempfile

    if n not in _CONFIG_DIRS:
        folder = tempfile.mkdtemp(prefix="sglang-config-")
        with open(f"{folder}/config.json", "w") as f:
            json.dump({**CONFIG, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 64}, f)
        _CONFIG_DIRS[n] = folder
    return ["--model-path", _CONFIG_DIRS[n], "--device", "cpu", "--tp-size", str(n), "--dcp-size", str(n),
            "--attention-backend", "dcp-triton"]
