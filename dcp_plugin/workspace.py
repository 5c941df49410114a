"""Scratch memory of DCP attention, allocated once and shared by every layer, so a step allocates nothing."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from dcp_plugin.checks import check_int
from dcp_plugin.layout import HeadLayout

_ALIGN = 16  # elements: every buffer starts, and every packed row is, a multiple of 16 elements


class DcpWorkspace:
    """Every intermediate tensor of ``DcpAttention.forward`` for steps of up to ``max_num_tokens`` tokens.

    Layers run one after another on one stream, so one workspace serves all the layers of a worker that share its
    head layout, head size, dtype and comm mode (an engine running two micro-batches at once needs one each).
    Allocate it before the engine measures its memory (vLLM: at model construction) so the engine counts it.

    Per step of ``T`` tokens, with ``H`` local Q heads, ``Hg = N * H`` gathered heads, head size ``D``:
    the current chunk (``[T, H, D]`` + LSE); at DCP = 1 the prefix partial in float32; at DCP > 1 the gathered
    queries (``[Hg, T, D]``, head-major so the all-gather is one contiguous copy per rank), and for ``ag_rs`` the
    prefix partial ``[T, Hg, D]`` in the model dtype, its LSEs from every rank, the rescaled partial ``[N, T, H, D]``
    (rank-major: the reduce-scatter's input) and its result; for ``a2a`` the send and receive buffers
    ``[N, T, W]`` packing each token's ``H`` outputs and their float32 LSEs (``W``: a multiple of 16 elements); and
    the split-KV partials (``split_elements`` floats, see ``dcp_plugin.kernels.split_capacity``).

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
        sizes = {"cur_out": (t * h * d, dtype), "lse": (t * h, torch.float32), "cur_lse": (t * h, torch.float32),
                 "splits": (split_elements, torch.float32)}
        if n == 1:
            sizes.update(pre_out=(t * h * d, torch.float32), pre_lse=(t * h, torch.float32))
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

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_num_tokens

    def views(self, num_tokens: int) -> SimpleNamespace:
        """This step's tensors (contiguous views of the buffers' first elements), by name."""
        t, h, d, n = num_tokens, self.heads.num_q_heads, self.head_dim, self.heads.dcp_size
        b = self.buffers
        v = SimpleNamespace(cur_out=_view(b["cur_out"], t, h, d), cur_lse=_view(b["cur_lse"], t, h),
                            lse=_view(b["lse"], t, h), splits=b["splits"] if b["splits"].numel() else None)
        if n == 1:
            v.pre_out, v.pre_lse = _view(b["pre_out"], t, h, d), _view(b["pre_lse"], t, h)
            return v
        hg = self.heads.num_group_q_heads
        v.q_send, v.q_all = _view(b["q_send"], h, t, d), _view(b["q_all"], hg, t, d)
        if self.comm == "a2a":
            w = self.packed_width
            v.send, v.recv = _view(b["send"], n, t, w), _view(b["recv"], n, t, w)
            v.send_out, v.send_lse = unpack(v.send, h, d)
            v.recv_out, v.recv_lse = unpack(v.recv, h, d)
        else:
            v.part, v.part_lse = _view(b["part"], t, hg, d), _view(b["part_lse"], t, hg)
            v.lse_all, v.scaled = _view(b["lse_all"], n, t, hg), _view(b["scaled"], n, t, h, d)
            v.lse_total, v.mine = _view(b["lse_total"], t, hg), _view(b["mine"], t, h, d)
        return v


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
