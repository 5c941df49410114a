"""Speculative verify steps on SGLang's objects (``tests.helpers.sglang_checks``): SGLang's ``TARGET_VERIFY`` batches as
its EAGLE and n-gram workers build them, checked against float64 attention.

A verify step gives every request ``d`` draft tokens in the slots ``req_to_token[req, seq_len:seq_len + d]``
(allocated past the committed tokens, as SGLang over-allocates a window), with ``seq_lens`` the committed lengths and
the drafts' tree in ``spec_info.custom_mask``: in SGLang's ``QLEN_ONLY`` layout written into the backend's own
``verify_mask`` buffer (EAGLE's worker does that), or in the ``FULL_MASK`` layout with the prefix's columns (the
n-gram worker on a GPU). Each request then accepts a random branch: a chain's first drafts, or the path from a
tree's root to a random node; SGLang moves an accepted tree branch's K/V to the window's leading slots with the
call its worker makes (``token_to_kv_pool_allocator.get_kvcache().move_kv_cache(tgt, src)``, widened slot ids; on
CPU its worker's index kernels need sgl-kernel, so the ids are computed here as they do). The sequences follow: the
accepted drafts become the next tokens, the rest are drawn anew as other tokens, which the next window writes.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from tests.helpers.kernel_checks import assert_matches
from tests.helpers.verify_steps import draft_tree, redraw

# SgCase.speculative -> (SGLang's arguments beyond the draft model and draft-token count, trees, mask layout)
SPECULATION = {
    "eagle-chain": (["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
                     "--speculative-eagle-topk", "1"], False, "qlen"),
    "eagle-tree": (["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
                    "--speculative-eagle-topk", "4"], True, "qlen"),
    "ngram-full": (["--speculative-algorithm", "NGRAM"], True, "full"),
    "ngram-qlen": (["--speculative-algorithm", "NGRAM"], True, "qlen"),
}


def argv(case) -> list[str]:
    """SGLang's speculative arguments of ``case`` (none without ``speculative``)."""
    if not case.speculative:
        return []
    extra, _, _ = SPECULATION[case.speculative]
    draft = [] if "NGRAM" in extra else ["--speculative-draft-model-path", _draft_model_dir()]
    return [*extra, *draft, "--speculative-num-draft-tokens", str(case.draft_tokens)]


def _draft_model_dir() -> str:
    from tests.helpers.sglang_checks import config_argv

    return config_argv(1)[1]  # a config-only Llama: SGLang resolves the draft's arguments from its config


def run_verify_steps(state, gather_heads, group_heads) -> int:
    """The case's verify steps on ``state`` (an ``SglangRank``), each layer checked; returns how many ran."""
    case = state.case
    if not case.speculative:
        return 0
    _, trees, layout = SPECULATION[case.speculative]
    rng = random.Random(case.seed * 7919 + state.n)  # identical draws on every rank
    for step in range(case.verify_steps):
        fb, positions, masks = verify_batch(state, trees=trees, layout=layout, rng=rng)
        state.attn.init_forward_metadata(fb)
        outs = state.forward(fb, positions)
        want = torch.cat([state.world.causal_attention_f64(b, p, group_heads) if mask is None
                          else state.world.tree_attention_f64(b, p, mask, group_heads)
                          for (b, p), mask in zip(positions.items(), masks)])
        for layer, out in zip(state.layers, outs):
            assert_matches(gather_heads(out), want, out.dtype,
                           f"{case.name} (N={state.n}) verify step {step} layer {layer.layer_id}")
        commit(state, positions, [accepted_path(mask, case.draft_tokens, rng) for mask in masks], fb.out_cache_loc,
               rng)
    return case.verify_steps


def verify_batch(state, *, trees: bool, layout: str, rng: random.Random):
    """SGLang's ``TARGET_VERIFY`` batch of ``state.case.draft_tokens`` drafts per request, its window slots
    allocated: ``(ForwardBatch, positions per request, each request's tree or None)``."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    case, d = state.case, state.case.draft_tokens
    reqs = list(range(len(case.requests)))
    lens = [state.lens[b] for b in reqs]
    state.reserve({b: lens[b] + d for b in reqs})
    masks = [draft_tree(d, rng.randint(1, d), rng) if trees else None for b in reqs]
    tree = torch.stack([m if m is not None else torch.ones(d, d, dtype=torch.bool).tril() for m in masks])
    out_cache_loc = torch.tensor([s for b in reqs for s in state.slots[b][lens[b]:lens[b] + d]], dtype=torch.int64)
    seq_lens = torch.tensor(lens)
    depth = tree.sum(-1) - 1  # a draft's ancestors: its position past the committed tokens
    spec_info = _spec_info(state, case, tree, seq_lens, layout, depth)
    fb = ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=len(reqs),
                      input_ids=torch.zeros(len(reqs) * d, dtype=torch.int64),
                      req_pool_indices=torch.tensor(reqs, dtype=torch.int64), seq_lens=seq_lens,
                      out_cache_loc=out_cache_loc, seq_lens_sum=int(seq_lens.sum()),
                      seq_lens_cpu=seq_lens if case.host_lengths else None,
                      positions=(seq_lens[:, None] + depth).flatten(), spec_info=spec_info)
    positions = {b: torch.arange(lens[b], lens[b] + d) for b in reqs}  # KV indices: where each draft is stored
    return fb, positions, masks


def _spec_info(state, case, tree: torch.Tensor, seq_lens: torch.Tensor, layout: str, depth: torch.Tensor):
    """The step's ``spec_info`` as SGLang's worker builds it: EAGLE's writes the trees into the backend's
    ``verify_mask`` buffer, n-gram's builds its own mask (``FULL_MASK`` on a GPU, ``QLEN_ONLY`` on CPU)."""
    bs, d = tree.shape[:2]
    if case.speculative.startswith("eagle"):
        from sglang.srt.speculative.eagle_info import EagleVerifyInput

        buffer = state.attn.verify_mask.buffer
        buffer[:bs * d * d] = tree.flatten()
        values = dict(custom_mask=buffer, positions=(seq_lens[:, None] + depth).flatten(), spec_steps=3,
                      topk=4 if "tree" in case.speculative else 1, draft_token_num=d, seq_lens_cpu=seq_lens,
                      seq_lens_sum=int(seq_lens.sum()), draft_token=torch.zeros(bs * d, dtype=torch.int64))
        return EagleVerifyInput(**{f.name: values.get(f.name) for f in dataclasses.fields(EagleVerifyInput)
                                   if f.init and (f.name in values or f.default is dataclasses.MISSING)})
    from sglang.srt.speculative.ngram_info import NgramVerifyInput

    if layout == "full":
        mask = torch.cat([torch.cat([torch.ones(d, int(n), dtype=torch.bool), t], dim=1).flatten()
                          for n, t in zip(seq_lens, tree)])
    else:
        mask = tree.flatten().clone()
    return NgramVerifyInput(custom_mask=mask, draft_token_num=d,
                            positions=(seq_lens[:, None] + depth).flatten())


def accepted_path(tree: torch.Tensor | None, d: int, rng: random.Random) -> list[int]:
    """The drafts a request accepts, in order: a chain's first ones, or the path from a tree's root to a random node
    (its ancestors and itself)."""
    if tree is None:
        return list(range(rng.randint(1, d)))
    return tree[rng.randrange(d)].nonzero().flatten().tolist()


def commit(state, positions: dict[int, torch.Tensor], paths: list[list[int]], out_cache_loc: torch.Tensor,
           rng: random.Random) -> None:
    """Accept each request's ``paths[b]``: a path that is not the window's first drafts moves their K/V into the
    leading slots as SGLang does; the sequences then hold the accepted drafts next, other tokens after them."""
    d = state.case.draft_tokens
    window = out_cache_loc.view(len(positions), d)
    moved = [(b, m, node) for b, path in zip(positions, paths) for m, node in enumerate(path) if m != node]
    if moved:
        tgt = torch.tensor([int(window[b, m]) for b, m, _ in moved])
        src = torch.tensor([int(window[b, node]) for b, _, node in moved])
        state.allocator.get_kvcache().move_kv_cache(tgt, src)
    world = state.world
    for (b, p), path in zip(positions.items(), paths):
        first = int(p[0])
        for tensors in (world.queries, world.keys, world.values):
            tensors[b][first:first + len(path)] = tensors[b][[first + node for node in path]].clone()
        state.lens[b] = first + len(path)
        rejected = range(state.lens[b], int(p[-1]) + 1)
        if len(rejected):
            redraw(world, state.case, b, rejected, rng.randrange(1 << 30))
