"""Speculative-decoding verify steps under DCP equal float64 causal attention, on DCP = 1, 2, 4 gloo processes.

A verify step gives a request k + 1 query tokens (the last sampled token and k proposed ones) against its sharded
cached prefix; 0..k of the proposals are then accepted, so the next step's context grows by 1..k + 1 tokens. The
rejected positions' K/V are already in the cache: the next step writes its tokens over them. Here a rejected
position gets new random q/k/v (another token), so a step that read a stale cache entry fails the check.

Each case runs a first step (cached contexts with decodes, verify rows, fresh prompts and prefill chunks), then
several steps with random proposal and acceptance counts, drawn identically on every rank. Rows are ordered as vLLM
orders them: decodes and verify rows first (single-token rows before or after verify rows), prefill chunks last, so
mixed steps also run the leading single-token decodes in their own launch. Both head layouts, both comm modes,
interleave 1 and 16 (block size 16), reference kernels; a few small cases run the Triton kernels (interpreter).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import pytest
import torch

from dcp_plugin import DcpAttention
from tests.dcp_harness import Case, RankState, SerialOps, World, causal_attention_f64, resolve_ops
from tests.integration.dcp_procs import GROUP_KEY, OK, run_group
from tests.kernel_checks import assert_matches

GROUP_SIZES = (1, 2, 4)
GROUP_TIMEOUT_S = 300


@dataclass(frozen=True)
class VerifyCase(Case):
    """A ``Case`` whose requests keep a kind after the first step: ``decode`` (one token a step), ``spec`` (one
    token plus 0..k proposals, 0..proposals of them accepted) or ``prefill`` (a chunk of ``chunk`` tokens).
    ``quiet_steps``: steps where no request has proposals (plain decode rows); ``expect``: what the case must
    produce (the kinds of ``step_kinds``, and ``rejected``: rejected proposals that a later step wrote over)."""

    kinds: tuple[str, ...] = ()
    k: int = 4
    steps: int = 6
    chunk: int = 7
    quiet_steps: tuple[int, ...] = ()
    expect: tuple[str, ...] = ("verify", "rejected")


# (kind, cached context, first-step tokens) per request, in batch order; expected step kinds
MIXES = {
    "decodes-first": ((("decode", 70, 1), ("decode", 5, 1), ("spec", 129, 5), ("spec", 33, 3), ("prefill", 0, 11)),
                      dict(expect=("verify", "rejected", "decodes-first"))),
    "verify-first": ((("spec", 100, 5), ("decode", 17, 1), ("spec", 2, 2), ("prefill", 40, 9)), {}),
    "verify-only": ((("spec", 150, 8), ("spec", 64, 1), ("spec", 3, 6)),
                    dict(k=7, quiet_steps=(3,), expect=("verify", "rejected", "decode"))),
}


def head_layouts(n: int) -> dict[str, dict]:
    """vLLM's layout (tp = 2n, two KV heads, the second DCP group) and SGLang's with 12 Q / 3 KV heads."""
    return {"tp": dict(kv_replication="tp", tp=2 * n, group_index=1, q_heads=4 * n, kv_heads=2),
            "group": dict(kv_replication="group", q_heads=12, kv_heads=3)}


def verify_case(name: str, mix: str, seed: int, **fields) -> VerifyCase:
    rows, extra = MIXES[mix]
    case = VerifyCase(name=name, kinds=tuple(kind for kind, _, _ in rows), block_size=16, seed=seed,
                      requests=tuple((ctx, new) for _, ctx, new in rows), **{**extra, **fields})
    # The harness sizes every sequence for decode_steps more tokens: room for the most any step can add.
    return dataclasses.replace(case, decode_steps=case.steps * max(case.k + 1, case.chunk))


def cases(n: int) -> list[VerifyCase]:
    made = []
    for layout, heads in head_layouts(n).items():
        for comm in ("ag_rs", "a2a"):
            for interleave in (1, 16):
                for mix in MIXES:
                    made.append(verify_case(f"{layout}-{comm}-I{interleave}-{mix}", mix, seed=len(made) + 100 * n,
                                            comm=comm, interleave=interleave, **heads))
    # One small case on the Triton kernels under the interpreter (fp32/fp16: it computes bf16 products wrongly).
    mix, layout, steps = ("verify-only", "tp", 3) if n == 1 else ("decodes-first", "group", 2)
    made.append(verify_case(f"triton-{layout}-{mix}", mix, seed=7 * n, ops="triton", head_dim=32, steps=steps,
                            comm="a2a" if n == 2 else "ag_rs", interleave=16 if n == 2 else 1,
                            dtype="float16" if n == 2 else "float32", **head_layouts(n)[layout]))
    return made


def step_kinds(case: VerifyCase, batch, new_tokens: list[int]) -> set[str]:
    """What a step covered: ``verify`` (a request with proposals over a cached prefix), ``decodes-first`` (a verify
    step whose leading single-token rows run in their own launch), ``decode`` (one token per request)."""
    contexts = batch.context_lens.tolist()
    verify = any(kind == "spec" and t > 1 and c > 0 for kind, t, c in zip(case.kinds, new_tokens, contexts))
    kinds = {"verify"} if verify else set()
    if verify and 0 < batch.num_decodes < batch.num_reqs:
        kinds.add("decodes-first")
    if batch.max_query_len == 1:
        kinds.add("decode")
    return kinds


def redraw(world: World, case: VerifyCase, request: int, positions: range, seed: int) -> None:
    """New q/k/v at ``positions`` of one request (the token sampled there is another one), the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    for tensors in (world.queries, world.keys, world.values):
        fresh = torch.randn((len(positions), *tensors[request].shape[1:]), generator=gen, dtype=torch.float64)
        tensors[request][positions.start:positions.stop] = fresh.to(dtype).to(torch.float64)


def next_step(case: VerifyCase, step: int, rng: random.Random) -> list[int]:
    """Tokens of each request in step ``step`` (> 0)."""
    tokens = []
    for kind in case.kinds:
        proposals = 0 if step in case.quiet_steps else rng.choice([0, case.k, rng.randint(1, case.k)])
        tokens.append({"decode": 1, "prefill": case.chunk, "spec": 1 + proposals}[kind])
    return tokens


def run_verify_case(case: VerifyCase, n: int, rank: int, group, gather_heads) -> int:
    """Every step of ``case`` on this rank, each checked against float64 attention over the accepted tokens."""
    world = World(case)
    state = RankState.create(case, world, n, rank)
    heads = state.heads
    attn = DcpAttention(heads=heads, tokens=state.tokens, group=group, scale=world.scale, comm=case.comm,
                        ops=SerialOps(resolve_ops(case.ops)))
    group_heads = range(heads.group_q_head_start, heads.group_q_head_start + heads.num_group_q_heads)
    rng = random.Random(case.seed)  # identical draws on every rank
    new_tokens, seen = [new for _, new in case.requests], set()
    for step in range(case.steps + 1):
        if step:
            new_tokens = next_step(case, step, rng)
        q, k, v, batch, positions = state.step(new_tokens)
        seen |= step_kinds(case, batch, new_tokens)
        out = torch.full(q.shape, float("nan"), dtype=q.dtype)
        attn.forward(q, k, v, state.key_cache, state.value_cache, batch, out=out)
        want = torch.cat([causal_attention_f64(world, b, p, group_heads) for b, p in enumerate(positions)])
        assert_matches(gather_heads(out), want, q.dtype, f"{case.name} (N={n}) step {step} tokens {new_tokens}")
        for b, kind in enumerate(case.kinds):
            if kind != "spec" or new_tokens[b] == 1:
                continue
            kept = 1 + rng.randint(0, new_tokens[b] - 1)  # the accepted proposals and the first token
            if kept < new_tokens[b]:
                state.lens[b] -= new_tokens[b] - kept
                redraw(world, case, b, range(state.lens[b], state.lens[b] + new_tokens[b] - kept),
                       rng.randrange(1 << 30))
                if step < case.steps:  # a later step writes over the stale entries
                    seen.add("rejected")
    missing = set(case.expect) - seen
    assert not missing, f"{case.name}: the schedule produced no step of kind {sorted(missing)} (seen {sorted(seen)})"
    state.check_cache()
    return case.steps + 1


_RESULTS: dict[int, dict[str, str]] = {}


@pytest.fixture(scope="module")
def group_results(tmp_path_factory):
    def results(n: int) -> dict[str, str]:
        if n not in _RESULTS:
            _RESULTS[n] = run_group(n, cases(n), tmp_path_factory.mktemp(f"spec{n}"), timeout_s=GROUP_TIMEOUT_S,
                                    runner=run_verify_case)
        return _RESULTS[n]

    return results


@pytest.mark.parametrize("n, name", [(n, c.name) for n in GROUP_SIZES for c in cases(n)],
                         ids=[f"N{n}-{c.name}" for n in GROUP_SIZES for c in cases(n)])
def test_verify_steps_match_single_rank_attention(group_results, n, name):
    results = group_results(n)
    if name not in results:
        pytest.fail(f"case {name} did not run:\n{results.get(GROUP_KEY, 'no verdict and no group error')}")
    assert results[name] == OK, results[name]


@pytest.mark.parametrize("n", GROUP_SIZES, ids=[f"N{n}" for n in GROUP_SIZES])
def test_process_group_ran_cleanly(group_results, n):
    results = group_results(n)
    assert GROUP_KEY not in results, results[GROUP_KEY]
