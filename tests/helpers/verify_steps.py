"""Speculative-decoding verify steps under DCP, shared by the gloo test (tests/integration/test_spec_verify.py)
and the single-GPU simulation (tests/gpu/test_dcp_sim_gpu.py).

A verify step gives a request k + 1 query tokens (the last sampled token and k proposed ones) against its sharded
cached prefix; 0..k of the proposals are then accepted, so the next step's context grows by 1..k + 1 tokens. The
rejected positions' K/V are already in the cache: the next step writes its tokens over them. Here a rejected
position gets new random q/k/v (another token), so a step that read a stale cache entry fails the check.

With ``trees`` a request's proposals form a tree instead of a chain (EAGLE with several candidates per step, n-gram
speculation): a proposal sees its ancestors only, which the step's ``chunk_mask`` says, and the accepted ones are
those of one branch. The tree's first branch is the leading proposals in order (the rest hang anywhere), so what is
accepted already lies in the leading positions, as an engine's move of the accepted tokens leaves it.

A case runs a first step (cached contexts with decodes, verify rows, fresh prompts and prefill chunks), then
several steps with random proposal and acceptance counts, drawn identically on every rank. Rows are ordered as vLLM
orders them: decodes and verify rows first (single-token rows before or after verify rows), prefill chunks last, so
mixed steps also run the leading single-token decodes in their own launch.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch

from dcp_plugin import DcpAttention
from dcp_plugin.testing import Case, RankState, World
from tests.helpers.dcp_harness import serial
from tests.helpers.kernel_checks import assert_matches


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
    trees: bool = False


# (kind, cached context, first-step tokens) per request, in batch order; expected step kinds
MIXES = {
    "decodes-first": ((("decode", 70, 1), ("decode", 5, 1), ("spec", 129, 5), ("spec", 33, 3), ("prefill", 0, 11)),
                      dict(expect=("verify", "rejected", "decodes-first"))),
    "verify-first": ((("spec", 100, 5), ("decode", 17, 1), ("spec", 2, 2), ("prefill", 40, 9)), {}),
    "verify-only": ((("spec", 150, 8), ("spec", 64, 1), ("spec", 3, 6)),
                    dict(k=7, quiet_steps=(3,), expect=("verify", "rejected", "decode"))),
}


# Longer contexts for the GPU: several KV splits per request, verify rows over thousands of cached tokens.
GPU_MIXES = {
    "long": ((("decode", 5000, 1), ("spec", 4100, 5), ("decode", 1, 1), ("spec", 2047, 3), ("prefill", 3000, 64)),
             dict(chunk=64, expect=("verify", "rejected", "decodes-first"))),
}


def head_layouts(n: int) -> dict[str, dict]:
    """vLLM's layout (tp = 2n, two KV heads, the second DCP group) and SGLang's with 12 Q / 3 KV heads."""
    return {"tp": dict(kv_replication="tp", tp=2 * n, group_index=1, q_heads=4 * n, kv_heads=2),
            "replicated": dict(kv_replication="replicated", q_heads=12, kv_heads=3)}


def verify_case(name: str, mix: str, seed: int, **fields) -> VerifyCase:
    rows, extra = {**MIXES, **GPU_MIXES}[mix]
    case = VerifyCase(name=name, kinds=tuple(kind for kind, _, _ in rows), block_size=16, seed=seed,
                      requests=tuple((ctx, new) for _, ctx, new in rows), **{**extra, **fields})
    # The harness sizes every sequence for decode_steps more tokens: room for the most any step can add.
    return dataclasses.replace(case, decode_steps=case.steps * max(case.k + 1, case.chunk))


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


def draft_tree(size: int, branch: int, rng: random.Random) -> torch.Tensor:
    """``[size, size]`` bool: which of a verify step's ``size`` tokens each sees (its ancestors and itself) in a
    random tree whose nodes ``0..branch - 1`` form its first branch, every other node's parent an earlier node."""
    seen = torch.zeros(size, size, dtype=torch.bool)
    for node in range(size):
        seen[node, node] = True
        if node:
            parent = node - 1 if node < branch else rng.randrange(node)
            seen[node] |= seen[parent]
    return seen


def step_masks(case: VerifyCase, new_tokens: list[int], kept: list[int], rng: random.Random):
    """A step's ``chunk_mask`` (``[requests, M, M]``) and each request's tree (``None``: causal), for ``trees``
    cases; ``(None, [None] * requests)`` otherwise. ``kept[b]``: request ``b``'s accepted tokens (its first branch)."""
    if not case.trees:
        return None, [None] * len(new_tokens)
    size = max(new_tokens)
    mask = torch.ones(len(new_tokens), size, size, dtype=torch.bool).tril()
    trees = []
    for b, (kind, t) in enumerate(zip(case.kinds, new_tokens)):
        tree = draft_tree(t, kept[b], rng) if kind == "spec" and t > 1 else None
        if tree is not None:
            mask[b, :t, :t] = tree
        trees.append(tree)
    return mask, trees


def run_verify_case(case: VerifyCase, n: int, rank: int, group, gather_heads) -> int:
    """Every step of ``case`` on this rank, each checked against float64 attention over the accepted tokens."""
    world = World(case)
    state = RankState.create(case, world, n, rank)
    heads = state.heads
    attn = serial(DcpAttention(heads=heads, tokens=state.tokens, group=group, scale=world.scale, comm=case.comm,
                               kernel_impl=case.kernel_impl))
    group_heads = range(heads.group_q_head_start, heads.group_q_head_start + heads.num_group_q_heads)
    rng = random.Random(case.seed)  # identical draws on every rank
    new_tokens, seen = [new for _, new in case.requests], set()
    for step in range(case.steps + 1):
        if step:
            new_tokens = next_step(case, step, rng)
        # The accepted proposals and the first token of each request (drawn before the step: a tree's first branch)
        accepted = [1 + rng.randint(0, t - 1) if kind == "spec" and t > 1 else t
                    for kind, t in zip(case.kinds, new_tokens)]
        chunk_mask, trees = step_masks(case, new_tokens, accepted, rng)
        q, k, v, batch, positions = state.step(new_tokens, chunk_mask)
        seen |= step_kinds(case, batch, new_tokens) | ({"tree"} if any(t is not None for t in trees) else set())
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
        attn.forward(q, k, v, state.key_cache, state.value_cache, batch, out=out)
        want = torch.cat([world.causal_attention_f64(b, p, group_heads) if tree is None
                          else world.tree_attention_f64(b, p, tree, group_heads)
                          for b, (p, tree) in enumerate(zip(positions, trees))])
        assert_matches(gather_heads(out), want, q.dtype, f"{case.name} (N={n}) step {step} tokens {new_tokens}")
        for b, kind in enumerate(case.kinds):
            if kind != "spec" or new_tokens[b] == 1:
                continue
            kept = accepted[b]
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
