"""One step of DCP attention, prepared: which kernels run, on which buffers, with which collectives in between.

``build_plan`` runs once per step (per layer configuration and tensor shapes); ``StepPlan.run`` is what every layer
pays: the launches and collectives, nothing else. The flows (``T`` new tokens, ``H`` local Q heads, ``N`` ranks):

- decode (one new token per request): the token is already in its owner's shard, so non-causal attention of the
  queries to every rank's whole shard is the causal result; no current-chunk pass and no merge;
- a step with no cached prefix anywhere (rank-invariant ``max_context_len == 0``): the current chunk only, no
  collectives;
- otherwise: the current chunk (local Q heads against the step's own K/V), then the prefix (all-gathered Q against
  the local shard), combined across ranks and merged with the chunk by LSE. In a mixed step the prefix pass of
  the leading single-token requests runs apart, in the decode kernel (``DecodesFirst``), so their long contexts
  get split-KV parallelism instead of one program each.

At DCP > 1 the queries are all-gathered head-major (``[N * H, T, D]``). ``ag_rs``: the prefix partial in the model
dtype, an all-gather of its float32 LSEs, one kernel rescaling it into rank-major ``[N, T, H, D]``, and a
reduce-scatter that hands each rank the sum for its own heads (straight into ``out`` for decode). ``a2a``: the
prefix pass writes its partial and LSE straight into the packed ``[N, T, W]`` send buffer, one all-to-all, and one
kernel combining the N received partials and the current chunk into ``out``.
"""

from __future__ import annotations

from types import SimpleNamespace


class StepPlan:
    """The prepared launches of one step; ``run`` replays them for one layer's tensors."""

    __slots__ = ("write", "extend", "paged", "combine", "comm", "mode", "decode", "ws", "batch", "group",
                 "rs_into_out", "paged_args", "combine_args")

    def __init__(self, **fields) -> None:
        for name in self.__slots__:
            setattr(self, name, fields.get(name))

    def run(self, q, k, v, key_cache, value_cache, out, k_scale=None, v_scale=None) -> None:
        batch, ws = self.batch, self.ws
        if self.write is not None:
            self.write(k, v, key_cache, value_cache, batch.slot_mapping, k_scale, v_scale)
        mode = self.mode
        if mode == "chunk":  # no cached prefix on any rank: the current chunk is the answer
            self.extend(q, k, v, out, ws.lse, batch.query_start_loc)
            return
        if self.extend is not None:
            self.extend(q, k, v, ws.cur_out, ws.cur_lse, batch.query_start_loc)
        if mode == "local":  # DCP = 1
            if self.combine is None:
                self.paged(q, key_cache, value_cache, *self.paged_args, out, ws.lse, k_scale, v_scale)
            else:
                self.paged(q, key_cache, value_cache, *self.paged_args, ws.pre_out, ws.pre_lse, k_scale, v_scale)
                self.combine(*self.combine_args, out, ws.lse)
            return
        group = self.group
        ws.q_send.copy_(q.transpose(0, 1))
        group.all_gather_into(ws.q_all, ws.q_send)
        q_group = self.paged_args[0]
        if self.comm == "a2a":
            self.paged(q_group, key_cache, value_cache, *self.paged_args[1:], ws.send_out, ws.send_lse, k_scale,
                       v_scale)
            group.all_to_all_into(ws.recv, ws.send)
            self.combine(*self.combine_args, out, ws.lse)
            return
        self.paged(q_group, key_cache, value_cache, *self.paged_args[1:], ws.part, ws.part_lse, k_scale, v_scale)
        group.all_gather_into(ws.lse_all, ws.part_lse)
        rescale, merge = self.combine
        rescale(*self.combine_args[0])  # into rank-major [N, T, H, D]: rank r's slice holds rank r's heads
        if self.rs_into_out:  # decode into a contiguous out: the reduce-scatter writes the answer
            group.reduce_scatter_into(out, ws.scaled)
            return
        group.reduce_scatter_into(ws.mine, ws.scaled)
        if self.decode:
            out.copy_(ws.mine)
        else:
            merge(*self.combine_args[1], out, ws.lse)


class DecodesFirst:
    """A mixed step's prefix pass as two launches: the other requests (their own tables), then the leading
    single-token requests (decode variant, split-KV sized for them alone). Called like one paged launch."""

    __slots__ = ("decodes", "rest", "num_decodes", "decode_tables", "rest_tables", "rank_major")

    def __init__(self, decodes, rest, num_decodes: int, decode_tables: tuple, rest_tables: tuple,
                 rank_major: bool) -> None:
        self.decodes, self.rest, self.num_decodes = decodes, rest, num_decodes
        self.decode_tables, self.rest_tables, self.rank_major = decode_tables, rest_tables, rank_major

    def __call__(self, q, key_cache, value_cache, block_table, lens, query_start_loc, out, lse, k_scale=None,
                 v_scale=None) -> None:
        nd = self.num_decodes
        # The rest first: with several splits its merge runs over every row and leaves the decodes' rows
        # undefined, which the decodes' own launch then writes.
        self.rest(q, key_cache, value_cache, *self.rest_tables, out, lse, k_scale, v_scale)
        first = (out[:, :nd], lse[:, :nd]) if self.rank_major else (out[:nd], lse[:nd])
        self.decodes(q[:nd], key_cache, value_cache, *self.decode_tables, *first, k_scale, v_scale)


def build_plan(*, attn, q, k, v, key_cache, value_cache, batch, out, write_kv: bool, ws: SimpleNamespace) -> StepPlan:
    """Prepare one step for tensors shaped like these (checked by the caller)."""
    ops, heads = attn._kernels, attn.heads
    head_map = dict(scale=attn.scale, q_per_kv=heads.q_per_kv, kv_head_start=heads.kv_head_start)
    write = ops.plan_write_kv(k, v, key_cache, value_cache, batch.slot_mapping) if write_kv else None
    decode = batch.max_query_len == 1
    plan = StepPlan(write=write, ws=ws, batch=batch, comm=attn.comm, group=attn._collectives, decode=decode)
    if not decode:
        chunk_only = batch.max_context_len == 0  # rank-invariant: no rank enters a collective
        cur_out, cur_lse = (out, ws.lse) if chunk_only else (ws.cur_out, ws.cur_lse)
        plan.extend = ops.plan_extend(q, k, v, cur_out, cur_lse, batch.query_start_loc, batch.max_query_len,
                                      q_head_start=heads.q_head_start, **head_map)
        if chunk_only:
            plan.mode = "chunk"
            return plan
    lens, max_len = (batch.local_seq_lens, batch.max_local_seq_len) if decode else \
        (batch.local_context_lens, batch.max_local_context_len)
    tables = (batch.block_table, lens, batch.query_start_loc)

    def paged(q_, out_, lse_, q_head_start):
        def plan(q__, tables_, out__, lse__, max_query_len):
            return ops.plan_paged(q__, key_cache, value_cache, *tables_, out__, lse__, q_head_start=q_head_start,
                                  max_kv_len=max_len, max_query_len=max_query_len, split_buffer=ws.splits,
                                  **head_map)

        nd = batch.num_decodes
        if decode or not 0 < nd < batch.num_reqs:
            return plan(q_, tables, out_, lse_, batch.max_query_len)
        # A mixed step: its leading single-token requests in the decode kernel (split for their long contexts),
        # then the rest; each writes its own rows.
        decodes = (batch.block_table[:nd], lens[:nd], batch.query_start_loc[:nd + 1])
        rest = (batch.block_table[nd:], lens[nd:], batch.query_start_loc[nd:])
        rank_major = out_.dim() == 4
        first_out, first_lse = (out_[:, :nd], lse_[:, :nd]) if rank_major else (out_[:nd], lse_[:nd])
        return DecodesFirst(plan(q_[:nd], decodes, first_out, first_lse, 1), plan(q_, rest, out_, lse_,
                                                                                 batch.max_query_len),
                            nd, decodes, rest, rank_major)

    if heads.dcp_size == 1:
        plan.mode, plan.paged_args = "local", tables
        if decode:
            plan.paged = paged(q, out, ws.lse, heads.q_head_start)
        else:
            plan.paged = paged(q, ws.pre_out, ws.pre_lse, heads.q_head_start)
            plan.combine_args = (ws.pre_out.unsqueeze(0), ws.pre_lse.unsqueeze(0), ws.cur_out, ws.cur_lse)
            plan.combine = ops.plan_combine(*plan.combine_args, out, ws.lse)
        return plan

    plan.mode = "group"
    q_group = ws.q_all.transpose(0, 1)  # [T, N * H, D]
    plan.paged_args = (q_group, *tables)
    current = (ws.cur_out, ws.cur_lse) if not decode else (None, None)
    if attn.comm == "a2a":
        plan.paged = paged(q_group, ws.send_out, ws.send_lse, heads.group_q_head_start)
        plan.combine_args = (ws.recv_out, ws.recv_lse, *current)
        plan.combine = ops.plan_combine(*plan.combine_args, out, ws.lse)
        return plan
    plan.paged = paged(q_group, ws.part, ws.part_lse, heads.group_q_head_start)
    n = heads.dcp_size
    rescale_args = (ws.part.unsqueeze(0).expand(n, *ws.part.shape), ws.lse_all, None, None, ws.scaled, ws.lse_total)
    rescale = ops.plan_combine(*rescale_args, o_part_start=attn._collectives.rank_in_group, num_o_parts=1)
    first = attn._collectives.rank_in_group * heads.num_q_heads
    merge_args = (ws.mine.unsqueeze(0), ws.lse_total[:, first:first + heads.num_q_heads].unsqueeze(0), *current)
    plan.combine = (rescale, ops.plan_combine(*merge_args, out, ws.lse) if not decode else None)
    plan.combine_args = (rescale_args, merge_args)
    plan.rs_into_out = decode and out.is_contiguous()
    return plan

