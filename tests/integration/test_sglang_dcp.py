"""The SGLang backend at DCP = 2 and 4 on real processes (torch.distributed, gloo) equals single-rank attention.

Each rank builds its own SGLang objects (``tests.helpers.sglang_checks``): SGLang's paged allocator hands out the
widened slots (pages of ``page_size * dcp``), ``ForwardBatch`` describes every step (a prefill, an extend over that
cached prefix, decode steps), and the backend writes the tokens it owns into SGLang's ``MHATokenToKVPool`` by SGLang's
placement and runs DCP attention over ``TorchDcpGroup``. Every layer's output, gathered across ranks, must match float64
causal attention over the full sequences; each rank's pool must hold its tokens at SGLang's rows.

Hybrid models (``hybrid``: SGLang's hybrid pools and its ``HybridLinearAttnBackend`` around the backend) and
speculative verify steps (``speculative``: EAGLE chains and trees, n-gram trees in SGLang's full-mask layout;
tests/helpers/sglang_spec_checks.py) run the same way, the seeds' workload among them.

Head layouts: the seeds' topology (32 Q / 2 KV heads at TP 4, DCP 4: ranks 0-1 read KV head 0, ranks 2-3 KV head
1) and 12 Q / 3 KV heads at TP 2, DCP 2, where each rank stores all 3 KV heads and rank 0's Q heads 0-5 read KV
heads 0 and 1: a KV-head count the DCP size neither divides nor is divided by, which SGLang's own Triton DCP maps
by a uniform slice (rank 0 would read KV head 0 only).
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="SGLang runs in its own venv: make test-sglang-matrix")

from tests.integration.dcp_procs import GROUP_KEY, OK, run_group  # noqa: E402
from tests.helpers.sglang_checks import SgCase, run_sglang_case  # noqa: E402

MIXED = ((5, 3), (0, 4), (9, 1), (2, 2))  # (cached context, new tokens): a prefix, a fresh prompt, short ones

CASES = {
    2: [
        SgCase(name="12q3kv-p1-ag_rs", q_heads=12, kv_heads=3, requests=MIXED),
        SgCase(name="12q3kv-p2-a2a", q_heads=12, kv_heads=3, page_size=2, requests=MIXED, comm="a2a"),
        SgCase(name="gqa4-p4-fp16", q_heads=8, kv_heads=2, page_size=4, requests=MIXED, dtype="float16"),
        SgCase(name="gqa4-p64-ag_rs", q_heads=8, kv_heads=2, page_size=64, requests=MIXED),
        SgCase(name="triton-12q3kv-p2", q_heads=12, kv_heads=3, page_size=2, requests=((3, 2), (0, 3)),
               decode_steps=1, kernel_impl="triton"),
        SgCase(name="hybrid-12q3kv-p2-eagle-chain", q_heads=12, kv_heads=3, page_size=2, requests=MIXED, hybrid=True,
               speculative="eagle-chain", decode_steps=0, verify_steps=3, host_lengths=False),
        SgCase(name="eagle-tree-p1-a2a", q_heads=8, kv_heads=2, requests=MIXED, comm="a2a", speculative="eagle-tree",
               draft_tokens=6, decode_steps=0, verify_steps=3),
        SgCase(name="ngram-full-p4", q_heads=8, kv_heads=2, page_size=4, requests=MIXED, speculative="ngram-full",
               draft_tokens=5, decode_steps=0, verify_steps=3),
    ],
    4: [
        SgCase(name="seeds-32q2kv-p1-ag_rs", q_heads=32, kv_heads=2, requests=MIXED),
        SgCase(name="seeds-32q2kv-p2-a2a", q_heads=32, kv_heads=2, page_size=2, requests=MIXED, comm="a2a"),
        SgCase(name="seeds-32q2kv-p64-a2a", q_heads=32, kv_heads=2, page_size=64, requests=MIXED, comm="a2a"),
        SgCase(name="triton-seeds-32q2kv-p1", q_heads=32, kv_heads=2, requests=((5, 2), (0, 2)), decode_steps=1,
               kernel_impl="triton"),
        # The seeds' workload: Qwen3.5's layout (hybrid pools, 32 Q / 2 KV heads at TP 4, DCP 4) with MTP drafts,
        # its verify steps without SGLang's host copy of the lengths (as its overlap scheduler runs them).
        SgCase(name="seeds-hybrid-32q2kv-p1-eagle-chain", q_heads=32, kv_heads=2, requests=MIXED, hybrid=True,
               speculative="eagle-chain", decode_steps=0, verify_steps=3, host_lengths=False),
        SgCase(name="seeds-hybrid-32q2kv-p2-eagle-tree-a2a", q_heads=32, kv_heads=2, page_size=2, requests=MIXED,
               hybrid=True, comm="a2a", speculative="eagle-tree", draft_tokens=6, decode_steps=0, verify_steps=2),
        SgCase(name="triton-seeds-hybrid-32q2kv-eagle-tree", q_heads=32, kv_heads=2, requests=((5, 2), (0, 2)),
               hybrid=True, speculative="eagle-tree", draft_tokens=5, decode_steps=0, verify_steps=2,
               kernel_impl="triton"),
    ],
}
TIMEOUT_S = 300
_RESULTS: dict[int, dict[str, str]] = {}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    def of(n: int) -> dict[str, str]:
        if n not in _RESULTS:
            _RESULTS[n] = run_group(n, CASES[n], tmp_path_factory.mktemp(f"sglang-dcp{n}"), timeout_s=TIMEOUT_S,
                                    runner=run_sglang_case)
        return _RESULTS[n]

    return of


@pytest.mark.parametrize("n, name", [(n, c.name) for n in CASES for c in CASES[n]],
                         ids=[f"N{n}-{c.name}" for n in CASES for c in CASES[n]])
def test_matches_single_rank_attention(results, n, name):
    verdicts = results(n)
    assert name in verdicts, f"{name} did not run:\n{verdicts.get(GROUP_KEY, 'no verdict')}"
    assert verdicts[name] == OK, verdicts[name]


@pytest.mark.parametrize("n", list(CASES), ids=[f"N{n}" for n in CASES])
def test_process_group_ran_cleanly(results, n):
    verdicts = results(n)
    assert GROUP_KEY not in verdicts, verdicts[GROUP_KEY]
