"""Which DCP sizes a model runs at a TP size in each engine, and what each buys: the table of `dcp-triton plan`.

The engines lay out KV heads two ways (``dcp_plugin.layout.HeadLayout``): ``"tp"``, each rank stores the KV heads
tensor parallelism gives it (vLLM; SGLang's models except Qwen3.5 from 0.5.23), so a DCP group must share one KV
head; ``"replicated"``, a DCP group's ranks all store the KV heads of the group's Q heads (SGLang 0.5.23's Qwen3.5,
whose KV projection is split over tp / dcp ranks). Importing this module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from dcp_plugin.capacity import DTYPE_BYTES, ModelShape

ENGINES = {"vllm": "vLLM", "sglang": "SGLang"}
DCP_FLAGS = {"vllm": "--decode-context-parallel-size", "sglang": "--dcp-size"}
# SGLang architectures whose attention replicates KV heads inside the DCP group (SGLang 0.5.23).
SGLANG_REPLICATED_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")


def tp_refusal(*, num_q_heads: int, num_kv_heads: int, tp_size: int, engine: str = "vllm") -> str | None:
    """Why ``engine`` cannot split these heads over ``tp_size`` ranks, with the sizes that work; None when it can.
    Each rank holds whole KV heads (one KV head may sit on several ranks) and the same number of Q heads."""
    divisors = [d for d in range(1, num_q_heads + 1) if num_q_heads % d == 0]
    if num_q_heads % num_kv_heads:
        return f"{num_q_heads} Q heads are not a multiple of {num_kv_heads} KV heads"
    if num_q_heads % tp_size:
        return f"it must divide the {num_q_heads} Q heads; use one of {divisors}"
    if tp_size % num_kv_heads if tp_size >= num_kv_heads else num_kv_heads % tp_size:
        good = [t for t in divisors if t % num_kv_heads == 0 or num_kv_heads % t == 0]
        return (f"{ENGINES[engine]} gives each rank whole KV heads, so it must divide the {num_kv_heads} KV heads or "
                f"be a multiple of them; use one of {good}")
    return None


def dcp_refusal(*, num_q_heads: int, num_kv_heads: int, tp_size: int, dcp_size: int,
                kv_layout: str = "tp") -> str | None:
    """Why ``dcp_size`` does not run for these heads at ``tp_size`` under ``kv_layout``, in the flags' words; None
    when it runs. DCP groups are consecutive TP ranks. ``"tp"``: the group must share one KV head (vLLM's engine
    check, and dcp-triton's); ``"replicated"``: SGLang splits the KV heads over tp / dcp ranks, whose count must
    divide them or be a multiple of them."""
    if tp_size % dcp_size:
        return f"does not divide tp {tp_size}"
    if dcp_size == 1:
        return None
    if kv_layout == "replicated":
        kv_tp = tp_size // dcp_size
        if num_kv_heads % kv_tp and kv_tp % num_kv_heads:
            return (f"SGLang splits the {num_kv_heads} KV heads over tp / dcp = {kv_tp} ranks, a count that neither "
                    "divides them nor is a multiple of them")
        return None
    if tp_size <= num_kv_heads:
        return (f"tp {tp_size} is not more than the {num_kv_heads} KV heads: every rank already stores KV heads of "
                "its own, so there is no duplicate to remove")
    if (tp_size // num_kv_heads) % dcp_size:
        return (f"tp / KV heads = {tp_size // num_kv_heads} ranks share each KV head, which is not a multiple of "
                f"{dcp_size}")
    if (num_q_heads // num_kv_heads) % dcp_size:
        return f"Q heads per KV head = {num_q_heads // num_kv_heads}, which is not a multiple of {dcp_size}"
    return None


def kv_heads_per_rank(model: ModelShape, *, tp_size: int, dcp_size: int, kv_layout: str = "tp") -> int:
    """KV heads one rank stores: TP's split, or under ``"replicated"`` the split over tp / dcp ranks (SGLang's
    ``get_num_kv_heads(tp, dcp)``)."""
    split = tp_size // dcp_size if kv_layout == "replicated" else tp_size
    return max(1, model.num_kv_heads // split)


@dataclass(frozen=True, slots=True, kw_only=True)
class DcpOption:
    """One DCP size at a fixed TP size (every rank alike)."""

    dcp_size: int
    kv_heads_per_rank: int  # KV heads each rank stores
    prefix_q_heads: int  # Q heads each rank attends to its KV shard with (its own, gathered over the DCP group)
    kv_bytes_per_token: float  # K + V bytes, all KV layers, that one context token costs a rank on average
    capacity: float  # KV tokens held relative to dcp_size=1
    max_context_tokens: int | None  # KV tokens (all requests together) a per-rank budget holds; None without one


def compare_dcp_sizes(model: ModelShape, *, tp_size: int, kv_budget_gib: float | None = None,
                      kv_layout: str = "tp") -> tuple[list[DcpOption], dict[int, str]]:
    """Every DCP size that divides ``tp_size``: the ones that run, compared, and the others with the reason."""
    if kv_layout not in ("tp", "replicated"):
        raise ValueError(f"kv_layout must be 'tp' or 'replicated', got {kv_layout!r}")
    per_head_token = 2 * model.head_dim * DTYPE_BYTES[model.dtype] * model.num_layers
    base = kv_heads_per_rank(model, tp_size=tp_size, dcp_size=1) * per_head_token
    options, refused = [], {}
    for dcp in (d for d in range(1, tp_size + 1) if tp_size % d == 0):
        reason = dcp_refusal(num_q_heads=model.num_q_heads, num_kv_heads=model.num_kv_heads, tp_size=tp_size,
                             dcp_size=dcp, kv_layout=kv_layout)
        if reason is not None:
            refused[dcp] = reason
            continue
        heads = kv_heads_per_rank(model, tp_size=tp_size, dcp_size=dcp, kv_layout=kv_layout)
        per_token = heads * per_head_token / dcp
        options.append(DcpOption(
            dcp_size=dcp, kv_heads_per_rank=heads, prefix_q_heads=model.num_q_heads // tp_size * dcp,
            kv_bytes_per_token=per_token, capacity=base / per_token,
            max_context_tokens=None if kv_budget_gib is None else int(kv_budget_gib * 2**30 // per_token)))
    return options, refused


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _legend(engine: str, kv_layout: str) -> tuple[str, ...]:
    heads = ("KV heads/rank: KV heads each rank stores (split over tp / dcp ranks, so a DCP group's ranks all store "
             "the KV heads of the group's Q heads: SGLang 0.5.23's Qwen3.5; 0.5.17 and other models split them by "
             "TP, --kv-layout tp)" if kv_layout == "replicated" else
             f"KV heads/rank: KV heads each rank stores ({ENGINES[engine]}'s tensor-parallel split; DCP does not "
             "change it)")
    return (
        f"dcp: ranks that split each request's KV cache along tokens ({DCP_FLAGS[engine]})",
        heads,
        "prefix Q heads: query heads each rank attends its KV shard with (its own, all-gathered over the DCP group)",
        "KV B/token: K + V bytes over all KV layers that one token of context costs a rank (it stores 1/dcp of them)",
        "capacity: KV tokens the cache holds, relative to dcp 1",
        "max tokens: KV tokens (all requests together) that --kv-budget-gib per rank holds",
        "per layer: what each step adds at dcp > 1 (a Q all-gather and an LSE merge over the DCP group)",
    )


def _model_notes(model: ModelShape, *, tp_size: int, engine: str) -> list[str]:
    """What the table leaves out: a hybrid model's per-request state, the MTP draft's cache."""
    notes = []
    if model.linear_layers:
        notes.append(f"hybrid model: {model.num_layers} of {model.num_layers + model.linear_layers} layers hold a KV "
                     f"cache (the table); the other {model.linear_layers} (linear attention or Mamba) keep a "
                     "per-request state that DCP does not shard: the same on every rank at every DCP size")
    if model.draft_layers and engine == "sglang":
        heads = max(1, model.num_kv_heads // tp_size)
        per_token = heads * 2 * model.head_dim * DTYPE_BYTES[model.dtype] * model.draft_layers
        notes.append(f"MTP draft ({_count(model.draft_layers, 'layer')}): SGLang runs it at DCP 1 with a KV cache of "
                     f"its own, not sharded: {_count(heads, 'KV head')} and {per_token:,} B/token per rank at every "
                     "DCP size")
    elif model.draft_layers:
        notes.append(f"MTP draft ({_count(model.draft_layers, 'layer')}): vLLM shards its KV cache over the same DCP "
                     f"group, like {_count(model.draft_layers, 'more KV layer')} of the table")
    return notes


def format_comparison(model: ModelShape, options: list[DcpOption], refused: dict[int, str], *, tp_size: int,
                      chosen: int | None = None, kv_budget_gib: float | None = None, engine: str = "vllm",
                      kv_layout: str = "tp") -> str:
    ceiling = max(1.0, tp_size / model.num_kv_heads)
    layers = f"{model.num_layers} KV layers" if model.linear_layers else f"{model.num_layers} layers"
    stored = ("per rank, KV heads split over tp / dcp ranks (replicated inside each DCP group)"
              if kv_layout == "replicated" else f"and {_count(options[0].kv_heads_per_rank, 'KV head')} per rank")
    lines = [f"model: {model.num_q_heads} Q heads, {_count(model.num_kv_heads, 'KV head')}, head_dim "
             f"{model.head_dim}, {layers}, {model.dtype} KV cache",
             f"{ENGINES[engine]} at tp {tp_size}: {_count(model.num_q_heads // tp_size, 'Q head')} {stored}; DCP can "
             f"gain at most max(1, tp / KV heads) = {ceiling:g}x KV capacity", ""]
    budget = "-" if kv_budget_gib is None else f"{kv_budget_gib:g} GiB"
    rows = [("", "dcp", "KV heads/rank", "prefix Q heads", "KV B/token", "capacity", f"max tokens ({budget})",
             "per layer")]
    for o in options:
        rows.append(("*" if o.dcp_size == chosen else "", str(o.dcp_size), str(o.kv_heads_per_rank),
                     str(o.prefix_q_heads), f"{o.kv_bytes_per_token:,.0f}", f"{o.capacity:g}x",
                     "-" if o.max_context_tokens is None else f"{o.max_context_tokens:,}",
                     "Q all-gather + LSE merge" if o.dcp_size > 1 else "no collectives"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(w) if i == len(widths) - 1 else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in rows]
    notes = []
    if all(o.capacity <= 1 + 1e-9 for o in options):
        notes.append(f"DCP buys nothing at tp {tp_size} for this model: run it without {DCP_FLAGS[engine]}.")
    by_reason: dict[str, list[int]] = {}
    for dcp, reason in refused.items():
        by_reason.setdefault(reason, []).append(dcp)
    notes += [f"dcp {', '.join(map(str, sizes))}: not runnable ({reason})" for reason, sizes in by_reason.items()]
    notes += _model_notes(model, tp_size=tp_size, engine=engine)
    lines += ["", *notes] if notes else []
    lines += ["", "legend:", *(f"  {line}" for line in _legend(engine, kv_layout))]
    return "\n".join(lines)
