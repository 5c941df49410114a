"""SGLang's CUDA-graph hooks on dcp-triton's backends, against whichever supported SGLang is installed (``make
test-sglang-matrix``): decode and verify steps (chains, trees, n-gram masks) and the draft model's extend windows,
each captured once and replayed over batches SGLang pads to the captured size, checked against float64 attention.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang runs in its own venv: make test-sglang-matrix")

from tests.helpers.kernel_checks import assert_matches  # noqa: E402
from tests.helpers.sglang_checks import SgCase, SglangRank, config_argv, server_args  # noqa: E402
from tests.helpers import sglang_spec_checks  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def plugins_loaded():
    """SGLang's own plugin loader, as every SGLang process runs it (dcp-triton's hooks applied)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()


def _padded(fb, bs: int, per_request: int):
    """SGLang's replay view of ``fb`` for a CUDA graph captured at ``bs`` requests: the per-request tensors padded
    (seq_len 1, request slot 0), ``out_cache_loc`` and ``spec_info`` the real requests'."""
    real = fb.batch_size
    pad = bs - real
    return SimpleNamespace(
        batch_size=bs, forward_mode=fb.forward_mode, spec_info=fb.spec_info, out_cache_loc=fb.out_cache_loc,
        seq_lens=torch.cat([fb.seq_lens, torch.ones(pad, dtype=fb.seq_lens.dtype)]),
        req_pool_indices=torch.cat([fb.req_pool_indices, torch.zeros(pad, dtype=fb.req_pool_indices.dtype)]),
        seq_lens_cpu=None, positions=torch.cat([fb.positions, torch.zeros(pad * per_request, dtype=torch.int64)]))


@pytest.mark.parametrize("speculative", ["", "eagle-chain", "eagle-tree", "ngram-full"])
def test_graph_steps_replay_padded_batches_on_fixed_addresses(speculative):
    """SGLang's CUDA-graph hooks for decode steps (no speculation) and verify steps: ``init_cuda_graph_state``, then
    ``init_forward_metadata_out_graph`` at capture and at every replay, each a batch of 3 requests padded to the
    captured 4 (SGLang's replay view). A replay refreshes the captured batch's buffers in place (the draft trees
    too), its padded tokens write nothing; running the captured step again (what a replay does) gives the new step's
    answer for the real requests."""

    case = SgCase(name="graphs", q_heads=8, kv_heads=2, page_size=2, requests=((5, 0), (9, 0), (2, 0)),
                  speculative=speculative, draft_tokens=4, verify_steps=4, decode_steps=4)
    state = SglangRank(case, 1, 0, None, server_args(config_argv(1) + sglang_spec_checks.argv(case)))
    state.step({0: 5, 1: 9, 2: 2})
    backend, d = state.backend, case.draft_tokens if speculative else 1
    backend.init_cuda_graph_state(4, 4 * d)
    captured, addresses = None, None
    rng = random.Random(3)
    layout = "full" if speculative.endswith("full") else "qlen"
    for step in range(4):
        if speculative:
            fb, positions, masks = sglang_spec_checks.verify_batch(state, trees="chain" not in speculative,
                                                                   layout=layout, rng=rng)
        else:
            (fb, positions), masks = state.allocate({0: 1, 1: 1, 2: 1}), [None] * 3
        backend.init_forward_metadata_out_graph(_padded(fb, 4, d), in_capture=step == 0)
        batch = backend.forward_metadata
        tensors = (batch.seq_lens, batch.block_table, batch.slot_mapping, batch.chunk_mask)
        if step == 0:
            captured, addresses = batch, [None if t is None else t.data_ptr() for t in tensors]
        assert [None if t is None else t.data_ptr() for t in tensors] == addresses
        assert bool((batch.slot_mapping[3 * d:] == -1).all())  # the padded request writes nothing
        backend.forward_metadata = captured  # a graph replays the captured step's launches
        q, k, v = (torch.cat(t) for t in zip(*(state._qkv(b, p) for b, p in positions.items())))
        q, k, v = (torch.cat([t, torch.zeros(d, *t.shape[1:])]) for t in (q, k, v))
        out = backend.forward_decode(q.flatten(1), k, v, state.layers[0], fb).view(q.shape)
        want = torch.cat([state.world.causal_attention_f64(b, p, range(8)) if m is None
                          else state.world.tree_attention_f64(b, p, m, range(8))
                          for (b, p), m in zip(positions.items(), masks)])
        assert_matches(out[:3 * d], want, out.dtype, f"replay {step}")
        if speculative:
            sglang_spec_checks.commit(state, positions, [sglang_spec_checks.accepted_path(m, d, rng) for m in masks],
                                      fb.out_cache_loc, rng)


def test_draft_extend_graph_steps_replay_padded_windows():
    """The draft model's extend after a verify step (``DRAFT_EXTEND_V2``: a causal window of ``d`` tokens per
    request, counted in ``seq_lens``) through SGLang's draft-extend CUDA-graph hooks: 3 requests padded to the
    captured 4 (seq_len 1, request slot 0, as SGLang's runner pads them). Every replay refreshes the captured
    buffers in place, the padded request writes nothing, and the captured step gives each new window's causal
    attention over its request's whole cache (float64)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from dcp_plugin.adapters.sglang.draft import draft_extend_backend

    d = 4
    case = SgCase(name="draft-extend", q_heads=8, kv_heads=2, page_size=2, requests=((5, 0), (9, 0), (2, 0)),
                  decode_steps=3 * d)
    state = SglangRank(case, 1, 0, None, server_args(config_argv(1)))
    state.step({0: 5, 1: 9, 2: 2})
    backend = draft_extend_backend(state.runner, topology=state.backend.topology)
    backend.init_cuda_graph_state(4, 4 * d)
    captured, addresses = None, None
    for step in range(3):
        fb, positions = state.allocate({0: d, 1: d, 2: d})
        fb.forward_mode, fb.spec_info = ForwardMode.DRAFT_EXTEND_V2, SimpleNamespace(num_tokens_per_req=d)
        backend.init_forward_metadata_out_graph(_padded(fb, 4, d), in_capture=step == 0)
        batch = backend.forward_metadata
        tensors = (batch.seq_lens, batch.block_table, batch.slot_mapping)
        if step == 0:
            captured, addresses = batch, [t.data_ptr() for t in tensors]
        assert [t.data_ptr() for t in tensors] == addresses and batch.chunk_mask is None
        assert bool((batch.slot_mapping[3 * d:] == -1).all())  # the padded request writes nothing
        backend.forward_metadata = captured  # a graph replays the captured step's launches
        q, k, v = (torch.cat(t) for t in zip(*(state._qkv(b, p) for b, p in positions.items())))
        q, k, v = (torch.cat([t, torch.zeros(d, *t.shape[1:])]) for t in (q, k, v))
        out = backend.forward_extend(q.flatten(1), k, v, state.layers[0], fb).view(q.shape)
        want = torch.cat([state.world.causal_attention_f64(b, p, range(8)) for b, p in positions.items()])
        assert_matches(out[:3 * d], want, out.dtype, f"replay {step}")


def test_an_adaptive_runs_candidate_backend_captures_its_own_draft_count():
    """``--speculative-adaptive``: SGLang builds a target backend and verify graphs for each candidate step count
    while its runtime config says that count (``get_context().override``, as its EAGLE worker does; the server
    arguments keep the start-up count). The candidate's backend takes the candidate's count: it captures a verify
    step of 3 draft tokens per request (the run started with 4), padded to the captured 4 requests, and gives each
    draft token its float64 attention."""
    import dataclasses

    from sglang.srt import runtime_context

    from dcp_plugin.adapters.sglang.backend import DcpTritonAttnBackend

    case = SgCase(name="adaptive", q_heads=8, kv_heads=2, page_size=2, requests=((5, 0), (9, 0), (2, 0)),
                  speculative="eagle-chain", draft_tokens=4, verify_steps=1, decode_steps=4)
    args = server_args(config_argv(1) + sglang_spec_checks.argv(case) + ["--speculative-adaptive"])
    state = SglangRank(case, 1, 0, None, args)
    state.step({0: 5, 1: 9, 2: 2})
    assert state.backend.speculation.draft_tokens == 4  # no runtime config published: the server arguments'
    runtime_context.publish(args, role="test")
    try:
        runtime_context.get_context().override("adaptive_spec.capture_override", speculative_num_steps=2,
                                               speculative_num_draft_tokens=3)
        backend = DcpTritonAttnBackend(state.runner, topology=state.backend.topology)
    finally:
        runtime_context.reset_context()
    d = 3
    assert backend.speculation.draft_tokens == d
    backend.init_cuda_graph_state(4, 4 * d)
    state.case = dataclasses.replace(case, draft_tokens=d)
    fb, positions, masks = sglang_spec_checks.verify_batch(state, trees=False, layout="qlen", rng=random.Random(0))
    backend.init_forward_metadata_out_graph(_padded(fb, 4, d), in_capture=True)
    q, k, v = (torch.cat(t) for t in zip(*(state._qkv(b, p) for b, p in positions.items())))
    q, k, v = (torch.cat([t, torch.zeros(d, *t.shape[1:])]) for t in (q, k, v))
    out = backend.forward_decode(q.flatten(1), k, v, state.layers[0], fb).view(q.shape)
    want = torch.cat([state.world.causal_attention_f64(b, p, range(8)) for b, p in positions.items()])
    assert_matches(out[:3 * d], want, out.dtype, "the candidate's verify step")
