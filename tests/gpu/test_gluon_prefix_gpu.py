"""The Gluon prefix pass (``dcp_plugin.kernels.gluon_prefix``) as ``prefix_attention`` runs it on an sm_90 GPU with
Triton 3.6 and ``DCP_TRITON_GLUON=1``: selected for a prefill step's one-split prefix pass over 64-token pages, and
equal to float64 attention there: varlen rows (1 to 300 a request) over contexts of 0 to 700 tokens in caches whose
other rows are NaN, plain (float32) and rank-major outputs, GQA head maps with offsets, rows past the last request
(0, -inf), rows before the first request untouched (a mixed step's second launch), CUDA graph replay."""

from __future__ import annotations

import pytest
import torch

from dcp_plugin.kernels import reference
from dcp_plugin.kernels import _gluon
from dcp_plugin.kernels._gluon import GLUON_ENV, gluon_supported
from dcp_plugin.kernels.gluon_prefix import plan_gluon_prefix
from dcp_plugin.kernels.prefix_attention import prefix_attention, plan_prefix
from dcp_plugin.testing import shuffled_block_table
from tests.helpers.kernel_checks import assert_matches, poisoned

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not gluon_supported(torch.device("cuda")),
                       reason="needs an sm_90 GPU and Triton 3.6 (the Gluon kernels)"),
]


@pytest.fixture(autouse=True)
def gluon_on(monkeypatch):
    monkeypatch.setenv(GLUON_ENV, "1")

PAGE = 64
Q_LENS = [1, 17, 130, 300, 128]
CTX = [0, 5, 64, 700, 129]  # none, part of a page, one page, 10 pages and a part, a key tile and one token


def _inputs(*, num_q_heads, num_kv_heads, dtype, first_row=0, pad=5, seed=0, head_dim=128):
    """q with ``first_row`` rows before the first request and ``pad`` after the last; caches of NaN but at each
    request's cached tokens (vLLM-style views of one ``[..., 2 * D]`` buffer), pages shuffled."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = [-(-c // PAGE) for c in CTX]
    buf = torch.full((sum(pages) + 1, PAGE, num_kv_heads, 2 * head_dim), float("nan"), dtype=dtype, device="cuda")
    table = shuffled_block_table(pages, generator=gen)
    for b, n in enumerate(CTX):
        pos = torch.arange(n, device="cuda")
        rows = table[b, pos // PAGE].long()
        buf[rows, pos % PAGE] = torch.randn(n, num_kv_heads, 2 * head_dim, generator=gen, device="cuda").to(dtype)
    qsl = torch.tensor([first_row, *(first_row + torch.tensor(Q_LENS).cumsum(0)).tolist()], dtype=torch.int32,
                       device="cuda")
    q = torch.randn(int(qsl[-1]) + pad, num_q_heads, head_dim, generator=gen, device="cuda").to(dtype)
    return (q, buf[..., :head_dim], buf[..., head_dim:], table, torch.tensor(CTX, dtype=torch.int32, device="cuda"),
            qsl)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A rank-major ``[R, T, H / R, ...]`` tensor as ``[T, H, ...]``."""
    return t.transpose(0, 1).reshape(t.shape[1], t.shape[0] * t.shape[2], *t.shape[3:])


# Q heads 24..31 of 32 read KV head 1 of 2 (over both stored heads, or over KV head 1 stored alone).
HEADS = {"32q8kv": (32, 8, dict(q_head_start=0, q_per_kv=4, kv_head_start=0)),
         "8of32q-2kv": (8, 2, dict(q_head_start=24, q_per_kv=16, kv_head_start=0)),
         "8of32q-kv1": (8, 1, dict(q_head_start=24, q_per_kv=16, kv_head_start=1))}


def test_selected_for_prefill_steps_only():
    q, kc, vc, table, lens, qsl = _inputs(num_q_heads=32, num_kv_heads=8, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")

    def kernel(max_query_len, num_splits=1):
        return plan_prefix(q, kc, vc, table, lens, qsl, out, lse, scale=0.1, **HEADS["32q8kv"][2], max_kv_len=700,
                           max_query_len=max_query_len, num_splits=num_splits).stage1.kernel.__name__

    assert kernel(300) == "gluon_prefix_kernel"
    assert kernel(300, num_splits=2) == kernel(8) == "prefix_attention_kernel"


@pytest.mark.parametrize("head_dim", [128, 64], ids=["d128", "d64"])
@pytest.mark.parametrize("first_row", [0, 200], ids=["first0", "first200"])
@pytest.mark.parametrize("rank_major", [False, True], ids=["plain", "rank-major"])
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_matches_float64(dtype, heads, rank_major, first_row, head_dim):
    """``first_row``: rows before the first request (a mixed step's launch after its decodes), more than a 128-row
    block of them too; the module's default schedule at both head sizes it serves (``GLUON_HEAD_DIMS``)."""
    assert head_dim in _gluon.GLUON_HEAD_DIMS
    num_q_heads, num_kv_heads, head_map = HEADS[heads]
    q, kc, vc, table, lens, qsl = _inputs(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, dtype=dtype,
                                          first_row=first_row, head_dim=head_dim)
    ranks = 2 if rank_major else 1
    out_dtype = dtype if rank_major else torch.float32  # DCP = 1's prefix pass writes float32
    out = poisoned((ranks, q.shape[0], num_q_heads // ranks, head_dim) if rank_major else q.shape, out_dtype,
                   "cuda")
    lse = poisoned((ranks, q.shape[0], num_q_heads // ranks) if rank_major else q.shape[:2], torch.float32, "cuda")
    assert plan_prefix(q, kc, vc, table, lens, qsl, out, lse, scale=0.1, **head_map, max_kv_len=700,
                       max_query_len=300, num_splits=1).stage1.kernel.__name__ == "gluon_prefix_kernel"
    prefix_attention(q, kc, vc, table, lens, qsl, scale=0.1, **head_map, max_kv_len=700, max_query_len=300,
                     num_splits=1, out=out, lse=lse)
    got_out, got_lse = (_plain(out), _plain(lse)) if rank_major else (out, lse)
    want_out, want_lse = reference.prefix_attention(q[first_row:].double(), kc.double(), vc.double(), table, lens,
                                                    qsl - first_row, scale=0.1, **head_map, max_kv_len=700)
    assert_matches(got_out[first_row:], want_out, dtype, "out")
    assert_matches(got_lse[first_row:], want_lse, dtype, "lse")
    assert got_out[:first_row].isnan().all() and got_lse[:first_row].isnan().all(), "rows before the first request"
    assert (got_out[-5:] == 0).all() and (got_lse[-5:] == float("-inf")).all(), "padding rows"


def test_cuda_graph_replay():
    q, kc, vc, table, lens, qsl = _inputs(num_q_heads=32, num_kv_heads=8, dtype=torch.bfloat16)
    head_map = HEADS["32q8kv"][2]
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    launch = plan_prefix(q, kc, vc, table, lens, qsl, out, lse, scale=0.1, **head_map, max_kv_len=700,
                         max_query_len=300, num_splits=1)
    assert launch.stage1.kernel.__name__ == "gluon_prefix_kernel"
    launch(q, kc, vc, table, lens, qsl, out, lse)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(q, kc, vc, table, lens, qsl, out, lse)
    q.copy_(torch.randn_like(q))
    lens.copy_(torch.tensor([0, 3, 64, 650, 100], device="cuda"))  # within each request's written tokens
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    want_out, want_lse = reference.prefix_attention(q.double(), kc.double(), vc.double(), table, lens, qsl,
                                                    scale=0.1, **head_map, max_kv_len=700)
    assert_matches(out, want_out, torch.bfloat16, "out")
    assert_matches(lse, want_lse, torch.bfloat16, "lse")


@pytest.mark.parametrize("first_row", [0, 200], ids=["first0", "first200"])
@pytest.mark.parametrize("heads", ["32q8kv", "8of32q-kv1"])
@pytest.mark.parametrize(("stages", "producer_fix", "overlap"), [(2, False, False), (3, True, False), (2, False, True)],
                         ids=["2-stages-consumer-copies", "3-stages-producer-fix", "overlap"])
def test_schedules_match_float64(stages, producer_fix, overlap, heads, first_row):
    """The schedules the benchmarks time beside the default (three stages, the last V tile's rows past the context
    zeroed by the producer in place, FA3's order): two stages with each consumer's own V copy, the producer's fix
    without FA3's order (``OVERLAP``: up to five unmasked key tiles before the last), and that order with the
    copies; NaN everywhere in the caches but the contexts."""
    num_q_heads, num_kv_heads, head_map = HEADS[heads]
    q, kc, vc, table, lens, qsl = _inputs(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, dtype=torch.bfloat16,
                                          first_row=first_row)
    out, lse = poisoned(q.shape, torch.bfloat16, "cuda"), poisoned(q.shape[:2], torch.float32, "cuda")
    plan_gluon_prefix(q, kc, vc, table, lens, qsl, out, lse, scale=0.1, **head_map, stages=stages,
                      producer_fix=producer_fix, overlap=overlap)(q, kc, vc, table, lens, qsl, out, lse, None, None)
    want_out, want_lse = reference.prefix_attention(q[first_row:].double(), kc.double(), vc.double(), table, lens,
                                                    qsl - first_row, scale=0.1, **head_map, max_kv_len=700)
    assert_matches(out[first_row:], want_out, torch.bfloat16, "out")
    assert_matches(lse[first_row:], want_lse, torch.bfloat16, "lse")
    assert out[:first_row].isnan().all() and lse[:first_row].isnan().all(), "rows before the first request"
    assert (out[-5:] == 0).all() and (lse[-5:] == float("-inf")).all(), "padding rows"
