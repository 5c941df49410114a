"""The Gluon current chunk (``dcp_plugin.kernels.gluon_chunk``) as ``chunk_attention`` runs it on an sm_90 GPU with
Triton 3.6 and ``DCP_TRITON_GLUON=1``: selected for head size 128 with K and V heads contiguous (vLLM's views of its
qkv projection), and equal to float64 causal attention: varlen requests of 1 to 1,000 rows (a key tile's edges), GQA
head maps with offsets, rows past the last request (0, -inf) whose K/V hold NaN, a request's NaN kept out of the
other requests (a key tile that passes a request's end reads the next one's rows), CUDA graph replay."""

from __future__ import annotations

import pytest
import torch

from dcp_plugin.kernels import reference
from dcp_plugin.kernels import _gluon
from dcp_plugin.kernels._gluon import GLUON_ENV, gluon_supported
from dcp_plugin.kernels.chunk_attention import chunk_attention, plan_chunk
from dcp_plugin.kernels.gluon_chunk import PAIRS, ROUND_ROBIN, SNAKE, plan_gluon_chunk
from tests.helpers.kernel_checks import assert_matches, poisoned

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not gluon_supported(torch.device("cuda")),
                       reason="needs an sm_90 GPU and Triton 3.6 (the Gluon kernels)"),
]

LENS = [1, 17, 64, 127, 128, 129, 300, 1000]
# Q heads 24..31 of 32 read KV head 1 of 2 (over both stored heads, or over KV head 1 stored alone).
HEADS = {"32q8kv": (32, 8, dict(q_head_start=0, q_per_kv=4, kv_head_start=0)),
         "8of32q-2kv": (8, 2, dict(q_head_start=24, q_per_kv=16, kv_head_start=0)),
         "8of32q-kv1": (8, 1, dict(q_head_start=24, q_per_kv=16, kv_head_start=1))}
PAD = 5


@pytest.fixture(autouse=True)
def gluon_on(monkeypatch):
    monkeypatch.setenv(GLUON_ENV, "1")


def _inputs(num_q_heads, num_kv_heads, dtype, seed=0, head_dim=128):
    """q, k, v as views of one qkv buffer (vLLM's layout), ``PAD`` rows past the last request with NaN K/V."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qsl = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    rows = int(qsl[-1]) + PAD
    qkv = torch.randn(rows, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen, device="cuda").to(dtype)
    q, k, v = (t.view(rows, -1, head_dim) for t in qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim,
                                                              num_kv_heads * head_dim], 1))
    k[-PAD:] = float("nan")
    v[-PAD:] = float("nan")
    return q, k, v, qsl


def _run(q, k, v, qsl, head_map, dtype):
    out, lse = poisoned(q.shape, dtype, "cuda"), poisoned(q.shape[:2], torch.float32, "cuda")
    chunk_attention(q, k, v, qsl, max(LENS), scale=0.1, **head_map, out=out, lse=lse)
    return out, lse


def test_selected():
    q, k, v, qsl = _inputs(32, 8, torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    launch = plan_chunk(q, k, v, out, lse, qsl, max(LENS), scale=0.1, **HEADS["32q8kv"][2])
    assert launch.kernel.__name__ == "gluon_chunk_kernel"


@pytest.mark.parametrize("head_dim", [128, 64], ids=["d128", "d64"])
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_matches_float64(dtype, heads, head_dim):
    """The module's default schedule at both head sizes it serves (``GLUON_HEAD_DIMS``)."""
    assert head_dim in _gluon.GLUON_HEAD_DIMS
    num_q_heads, num_kv_heads, head_map = HEADS[heads]
    q, k, v, qsl = _inputs(num_q_heads, num_kv_heads, dtype, head_dim=head_dim)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    assert plan_chunk(q, k, v, out, lse, qsl, max(LENS), scale=0.1, **head_map).kernel.__name__ == \
        "gluon_chunk_kernel"
    out, lse = _run(q, k, v, qsl, head_map, dtype)
    total = int(qsl[-1])
    want_out, want_lse = reference.chunk_attention(q[:total].double(), k[:total].double(), v[:total].double(), qsl,
                                                   max(LENS), scale=0.1, **head_map)
    assert_matches(out[:total], want_out, dtype, "out")
    assert_matches(lse[:total], want_lse, dtype, "lse")
    assert (out[total:] == 0).all() and (lse[total:] == float("-inf")).all(), "padding rows"


@pytest.mark.parametrize(("producer_fix", "overlap"), [(False, False), (True, False), (False, True), (True, True)],
                         ids=["consumer-copies", "producer-fix-3-stages", "consumer-copies-overlap",
                              "producer-fix-3-stages-overlap"])
def test_a_requests_nan_stays_in_it(producer_fix, overlap):
    """Request 4 (128 rows) holds NaN in K and V: its own rows turn NaN, every other request matches float64; request
    3's last key tile (127 rows from row 82) reads request 4's first row. Whichever warp zeroes those rows: each
    consumer into its own copy, or the producer in place (``PRODUCER_FIX``, three stages); each tile's steps in turn,
    or in FA3's order (``OVERLAP``; with the producer's fix, the default)."""
    num_q_heads, num_kv_heads, head_map = HEADS["32q8kv"]
    q, k, v, qsl = _inputs(num_q_heads, num_kv_heads, torch.bfloat16)
    lo, hi = int(qsl[4]), int(qsl[5])
    clean_k, clean_v = k.clone(), v.clone()
    k[lo:hi] = float("nan")
    v[lo:hi] = float("nan")
    out, lse = poisoned(q.shape, torch.bfloat16, "cuda"), poisoned(q.shape[:2], torch.float32, "cuda")
    plan_gluon_chunk(q, k, v, out, lse, qsl, scale=0.1, **head_map, stages=3 if producer_fix else 2,
                     producer_fix=producer_fix, overlap=overlap)(q, k, v, out, lse, qsl)
    total = int(qsl[-1])
    want_out, want_lse = reference.chunk_attention(q[:total].double(), clean_k[:total].double(),
                                                   clean_v[:total].double(), qsl, max(LENS), scale=0.1, **head_map)
    others = torch.ones(total, dtype=torch.bool, device="cuda")
    others[lo:hi] = False
    assert_matches(out[:total][others], want_out[others], torch.bfloat16, "out")
    assert_matches(lse[:total][others], want_lse[others], torch.bfloat16, "lse")
    assert out[lo:hi].isnan().all(), "the request's own NaN"


def test_cuda_graph_replay():
    num_q_heads, num_kv_heads, head_map = HEADS["32q8kv"]
    q, k, v, qsl = _inputs(num_q_heads, num_kv_heads, torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    launch = plan_chunk(q, k, v, out, lse, qsl, max(LENS), scale=0.1, **head_map)
    launch(q, k, v, out, lse, qsl)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(q, k, v, out, lse, qsl)
    total = int(qsl[-1])
    q.copy_(torch.randn_like(q))
    k[:total] = torch.randn_like(k[:total])
    qsl.copy_(torch.tensor([0, 1, 300, 301, 400, 1000, 1100, 1500, total], dtype=torch.int32, device="cuda"))
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    want_out, want_lse = reference.chunk_attention(q[:total].double(), k[:total].double(), v[:total].double(), qsl,
                                                   max(LENS), scale=0.1, **head_map)
    assert_matches(out[:total], want_out, torch.bfloat16, "out")
    assert_matches(lse[:total], want_lse, torch.bfloat16, "lse")


@pytest.mark.parametrize("first_row", [0, 200], ids=["first0", "first200"])
@pytest.mark.parametrize(("order", "stages", "producer_fix", "overlap"),
                         [(ROUND_ROBIN, 2, False, False), (SNAKE, 2, False, False), (PAIRS, 2, False, False),
                          (PAIRS, 3, True, False), (SNAKE, 2, False, True), (PAIRS, 3, True, True)],
                         ids=["round-robin", "snake", "pairs", "pairs-3-stages-producer-fix", "snake-overlap",
                              "pairs-3-stages-producer-fix-overlap"])
def test_every_tile_order_matches_float64(order, stages, producer_fix, overlap, first_row):
    """Every way of dealing the tiles (``gluon_chunk.ORDER``), the V rows past a request zeroed by the producer in
    place (``PRODUCER_FIX``, three stages), and FA3's order inside a warpgroup (``OVERLAP``: the softmax under the
    previous tile's P x V, 0 to 7 key tiles before a block's diagonal) compute the same attention: the requests hold
    one to eight 128-row blocks (300 rows: a pair and its middle block alone), the rows after them NaN K/V, and with
    ``first_row`` rows before the first request (a mixed step's chunk after its decodes), which no tile may write."""
    num_q_heads, num_kv_heads, head_map = HEADS["32q8kv"]
    q, k, v, qsl = _inputs(num_q_heads, num_kv_heads, torch.bfloat16, seed=3)
    if first_row:
        def lead(t, fill):
            return torch.cat([torch.full((first_row, *t.shape[1:]), fill, dtype=t.dtype, device="cuda"), t])
        q, k, v, qsl = lead(q, 0.0), lead(k, float("nan")), lead(v, float("nan")), qsl + first_row
    out, lse = poisoned(q.shape, torch.bfloat16, "cuda"), poisoned(q.shape[:2], torch.float32, "cuda")
    plan_gluon_chunk(q, k, v, out, lse, qsl, scale=0.1, **head_map, order=order, stages=stages,
                     producer_fix=producer_fix, overlap=overlap)(q, k, v, out, lse, qsl)
    total = int(qsl[-1])
    want_out, want_lse = reference.chunk_attention(q[first_row:total].double(), k[first_row:total].double(),
                                                   v[first_row:total].double(), qsl - first_row, max(LENS),
                                                   scale=0.1, **head_map)
    assert_matches(out[first_row:total], want_out, torch.bfloat16, "out")
    assert_matches(lse[first_row:total], want_lse, torch.bfloat16, "lse")
    assert out[:first_row].isnan().all() and lse[:first_row].isnan().all(), "rows before the first request"
    assert (out[total:] == 0).all() and (lse[total:] == float("-inf")).all(), "padding rows"
