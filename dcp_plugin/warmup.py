"""Compile every kernel variant a serving engine can need before it serves: one dummy step of each kind.

A step's kernels differ by kind (decode, short queries, long queries, no cached prefix, a mixed step whose leading
decodes run apart), by whether the KV cache is read in one split or several, on the GPU by whether a chunk passes
``SHORT_CHUNK`` rows (the current chunk's tiles), and by nothing else that changes between steps (the kernels do not
specialize on per-step sizes; where a step picks a variant by its sizes, as the split merge does by its split count,
the warm-up runs every variant: ``every_variant``). ``warm_up`` runs one step of each combination through
``DcpAttention.forward`` itself, on the layer's real KV cache and on scratch inputs with the real inputs' strides,
so Triton compiles exactly the variants later steps run. It writes nothing to the cache (every slot is -1) and reads
only page 0. At DCP > 1 it runs the collectives too: every rank of the group must call it at the same point.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from dcp_plugin.batch import DcpBatch, DcpBatchBuffers
from dcp_plugin.kernels import INTERPRET, compile_ahead, compile_workers, every_variant, join_early, launches_run, stand_by
from dcp_plugin.kernels.checks import FP8_DTYPES
from dcp_plugin.kernels.chunk_attention import SHORT_CHUNK
from dcp_plugin.kernels.fp8_prefill import COPY_MIN_ROWS, fp8_copy_asked

_log = logging.getLogger("dcp_plugin")

# (query rows, cached context) per request of each dummy step. A 4096-token context puts several KV splits on any
# GPU (the split count fills the SMs only while the tiles last); tiny contexts keep one split.
STEPS = (
    ((1, 1), (1, 2)),  # decode, one split
    ((1, 4096),),  # decode, several splits
    ((2, 1), (5, 3)),  # short queries (speculative verify), one split
    ((4, 4096),),  # short queries, several splits
    ((16, 1), (1, 0), (9, 2)),  # long queries mixed with a decode, one split
    ((12, 4096),),  # long queries, several splits
    ((16, 0), (3, 0)),  # no cached prefix anywhere: the current chunk only
    ((1, 1), (1, 2), (12, 3)),  # a mixed step, decodes first: their own decode launch (one split), then the rest
    ((1, 4096), (1, 4096), (4, 3)),  # the same with the decodes' contexts in several splits
)
LONG_CHUNK = ((SHORT_CHUNK + 1, 0),)  # a chunk past SHORT_CHUNK rows: the current chunk's larger tiles
TREE_VERIFY = ((3, 1), (3, 5))  # verify rows whose proposals form trees: the current chunk under a chunk_mask
# An fp8 cache's prefill steps through their 16-bit copy (``DCP_TRITON_FP8_PREFILL=copy``): the copy, and the pass
# over it in one split (the Gluon pass on sm_90) and in several.
FP8_COPY_STEPS = (((COPY_MIN_ROWS, 3),), ((COPY_MIN_ROWS, 4096),))


def steps_for(attention, *, trees: bool = False, fp8_copy: bool = False) -> tuple:
    """``STEPS``, ``TREE_VERIFY`` when an engine verifies draft trees (``trees``), and where a step can reach them
    (the GPU's Triton kernels: the interpreter and the torch references tile every step alike; and a workspace that
    holds the step, or none: the layer sizes its own) ``LONG_CHUNK`` and, over an fp8 cache whose prefill steps take
    the copy (``fp8_copy``), ``FP8_COPY_STEPS``."""
    workspace = attention.workspace
    steps = STEPS + ((TREE_VERIFY,) if trees else ())
    if attention.kernel_impl != "triton" or INTERPRET:
        return steps
    fits = lambda rows: workspace is None or workspace.fits(rows)  # noqa: E731
    return (*steps, *((LONG_CHUNK,) if fits(SHORT_CHUNK + 1) else ()),
            *(FP8_COPY_STEPS if fp8_copy and fits(COPY_MIN_ROWS) else ()))


def warmed_up_line(steps: int, seconds: float, dcp_size: int, dtype, compiles: dict | None = None,
                   ahead: dict | None = None) -> str:
    """The adapters' log line once a warm-up ran: its step kinds and seconds (its share of an engine's start),
    ``compiles`` (``counting_compiles``): kernel variants built here and those found in Triton's cache, and ``ahead``
    (``compile_ahead``'s report): variants the worker processes compiled first."""
    counted = "" if compiles is None else (f"; {compiles['built']} kernel variants built in "
                                           f"{compiles['build_s']:.1f} s, {compiles['cached']} from Triton's cache")
    for name, report in (("compile-ahead started early", (ahead or {}).get("early")), ("compile-ahead", ahead)):
        if report:
            counted += (f"; {name}: {report['variants']} variants, {report['missing']} not in Triton's cache, "
                        f"{report['compiled']} compiled by {report['workers']} worker processes"
                        + _times(report)
                        + (f", {report['failed']} failed: {report['reason']}" if report["failed"] else ""))
    return (f"dcp-triton: compiled the kernels of {steps} step kinds before serving in {seconds:.1f} s "
            f"(dcp_size={dcp_size}, {dtype}{counted})")


def _times(report: dict) -> str:
    """Where a compile-ahead's seconds went (its report's ``times``: the worker that finished last) and, for one
    started early, how long the warm-up still waited for it (``waited_s``)."""
    times, waited = report.get("times"), report.get("waited_s")
    text = "" if times is None else (
        f" in {times['end_s']:.1f} s (the last: started in {times['start_s']:.1f} s, "
        f"imports {times['imports_s']:.1f} s, compiles {times['compile_s']:.1f} s, "
        f"launchers {times['launcher_s']:.1f} s)")
    return text + ("" if waited is None else f", waited for {waited:.1f} s")


@contextlib.contextmanager
def counting_compiles():
    """Within: Triton's compiles counted (its compilation listener, beside any listener already set) -> the yielded
    ``{"built", "build_s", "cached"}``; a Triton without the listener counts nothing (``None``)."""
    import triton  # here, not at the top: the kernels' package decides the interpreter before triton loads

    knobs = getattr(triton, "knobs", None)
    compilation = getattr(knobs, "compilation", None)
    if compilation is None or not hasattr(compilation, "listener"):
        yield None
        return
    counts = {"built": 0, "build_s": 0.0, "cached": 0}
    before = compilation.listener

    def listener(*, src, metadata, metadata_group, times, cache_hit) -> None:
        counts["cached" if cache_hit else "built"] += 1
        if not cache_hit:
            counts["build_s"] += (getattr(times, "total", 0) or 0) / 1e6  # Triton gives microseconds
        if before is not None:
            before(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

    compilation.listener = listener
    try:
        yield counts
    finally:
        compilation.listener = before


def timed_warm_up(attention, *, dcp_size: int, trees: bool = False, **tensors) -> str:
    """``warm_up`` timed and its compiles counted: the adapters' log line (``warmed_up_line``)."""
    began, ahead = time.perf_counter(), {}
    with counting_compiles() as compiles:
        steps = warm_up(attention, report=ahead, trees=trees, **tensors)
    return warmed_up_line(steps, time.perf_counter() - began, dcp_size, tensors["query"].dtype, compiles, ahead)


def warm_up(attention, *, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
            value_cache: torch.Tensor, output: torch.Tensor, k_scale: torch.Tensor | None = None,
            v_scale: torch.Tensor | None = None, report: dict | None = None, trees: bool = False) -> int:
    """Run one dummy step of each kind in ``steps_for(attention, trees=trees)``; returns the number of steps run.

    ``query``/``key``/``value``/``output``: tensors shaped and strided like the layer's real ones (any number of
    rows; only their strides, dtype and device are used); ``key_cache``/``value_cache``: the layer's cache views;
    ``k_scale``/``v_scale``: its scales when the cache is fp8. With compile-ahead on (``compile_workers``, a GPU's)
    the steps are first recorded and their kernel variants compiled by worker processes side by side (``report``
    receives what ``compile_ahead`` reports), then run.
    """
    steps, buffers = _steps(attention, trees, query.device, key_cache)
    args = dict(query=query, key=key, value=value, key_cache=key_cache, value_cache=value_cache, output=output,
                k_scale=k_scale, v_scale=v_scale)
    workers = _workers_for(query.device)
    early = join_early()  # what ``warm_up_early`` started is in Triton's cache before anything is looked up
    if early is not None and report is not None:
        report["early"] = early
    with every_variant():  # also the variants other sizes of a step kind pick (the split merge's two)
        if workers:  # the steps recorded, the variants Triton's cache lacks compiled side by side, then for real
            with compile_ahead(workers, report=report):
                _run_steps(attention, steps, buffers, **args)
        return _run_steps(attention, steps, buffers, **args)


def warm_up_early(attention, *, trees: bool = False, **tensors) -> bool:
    """Start ``warm_up``'s compiles before the engine's warm-up, without waiting for them: its steps recorded now
    (compile-ahead) on tensors laid out as the engine's will be, a ``key_cache`` / ``value_cache`` of a few pages
    among them, and the variants Triton's cache lacks handed to worker processes that compile while the engine goes
    on (its profiling run, its KV-cache allocation). ``warm_up`` waits for them first, then looks every variant up
    and compiles only what they did not (a variant recorded on another layout than the engine's is compiled then,
    as without this). Runs what ``warm_up`` runs besides the attention kernels (the batches' length kernel), and
    the collectives at DCP > 1: every rank of the group must call it at the same point. False where compile-ahead
    is off (no GPU, ``DCP_TRITON_COMPILE_WORKERS=0``)."""
    query = tensors["query"]
    workers = _workers_for(query.device)
    if not workers:
        return False
    steps, buffers = _steps(attention, trees, query.device, tensors["key_cache"])
    args = dict(dict.fromkeys(("k_scale", "v_scale")), **tensors)
    with every_variant(), compile_ahead(workers, wait=False):
        _run_steps(attention, steps, buffers, **args)
    return True


def workers_ahead(device: torch.device) -> int:
    """Start compile-ahead's worker processes now, before any warm-up has work for them (an engine building its
    model): their start (Python, torch, Triton) then overlaps the engine's instead of delaying ``warm_up_early``'s
    compiles (``dcp_plugin.kernels.stand_by``; none where Triton's cache already holds what the last start
    compiled). Returns how many wait; 0 where compile-ahead is off, and where they could not start (said in one
    warning line: only a head start is lost)."""
    workers = _workers_for(device)
    try:
        return stand_by(workers) if workers else 0
    except Exception as error:
        _log.warning("dcp-triton: compile workers could not start ahead (%s: %s); they start when there is work",
                     type(error).__name__, error)
        return 0


def _steps(attention, trees: bool, device: torch.device, key_cache: torch.Tensor) -> tuple:
    """The warm-up's steps and the persistent buffers their batches are built into, as engines build theirs: on a
    GPU that runs (and compiles) the kernel that derives the per-request lengths (``kernels.batch_lengths``) too."""
    steps = steps_for(attention, trees=trees, fp8_copy=key_cache.dtype in FP8_DTYPES and fp8_copy_asked())
    return steps, DcpBatchBuffers(max(len(requests) for requests in steps), device)


def _workers_for(device: torch.device) -> int:
    """Compile-ahead's worker processes for a warm-up on ``device`` (0, off, but on a GPU)."""
    return compile_workers() if device.type == "cuda" else 0


def _run_steps(attention, steps, buffers, *, query, key, value, key_cache, value_cache, output, k_scale,
               v_scale) -> int:
    tokens, device = attention.tokens, query.device
    run = 0
    for requests in steps:
        num_tokens = sum(rows for rows, _ in requests)
        seq_lens = [rows + context for rows, context in requests]
        width = max(1, -(-tokens.max_local_len(max(seq_lens)) // tokens.block_size))
        with launches_run():  # the host reads what the batch's kernel derives
            batch = _build(requests, seq_lens, num_tokens, width, tokens, buffers, device,
                           tree=requests is TREE_VERIFY)
        q, k, v, out = (_like(t, num_tokens) for t in (query, key, value, output))
        attention.forward(q, k, v, key_cache, value_cache, batch, out=out, write_kv=True, k_scale=k_scale,
                          v_scale=v_scale)
        run += 1
    return run


def _build(requests, seq_lens, num_tokens, width, tokens, buffers, device, *, tree: bool) -> DcpBatch:
    rows = max(r for r, _ in requests)
    mask = torch.ones(len(requests), rows, rows, dtype=torch.bool, device=device).tril() if tree else None
    return DcpBatch.build(
        query_start_loc=torch.tensor([0, *_cumsum(rows for rows, _ in requests)], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=torch.zeros(len(requests), width, dtype=torch.int32, device=device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        tokens=tokens,
        buffers=buffers,
        chunk_mask=mask,
    )


def _like(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Zeros of ``rows`` rows with ``t``'s row layout (strides), dtype and device."""
    stride = t.stride()
    size = (rows, *t.shape[1:])
    storage = (rows - 1) * stride[0] + sum((n - 1) * s for n, s in zip(size[1:], stride[1:])) + 1
    return torch.zeros(storage, dtype=t.dtype, device=t.device).as_strided(size, stride)


def _cumsum(values) -> list[int]:
    total, out = 0, []
    for value in values:
        total += value
        out.append(total)
    return out
