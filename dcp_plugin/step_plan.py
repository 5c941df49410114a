"""One step of DCP attention, prepared once and replayed by every layer: one small class per flow.

``plan_step`` runs once per step (per layer settings and tensor shapes): it picks the flow on rank-invariant data
and asks each kernel for its prepared launch (``plan_write_kv``, ``plan_chunk``, ``plan_prefix``,
``plan_merge``) on the step's workspace views. The plan's ``run`` is what every layer pays: the launches and the
collectives, nothing else. The flows (``T`` new tokens, ``H`` local Q heads, ``N`` ranks; the words are those of
docs/design.md's glossary):

- ``ChunkOnlyPlan``: no request has a cached context (``max_context_len == 0``, the same on every rank): the
  current chunk is the answer; no collective.
- ``SingleRankPlan``: DCP = 1. The current chunk, the prefix pass over the rank's cache, their merge.
- ``AgRsPlan``: DCP > 1, ``comm="ag_rs"``. The current chunk; the queries all-gathered head-major
  (``[N * H, T, D]``) and the prefix pass of all ``N * H`` heads (partial in the model dtype); an all-gather of its
  float32 LSEs, one kernel rescaling it into rank-major ``[N, T, H, D]``, a reduce-scatter that hands each rank
  the sum for its own heads (straight into ``out`` for decode), and the merge with the current chunk.
- ``A2aPlan``: DCP > 1, ``comm="a2a"``. The current chunk; the gathered queries' prefix pass writes its partial
  and LSE straight into the packed ``[N, T, W]`` send buffer; one all-to-all; one kernel merging the N received
  partials and the current chunk into ``out``.

A decode step (one new token per request) has no current chunk and no merge: the new token is already in its
owner's shard, so the prefix pass over every rank's whole shard is the causal result. In a mixed step the prefix
pass of the leading single-token requests runs apart, in the decode kernel (``DecodesFirst``), so their long
contexts get split-KV parallelism instead of one program each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from dcp_plugin.batch import DcpBatch
from dcp_plugin.group import BufferedGroup, DcpGroup
from dcp_plugin.layout import HeadLayout
from dcp_plugin.workspace import A2aViews, AgRsViews, GatheredViews, SingleRankViews, StepViews

# A prepared launch (a kernel's plan_*: Launch or PrefixLaunch, or a reference twin): called with the tensors only.
Prepared = Callable[..., None]
Collectives = DcpGroup | BufferedGroup  # a DCP group with the *_into collectives (dcp_plugin.group.buffered)
# A decode step's prefix pass is planned for its longest local shard rounded up to DECODE_BOUND_STEP tokens (the bound
# only tunes the split count): the decode steps that follow, over an engine's persistent buffers, then ask for the same
# plan, and DcpAttention replays it instead of preparing it again (``decode_signature``).
DECODE_BOUND_STEP = 256


def decode_bound(batch: DcpBatch) -> int:
    """The bound a decode step's prefix pass is planned for: ``max_local_seq_len`` rounded up to
    ``DECODE_BOUND_STEP``, at most the tokens the block table addresses."""
    capacity = batch.block_table.shape[1] * batch.tokens.block_size
    return min(capacity, -(-batch.max_local_seq_len // DECODE_BOUND_STEP) * DECODE_BOUND_STEP)


def decode_signature(batch: DcpBatch) -> tuple:
    """Everything a decode step's plan reads from its batch: decode steps of equal signature (and equal layer
    tensors' shapes, ``DcpAttention``'s key) have equal plans. The batch tensors enter by address, shape, strides and
    dtype: an engine's persistent buffers, refreshed in place, keep them from step to step."""
    return (batch.num_reqs, batch.num_tokens, decode_bound(batch),
            *((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in (batch.query_start_loc, batch.block_table,
                                                                     batch.slot_mapping, batch.local_seq_lens)))


@dataclass(frozen=True, slots=True, kw_only=True)
class StepInputs:
    """What a step plan is prepared from: the layer's kernels and heads, and tensors shaped like the step's."""

    kernel_ops: ModuleType  # dcp_plugin.kernels or dcp_plugin.kernels.reference: their plan_* functions
    heads: HeadLayout
    scale: float
    group: Collectives | None  # None at DCP = 1
    batch: DcpBatch
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    out: torch.Tensor
    write_kv: bool

    @property
    def decode(self) -> bool:
        return self.batch.max_query_len == 1

    def prepare_write(self) -> Prepared | None:
        """Step 1, unless the host writes the cache itself."""
        if not self.write_kv:
            return None
        return self.kernel_ops.plan_write_kv(self.k, self.v, self.key_cache, self.value_cache, self.batch.slot_mapping)

    def prepare_chunk(self, out: torch.Tensor, lse: torch.Tensor) -> Prepared | None:
        """Step 2 into ``(out, lse)``, causal or by the batch's ``chunk_mask``; none in a decode step."""
        if self.decode:
            return None
        heads, batch = self.heads, self.batch
        return self.kernel_ops.plan_chunk(self.q, self.k, self.v, out, lse, batch.query_start_loc, batch.max_query_len,
                                          scale=self.scale, q_head_start=heads.q_head_start, q_per_kv=heads.q_per_kv,
                                          kv_head_start=heads.kv_head_start, chunk_mask=batch.chunk_mask)

    def prefix_lens(self) -> tuple[torch.Tensor, int]:
        """The local tokens the prefix pass reads per request, and their rank-invariant bound: in a decode step the
        whole local shard (this step's token is written first; ``decode_bound``), otherwise the context cached before
        this step."""
        batch = self.batch
        if self.decode:
            return batch.local_seq_lens, decode_bound(batch)
        return batch.local_context_lens, batch.max_local_context_len

    def prepare_prefix(self, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *, q_head_start: int,
                       views: StepViews) -> Prepared:
        """Step 3, queries ``q`` against this rank's cache into ``(out, lse)``: one ``prefix_attention`` launch, or in
        a mixed step the leading decodes' own launch and the rest's (``DecodesFirst``). Called with the whole step's
        tables; split-KV partials and counters in ``views`` (``splits``, ``split_sync``)."""
        batch = self.batch
        lens, max_len = self.prefix_lens()
        nd = batch.num_decodes
        tables = (batch.block_table, lens, batch.query_start_loc)
        if self.decode or not 0 < nd < batch.num_reqs:
            return self._plan_prefix(q, tables, out, lse, batch.max_query_len, max_len, q_head_start, views)
        # Each launch writes its own rows; the decodes' rows of a rank-major out ([N, T, H, D]) are out[:, :nd].
        decodes = (batch.block_table[:nd], lens[:nd], batch.query_start_loc[:nd + 1])
        rest = (batch.block_table[nd:], lens[nd:], batch.query_start_loc[nd:])
        rank_major = out.dim() == 4
        first_out, first_lse = (out[:, :nd], lse[:, :nd]) if rank_major else (out[:nd], lse[:nd])
        return DecodesFirst(
            decodes=self._plan_prefix(q[:nd], decodes, first_out, first_lse, 1, max_len, q_head_start, views),
            rest=self._plan_prefix(q, rest, out, lse, batch.max_query_len, max_len, q_head_start, views),
            num_decodes=nd, decode_tables=decodes, rest_tables=rest, rank_major=rank_major)

    def _plan_prefix(self, q, tables, out, lse, max_query_len: int, max_kv_len: int, q_head_start: int,
                     views: StepViews):
        heads = self.heads
        return self.kernel_ops.plan_prefix(q, self.key_cache, self.value_cache, *tables, out, lse, scale=self.scale,
                                           q_head_start=q_head_start, q_per_kv=heads.q_per_kv,
                                           kv_head_start=heads.kv_head_start, max_kv_len=max_kv_len,
                                           max_query_len=max_query_len, split_buffer=views.splits,
                                           split_sync=views.split_sync)


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodesFirst:
    """A mixed step's prefix pass as two launches: the other requests (their own tables), then the leading
    single-token requests (decode variant, split-KV sized for them alone). Called like the one prefix_attention
    launch it replaces, with the whole step's tables; it launches on the two cuts of them it was prepared with."""

    decodes: Prepared
    rest: Prepared
    num_decodes: int
    decode_tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (block_table, lens, query_start_loc)
    rest_tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    rank_major: bool  # out is [N, T, H, D] (the decodes' rows are out[:, :num_decodes])

    def __call__(self, q, key_cache, value_cache, block_table, lens, query_start_loc, out, lse, k_scale=None,
                 v_scale=None) -> None:
        nd = self.num_decodes
        # The rest first: with several splits its merge runs over every row and leaves the decodes' rows
        # undefined, which the decodes' own launch then writes.
        self.rest(q, key_cache, value_cache, *self.rest_tables, out, lse, k_scale, v_scale)
        first = (out[:, :nd], lse[:, :nd]) if self.rank_major else (out[:nd], lse[:nd])
        self.decodes(q[:nd], key_cache, value_cache, *self.decode_tables, *first, k_scale, v_scale)


@dataclass(frozen=True, slots=True, kw_only=True)
class GatheredPrefix:
    """Step 3 at DCP > 1: this rank's queries all-gathered head-major across the group, then the prefix pass of all
    the group's Q heads over this rank's shard, into ``(out, lse)`` (workspace views)."""

    group: Collectives
    q_send: torch.Tensor  # [H, T, D]
    q_all: torch.Tensor  # [N * H, T, D]
    q_group: torch.Tensor  # q_all as [T, N * H, D]
    launch: Prepared  # prefix_attention's prepared launch, or DecodesFirst
    block_table: torch.Tensor
    lens: torch.Tensor
    query_start_loc: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor

    @classmethod
    def prepare(cls, step: StepInputs, views: GatheredViews, out: torch.Tensor, lse: torch.Tensor) -> GatheredPrefix:
        launch = step.prepare_prefix(views.q_group, out, lse, q_head_start=step.heads.group_q_head_start, views=views)
        return cls(group=step.group, q_send=views.q_send, q_all=views.q_all, q_group=views.q_group, launch=launch,
                   block_table=step.batch.block_table, lens=step.prefix_lens()[0],
                   query_start_loc=step.batch.query_start_loc, out=out, lse=lse)

    def __call__(self, q, key_cache, value_cache, k_scale, v_scale) -> None:
        self.q_send.copy_(q.transpose(0, 1))
        self.group.all_gather_into(self.q_all, self.q_send)
        self.launch(self.q_group, key_cache, value_cache, self.block_table, self.lens, self.query_start_loc, self.out,
                    self.lse, k_scale, v_scale)


@dataclass(frozen=True, slots=True, kw_only=True)
class _WriteAndChunk:
    """Steps 1-2, alike in every flow: the cache write (None: the host wrote it) and the current chunk (None in a
    decode step)."""

    write: Prepared | None
    slot_mapping: torch.Tensor
    chunk: Prepared | None
    query_start_loc: torch.Tensor

    def _write_and_chunk(self, q, k, v, key_cache, value_cache, chunk_out, chunk_lse, k_scale, v_scale) -> None:
        if self.write is not None:
            self.write(k, v, key_cache, value_cache, self.slot_mapping, k_scale, v_scale)
        if self.chunk is not None:
            self.chunk(q, k, v, chunk_out, chunk_lse, self.query_start_loc)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkOnlyPlan(_WriteAndChunk):
    """No request has a cached context: the current chunk, written into ``out``, is the answer."""

    lse: torch.Tensor  # the chunk's LSE (not returned)

    @classmethod
    def prepare(cls, step: StepInputs, views: StepViews) -> ChunkOnlyPlan:
        return cls(write=step.prepare_write(), slot_mapping=step.batch.slot_mapping,
                   chunk=step.prepare_chunk(step.out, views.lse), query_start_loc=step.batch.query_start_loc,
                   lse=views.lse)

    def run(self, q, k, v, key_cache, value_cache, out, k_scale=None, v_scale=None) -> None:
        self._write_and_chunk(q, k, v, key_cache, value_cache, out, self.lse, k_scale, v_scale)


@dataclass(frozen=True, slots=True, kw_only=True)
class SingleRankPlan(_WriteAndChunk):
    """DCP = 1 with a cached context. A decode step: the prefix pass over the whole cache writes the answer.
    Otherwise: the current chunk, the prefix pass (a float32 partial), and ``merge`` of the two into ``out``."""

    prefix: Prepared  # prefix_attention's prepared launch, or DecodesFirst; reads block_table and prefix_lens
    block_table: torch.Tensor
    prefix_lens: torch.Tensor
    merge: Prepared | None  # None in a decode step
    merge_inputs: tuple  # (prefix partial [1, T, H, D], its LSE [1, T, H], chunk out, chunk LSE)
    views: SingleRankViews

    @classmethod
    def prepare(cls, step: StepInputs, views: SingleRankViews) -> SingleRankPlan:
        decode, batch = step.decode, step.batch
        out, lse = (step.out, views.lse) if decode else (views.prefix_out, views.prefix_lse)
        merge_inputs = (views.prefix_out.unsqueeze(0), views.prefix_lse.unsqueeze(0), views.chunk_out,
                        views.chunk_lse)
        return cls(write=step.prepare_write(), slot_mapping=batch.slot_mapping,
                   chunk=step.prepare_chunk(views.chunk_out, views.chunk_lse), query_start_loc=batch.query_start_loc,
                   prefix=step.prepare_prefix(step.q, out, lse, q_head_start=step.heads.q_head_start, views=views),
                   block_table=batch.block_table, prefix_lens=step.prefix_lens()[0],
                   merge=None if decode else step.kernel_ops.plan_merge(*merge_inputs, step.out, views.lse),
                   merge_inputs=merge_inputs, views=views)

    def run(self, q, k, v, key_cache, value_cache, out, k_scale=None, v_scale=None) -> None:
        views = self.views
        self._write_and_chunk(q, k, v, key_cache, value_cache, views.chunk_out, views.chunk_lse, k_scale, v_scale)
        if self.merge is None:  # decode: the prefix pass is the answer
            self.prefix(q, key_cache, value_cache, self.block_table, self.prefix_lens, self.query_start_loc, out,
                        views.lse, k_scale, v_scale)
            return
        self.prefix(q, key_cache, value_cache, self.block_table, self.prefix_lens, self.query_start_loc,
                    views.prefix_out, views.prefix_lse, k_scale, v_scale)
        self.merge(*self.merge_inputs, out, views.lse)


@dataclass(frozen=True, slots=True, kw_only=True)
class AgRsPlan(_WriteAndChunk):
    """DCP > 1, ``comm="ag_rs"``: the gathered queries' prefix partial, every rank's LSEs all-gathered, the partial
    rescaled by this rank's share of each head's mass (``rescale``) and reduce-scattered, so each rank receives the
    merged prefix of its own heads; then ``merge`` with the current chunk (none in a decode step)."""

    prefix: GatheredPrefix  # into views.part, views.part_lse
    group: Collectives
    rescale: Prepared
    rescale_args: tuple  # (partial as [N, T, N * H, D] with stride 0 over N, lse_all, None, None, scaled, lse_total)
    reduce_into_out: bool  # a decode step into a contiguous out: the reduce-scatter writes the answer
    merge: Prepared | None
    merge_inputs: tuple  # (this rank's merged prefix [1, T, H, D], its LSE [1, T, H], chunk out, chunk LSE)
    views: AgRsViews

    @classmethod
    def prepare(cls, step: StepInputs, views: AgRsViews) -> AgRsPlan:
        heads, batch, kernel_ops = step.heads, step.batch, step.kernel_ops
        n, rank = heads.dcp_size, step.group.rank_in_group
        rescale_args = (views.part.unsqueeze(0).expand(n, *views.part.shape), views.lse_all, None, None,
                        views.scaled, views.lse_total)
        first = rank * heads.num_q_heads  # this rank's heads among the gathered ones
        merge_inputs = (views.mine.unsqueeze(0), views.lse_total[:, first:first + heads.num_q_heads].unsqueeze(0),
                        views.chunk_out, views.chunk_lse)
        return cls(write=step.prepare_write(), slot_mapping=batch.slot_mapping,
                   chunk=step.prepare_chunk(views.chunk_out, views.chunk_lse), query_start_loc=batch.query_start_loc,
                   prefix=GatheredPrefix.prepare(step, views, views.part, views.part_lse), group=step.group,
                   rescale=kernel_ops.plan_merge(*rescale_args, o_part_start=rank, num_o_parts=1),
                   rescale_args=rescale_args, reduce_into_out=step.decode and step.out.is_contiguous(),
                   merge=None if step.decode else kernel_ops.plan_merge(*merge_inputs, step.out, views.lse),
                   merge_inputs=merge_inputs, views=views)

    def run(self, q, k, v, key_cache, value_cache, out, k_scale=None, v_scale=None) -> None:
        views, group = self.views, self.group
        self._write_and_chunk(q, k, v, key_cache, value_cache, views.chunk_out, views.chunk_lse, k_scale, v_scale)
        self.prefix(q, key_cache, value_cache, k_scale, v_scale)
        group.all_gather_into(views.lse_all, views.part_lse)
        self.rescale(*self.rescale_args)  # rank-major: rank r's slice of views.scaled holds rank r's heads
        if self.reduce_into_out:
            group.reduce_scatter_into(out, views.scaled)
            return
        group.reduce_scatter_into(views.mine, views.scaled)
        if self.merge is None:  # a decode step into a strided out
            out.copy_(views.mine)
        else:
            self.merge(*self.merge_inputs, out, views.lse)


@dataclass(frozen=True, slots=True, kw_only=True)
class A2aPlan(_WriteAndChunk):
    """DCP > 1, ``comm="a2a"``: the gathered queries' prefix partial, packed with its LSEs, goes to the ranks that
    own its heads in one all-to-all; ``merge`` merges the N received partials and the current chunk into ``out``."""

    prefix: GatheredPrefix  # into views.send_out, views.send_lse
    group: Collectives
    merge: Prepared
    merge_inputs: tuple  # (recv_out, recv_lse, chunk out, chunk LSE), the chunk's None in a decode step
    views: A2aViews

    @classmethod
    def prepare(cls, step: StepInputs, views: A2aViews) -> A2aPlan:
        batch = step.batch
        chunk = (None, None) if step.decode else (views.chunk_out, views.chunk_lse)
        merge_inputs = (views.recv_out, views.recv_lse, *chunk)
        return cls(write=step.prepare_write(), slot_mapping=batch.slot_mapping,
                   chunk=step.prepare_chunk(views.chunk_out, views.chunk_lse), query_start_loc=batch.query_start_loc,
                   prefix=GatheredPrefix.prepare(step, views, views.send_out, views.send_lse), group=step.group,
                   merge=step.kernel_ops.plan_merge(*merge_inputs, step.out, views.lse),
                   merge_inputs=merge_inputs, views=views)

    def run(self, q, k, v, key_cache, value_cache, out, k_scale=None, v_scale=None) -> None:
        views = self.views
        self._write_and_chunk(q, k, v, key_cache, value_cache, views.chunk_out, views.chunk_lse, k_scale, v_scale)
        self.prefix(q, key_cache, value_cache, k_scale, v_scale)
        self.group.all_to_all_into(views.recv, views.send)
        self.merge(*self.merge_inputs, out, views.lse)


StepPlan = ChunkOnlyPlan | SingleRankPlan | AgRsPlan | A2aPlan


def plan_step(step: StepInputs, views: SingleRankViews | AgRsViews | A2aViews) -> StepPlan:
    """Prepare one step (its inputs checked by the caller) in the flow that rank-invariant data selects: whether any
    request has a cached context, then the workspace's kind (DCP = 1, or DCP > 1 with its comm mode)."""
    if not step.decode and step.batch.max_context_len == 0:  # no rank enters a collective
        return ChunkOnlyPlan.prepare(step, views)
    if isinstance(views, SingleRankViews):
        return SingleRankPlan.prepare(step, views)
    if isinstance(views, A2aViews):
        return A2aPlan.prepare(step, views)
    return AgRsPlan.prepare(step, views)
