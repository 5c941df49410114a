"""The SGLang adapter under speculative decoding and with hybrid models, against whichever supported SGLang is installed
(``make test-sglang-matrix``): the draft model's multi-step decode read exactly where SGLang's own draft kernel reads
and equal to float64 attention, SGLang's draft-backend factory building dcp-triton's backends, steps without SGLang's
host copy of the lengths, the start-up checks. The CUDA-graph hooks: ``test_sglang_graph_steps.py``. DCP = 2 and 4:
``tests/integration/test_sglang_dcp.py``.
"""

from __future__ import annotations

import contextlib
import inspect
import random
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang runs in its own venv: make test-sglang-matrix")

from dcp_plugin.adapters.sglang import compat, support  # noqa: E402
from dcp_plugin.adapters.sglang.draft import DcpTritonDraftSteps, DraftSteps  # noqa: E402
from dcp_plugin.layout import TokenLayout  # noqa: E402
from dcp_plugin.testing import attention_f64  # noqa: E402
from tests.helpers.kernel_checks import assert_matches  # noqa: E402
from tests.helpers.sglang_checks import SgCase, SglangRank, config_argv, server_args  # noqa: E402
from tests.helpers import sglang_spec_checks  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def plugins_loaded():
    """SGLang's own plugin loader, as every SGLang process runs it (dcp-triton's hooks applied)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()


def _drafting(page: int, topk: int, steps: int, lengths: tuple[int, ...], **fields):
    """An SglangRank at DCP = 1 whose requests were prefilled with ``lengths`` tokens, and their draft windows
    allocated and laid out as SGLang's ``prepare_for_draft`` does (the prefix's last partial page copied into each
    branch's first page when pages are wider than a token and ``topk > 1``): ``(state, draft steps' ForwardBatch
    stand-in, DraftSteps)``."""
    from sglang.srt.speculative.eagle_worker_common import duplicate_prefix_tail_to_draft_branches

    case = SgCase(name="draft", q_heads=4, kv_heads=1, page_size=page, requests=tuple((n, 0) for n in lengths),
                  decode_steps=topk * steps + page, speculative="eagle-tree", **fields)  # a pool that copies rows
    state = SglangRank(case, 1, 0, None, server_args(config_argv(1)))
    state.step({b: n for b, n in enumerate(lengths)})
    seq = torch.tensor(lengths)
    tokens = TokenLayout(dcp_size=1, dcp_rank=0, interleave=1, block_size=page)
    steps_of = DraftSteps(tokens=tokens, req_to_token=state.req_pool.req_to_token, topk=topk, num_steps=steps)
    base, span = steps_of.layout(seq)
    state.reserve({b: int(base[b] + topk * span[b]) for b in range(len(lengths))})
    if steps_of.paged:
        rows = state.req_pool.req_to_token[torch.arange(len(lengths))].long()
        duplicate_prefix_tail_to_draft_branches(state.pool, rows, base, seq % page, span // page, topk, page)
    fb = SimpleNamespace(batch_size=len(lengths), seq_lens=seq, seq_lens_cpu=seq,
                         req_pool_indices=torch.arange(len(lengths)))
    return state, fb, steps_of


def _sglang_draft_rows(state, fb, topk: int, steps: int, page: int) -> list[list[torch.Tensor]]:
    """The slots SGLang's own ``generate_draft_decode_kv_indices`` gives each row (``b * topk + t``) of each draft
    step to attend (its Triton kernel, interpreted)."""
    from sglang.kernels.ops.speculative.cache_locs import generate_draft_decode_kv_indices

    bs, rows = fb.batch_size, fb.batch_size * topk
    req_to_token = state.req_pool.req_to_token
    kv_indices = torch.full((steps, rows * (int(fb.seq_lens.max()) + steps)), -1, dtype=torch.int64)
    kv_indptr = torch.zeros(steps, rows + 1, dtype=torch.int32)
    positions = fb.seq_lens.repeat_interleave(topk)
    names = inspect.signature(generate_draft_decode_kv_indices.fn).parameters
    stride = {"row_stride" if "row_stride" in names else "pool_len": req_to_token.shape[1]}
    pow2 = lambda n: 1 << max(0, (n - 1).bit_length())  # noqa: E731
    generate_draft_decode_kv_indices[(steps, bs, topk)](
        req_pool_indices=fb.req_pool_indices, req_to_token=req_to_token, paged_kernel_lens=fb.seq_lens,
        kv_indices=kv_indices, kv_indptr=kv_indptr, positions=positions, kv_indices_stride=kv_indices.shape[1],
        kv_indptr_stride=kv_indptr.shape[1], bs_upper=pow2(bs), iter_upper=pow2(steps), num_tokens_upper=pow2(rows),
        page_size=page, **stride)
    return [[kv_indices[i, int(kv_indptr[i, r]):int(kv_indptr[i, r]) + int(positions[r]) + i + 1]
             for r in range(rows)] for i in range(steps - 1)]


DRAFT_LAYOUTS = [(1, 1, 3), (1, 4, 3), (4, 1, 3), (4, 3, 4), (2, 2, 5), (8, 2, 3)]


@pytest.mark.parametrize("page, topk, steps", DRAFT_LAYOUTS, ids=[f"p{p}-topk{k}-steps{s}" for p, k, s in DRAFT_LAYOUTS])
def test_draft_steps_read_what_sglangs_draft_kernel_reads(page, topk, steps):
    """Every row of every draft decode step attends the K/V SGLang's own draft kernel gives it (gathered through
    each one's indices from a pool of random values), whether the branches lie contiguously past the prefix or in
    pages of their own after a copy of the prefix's last partial page."""
    state, fb, steps_of = _drafting(page, topk, steps, (1, 5, page + 3, 2 * page + 1))
    cache = state.kv_pool.k_buffer[0]
    cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(page * 31 + topk)))
    if steps_of.paged:  # the prefix tails again, into the random pool: what SGLang's copy leaves
        from sglang.srt.speculative.eagle_worker_common import duplicate_prefix_tail_to_draft_branches

        base, span = steps_of.layout(fb.seq_lens)
        rows = state.req_pool.req_to_token[torch.arange(fb.batch_size)].long()
        duplicate_prefix_tail_to_draft_branches(state.pool, rows, base, fb.seq_lens % page, span // page, topk, page)
    theirs = _sglang_draft_rows(state, fb, topk, steps, page)
    for i, batch in enumerate(steps_of.build(fb)):
        for r in range(fb.batch_size * topk):
            length = int(batch.seq_lens[r])
            positions = torch.arange(length)
            ours = batch.block_table[r, positions // page].long() * page + positions % page
            assert len(theirs[i][r]) == length
            assert torch.equal(cache[ours], cache[theirs[i][r]]), f"step {i} row {r}"
            assert int(batch.slot_mapping[r]) == int(theirs[i][r][-1])  # the step writes the token it reads last


@pytest.mark.parametrize("page, topk, kernels, host_lengths", [(1, 1, "reference", True), (1, 3, "reference", False),
                                                               (4, 3, "reference", True), (2, 2, "triton", False)])
def test_draft_steps_match_float64_attention(page, topk, kernels, host_lengths):
    """The multi-step draft decode through ``DcpTritonDraftSteps`` on SGLang's objects: each step writes each
    branch's new token and attends the prefix and the branch's tokens so far, equal to float64 attention; with
    SGLang's host copy of the lengths and without it (its overlap scheduler's speculative steps)."""
    steps, lengths = 4, (3, 7, 2 * page + 1)
    state, fb, _ = _drafting(page, topk, steps, lengths, kernel_impl=kernels)
    if not host_lengths:
        fb.seq_lens_cpu = None
    state.runner.is_draft_worker = True
    drafts = DcpTritonDraftSteps(state.runner, topk, steps, topology=state.backend.topology)
    for backend in drafts.attn_backends:
        backend.kernel_impl = kernels
        backend._output_like = lambda q: torch.full_like(q, float("nan"))
    drafts.init_forward_metadata(fb)
    world, heads, d = state.world, state.heads, state.case.head_dim
    gen = torch.Generator().manual_seed(page + topk)
    rows = len(lengths) * topk
    dk, dv, dq = (torch.randn(steps - 1, rows, n, d, generator=gen, dtype=torch.float64) for n in (1, 1, 4))
    for i, backend in enumerate(drafts.attn_backends):
        q, k, v = dq[i].float(), dk[i].float(), dv[i].float()
        out = backend.forward_decode(q.flatten(1), k, v, state.layers[0], fb).view(q.shape)
        for r in range(rows):
            b = r // topk
            keys = torch.cat([world.keys[b][:lengths[b]], dk[:i + 1, r]])
            values = torch.cat([world.values[b][:lengths[b]], dv[:i + 1, r]])
            want = attention_f64(dq[i, r:r + 1], keys, values, torch.ones(1, len(keys), dtype=torch.bool),
                                 scale=world.scale, q_per_kv=4)
            assert_matches(out[r:r + 1], want, torch.float32, f"step {i} row {r}")


def _factory(runner, topk: int, steps: int):
    """SGLang's ``DraftBackendFactory`` for ``runner`` (no ``--speculative-draft-attention-backend``), and a maker of
    the configuration it reads in force (0.5.23: a context of its own; 0.5.17: published, then reset)."""
    from sglang.srt import runtime_context
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    if "server_args" in inspect.signature(DraftBackendFactory.__init__).parameters:
        @contextlib.contextmanager
        def published():
            runtime_context.publish(runner.server_args, role="test")
            try:
                yield
            finally:
                runtime_context.reset_context()

        return DraftBackendFactory(runner.server_args, runner, topk, steps), published
    runner.draft_attention_backend = None
    context = runtime_context.create_context(runner.server_args, role="test")
    return DraftBackendFactory(runner, topk, steps), lambda: runtime_context.use_context(context)


def test_sglangs_draft_backend_factory_builds_dcp_tritons(monkeypatch):
    """With ``--attention-backend dcp-triton`` SGLang's ``DraftBackendFactory`` (which lists its built-in backends
    only) builds dcp-triton's multi-step draft decode and draft extend backends (the hook registered with SGLang's
    plugins), at DCP = 1 over the draft runner's pool; a name it knows neither way is still refused by SGLang."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from dcp_plugin.adapters.sglang import topology
    from dcp_plugin.adapters.sglang.backend import DcpTritonAttnBackend, DcpTritonDraftExtendBackend

    state = SglangRank(SgCase(name="factory", q_heads=8, kv_heads=2, page_size=2), 1, 0, None,
                       server_args(config_argv(1)))
    runner = state.runner
    runner.is_draft_worker = True
    monkeypatch.setattr(topology, "from_sglang", lambda runner: state.backend.topology)  # no SGLang runtime here
    factory, context = _factory(runner, topk=2, steps=4)
    with context():
        steps, extend = factory.create_decode_backend(), factory.create_draft_extend_backend()
    assert isinstance(steps, DcpTritonDraftSteps) and len(steps.attn_backends) == 3
    assert all(isinstance(b, DcpTritonAttnBackend) and b.tokens.dcp_size == 1 for b in steps.attn_backends)
    assert len({id(b.workspace) for b in steps.attn_backends}) == 1  # one workspace for every step
    assert type(extend) is DcpTritonDraftExtendBackend and extend.verify_mask is None  # a draft verifies nothing
    # SGLang captures the draft extend's CUDA graph for the classes it lists, TritonAttnBackend among them: the
    # draft-extend backend passes its isinstance test, a target's backend does not.
    assert isinstance(extend, TritonAttnBackend) and not isinstance(state.backend, TritonAttnBackend)
    assert steps.attn_backends[0].get_cuda_graph_seq_len_fill_value() == 1
    factory.draft_attn_backend = "dcp-tritonn"  # --speculative-draft-attention-backend
    with context(), pytest.raises(ValueError, match="EAGLE is not supported in decode attention backend dcp-tritonn"):
        factory.create_decode_backend()


def test_no_step_needs_sglangs_host_copy_of_the_lengths(monkeypatch):
    """SGLang's overlap scheduler copies each speculative step's lengths to the host, which waits for the step before
    to finish on the GPU, unless every backend of the run says ``needs_cpu_seq_lens = False``. SGLang's own decision
    over a hybrid target's run (the target inside SGLang's hybrid wrapper, dcp-triton's draft decode steps and draft
    extend) skips the copy, and a backend that does not say so would bring it back. Without the copy
    (``seq_lens_cpu`` None) each decode, verify and draft decode step is built with every host bound given, which on
    a GPU is what keeps ``DcpBatch.build`` from reading the device."""
    from sglang.srt.managers.overlap_utils import decide_needs_cpu_seq_lens

    from dcp_plugin.adapters.sglang import topology
    from dcp_plugin.batch import DcpBatch

    case = SgCase(name="overlap", q_heads=8, kv_heads=2, page_size=2, hybrid=True, speculative="eagle-chain",
                  requests=((5, 0), (9, 0), (2, 0)), decode_steps=8)
    state = SglangRank(case, 1, 0, None, server_args(config_argv(1) + sglang_spec_checks.argv(case)))
    state.step({0: 5, 1: 9, 2: 2})
    target = state.backend
    state.runner.is_draft_worker = True
    monkeypatch.setattr(topology, "from_sglang", lambda runner: target.topology)  # no SGLang runtime here
    factory, context = _factory(state.runner, topk=1, steps=3)
    with context():
        steps, extend = factory.create_decode_backend(), factory.create_draft_extend_backend()
        server = (state.runner.server_args,) if "server_args" in inspect.signature(
            decide_needs_cpu_seq_lens).parameters else ()  # 0.5.17 takes them, 0.5.23 reads its context
        assert decide_needs_cpu_seq_lens(*server, (state.attn, steps, extend)) is False
        assert decide_needs_cpu_seq_lens(*server, (state.attn, steps, SimpleNamespace())) is True
    built = []
    build = DcpBatch.build.__func__
    monkeypatch.setattr(DcpBatch, "build", classmethod(lambda cls, **kw: built.append(kw) or build(cls, **kw)))
    decode, _ = state.allocate({0: 1, 1: 1, 2: 1})
    verify, _, _ = sglang_spec_checks.verify_batch(state, trees=False, layout="qlen", rng=random.Random(0))
    for fb in (decode, verify):
        fb.seq_lens_cpu = None
        target.init_forward_metadata(fb)
    kinds = [str(fb.forward_mode) for fb in (decode, verify)]
    steps.init_forward_metadata(SimpleNamespace(batch_size=3, seq_lens=fb.seq_lens, seq_lens_cpu=None,
                                                req_pool_indices=fb.req_pool_indices))
    assert len(built) == 2 + len(steps.attn_backends), kinds
    for kw in built:
        assert None not in (kw["max_query_len"], kw["max_seq_len"], kw["max_context_len"]), kw


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "STANDALONE", "NGRAM"])
def test_sglangs_speculative_algorithms_are_accepted_without_a_plan_stream(monkeypatch, algorithm):
    """SGLang's algorithms run; its opt-in plan stream, which would build a step's metadata beside the forward
    stream that refreshes dcp-triton's graph buffers, is refused by name."""
    state = SglangRank(SgCase(name="spec", q_heads=8, kv_heads=2), 1, 0, None, server_args(config_argv(1)))
    monkeypatch.setattr(compat, "resolved_server_arg", lambda runner, arg: algorithm if arg == "speculative_algorithm"
                        else None)
    assert support.runner_problems(state.runner) == []
    monkeypatch.setenv("SGLANG_ENABLE_OVERLAP_PLAN_STREAM", "true")
    (problem,) = support.runner_problems(state.runner)
    assert problem.startswith("SGLANG_ENABLE_OVERLAP_PLAN_STREAM=1") and "supported: 0" in problem


def test_a_hybrid_models_pool_is_accepted_and_its_full_attention_buffers_read():
    """SGLang's ``HybridLinearKVPool`` around an ``MHATokenToKVPool``: accepted; the backend reads a layer's cache
    through the pool's map of model layer ids (layer 3 is the pool's second full-attention layer) and sets what
    SGLang's hybrid wrapper reads off it."""
    state = SglangRank(SgCase(name="hybrid", q_heads=8, kv_heads=2, page_size=2, hybrid=True), 1, 0, None,
                       server_args(config_argv(1)))
    assert support.runner_problems(state.runner) == []
    key_cache, _ = state.backend._cache_views(3)
    assert key_cache.data_ptr() == state.kv_pool.k_buffer[1].data_ptr()
    wrapper = state.attn
    assert wrapper.token_to_kv_pool is state.pool and wrapper.req_to_token_pool is state.req_pool
    assert state.backend.max_context_len == state.req_pool.req_to_token.shape[1]


def test_a_hybrid_pool_around_another_pool_is_refused():
    state = SglangRank(SgCase(name="hybrid", q_heads=8, kv_heads=2, hybrid=True), 1, 0, None,
                       server_args(config_argv(1)))
    state.pool.full_kv_pool = SimpleNamespace()  # e.g. SGLang's MXFP8 or sparse pools
    (problem,) = support.runner_problems(state.runner)
    assert problem.startswith("KV pool HybridLinearKVPool holding SimpleNamespace") and "supported:" in problem


def test_a_speculative_target_hands_sglang_a_draft_tree_buffer():
    """SGLang's EAGLE worker writes each verify step's draft trees into the target backend's ``verify_mask`` in its
    ``QLEN_ONLY`` layout (no prefix columns); a graph's batch sizes grow it. A target without speculation, and any
    draft runner, has none."""
    from sglang.srt.speculative.eagle_utils import TreeMaskMode

    case = SgCase(name="trees", q_heads=8, kv_heads=2, speculative="eagle-tree", draft_tokens=6)
    state = SglangRank(case, 1, 0, None, server_args(config_argv(1) + sglang_spec_checks.argv(case)))
    mask = state.backend.verify_mask
    assert mask.mode == TreeMaskMode.QLEN_ONLY and mask.is_read and mask.max_bs == state.req_pool.size
    assert mask.buffer.dtype == torch.bool and mask.buffer.numel() == mask.max_bs * 36
    state.backend.init_cuda_graph_state(16, 16 * 6)
    assert state.backend.verify_mask.max_bs == 16 and state.backend.verify_mask.buffer.numel() == 16 * 36
    assert state.attn.verify_mask is state.backend.verify_mask
    plain = SglangRank(SgCase(name="plain", q_heads=8, kv_heads=2), 1, 0, None, server_args(config_argv(1)))
    assert plain.backend.verify_mask is None


def test_every_target_backend_over_a_pool_keeps_its_verify_windows_for_the_one_move():
    """At DCP > 1 with draft trees the pool's move reads the verify windows the backends kept: a second target
    backend over the same pool (SGLang 0.5.23's adaptive runtime builds several) keeps them in the same place, and
    CUDA-graph batch sizes past the request pool make room for their windows."""
    from dcp_plugin.adapters.sglang.backend import DcpTritonAttnBackend

    class GroupShape:  # the DCP group's shape: building a backend runs no collective
        world_size, rank_in_group = 2, 0

    case = SgCase(name="moves", q_heads=8, kv_heads=2, speculative="eagle-tree", draft_tokens=6)
    state = SglangRank(case, 2, 0, GroupShape(), server_args(config_argv(2) + sglang_spec_checks.argv(case)))
    moves = state.backend._moves
    assert moves is not None and state.pool.move_kv_cache == moves.move
    again = DcpTritonAttnBackend(state.runner, topology=state.backend.topology)
    assert again._moves is moves and state.pool.move_kv_cache == moves.move
    again.init_cuda_graph_state(64, 64 * 6)
    assert moves.window.shape[0] == moves.keys.shape[1] == 64 * 6


@pytest.mark.parametrize("algorithm", ["STANDALONE", "NGRAM"])
def test_the_sglang_example_asks_for_what_sglang_resolves(algorithm):
    """``examples/sglang_generate.py``'s engine arguments (a tree: topk 4, 8 draft tokens, the model drafting for
    itself; or n-gram trees), given to SGLang's own parser under the same names on a config-only Llama at TP = DCP
    = 2."""
    from pathlib import Path

    from tests.helpers.examples import load_example

    example = load_example("sglang_generate")
    model = Path(config_argv(2)[1])
    args = example.build_parser().parse_args(["--model", str(model), "--tp", "2", "--dcp", "2", "--topk", "4",
                                              "--draft-tokens", "8", "--speculative-algorithm", algorithm])
    argv = ["--device", "cpu"]
    for name, value in example.engine_kwargs(model, args).items():
        flag = "--" + name.replace("_", "-")
        argv += ([flag] if value else []) if isinstance(value, bool) else [flag, str(value)]
    resolved = server_args(argv)
    assert (resolved.attention_backend, resolved.tp_size, resolved.dcp_size) == ("dcp-triton", 2, 2)
    assert (resolved.speculative_algorithm, resolved.speculative_num_draft_tokens) == (algorithm, 8)
    assert resolved.skip_tokenizer_init
    if algorithm == "STANDALONE":
        assert (resolved.speculative_eagle_topk, resolved.speculative_num_steps) == (4, 3)
        assert resolved.speculative_draft_model_path == str(model)
