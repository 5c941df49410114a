"""What the SGLang adapter tests share: one rank's SGLang objects (its own ``ReqToTokenPool``, ``MHATokenToKVPool``,
``PagedTokenToKVPoolAllocator``, ``RadixAttention`` layers, ``ForwardBatch`` per step, ``ServerArgs``) around the
dcp-triton backend, fed with a case's random sequences and checked against float64 causal attention.

The model runner is the one stand-in (``runner``): SGLang's ``ModelRunner`` loads weights and initialises CUDA
and sgl-kernel, none of which exists here; the stand-in carries the attributes the backend reads, each set from
the SGLang objects above.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from dcp_plugin.adapters.sglang import topology
from tests.dcp_harness import World, causal_attention_f64
from tests.kernel_checks import assert_matches

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
          "intermediate_size": 512, "vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}


@dataclass(frozen=True)
class SgCase:
    """One configuration: ``requests`` are ``(cached context, new tokens)``; the context is prefilled first (an
    extend step of its own), then the new tokens extend it (a cached prefix), then ``decode_steps`` decode steps."""

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
    kernels: str = "reference"  # the backend's kernels, whatever DCP_TRITON_KERNELS says
    seed: int = 0
    device: str = "cpu"


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
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        from dcp_plugin.adapters.sglang.backend import DcpTritonAttnBackend

        self.case, self.n, self.world = case, n, World(case)
        tp = case.tp or n
        topo = topology.build(total_q_heads=case.q_heads, total_kv_heads=case.kv_heads, tp_rank=rank, tp_size=tp,
                              dcp_size=n, group=group, comm=case.comm)
        self.heads = topo.heads
        dtype = getattr(torch, case.dtype)
        capacity = 8 * n * case.page_size * -(-sum(sum(r) + case.decode_steps for r in case.requests) // n)
        self.req_pool = ReqToTokenPool(size=len(case.requests), max_context_len=256, device="cpu",
                                       enable_memory_saver=False)
        self.pool = MHATokenToKVPool(size=capacity, page_size=case.page_size, dtype=dtype,
                                     head_num=self.heads.num_kv_heads, head_dim=case.head_dim, layer_num=2,
                                     device="cpu", enable_memory_saver=False)
        for buffer in (*self.pool.k_buffer, *self.pool.v_buffer):
            buffer.fill_(float("nan"))  # a row read but never written turns the output NaN
        # SGLang's choice: pages of page_size * dcp widened slots, or single slots at page size 1 without DCP.
        if case.page_size * n > 1:
            self.allocator = PagedTokenToKVPoolAllocator(capacity * n, page_size=case.page_size * n, dtype=dtype,
                                                         device="cpu", kvcache=self.pool, need_sort=False)
        else:
            self.allocator = TokenToKVPoolAllocator(capacity, dtype=dtype, device="cpu", kvcache=self.pool,
                                                    need_sort=False)
        self.layers = torch.nn.ModuleList(
            RadixAttention(self.heads.num_q_heads, case.head_dim, self.world.scale, self.heads.num_kv_heads, layer_id=i)
            for i in range(2))
        self.runner = SimpleNamespace(
            model_config=SimpleNamespace(num_attention_heads=case.q_heads, get_total_num_kv_heads=lambda: case.kv_heads,
                                         head_dim=case.head_dim, v_head_dim=case.head_dim, attention_chunk_size=None,
                                         is_encoder_decoder=False),
            dtype=dtype, kv_cache_dtype=dtype, token_to_kv_pool=self.pool, req_to_token_pool=self.req_pool,
            model=self.layers, is_draft_worker=False, use_mla_backend=False, sliding_window_size=None,
            server_args=args, page_size=case.page_size,
        )
        backend_cls = DcpTritonAttnBackend
        self.backend = backend_cls(self.runner, topology=topo)
        self.backend._output_like = lambda q: torch.full_like(q, float("nan"))  # unwritten rows fail
        self.backend.kernels = case.kernels  # before the first layer binds its DcpAttention
        self.lens = [0] * len(case.requests)  # tokens of each request in the cache
        self.slots = [[] for _ in case.requests]  # widened slot of each cached position

    def _qkv(self, b: int, positions: torch.Tensor):
        h, dtype = self.heads, getattr(torch, self.case.dtype)
        q = self.world.queries[b][positions][:, h.q_head_start:h.q_head_start + h.num_q_heads]
        kv = slice(h.kv_head_start, h.kv_head_start + h.num_kv_heads)
        return q.to(dtype), self.world.keys[b][positions][:, kv].to(dtype), self.world.values[b][positions][:, kv].to(dtype)

    def allocate(self, new: dict[int, int]):
        """Allocate this step's slots with SGLang's allocator, record them in its request table and describe the step
        as SGLang's ``ForwardBatch`` (decode when every request adds one token to a cached prefix)."""
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        reqs = sorted(new)
        prefix = torch.tensor([self.lens[b] for b in reqs])
        counts = torch.tensor([new[b] for b in reqs])
        seq = prefix + counts
        last = torch.tensor([self.slots[b][-1] if self.slots[b] else -1 for b in reqs])
        decode = all(new[b] == 1 and self.lens[b] > 0 for b in reqs)
        if not isinstance(self.allocator, PagedTokenToKVPoolAllocator):
            loc = self.allocator.alloc(int(counts.sum()))
        elif decode:
            loc = self.allocator.alloc_decode(seq, seq, last)
        else:
            loc = self.allocator.alloc_extend(prefix, prefix, seq, seq, last, int(counts.sum()))
        assert loc is not None, "the allocator ran out of pages"
        positions = [torch.arange(self.lens[b], self.lens[b] + new[b]) for b in reqs]
        start = 0
        for b, p in zip(reqs, positions):
            self.req_pool.req_to_token[b, p] = loc[start:start + len(p)].to(torch.int32)
            self.slots[b] += loc[start:start + len(p)].tolist()
            self.lens[b] += len(p)
            start += len(p)
        fields = dict(seq_lens_cpu=seq, positions=torch.cat(positions))
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
            outs.append(self.backend.forward(q.flatten(1), k, v, layer, fb).view(q.shape))
        return outs

    def step(self, new: dict[int, int]):
        """One eager step adding ``new[b]`` tokens to request ``b``: ``(outputs per layer, positions per request)``."""
        fb, positions = self.allocate(new)
        self.backend.init_forward_metadata(fb)
        return self.forward(fb, positions), positions

    def check_cache(self, layer_id: int = 0) -> None:
        """Each token this rank owns sits at row ``widened slot // N`` of SGLang's pool (SGLang's placement)."""
        h, n = self.heads, self.n
        kv = slice(h.kv_head_start, h.kv_head_start + h.num_kv_heads)
        for b, slots in enumerate(self.slots):
            for pos, slot in enumerate(slots):
                if pos % n == h.dcp_rank:
                    row = self.pool.k_buffer[layer_id][slot // n]
                    want = self.world.keys[b][pos][kv].to(row.dtype)
                    assert torch.equal(row, want), f"request {b} position {pos}: not at row {slot // n}"


def schedule(case: SgCase) -> list[dict[int, int]]:
    """The steps of a case: prefill of the cached contexts, the new tokens over them, then decode steps."""
    steps = [{b: ctx for b, (ctx, _) in enumerate(case.requests) if ctx}]
    steps.append({b: new for b, (_, new) in enumerate(case.requests)})
    steps += [{b: 1 for b in range(len(case.requests))}] * case.decode_steps
    return [s for s in steps if s]


def run_sglang_case(case: SgCase, n: int, rank: int, group, gather_heads, *, args=None) -> int:
    """Run ``case`` on this rank through the SGLang backend and check every layer's gathered output of every step
    against float64 attention (the same verdict on every rank). Returns the number of checked steps."""
    if args is None:
        if n not in _ARGS:
            _ARGS[n] = server_args(config_argv(n))
        args = _ARGS[n]
    state = SglangRank(case, n, rank, group if n > 1 else None, args)
    group_heads = range(state.heads.group_q_head_start, state.heads.group_q_head_start + state.heads.num_group_q_heads)
    steps = schedule(case)
    for index, new in enumerate(steps):
        outs, positions = state.step(new)
        want = torch.cat([causal_attention_f64(state.world, b, p, group_heads) for b, p in positions.items()])
        for layer_id, out in enumerate(outs):
            assert_matches(gather_heads(out), want, out.dtype, f"{case.name} (N={n}) step {index} layer {layer_id}")
    state.check_cache()
    return len(steps)


_CONFIG_DIRS: dict[int, str] = {}
_ARGS: dict[int, object] = {}


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

