"""VllmDcpGroup: the collectives into caller buffers go through vLLM's NCCL communicator when it has one (and it
is enabled), else through torch.distributed; the all-to-all is one grouped send/receive per peer. Micro-batching
is refused at startup."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from dcp_plugin.adapters.vllm import topology  # noqa: E402


class FakePyNccl:
    """Records calls; emulates rank 0 of 2 with a peer that holds ``peer_value`` everywhere."""

    def __init__(self, disabled=False) -> None:
        self.disabled, self.calls, self.pending = disabled, [], []

    def all_gather(self, out, t):
        self.calls.append("all_gather")
        out.view(2, -1)[0].copy_(t.reshape(-1))
        out.view(2, -1)[1].fill_(7)

    def reduce_scatter(self, out, t):
        self.calls.append("reduce_scatter")
        out.view(-1).copy_(t.reshape(2, -1)[0] + 7)

    def group_start(self):
        self.calls.append("group_start")

    def send(self, t, peer):
        self.calls.append(f"send {peer} {tuple(t.shape)}")

    def recv(self, t, peer):
        self.calls.append(f"recv {peer} {tuple(t.shape)}")
        t.fill_(peer)

    def group_end(self):
        self.calls.append("group_end")


def coordinator(nccl):
    return SimpleNamespace(world_size=2, rank_in_group=0, device_group=None,
                           device_communicator=SimpleNamespace(pynccl_comm=nccl))


@pytest.fixture
def no_torch_group(monkeypatch):
    monkeypatch.setattr(topology, "TorchDcpGroup", lambda group: SimpleNamespace(
        all_gather_into=lambda out, t: out.fill_(-1), reduce_scatter_into=lambda out, t: out.fill_(-1),
        all_to_all_into=lambda out, t: out.fill_(-1)))


def test_collectives_use_vllms_nccl_communicator(no_torch_group):
    nccl = FakePyNccl()
    group = topology.VllmDcpGroup(coordinator(nccl))
    assert group.uses_nccl and (group.world_size, group.rank_in_group) == (2, 0)
    t = torch.arange(6.0).view(3, 2)
    out = torch.empty(6, 2)
    group.all_gather_into(out, t)
    assert torch.equal(out[:3], t) and (out[3:] == 7).all()
    mine = torch.empty(3, 2)
    group.reduce_scatter_into(mine, torch.ones(6, 2))
    assert (mine == 8).all()
    recv = torch.empty(2, 4, 5)
    group.all_to_all_into(recv, torch.zeros(2, 4, 5))
    assert nccl.calls[2:] == ["group_start", "send 0 (1, 4, 5)", "recv 0 (1, 4, 5)", "send 1 (1, 4, 5)",
                              "recv 1 (1, 4, 5)", "group_end"]
    assert torch.equal(recv[1], torch.ones(4, 5)) and torch.equal(recv[0], torch.zeros(4, 5))


@pytest.mark.parametrize("nccl", [None, FakePyNccl(disabled=True)], ids=["none", "disabled"])
def test_without_an_enabled_communicator_torch_distributed_serves(no_torch_group, nccl):
    group = topology.VllmDcpGroup(coordinator(nccl))
    assert not group.uses_nccl
    out = torch.zeros(4)
    group.all_gather_into(out, torch.ones(2))
    assert (out == -1).all()
    assert nccl is None or nccl.calls == []
