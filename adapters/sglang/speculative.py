"""Speculative decoding in SGLang with dcp-triton: what a run speculates with, and the target's verify-mask buffer.

SGLang's speculative workers (EAGLE, EAGLE3, NEXTN/MTP, STANDALONE: a draft model; NGRAM: no draft) give the target
``TARGET_VERIFY`` steps of ``d`` draft tokens per request over the committed prefix (``metadata.StepBuilder``): the
current chunk under the draft tree, the prefix pass over the sharded cache, exactly as any other step. A draft model
runs at DCP = 1 over a KV pool that SGLang replicates on every rank (``draft.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

SUPPORTED_ALGORITHMS = ("EAGLE", "EAGLE3", "STANDALONE", "NGRAM")  # NEXTN resolves to EAGLE


@dataclass(frozen=True, slots=True)
class Speculation:
    """A model runner's speculative setting (SGLang's resolved server arguments): ``algorithm`` (None: off),
    ``draft_tokens`` per verify step and request, ``trees`` whether proposals form trees (EAGLE's ``topk > 1``,
    n-gram) rather than chains."""

    algorithm: str | None = None
    draft_tokens: int = 0
    trees: bool = False

    @property
    def verifies(self) -> bool:
        return self.algorithm is not None and self.draft_tokens > 0


def from_runner(model_runner) -> Speculation:
    """The runner's ``Speculation``; a draft runner verifies nothing."""
    from dcp_plugin.adapters.sglang import compat

    algorithm = compat.resolved_server_arg(model_runner, "speculative_algorithm")
    if algorithm is None or model_runner.is_draft_worker:
        return Speculation()
    algorithm = str(getattr(algorithm, "name", algorithm)).upper()
    topk = compat.resolved_server_arg(model_runner, "speculative_eagle_topk") or 1
    tokens = compat.resolved_server_arg(model_runner, "speculative_num_draft_tokens") or 0
    if compat.resolved_server_arg(model_runner, "speculative_adaptive"):  # this candidate's count (compat)
        tokens = compat.runtime_spec_arg("speculative_num_draft_tokens", tokens) or 0
    return Speculation(algorithm=algorithm, draft_tokens=tokens, trees=algorithm == "NGRAM" or topk > 1)


PLAN_STREAM_ENV = "SGLANG_ENABLE_OVERLAP_PLAN_STREAM"


def problems(speculation: Speculation) -> list[str]:
    """Each speculative setting dcp-triton does not run, as ``"<option>: <why>; supported: <what>"``."""
    if speculation.algorithm is None:
        return []
    if speculation.algorithm not in SUPPORTED_ALGORITHMS:
        return [f"--speculative-algorithm {speculation.algorithm}: not supported by dcp-triton; supported: "
                f"{', '.join(SUPPORTED_ALGORITHMS)} (and NEXTN)"]
    if os.environ.get(PLAN_STREAM_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return [f"{PLAN_STREAM_ENV}=1: SGLang would build a step's attention metadata on a stream of its own, while "
                "dcp-triton refreshes its graph buffers on the forward stream; supported: 0 (SGLang's default)"]
    return []


class VerifyTrees:
    """The target's draft-tree buffer, ``[max_bs, d, d]`` bool, handed to SGLang's EAGLE worker as the backend's
    ``verify_mask`` in SGLang's ``QLEN_ONLY`` layout: the worker writes each verify step's trees into it (no
    prefix columns, which DCP never reads: every draft token sees the whole cached prefix), and a verify step's
    CUDA graph reads it at a fixed address. A batch past ``max_bs`` gets a mask of its own from the worker, in the
    same layout."""

    def __init__(self, draft_tokens: int, max_bs: int, device) -> None:
        self.buffer = torch.ones(max_bs, draft_tokens, draft_tokens, dtype=torch.bool, device=device).tril()
        self.verify_mask = _verify_mask(self.buffer)

    def grown(self, max_bs: int) -> VerifyTrees:
        """This buffer, or a larger one for ``max_bs`` requests (SGLang's CUDA-graph batch sizes)."""
        if max_bs <= self.buffer.shape[0]:
            return self
        return VerifyTrees(self.buffer.shape[1], max_bs, self.buffer.device)


def _verify_mask(buffer: torch.Tensor):
    from sglang.srt.layers.attention.verify_mask import VerifyMask
    from sglang.srt.speculative.eagle_utils import TreeMaskMode

    return VerifyMask(buffer=buffer.view(-1), mode=TreeMaskMode.QLEN_ONLY, max_bs=buffer.shape[0], is_read=True)
