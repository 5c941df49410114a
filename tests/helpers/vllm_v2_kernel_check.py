"""vLLM's V2-runner Triton kernels against their torch copies in ``tests/helpers/vllm_v2.py``, on random batches.

Run by ``tests/unit/test_vllm_v2_runner.py`` (``python -m tests.helpers.vllm_v2_kernel_check``) with
``CUDA_VISIBLE_DEVICES=''`` and ``TRITON_INTERPRET=1``, under which vLLM's CUDA build keeps Triton
(``vllm/triton_utils/importing.py``: no active driver is tolerated when the visible device list is empty) and the
kernels run interpreted on CPU tensors. Prints ``NO_TRITON`` where vLLM replaced Triton with placeholders, else
``KERNELS_EQUAL`` once every comparison held. The slot-mapping kernel is compared at DCP size 1 only: at DCP > 1 the
interpreter refuses its boolean mask (an int8 there); the test's ``vllm_slot`` checks that copy instead.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch
import vllm.triton_utils

if not vllm.triton_utils.HAS_TRITON:
    print("NO_TRITON")
    sys.exit(0)

from vllm.v1.worker.gpu import block_table, cp_utils, input_batch  # noqa: E402

from tests.helpers import vllm_v2  # noqa: E402

MAX_REQS, WIDTH, MAX_TOKENS, BLOCK = 8, 6, 64, 16


def tables(src: torch.Tensor, counts: torch.Tensor) -> block_table.BlockTables:
    """A one-group BlockTables holding ``src`` (its constructor needs pinned memory, so its state is set here)."""
    t = object.__new__(block_table.BlockTables)
    t.__dict__.update(
        block_sizes=[BLOCK], num_kv_cache_groups=1, max_num_reqs=MAX_REQS, device=torch.device("cpu"), cp_size=1,
        cp_rank=0, cp_interleave=1, _num_dirty_rows=0, _slot_mapping_enabled=[True],
        dcp_sharded=torch.tensor([True]), _sliding_window_reach=[0], has_sliding_window_groups=False,
        block_tables=[SimpleNamespace(gpu=src)], num_blocks=SimpleNamespace(gpu=counts[None].clone()),
        input_block_tables=[torch.full_like(src, 7)], slot_mappings=torch.full((1, MAX_TOKENS), 5),
        src=[src], src_num_blocks=[counts])
    t.init_block_table_layout_tensors()
    return t


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    for trial in range(6):
        num_reqs = int(torch.randint(1, MAX_REQS - 1, (), generator=gen))
        padded = num_reqs + trial % 3
        seq_lens = torch.randint(0, 300, (MAX_REQS,), generator=gen, dtype=torch.int32)
        for dcp, interleave in ((2, 1), (4, 2), (2, 8)):
            for rank in range(dcp):
                real = cp_utils.prepare_dcp_local_seq_lens(torch.full((MAX_REQS,), 9, dtype=torch.int32), seq_lens,
                                                           num_reqs, dcp, rank, interleave, num_reqs_padded=padded)
                copy = vllm_v2.prepare_dcp_local_seq_lens(torch.full((MAX_REQS,), 9, dtype=torch.int32), seq_lens,
                                                          num_reqs, dcp, rank, interleave, num_reqs_padded=padded)
                assert torch.equal(real, copy), ("dcp_local_seq_lens", trial, dcp, rank, real, copy)

        idx = torch.randperm(MAX_REQS, generator=gen)[:num_reqs]
        query_lens = torch.randint(1, 6, (num_reqs,), generator=gen, dtype=torch.int32)
        qsl = torch.full((MAX_REQS + 1,), int(query_lens.sum()), dtype=torch.int32)
        qsl[0] = 0
        qsl[1:num_reqs + 1] = query_lens.cumsum(0)
        computed = torch.randint(0, 40, (MAX_REQS,), generator=gen, dtype=torch.int32)
        outs = []
        for fn in (input_batch.prepare_pos_seq_lens, vllm_v2.prepare_pos_seq_lens):
            pos, lens = torch.full((MAX_TOKENS,), -3), torch.full((MAX_REQS,), -3, dtype=torch.int32)
            fn(idx, qsl[:padded + 1], computed, pos, lens)
            outs.append((pos, lens))
        assert all(torch.equal(a, b) for a, b in zip(*outs)), ("pos_seq_lens", trial, outs)
        positions = outs[0][0]

        src = (torch.randperm(MAX_REQS * WIDTH, generator=gen) + 1).to(torch.int32).view(MAX_REQS, WIDTH)
        counts = torch.randint(1, WIDTH + 1, (MAX_REQS,), generator=gen, dtype=torch.int32)
        real_t, copy_t = tables(src, counts), tables(src, counts)
        for rows in (MAX_REQS - 1, num_reqs):  # a larger batch first leaves dirty rows to clear
            real = real_t.gather_block_tables(idx[:rows] if rows <= num_reqs else torch.arange(rows), rows + 1)
            copy = vllm_v2.gather_block_tables(copy_t, idx[:rows] if rows <= num_reqs else torch.arange(rows),
                                               rows + 1)
            assert torch.equal(real[0], copy[0]), ("block_tables", trial, real, copy)
        real = real_t.compute_slot_mappings(idx, qsl[:padded + 1], positions, num_tokens_padded=MAX_TOKENS)
        copy = vllm_v2.compute_slot_mappings(copy_t, idx, qsl[:padded + 1], positions, num_tokens_padded=MAX_TOKENS)
        assert torch.equal(real, copy), ("slot_mappings", trial, real, copy)
    print("KERNELS_EQUAL")


if __name__ == "__main__":
    main()
