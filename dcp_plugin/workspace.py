"""Scratch memory of DCP attention, allocated once and shared by every layer, so a step allocates nothing."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dcp_plugin.kernels.checks import check_int
from dcp_plugin.layout import HeadLayout

_ALIGN = 16  # elements: every buffer starts, and every packed row is, a multiple of 16 elements


@dataclass(frozen=True, slots=True, kw_only=True)
class StepViews:
    """One step's tensors that every flow has (``T`` tokens, ``H`` local Q heads, head size ``D``)."""

    chunk_out: torch.Tensor  # [T, H, D]: the current chunk's output (model dtype)
    chunk_lse: torch.Tensor  # [T, H]
    lse: torch.Tensor  # [T, H]: the LSE of the answer (computed, never returned)
    splits: torch.Tensor | None  # float32 split-KV partials of the prefix pass (None: no room reserved)
    split_sync: torch.Tensor | None  # int32 split counters of a decode whose last split merges, zero between launches


@dataclass(frozen=True, slots=True, kw_only=True)
class SingleRankViews(StepViews):
    """DCP = 1: the prefix pass's partial, in float32."""

    prefix_out: torch.Tensor  # [T, H, D]
    prefix_lse: torch.Tensor  # [T, H]


@dataclass(frozen=True, slots=True, kw_only=True)
class GatheredViews(StepViews):
    """DCP > 1 (``N`` ranks): this rank's queries head-major, and every rank's after the all-gather."""

    q_send: torch.Tensor  # [H, T, D]
    q_all: torch.Tensor  # [N * H, T, D]: rank r's heads in slice r, so the all-gather is one contiguous copy
    q_group: torch.Tensor  # q_all as [T, N * H, D], what the prefix pass reads


@dataclass(frozen=True, slots=True, kw_only=True)
class AgRsViews(GatheredViews):
    """``comm="ag_rs"``: the prefix partial of all ``N * H`` gathered heads (model dtype), every rank's LSEs, the
    partial rescaled rank-major (the reduce-scatter's input) and this rank's heads of the sum."""

    part: torch.Tensor  # [T, N * H, D]
    part_lse: torch.Tensor  # [T, N * H]
    lse_all: torch.Tensor  # [N, T, N * H]: every rank's part_lse
    scaled: torch.Tensor  # [N, T, H, D]: slice r holds rank r's heads
    lse_total: torch.Tensor  # [T, N * H]: the merged LSE of every gathered head
    mine: torch.Tensor  # [T, H, D]: this rank's slice of the reduce-scatter


@dataclass(frozen=True, slots=True, kw_only=True)
class A2aViews(GatheredViews):
    """``comm="a2a"``: the packed send and receive buffers ``[N, T, W]`` (a token's ``H`` outputs, then their
    float32 LSEs) and their unpacked views; slice r of the send buffer goes to rank r."""

    send: torch.Tensor
    recv: torch.Tensor
    send_out: torch.Tensor  # [N, T, H, D]: the prefix pass writes its rank-major partial here
    send_lse: torch.Tensor  # [N, T, H]
    recv_out: torch.Tensor  # [N, T, H, D]: rank r's partial for this rank's heads in slice r
    recv_lse: torch.Tensor  # [N, T, H]


class DcpWorkspace:
    """Every intermediate tensor of ``DcpAttention.forward`` for steps of up to ``max_num_tokens`` tokens.

    Layers run one after another on one stream, so one workspace serves all the layers of a worker that share its
    head layout, head size, dtype and comm mode (an engine running two micro-batches at once needs one each).
    Allocate it before the engine measures its memory (vLLM: at model construction) so the engine counts it.

    ``views(T)`` hands a step of ``T`` tokens its tensors: ``SingleRankViews`` at DCP = 1, ``AgRsViews`` or ``A2aViews``
    at DCP > 1 (their fields say what each holds), plus the split-KV partials (``split_elements`` floats, see
    ``dcp_plugin.kernels.split_capacity``).

    Example::

        ws = DcpWorkspace(heads=heads, head_dim=128, dtype=torch.bfloat16, device="cuda", max_num_tokens=8192,
                          comm="ag_rs", split_elements=kernels.split_capacity(128, torch.device("cuda")))
    """

    def __init__(self, *, heads: HeadLayout, head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 max_num_tokens: int, comm: str, split_elements: int = 0) -> None:
        for name, value, low in (("head_dim", head_dim, 1), ("max_num_tokens", max_num_tokens, 1),
                                 ("split_elements", split_elements, 0)):
            check_int(name, value, low=low)
        self.heads, self.head_dim, self.dtype, self.comm = heads, head_dim, dtype, comm
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # tensors report their index: compare equal
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_num_tokens = max_num_tokens
        t, h, d, n = max_num_tokens, heads.num_q_heads, head_dim, heads.dcp_size
        sizes = {"chunk_out": (t * h * d, dtype), "chunk_lse": (t * h, torch.float32), "lse": (t * h, torch.float32),
                 "splits": (split_elements, torch.float32)}
        if n == 1:
            sizes.update(prefix_out=(t * h * d, torch.float32), prefix_lse=(t * h, torch.float32))
        else:
            hg = heads.num_group_q_heads
            sizes.update(q_send=(h * t * d, dtype), q_all=(hg * t * d, dtype))
            if comm == "a2a":
                self.packed_width = packed_width(h, d, dtype)
                sizes.update(send=(n * t * self.packed_width, dtype), recv=(n * t * self.packed_width, dtype))
            else:
                sizes.update(part=(t * hg * d, dtype), part_lse=(t * hg, torch.float32),
                             lse_all=(n * t * hg, torch.float32), scaled=(n * t * h * d, dtype),
                             lse_total=(t * hg, torch.float32), mine=(t * h * d, dtype))
        self.buffers = {name: torch.empty(_round_up(size, _ALIGN), dtype=dt, device=self.device)
                        for name, (size, dt) in sizes.items()}
        # A decode's split counters (``plan_prefix``'s ``split_sync``): a (token, head program) each, at most a head
        # program per gathered Q head; zero once here, and every launch leaves them zero.
        if split_elements:
            self.buffers["split_sync"] = torch.zeros(t * heads.num_group_q_heads, dtype=torch.int32,
                                                     device=self.device)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_num_tokens

    def views(self, num_tokens: int) -> SingleRankViews | AgRsViews | A2aViews:
        """This step's tensors: contiguous views of the buffers' first elements."""
        t, h, d, n = num_tokens, self.heads.num_q_heads, self.head_dim, self.heads.dcp_size
        b = self.buffers
        common = dict(chunk_out=_view(b["chunk_out"], t, h, d), chunk_lse=_view(b["chunk_lse"], t, h),
                      lse=_view(b["lse"], t, h), splits=b["splits"] if b["splits"].numel() else None,
                      split_sync=b.get("split_sync"))
        if n == 1:
            return SingleRankViews(**common, prefix_out=_view(b["prefix_out"], t, h, d),
                              prefix_lse=_view(b["prefix_lse"], t, h))
        hg = self.heads.num_group_q_heads
        q_all = _view(b["q_all"], hg, t, d)
        common.update(q_send=_view(b["q_send"], h, t, d), q_all=q_all, q_group=q_all.transpose(0, 1))
        if self.comm == "a2a":
            send, recv = _view(b["send"], n, t, self.packed_width), _view(b["recv"], n, t, self.packed_width)
            (send_out, send_lse), (recv_out, recv_lse) = unpack(send, h, d), unpack(recv, h, d)
            return A2aViews(**common, send=send, recv=recv, send_out=send_out, send_lse=send_lse, recv_out=recv_out,
                            recv_lse=recv_lse)
        return AgRsViews(**common, part=_view(b["part"], t, hg, d), part_lse=_view(b["part_lse"], t, hg),
                         lse_all=_view(b["lse_all"], n, t, hg), scaled=_view(b["scaled"], n, t, h, d),
                         lse_total=_view(b["lse_total"], t, hg), mine=_view(b["mine"], t, h, d))


def packed_width(num_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Elements per token of an ``a2a`` buffer: ``num_heads`` outputs, then their float32 LSEs, padded to 16."""
    lse_elements = num_heads * 4 // torch.empty(0, dtype=dtype).element_size()
    return _round_up(num_heads * head_dim + lse_elements, _ALIGN)


def unpack(packed: torch.Tensor, num_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [N, T, H, D], lse [N, T, H] float32)`` views of an ``a2a`` buffer ``[N, T, W]``."""
    out = packed[:, :, :num_heads * head_dim].unflatten(2, (num_heads, head_dim))
    lse_start = num_heads * head_dim * packed.element_size() // 4
    return out, packed.view(torch.float32)[:, :, lse_start:lse_start + num_heads]


def _view(buffer: torch.Tensor, *shape: int) -> torch.Tensor:
    return buffer[:math.prod(shape)].view(shape)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
