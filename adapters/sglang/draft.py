"""The draft model's attention under speculative decoding (EAGLE, EAGLE3, NEXTN/MTP, STANDALONE): dcp-triton at DCP = 1.

SGLang gives a draft model a KV pool of its own that is not sharded: every rank holds all of it, indexed by the
allocator's widened slots (``page_size * dcp`` per page), so the draft runs at DCP = 1 (``topology.from_sglang``)
with that page as its block. Besides the draft runner's own backend SGLang builds two through its
``DraftBackendFactory``, whose table names its built-in backends only: the draft's extend (after a verify step, and
its prefill) and the multi-step draft decode. ``register_draft_backends`` adds dcp-triton's to that table (an
``AROUND`` hook of SGLang's plugin hook registry), so SGLang resolves the name as for its own.

The multi-step draft decode (``DcpTritonDraftSteps``) runs ``num_steps - 1`` decode steps of ``topk`` rows per
request. Row ``t`` of request ``b`` at step ``i`` attends the committed prefix and its branch's draft tokens
``0..i``, laid out in the request's slot row as SGLang's ``prepare_for_draft`` allocates them: contiguously past the
prefix (``seq_len + t * num_steps + i``) when pages hold one token or ``topk`` is 1, else in pages of the branch's
own that begin with a copy of the prefix's last partial page (SGLang copies it there). A branch is therefore a
request of its own with a block table of its own: the prefix's pages, then the branch's.

The draft's extend after each verify step (``backend.DcpTritonDraftExtendBackend``) replays from SGLang's
draft-extend CUDA graph, as SGLang's ``triton`` backend's does: SGLang captures that graph for the classes of a
list of its own, so the class is registered as a virtual subclass of ``TritonAttnBackend``.
"""

from __future__ import annotations

import inspect

import torch

from dcp_plugin.adapters.sglang.metadata import longest_on_host
from dcp_plugin.batch import DcpBatch, DcpBatchBuffers

HOOK_TARGET = "sglang.srt.speculative.draft_utils.DraftBackendFactory._create_backend"
_registered = False


def register_draft_backends(names: tuple[str, ...]) -> None:
    """Add ``names`` to SGLang's draft backend table (re-entrant; the hook applies when SGLang applies its plugins'
    hooks, at the end of ``load_plugins``)."""
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def with_dcp_triton(original, factory, backend_name, backend_map, *args, **kwargs):
        decode = getattr(backend_map.get("triton"), "__name__", "").endswith("decode_backend")
        stamped = "stamps_children" in inspect.signature(original).parameters  # 0.5.23: (name, backend) entries

        def make():
            runner = factory.draft_model_runner
            backend = DcpTritonDraftSteps(runner, factory.topk, factory.speculative_num_steps) if decode else \
                draft_extend_backend(runner)
            return (names[0], backend) if stamped else backend

        return original(factory, backend_name, {**backend_map, **dict.fromkeys(names, make)}, *args, **kwargs)

    HookRegistry.register(HOOK_TARGET, with_dcp_triton, HookType.AROUND)
    _registered = True


def draft_extend_backend(runner, *, topology=None):
    """dcp-triton's draft-extend backend for the draft ``runner``, of a class SGLang captures a CUDA graph for."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from dcp_plugin.adapters.sglang.backend import DcpTritonDraftExtendBackend

    if not issubclass(DcpTritonDraftExtendBackend, TritonAttnBackend):
        TritonAttnBackend.register(DcpTritonDraftExtendBackend)
    return DcpTritonDraftExtendBackend(runner, topology=topology)


class DcpTritonDraftSteps:
    """SGLang's multi-step draft decode backend for dcp-triton: ``attn_backends`` holds one backend per draft
    decode step, views of one ``DcpTritonAttnBackend`` of the draft runner (its workspace and compiled launches
    shared), each reading its own step's batch; CUDA graphs capture all steps over persistent buffers. ``topology``:
    as for ``DcpTritonAttnBackend`` (tests)."""

    needs_cpu_seq_lens = False  # as DcpTritonAttnBackend's: no step reads seq_lens_cpu

    def __init__(self, model_runner, topk: int, num_steps: int, *, topology=None) -> None:
        from dcp_plugin.adapters.sglang.backend import DcpTritonAttnBackend

        base = DcpTritonAttnBackend(model_runner, topology=topology)
        self.attn_backends = [base.step_view() for _ in range(num_steps - 1)]
        self.steps = DraftSteps(tokens=base.tokens, req_to_token=base.req_to_token_pool.req_to_token, topk=topk,
                                num_steps=num_steps)
        self.max_context_len = base.max_context_len

    def init_forward_metadata(self, forward_batch) -> None:
        self._bind(self.steps.build(forward_batch))

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.steps.init_graphs(max_bs)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        self._bind(self.steps.build(forward_batch, graph=True))

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        pass

    def _bind(self, batches: list[DcpBatch]) -> None:
        for backend, batch in zip(self.attn_backends, batches):
            backend.forward_metadata = batch


class DraftSteps:
    """Each draft decode step's ``DcpBatch`` (``DcpTritonDraftSteps``), at DCP = 1: ``tokens`` (the draft pool's
    page as the block), SGLang's slot rows ``req_to_token``, ``topk`` rows per request, ``num_steps`` drafts."""

    def __init__(self, *, tokens, req_to_token: torch.Tensor, topk: int, num_steps: int) -> None:
        self.tokens, self.req_to_token, self.topk, self.num_steps = tokens, req_to_token, topk, num_steps
        page = tokens.block_size
        self.paged = page > 1 and topk > 1  # SGLang's per-branch pages
        self.width = -(-req_to_token.shape[1] // page)
        self.graph: dict | None = None

    def init_graphs(self, max_bs: int) -> None:
        rows, device = max_bs * self.topk, self.req_to_token.device
        self.graph = {
            "query_start_loc": torch.arange(rows + 1, dtype=torch.int32, device=device),
            "seq_lens": torch.zeros(self.num_steps - 1, rows, dtype=torch.int32, device=device),
            "block_table": torch.zeros(rows, self.width, dtype=torch.int32, device=device),
            "slot_mapping": torch.full((self.num_steps - 1, rows), -1, dtype=torch.int64, device=device),
            "buffers": [DcpBatchBuffers(rows, device) for _ in range(self.num_steps - 1)],
        }

    def layout(self, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each request's branches begin in its slot row (``base``) and how far apart (``span``)."""
        seq, page = seq_lens.to(torch.int64), self.tokens.block_size
        if not self.paged:
            return seq, torch.full_like(seq, self.num_steps)
        tail = seq % page
        return seq - tail, (tail + self.num_steps + page - 1) // page * page

    def slot_index(self, positions: torch.Tensor, base: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
        """``[bs, topk, K]``: where in its request's slot row branch ``t`` keeps each of ``positions`` ``[bs, K]``
        (the prefix's own slots below ``base``, the branch's past it)."""
        p = positions[:, None, :]
        base, span = base[:, None, None], span[:, None, None]
        branch = torch.arange(self.topk, device=positions.device)[None, :, None]
        return torch.where(p < base, p, base + branch * span + p - base).clamp_max(self.req_to_token.shape[1] - 1)

    def build(self, fb, *, graph: bool = False) -> list[DcpBatch]:
        """The batches of every draft decode step (``graph``: over the persistent buffers, padded like ``fb``)."""
        bs, page, steps = fb.batch_size, self.tokens.block_size, self.num_steps - 1
        rows, device = bs * self.topk, fb.seq_lens.device
        seq = fb.seq_lens[:bs].to(torch.int64)
        slot_rows = self.req_to_token[fb.req_pool_indices[:bs].long()]
        base, span = self.layout(seq)
        capacity = self.req_to_token.shape[1] - steps  # the longest prefix whose drafts the slot row holds
        longest = None if graph else longest_on_host(fb, bs, capacity)
        width = self.width if longest is None else min(self.width, -(-(longest + steps) // page))
        columns = (torch.arange(width, device=device) * page).expand(bs, width)
        table = slot_rows.gather(1, self.slot_index(columns, base, span).view(bs, -1)) // page
        drafts = seq[:, None] + torch.arange(steps, device=device)  # each step's token: the branch's next position
        slots = slot_rows.gather(1, self.slot_index(drafts, base, span).view(bs, -1)).to(torch.int64)
        table, slots = table.view(rows, width), slots.view(rows, steps).T.contiguous()  # rows b * topk + t
        lens = seq.to(torch.int32).repeat_interleave(self.topk) + torch.arange(
            1, steps + 1, dtype=torch.int32, device=device)[:, None]
        if graph:
            g = self.graph
            g["block_table"][:rows].copy_(table)
            g["seq_lens"][:, :rows].copy_(lens)
            g["slot_mapping"][:, :rows].copy_(slots)
            table, lens, slots = g["block_table"][:rows], g["seq_lens"][:, :rows], g["slot_mapping"][:, :rows]
            query_start_loc = g["query_start_loc"][:rows + 1]
        else:
            query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        bounds = [self.req_to_token.shape[1] if graph else longest + i + 1 for i in range(steps)]
        return [DcpBatch.build(query_start_loc=query_start_loc, seq_lens=lens[i], block_table=table,
                               slot_mapping=slots[i], tokens=self.tokens, max_query_len=1, max_seq_len=bounds[i],
                               max_context_len=bounds[i] - 1, num_decodes=0,
                               buffers=self.graph["buffers"][i] if graph else None)
                for i in range(steps)]
