"""Programmatic dependent launches (kernels/_pdl.py) on the GPU: on sm_90+ a decode layer's kernels (the cache write,
the split pass, the merge) are compiled and launched as such, and three layers of them back to back, eagerly and
replayed from a CUDA graph, give the outputs of the same kernels launched one after the other, bit for bit, and of
float64 attention over the cache the writes left."""

from __future__ import annotations

import pytest
import torch

from dcp_plugin.kernels import plan_write_kv, reference
from dcp_plugin.kernels._pdl import programmatic_launches
from dcp_plugin.kernels.prefix_attention import plan_prefix
from dcp_plugin.testing import shuffled_block_table
from tests.helpers.kernel_checks import assert_matches

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LAYERS = 3
# (contexts, Q heads, KV heads, page): one request of 1K (one merge launch), 8 of 1K (the last split merges),
# uneven contexts to 9K (balanced splits, a merge launch), 32 Q over one KV head (Gluon's decode on sm_90).
CASES = [([1000], 32, 8, 64), ([1000] * 8, 32, 8, 64), ([9000, 17, 4000, 1], 32, 8, 16), ([8000, 300], 32, 1, 64)]


def _layers(ctx_lens, hq, hk, page, dtype, seed):
    """Per layer: q, new k/v, a cache, its block table; and the shared lengths, query starts and slots."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = [-(-c // page) for c in ctx_lens]
    table = shuffled_block_table(pages, generator=gen, fill=0)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    qsl = torch.arange(len(ctx_lens) + 1, dtype=torch.int32, device="cuda")
    # Each request's newest token (position ctx - 1) is the one its step writes.
    slots = torch.tensor([int(table[b, (c - 1) // page]) * page + (c - 1) % page for b, c in enumerate(ctx_lens)],
                         dtype=torch.int64, device="cuda")
    layers = []
    for _ in range(LAYERS):
        q = torch.randn(len(ctx_lens), hq, 128, device="cuda", generator=gen).to(dtype)
        k, v = torch.randn(2, len(ctx_lens), hk, 128, device="cuda", generator=gen).to(dtype)
        cache = torch.randn(sum(pages), page, hk, 256, device="cuda", generator=gen).to(dtype)
        layers.append((q, k, v, cache))
    return layers, table, lens, qsl, slots


def _run(layers, table, lens, qsl, slots, *, pdl: bool, graph: bool):
    """Every layer's write then decode, with PDL on or off; returns the outputs and the caches written."""
    caches = [cache.clone() for *_, cache in layers]
    outs = [torch.full_like(q, float("nan")) for q, *_ in layers]
    lses = [torch.full(q.shape[:2], float("nan"), device="cuda") for q, *_ in layers]
    steps = []
    with programmatic_launches(pdl):
        for (q, k, v, _), cache, out, lse in zip(layers, caches, outs, lses):
            kc, vc = cache[..., :128], cache[..., 128:]
            write = plan_write_kv(k, v, kc, vc, slots)
            decode = plan_prefix(q, kc, vc, table, lens, qsl, out, lse, scale=128 ** -0.5, q_head_start=0,
                                 q_per_kv=q.shape[1] // kc.shape[2], kv_head_start=0, max_kv_len=int(lens.max()),
                                 max_query_len=1)
            steps.append((write, decode, q, k, v, kc, vc, out, lse))

    def run():
        for write, decode, q, k, v, kc, vc, out, lse in steps:
            write(k, v, kc, vc, slots, None, None)
            decode(q, kc, vc, table, lens, qsl, out, lse)

    if graph:
        run()  # compiled before the capture
        for t in (*outs, *lses):  # what the replay must write again
            t.fill_(float("nan"))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        g.replay()
    else:
        run()
    torch.cuda.synchronize()
    return outs, lses, caches, steps


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_decode_layers_with_pdl_equal_launches_one_after_the_other(case, graph):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    ctx_lens, hq, hk, page = CASES[case]
    layers, table, lens, qsl, slots = _layers(ctx_lens, hq, hk, page, torch.bfloat16, seed=case)
    outs, lses, caches, steps = _run(layers, table, lens, qsl, slots, pdl=True, graph=graph)
    # Launched as PDL, and compiled for it (the launcher reads launch_pdl from the compiled kernel's metadata).
    launches = [launch for write, decode, *_ in steps for launch in (write, decode.stage1, decode.merge) if launch]
    assert launches and all(launch.options.get("launch_pdl") is True for launch in launches)
    assert all(launch._compiled is None or launch._compiled.metadata.launch_pdl for launch in launches)
    base_outs, base_lses, base_caches, base_steps = _run(layers, table, lens, qsl, slots, pdl=False, graph=graph)
    assert not any(launch.options.get("launch_pdl") for _, decode, *_ in base_steps
                   for launch in (decode.stage1, decode.merge) if launch)
    for i, ((q, k, v, before), cache) in enumerate(zip(layers, caches)):
        want_cache = before.clone()
        want_cache.view(-1, hk, 256)[slots] = torch.cat([k, v], dim=-1)
        assert torch.equal(cache, want_cache) and torch.equal(base_caches[i], want_cache), f"layer {i}: cache"
        assert torch.equal(outs[i], base_outs[i]) and torch.equal(lses[i], base_lses[i]), f"layer {i} differs"
        kc, vc = cache[..., :128].double(), cache[..., 128:].double()
        want_out, want_lse = reference.prefix_attention(q.double(), kc, vc, table, lens, qsl, scale=128 ** -0.5,
                                                        q_head_start=0, q_per_kv=hq // hk, kv_head_start=0,
                                                        max_kv_len=int(lens.max()))
        assert_matches(outs[i], want_out, torch.bfloat16, f"layer {i} out")
        assert_matches(lses[i], want_lse, torch.bfloat16, f"layer {i} lse")
