"""A prepared launch replays its compiled kernel directly (``Launch``, FAST_LAUNCH): bit for bit what Triton's own
dispatch gives, on other layers' tensors too, and it falls back to the dispatch when a tensor's alignment differs
from the one the kernel was compiled for (Triton specializes on it)."""

from __future__ import annotations

import pytest
import torch

from dcp_plugin import kernels
from dcp_plugin.kernels import _launch, reference
from tests.helpers.kernel_checks import assert_matches, poisoned

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

D, PAGE, HQ, HK = 128, 16, 8, 1


def layer(gen, num_reqs: int, ctx: int, *, offset: int = 0):
    """One layer's decode inputs; ``offset`` elements shift q off its 16-byte alignment."""
    width = -(-ctx // PAGE)
    buf = torch.randn(num_reqs * width, PAGE, HK, 2 * D, generator=gen, device="cuda").to(torch.bfloat16)
    table = torch.randperm(num_reqs * width, generator=gen, device="cuda").to(torch.int32).view(num_reqs, width)
    lens = torch.randint(1, ctx + 1, (num_reqs,), generator=gen, device="cuda", dtype=torch.int32)
    flat = torch.randn(num_reqs * HQ * D + offset, generator=gen, device="cuda").to(torch.bfloat16)
    q = flat[offset:].view(num_reqs, HQ, D)
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32, device="cuda")
    return q, buf[..., :D], buf[..., D:], table, lens, qsl


def plan_for(args, out, lse, *, splits=None):
    return kernels.plan_prefix(*args, out, lse, scale=D ** -0.5, q_head_start=0, q_per_kv=HQ, kv_head_start=0,
                               max_kv_len=int(args[4].max()), max_query_len=1, num_splits=splits)


def reference_out(args):
    q, kc, vc, table, lens, qsl = args
    return reference.prefix_attention(q.double(), kc.double(), vc.double(), table, lens, qsl, scale=D ** -0.5,
                                      q_head_start=0, q_per_kv=HQ, kv_head_start=0, max_kv_len=int(lens.max()))


@pytest.mark.parametrize("splits", [1, 6], ids=["one-split", "split-merge"])
def test_replayed_launches_match_the_dispatch_bit_for_bit(splits, monkeypatch):
    assert _launch.FAST_LAUNCH, f"the fast launch path is off on triton {_launch.triton.__version__}"
    gen = torch.Generator(device="cuda").manual_seed(1)
    layers = [layer(gen, 12, 700) for _ in range(3)]
    out, lse = poisoned((12, HQ, D), torch.bfloat16, "cuda"), poisoned((12, HQ), torch.float32, "cuda")
    fast = plan_for(layers[0], out, lse, splits=splits)
    fast_results = []
    for args in layers:
        out.fill_(float("nan"))
        fast(*args, out, lse)
        fast_results.append(out.clone())
        assert_matches(out, reference_out(args)[0], torch.bfloat16, "replayed launch")
    assert fast.stage1._compiled is not None, "the plan never kept its compiled kernel"
    monkeypatch.setattr(_launch, "FAST_LAUNCH", False)
    slow = plan_for(layers[0], out, lse, splits=splits)
    for args, want in zip(layers, fast_results):
        out.fill_(float("nan"))
        slow(*args, out, lse)
        assert torch.equal(out, want), "the replayed kernel differs from Triton's dispatch"
    assert slow.stage1._compiled is None


def test_a_misaligned_tensor_goes_back_through_the_dispatch():
    gen = torch.Generator(device="cuda").manual_seed(2)
    aligned, shifted = layer(gen, 5, 300), layer(gen, 5, 300, offset=1)
    assert shifted[0].data_ptr() % 16 != 0
    out, lse = poisoned((5, HQ, D), torch.bfloat16, "cuda"), poisoned((5, HQ), torch.float32, "cuda")
    plan = plan_for(aligned, out, lse, splits=1)
    plan(*aligned, out, lse)
    compiled = plan.stage1._compiled
    for args in (shifted, aligned):
        out.fill_(float("nan"))
        plan(*args, out, lse)
        assert_matches(out, reference_out(args)[0], torch.bfloat16, "after an alignment change")
    assert plan.stage1._compiled is compiled, "the kept kernel must stay the one compiled for aligned tensors"


def test_a_plan_built_again_replays_the_first_plans_kernels_from_its_first_call(monkeypatch):
    """A second plan of the same shapes (a repeated one-shot call, the next step's plan) replays, from its first
    call, the kernels the first plan's dispatch returned (``_launch._COMPILED``): no dispatch, the same answer."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    args = layer(gen, 7, 500)
    out, lse = poisoned((7, HQ, D), torch.bfloat16, "cuda"), poisoned((7, HQ), torch.float32, "cuda")
    first = plan_for(args, out, lse, splits=4)
    first(*args, out, lse)
    want = out.clone()

    def no_dispatch(*_, **__):
        raise AssertionError("a plan built again went through Triton's dispatch")

    second = plan_for(args, out, lse, splits=4)
    for launch in (second.stage1, second.merge):  # kernel[grid](...) ends in the JIT function's run: its dispatch
        monkeypatch.setattr(launch.kernel, "run", no_dispatch)
    out.fill_(float("nan"))
    second(*args, out, lse)
    assert second.stage1._compiled is first.stage1._compiled and second.merge._compiled is first.merge._compiled
    assert torch.equal(out, want)
    assert_matches(out, reference_out(args)[0], torch.bfloat16, "a plan built again")
