"""The Gluon decode (``dcp_plugin.kernels.gluon_decode``) as ``prefix_attention`` runs it on an sm_90 GPU with Triton
3.6 and ``DCP_TRITON_GLUON=1``: selected for a decode over 64-token pages with more than ``GLUON_DECODE_MIN_KV_GROUP``
Q heads per KV group, and equal to float64 attention there: contexts of 0 to 3,000 tokens in caches whose other
rows are NaN, one split, three and the automatic count (the partials merged by the ``tl`` merge), plain and
rank-major outputs, head maps with offsets and groups wider than one tile, rows before the first request untouched
by one split (several: the merge writes every row, as the ``tl`` kernel's), padding rows after the last (0, -inf),
CUDA graph replay, and 1-5 programs over all the work items (groups of 4 and 5 among them)."""

from __future__ import annotations

import pytest
import torch

from dcp_plugin.kernels import reference
from dcp_plugin.kernels._gluon import GLUON_DECODE_MIN_KV_GROUP, GLUON_ENV, gluon_supported
from dcp_plugin.kernels.prefix_attention import prefix_attention, plan_prefix
from dcp_plugin.testing import shuffled_block_table
from tests.helpers.kernel_checks import assert_matches, poisoned

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not gluon_supported(torch.device("cuda")),
                       reason="needs an sm_90 GPU and Triton 3.6 (the Gluon kernels)"),
]

PAGE, PAD = 64, 5
CTX = [0, 1, 63, 64, 65, 129, 700, 3000]  # none, one token, page edges, a key tile and one, many tiles
# name -> (local Q heads, stored KV heads, head map): a KV group of 32; one of 128 (two tiles of 64 heads); a rank's
# 24 Q heads from the middle of two KV groups of 32 (heads 20..43); a rank's 24 of the second KV group (heads
# 40..63) over KV head 1 stored alone. Every layout has more than GLUON_DECODE_MIN_KV_GROUP local heads in a KV group.
HEADS = {"32q1kv": (32, 1, dict(q_head_start=0, q_per_kv=32, kv_head_start=0)),
         "128q1kv": (128, 1, dict(q_head_start=0, q_per_kv=128, kv_head_start=0)),
         "24of64q-2kv": (24, 2, dict(q_head_start=20, q_per_kv=32, kv_head_start=0)),
         "24of64q-kv1": (24, 1, dict(q_head_start=40, q_per_kv=32, kv_head_start=1))}


@pytest.fixture(autouse=True)
def gluon_on(monkeypatch):
    monkeypatch.setenv(GLUON_ENV, "1")


def _inputs(*, num_q_heads, num_kv_heads, dtype, first_row=0, head_dim=128, seed=0):
    """One query row a request after ``first_row`` rows of others, ``PAD`` rows after the last; caches of NaN but at
    each request's cached tokens (views of one ``[..., 2 * D]`` buffer), pages shuffled, unused entries on a NaN
    page."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = [-(-c // PAGE) for c in CTX]
    buf = torch.full((sum(pages) + 1, PAGE, num_kv_heads, 2 * head_dim), float("nan"), dtype=dtype, device="cuda")
    table = shuffled_block_table(pages, generator=gen)
    for b, n in enumerate(CTX):
        pos = torch.arange(n, device="cuda")
        buf[table[b, pos // PAGE].long(), pos % PAGE] = torch.randn(n, num_kv_heads, 2 * head_dim, generator=gen,
                                                                    device="cuda").to(dtype)
    qsl = torch.arange(first_row, first_row + len(CTX) + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(int(qsl[-1]) + PAD, num_q_heads, head_dim, generator=gen, device="cuda").to(dtype)
    return (q, buf[..., :head_dim], buf[..., head_dim:], table, torch.tensor(CTX, dtype=torch.int32, device="cuda"),
            qsl)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A rank-major ``[R, T, H / R, ...]`` tensor as ``[T, H, ...]``."""
    return t.transpose(0, 1).reshape(t.shape[1], t.shape[0] * t.shape[2], *t.shape[3:])


def _kernel(num_q_heads, num_kv_heads, head_map):
    q, kc, vc, table, lens, qsl = _inputs(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    return plan_prefix(q, kc, vc, table, lens, qsl, out, lse, scale=0.1, **head_map, max_kv_len=max(CTX),
                       max_query_len=1).stage1.kernel.__name__


def test_selected_for_wide_groups_only():
    kv_group = GLUON_DECODE_MIN_KV_GROUP
    wide = dict(q_head_start=0, q_per_kv=kv_group + 1, kv_head_start=0)
    assert _kernel(kv_group + 1, 1, wide) == "gluon_decode_kernel"
    assert _kernel(kv_group, 1, dict(q_head_start=0, q_per_kv=kv_group, kv_head_start=0)) == "prefix_attention_kernel"


@pytest.mark.parametrize("head_dim", [128, 64], ids=["d128", "d64"])
@pytest.mark.parametrize("num_splits", [1, 3, None], ids=["split1", "split3", "auto"])
@pytest.mark.parametrize("first_row", [0, 7], ids=["first0", "first7"])
@pytest.mark.parametrize("rank_major", [False, True], ids=["plain", "rank-major"])
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_matches_float64(dtype, heads, rank_major, first_row, num_splits, head_dim):
    num_q_heads, num_kv_heads, head_map = HEADS[heads]
    q, kc, vc, table, lens, qsl = _inputs(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, dtype=dtype,
                                          first_row=first_row, head_dim=head_dim)
    ranks = 2 if rank_major else 1
    out = poisoned((ranks, q.shape[0], num_q_heads // ranks, head_dim) if rank_major else q.shape, dtype, "cuda")
    lse = poisoned((ranks, q.shape[0], num_q_heads // ranks) if rank_major else q.shape[:2], torch.float32, "cuda")
    kw = dict(scale=0.1, **head_map, max_kv_len=max(CTX), max_query_len=1, num_splits=num_splits)
    plan = plan_prefix(q, kc, vc, table, lens, qsl, out, lse, **kw)
    assert plan.stage1.kernel.__name__ == "gluon_decode_kernel"
    prefix_attention(q, kc, vc, table, lens, qsl, out=out, lse=lse, **kw)
    got_out, got_lse = (_plain(out), _plain(lse)) if rank_major else (out, lse)
    want_out, want_lse = reference.prefix_attention(q[first_row:].double(), kc.double(), vc.double(), table, lens,
                                                    qsl - first_row, scale=0.1, **head_map, max_kv_len=max(CTX))
    assert_matches(got_out[first_row:], want_out, dtype, "out")
    assert_matches(got_lse[first_row:], want_lse, dtype, "lse")
    if plan.num_splits == 1:  # with splits the merge writes every row (the DCP core launches decodes last)
        assert got_out[:first_row].isnan().all() and got_lse[:first_row].isnan().all(), "rows before the first"
    assert (got_out[-PAD:] == 0).all() and (got_lse[-PAD:] == float("-inf")).all(), "padding rows"


@pytest.mark.parametrize("num_splits", [1, 4], ids=["split1", "split4"])
def test_cuda_graph_replay(num_splits):
    num_q_heads, num_kv_heads, head_map = HEADS["32q1kv"]
    q, kc, vc, table, lens, qsl = _inputs(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    launch = plan_prefix(q, kc, vc, table, lens, qsl, out, lse, scale=0.1, **head_map, max_kv_len=max(CTX),
                         max_query_len=1, num_splits=num_splits)
    assert launch.stage1.kernel.__name__ == "gluon_decode_kernel"
    launch(q, kc, vc, table, lens, qsl, out, lse)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(q, kc, vc, table, lens, qsl, out, lse)
    q.copy_(torch.randn_like(q))
    lens.copy_(torch.tensor([0, 1, 10, 1, 65, 128, 699, 2000], device="cuda"))  # within each request's tokens
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    want_out, want_lse = reference.prefix_attention(q.double(), kc.double(), vc.double(), table, lens, qsl,
                                                    scale=0.1, **head_map, max_kv_len=max(CTX))
    assert_matches(out, want_out, torch.bfloat16, "out")
    assert_matches(lse, want_lse, torch.bfloat16, "lse")


SMALL_KV_GROUPS = {"32q8kv": (32, 8, dict(q_head_start=0, q_per_kv=4, kv_head_start=0)),
                   "40q8kv": (40, 8, dict(q_head_start=0, q_per_kv=5, kv_head_start=0))}


@pytest.mark.parametrize("programs", [1, 2, 5])
@pytest.mark.parametrize("num_splits", [1, 3], ids=["split1", "split3"])
@pytest.mark.parametrize("heads", sorted(HEADS) + sorted(SMALL_KV_GROUPS))
def test_programs_that_loop_over_items(heads, num_splits, programs):
    """A program per SM takes many work items in turn (its copies for one item run under the previous item's
    work): here 1, 2 or 5 programs over all the items, so every item boundary, ring wrap and last-tile fix is met
    within one program; small KV groups too (a benchmark can ask for the kernel at any KV group size)."""
    num_q_heads, num_kv_heads, head_map = {**HEADS, **SMALL_KV_GROUPS}[heads]
    q, kc, vc, table, lens, qsl = _inputs(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, dtype=torch.bfloat16,
                                          first_row=7)
    out, lse = poisoned(q.shape, q.dtype, "cuda"), poisoned(q.shape[:2], torch.float32, "cuda")
    plan = plan_prefix(q, kc, vc, table, lens, qsl, out, lse, scale=0.1, **head_map, max_kv_len=max(CTX),
                       max_query_len=1, num_splits=num_splits, gluon_decode=(1, 4, programs))
    assert plan.stage1.kernel.__name__ == "gluon_decode_kernel" and plan.stage1.grid[0] == programs
    plan(q, kc, vc, table, lens, qsl, out, lse)
    want_out, want_lse = reference.prefix_attention(q[7:].double(), kc.double(), vc.double(), table, lens, qsl - 7,
                                                    scale=0.1, **head_map, max_kv_len=max(CTX))
    assert_matches(out[7:], want_out, torch.bfloat16, "out")
    assert_matches(lse[7:], want_lse, torch.bfloat16, "lse")
    assert (out[-PAD:] == 0).all() and (lse[-PAD:] == float("-inf")).all(), "padding rows"
