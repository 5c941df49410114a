"""After ``warm_up``, no step a serving engine sends compiles a kernel: decodes of any batch and context, speculative
verify steps, chunked prefills over a cached prefix, fresh prompts, mixed steps, at DCP = 1 and DCP = 2 (two
ranks as threads on one GPU), both comm modes, with the kernels compiled at their first launch or ahead by worker
processes (into an empty Triton cache: nothing compiles in this process after them, also when ptxas moved); every
step is also checked against float64 attention."""

from __future__ import annotations

import contextlib
import random
import threading

import pytest
import torch
import triton
import triton.runtime.build

from dcp_plugin import DcpAttention, DcpWorkspace, kernels, warmup
from dcp_plugin.kernels._gluon import GLUON_DECODE_MIN_KV_GROUP, PREFIX_PAGE
from dcp_plugin.kernels.merge import merge_kernel
from dcp_plugin.kernels.chunk_attention import chunk_attention_kernel
from dcp_plugin.kernels.prefix_attention import prefix_attention_kernel, split_merge_kernel
from dcp_plugin.kernels.write_kv_cache import write_kv_cache_kernel
from dcp_plugin.warmup import warm_up
from dcp_plugin.testing import Case, RankState, World
from tests.helpers.dcp_harness import ThreadGroup, run_threads, serial
from tests.helpers.kernel_checks import assert_matches, gluon_kernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

KERNELS = (write_kv_cache_kernel, chunk_attention_kernel, prefix_attention_kernel, split_merge_kernel,
           merge_kernel) + gluon_kernels()  # the Gluon ones where they serve (sm_90, Triton 3.6)
# (cached context, new tokens) of the first step: long decodes, speculative verify rows, a chunk over a prefix, a
# fresh prompt, a one-token prompt, contexts shorter than the group; then single-token decode steps.
REQUESTS = ((3000, 1), (1, 1), (1900, 5), (700, 3), (2048, 200), (0, 150), (0, 1), (2, 2), (5000, 1))


def compiled_counts() -> list[int]:
    return [len(k.device_caches[torch.cuda.current_device()][0]) for k in KERNELS]


def reached(kernel, block_size: int, group: int = 4) -> bool:
    """Whether steps of head size 128, bf16, K and V contiguous, ``group`` local Q heads per KV head run ``kernel``:
    where the Gluon kernels serve, they take every current chunk from the ``tl`` one, the Gluon prefix pass reads
    64-token pages only, and the Gluon decode those with groups of more than ``GLUON_DECODE_MIN_KV_GROUP``."""
    gluon = gluon_kernels()
    if not gluon:
        return True
    if kernel is chunk_attention_kernel:
        return False
    if kernel is gluon[2]:
        return block_size == PREFIX_PAGE and group > GLUON_DECODE_MIN_KV_GROUP
    return kernel is not gluon[1] or block_size == PREFIX_PAGE


def steps(seed: int) -> list[list[int]]:
    """The new tokens per request of each step after the first: mixes of decodes, verify rows, chunks."""
    rng = random.Random(seed)
    shapes = [[1] * len(REQUESTS), [rng.choice([2, 3, 5]) for _ in REQUESTS], [1] * len(REQUESTS)]
    shapes.append([rng.choice([1, 1, 4, 33]) for _ in REQUESTS])  # a mixed step
    return shapes


@pytest.mark.parametrize("block_size", [16, 64])  # 64: what the vLLM backend asks for on sm_90+ (descriptor tiles)
@pytest.mark.parametrize("workers", [0, 4], ids=["serial", "compile-ahead"])
@pytest.mark.parametrize("comm", ["ag_rs", "a2a"])
@pytest.mark.parametrize("n", [1, 2])
def test_no_kernel_compiles_after_warm_up(n, comm, workers, block_size, monkeypatch, tmp_path):
    no_compiles_after_warm_up(n, comm, workers, block_size, monkeypatch, tmp_path)


def test_compile_ahead_keys_its_variants_as_this_process_does_when_ptxas_moved(monkeypatch, tmp_path):
    """As torch.compile (inductor) may inside an engine: ``TRITON_PTXAS_PATH`` points at another ptxas after this
    process's Triton has read (and cached) the first one's version, which keys its compiles. A worker, a new
    process, would read the other; compile-ahead must still land every variant where this process looks."""
    from triton.backends.nvidia.compiler import get_ptxas, get_ptxas_version

    get_ptxas_version(90)  # read and cached here, as the engine's first compile does
    other = tmp_path / "ptxas"
    other.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo "Cuda compilation tools, release 12.8, V12.8.93"; '
                     f'exit 0; fi\nexec {get_ptxas(90).path} "$@"\n')
    other.chmod(0o755)
    monkeypatch.setenv("TRITON_PTXAS_PATH", str(other))
    monkeypatch.setenv("TRITON_PTXAS_BLACKWELL_PATH", str(other))
    (tmp_path / "cache").mkdir()
    no_compiles_after_warm_up(1, "ag_rs", 4, 64, monkeypatch, tmp_path / "cache")


def test_a_warm_up_started_early_on_two_pages_leaves_the_warm_up_nothing_to_compile(monkeypatch, tmp_path):
    """``warm_up_early`` over the cache's first two pages (an engine's profiling run, before its cache exists), then
    ``warm_up`` over the whole cache, into an empty Triton cache: the warm-up finds every variant the early workers
    compiled, nothing compiles in this process after them, and serving steps compile nothing."""
    no_compiles_after_warm_up(1, "ag_rs", 4, 64, monkeypatch, tmp_path, early=True)


def no_compiles_after_warm_up(n, comm, workers, block_size, monkeypatch, cache_dir, early: bool = False) -> None:
    monkeypatch.setenv("DCP_TRITON_COMPILE_WORKERS", str(workers))
    built = {"recording": [], "after": []}  # compiled or a launcher built in this process: while recording / after
    if workers:  # into an empty Triton cache, from nothing compiled in this process: the workers compile it all
        monkeypatch.setenv("TRITON_CACHE_DIR", str(cache_dir))
        for kernel in KERNELS:
            kernel.device_caches[torch.cuda.current_device()][0].clear()
        watch_builds(monkeypatch, built)
    case = Case(name=f"warm-{n}-{comm}", q_heads=32, kv_heads=8, kv_replication="replicated", tp=4 * n if n > 1 else 1,
                head_dim=128, block_size=block_size, requests=REQUESTS, comm=comm, dtype="bfloat16",
                kernel_impl="triton", seed=5,
                decode_steps=40,  # room in every sequence for the steps below (at most 40 more tokens each)
                device="cuda")
    world = World(case)

    def rank_fn(rank, exchange):
        state = RankState.create(case, world, n, rank)
        # An engine's block table is as wide as its longest sequence allows, whatever the warm-up used: make this
        # one's row stride a multiple of 16 (a class of its own for an integer Triton specializes on).
        width = state.block_table.shape[1]
        state.block_table = torch.nn.functional.pad(state.block_table, (0, 16 - width % 16 + 16), value=0)
        group = ThreadGroup(exchange, rank) if n > 1 else None
        ws = DcpWorkspace(heads=state.heads, head_dim=128, dtype=torch.bfloat16, device="cuda", max_num_tokens=512,
                          comm=comm, split_elements=kernels.split_capacity(128, torch.device("cuda")))
        attn = serial(DcpAttention(heads=state.heads, tokens=state.tokens, group=group, scale=world.scale, comm=comm,
                                   workspace=ws))
        like = torch.zeros(4, state.heads.num_q_heads, 128, dtype=torch.bfloat16, device="cuda")
        kv_like = torch.zeros(4, state.heads.num_kv_heads, 128, dtype=torch.bfloat16, device="cuda")
        report = {}
        if early:  # the variants recorded on two pages of the cache, their workers left compiling
            assert warmup.warm_up_early(attn, query=like, key=kv_like, value=kv_like, key_cache=state.key_cache[:2],
                                        value_cache=state.value_cache[:2], output=like)
        warm_up(attn, query=like, key=kv_like, value=kv_like, key_cache=state.key_cache,
                value_cache=state.value_cache, output=like, report=report)
        if early:
            started = report["early"]
            assert started["failed"] == 0 and started["compiled"] == started["missing"] >= 5, report
            assert report["missing"] == 0, report  # the warm-up's own look-up found every one
        elif workers:  # into an empty cache: the workers compiled (ranks as threads may share the variants)
            assert report["failed"] == 0 and report["compiled"] == report["missing"] >= 1, report
            assert report["workers"] == min(workers, report["missing"]), report
            if n == 1:
                assert report["missing"] == report["variants"] >= 5, report
        exchange.barrier.wait()
        before = compiled_counts()
        group_heads = range(state.heads.group_q_head_start,
                            state.heads.group_q_head_start + state.heads.num_group_q_heads)
        for step, new_tokens in enumerate([[new for _, new in REQUESTS]] + steps(7)):
            q, k, v, batch, positions = state.step(new_tokens)
            out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
            attn.forward(q, k, v, state.key_cache, state.value_cache, batch, out=out)
            got = group.all_gather(out, dim=1) if group else out
            want = torch.cat([world.causal_attention_f64(b, p, group_heads) for b, p in enumerate(positions)])
            assert_matches(got, want, torch.bfloat16, f"N={n} {comm} step {step}")
        state.check_cache()
        return before, compiled_counts()

    for before, after in run_threads(n, rank_fn, timeout_s=600):
        served = [count for kernel, count in zip(KERNELS, before) if reached(kernel, block_size)]
        assert min(served) >= 1, f"a kernel these steps run never compiled during warm-up: {before}"
        assert after == before, f"serving steps compiled new variants: {before} -> {after}"
    assert built["after"] == [], f"compiled in the engine's process after the workers: {built['after']}"
    # while recording, only the kernel whose output the host reads (launches_run) compiles here
    assert set(built["recording"]) <= {"batch_lengths_kernel"}, built["recording"]


def watch_builds(monkeypatch, built: dict) -> None:
    """Record in ``built`` every kernel variant Triton compiles in this process rather than finds in its cache, and
    every launcher (C module) it builds: under ``recording`` while a thread's compile-ahead records, under ``after``
    once it has ended (the warm-up's real pass, the steps)."""
    recording, ahead_done = set(), set()
    real = warmup.compile_ahead

    @contextlib.contextmanager
    def marked(*args, **kwargs):
        recording.add(threading.get_ident())
        with real(*args, **kwargs):
            yield
        recording.discard(threading.get_ident())
        ahead_done.add(threading.get_ident())

    def phase():
        me = threading.get_ident()
        return "after" if me in ahead_done else "recording" if me in recording else None

    def listener(*, src, cache_hit, **kwargs):
        if phase() and not cache_hit:
            built[phase()].append(getattr(getattr(src, "fn", None), "__name__", repr(src)))

    build = triton.runtime.build._build

    def counted_build(name, *args, **kwargs):
        if phase() == "after":  # while recording, the batch lengths kernel's launcher may build
            built["after"].append(f"launcher {name}")
        return build(name, *args, **kwargs)

    monkeypatch.setattr(warmup, "compile_ahead", marked)
    monkeypatch.setattr(triton.knobs.compilation, "listener", listener)
    monkeypatch.setattr(triton.runtime.build, "_build", counted_build)


def _one_rank_steps(case: Case, max_num_tokens: int, steps: list, heads: range) -> tuple[int, list[int]]:
    """Warm one rank's ``DcpAttention`` up, then run ``steps`` (new tokens per request) through it, each checked
    against float64 attention of ``heads``: the warm-up's step count and the compiled counts before the steps
    (asserted unchanged after)."""
    world = World(case)
    state = RankState.create(case, world, 1, 0)
    d = case.head_dim
    ws = DcpWorkspace(heads=state.heads, head_dim=d, dtype=torch.bfloat16, device="cuda",
                      max_num_tokens=max_num_tokens, comm="ag_rs", split_elements=kernels.split_capacity(
                          d, torch.device("cuda")))
    attn = serial(DcpAttention(heads=state.heads, tokens=state.tokens, group=None, scale=world.scale, workspace=ws))
    like = torch.zeros(4, state.heads.num_q_heads, d, dtype=torch.bfloat16, device="cuda")
    kv_like = torch.zeros(4, state.heads.num_kv_heads, d, dtype=torch.bfloat16, device="cuda")
    warmed = warm_up(attn, query=like, key=kv_like, value=kv_like, key_cache=state.key_cache,
                     value_cache=state.value_cache, output=like)
    before = compiled_counts()
    for step, new_tokens in enumerate(steps):
        q, k, v, batch, positions = state.step(new_tokens)
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
        attn.forward(q, k, v, state.key_cache, state.value_cache, batch, out=out)
        want = torch.cat([world.causal_attention_f64(b, p, heads) for b, p in enumerate(positions)])
        assert_matches(out, want, torch.bfloat16, f"step {step}")
    assert compiled_counts() == before, f"serving steps compiled new variants: {before} -> {compiled_counts()}"
    return warmed, before


def test_a_chunk_past_short_chunk_rows_compiles_nothing_after_warm_up():
    """A workspace that holds more than SHORT_CHUNK tokens: the warm-up compiles the current chunk's larger tiles
    too, so a 3,000-token prompt beside a 1,000-token one (each chunk's tiles) compiles nothing when it comes."""
    from dcp_plugin.kernels.chunk_attention import SHORT_CHUNK
    from dcp_plugin.warmup import STEPS

    case = Case(name="warm-long-chunk", q_heads=32, kv_heads=8, head_dim=128, block_size=64,
                requests=((0, SHORT_CHUNK + 952), (0, 1000)), dtype="bfloat16", kernel_impl="triton", seed=6,
                decode_steps=1, device="cuda")
    warmed, _ = _one_rank_steps(case, 4096, [[new for _, new in case.requests], [1, 1]], range(32))
    assert warmed == len(STEPS) + 1


def test_one_kv_head_compiles_nothing_after_warm_up():
    """32 Q heads over one KV head in 64-token pages: where the Gluon decode serves, decodes of one split and of
    several, alone and after a mixed step's chunk, compile nothing after the warm-up."""
    case = Case(name="warm-one-kv-head", q_heads=32, kv_heads=1, head_dim=128, block_size=64, requests=REQUESTS,
                dtype="bfloat16", kernel_impl="triton", seed=8, decode_steps=40, device="cuda")
    _, before = _one_rank_steps(case, 512, [[new for _, new in REQUESTS]] + steps(9), range(32))
    served = [count for kernel, count in zip(KERNELS, before) if reached(kernel, 64, group=32)]
    assert min(served) >= 1, f"a kernel these steps run never compiled during warm-up: {before}"


def test_draft_tree_verify_steps_compile_nothing_after_a_warm_up_for_trees():
    """An engine that verifies draft trees warms up with ``trees=True``: its verify steps (the current chunk under
    the batch's chunk_mask, beside decodes and chunks) then compile nothing."""
    from tests.helpers.verify_steps import next_step, step_masks, verify_case

    case = verify_case("warm-trees", "decodes-first", seed=4, head_dim=128, dtype="bfloat16", kernel_impl="triton",
                       device="cuda", trees=True, q_heads=32, kv_heads=8, kv_replication="replicated")
    world, rng = World(case), random.Random(5)
    state = RankState.create(case, world, 1, 0)
    ws = DcpWorkspace(heads=state.heads, head_dim=128, dtype=torch.bfloat16, device="cuda", max_num_tokens=512,
                      comm="ag_rs", split_elements=kernels.split_capacity(128, torch.device("cuda")))
    attn = serial(DcpAttention(heads=state.heads, tokens=state.tokens, group=None, scale=world.scale, workspace=ws))
    like = torch.zeros(4, 32, 128, dtype=torch.bfloat16, device="cuda")
    kv_like = torch.zeros(4, 8, 128, dtype=torch.bfloat16, device="cuda")
    warm_up(attn, query=like, key=kv_like, value=kv_like, key_cache=state.key_cache, value_cache=state.value_cache,
            output=like, trees=True)
    before = compiled_counts()
    new_tokens = [new for _, new in case.requests]
    for step in range(4):
        if step:
            new_tokens = next_step(case, step, rng)
        chunk_mask, trees = step_masks(case, new_tokens, [1] * len(new_tokens), rng)
        q, k, v, batch, positions = state.step(new_tokens, chunk_mask)
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
        attn.forward(q, k, v, state.key_cache, state.value_cache, batch, out=out)
        want = torch.cat([world.causal_attention_f64(b, p, range(32)) if t is None
                          else world.tree_attention_f64(b, p, t, range(32))
                          for b, (p, t) in enumerate(zip(positions, trees))])
        assert_matches(out, want, torch.bfloat16, f"step {step}")
    assert compiled_counts() == before, f"tree verify steps compiled new variants: {before} -> {compiled_counts()}"
