"""The launch constants of ``prefix_attention``'s ``tl`` kernel: the tuning table by head size and variant, the
descriptor and pointer alternatives, and the check of a caller's own ``PrefixConfig`` (benchmarks sweep others).
Each entry's comment names the measurement that chose it."""

from __future__ import annotations

import dataclasses

import torch

from dcp_plugin.kernels._mode import INTERPRET
from dcp_plugin.kernels.checks import env_choice


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixConfig:
    block_n: int  # KV tokens per tile; split boundaries are multiples of it
    block_m: int  # most rows (query tokens x Q heads of one KV group) per tile
    num_warps: int
    num_stages: int
    tma: bool = False  # on sm_90+, whole tiles of one page through tensor descriptors where the cache allows
    rows_ahead: bool = False  # with tma: the tiles' descriptor rows read a chunk ahead (_prefix_tile.TMA_CHUNK)
    min_rows: int = 16  # rows a tile has at least (Q heads past the group masked); 64: warpgroup MMAs on sm_90
    # An fp8 cache's tiles widened to fp16 before their shared-memory round trip (``_prefix_tile.widen_fp8``): 0 none
    # (V then reaches P x V a byte at a time), 1 V, 2 K and V. Other caches ignore it.
    fp8_widen: int = 0
    max_registers: int = 0  # a cap on registers per thread (Triton's maxnreg), for more programs per SM; 0: none
    # A balanced decode's splits merged by the last of them to finish (``LAST_MERGES``), not by a second launch.
    last_split_merges: bool = False
    # Over an e4m3 cache, the prefix pass's products in fp8 on the tensor cores, as FA3 runs them (``FP8_DOT``): 0
    # none (the tiles widened to 16 bits), 1 Q x K (each program's q scaled by a power of two into e4m3), 2 P x V
    # too (P in e4m3). None: ``$DCP_TRITON_FP8_DOT`` (``fp8_dot_asked``, default 0). Other caches ignore it, and so
    # does decode: compiled for sm_90 (Triton 3.9, scripts/compile_for_hopper.py) its loop was the same with 1 and
    # longer with 2 (byte-wide shared loads), where the prefix pass's took fewer MMAs and less shared memory.
    fp8_dot: int | None = None


# (padded head dim, decode) -> launch constants for Hopper; benchmarks sweep others via ``config=``. "decode" = the
# caller promised one query row per request (max_query_len=1). D=128 decode: 128-token tiles (H200, bf16: 1.1-1.3x
# the GB/s of 64-token tiles with one KV head per rank, e.g. 32 x 8K 2631 against 2037, within 3% elsewhere;
# docs/kernels.md, decode); over an fp8 cache V widened to fp16 before its shared-memory
# round trip (``fp8_widen=1``): 38.1 / 67.0 / 206.4 / 771.6 us at 1 x 32K / 8 x 8K / 8 x 32K / 128 x 8K (32 Q / 8 KV,
# 64-token pages) against 40.9 / 73.7 / 232.5 / 873.1 with V read a byte at a time; K widened too (2) was slower:
# 100.5 KiB of shared memory, two programs an SM (docs/kernels.md, fp8 decode).
# Longer queries (the prefix pass, 32 Q / 8 KV heads; on sm_90 with Triton 3.6 ``gluon_prefix`` takes one-split
# prefill steps over 64-token pages instead): pages of 64+, 128-row tiles of 64 tokens through tensor descriptors,
# four warps, two stages, the rows read a chunk ahead:
# 528 / 517 TFLOP/s at 2 x 4K rows over 32K cached / 1 x 2K over 128K, against 501 / 500 with each row read in
# the loop (pointer loads' best: 372 / 390); smaller pages (or strides descriptors refuse): ``POINTER_CONFIGS``,
# 256-row tiles of 64 tokens, eight warps, 375 / 394 over 16-token pages (docs/kernels.md, prefix pass).
GPU_CONFIGS = {
    (64, True): PrefixConfig(block_n=64, block_m=64, num_warps=4, num_stages=3, last_split_merges=True),
    (64, False): PrefixConfig(block_n=64, block_m=128, num_warps=4, num_stages=3),
    (128, True): PrefixConfig(block_n=128, block_m=64, num_warps=4, num_stages=3, fp8_widen=1,
                              last_split_merges=True),
    (128, False): PrefixConfig(block_n=64, block_m=128, num_warps=4, num_stages=2, tma=True, rows_ahead=True),
    (256, True): PrefixConfig(block_n=64, block_m=64, num_warps=4, num_stages=2, last_split_merges=True),
    (256, False): PrefixConfig(block_n=64, block_m=64, num_warps=8, num_stages=2),
}
# A table entry that asks for tensor descriptors -> the constants for the same work through pointer loads.
POINTER_CONFIGS = {GPU_CONFIGS[128, False]: PrefixConfig(block_n=64, block_m=256, num_warps=8, num_stages=3)}
# Decode over pages of 64+ tokens, at most 16 Q heads per KV group, bf16/fp16 cache: 64-token descriptor tiles, four
# stages. H200, 32 Q / 8 KV, 64-token pages: 3,690 / 1,767 GB/s at 8 x 8K / 8 x 1K against 3,001 / 1,658 for the
# 128-token pointer tiles; with 32 Q heads per KV head those win (2,566 against 2,092 at 32 x 8K); rows read ahead
# and two warps lose (docs/kernels.md, decode).
# Capped at 128 registers (135 uncapped: three programs an SM, four capped): 45.7 / 76.3 / 982.9 us at 1 x 32K / 8 x
# 8K / 128 x 8K against 55.0 / 92.8 / 1,015.0 (32 Q / 8 KV; docs/kernels.md, fp8 decode).
DESCRIPTOR_DECODE_CONFIGS = {128: PrefixConfig(block_n=64, block_m=64, num_warps=4, num_stages=4, tma=True,
                                               max_registers=128, last_split_merges=True)}
# The same over an fp8 cache: six stages, V widened, 96 registers (four programs an SM, by shared memory). 32 Q / 8
# KV, 64-token pages: 36.3 / 57.0 / 179.7 / 664.8 us at 1 x 32K / 8 x 8K / 8 x 32K / 128 x 8K against 37.4 / 66.8 /
# 207.5 / 770.6 for the 128-token pointer tiles (V widened too), 20.3 against 18.5 at 8 x 1K
# (docs/kernels.md, fp8 decode).
FP8_DESCRIPTOR_DECODE_CONFIGS = {128: PrefixConfig(block_n=64, block_m=64, num_warps=4, num_stages=6, tma=True,
                                                   fp8_widen=1, max_registers=96, last_split_merges=True)}
DESCRIPTOR_DECODE_MAX_KV_GROUP = 16
# float32 tiles take twice the shared memory: 128-token prefix tiles do not fit (256 KiB of 227).
GPU_FP32_CONFIGS = {(128, False): PrefixConfig(block_n=64, block_m=128, num_warps=8, num_stages=3)}
INTERPRET_CONFIG = PrefixConfig(block_n=32, block_m=32, num_warps=1, num_stages=1)




def pick_config(head_dim: int, *, decode: bool, dtype: torch.dtype = torch.bfloat16,
                config: PrefixConfig | None = None) -> PrefixConfig:
    """The launch constants a call uses: ``config`` if given (validated), else the table entry for q's dtype."""
    if config is None:
        if INTERPRET:
            return INTERPRET_CONFIG
        key = (min(d for d, _ in GPU_CONFIGS if d >= head_dim), decode)
        return GPU_FP32_CONFIGS.get(key, GPU_CONFIGS[key]) if dtype == torch.float32 else GPU_CONFIGS[key]
    if not isinstance(config, PrefixConfig):
        raise ValueError(f"config must be a PrefixConfig, got {type(config).__name__}")
    for name in ("block_n", "block_m", "min_rows"):
        value = getattr(config, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"config.{name} must be a power of two >= 16 (tl.dot tiles), got {value}")
    if config.min_rows > config.block_m:
        raise ValueError(f"config.min_rows ({config.min_rows}) must be <= config.block_m ({config.block_m})")
    if config.fp8_widen not in (0, 1, 2):
        raise ValueError(f"config.fp8_widen must be 0 (none), 1 (V) or 2 (K and V), got {config.fp8_widen!r}")
    if config.fp8_dot not in (None, 0, 1, 2):
        raise ValueError(f"config.fp8_dot must be None (the environment's), 0 (none), 1 (Q x K) or 2 (Q x K and "
                         f"P x V), got {config.fp8_dot!r}")
    if config.max_registers and not 24 <= config.max_registers <= 255:
        raise ValueError(f"config.max_registers must be 0 (no cap) or 24..255, got {config.max_registers!r}")
    if config.num_warps < 1 or config.num_stages < 1:
        raise ValueError(f"config.num_warps and config.num_stages must be >= 1, got {config!r}")
    return config


FP8_DOT_ENV = "DCP_TRITON_FP8_DOT"


def fp8_dot_asked() -> int:
    """``$DCP_TRITON_FP8_DOT``: over an e4m3 cache, 0 (unset: the tiles widened to 16 bits for both products), 1
    (Q x K in fp8) or 2 (Q x K and P x V in fp8)."""
    return int(env_choice(FP8_DOT_ENV, {"0": "16-bit products", "1": "Q x K in fp8", "2": "Q x K and P x V in fp8"},
                          "0"))


def fp8_dot_for(config: PrefixConfig, cache_dtype: torch.dtype) -> int:
    """The ``FP8_DOT`` a launch takes: ``config.fp8_dot`` (the environment's where None) over an e4m3 cache, else 0
    (e5m2 caches and 16-bit caches keep 16-bit products)."""
    if cache_dtype != torch.float8_e4m3fn:
        return 0
    return fp8_dot_asked() if config.fp8_dot is None else config.fp8_dot

