"""The SGLang adapter against whichever supported SGLang is installed (``make test-sglang-matrix``: 0.5.17 and
0.5.23, each in its own venv beside the CPU torch): entry point, registration, SGLang's own argument parsing and
resolution, token placement and KV write against SGLang's own functions, and the backend on SGLang's objects at
DCP = 1, decode CUDA-graph hooks included. DCP = 2 and 4: ``tests/integration/test_sglang_dcp.py``.
"""

from __future__ import annotations

import logging
import os
import sys
from importlib import metadata

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang runs in its own venv: make test-sglang-matrix")

from packaging.version import Version  # noqa: E402

import dcp_plugin.adapters.sglang as plugin  # noqa: E402
from dcp_plugin.adapters.sglang import compat, registration  # noqa: E402
from dcp_plugin.adapters.sglang.metadata import StepBuilder  # noqa: E402
from dcp_plugin.layout import TokenLayout  # noqa: E402
from tests.helpers.sglang_checks import SgCase, SglangRank, config_argv, run_sglang_case, server_args  # noqa: E402

EXPECTED_SGLANG_ENV = "DCP_TRITON_EXPECT_SGLANG"


@pytest.fixture(scope="module", autouse=True)
def plugins_loaded():
    """SGLang's own plugin loader, as every SGLang process runs it."""
    from sglang.srt.plugins import load_plugins

    load_plugins()


def test_the_installed_sglang_is_the_expected_supported_one():
    import sglang

    assert compat.unsupported_sglang_reason() is None
    expected = os.environ.get(EXPECTED_SGLANG_ENV)
    if expected:
        assert f"sglang=={compat.installed_sglang()}" == expected
        assert sglang.__file__.startswith(sys.prefix)  # this venv's SGLang, not one behind it on the path


def test_the_entry_point_registers_every_name():
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    (point,) = [p for p in metadata.entry_points(group="sglang.srt.plugins") if p.name == "dcp_triton"]
    assert point.load() is plugin.register
    for name in ("dcp-triton", "dcp_triton", "DCP_TRITON"):
        assert ATTENTION_BACKEND_CHOICES.count(name) == 1
        assert ATTENTION_BACKENDS[name] is registration.create_backend
    plugin.register()  # re-entrant: nothing doubles
    assert ATTENTION_BACKEND_CHOICES.count("dcp-triton") == 1


@pytest.mark.parametrize("name", ["dcp-triton", "dcp_triton", "DCP_TRITON"])
def test_sglang_parses_and_resolves_the_names(name):
    from sglang.srt.arg_groups.overrides import attention_backends_of, resolved_view

    args = server_args([*config_argv(4), "--attention-backend", name])
    view = resolved_view(args)
    assert set(attention_backends_of(view)) == {name}
    assert (view.tp_size, view.dcp_size) == (4, 4)


def test_sglang_still_refuses_unknown_names(capsys):
    with pytest.raises(SystemExit):
        server_args([*config_argv(1), "--attention-backend", "dcp-tritonn"])
    assert "invalid choice: 'dcp-tritonn'" in capsys.readouterr().err


@pytest.mark.parametrize("dp, tp, dcp", [(1, 4, 4), (1, 4, 2), (2, 4, 2)])
def test_server_args_resolution_with_dp_tp_dcp(dp, tp, dcp):
    from sglang.srt.arg_groups.overrides import attention_backends_of, resolved_view

    argv = [*config_argv(1)[:4], "--tp-size", str(tp), "--dcp-size", str(dcp), "--dp-size", str(dp),
            "--attention-backend", "dcp-triton"]
    view = resolved_view(server_args(argv))
    assert (view.dp_size, view.tp_size, view.dcp_size) == (dp, tp, dcp)
    assert set(attention_backends_of(view)) == {"dcp-triton"}
    assert view.dcp_comm_backend in ("ag_rs", "a2a", "auto")


def test_an_unsupported_sglang_registers_nothing_and_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(compat, "installed_sglang", lambda: Version("0.5.20"))
    monkeypatch.setattr(registration, "register", lambda: pytest.fail("registered on an unsupported SGLang"))
    with caplog.at_level(logging.WARNING, logger="sglang.dcp_triton"):
        plugin.register()
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "sglang==0.5.20 is not supported" in record.getMessage()
    assert "supported: sglang 0.5.17.x, sglang 0.5.23.x" in record.getMessage()


def test_a_failed_registration_is_one_error_naming_the_version(monkeypatch, caplog):
    def broken():
        raise ImportError("cannot import name 'register_attention_backend'")

    monkeypatch.setattr(registration, "register", broken)
    with caplog.at_level(logging.WARNING, logger="sglang.dcp_triton"):
        plugin.register()
    (record,) = caplog.records
    message = record.getMessage()
    assert record.levelno == logging.ERROR and record.exc_info is None  # one line, no traceback
    assert f"sglang=={compat.installed_sglang()}" in message and "register_attention_backend" in message
    assert "supported: sglang 0.5.17.x, sglang 0.5.23.x" in message


def _sglang_step(n: int, page: int, lengths: list[int]):
    """SGLang's allocator and request table after prefilling ``lengths`` and allocating one decode token each:
    ``(rank state, decode ForwardBatch, its positions)``."""
    state = SglangRank(SgCase(name="placement", q_heads=4 * n, kv_heads=1, page_size=page, decode_steps=0,
                              requests=tuple((length, 1) for length in lengths)),
                       n, 0, _GroupShape(n), server_args(config_argv(1)))
    state.allocate({b: length for b, length in enumerate(lengths)})
    fb, positions = state.allocate({b: 1 for b in range(len(lengths))})
    return state, fb, torch.cat(list(positions.values()))


class _GroupShape:
    """A DCP group's shape for the layouts (the placement tests run no collective)."""

    def __init__(self, n: int) -> None:
        self.world_size, self.rank_in_group = n, 0


@pytest.mark.parametrize("n, page", [(2, 1), (2, 4), (4, 1), (4, 2)])
def test_token_placement_is_sglangs(n, page):
    """Per rank: SGLang's local lengths (get_dcp_lens) and the cache rows its Triton DCP reads
    (create_triton_kv_indices_for_dcp_triton) equal TokenLayout's lengths and the rows our block table addresses."""
    from sglang.srt.layers.dcp import create_triton_kv_indices_for_dcp_triton, get_dcp_lens

    lengths = [1, 2, n - 1 or 1, 2 * n * page + 3, 37]
    state, fb, _ = _sglang_step(n, page, lengths)
    req_to_token, rpi, seq_lens = state.req_pool.req_to_token, fb.req_pool_indices, fb.seq_lens
    for rank in range(n):
        tokens = TokenLayout(dcp_size=n, dcp_rank=rank, interleave=1, block_size=page)
        lens = get_dcp_lens(seq_lens, n, rank)
        assert lens.tolist() == [tokens.local_len(int(s)) for s in seq_lens]
        indptr = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0))
        rows = torch.full((int(lens.sum()),), -1, dtype=torch.int64)
        create_triton_kv_indices_for_dcp_triton[(len(lengths),)](req_to_token, rpi, lens, indptr, None, rows,
                                                                 req_to_token.stride(0), n, rank)
        table = StepBuilder(tokens=tokens, req_to_token=req_to_token).block_table(rpi, 64)
        for b in range(len(lengths)):
            local = torch.arange(int(lens[b]))
            p = tokens.global_position(local)
            ours = table[b, tokens.virtual_block(p)].long() * page + tokens.local_offset(p)
            assert torch.equal(ours, rows[indptr[b]:indptr[b + 1]]), f"rank {rank}, request {b}"


@pytest.mark.parametrize("ops_name", ["reference", "triton"])
@pytest.mark.parametrize("n, page", [(2, 1), (4, 2)])
def test_kv_write_is_sglangs(n, page, ops_name):
    """The rows the backend writes equal what SGLang's own masked DCP write (MHATokenToKVPool.set_kv_buffer with
    loc = out_cache_loc // dcp and dcp_kv_mask = positions % dcp == rank) stores, bit for bit, NaN elsewhere."""
    from sglang.srt.layers.radix_attention import RadixAttention

    from dcp_plugin import kernels
    from dcp_plugin.kernels import reference

    ops = reference if ops_name == "reference" else kernels
    lengths = [3, 2 * n * page + 1, 8]
    state, fb, positions = _sglang_step(n, page, lengths)
    layer = RadixAttention(4, 64, 1.0, 1, layer_id=0)
    gen = torch.Generator().manual_seed(n * 10 + page)
    k, v = (torch.randn(len(lengths), 1, 64, generator=gen) for _ in range(2))
    pool = state.pool
    for rank in range(n):
        theirs = [torch.full_like(b, float("nan")) for b in (pool.k_buffer[0], pool.v_buffer[0])]
        pool.k_buffer[0], pool.v_buffer[0] = theirs
        pool.set_kv_buffer(layer, fb.out_cache_loc // n, k.clone(), v.clone(), dcp_kv_mask=positions % n == rank)
        tokens = TokenLayout(dcp_size=n, dcp_rank=rank, interleave=1, block_size=page)
        builder = StepBuilder(tokens=tokens, req_to_token=state.req_pool.req_to_token)
        qsl = torch.arange(len(lengths) + 1, dtype=torch.int32)
        slots = builder.slot_mapping(fb.out_cache_loc, fb.seq_lens.to(torch.int32), qsl, len(lengths))
        ours = [torch.full_like(b, float("nan")).unflatten(0, (-1, page)) for b in theirs]
        ops.write_kv_cache(k, v, *ours, slots)
        for mine, sglangs in zip(ours, theirs):
            torch.testing.assert_close(mine.flatten(0, 1), sglangs, rtol=0, atol=0, equal_nan=True)
        assert int((slots >= 0).sum()) == int((positions % n == rank).sum())


DCP1_CASES = [
    SgCase(name="p1", q_heads=8, kv_heads=2),
    SgCase(name="p2-no-host-lengths", q_heads=8, kv_heads=2, page_size=2, host_lengths=False),
    SgCase(name="p4-mqa-fp16", q_heads=4, kv_heads=1, page_size=4, dtype="float16"),
    SgCase(name="triton-p2", q_heads=4, kv_heads=2, page_size=2, requests=((3, 2), (0, 3)), decode_steps=1,
           kernel_impl="triton"),
    SgCase(name="triton-p64", q_heads=8, kv_heads=2, page_size=64, requests=((70, 3), (0, 5)), decode_steps=1,
           kernel_impl="triton"),
]


@pytest.mark.parametrize("case", DCP1_CASES, ids=[c.name for c in DCP1_CASES])
def test_backend_at_dcp1_on_sglang_objects(case):
    assert run_sglang_case(case, 1, 0, None, lambda out: out) == 4 - (case.decode_steps < 2)


@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
def test_a_padded_idle_batch_gets_decode_metadata(hybrid):
    """A DP-attention rank without requests runs an IDLE batch that SGLang padded to the DP group's size (seq_len 1,
    request slot 0, cache location 0: SGLang's padding slot). SGLang builds its attention metadata (and skips the
    attention itself): the backend, directly or inside the hybrid wrapper, takes it as decode rows, as SGLang's own
    backends do, and nothing is written to the cache."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    case = SgCase(name="idle", q_heads=8, kv_heads=2, page_size=2, requests=((5, 0), (9, 0)), hybrid=hybrid)
    state = SglangRank(case, 1, 0, None, server_args(config_argv(1)))
    state.step({0: 5, 1: 9})
    bs, layer = 2, state.layers[0]
    ones, zeros = torch.ones(bs, dtype=torch.int64), torch.zeros(bs, dtype=torch.int64)
    fb = ForwardBatch(forward_mode=ForwardMode.IDLE, batch_size=bs, input_ids=zeros, req_pool_indices=zeros,
                      seq_lens=ones, out_cache_loc=zeros, seq_lens_sum=bs, seq_lens_cpu=ones, positions=zeros)
    keys = state.kv_pool.get_key_buffer(layer.layer_id)
    before = keys.clone()
    state.attn.init_forward_metadata(fb)
    batch = state.backend.forward_metadata
    assert (batch.num_tokens, batch.seq_lens.tolist(), batch.max_query_len) == (bs, [1, 1], 1)
    q, k, v = (torch.randn(bs, n, case.head_dim) for n in (8, 2, 2))
    state.attn.forward(q.flatten(1), k, v, layer, fb)  # as RadixAttention calls it
    assert bool((keys.nan_to_num(7.0) == before.nan_to_num(7.0)).all())


@pytest.mark.parametrize(("page_size", "descriptors"), [(64, True), (1, False), (16, False)])
def test_pages_of_64_tokens_let_hopper_read_the_cache_through_tensor_descriptors(monkeypatch, page_size, descriptors):
    """With ``--page-size 64`` the backend's views of SGLang's KV buffers take whole 64-token tiles through tensor
    descriptors on an sm_90 GPU (its answer stood in for); at SGLang's default page size of 1, or 16, they do not."""
    from dcp_plugin.kernels import _prefix_tile

    monkeypatch.setattr(_prefix_tile, "tma_available", lambda device: True)
    state = SglangRank(SgCase(name="views", q_heads=8, kv_heads=2, page_size=page_size), 1, 0, None,
                       server_args(config_argv(1)))
    key_cache, value_cache = state.backend._cache_views(0)
    assert key_cache.shape[1] == page_size
    assert _prefix_tile.cache_takes_descriptors(key_cache, value_cache, key_cache.shape[-1], 64) is descriptors


def test_decode_graph_hooks_replay_on_fixed_addresses():
    """SGLang's decode CUDA-graph hooks: ``init_cuda_graph_state``, then ``init_forward_metadata_out_graph`` at
    capture and at every replay. A replay refreshes the captured batch's buffers in place; running the captured
    step again (what a graph replay does: the same launches on the same addresses) gives the new step's answer."""
    from tests.helpers.kernel_checks import assert_matches

    case = SgCase(name="graphs", q_heads=8, kv_heads=2, page_size=2, requests=((5, 1), (9, 1), (2, 1)), decode_steps=3)
    state = SglangRank(case, 1, 0, None, server_args(config_argv(1)))
    state.step({0: 5, 1: 9, 2: 2})
    backend = state.backend
    backend.init_cuda_graph_state(4, 4)
    fb, positions = state.allocate({0: 1, 1: 1})
    backend.init_forward_metadata_out_graph(fb, in_capture=True)
    captured = backend.forward_metadata
    state.forward(fb, positions)
    addresses = [t.data_ptr() for t in (captured.seq_lens, captured.block_table, captured.slot_mapping)]
    for step in range(3):  # replays with longer contexts; a captured graph re-runs the captured batch's launches
        fb, positions = state.allocate({0: 1, 1: 1})
        backend.init_forward_metadata_out_graph(fb)
        replay = backend.forward_metadata
        assert [t.data_ptr() for t in (replay.seq_lens, replay.block_table, replay.slot_mapping)] == addresses
        backend.forward_metadata = captured
        want = torch.cat([state.world.causal_attention_f64(b, p, range(8)) for b, p in positions.items()])
        for out in state.forward(fb, positions):
            assert_matches(out, want, out.dtype, f"replay {step}")


REFUSALS = {
    "sliding window 4096": lambda r: setattr(r, "sliding_window_size", 4096),
    "MLA model": lambda r: setattr(r, "use_mla_backend", True),
    "encoder-decoder model": lambda r: setattr(r.model_config, "is_encoder_decoder", True),
    "attention_chunk_size=8192": lambda r: setattr(r.model_config, "attention_chunk_size", 8192),
    "--kv-cache-dtype": lambda r: setattr(r, "kv_cache_dtype", torch.float8_e4m3fn),
    "head_dim=72": lambda r: setattr(r.model_config, "head_dim", 72),
    "layer 1: logit_cap=30.0": lambda r: setattr(r.model[1], "logit_cap", 30.0),
    "layer 0: sliding window 128": lambda r: setattr(r.model[0], "sliding_window_size", 128),
    "layer 1: cross-attention": lambda r: setattr(r.model[1], "is_cross_attention", True),
    # A model that splits its KV heads by TP instead of replicating them in the DCP group.
    "layer 0: holds 8 Q / 1 KV heads": lambda r: setattr(r.model[0], "tp_k_head_num", 1),
}


@pytest.mark.parametrize("option", list(REFUSALS))
def test_unsupported_settings_are_refused_at_start_up_by_name(option):
    """The backend is built when SGLang's model runner starts (the model loaded, before any request): each
    unsupported setting raises one ValueError naming it and what is supported."""
    from dcp_plugin.adapters.sglang.backend import DcpTritonAttnBackend

    state = SglangRank(SgCase(name="refusal", q_heads=8, kv_heads=2), 1, 0, None, server_args(config_argv(1)))
    REFUSALS[option](state.runner)
    with pytest.raises(ValueError, match="supported") as error:
        DcpTritonAttnBackend(state.runner, topology=state.backend.topology)
    assert option in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("flag, value", [("--speculative-algorithm", "DFLASH"), ("--enable-two-batch-overlap", True)])
def test_other_speculative_algorithms_and_two_batch_overlap_are_refused(monkeypatch, flag, value):
    from dcp_plugin.adapters.sglang import support

    state = SglangRank(SgCase(name="refusal", q_heads=8, kv_heads=2), 1, 0, None, server_args(config_argv(1)))
    name = flag[2:].replace("-", "_")
    monkeypatch.setattr(compat, "resolved_server_arg", lambda runner, arg: value if arg == name else None)
    (problem,) = support.runner_problems(state.runner)
    assert problem.startswith(flag) and "supported:" in problem


def test_sinks_at_forward_are_refused_by_name():
    state = SglangRank(SgCase(name="sinks", q_heads=8, kv_heads=2), 1, 0, None, server_args(config_argv(1)))
    fb, positions = state.allocate({0: 5})
    state.backend.init_forward_metadata(fb)
    q = torch.zeros(5, 8 * 64)
    with pytest.raises(ValueError, match="layer 0: sinks"):
        state.backend.forward_extend(q, torch.zeros(5, 2, 64), torch.zeros(5, 2, 64), state.layers[0], fb,
                                     sinks=torch.zeros(8))


def test_the_plans_kv_heads_per_rank_are_sglangs_own():
    """``dcp-triton plan --engine sglang`` counts the KV heads per rank SGLang's ``ModelConfig.get_num_kv_heads``
    gives its pools: 0.5.23 splits them over tp / dcp ranks (``--kv-layout replicated``; drafts over tp), 0.5.17 over
    tp at every DCP size."""
    import inspect
    from types import SimpleNamespace

    from sglang.srt.configs.model_config import ModelConfig

    from dcp_plugin.capacity import ModelShape
    from dcp_plugin.dcp_sizes import kv_heads_per_rank

    takes_dcp = "dcp_size" in inspect.signature(ModelConfig.get_num_kv_heads).parameters
    assert takes_dcp == (Version(metadata.version("sglang")) >= Version("0.5.23"))
    checked = 0
    for kv in (1, 2, 4, 8):
        model = ModelShape(num_q_heads=32, num_kv_heads=kv, head_dim=128, num_layers=1)
        for tp in (1, 2, 4, 8):
            for dcp in (d for d in (1, 2, 4, 8) if tp % d == 0):
                for draft in (False, True):
                    config = SimpleNamespace(get_total_num_kv_heads=lambda kv=kv: kv, is_draft_model=draft)
                    theirs = ModelConfig.get_num_kv_heads(config, tp, *((dcp,) if takes_dcp else ()))
                    layout = "replicated" if takes_dcp and not draft else "tp"
                    assert kv_heads_per_rank(model, tp_size=tp, dcp_size=dcp, kv_layout=layout) == theirs, \
                        (kv, tp, dcp, draft)
                    checked += 1
    assert checked == 2 * 4 * (1 + 2 + 3 + 4)
